"""Glossaries: source terms and the target terms every translation must use (DeepL's glossaries).

A glossary file is DeepL's TSV (`source<TAB>target`, one entry a line; a third column of counts,
as `tmt terms` writes, is allowed) or CSV (`source,target[,source_lang,target_lang]`, quoted as
CSV quotes): .csv files are read as CSV, .tsv ones as TSV, others by their first entry (a tab:
TSV). A target may offer alternatives separated by " | " (`Hund<TAB>dog | dogs`): any one
satisfies the entry. Both sides are read as Unicode NFC; "# " lines before the first entry are a
header. Refused in one line naming the file and line: a line without two fields, an empty side,
a control character (a tab or a line break inside a quoted CSV field among them), an empty
alternative, the same source with two different targets (both lines named), a language pair that
is not the model's. A source longer than glossary.max_source_words words (when set) is skipped and
counted (Glossary.skipped), never a reason to refuse the file.

Matching works on words: runs of letters, digits and marks, joined by inner hyphens (T-Shirt is
one word, so `Shirt` does not fire inside it, nor `Mann` inside `Feuerwehrmann`), each character
of a script written without spaces (languages.UNSPACED: Chinese, kana, Thai, ...) a word; an
apostrophe,
and any other punctuation, is a word of its own (`Martin's` is Martin ' s, and `Martin` matches
in it). Typographic apostrophes and hyphens count as the plain ones. Case is ignored unless
glossary.case_sensitive. The entries sit in a trie of words, built once per glossary (and kept:
`load` caches it by the file's SHA-256), so matching a line costs a few dictionary look-ups per
word whatever the glossary's size. Among the entries found in a line, the longest (in words) wins,
then the leftmost; entries never overlap.

Whether an output uses an entry is read from its text the same way: one alternative's words in a
row, compared exactly, except that the first may start with a capital (a sentence's first word).
"""

from __future__ import annotations

import csv
import gc
import hashlib
import io
import itertools
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from transformer_mt.common import files, languages
from transformer_mt.common.exits import TmtError

ALTERNATIVES = " | "  # separates a target's alternatives
_END = ""  # the trie key of an entry that ends at a node (no word is empty)


def _mark_ranges() -> str:
    """Every combining mark (Unicode categories M*) as regex ranges: words in Devanagari, Thai or
    Arabic carry them inside, and \\w does not take them."""
    marks = [c for c in map(chr, range(0x300, 0x20000)) if unicodedata.category(c)[0] == "M"]
    marks += [chr(c) for c in range(0xE0100, 0xE01F0)]  # variation selectors
    ranges: list[list[int]] = []
    for code in map(ord, marks):
        if ranges and ranges[-1][1] == code - 1:
            ranges[-1][1] = code
        else:
            ranges.append([code, code])
    return "".join(f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


_MARKS = _mark_ranges()
_LETTER = rf"[\w{_MARKS}]"
_WORDS = re.compile(rf"{_LETTER}+(?:[-\u2010\u2011]{_LETTER}+)*|[^\s\w]")
# The same words where a text has no combining mark (most texts, after NFC): half the work.
_PLAIN_WORDS = re.compile(r"\w+(?:[-\u2010\u2011]\w+)*|[^\s\w]")
# Each character of a script written without spaces (languages.UNSPACED) is a word, so a term
# matches inside a run of them, as sacreBLEU's zh tokenizer and the WMT23 terminology task's
# substring search read Chinese (as one \w run, 公园 matched in no sentence). Patterns of their
# own, for texts that hold such a character: the others keep one character class a run.
_U = languages.UNSPACED
_LETTERS_U = rf"(?:[^\W{_U}]+|[{_MARKS}]+)+"  # runs of one class at a time (fewer switches)
_WORDS_U = re.compile(rf"{_LETTERS_U}(?:[-\u2010\u2011]{_LETTERS_U})*|[{_U}]|[^\s\w]")
_PLAIN_WORDS_U = re.compile(rf"[^\W{_U}]+(?:[-\u2010\u2011][^\W{_U}]+)*|[{_U}]|[^\s\w]")
_HAS_MARK = re.compile(f"[{_MARKS}]")
_HAS_WORD = re.compile(r"\S")  # where _WORDS finds a word: any character but white space
_ABOVE_LATIN = re.compile("[\u0300-\U0010ffff]")
_SAME = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'", "`": "'", "\u2010": "-",
                       "\u2011": "-"})  # fmt: skip
_TYPOGRAPHIC = re.compile("[\u2019\u2018\u02bc`\u2010\u2011]")  # what _SAME changes
# " | " between alternatives: a bar with white space (or the text's end) on both sides, each bar
# one separator, so "x | | y" and "hound |" have an empty alternative (refused alike).
_BAR = re.compile(r"(?:(?<=\s)|^)\|(?=\s|$)")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")  # tabs and line breaks too
# Turkish and Azerbaijani I: dotted İ and dotless ı match I and i, as a reader takes them
# (casefold keeps İ's dot as a combining mark, and ı apart from i).
_DOTTED_I = str.maketrans({"\u0130": "I", "\u0131": "i"})


class Entry(NamedTuple):
    source: str  # as written (NFC)
    targets: tuple[str, ...]  # the alternatives, any one of which satisfies the entry
    line: int  # where it was given (1-based; 0: not from a file)

    @property
    def target(self) -> str:
        return ALTERNATIVES.join(self.targets)


class Match(NamedTuple):
    """An entry found in a line: the entry's index in its glossary and the characters it spans."""

    entry: Entry
    index: int
    start: int
    end: int


@dataclass
class Glossary:
    entries: list[Entry]
    name: str  # the file, or what gave the entries (a request)
    case_sensitive: bool = False
    sha256: str = ""  # of what was read, with the settings that change matching
    skipped: int = 0  # entries left out: their source over glossary.max_source_words
    keys: list[list[str]] | None = field(default=None, repr=False)  # each source's (parse's)
    _trie: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        keys = self.keys or [self._keys(entry.source) for entry in self.entries]
        for index, words_of in enumerate(keys):
            node = self._trie
            for word in words_of:
                node = node.setdefault(word, {})
            node[_END] = index
        self.keys = None  # only needed to build the trie

    def __len__(self) -> int:
        return len(self.entries)

    def _keys(self, text: str) -> list[str]:
        """The words of `text` as keys: the line made plain and (by default) casefolded whole,
        then cut into words, one C call each (plain and casefold never move a word boundary,
        so the i-th key is the i-th word of `text`)."""
        if text.isascii():
            text = text.translate(_SAME) if "`" in text else text
            return _PLAIN_WORDS.findall(text if self.case_sensitive else text.lower())
        if not unicodedata.is_normalized("NFC", text):
            text = unicodedata.normalize("NFC", text)
        if _TYPOGRAPHIC.search(text):  # translate is costly: only where it changes something
            text = text.translate(_SAME)
        if not self.case_sensitive and ("\u0130" in text or "\u0131" in text):
            text = text.translate(_DOTTED_I)
        text = text if self.case_sensitive else text.casefold()
        return _words_of(text).findall(text)

    def match(self, line: str) -> list[Match]:
        """The entries found in `line` (whole words, longest first, never overlapping), in the
        order they appear."""
        keys, trie, entries = self._keys(line), self._trie, self.entries
        count = len(keys)
        candidates = []  # (words, start word, entry index)
        longest = 0
        first = list(map(trie.get, keys))  # each word's node, looked up in one C loop
        for i in itertools.compress(range(count), first):  # the words that start an entry
            node, j = first[i], i
            while node is not None:
                index = node.get(_END)
                if index is not None:
                    candidates.append((j + 1 - i, i, index))
                    if j + 1 - i > longest:
                        longest = j + 1 - i
                j += 1
                node = node.get(keys[j]) if j < count else None
        if not candidates:
            return []
        last = max(start + size for size, start, _ in candidates)  # the spans needed, no more
        spans = [m.span() for m in itertools.islice(_words_of(line).finditer(line), last)]
        if longest == 1:  # one word each, one at each start: none overlaps, in order already
            return [Match(entries[index], index, *spans[start]) for _, start, index in candidates]
        taken = [False] * count
        chosen = []
        for size, start, index in sorted(candidates, key=lambda c: (-c[0], c[1])):
            if not any(taken[start : start + size]):
                taken[start : start + size] = [True] * size
                chosen.append(Match(entries[index], index, spans[start][0],
                                    spans[start + size - 1][1]))  # fmt: skip
        chosen.sort(key=lambda m: m.start)
        return chosen

    def match_lines(self, lines: Iterable[str]) -> list[list[Match]]:
        return [self.match(line) for line in lines]


def _words_of(text: str) -> re.Pattern[str]:
    """The word pattern for `text`: the plain one unless it holds a combining mark, each in its
    own form for a text with a character of a script written without spaces."""
    # No mark lies below U+0300 (Latin scripts after NFC): a cheap scan decides most texts.
    if not _ABOVE_LATIN.search(text):
        return _PLAIN_WORDS
    marks, unspaced = _HAS_MARK.search(text), languages.any_unspaced(text)
    if unspaced:
        return _WORDS_U if marks else _PLAIN_WORDS_U
    return _WORDS if marks else _PLAIN_WORDS


def words(text: str) -> list[tuple[str, int, int]]:
    """The words of `text` with their character spans in it (as given: compare them by
    `plain`)."""
    return [(m.group(), m.start(), m.end()) for m in _words_of(text).finditer(text)]


def join(words: Sequence[str]) -> str:
    """Words as a text writes them: a space between two, none between two characters of a
    script written without spaces (公 园 is 公园)."""
    if len(words) < 2 or not languages.any_unspaced("".join(words)):  # most text: one C scan
        return " ".join(words)
    text = words[0]
    for before, word in itertools.pairwise(words):
        unspaced = languages.unspaced(before[-1:]) and languages.unspaced(word[:1])
        text += word if unspaced else " " + word
    return text


def plain(word: str) -> str:
    """A word as glossaries compare it: NFC, plain apostrophes and hyphens."""
    if not word.isascii():
        word = unicodedata.normalize("NFC", word).translate(_SAME)
    elif "`" in word:
        word = word.translate(_SAME)
    return word


def used(entry: Entry, output: str) -> int | None:
    """The index of the first of the entry's alternatives that `output` uses (its words in a row,
    the first perhaps capitalised), or None."""
    out = [plain(w) for w, _, _ in words(output)]
    for number, target in enumerate(entry.targets):
        want = [plain(w) for w, _, _ in words(target)]
        if want and _contains(out, want):
            return number
    return None


def _contains(out: list[str], want: list[str]) -> bool:
    first, rest = want[0], want[1:]
    capital = first[:1].upper() + first[1:]
    for i in range(len(out) - len(want) + 1):
        if out[i] in (first, capital) and out[i + 1 : i + len(want)] == rest:
            return True
    return False


def capitalised(target: str) -> str:
    """The alternative as the first word of a sentence writes it."""
    return target[:1].upper() + target[1:]


# --- reading -----------------------------------------------------------------------------------


def load(
    path: str | Path,
    case_sensitive: bool = False,
    max_source_words: int = 0,
    pair: tuple[str, str] | None = None,
) -> Glossary:
    """The glossary of a file (cached by content and settings); `pair`: the model's (source,
    target) languages, which a CSV's language columns must name."""
    where = str(path)
    try:
        data = files.read_plain(Path(path))
    except FileNotFoundError:
        raise TmtError(f"{where}: no such file", param="glossary") from None
    except files.NotPlainFile as err:
        raise TmtError(f"{where}: {err.strerror}", param="glossary") from None
    except OSError as err:
        raise TmtError(f"{where}: cannot read: {err.strerror or err}", param="glossary") from None
    suffix = Path(path).suffix.lower()
    kind = {".csv": "csv", ".tsv": "tsv"}.get(suffix) or _sniff(data)
    key = (hashlib.sha256(data).hexdigest(), kind, case_sensitive, max_source_words, pair)
    if key not in _CACHE:
        if len(_CACHE) >= 8:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = parse(data, kind, where, case_sensitive, max_source_words, pair)
    return _CACHE[key]


_CACHE: dict[tuple, Glossary] = {}


def _sniff(data: bytes) -> str:
    for raw in data.splitlines():
        line = raw.strip()
        if line and not line.startswith(b"# "):
            return "tsv" if b"\t" in line else "csv"
    return "tsv"


def parse(
    data: bytes | str,
    kind: str,
    name: str,
    case_sensitive: bool = False,
    max_source_words: int = 0,
    pair: tuple[str, str] | None = None,
) -> Glossary:
    """A glossary from TSV or CSV text (`kind`), every line checked; errors name `name`:line."""
    if kind not in ("tsv", "csv"):
        raise TmtError(f"{name}: entries format {kind!r}: expected tsv or csv")
    if isinstance(data, bytes):
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as err:
            line = data[: err.start].count(b"\n") + 1
            raise TmtError(f"{name}:{line}: not UTF-8 text (byte {err.start})") from None
    else:
        text = data.removeprefix("\ufeff")
    # Hundreds of thousands of small objects, none of them in a cycle: the cycle collector
    # would walk them again and again (a third of the load time at 100,000 entries).
    paused = gc.isenabled()
    gc.disable()
    try:
        return _parse(text, kind, name, case_sensitive, max_source_words, pair, data)
    finally:
        if paused:
            gc.enable()


def _parse(
    text: str, kind: str, name: str, case_sensitive: bool, max_source_words: int,
    pair: tuple[str, str] | None, data: bytes | str,
) -> Glossary:  # fmt: skip
    rows = _csv_rows(text, name) if kind == "csv" else _tsv_rows(text, name)
    entries: list[Entry] = []
    sources: list[list[str]] = []
    seen: dict[tuple[str, ...], Entry] = {}
    probe = Glossary([], name, case_sensitive)
    skipped = 0
    for line, fields in rows:
        entry = _entry(fields, kind, name, line, pair)
        keys = tuple(probe._keys(entry.source))
        if not keys:
            raise TmtError(f"{name}:{line}: the source {entry.source!r} has no word to match")
        if max_source_words and len(keys) > max_source_words:
            skipped += 1  # glossary.max_source_words: left out, counted
            continue
        earlier = seen.get(keys)
        if earlier is not None:
            if earlier.targets != entry.targets:
                raise TmtError(
                    f"{name}:{line}: the source {entry.source!r} is given two targets:"
                    f" {entry.target!r} here and {earlier.target!r} on line {earlier.line}"
                )
            continue  # the same entry twice: once is enough
        seen[keys] = entry
        entries.append(entry)
        sources.append(list(keys))
    settings = f"{kind}|{case_sensitive}|{max_source_words}|{pair}".encode()
    raw = data if isinstance(data, bytes) else data.encode()
    digest = hashlib.sha256(raw + b"\0" + settings).hexdigest()
    return Glossary(entries, name, case_sensitive, sha256=digest, keys=sources, skipped=skipped)


def from_pairs(
    pairs: Sequence[Sequence[str]],
    name: str,
    case_sensitive: bool = False,
    max_source_words: int = 0,
) -> Glossary:
    """A glossary of [source, target] pairs (a request's inline glossary), checked as a file's:
    `name`:N names the N-th pair."""
    buffer = io.StringIO()
    for number, pair in enumerate(pairs, 1):
        if not (isinstance(pair, list | tuple) and all(isinstance(x, str) for x in pair)):
            raise TmtError(f"{name}:{number}: expected [source, target], two strings")
        if len(pair) != 2:
            raise TmtError(f"{name}:{number}: {len(pair)} fields; expected [source, target]")
        if any(c in "\t\n\r" for c in "".join(pair)):
            raise TmtError(f"{name}:{number}: a tab or a line break inside an entry")
        buffer.write(f"{pair[0]}\t{pair[1]}\n")
    return parse(buffer.getvalue(), "tsv", name, case_sensitive, max_source_words)


def _tsv_rows(text: str, name: str) -> Iterable[tuple[int, list[str]]]:
    header = True
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if header and line.startswith("# "):
            continue
        if not line.strip():
            continue
        header = False
        fields = line.split("\t")
        if len(fields) == 3 and fields[2].strip().isdigit():
            fields = fields[:2]  # a count column (tmt terms)
        if len(fields) != 2:
            raise TmtError(f"{name}:{number}: {len(fields)} tab-separated fields; expected"
                           " source<TAB>target")  # fmt: skip
        yield number, fields


def _csv_rows(text: str, name: str) -> Iterable[tuple[int, list[str]]]:
    lines = text.split("\n")
    start = 0
    while start < len(lines) and lines[start].startswith("# "):
        start += 1
    reader = csv.reader(io.StringIO("\n".join(lines[start:])), strict=True)
    ended = 0  # the line the previous record ended on: a quoted field may span lines
    try:
        for fields in reader:
            number, ended = ended + 1 + start, reader.line_num
            if not fields or not "".join(fields).strip():
                continue
            if len(fields) not in (2, 4):
                raise TmtError(f"{name}:{number}: {len(fields)} comma-separated fields; expected"
                               " source,target[,source_lang,target_lang]")  # fmt: skip
            yield number, fields
    except csv.Error as err:
        raise TmtError(f"{name}:{reader.line_num + start}: not CSV ({err})") from None


def _entry(
    fields: list[str], kind: str, name: str, line: int, pair: tuple[str, str] | None
) -> Entry:
    source, target = (_nfc(f.strip()) for f in fields[:2])
    for side, value in (("source", source), ("target", target)):
        if not value:
            raise TmtError(f"{name}:{line}: the {side} is empty")
        if _CONTROL.search(value):
            what = {"\t": "a tab", "\n": "a line break", "\r": "a line break"}.get(
                _CONTROL.search(value).group(), "a control character"
            )
            raise TmtError(f"{name}:{line}: {what} in the {side}")
    if _BAR.search(target):
        parts = [t.strip() for t in _BAR.split(target)]
        if not all(_HAS_WORD.search(t) for t in parts):
            raise TmtError(f"{name}:{line}: an empty alternative in the target {target!r}")
        targets = tuple(dict.fromkeys(parts))
    elif _HAS_WORD.search(target):
        targets = (target,)
    else:
        raise TmtError(f"{name}:{line}: the target {target!r} has no word")
    if len(fields) == 4:
        given = tuple(f.strip() for f in fields[2:])
        for code in given:
            if not languages.is_known(code):
                raise TmtError(f"{name}:{line}: unknown language code {code!r}")
        if pair is not None and not (
            languages.same_language(given[0], pair[0])
            and languages.same_language(given[1], pair[1])
        ):
            raise TmtError(f"{name}:{line}: an entry for {given[0]}→{given[1]}; the model"
                           f" translates {pair[0]}→{pair[1]}")  # fmt: skip
    return Entry(source, targets, line)


def _nfc(text: str) -> str:
    return text if text.isascii() else unicodedata.normalize("NFC", text)


def report(line: int, text: str, matches: Sequence[Match], terms: Sequence | None) -> dict:
    """The glossary report of one input line (tmt translate --glossary-report, the server's
    "terms"): per entry it matched, where (characters of the input line), the entry, the
    alternative the output uses (None: none), whether it does, whether constrained decoding wrote
    it (the line's first translation missed an entry: this output is the constrained search's),
    and for an entry strict could not place, `missed`: why. `terms`: the best hypothesis's
    (search.Hypothesis.terms: (alternative, forced, why missed) per entry)."""
    uses = list(terms) if terms else [(-1, False, "")] * len(matches)
    return {
        "line": line,
        "terms": [
            {"source": m.entry.source, "matched": text[m.start : m.end], "start": m.start,
             "end": m.end, "target": m.entry.target,
             "alternative": m.entry.targets[use[0]] if use[0] >= 0 else None,
             "used": use[0] >= 0, "forced": bool(use[1]),
             **({"missed": use[2]} if len(use) > 2 and use[2] else {})}
            for m, use in zip(matches, uses, strict=True)
        ],
    }  # fmt: skip


def term_use(glossary: Glossary, sources: Sequence[str], outputs: Sequence[str]) -> dict:
    """Entries used over entries matched, over a corpus (each match of each line counts once)."""
    matched = used_count = lines = 0
    for source, output in zip(sources, outputs, strict=True):
        found = glossary.match(source)
        lines += bool(found)
        matched += len(found)
        used_count += sum(used(m.entry, output) is not None for m in found)
    return {
        "term_use": round(100.0 * used_count / matched, 2) if matched else None,
        "terms_matched": matched,
        "terms_used": used_count,
        "lines_with_terms": lines,
    }
