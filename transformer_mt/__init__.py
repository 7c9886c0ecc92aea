"""tmt: the Transformer of "Attention Is All You Need", from raw parallel text to translations."""

__version__ = "0.1.0"
