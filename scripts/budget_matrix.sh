#!/usr/bin/env bash
# Issue 24's measurement: the default preset (Multi30k) trained for a budget in updates (so any
# machine reproduces it) with the paper's schedule or the budget schedule, each with and without
# subword regularization (BPE-dropout 0.1 on the source); the last checkpoints averaged, scored
# on the validation split (choose there) and on test_2016_flickr (beam 5, report once).
#   bash scripts/budget_matrix.sh                      # de→en, 630 and 2,100 updates, 4 variants
#   PAIR=en-de STEPS=2100 VARIANTS=budget bash scripts/budget_matrix.sh
# Results: runs/budget/<pair>_<variant>_<steps>/{train.json,valid.json,test.json}; a table on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
TMT=${TMT:-.venv/bin/tmt}
PAIR=${PAIR:-de-en}
STEPS=${STEPS:-630 2100}
VARIANTS=${VARIANTS:-noam budget noam_sr budget_sr}
src=${PAIR%-*}; tgt=${PAIR#*-}
mkdir -p runs/budget
settings() {
  case $1 in
    noam) echo "--set optim.schedule=noam" ;;
    budget) echo "--set optim.schedule=budget" ;;
    noam_sr) echo "--set optim.schedule=noam --set data.subword_alpha=0.1" ;;
    budget_sr) echo "--set optim.schedule=budget --set data.subword_alpha=0.1" ;;
    *) echo "unknown variant $1" >&2; exit 2 ;;
  esac
}
for steps in $STEPS; do
  for variant in $VARIANTS; do
    run=runs/budget/${PAIR}_${variant}_${steps}
    if [ ! -f "$run/test.json" ]; then
      # shellcheck disable=SC2046
      "$TMT" train -c multi30k --set data.src_lang="$src" --set data.tgt_lang="$tgt" \
        $(settings "$variant") --set train.max_minutes=0 --set train.max_steps="$steps" \
        --set train.out_dir="$run" --json > "$run.train.json"
      mv "$run.train.json" "$run/train.json"
      "$TMT" evaluate -m "$run/average" --split valid --json > "$run/valid.json"
      "$TMT" evaluate -m "$run/average" --split test --json > "$run/test.json"
    fi
  done
done
printf 'pair\tupdates\tvariant\tvalid BLEU\tvalid chrF\ttest BLEU\ttest chrF\n'
for steps in $STEPS; do
  for variant in $VARIANTS; do
    run=runs/budget/${PAIR}_${variant}_${steps}
    python3 -c 'import json, sys
v, t = (json.load(open(f"{sys.argv[1]}/{s}.json")) for s in ("valid", "test"))
print("\t".join([sys.argv[2], sys.argv[3], sys.argv[4]] + ["%.2f" % x for x in (v["bleu"], v["chrf"], t["bleu"], t["chrf"])]))' \
      "$run" "$PAIR" "$steps" "$variant"
  done
done
