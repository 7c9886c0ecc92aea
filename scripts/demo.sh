#!/usr/bin/env bash
# `make demo`: train the default config (Multi30k de→en) for a bounded time, average its last
# checkpoints, show a few translations of the bundled test set, and score the whole test set.
set -euo pipefail
cd "$(dirname "$0")/.."
TMT=${TMT:-.venv/bin/tmt}
MINUTES=${MINUTES:-10}
run=${RUN:-runs/demo}
"$TMT" train --set train.out_dir="$run" --set train.max_minutes="$MINUTES" --set train.average_last=5
echo
echo "A few translations of test_2016_flickr (source, tmt, reference):"
test=transformer_mt/multi30k/test_2016_flickr
paste <(zcat "$test.de.gz" | head -5) <(zcat "$test.de.gz" | head -5 | "$TMT" translate -m "$run/average") \
      <(zcat "$test.en.gz" | head -5) | awk -F'\t' '{print "  de:  " $1 "\n  tmt: " $2 "\n  ref: " $3 "\n"}'
"$TMT" evaluate -m "$run/average" --split test
