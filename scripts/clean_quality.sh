#!/usr/bin/env bash
# What cleaning buys: de→en trained for STEPS updates (2,100: scripts/budget_matrix.sh's budget,
# with scripts/multi30k.sh's recipe: the budget schedule, dropout 0.1, the last 3 checkpoints
# averaged, beam 5 at α 1.0) on the clean Multi30k pairs, on the noisy corpus of
# scripts/noisy_corpus.py, and on that corpus after `tmt clean` (language identification on);
# test_2016_flickr and validation BLEU and chrF of each, and the share of the BLEU the noise cost
# that cleaning recovers. Each run resumes when the script runs again; results: runs/clean_quality/<variant>/.
#   bash scripts/clean_quality.sh
#   STEPS=630 VARIANTS="noisy cleaned" bash scripts/clean_quality.sh
# -h, --help: the comment above. Its settings come from the environment, not arguments.
NO_ARGS=1 . "$(dirname "$0")/args.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
TMT=${TMT:-.venv/bin/tmt}
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-2100}
VARIANTS=${VARIANTS:-clean noisy cleaned}
OUT=runs/clean_quality
corpus=runs/clean_bench/noisy
mkdir -p "$OUT"
[ -f "$corpus/noisy.label" ] || "$PY" scripts/noisy_corpus.py "$corpus"
data=(--set data.source=files --set data.valid=transformer_mt/multi30k/val
      --set data.test=transformer_mt/multi30k/test_2016_flickr)
[ -f "$OUT/cleaned.report.json" ] || "$TMT" clean "${data[@]}" --set data.train="$corpus/noisy" \
  --set clean.langid=true --set data.num_proc=2 -o "$OUT/cleaned" --overwrite
for variant in $VARIANTS; do
  case $variant in
    clean) train=$corpus/clean ;;
    noisy) train=$corpus/noisy ;;
    cleaned) train=$OUT/cleaned ;;
    *) echo "unknown variant $variant" >&2; exit 2 ;;
  esac
  run=$OUT/${variant}_$STEPS
  if [ ! -f "$run/test.json" ]; then
    "$TMT" train -c multi30k "${data[@]}" --set data.train="$train" --set model.dropout=0.1 \
      --set optim.schedule=budget --set train.average_last=3 --set decode.length_penalty=1.0 \
      --set train.max_minutes=0 --set train.max_steps="$STEPS" --set train.out_dir="$run" \
      --json > "$run.train.json"
    "$TMT" evaluate -m "$run/average" --split test --json > "$run/test.json.tmp"
    mv "$run/test.json.tmp" "$run/test.json"
  fi
  # The validation split, which no corpus here contains (the noisy one holds test pairs)
  if [ ! -f "$run/valid.json" ]; then
    "$TMT" evaluate -m "$run/average" --split valid --json > "$run/valid.json.tmp"
    mv "$run/valid.json.tmp" "$run/valid.json"
  fi
done
"$PY" - "$OUT" "$STEPS" $VARIANTS <<'EOF'
import json, sys
out, steps, variants = sys.argv[1], sys.argv[2], sys.argv[3:]
for split in ("test", "valid"):
    scores = {v: json.load(open(f"{out}/{v}_{steps}/{split}.json")) for v in variants}
    for v, r in scores.items():
        print(f"{split:<5} {v:<8} BLEU {r['bleu']:.2f}  chrF {r['chrf']:.2f}  ({r['signature']})")
    if {"clean", "noisy", "cleaned"} <= set(scores):
        cost = scores["clean"]["bleu"] - scores["noisy"]["bleu"]
        back = scores["cleaned"]["bleu"] - scores["noisy"]["bleu"]
        print(f"{split}: the noise cost {cost:.2f} BLEU; cleaning recovered {back:.2f}"
              + (f" ({100 * back / cost:.0f} %)" if cost > 0 else ""))
EOF
