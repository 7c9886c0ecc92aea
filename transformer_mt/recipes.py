"""What an exported directory says about itself: a README.md with the code that translates with the
export alone (ctranslate2 + sentencepiece, or transformers), with the options that reproduce tmt.

The CTranslate2 recipe is not only documentation: `tmt export` runs that very code (the python
block of the README) through the directory's own sentencepiece.model for its parity check, and a
test runs it as a script in a process without tmt. Values (beam, length penalty, the maximum
length rule, special pieces) are the model's, written into the recipe.
"""

from __future__ import annotations

from typing import Any

from transformer_mt.translate import Translator

README_FILE = "README.md"

_CTRANSLATE2_CODE = '''\
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
'''

_CTRANSLATE2_README = """\
# {origin}: a CTranslate2 model exported by tmt {version}

{src} → {tgt}. This directory is all you need: the CTranslate2 model (`model.bin`, `config.json`,
`shared_vocabulary.json`), the sentencepiece model that turns text into its pieces
(`sentencepiece.model`), and `tmt_export.json` (what was exported and checked).

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

{src} → {tgt}, a `{architecture}` with its tokenizer (`tokenizer.json`: tmt's sentencepiece
pieces and ids). Load it with the Auto classes:

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
tokenizer = AutoTokenizer.from_pretrained(directory)
model = AutoModelForSeq2SeqLM.from_pretrained(directory).eval()


def translate(line, beam={beam}, length_penalty={length_penalty}):
    ids = tokenizer(line)["input_ids"]  # the pieces' ids and </s>
    if len(ids) == 1:
        return ""  # an empty line gives an empty line
    ids = ids[: POSITIONS - 1] + ids[-1:] if len(ids) > POSITIONS else ids
    limit = min(int(A * (len(ids) - 1) + B), POSITIONS)  # tmt's length limit, </s> included
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]), num_beams=beam, do_sample=False,
            length_penalty=length_penalty, max_new_tokens=limit - 1,
            bad_words_ids=[[{pad_id}], [{bos_id}]], forced_eos_token_id=None,
        )
    return tokenizer.decode(out[0], skip_special_tokens=True).replace("\\n", " ")


print(translate("{example}", beam=1))
```
"""


def _values(translator: Translator) -> dict[str, Any]:
    cfg, tok = translator.config, translator.tokenizer
    return {
        "beam": cfg.decode.beam_size, "length_penalty": cfg.decode.length_penalty,
        "form": cfg.decode.length_penalty_form, "a": cfg.decode.max_len_a,
        "b": cfg.decode.max_len_b, "positions": cfg.model.max_positions,
        "pad": tok._sp.id_to_piece(tok.pad_id), "bos": tok._sp.id_to_piece(tok.bos_id),
        "pad_id": tok.pad_id, "bos_id": tok.bos_id, "src": cfg.data.src_lang,
        "tgt": cfg.data.tgt_lang, "origin": translator.origin,
    }  # fmt: skip


def ctranslate2_code(translator: Translator) -> str:
    """The CTranslate2 recipe with this model's values: a script, and `translate()`."""
    return _CTRANSLATE2_CODE.format(**_values(translator))


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
