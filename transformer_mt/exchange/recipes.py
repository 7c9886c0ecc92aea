"""What an exported directory says about itself: a README.md with the code that translates with the
export alone (ctranslate2 + sentencepiece, or transformers), with the options that reproduce tmt.

The CTranslate2 recipe is not only documentation: `tmt export` runs that very code (the python
block of the README) through the directory's own sentencepiece.model for its parity check, and a
test runs it as a script in a process without tmt. Values (beam, length penalty, the maximum
length rule, special pieces) are the model's, written into the recipe.
"""

from __future__ import annotations

from typing import Any

from transformer_mt.translation.translate import Translator

README_FILE = "README.md"

# Both recipes' decoding: one CTranslate2 call per length limit (tmt's, the </s> included).
_DECODE_BY_LIMIT = """\
    # tmt's length limit, its end of sentence included: A * source pieces + B, within POSITIONS
    limits = [min(int(A * len(p) + B), POSITIONS) for p in pieces]
    outputs = [[] for _ in lines]
    for limit in sorted(set(limits)):  # max_decoding_length is per call: one call per limit
        batch = [i for i, p in enumerate(pieces) if p and limits[i] == limit]
        if not batch:
            continue
        results = model.translate_batch(
            [pieces[i] for i in batch], beam_size=beam, length_penalty=length_penalty,
            max_decoding_length=limit - 1, min_decoding_length=0, suppress_sequences=SUPPRESS,
        )
        for i, result in zip(batch, results):
            outputs[i] = result.hypotheses[0]
    return outputs
"""

_CTRANSLATE2_CODE = (
    '''\
# python translate.py EXPORT_DIR [BEAM] < input.txt > output.txt   (one sentence per line)
import sys

import ctranslate2
import sentencepiece

BEAM, LENGTH_PENALTY = {beam}, {length_penalty}  # tmt's decode.beam_size, decode.length_penalty
A, B, POSITIONS = {a}, {b}, {positions}  # decode.max_len_a, decode.max_len_b, model.max_positions
SUPPRESS = [[{pad!r}], [{bos!r}]]  # padding and start pieces are never output


def translate(directory, lines, beam=BEAM, length_penalty=LENGTH_PENALTY, device="cpu"):
    """The pieces of each line's translation ([] for an empty line)."""
    sp = sentencepiece.SentencePieceProcessor(model_file=f"{{directory}}/sentencepiece.model")
    model = ctranslate2.Translator(directory, device=device)
    pieces = [sp.encode(line, out_type=str)[: POSITIONS - 1] for line in lines]
'''
    + _DECODE_BY_LIMIT
    + """

if __name__ == "__main__":
    directory = sys.argv[1]
    sp = sentencepiece.SentencePieceProcessor(model_file=f"{{directory}}/sentencepiece.model")
    lines = sys.stdin.read().split("\\n")
    if lines[-1] == "":
        lines.pop()
    beam = int(sys.argv[2]) if len(sys.argv) > 2 else BEAM  # 1: tmt's greedy output, exactly
    for output in translate(directory, lines, beam=beam):
        text = sp.decode(output).replace("\\r", " ").replace("\\n", " ")  # one line out per line in
        sys.stdout.write(text + "\\n")
"""
)

# An imported Marian (OPUS-MT) model: MarianTokenizer's pieces from source.spm, its vocabularies in
# CTranslate2's vocabulary files, the text of the target pieces from target.spm.
_CTRANSLATE2_MARIAN_CODE = (
    '''\
# python translate.py EXPORT_DIR [BEAM] < input.txt > output.txt   (one sentence per line)
import re
import sys

import ctranslate2
import sentencepiece

BEAM, LENGTH_PENALTY = {beam}, {length_penalty}  # tmt's decode.beam_size, decode.length_penalty
A, B, POSITIONS = {a}, {b}, {positions}  # decode.max_len_a, decode.max_len_b, model.max_positions
SUPPRESS = {suppress!r}  # never output
SPECIAL = {special!r}  # one piece where typed; dropped from outputs
TARGET_LANG = {target_lang!r}  # a multi-target model's target language: >>xxx<< first ("": none)
CLEAN_UP = {clean_up!r}  # the tokenizer's clean_up_tokenization_spaces
SPLIT = re.compile("(" + "|".join(map(re.escape, sorted(SPECIAL, key=len, reverse=True))) + ")")


def source_pieces(sp, line):
    """MarianTokenizer's pieces: special tokens and a leading >>xxx<< whole, the rest cut by sp."""
    pieces = []
    for part in SPLIT.split(line):
        if part in SPECIAL:
            pieces.append(part)
        elif part:
            end = part.find("<<") + 2 if part.startswith(">>") and "<<" in part else 0
            pieces += ([part[:end]] if end else []) + sp.encode(part[end:], out_type=str)
    return pieces


def text(sp, pieces):
    """MarianTokenizer.decode(skip_special_tokens=True) of target pieces."""
    out = sp.decode_pieces([p for p in pieces if p not in SPECIAL]).replace("\u2581", " ").strip()
    for old, new in CLEAN_UP:
        out = out.replace(old, new)
    return out


def translate(directory, lines, beam=BEAM, length_penalty=LENGTH_PENALTY, device="cpu"):
    """The target pieces of each line's translation ([] for an empty line)."""
    sp = sentencepiece.SentencePieceProcessor(model_file=f"{{directory}}/source.spm")
    model = ctranslate2.Translator(directory, device=device)
    pieces = []
    for line in lines:
        found = source_pieces(sp, line)
        if found and TARGET_LANG:
            found = [f">>{{TARGET_LANG}}<<", *found]
        pieces.append(found[: POSITIONS - 1])
'''
    + _DECODE_BY_LIMIT
    + """

if __name__ == "__main__":
    directory = sys.argv[1]
    target = sentencepiece.SentencePieceProcessor(model_file=f"{{directory}}/target.spm")
    lines = sys.stdin.read().split("\\n")
    if lines[-1] == "":
        lines.pop()
    beam = int(sys.argv[2]) if len(sys.argv) > 2 else BEAM  # 1: tmt's greedy output, exactly
    for output in translate(directory, lines, beam=beam):
        sys.stdout.write(text(target, output).replace("\\r", " ").replace("\\n", " ") + "\\n")
"""
)

_CTRANSLATE2_README = """\
# {origin}: a CTranslate2 model exported by tmt {version}

{src} → {tgt}. This directory is all you need: the CTranslate2 model (`model.bin`, `config.json`,
its vocabularies), the {tokenizer_files} that turn text into its pieces and back, and
`tmt_export.json` (what was exported and checked).

    pip install ctranslate2 sentencepiece

The code below translates stdin to stdout. With `beam=1` it gives tmt's greedy output exactly:
`tmt export` ran this very code on {check_lines} validation lines and found every output
token-identical to tmt's. With a beam it uses CTranslate2's length penalty, score / |Y|^α (tmt's
`decode.length_penalty_form=power`; the model was trained and validated with
`{form}`), and CTranslate2's stopping rule, so a few lines may differ from tmt's beam search.

What makes it tmt's: the source is the sentencepiece pieces of the line, at most POSITIONS - 1
of them (CTranslate2 appends the end of sentence, `add_source_eos`); the output has at most
min(A · |source| + B, POSITIONS) - 1 pieces before its end; `min_decoding_length=0` (tmt may
output nothing; CTranslate2's default forbids it); the padding and start pieces are suppressed; an
empty line gives an empty line.

```python
{code}```

With tmt installed, `tmt translate -m THIS_DIRECTORY` (also `evaluate` and `serve`) decodes it with
its CTranslate2 engine, after checking the files against the checksums in `tmt_export.json`.
"""

_HUGGINGFACE_README = """\
# {origin}: a Hugging Face model exported by tmt {version}

{src} → {tgt}, a `{architecture}` with its tokenizer ({hf_tokenizer}). Load it with the Auto
classes:

    pip install torch transformers tokenizers

`tmt export` checked that greedy generation with these options gives tmt's output on
{check_lines} validation lines, token for token. With a beam, `generate`'s length penalty is
score / |Y|^α (tmt's `decode.length_penalty_form=power`; the model was trained and validated with
`{form}`), and its stopping rule is its own, so a few lines may differ from tmt's beam search.

```python
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

directory = "{directory}"  # this directory
A, B, POSITIONS = {a}, {b}, {positions}  # decode.max_len_a, decode.max_len_b, model.max_positions
TARGET_LANG = {target_lang!r}  # a multi-target model's target language: >>xxx<< first ("": none)
tokenizer = AutoTokenizer.from_pretrained(directory)
model = AutoModelForSeq2SeqLM.from_pretrained(directory).eval()


def translate(line, beam={beam}, length_penalty={length_penalty}):
    if TARGET_LANG and line.strip():
        line = f">>{{TARGET_LANG}}<< {{line}}"
    ids = tokenizer(line)["input_ids"]  # the pieces' ids and </s>
    if len(ids) == 1:
        return ""  # an empty line gives an empty line
    ids = ids[: POSITIONS - 1] + ids[-1:] if len(ids) > POSITIONS else ids
    limit = min(int(A * (len(ids) - 1) + B), POSITIONS)  # tmt's length limit, </s> included
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]), num_beams=beam, do_sample=False,
            length_penalty=length_penalty, max_new_tokens=limit - 1,
            bad_words_ids={bad_words}, forced_eos_token_id=None,
        )
    return tokenizer.decode(out[0], skip_special_tokens=True).replace("\\n", " ")


print(translate("{example}", beam=1))
```
"""


VMAP_NOTE = """
## Its lexical shortlist (`vmap.txt`)

This export carries the model's lexical shortlist as CTranslate2's vocabulary map: pass
`use_vmap=True` to `translate_batch` to score only each batch's candidate pieces (faster on a
large vocabulary; CTranslate2 takes the union of the batch's candidates, so a line's output may
depend on the lines beside it). tmt decodes it with `tmt translate -m THIS_DIR --engine
ctranslate2 --shortlist auto`.
"""


def _values(translator: Translator) -> dict[str, Any]:
    cfg, tok = translator.config, translator.tokenizer
    marian = tok.kind == "marian"
    return {
        "beam": cfg.decode.beam_size, "length_penalty": cfg.decode.length_penalty,
        "form": cfg.decode.length_penalty_form, "a": cfg.decode.max_len_a,
        "b": cfg.decode.max_len_b, "positions": cfg.model.max_positions,
        "pad": tok.id_to_piece(tok.pad_id), "bos": tok.id_to_piece(max(tok.bos_id, 0)),
        "bad_words": [[token] for token in tok.never_output],
        "suppress": [[tok.id_to_piece(token)] for token in tok.never_output],
        "special": list(dict.fromkeys(tok.special_tokens)) if marian else [],
        "clean_up": _CLEAN_UP if marian and tok.settings["clean_up_tokenization_spaces"] else [],
        "target_lang": cfg.decode.target_lang, "src": cfg.data.src_lang,
        "tgt": cfg.data.tgt_lang, "origin": translator.origin,
        "tokenizer_files": "sentencepiece models (`source.spm`, `target.spm`) and vocabularies"
        " (`vocab.json`)" if marian else "sentencepiece model (`sentencepiece.model`)",
        "hf_tokenizer": "MarianTokenizer: the model's `source.spm`, `target.spm` and `vocab.json`"
        " as imported" if marian else "`tokenizer.json`: tmt's sentencepiece pieces and ids",
    }  # fmt: skip


_CLEAN_UP = [[" .", "."], [" ?", "?"], [" !", "!"], [" ,", ","], [" ' ", "'"], [" n't", "n't"],
             [" 'm", "'m"], [" 's", "'s"], [" 've", "'ve"], [" 're", "'re"]]  # fmt: skip


def ctranslate2_code(translator: Translator) -> str:
    """The CTranslate2 recipe with this model's values: a script, and `translate()`."""
    marian = translator.tokenizer.kind == "marian"
    code = _CTRANSLATE2_MARIAN_CODE if marian else _CTRANSLATE2_CODE
    return code.format(**_values(translator))


def ctranslate2_readme(translator: Translator, check_lines: int, version: str) -> str:
    code = ctranslate2_code(translator)
    values = _values(translator)
    return _CTRANSLATE2_README.format(code=code, check_lines=check_lines, version=version, **values)


def huggingface_readme(
    translator: Translator, architecture: str, check_lines: int, version: str, example: str
) -> str:
    return _HUGGINGFACE_README.format(
        architecture=architecture, check_lines=check_lines, version=version,
        directory=".", example=example.replace("\\", "\\\\").replace('"', '\\"'),
        **_values(translator),
    )  # fmt: skip


def python_block(readme: str) -> str:
    """The code of a README's ```python block."""
    start = readme.index("```python\n") + len("```python\n")
    return readme[start : readme.index("```", start)]


def run_ctranslate2_recipe(
    code: str, directory: str, lines: list[str], beam: int
) -> list[list[str]]:
    """`translate()` of the recipe `code`, as the README gives it."""
    namespace: dict[str, Any] = {"__name__": "tmt_recipe"}
    exec(compile(code, "README.md", "exec"), namespace)  # tmt's own text, never a file read back
    return namespace["translate"](directory, lines, beam=beam)
