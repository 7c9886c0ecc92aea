"""Exchange with other toolkits: `tmt export` to CTranslate2 and Hugging Face (export,
huggingface, with the README an export carries: recipes), `tmt import` of OPUS-MT / MarianMT
directories (pretrained, marian_config), and reading the JSON another tool wrote (foreign).

Imports: common, config, data, network, runs, translation.
"""
