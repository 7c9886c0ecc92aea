"""A glossary bound to a translator: read from glossary.path (checked against the model's
languages), taken from a caller as a file, a Glossary or [source, target] pairs, and checked
against the model and decoding that must obey it (a target longer than any output, a mode the
model was not trained for, sampling with strict, CTranslate2 without the tmt model).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, apply_overrides
from transformer_mt.data import glossary as glossaries
from transformer_mt.data import hints
from transformer_mt.translation.sources import max_positions

logger = logging.getLogger(__name__)


def load_glossary(cfg: Config) -> glossaries.Glossary | None:
    """The glossary glossary.path names (None for none), checked against the model's languages:
    a CSV's language columns must name its pair. What it skips, or an empty one, is said."""
    settings = cfg.glossary
    if not settings.path:
        return None
    pair = (cfg.data.src_lang, cfg.decode.target_lang or cfg.data.tgt_lang)
    found = glossaries.load(settings.path, settings.case_sensitive, settings.max_source_words, pair)
    announce(found, settings.max_source_words)
    return found


def announce(glossary: glossaries.Glossary, max_source_words: int) -> None:
    """Warn of a glossary that obeys nothing (no entry) or skipped entries (their source over
    glossary.max_source_words words)."""
    if glossary.skipped:
        logger.warning("%s: %d entries skipped: a source of more than %d words"
                       " (glossary.max_source_words)", glossary.name, glossary.skipped,
                       max_source_words)  # fmt: skip
    if not glossary.entries:
        logger.warning("%s: the glossary has no entries: translations are as without it",
                       glossary.name)  # fmt: skip


def glossary_of(given: Any, cfg: Config) -> glossaries.Glossary:
    """What a caller gives as a glossary: a Glossary, a file's path, or entries as
    [source, target] pairs (as the server takes them)."""
    if isinstance(given, glossaries.Glossary):
        return given
    if isinstance(given, str | Path):
        found = load_glossary(apply_overrides(cfg, [f"glossary.path={given}"]))
        assert found is not None
        return found
    if isinstance(given, list | tuple):
        settings = cfg.glossary
        found = glossaries.from_pairs(given, "glossary", settings.case_sensitive,
                                      settings.max_source_words)  # fmt: skip
        announce(found, settings.max_source_words)
        return found
    raise TmtError(f"glossary: {type(given).__name__}: expected a file's path, a"
                   " glossary.Glossary, or [source, target] pairs")  # fmt: skip


def check_glossary(translator: Any) -> None:
    """Refuse, in one line, a glossary with decoding that cannot obey it."""
    cfg = translator.config
    mode = cfg.glossary.mode
    if translator.glossary is None:
        return
    _check_targets(translator)
    if mode in ("hint", "auto") and not hints.trained_with_hints(cfg):
        raise TmtError(f"glossary.mode={mode}: the model was not trained with term hints"
                       " (data.terms); use glossary.mode=strict or check")  # fmt: skip
    if mode not in ("strict", "auto"):
        return
    if cfg.decode.sampling != "none":
        raise TmtError(f"glossary.mode={mode}: not while sampling (decode.sampling="
                       f"{cfg.decode.sampling}); use glossary.mode=check or hint")  # fmt: skip
    if translator.engine is not None and translator.model is None:
        raise TmtError(
            f"glossary.mode={mode} with decode.engine=ctranslate2 ({translator.origin}): the lines"
            " that need constrained decoding are decoded by tmt's engine, from the tmt model:"
            " load the model (not only its CTranslate2 export) with the glossary (--glossary,"
            " glossary.path, Translator.load(glossary=...)), or use glossary.mode=check"
        )


_FITS: set[tuple[str, str, int]] = set()  # (glossary, tokenizer, limit) whose targets fit


def _check_targets(translator: Any) -> None:
    """Refuse, naming its file and line, an entry whose target no output of the model can hold
    (more pieces than its positions leave beside the EOS): strict could never place it, and a
    huge one would only cost time and memory. A target of at most limit / 4 characters always
    fits (a character is at most 4 byte pieces); one of more than 16 × limit never does (a
    piece is at most 16 characters); the others are counted by the tokenizer."""
    glossary, tok = translator.glossary, translator.tokenizer
    limit = max_positions(translator) - 1
    key = (glossary.sha256 or str(id(glossary)), tok.sha256, limit)
    if key in _FITS:
        return
    for entry in glossary.entries:
        for target in entry.targets:
            if 4 * len(target) <= limit:
                continue
            long = len(target) > 16 * limit
            pieces = limit + 1 if long else len(tok.encode([target], side="target")[0])
            if pieces > limit:
                where = f"{glossary.name}:{entry.line}" if entry.line else glossary.name
                shown = target if len(target) <= 40 else target[:40] + "..."
                count = f"over {limit}" if long else str(pieces)
                raise TmtError(
                    f"{where}: the target {shown!r} is {count} pieces; no output of this model"
                    f" holds more than {limit} (model.max_positions {limit + 1})"
                )
    if len(_FITS) > 64:
        _FITS.clear()
    _FITS.add(key)
