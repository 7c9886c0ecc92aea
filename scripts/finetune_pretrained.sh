#!/usr/bin/env bash
# Fine-tune a published Marian model (an OPUS-MT Hugging Face MarianMTModel directory) on your own
# corpus, end to end: import it, score it, fine-tune it, score the child against the parent with
# sacreBLEU's paired tests, export the child to CTranslate2 and Hugging Face.
#
#   hf download Helsinki-NLP/opus-mt-de-en --local-dir opus-mt-de-en   # once, with internet
#   bash scripts/finetune_pretrained.sh opus-mt-de-en runs/opus-de-en
#
# The corpus: TRAIN, VALID and TEST are path prefixes (PREFIX.SRC and PREFIX.TGT, plain or .gz);
# by default the bundled Multi30k (train, val, test_2016_flickr), for models whose languages it
# has (en, de, fr). GENERAL=PREFIX mixes pairs the model already knows into every epoch
# (GENERAL_WEIGHT of it, 0.2) against forgetting. The recipe (README, "Start from a published
# model"): LR, the peak learning rate (5e-5), reached after WARMUP updates (200), held, then
# decayed over the last fifth of STEPS (2000) or MINUTES, whichever ends first; validation BLEU
# every 200 updates, early stopping after 3 without a better one, the last 5 checkpoints averaged.
# TARGET_LANG: a multi-target model's target language (its >>xxx<< token, put first).
# Each step is skipped when its output exists, and an interrupted fine-tuning resumes: run the
# same command again. Results: OUT/comparison.json (and the table on stdout).
# -h, --help: the comment above.
. "$(dirname "$0")/args.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 HF_MODEL_DIR [OUT]" >&2; exit 2; }
TMT=${TMT:-.venv/bin/tmt}
PY=${PY:-.venv/bin/python}
HF=$1
OUT=${2:-runs/finetune_pretrained}
STEPS=${STEPS:-2000}
MINUTES=${MINUTES:-0}
LR=${LR:-5e-5}
WARMUP=${WARMUP:-200}
GENERAL_WEIGHT=${GENERAL_WEIGHT:-0.2}
mkdir -p "$OUT/data"

# 1. The model as tmt holds it (its config.yaml: what fine-tuning starts from).
[ -f "$OUT/parent/manifest.json" ] || "$TMT" import -m "$HF" -o "$OUT/parent"
read -r SRC TGT D_MODEL < <("$PY" -c 'import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
print(c["data"]["src_lang"], c["data"]["tgt_lang"], c["model"]["d_model"])' "$OUT/parent/config.yaml")
SRC=${SRC_LANG:-$SRC}
TGT=${TGT_LANG:-$TGT}

# 2. The corpus, and the test set as plain text.
if [ -n "${TRAIN:-}" ]; then
  data=(--set data.source=files --set "data.valid=${VALID:?VALID: the validation prefix}")
  train=$TRAIN
  test=${TEST:?TEST: the test prefix}
else
  data=(--set data.source=files --set "data.valid=transformer_mt/multi30k/val")
  train=transformer_mt/multi30k/train
  test=transformer_mt/multi30k/test_2016_flickr
fi
if [ -n "${GENERAL:-}" ]; then
  data+=(--set "data.train=[{split: $train, weight: 1}, {split: $GENERAL, weight: $GENERAL_WEIGHT}]")
else
  data+=(--set "data.train=$train")
fi
data+=(--set "data.src_lang=$SRC" --set "data.tgt_lang=$TGT")
flags=()
[ -z "${TARGET_LANG:-}" ] || { data+=(--set "decode.target_lang=$TARGET_LANG"); flags+=(--target-lang "$TARGET_LANG"); }
for side in "$SRC" "$TGT"; do
  file=$(ls "$test.$side" "$test.$side.gz" 2>/dev/null | head -1 || true)
  [ -n "$file" ] || { echo "no $test.$side(.gz)" >&2; exit 2; }
  case $file in *.gz) gzip -dc "$file" ;; *) cat "$file" ;; esac > "$OUT/data/test.$side"
done

# 3. The parent's translations of the test set.
[ -s "$OUT/parent.$TGT" ] || "$TMT" translate -m "$OUT/parent" "${flags[@]}" \
  -i "$OUT/data/test.$SRC" -o "$OUT/parent.$TGT" --overwrite

# 4. Fine-tuning: the import's recipe at peak LR (optim.lr_scale · d_model^-0.5 · warmup^-0.5).
scale=$("$PY" -c "print(round($LR * ($D_MODEL * $WARMUP) ** 0.5, 6))")
"$TMT" train -c "$OUT/parent/config.yaml" --init-from "$OUT/parent" "${data[@]}" \
  --set train.out_dir="$OUT/child" --set train.max_steps="$STEPS" \
  --set train.max_minutes="$MINUTES" --set optim.warmup_steps="$WARMUP" \
  --set optim.lr_scale="$scale" --json > "$OUT/child.train.json"
"$TMT" translate -m "$OUT/child" "${flags[@]}" -i "$OUT/data/test.$SRC" -o "$OUT/child.$TGT" \
  --overwrite

# 5. The child against the parent: sacreBLEU's paired bootstrap and approximate randomization.
"$TMT" evaluate --hyp "$OUT/parent.$TGT" --hyp "$OUT/child.$TGT" --ref "$OUT/data/test.$TGT" \
  --json > "$OUT/comparison.json"
"$TMT" evaluate --hyp "$OUT/parent.$TGT" --hyp "$OUT/child.$TGT" --ref "$OUT/data/test.$TGT"

# 6. The child where users take it (each export checked against tmt before it is written).
for format in ctranslate2 huggingface; do
  [ -f "$OUT/child-$format/tmt_export.json" ] || "$TMT" export -m "$OUT/child" --format "$format" \
    -o "$OUT/child-$format" --check-lines 200 > /dev/null
done
echo "exports: $OUT/child-ctranslate2 $OUT/child-huggingface"
