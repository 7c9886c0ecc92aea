"""Parallel text to batches: the corpora from every source (corpus), the cleaning rules
(filters) and the `tmt clean` command that applies them (cleaning), the joint sentencepiece
vocabulary (tokenizer) or OPUS-MT's pair (marian_tokenizer), the encoded cache and token-bucket
batches (batches), glossaries (glossary), term hints (hints), eflomal's word aligner (aligner).

Imports: common, config.
"""
