#!/usr/bin/env bash
# A MarianMTModel parent for scripts/finetune_pretrained.sh where no model hub is reachable: a
# small model of OPUS-MT's make (post-norm, swish, output bias, decoding from <pad>, Marian's
# tokenizer: two sentencepiece models and a joint vocabulary) written by transformers with random
# weights, imported into tmt, trained on the first PART Multi30k de→en pairs for MINUTES, and
# exported back to a MarianMTModel directory (tmt export: transformers' own save_pretrained).
# The pairs after PART are left for the child: OUT/data/rest.{de,en}.
#   bash scripts/marian_parent.sh [OUT]      # then: TRAIN=OUT/data/rest ... finetune_pretrained.sh
# -h, --help: the comment above.
. "$(dirname "$0")/args.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
TMT=${TMT:-.venv/bin/tmt}
PY=${PY:-.venv/bin/python}
OUT=${1:-runs/marian_parent}
PART=${PART:-10000}
MINUTES=${MINUTES:-20}
mkdir -p "$OUT/data"
for lang in de en; do
  gzip -dc "transformer_mt/multi30k/train.$lang.gz" | sed -n "1,${PART}p" > "$OUT/data/part.$lang"
  gzip -dc "transformer_mt/multi30k/train.$lang.gz" | tail -n "+$((PART + 1))" > "$OUT/data/rest.$lang"
done
[ -f "$OUT/random/config.json" ] || "$PY" -c 'import sys; sys.path.insert(0, "tests")
import pathlib, marian_models
marian_models.random_marian(pathlib.Path(sys.argv[1]), d_model=256, layers=3, heads=4, ffn=1024,
                            vocab_size=12000)' "$OUT/random"
[ -f "$OUT/imported/manifest.json" ] || "$TMT" import -m "$OUT/random" -o "$OUT/imported"
# From random weights: the paper's peak (lr_scale 1 at d_model 256, warmup 800) fitted to the
# time, dropout 0.1; the tokenizer is the random model's.
"$TMT" train -c "$OUT/imported/config.yaml" --init-from "$OUT/imported" \
  --set train.out_dir="$OUT/run" --set data.source=files --set data.train="$OUT/data/part" \
  --set data.valid=transformer_mt/multi30k/val --set train.max_steps=100000 \
  --set train.max_minutes="$MINUTES" --set optim.warmup_steps=800 --set optim.lr_scale=1.0 \
  --set train.patience=0 --set train.bleu_every=300 --set train.valid_every=300 \
  --set train.save_every=100 --set train.keep_last=3 --set train.average_last=3 --json \
  > "$OUT/run.json"
[ -f "$OUT/hf/tmt_export.json" ] || "$TMT" export -m "$OUT/run" --format huggingface \
  -o "$OUT/hf" --check-lines 200
echo "parent: $OUT/hf (a MarianMTModel directory)"
