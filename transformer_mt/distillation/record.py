"""DIR/distill.json, `tmt distill`'s record, read back: what tmt wrote there earlier is
verified, not trusted. A record that does not parse, is of another format, or whose steps are
not shaped as tmt writes them is refused in one line (never overwritten, never a KeyError).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from transformer_mt.common import files
from transformer_mt.common.exits import TmtError
from transformer_mt.config import Config, config_from_dict
from transformer_mt.runs import run

logger = logging.getLogger("tmt")


def read(path: Path, version: int) -> dict[str, Any]:
    """DIR/distill.json, or a fresh one; one that does not parse, or whose steps are not shaped
    as tmt writes them, is refused, not overwritten."""
    if not path.exists():
        return {"format": version}
    try:
        manifest = json.loads(files.read_plain(path))
    except (OSError, ValueError, UnicodeDecodeError, RecursionError):
        raise TmtError(f"{path}: not a record tmt wrote (remove it to start over)") from None
    if not isinstance(manifest, dict) or manifest.get("format") != version:
        raise TmtError(f"{path}: not a record of this tmt (format {version}); remove it to start"
                       " over")  # fmt: skip
    for step, shape in _RECORD.items():
        if step in manifest and not _shaped(manifest[step], shape):
            raise TmtError(f"{path}: its {step!r} is not as tmt writes it; remove the record to"
                           " start over")  # fmt: skip
    return manifest


# What each step of the record holds, as tmt writes it: dict keys with their shapes, [shape] a
# list of them, {str: shape} a mapping of any keys, a type a value of it.
_FILES = {str: str}
_CORPUS = {"prefix": str, "weight": (int, float), "tag": str, "pairs": int}
_RECORD: dict[str, Any] = {
    "originals": {"identity": [dict], "corpora": [_CORPUS], "files": _FILES},
    "teacher": {"fingerprint": str, "origin": str, "decode": dict},
    "translations": {str: str},
    "distilled": {"selection": dict, "corpora": [_CORPUS], "files": _FILES},
    "student": {"trained_on": _FILES},
    "evaluation": {"identity": dict, "report": dict, "files": _FILES},
    "export": {"identity": dict, "report": dict},
}


def _shaped(value: Any, shape: Any) -> bool:
    if isinstance(shape, list):
        return isinstance(value, list) and all(_shaped(v, shape[0]) for v in value)
    if isinstance(shape, dict) and set(shape) == {str}:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _shaped(v, shape[str]) for k, v in value.items()
        )
    if isinstance(shape, dict):
        return isinstance(value, dict) and all(
            k in value and _shaped(value[k], s) for k, s in shape.items()
        )
    kinds = shape if isinstance(shape, tuple) else (shape,)
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


def moved(cfg: Config, recorded: dict[str, Any], student_dir: Path) -> Config:
    """The student's config, resumed without a refusal when the config it was trained with (as
    recorded) differs from it only in where the (verified, byte-identical) distilled corpora lie:
    DIR was moved, or -o given relative to another directory."""
    try:
        saved = config_from_dict(recorded)
    except TmtError:
        return cfg
    changed = run.drift(saved, cfg)
    if changed and all(c.startswith("data.train ") for c in changed):
        logger.info("%s: the distilled corpora lie elsewhere now; resuming on them", student_dir)
        return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, resume="force"))
    return cfg
