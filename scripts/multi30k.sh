#!/usr/bin/env bash
# Multi30k quality recipe: train de→en and en→de on the bundled corpus (at most MINUTES each, CPU),
# the learning rate planned for the time (optim.schedule=budget, which beats the paper's schedule
# at 630 and 2,100 updates: docs/benchmarks.md), average the last 3 checkpoints, decode
# test_2016_flickr with beam 5 and α 1.0, and report sacreBLEU, chrF and lowercased BLEU.
# Results: runs/multi30k_<src>-<tgt>/test.json; the summary table on stdout.
#   bash scripts/multi30k.sh            # both directions, 30 minutes each
#   MINUTES=10 bash scripts/multi30k.sh de-en
# -h, --help: the comment above. Its settings come from the environment, not arguments.
NO_ARGS=1 . "$(dirname "$0")/args.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
TMT=${TMT:-.venv/bin/tmt}
MINUTES=${MINUTES:-30}
directions=${*:-de-en en-de}
for pair in $directions; do
  src=${pair%-*}; tgt=${pair#*-}
  run=runs/multi30k_${src}-${tgt}
  echo "== ${src}→${tgt}: training for at most ${MINUTES} minutes into ${run}" >&2
  # The paper's dropout 0.1 in both directions: with the preset's 0.3 they under-fit in 30 minutes
  # (en→de lowercased BLEU 37.59 against 39.46; de→en at 2,100 updates validation BLEU 41.37
  # against 41.87); length penalty α 1.0, not the paper's 0.6: +0.2 to +0.8 validation BLEU in
  # every 630- and 2,100-update run of scripts/budget_matrix.sh (docs/benchmarks.md).
  "$TMT" train -c multi30k --set data.src_lang="$src" --set data.tgt_lang="$tgt" --set model.dropout=0.1 \
    --set optim.schedule=budget --set train.average_last=3 --set decode.length_penalty=1.0 \
    --set train.out_dir="$run" --set train.max_minutes="$MINUTES" --json > "$run.train.json"
  "$TMT" evaluate -m "$run/average" --split test --json > "$run/test.json"
done
for pair in $directions; do
  printf '%s\t' "$pair"
  python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print("BLEU %.2f\tchrF %.2f\tBLEU(lc) %.2f\t%s" % (r["bleu"], r["chrf"], r["bleu_lc"], r["signature"]))' \
    "runs/multi30k_${pair}/test.json"
done
