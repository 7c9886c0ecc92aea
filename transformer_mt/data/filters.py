"""Corpus cleaning: the cheap rules that OpusCleaner, OpusFilter, bicleaner-hardrules, Mozilla's
pipeline and OpenNMT-py's `clean` transform agree on, applied pair by pair in one fixed order,
each removed pair counted under the first rule that removes it (`tmt clean`, and `data.clean` at
training time).

The order: empty, encoding, length, ratio, copy, script, symbols, overlap, duplicate,
near_duplicate, langid. Every rule reads only the pair (and, for overlap, the validation and test
sets; for the duplicates, the hashes of the pairs kept before it): a pair's reason is the same
however the corpus is chunked or shared among processes, so the output is too.

A name or a number that both sides share is never the reason a pair goes: the script, symbol and
language rules look at what is left of each side once the tokens found on both sides are set
aside, and a copy must have `clean.copy_min_words` words with letters (a shorter one is a name, a
number or a title, which the model must learn to copy). Thresholds and their sources: README,
"Clean what you train on"; the measurements: docs/benchmarks.md.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import itertools
import multiprocessing
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from transformer_mt.common import languages
from transformer_mt.common.exits import TmtError
from transformer_mt.config import CleanConfig, Config
from transformer_mt.data import corpus

FILTERS = ("empty", "encoding", "length", "ratio", "copy", "script", "symbols", "overlap",
           "duplicate", "near_duplicate", "langid")  # fmt: skip
# What the rules decide changed (2: language codes of any ISO form, two-script languages): cached
# judgements of another version are judged again.
RULES_VERSION = 2
KEPT = 0  # a pair's reason code: 0 kept, else 1 + its filter's index in FILTERS
# Scripts by language (ISO 639-1), as unicodedata names a letter's first word; a language not
# listed is not checked by the script rule.
_BY_SCRIPT = {
    "LATIN": "af az cs cy da de en eo es et eu fi fr ga gl hr hu id is it lt lv ms mt nb nl nn no"
    " pl pt ro sk sl sq sv sw tl tr uz vi",
    "CYRILLIC": "be bg kk ky mk mn ru sr tg uk",
    "ARABIC": "ar fa ur", "DEVANAGARI": "hi mr ne", "GREEK": "el", "HEBREW": "he",
    "BENGALI": "bn", "TAMIL": "ta", "TELUGU": "te", "THAI": "th", "GEORGIAN": "ka",
    "ARMENIAN": "hy", "CJK": "zh",
}  # fmt: skip
SCRIPTS: dict[str, tuple[str, ...]] = {
    **{lang: (script,) for script, langs in _BY_SCRIPT.items() for lang in langs.split(" ")},
    "ko": ("HANGUL", "CJK"), "ja": ("CJK", "HIRAGANA", "KATAKANA"),
    # Languages written in two scripts: either is theirs.
    "sr": ("CYRILLIC", "LATIN"), "sh": ("LATIN", "CYRILLIC"), "bs": ("LATIN", "CYRILLIC"),
    "az": ("LATIN", "CYRILLIC"), "uz": ("LATIN", "CYRILLIC"), "tk": ("LATIN", "CYRILLIC"),
    "kk": ("CYRILLIC", "LATIN"), "mn": ("CYRILLIC", "MONGOLIAN"), "ku": ("LATIN", "ARABIC"),
    "pa": ("GURMUKHI", "ARABIC"), "ms": ("LATIN", "ARABIC"),
}  # fmt: skip
# ISO 15924 codes a language code may name after its language (sr_Latn, zh-Hant): that script only.
_ISO_SCRIPTS = {"Latn": "LATIN", "Cyrl": "CYRILLIC", "Arab": "ARABIC", "Deva": "DEVANAGARI",
                "Grek": "GREEK", "Hebr": "HEBREW", "Hans": "CJK", "Hant": "CJK", "Hani": "CJK",
                "Guru": "GURMUKHI", "Mong": "MONGOLIAN", "Geor": "GEORGIAN", "Armn": "ARMENIAN",
                "Thai": "THAI", "Hang": "HANGUL"}  # fmt: skip
# Languages written without spaces between words: lengths in characters, ratios in UTF-8 bytes
# (bicleaner's rule for CJK), no word counts.
NO_SPACES = languages.NO_SPACES
# Mis-decoded UTF-8 read as Latin-1 or cp1252 (mojibake): a lead byte's character (Ã, Â, â, Å)
# before a continuation byte's (U+0080-U+00BF, or what cp1252 makes of 0x80-0x9F: € „ ™ œ ž ...),
# as in "CafÃ©", "â€žHalloâ€œ" (bicleaner's no_bad_encoding, sharpened so that Portuguese "SÃO"
# or "À bientôt" stay).
_CONTINUATION = "\u0080-\u00bf" + bytes(range(0x80, 0xA0)).decode("cp1252", "ignore")
_MOJIBAKE = f"[ÃÂÅ][{_CONTINUATION}]|â[{_CONTINUATION}][{_CONTINUATION}]"
# Control characters (Unicode's Cc, the tab aside) and U+FFFD, or mojibake: one regex, one pass.
_BAD_ENCODING = re.compile(f"[\x00-\x08\x0a-\x1f\x7f-\x9f\ufffd]|{_MOJIBAKE}")
_PUNCT_EDGES = re.compile(r"^\W+|\W+$")
_NOT_ALNUM = re.compile(r"[\W_]+")  # what str.isalnum rejects (re's \w is isalnum or "_")
_SYMBOLS = re.compile(r"[^\w\s]|[\d_]")  # digits, punctuation and symbols (and marks)


def _latin_letters() -> re.Pattern[str]:
    """A class of the letters unicodedata names LATIN (the script most languages here use),
    so that a Latin side's script share is counted by one regex, not letter by letter."""
    blocks = [(0x41, 0x2FFF), (0xA720, 0xA7FF), (0xAB30, 0xAB6F), (0xFB00, 0xFB06),
              (0xFF21, 0xFF5A)]  # fmt: skip
    chars = (chr(c) for lo, hi in blocks for c in range(lo, hi + 1))
    letters = [ch for ch in chars if ch.isalpha() and unicodedata.name(ch, "").startswith("LATIN")]
    return re.compile("[" + re.escape("".join(letters)) + "]")


_LATIN = _latin_letters()


@dataclass(frozen=True)
class Rules:
    """What the rules of one run need besides the pair: the settings, the languages, the
    normalised validation and test sentences (the overlap rule), and the language identifier."""

    cfg: CleanConfig
    src_lang: str  # as the config gives it (deu, sr_Latn, ...)
    tgt_lang: str
    eval_sources: frozenset[int] = frozenset()
    eval_targets: frozenset[int] = frozenset()

    @functools.cached_property
    def langs(self) -> tuple[str, str]:
        """The two languages as one key each (languages.canonical: deu is de)."""
        return (base_language(self.src_lang), base_language(self.tgt_lang))

    @functools.cached_property
    def scripts(self) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
        return (scripts_of(self.src_lang), scripts_of(self.tgt_lang))


def base_language(code: str) -> str:
    """A language code as one key (de for deu, ger, de_DE); an unknown one lower-cased."""
    return languages.canonical(code) or code.strip().lower()


def scripts_of(code: str) -> tuple[str, ...] | None:
    """The scripts a side in `code` may be written in: the one a code names (sr_Latn), else its
    language's (both of a two-script language); None where not known (not checked)."""
    named = languages.script_part(code)
    if named in _ISO_SCRIPTS:
        return (_ISO_SCRIPTS[named],)
    return SCRIPTS.get(base_language(code))


def normalised(text: str) -> str:
    """A sentence with case, spaces and punctuation set aside: its letters and digits, casefolded
    (what copies, near duplicates and test overlap are compared by)."""
    return _NOT_ALNUM.sub("", unicodedata.normalize("NFKC", text).casefold())


def digest(text: str) -> int:
    """8 bytes of BLAKE2b as a signed int64: what duplicates are remembered by (8 bytes a pair,
    not its text; a false match is about n²/2⁶⁵, 3·10⁻⁴ at 10⁸ pairs)."""
    raw = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


@functools.lru_cache(maxsize=65_536)
def _script(ch: str) -> str:
    name = unicodedata.name(ch, "")
    return name.split(" ", 1)[0] if name else ""


def _keys(text: str) -> list[tuple[str, str]]:
    """(token, its key): the token without the punctuation at its edges, casefolded."""
    return [(t, (t if t.isalnum() else _PUNCT_EDGES.sub("", t)).casefold()) for t in text.split()]


def _own_part(keys: list[tuple[str, str]], shared: set[str]) -> str:
    """A side without the tokens found on both sides of its pair (names, numbers, URLs)."""
    return " ".join(t for t, key in keys if key not in shared)


def _bad_encoding(text: str) -> bool:
    return _BAD_ENCODING.search(text) is not None


def _length_problem(text: str, lang: str, cfg: CleanConfig) -> bool:  # lang: base_language
    if len(text) > cfg.max_chars:
        return True
    if lang in NO_SPACES:
        return False
    words = len(text.split())
    return words < cfg.min_words or words > cfg.max_words


def _size(text: str, bytes_: bool) -> int:
    return len(text.encode("utf-8", "surrogatepass")) if bytes_ else len(text)


def _script_share(text: str, expected: tuple[str, ...] | None) -> float | None:
    """The share of `text`'s letters in the `expected` scripts; None when it has no letter or the
    language's script is not known."""
    letters = sum(map(str.isalpha, text))
    if expected is None or not letters:
        return None
    if expected == ("LATIN",):
        return len(_LATIN.findall(text)) / letters
    return sum(_script(ch) in expected for ch in text if ch.isalpha()) / letters


def _symbol_share(text: str) -> float | None:
    """The share of digits, punctuation and symbols among `text`'s non-space characters."""
    chars = len(text) - sum(map(str.isspace, text))
    return len(_SYMBOLS.findall(text)) / chars if chars else None


def pair_reason(src: str, tgt: str, rules: Rules, identify: Identify | None) -> int:
    """The first rule (reason code, KEPT = 0) that removes (src, tgt), among those that read the
    pair alone or the evaluation sets (the duplicates are the caller's: they need the corpus)."""
    cfg, langs = rules.cfg, rules.langs
    code = FILTERS.index
    if cfg.empty and (not src.strip() or not tgt.strip()):
        return 1 + code("empty")
    if cfg.encoding and (_bad_encoding(src) or _bad_encoding(tgt)):
        return 1 + code("encoding")
    sides = list(zip((src, tgt), langs, strict=True))
    if cfg.length and any(_length_problem(text, lang, cfg) for text, lang in sides):
        return 1 + code("length")
    if cfg.ratio:
        in_bytes = bool(NO_SPACES & set(langs))
        a, b = _size(src.strip(), in_bytes), _size(tgt.strip(), in_bytes)
        if max(a, b) > cfg.max_ratio * max(min(a, b), 1):
            return 1 + code("ratio")
    src_norm, tgt_norm = normalised(src), normalised(tgt)
    copied = bool(src_norm) and src_norm == tgt_norm
    if cfg.copy and copied:
        worded = sum(any(ch.isalpha() for ch in word) for word in src.split())
        if worded >= cfg.copy_min_words:
            return 1 + code("copy")
    # A short copy is a name, a number or a title both sides share: nothing of its own to judge.
    own = ("", "")
    if not copied:
        keys = _keys(src), _keys(tgt)
        shared = ({k for _, k in keys[0]} & {k for _, k in keys[1]}) - {""}  # "": punctuation
        own = (_own_part(keys[0], shared), _own_part(keys[1], shared))
    if cfg.script:
        shares = [_script_share(t, s) for t, s in zip(own, rules.scripts, strict=True)]
        if any(s is not None and s < cfg.min_script_share for s in shares):
            return 1 + code("script")
    if cfg.symbols:
        shares = [_symbol_share(t) for t in own]
        if any(s is not None and s > cfg.max_symbol_share for s in shares):
            return 1 + code("symbols")
    if cfg.overlap and (
        (src_norm and digest(src_norm) in rules.eval_sources)
        or (tgt_norm and digest(tgt_norm) in rules.eval_targets)
    ):
        return 1 + code("overlap")
    if cfg.langid and identify is not None:
        for text, lang in zip(own, langs, strict=True):
            if len(text) >= cfg.langid_min_chars and identify(text, lang) < cfg.langid_min_prob:
                return 1 + code("langid")
    return KEPT


class Identify:
    """Language identification by py3langid (the `clean` extra): its model ships inside the
    package (nothing is downloaded), BSD-licensed, 97 languages, OpusFilter's default. A side
    goes when its language's probability is under clean.langid_min_prob, not whenever another
    language ranks first: on Multi30k, 0.08 % of English lines rank another language first, none
    has P(en) < 0.1, and 99.96 % of French lines do (docs/benchmarks.md). Loaded once per
    process."""

    def __init__(self) -> None:
        try:
            from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier
        except ImportError:
            raise TmtError(
                "clean.langid needs the clean extra (py3langid is missing):"
                " pip install 'transformer_mt[clean]'"
            ) from None
        self._identifier = LanguageIdentifier.from_modelpath(
            MODEL_DIR / MODEL_FILE, norm_probs=True
        )
        # The model's labels by language (its ary and arz are Arabic, its no is Norwegian).
        self._labels: dict[str, list[str]] = collections.defaultdict(list)
        for label in dict.fromkeys(self._identifier.nb_classes):
            self._labels[base_language(label)].append(label)
        self._labels["nb"] += self._labels["no"]

    def labels(self, lang: str) -> list[str]:
        """The model's labels of a language (the config's code, any form)."""
        return self._labels.get(base_language(lang), [])

    def check(self, *codes: str) -> None:
        """Refuse, in one line, a language code the table or the model does not know."""
        for code in codes:
            if not languages.is_known(code):
                raise TmtError(f"clean.langid: {code!r} is not a language code tmt knows (ISO"
                               " 639-1 or 639-3: de, deu); set clean.langid=false")  # fmt: skip
            if not self.labels(code):
                raise TmtError(f"clean.langid: py3langid has no model of {code!r}; set"
                               " clean.langid=false")  # fmt: skip

    def __call__(self, text: str, lang: str) -> float:
        """The probability that `text` is in `lang` (the sum over the model's labels of it; 0 for
        a language the model lacks)."""
        ranked = dict(self._identifier.rank(text))
        return float(sum(ranked.get(label, 0.0) for label in self.labels(lang)))


def pair_hashes(chunk: Sequence[tuple[str, str]], cfg: CleanConfig) -> np.ndarray:
    """(2, N) int64: each pair's hash as it is ("duplicate") and once case, spaces and
    punctuation are set aside ("near_duplicate"); computed where the pairs are judged."""
    hashes = np.zeros((2, len(chunk)), dtype=np.int64)
    if cfg.duplicate:
        exact = (digest(s + "\t" + t) for s, t in chunk)
        hashes[0] = np.fromiter(exact, np.int64, len(chunk))
    if cfg.near_duplicate:
        near = (digest(normalised(s) + "\t" + normalised(t)) for s, t in chunk)
        hashes[1] = np.fromiter(near, np.int64, len(chunk))
    return hashes


def duplicate_reasons(
    chunk: Sequence[tuple[str, str]],
    reasons: np.ndarray,
    seen: dict[str, np.ndarray],
    cfg: CleanConfig,
    alive_codes: Sequence[int] = (KEPT,),
    hashes: np.ndarray | None = None,
) -> None:
    """Mark, in `reasons` (the chunk's codes so far, changed in place), the pairs that passed
    the rules before the duplicates (`alive_codes`: kept, or removed by a later rule only) and
    repeat such a pair before them: exactly ("duplicate") or once case, spaces and punctuation
    are set aside ("near_duplicate"). `seen`: the sorted hashes of those pairs in the chunks
    before, updated with this chunk's; `hashes`: pair_hashes(chunk), if computed already."""
    if hashes is None:
        hashes = pair_hashes(chunk, cfg)
    for row, (name, on) in enumerate((("duplicate", cfg.duplicate),
                                      ("near_duplicate", cfg.near_duplicate))):  # fmt: skip
        alive = np.flatnonzero(np.isin(reasons, alive_codes))
        if not on or not len(alive):
            continue
        mine = hashes[row, alive]
        known = seen.get(name, np.zeros(1, dtype=np.int64)[:0])
        at = np.minimum(np.searchsorted(known, mine), max(len(known) - 1, 0))
        before = known[at] == mine if len(known) else np.zeros(len(mine), dtype=bool)
        _, first = np.unique(mine, return_index=True)
        repeated = np.ones(len(mine), dtype=bool)
        repeated[first] = False
        hit = before | repeated
        reasons[alive[hit]] = 1 + FILTERS.index(name)
        fresh = np.unique(mine[~hit])  # sorted; merged in by position, one copy, no sort of all
        seen[name] = np.insert(known, np.searchsorted(known, fresh), fresh)


def eval_digests(lines: Iterable[str]) -> frozenset[int]:
    return frozenset(digest(n) for n in map(normalised, lines) if n)


# --- a corpus: its chunks judged, on several processes -------------------------------------------

CHUNK = 20_000  # pairs a process judges at a time
LANGID = 1 + FILTERS.index("langid")


_RULES: Rules | None = None  # this process's rules (a worker's, set by _start)
_IDENTIFY: Identify | None = None  # ... and its language identifier, loaded once


def _start(rules: Rules) -> None:
    global _RULES, _IDENTIFY
    _RULES, _IDENTIFY = rules, Identify() if rules.cfg.langid else None


def _judge(chunk: list[tuple[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """A chunk's reason codes (the duplicates aside) and its pairs' hashes, in a worker."""
    assert _RULES is not None
    codes = np.asarray([pair_reason(s, t, _RULES, _IDENTIFY) for s, t in chunk], np.int8)
    return codes, pair_hashes(chunk, _RULES.cfg)


def reasons(
    pairs: Iterator[list[tuple[str, str]]], rules: Rules, num_proc: int
) -> Iterator[tuple[list[tuple[str, str]], np.ndarray]]:
    """Each chunk of `pairs` with its pairs' reason codes (KEPT: kept), in order. The rules
    that read a pair alone run on `num_proc` processes (at most 2 chunks each in flight: memory
    stays bounded); the duplicates here, in order, so that the result does not depend on the
    process count."""
    seen: dict[str, np.ndarray] = {}
    workers = min(num_proc, os.cpu_count() or 1)
    alive = (KEPT, LANGID)  # the duplicates come before langid in the order
    if workers <= 1:
        _start(rules)
        for chunk in pairs:
            codes, hashes = _judge(chunk)
            duplicate_reasons(chunk, codes, seen, rules.cfg, alive, hashes)
            yield chunk, codes
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process that holds torch
    with context.Pool(workers, initializer=_start, initargs=(rules,)) as pool:
        window: collections.deque[tuple[list[tuple[str, str]], Any]] = collections.deque()
        for chunk in itertools.chain(pairs, [None]):
            if chunk is not None:
                window.append((chunk, pool.apply_async(_judge, (chunk,))))
            while window and (chunk is None or len(window) >= 2 * workers):
                done, result = window.popleft()
                codes, hashes = result.get()
                duplicate_reasons(done, codes, seen, rules.cfg, alive, hashes)
                yield done, codes


def eval_sets(cfg: Config) -> tuple[Rules, list[str]]:
    """The rules of this config, with the validation and test sentences the overlap rule keeps
    out of training (a split that cannot be read is named in the notes and left out)."""
    sources: list[str] = []
    targets: list[str] = []
    notes = []
    if cfg.clean.overlap:
        for key in ("data.valid", "data.test"):
            try:
                src, tgt = corpus.read_split(cfg.data, key)
            except TmtError as err:
                notes.append(f"overlap: {key} not checked ({err})")
                continue
            sources += src
            targets += tgt
    rules = Rules(cfg.clean, cfg.data.src_lang, cfg.data.tgt_lang,
                        eval_digests(sources), eval_digests(targets))  # fmt: skip
    return rules, notes
