#!/usr/bin/env bash
# Issue 48's measurement: models that take hints. On Multi30k de→en at the demo recipe's 2,100
# updates: a dictionary from data.train (tmt terms, eflomal), a plain model and one trained with
# hints on 30 % of the pairs that have a term (the same seed and updates), then
# scripts/terms_quality.py on test_2016_flickr and valid: term use, BLEU, chrF with paired tests,
# sentences/s for the plain model's none/strict and the hinted model's none/hint/strict/auto,
# with the reference-consistent, override and random-control lists of scripts/bench_terms.py.
#   bash scripts/terms_quality.sh                     # about 3 h on 2 cores (two trainings)
#   ANNOTATE=0.1 bash scripts/terms_quality.sh        # Dinu et al.'s 10 %
# Results: runs/terms/{multi30k_terms.tsv,plain_2100,hints_2100}, runs/terms_quality_{test,valid}.json
# -h, --help: the comment above. Its settings come from the environment, not arguments.
NO_ARGS=1 . "$(dirname "$0")/args.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
TMT=${TMT:-.venv/bin/tmt}
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-2100}
ANNOTATE=${ANNOTATE:-0.3}
mkdir -p runs/terms
recipe=(-c multi30k --set model.dropout=0.1 --set optim.schedule=budget --set train.average_last=3
        --set decode.length_penalty=1.0 --set train.max_minutes=0 --set "train.max_steps=$STEPS")
[ -f runs/terms/multi30k_terms.tsv ] || $TMT terms -c multi30k -o runs/terms/multi30k_terms.tsv
# A run that is complete is reused; an unfinished one resumes (the same command).
[ -d "runs/terms/plain_$STEPS/average" ] || $TMT train "${recipe[@]}" \
  --set "train.out_dir=runs/terms/plain_$STEPS" --json > "runs/terms/plain_$STEPS.train.json"
[ -d "runs/terms/hints_$STEPS/average" ] || $TMT train "${recipe[@]}" \
  --set data.terms.dictionary=runs/terms/multi30k_terms.tsv --set "data.terms.annotate=$ANNOTATE" \
  --set "train.out_dir=runs/terms/hints_$STEPS" --json > "runs/terms/hints_$STEPS.train.json"
for split in test valid; do
  $PY scripts/terms_quality.py --plain "runs/terms/plain_$STEPS/average" \
    --hinted "runs/terms/hints_$STEPS/average" --split "$split" | tail -1 > "runs/terms_quality_$split.json"
done
