"""`tmt serve`: the HTTP app (serve), the outer gate of limits, key and metrics (gate), what the
endpoints share (service), the LibreTranslate API (libretranslate), dynamic batching (batching),
stored glossaries (glossary_store), and the page (page.html).

Imports: common, config, data, network, runs, translation.
"""
