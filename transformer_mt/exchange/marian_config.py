"""What a MarianMTModel directory's JSON files say, as tmt settings (`tmt import`):

    config.json             the shape, the activation, the special ids, the vocabulary sizes
    generation_config.json  how generate decodes (else the generation keys of config.json)
    tokenizer_config.json   the languages, the special tokens, separate vocabularies

Every field is read with its type and range checked (foreign.py): a value of the wrong type is
one line naming the file and the key, never a traceback. What generate does that tmt does not
reproduce is named in import.json ("not_reproduced") and in a warning, never dropped in silence.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformer_mt.common import files
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, config_from_dict
from transformer_mt.data import marian_tokenizer
from transformer_mt.exchange import foreign, huggingface
from transformer_mt.exchange.foreign import Fields

logger = logging.getLogger(__name__)

ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu": "gelu"}
# generate's defaults (transformers.GenerationConfig) for what a directory does not say.
GENERATE_DEFAULTS = {"num_beams": 1, "max_length": 20, "length_penalty": 1.0,
                     "early_stopping": False}  # fmt: skip
# Settings of generate that tmt's decoding does not have, with the value that means "off".
NOT_REPRODUCED = {
    "min_length": 0, "min_new_tokens": None, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "repetition_penalty": 1.0, "do_sample": False,
    "renormalize_logits": False, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "num_beam_groups": 1, "diversity_penalty": 0.0,
    "exponential_decay_length_penalty": None, "num_return_sequences": 1,
}  # fmt: skip
# What generate reads of config.json when the directory has no generation_config.json.
_GENERATION_KEYS = {*GENERATE_DEFAULTS, *NOT_REPRODUCED, "max_new_tokens", "forced_eos_token_id",
                    "eos_token_id", "bad_words_ids"}  # fmt: skip
# The fine-tuning recipe of an imported model (README "Start from a published model").
FINE_TUNING = {
    "optim": {"schedule": "budget", "warmup_steps": 200, "decay_fraction": 0.2},
    "train": {"max_steps": 2000, "valid_every": 200, "save_every": 200, "save_every_minutes": 0,
              "keep_last": 5, "average_last": 5, "bleu_every": 200, "best_metric": "val_bleu",
              "patience": 3},
}  # fmt: skip
PEAK_LR = 5e-5  # the recipe's peak learning rate: optim.lr_scale is set to reach it


def read(path: Path, missing_ok: bool = False) -> Fields:
    """A JSON object of the directory (empty when `missing_ok` and the file is not there)."""
    if missing_ok and not path.exists() and not path.is_symlink():
        return Fields({}, str(path))
    try:
        return foreign.read(path)
    except TmtError as err:
        if "no such file" in str(err):
            raise TmtError(f"{path}: no such file (a MarianMTModel directory has it)") from None
        raise


def check_architecture(source: Path, hf: Fields) -> None:
    """Refuse, in one line, what is not a Transformer MarianMTModel that tmt's model computes."""
    where = source / "config.json"
    kind = hf.text("model_type", "")
    architectures = hf.strings("architectures", ["MarianMTModel"]) or ["MarianMTModel"]
    if kind != "marian" or "MarianMTModel" not in architectures:
        named = f"model_type {kind!r}" + (f" ({', '.join(architectures)})"
                                           if "architectures" in hf else "")  # fmt: skip
        raise TmtError(
            f"{where}: {named} is not a MarianMTModel; tmt imports Marian (OPUS-MT) translation"
            " models"
        )
    for key, wanted, what in (
        ("normalize_before", False, "pre-norm layers"),
        ("normalize_embedding", False, "a layer norm of the embeddings"),
        ("add_final_layer_norm", False, "final layer norms"),
        ("scale_embedding", True, "embeddings not scaled by √d_model"),
        ("tie_word_embeddings", True, "an output projection apart from the target embedding"),
    ):
        if hf.boolean(key, wanted) != wanted:
            raise TmtError(f"{where}: {key}={hf.raw(key)} ({what}): not a Marian model tmt reads")
    hf.choice("activation_function", "gelu", tuple(ACTIVATIONS))
    for side in ("attention_heads", "ffn_dim"):
        encoder, decoder = hf.integer(f"encoder_{side}", minimum=1), hf.integer(
            f"decoder_{side}", minimum=1)  # fmt: skip
        if encoder != decoder:
            raise TmtError(f"{where}: encoder_{side}={encoder} and decoder_{side}={decoder};"
                           " tmt's two stacks have one size")  # fmt: skip


def read_tokenizer(source: Path) -> marian_tokenizer.MarianTokenizer:
    """The directory's tokenizer files and settings, as one tmt tokenizer."""
    settings = read(source / "tokenizer_config.json", missing_ok=True)
    chosen: dict[str, Any] = {}
    for key, default in marian_tokenizer.DEFAULTS.items():
        if key == "added_token_ids":
            chosen[key] = _added_ids(settings)
        elif key == "decoder_ids":  # tmt's, from the model's config (decoder_side)
            continue
        elif key == "additional_special_tokens":
            value = settings.raw(key) or []
            if not isinstance(value, list):
                raise TmtError(f"{settings.where}: {key}: expected a list of tokens")
            chosen[key] = [_token(settings, key, v) for v in value]
        elif isinstance(default, bool):
            chosen[key] = settings.boolean(key, default)
        else:
            chosen[key] = _token(settings, key, settings.raw(key, default) or default)
    wanted = [marian_tokenizer.SOURCE_SPM, marian_tokenizer.TARGET_SPM, marian_tokenizer.VOCAB]
    if chosen["separate_vocabs"]:
        wanted.append(marian_tokenizer.TARGET_VOCAB)
    content = {}
    for name in wanted:
        try:
            content[name] = files.read_plain(source / name, limit=1 << 28, follow_links=True)
        except FileNotFoundError:
            exported = (source / "tmt_export.json").is_file() and (
                source / "tokenizer.json"
            ).exists()
            raise TmtError(
                f"{source / name}: no such file (Marian's tokenizer: source.spm, target.spm,"
                " vocab.json, and target_vocab.json with separate_vocabs)"
                + ("; this is tmt's export of its own model: use that model" if exported else "")
            ) from None
        except OSError as err:
            raise TmtError(f"{source / name}: cannot read ({err.strerror or err})") from None
    return marian_tokenizer.MarianTokenizer(
        marian_tokenizer.pack(content, chosen), origin=str(source)
    )


def _added_ids(settings: Fields) -> dict[str, int]:
    """The ids transformers 5 fixes for the special tokens (added_tokens_decoder: id -> token)."""
    found = settings.mapping("added_tokens_decoder", {})
    ids = {}
    for key, token in found.items():
        content = token.get("content") if isinstance(token, dict) else token
        if not (isinstance(key, str) and key.isdigit() and isinstance(content, str)):
            raise TmtError(f"{settings.where}: added_tokens_decoder: expected id: token")
        ids[content] = int(key)
    return ids


def _token(settings: Fields, key: str, value: Any) -> str:
    """A special token: a string, or an AddedToken as JSON ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise TmtError(f"{settings.where}: {key}: expected a token (a string)")
    return value


def tmt_config(
    source: Path,
    hf: Fields,
    tokenizer: marian_tokenizer.MarianTokenizer,
    src_lang: str | None,
    tgt_lang: str | None,
) -> tuple[Config, dict[str, Any]]:
    """The tmt config of the model: its shape, its languages, decoding as generate decodes it,
    the fine-tuning recipe; and what of generate's settings tmt reproduces and what it does not."""
    where = source / "config.json"
    check_ids(where, hf, tokenizer)
    settings = read(source / "tokenizer_config.json", missing_ok=True)
    langs = [src_lang or settings.text("source_lang", None),
             tgt_lang or settings.text("target_lang", None)]  # fmt: skip
    for lang, key, flag in zip(langs, ("source_lang", "target_lang"), ("src_lang", "tgt_lang"),
                               strict=True):  # fmt: skip
        if not lang:
            raise TmtError(f"{settings.where}: no {key} (the model's language); give it with"
                           f" {{{flag}}}", mentions=[flag])  # fmt: skip
    d_model = hf.integer("d_model", minimum=1)
    positions = hf.integer("max_position_embeddings", minimum=2)
    model = {
        "d_model": d_model, "d_ff": hf.integer("encoder_ffn_dim", minimum=1),
        "n_heads": hf.integer("encoder_attention_heads", minimum=1),
        "n_encoder_layers": hf.integer("encoder_layers", minimum=1),
        "n_decoder_layers": hf.integer("decoder_layers", minimum=1),
        "dropout": hf.number("dropout", 0.1, minimum=0.0),
        "attention_dropout": hf.number("attention_dropout", 0.0, minimum=0.0),
        "max_positions": positions, "pre_norm": False,
        "activation": ACTIVATIONS[hf.choice("activation_function", "gelu", tuple(ACTIVATIONS))],
        "output_bias": True, "decoder_start": "pad",
        "share_embeddings": hf.boolean("share_encoder_decoder_embeddings", True),
    }  # fmt: skip
    decode, generation = decoding(source, hf, tokenizer)
    warmup = FINE_TUNING["optim"]["warmup_steps"]
    tree = {
        "model": model,
        "tokenizer": {"vocab_size": max(tokenizer.vocab_size, 8), "model_type": "unigram"},
        "data": {
            "src_lang": langs[0],
            "tgt_lang": langs[1],
            "max_len": min(256, max(positions - 1, 1)),
        },
        "optim": {
            **FINE_TUNING["optim"],
            "lr_scale": round(PEAK_LR * (d_model * warmup) ** 0.5, 6),
        },
        "train": {**FINE_TUNING["train"], "out_dir": f"runs/{source.resolve().name}-finetuned"},
        "decode": decode,
    }
    try:
        cfg = config_from_dict(tree, origin=str(where))
    except TmtError as err:
        raise TmtError(f"{where}: not a model tmt can hold ({err})") from None
    return cfg, generation


def decoder_side(
    where: Path, hf: Fields, tokenizer: marian_tokenizer.MarianTokenizer
) -> marian_tokenizer.MarianTokenizer:
    """The tokenizer with the decoder's </s> and <pad> the config names, where they are not the
    target vocabulary's own (an OPUS-MT tc-big checkpoint with separate vocabularies: the
    converter writes the source side's ids, and generate starts from, bans and stops on those):
    tmt decodes as generate does. Each must be an id of the decoder's vocabulary; the decoder
    starts from <pad>, as every Marian model does."""
    size = tokenizer.vocab_size
    pad = hf.integer("pad_token_id", tokenizer.pad_id, minimum=0)
    eos = hf.integer("eos_token_id", tokenizer.eos_id, minimum=0)
    start = hf.integer("decoder_start_token_id", pad, minimum=0)
    for key, value in (("pad_token_id", pad), ("eos_token_id", eos)):
        if value >= size:
            raise TmtError(f"{where}: {key}={value}, outside the decoder's vocabulary of {size}")
    if start != pad:
        raise TmtError(f"{where}: decoder_start_token_id={start}, but pad_token_id={pad}: a"
                       " Marian decoder starts from <pad>")  # fmt: skip
    if (pad, eos) == (tokenizer.pad_id, tokenizer.eos_id):
        return tokenizer
    decoder = {k: v for k, v in (("eos", eos), ("pad", pad))
               if v != getattr(tokenizer, f"{k}_id")}  # fmt: skip
    files, settings = marian_tokenizer.unpack(tokenizer.model_bytes, str(where.parent))
    packed = marian_tokenizer.pack(files, settings | {"decoder_ids": decoder})
    return marian_tokenizer.MarianTokenizer(packed, origin=str(where.parent))


def check_ids(where: Path, hf: Fields, tokenizer: marian_tokenizer.MarianTokenizer) -> None:
    """The config's special ids and vocabulary sizes are the tokenizer's (read from its files;
    the ids of the decoder's side: generate decodes with them)."""
    expected = {
        "pad_token_id": tokenizer.pad_id, "eos_token_id": tokenizer.eos_id,
        "decoder_start_token_id": tokenizer.pad_id, "vocab_size": tokenizer.source_vocab_size,
        "decoder_vocab_size": tokenizer.vocab_size,
    }  # fmt: skip
    for key, value in expected.items():
        fallback = hf.raw("vocab_size") if key == "decoder_vocab_size" else value
        found = hf.integer(key, fallback if fallback is not None else value, minimum=0)
        if found != value:
            what = "vocabulary" if key.endswith("vocab_size") else "tokenizer"
            raise TmtError(f"{where}: {key}={found}, but its {what} says {value}")


def decoding(
    source: Path, hf: Fields, tokenizer: marian_tokenizer.MarianTokenizer
) -> tuple[dict[str, Any], dict[str, Any]]:
    """tmt's decode settings for generate's: beam, maximum length, length penalty (|Y|^α, </s>
    counted), its stopping rule, the score of the </s> it forces at max_length; and the
    generation settings tmt does not reproduce."""
    path = source / "generation_config.json"
    if path.exists() or path.is_symlink():
        settings = read(path)
    else:
        settings = Fields({k: v for k, v in hf.data.items() if k in _GENERATION_KEYS}, hf.where)
    beams = settings.integer("num_beams", GENERATE_DEFAULTS["num_beams"], minimum=1)
    if "max_new_tokens" in settings:
        limit = settings.integer("max_new_tokens", minimum=1)  # </s> included
    else:
        max_length = settings.integer("max_length", GENERATE_DEFAULTS["max_length"], minimum=1)
        if max_length < 2:
            raise TmtError(f"{settings.where}: max_length={max_length}: leaves no room for a"
                           " token after the decoder's start")  # fmt: skip
        limit = max_length - 1
    penalty = settings.number("length_penalty", GENERATE_DEFAULTS["length_penalty"])
    stopping = {value: rule for rule, value in huggingface.EARLY_STOPPING.items()}
    rule = settings.choice("early_stopping", False, (True, False, "never"))
    eos = settings.token_ids("eos_token_id", [tokenizer.eos_id])
    forced = settings.token_ids("forced_eos_token_id")
    decode = {
        "beam_size": beams, "length_penalty": penalty, "length_penalty_form": "power",
        "early_stopping": stopping[rule], "max_len_a": 0.0, "max_len_b": limit,
        # generate's ForcedEOSTokenLogitsProcessor gives the </s> at max_length the score 0
        "forced_eos": "zero" if forced == [tokenizer.eos_id] else "log_prob",
    }  # fmt: skip
    ignored = {k: v for k, v in settings.data.items() if k in NOT_REPRODUCED
               and v not in (NOT_REPRODUCED[k], None, [])}  # fmt: skip
    banned = settings.raw("bad_words_ids")
    if banned not in (None, [[tokenizer.pad_id]]):
        ignored["bad_words_ids"] = banned
    if forced not in (None, [tokenizer.eos_id]):
        ignored["forced_eos_token_id"] = settings.raw("forced_eos_token_id")
    if forced is None:  # generate stops at max_length without an </s>; tmt ends with one
        ignored["forced_eos_token_id"] = None
    if eos != [tokenizer.eos_id]:  # generate stops on other ids; tmt on the tokenizer's </s>
        ignored["eos_token_id"] = settings.raw("eos_token_id")
    if ignored:
        logger.warning(
            "%s: tmt does not reproduce %s", Path(settings.where).name,
            ", ".join(f"{k}={v}" for k, v in sorted(ignored.items())),
        )  # fmt: skip
    given = {"num_beams": beams, "max_length": limit + 1, "length_penalty": penalty,
             "early_stopping": rule}  # fmt: skip
    if "max_new_tokens" in settings:
        given["max_new_tokens"] = limit
    return decode, {"generation": given, "not_reproduced": ignored}
