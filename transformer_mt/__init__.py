"""tmt: the Transformer of "Attention Is All You Need", from raw parallel text to translations.

The Python API: `from transformer_mt import Translator` (loaded on first use, so importing the
package, and `tmt --help`, stay instant).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.2.0"
__all__ = ["Translator", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Translator":
        from transformer_mt.translation.translate import Translator

        return Translator
    raise AttributeError(f"module 'transformer_mt' has no attribute {name!r}")
