"""JSON that another tool wrote (a Hugging Face model's config.json, generation_config.json,
tokenizer_config.json, vocab.json), read field by field with each field's type checked: a
value of the wrong type or out of range is one line naming the file, the key and what was
expected, never a traceback deep inside the reader (stdlib only).

    fields = foreign.read(path)                    # the object, bounded, a plain file
    d_model = fields.integer("d_model", minimum=1)  # required
    beams = fields.integer("num_beams", 1, minimum=1)
    rule = fields.choice("early_stopping", False, (True, False, "never"))
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformer_mt.common import files
from transformer_mt.common.exits import TmtError, first_line

_REQUIRED = object()
LIMIT = 1 << 24  # a config or a vocabulary of an OPUS-MT model is a few MB; more is not one


def read(path: Path, limit: int = LIMIT) -> Fields:
    """The JSON object in `path` (a plain file of at most `limit` bytes, or a link to one), as
    Fields."""
    try:
        value = json.loads(files.read_plain(path, limit=limit, follow_links=True))
    except FileNotFoundError:
        raise TmtError(f"{path}: no such file") from None
    except (OSError, ValueError, RecursionError) as err:
        raise TmtError(f"{path}: unreadable JSON ({first_line(err)[:160]})") from None
    if not isinstance(value, dict):
        raise TmtError(f"{path}: expected a JSON object, found {_kind(value)}")
    return Fields(value, str(path))


class Fields:
    """A JSON object's fields, each read with its type (and range) checked. A key that is absent
    or null takes the default (a key without one is required)."""

    def __init__(self, data: Mapping[str, Any], where: str) -> None:
        self.data, self.where = dict(data), where

    def __contains__(self, key: str) -> bool:
        return self.data.get(key) is not None

    def keys(self) -> list[str]:
        return list(self.data)

    def raw(self, key: str, default: Any = None) -> Any:
        """The value as it is (for reporting it back), unchecked."""
        return self.data.get(key, default)

    def _value(self, key: str, default: Any) -> Any:
        value = self.data.get(key)
        if value is None:
            if default is _REQUIRED:
                raise TmtError(f"{self.where}: no {key}")
            return default
        return value

    def _bad(self, key: str, value: Any, expected: str) -> TmtError:
        shown = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
        return TmtError(f"{self.where}: {key}={shown}: expected {expected}")

    def integer(self, key: str, default: Any = _REQUIRED, minimum: int | None = None) -> Any:
        value = self._value(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, value, "an integer" + _at_least(minimum))
        if minimum is not None and value < minimum:
            raise self._bad(key, value, "an integer" + _at_least(minimum))
        return value

    def number(self, key: str, default: Any = _REQUIRED, minimum: float | None = None) -> Any:
        value = self._value(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            raise self._bad(key, value, "a number" + _at_least(minimum))
        if minimum is not None and value < minimum:
            raise self._bad(key, value, "a number" + _at_least(minimum))
        return float(value)

    def boolean(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, bool):
            raise self._bad(key, value, "true or false")
        return value

    def text(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, str):
            raise self._bad(key, value, "a string")
        return value

    def choice(self, key: str, default: Any, choices: Sequence[Any]) -> Any:
        value = self._value(key, default)
        # True == 1 in Python: a choice is matched by type too
        if not any(value == c and type(value) is type(c) for c in choices):
            shown = ", ".join(json.dumps(c) for c in choices)
            raise self._bad(key, value, f"one of {shown}")
        return value

    def token_ids(self, key: str, default: Any = None) -> Any:
        """A token id or a list of them (transformers takes both), as a list; default if absent."""
        value = self._value(key, default)
        if value is default:
            return value
        ids = value if isinstance(value, list) else [value]
        if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise self._bad(key, value, "a token id (an integer >= 0) or a list of them")
        return ids

    def mapping(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, dict):
            raise self._bad(key, value, "a JSON object")
        return value

    def strings(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if value is default and default is not _REQUIRED:
            return value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(key, value, "a list of strings")
        return value


def _at_least(minimum: float | None) -> str:
    return f" >= {minimum}" if minimum is not None else ""


def _kind(value: Any) -> str:
    return {list: "a list", str: "a string", int: "a number", float: "a number",
            bool: "true or false"}.get(type(value), type(value).__name__)  # fmt: skip


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True
