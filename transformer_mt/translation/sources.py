"""Each line as the model reads it, and how long its output may be: subword ids (cut to the
model's positions with a warning), a multi-target model's language token, §6.1's output limit, and
the longer limit that leaves a constrained search room for its terms.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

from transformer_mt.data.tokenizer import encode_heads, head, language_token_id
from transformer_mt.network.automaton import Terms

logger = logging.getLogger(__name__)

_SURROGATES = re.compile("[\ud800-\udfff]")


# What of a line anything reads: a line of 2 * 10^8 characters is read as its head of 1,024
# characters a position (its tokens lie in the first 16 a position; encode_heads grows its head
# inside this one while whitespace or removed marks leave it short). A glossary matched the whole
# line: 4 * 10^7 matches of one entry ran past 300 s and 16 GB.
_READ_CHARS = 1024


def readable(translator: Any, lines: Sequence[str], at: Sequence[int] | None = None) -> list[str]:
    """`lines`, each cut to what the model can read of it (with a warning naming the line by
    `at`, each line's index in the whole input; default its index in `lines`); the same lines,
    as a list, when none is that long."""
    positions = max_positions(translator)
    size = _READ_CHARS * (positions + 64)
    cut = list(lines)
    for i, line in enumerate(cut):
        if len(line) > size:
            cut[i] = head(line, size)
            logger.warning("line %d: %d characters, read as its first %d (the model reads at most"
                           " %d tokens)", (at[i] if at is not None else i) + 1, len(line),
                           len(cut[i]), positions - 1)  # fmt: skip
    return cut


def source_ids(
    translator: Any,
    lines: Sequence[str],
    what: str = "line",
    at: Sequence[int] | None = None,
    warn: bool = True,
) -> list[list[int]]:
    """The subword ids of each line as the model reads it: lone surrogates (possible in Python
    strings, never in UTF-8, fatal to sentencepiece) replaced, a multi-target model's language
    token first (decode.target_lang), and cut to the model's positions (source tokens + EOS, or a
    target prefix + EOS, must fit them) with a warning naming the line in the whole input (`at`:
    each line's index there, default its index in `lines`; none where not `warn`: a count of
    tokens before the lines are decoded, which warns then). A prefix (`what`) is target text."""
    limit = max_positions(translator) - 1
    side = "target" if what == "prefix" else "source"
    texts = [_SURROGATES.sub("\ufffd", line) for line in lines]
    ids, whole = encode_heads(translator.tokenizer, texts, side, limit)
    code = language_token(translator) if side == "source" else None
    if side == "source" and code is None:
        _say_no_target_language(translator.tokenizer, texts)
    if code is not None:  # an empty line stays empty: it is not translated
        ids = [[code, *seq] if seq else seq for seq in ids]
    for i, seq in enumerate(ids):
        if len(seq) > limit:
            read = f"{len(seq)} tokens" if whole[i] else f"{len(texts[i])} characters"
            if warn:
                logger.warning("%s %d: %s, truncated to %d tokens (model.max_positions)", what,
                               (at[i] if at is not None else i) + 1, read, limit)  # fmt: skip
            ids[i] = seq[:limit]
    return ids


def language_token(translator: Any) -> int | None:
    """The id of >>xxx<< for decode.target_lang xxx (None when unset), refused in one line when
    the model has no such token: only multi-target Marian models read one."""
    lang = translator.config.decode.target_lang
    return language_token_id(translator.tokenizer, lang) if lang else None


def _say_no_target_language(tokenizer: Any, texts: Sequence[str]) -> None:
    """A multi-target model (OPUS-MT's opus-mt-en-roa) reads >>xxx<< first: a line without it,
    and no decode.target_lang, gets a language the model picks itself. Said once a model, not
    refused: that is what transformers' generate gives such a line."""
    codes = tokenizer.language_codes
    if not codes or id(tokenizer) in _WARNED:
        return
    if all(_BLANK_OR_CODE_FIRST.match(text) for text in texts):
        return  # each line names its language itself (or is empty)
    _WARNED.add(id(tokenizer))
    shown = ", ".join(c[2:-2] for c in codes[:12]) + (", ..." if len(codes) > 12 else "")
    logger.warning("the model translates into several languages (%s); a line that does not"
                   " start with >>xxx<<, without decode.target_lang (--target-lang), gets one"
                   " the model picks", shown)  # fmt: skip


_WARNED: set[int] = set()  # tokenizers whose missing target language was said
_BLANK_OR_CODE_FIRST = re.compile(r"\s*(>>|\Z)")  # matched, never copied: a line may be long


def max_positions(translator: Any) -> int:
    """The position table's size: an ensemble's smallest (its architectures may differ)."""
    return min([translator.config.model.max_positions,
                *(m.cfg.max_positions for m in translator.ensemble)])  # fmt: skip


def output_limits(
    translator: Any,
    sources: Sequence[Sequence[int]],
    prefixes: Sequence[Sequence[int]] = (),
) -> list[int]:
    """§6.1: the maximum output length (the EOS included) of each source, a · |x| + b, at least
    its target prefix and the EOS, within the position table."""
    decode, positions = translator.config.decode, max_positions(translator)
    given = [len(p) for p in prefixes] or [0] * len(sources)
    return [
        min(max(int(decode.max_len_a * len(x) + decode.max_len_b), size + 1), positions)
        for x, size in zip(sources, given, strict=True)
    ]


def constrained_limits(
    translator: Any,
    sources: Sequence[Sequence[int]],
    prefixes: Sequence[Sequence[int]],
    terms: Sequence[Terms],
) -> list[int]:
    """output_limits lengthened by every term's longest alternative (room for the terms on top
    of what the sentence would take), within the position table."""
    positions = max_positions(translator)
    return [min(limit + sum(max(map(len, alternatives)) for alternatives in line), positions)
            for limit, line in zip(output_limits(translator, sources, prefixes), terms,
                                   strict=True)]  # fmt: skip
