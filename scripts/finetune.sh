#!/usr/bin/env bash
# Fine-tuning end to end on Multi30k de→en (the bundled corpus, CPU). A parent model is trained on
# the first PART training pairs; then two children start from its weights and tokenizer with a
# fresh optimizer (tmt train --init-from): one on the other training pairs, new to the parent; one
# on the parent's own pairs for as many updates, the control (more updates, no new data). Each is
# scored on test_2016_flickr (beam 5, sacreBLEU). Results: runs/finetune/{parent,new,control}.json,
# the summary table on stdout, and the three runs' curves in runs/finetune/curves.png.
#   bash scripts/finetune.sh
#   PARENT_STEPS=300 CHILD_STEPS=200 bash scripts/finetune.sh    # a quicker look
# -h, --help: the comment above. Its settings come from the environment, not arguments.
NO_ARGS=1 . "$(dirname "$0")/args.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
TMT=${TMT:-.venv/bin/tmt}
OUT=${OUT:-runs/finetune}
PART=${PART:-10000}
PARENT_STEPS=${PARENT_STEPS:-600}
CHILD_STEPS=${CHILD_STEPS:-400}
mkdir -p "$OUT/data"
for lang in de en; do
  gzip -dc "transformer_mt/multi30k/train.$lang.gz" | sed -n "1,${PART}p" > "$OUT/data/part.$lang"
  gzip -dc "transformer_mt/multi30k/train.$lang.gz" | tail -n "+$((PART + 1))" > "$OUT/data/new.$lang"
done
# The preset's model and schedule, step budgets instead of its 30 minutes (the same result on any
# machine); validation and test stay the bundled Multi30k splits.
common=(-c multi30k --set train.max_minutes=0 --set train.save_every=50 --set train.bleu_every=100)
"$TMT" train "${common[@]}" --set train.out_dir="$OUT/parent" --set train.max_steps="$PARENT_STEPS" \
  --set "data.train=[{split: $OUT/data/part, source: files}]" --json > "$OUT/parent.train.json"
"$TMT" evaluate -m "$OUT/parent" --json > "$OUT/parent.json"
# Fine-tuning: a fresh, shorter warmup to half the preset's peak learning rate.
for child in new control; do
  data=$([ "$child" = new ] && echo new || echo part)
  "$TMT" train "${common[@]}" --init-from "$OUT/parent" --set train.out_dir="$OUT/$child" \
    --set train.max_steps="$CHILD_STEPS" --set optim.warmup_steps=200 --set optim.lr_scale=0.5 \
    --set train.average_last=4 --set "data.train=[{split: $OUT/data/$data, source: files}]" \
    --json > "$OUT/$child.train.json"
  "$TMT" evaluate -m "$OUT/$child" --json > "$OUT/$child.json"
done
"$TMT" plot -m "$OUT/parent" -m "$OUT/new" -m "$OUT/control" -o "$OUT/curves.png" --overwrite \
  > /dev/null
for run in parent new control; do
  printf '%s\t' "$run"
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("BLEU %.2f\tchrF %.2f\t%s" % (r["bleu"], r["chrf"], r["signature"]))' "$OUT/$run.json"
done
