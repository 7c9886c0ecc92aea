"""OPUS-MT's tokenizer, as transformers' MarianTokenizer reads it: a sentencepiece model for each
side and the Marian vocabulary that maps their pieces to the model's ids (pretrained.md §1.6).

    source.spm, target.spm   the two sentencepiece models (their own ids are not the model's)
    vocab.json               piece -> id, the model's (joint) vocabulary, <pad> included
    target_vocab.json        piece -> id of the target side, when the vocabularies are separate

`</s>`, `<unk>` and `<pad>` are the tokens the tokenizer config names, their ids read from the
vocabulary, never assumed (tc-big vocabularies have `</s>` far from 0). The model has no `<s>`:
the decoder starts from `<pad>` (model.decoder_start=pad). A source line that starts with a
language code (`>>fra<<`, what a multi-target model reads first) keeps it as one token, the rest
is cut into pieces, as MarianTokenizer does; so are the special tokens typed in a line.

Inside a tmt model the tokenizer travels as one byte string (model_bytes, what a checkpoint keeps
as its tokenizer): a header line, a JSON line naming the files and the special tokens, then the
files' bytes. Reading it back checks every part, so a damaged one is one line, not a crash.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import sentencepiece as spm

from transformer_mt.common import languages
from transformer_mt.common.exits import TmtError

# Term hints' tags (hints.py), which both kinds of tokenizer know: user-defined symbols of a
# tokenizer trained with data.terms (special tokens of a fine-tuned Marian one), read in
# sources, never written in an output.
HINT_TAGS = ("<t>", "</t>", "<tr>", "</tr>")
MAGIC = b"tmt-marian-tokenizer 1\n"
SOURCE_SPM, TARGET_SPM = "source.spm", "target.spm"
VOCAB, TARGET_VOCAB = "vocab.json", "target_vocab.json"
FILES = (SOURCE_SPM, TARGET_SPM, VOCAB, TARGET_VOCAB)
_WORD_START = "\u2581"
# transformers' clean_up_tokenization, applied when the tokenizer config asks for it.
_CLEAN_UP = [(" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
             (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")]  # fmt: skip
# The settings a tokenizer config gives, with MarianTokenizer's defaults.
DEFAULTS: dict[str, Any] = {
    "eos_token": "</s>",
    "unk_token": "<unk>",
    "pad_token": "<pad>",
    "additional_special_tokens": [],
    "separate_vocabs": False,
    "clean_up_tokenization_spaces": False,
    # transformers 5 saves the special tokens with fixed ids (tokenizer_config.json's
    # added_tokens_decoder), which the source side's encoding takes over the vocabulary's.
    "added_token_ids": {},
    # The decoder's </s> and <pad> (its start and the id it never writes) where the model's
    # config names other ids than the target vocabulary's own (a tc-big checkpoint with separate
    # vocabularies: transformers' converter writes the source side's, and generate decodes with
    # them): {"eos": id, "pad": id}; empty for the vocabulary's own (and not packed then).
    "decoder_ids": {},
}


def is_marian(data: bytes) -> bool:
    """Whether `data` is a tokenizer of this kind (else a joint sentencepiece model)."""
    return data.startswith(MAGIC)


def pack(files: Mapping[str, bytes], settings: Mapping[str, Any]) -> bytes:
    """The one byte string of a tokenizer's files and settings: the same input, the same bytes."""
    names = [name for name in FILES if name in files]
    chosen = {key: settings.get(key, value) for key, value in DEFAULTS.items()}
    if not chosen["decoder_ids"]:  # the tokenizers of earlier tmt, byte for byte
        del chosen["decoder_ids"]
    header = {"files": [[name, len(files[name])] for name in names], "settings": chosen}
    return (
        MAGIC
        + json.dumps(header, sort_keys=True).encode()
        + b"\n"
        + b"".join(files[name] for name in names)
    )


def unpack(data: bytes, origin: str) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The files and settings of pack(...), checked: every length, the JSON, the settings."""
    bad = f"{origin}: damaged Marian tokenizer"
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC) : end].decode()) if end > 0 else None
    except (UnicodeDecodeError, ValueError, RecursionError):
        header = None
    listed = header.get("files") if isinstance(header, dict) else None
    settings = header.get("settings") if isinstance(header, dict) else None
    if not isinstance(listed, list) or not isinstance(settings, dict):
        raise TmtError(f"{bad} (no file list)")
    files, at = {}, end + 1
    for entry in listed:
        if not (isinstance(entry, list) and len(entry) == 2 and entry[0] in FILES
                and isinstance(entry[1], int) and 0 <= entry[1] <= len(data) - at):  # fmt: skip
            raise TmtError(f"{bad} (file list)")
        files[entry[0]] = data[at : at + entry[1]]
        at += entry[1]
    if at != len(data) or not {SOURCE_SPM, TARGET_SPM, VOCAB} <= set(files):
        raise TmtError(f"{bad} (its files do not add up)")
    return files, {key: settings.get(key, value) for key, value in DEFAULTS.items()}


class MarianTokenizer:
    """Two sentencepiece models and the vocabulary of their pieces: encode a source line as
    MarianTokenizer does, decode a target as its batch_decode(skip_special_tokens=True)."""

    kind = "marian"
    model_type = "marian"  # no BPE-dropout: data.subword_alpha refuses it by this name
    bos_id = -1  # none: the decoder starts from <pad>

    def __init__(self, model_bytes: bytes, origin: str = "tokenizer") -> None:
        self.model_bytes = bytes(model_bytes)
        self.files, self.settings = unpack(self.model_bytes, origin)
        self.sha256 = hashlib.sha256(self.model_bytes).hexdigest()
        self._spm = {
            "source": load_processor(self.files[SOURCE_SPM], f"{origin} {SOURCE_SPM}"),
            "target": load_processor(self.files[TARGET_SPM], f"{origin} {TARGET_SPM}"),
        }
        separate = bool(self.settings["separate_vocabs"])
        if separate and TARGET_VOCAB not in self.files:
            raise TmtError(f"{origin}: separate_vocabs without {TARGET_VOCAB}")
        source = _vocabulary(self.files[VOCAB], f"{origin} {VOCAB}")
        target = (
            _vocabulary(self.files[TARGET_VOCAB], f"{origin} {TARGET_VOCAB}")
            if separate
            else source
        )
        self._ids = {"source": source, "target": target}
        self._pieces = {side: _by_id(ids) for side, ids in self._ids.items()}
        special = {name: self._special(name, origin) for name in ("eos", "unk", "pad")}
        # The target side's ids (what decoding emits and stops on, what config.json names); the
        # source side's may differ with separate vocabularies (generate reads the encoder's input
        # as the tokenizer encodes it: with the source vocabulary's </s> and padding).
        self.eos_id, self.unk_id, self.pad_id = (
            special[n]["target"] for n in ("eos", "unk", "pad")
        )
        self.source_eos_id, self.source_unk_id, self.source_pad_id = (
            special[n]["source"] for n in ("eos", "unk", "pad"))  # fmt: skip
        decoder = self.settings["decoder_ids"]
        if decoder:  # the config's ids on the decoder's side (DEFAULTS says when)
            size = len(self._pieces["target"])
            if not (isinstance(decoder, dict) and set(decoder) <= {"eos", "pad"} and all(
                    isinstance(v, int) and 0 <= v < size for v in decoder.values())):  # fmt: skip
                raise TmtError(f"{origin}: damaged Marian tokenizer (decoder ids {decoder!r})")
            self.eos_id = decoder.get("eos", self.eos_id)
            self.pad_id = decoder.get("pad", self.pad_id)
        self.vocab_size = len(self._pieces["target"])
        self.source_vocab_size = len(self._pieces["source"])
        self.special_tokens = [self.settings[f"{n}_token"] for n in ("eos", "unk", "pad")] + [
            str(t) for t in self.settings["additional_special_tokens"]
        ]
        # A special token typed in a line is one token, as transformers' trie splits it out.
        self._split = re.compile("(" + "|".join(map(re.escape, sorted(
            set(self.special_tokens), key=len, reverse=True))) + ")")  # fmt: skip
        # Multi-target models read one of these first (tokenized whole, as any >>xxx<<).
        self.language_codes = tuple(
            p for p in self._ids["source"] if p.startswith(">>") and p.endswith("<<")
        )

    def _special(self, name: str, origin: str) -> dict[str, int]:
        """The id of a special token on each side ("source", "target")."""
        token = self.settings[f"{name}_token"]
        if not isinstance(token, str):
            raise TmtError(f"{origin}: the {name} token is {token!r}, not a string")
        found = {side: ids.get(token) for side, ids in self._ids.items()}
        added = self.settings.get("added_token_ids") or {}
        if isinstance(added.get(token), int):  # transformers encodes it with this id
            found["source"] = added[token]
        for side, token_id in found.items():
            if token_id is None:
                where = VOCAB if side == "source" else TARGET_VOCAB
                raise TmtError(f"{origin}: the {name} token {token!r} is not in {where}")
        return found  # type: ignore[return-value]

    # --- ids ----------------------------------------------------------------------------------

    def start_id(self, start: str) -> int:
        """The decoder's first input for model.decoder_start: only <pad>, there is no <s>."""
        if start != "pad":
            raise TmtError("a Marian tokenizer has no <s>: the decoder starts from <pad>"
                           " (model.decoder_start=pad)")  # fmt: skip
        return self.pad_id

    @property
    def never_output(self) -> tuple[int, ...]:
        """Ids a search never emits: <pad> (generate's bad_words_ids of OPUS-MT models), and
        term hints' tags where fine-tuning added them (special tokens of the target side)."""
        tags = [self._ids["target"][t] for t in HINT_TAGS if t in self.special_tokens
                and t in self._ids["target"]]  # fmt: skip
        return (self.pad_id, *tags)

    def pieces(self, side: str = "target") -> list[str]:
        return list(self._pieces[side])

    def id_to_piece(self, token: int, side: str = "target") -> str:
        pieces = self._pieces[side]
        return pieces[token] if 0 <= token < len(pieces) else self.settings["unk_token"]

    def piece_to_id(self, piece: str, side: str = "target") -> int:
        return self._ids[side].get(piece, self.source_unk_id if side == "source" else self.unk_id)

    def with_symbols(self, symbols: Sequence[str]) -> MarianTokenizer:
        """This tokenizer with `symbols` it lacks as new source tokens (ids after the last, in
        vocab.json: the target's too when the vocabulary is joint) and special tokens, so that
        each is one token wherever it is typed, as transformers' added tokens are."""
        new = [s for s in dict.fromkeys(symbols) if s not in self._ids["source"]]
        if not new:
            return self
        vocab = dict(self._ids["source"])
        vocab.update({symbol: len(vocab) + i for i, symbol in enumerate(new)})
        files = dict(self.files)
        files[VOCAB] = json.dumps(vocab, ensure_ascii=False, indent=2).encode()
        special = [*self.settings["additional_special_tokens"], *new]
        settings = self.settings | {"additional_special_tokens": special}
        return MarianTokenizer(pack(files, settings), "tokenizer")

    def tag_ids(self, tag: str) -> list[int] | None:
        """A corpus tag is one token when it is in the vocabulary (a language code, >>fra<<; a
        language code in another form, >>fr<<, is the model's token of that language)."""
        token = self._ids["source"].get(tag)
        if token is None and tag.startswith(">>") and tag.endswith("<<"):
            token = self._code_id(tag)
        return None if token is None else [token]

    def _code_id(self, code: str) -> int | None:
        """The id of the model's one >>xxx<< token of the language `code` names (>>de<< finds
        >>deu<<), None when it has none or several."""
        found = [c for c in self.language_codes if languages.same_language(c[2:-2], code[2:-2])]
        return self._ids["source"][found[0]] if len(found) == 1 else None

    # --- text ---------------------------------------------------------------------------------

    def encode(self, texts: Sequence[str], side: str = "source") -> list[list[int]]:
        """Ids of each text, without </s>: its special tokens and a leading language code kept
        whole, the rest cut by that side's sentencepiece model and looked up in the vocabulary
        (an unknown piece is <unk>), as MarianTokenizer tokenizes."""
        processor, ids = self._spm[side], self._ids[side]
        unk = self.source_unk_id if side == "source" else self.unk_id
        special = set(self.special_tokens)
        out = []
        fixed = self.settings.get("added_token_ids") or {} if side == "source" else {}
        for text in texts:
            tokens: list[str] = []
            for part in self._split.split(text):
                if part in special:
                    tokens.append(part)
                elif part:
                    code, rest = _language_code(part)
                    tokens += code + processor.encode(rest, out_type=str)
            out.append([fixed.get(token) if token in fixed else ids.get(token, unk)
                        for token in tokens])  # fmt: skip
        return out

    def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Text of each target id sequence as MarianTokenizer.batch_decode(skip_special_tokens=
        True) writes it: the ids of the special tokens dropped (<unk> too: their ids as the
        tokenizer reads them, the source side's), a special token the target side still holds
        at another id written as it is, the rest by the target's sentencepiece model."""
        skip = {self.piece_to_id(t, "source") for t in self.special_tokens}
        if not self.settings["decoder_ids"]:  # one place for each special: the target's own
            skip = {self.piece_to_id(t) for t in self.special_tokens}
        special = set(self.special_tokens)
        processor, clean = self._spm["target"], self.settings["clean_up_tokenization_spaces"]
        texts = []
        for seq in ids:
            text, pieces = "", []
            for piece in (self.id_to_piece(int(t)) for t in seq if int(t) not in skip):
                if piece in special:  # transformers writes it between sentencepiece's runs
                    text += processor.decode_pieces(pieces) + piece + " "
                    pieces = []
                else:
                    pieces.append(piece)
            text = (text + processor.decode_pieces(pieces)).replace(_WORD_START, " ").strip()
            for old, new in _CLEAN_UP if clean else ():
                text = text.replace(old, new)
            texts.append(text)
        return texts

    def spm_bytes(self, side: str) -> bytes:
        return self.files[SOURCE_SPM if side == "source" else TARGET_SPM]

    def __getstate__(self) -> dict[str, object]:  # datasets.map's workers: the bytes only
        return {"model_bytes": self.model_bytes}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(state["model_bytes"])  # type: ignore[misc, arg-type]


def _language_code(text: str) -> tuple[list[str], str]:
    """A leading >>xxx<< and the rest (MarianTokenizer.remove_language_code)."""
    end = text.find("<<") if text.startswith(">>") else -1
    return ([text[: end + 2]], text[end + 2 :]) if end != -1 else ([], text)


def _vocabulary(data: bytes, origin: str) -> dict[str, int]:
    """A vocabulary file: a JSON object of piece -> id, the ids distinct and from 0."""
    try:
        vocab = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise TmtError(f"{origin}: not a JSON vocabulary ({str(err)[:120]})") from None
    if not isinstance(vocab, dict) or not vocab:
        raise TmtError(f"{origin}: expected a JSON object of piece: id")
    ids = list(vocab.values())
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TmtError(f"{origin}: every id must be an integer")
    if sorted(ids) != list(range(len(ids))):
        raise TmtError(f"{origin}: its ids must be 0 to {len(ids) - 1}, each once")
    return vocab


def _by_id(ids: Mapping[str, int]) -> list[str]:
    pieces = [""] * len(ids)
    for piece, token in ids.items():
        pieces[token] = piece
    return pieces


def load_processor(data: bytes, origin: str) -> spm.SentencePieceProcessor:
    """A sentencepiece model loaded from its bytes, or one line naming `origin`."""
    loaded = spm.SentencePieceProcessor()
    try:
        loaded.LoadFromSerializedProto(data)
    except (RuntimeError, TypeError) as err:
        raise TmtError(f"{origin}: not a sentencepiece model ({err})") from None
    return loaded
