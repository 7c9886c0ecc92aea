"""A model's lines to translations: batches through the search or CTranslate2 (decoding, ct2),
the one Translator behind every command (translate), streams and files (streams), the resumable
file job over many processes (bulk), scores (evaluate), and the commands that read a model's
translations or attention: `tmt terms` (terms) and `tmt shortlist` (shortlisting).

Imports: common, config, data, network, runs.
"""
