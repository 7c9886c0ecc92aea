#!/usr/bin/env bash
# What one line far longer than any model reads costs each command (docs/reliability.md P83-P85):
# this tmt against an earlier checkout of it, in turn, seconds and peak memory of each, and the
# ratio. Then the same commands on the sample without the long line, for what is left.
#
#   bash scripts/bench_long_line.sh RUN_DIR [OLD_CHECKOUT]    # e.g. runs/multi30k /tmp/old
#
# OLD_CHECKOUT is a checkout of an earlier tmt (git worktree add /tmp/old REV), run with this
# .venv. Each command is bounded by LIMIT seconds (default 300): a slower one is reported killed.
# The inputs: one line of CHARS characters ("Hund " repeated, default 2 * 10^8), and the first
# 2,000 pairs of Multi30k's train with one line of 10^7 "Hund " (50 MB) added.
# -h, --help: the comment above.
. "$(dirname "$0")/args.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
run_dir=$(realpath "${1:?usage: bench_long_line.sh RUN_DIR [OLD_CHECKOUT]}")
old=${2:+$(realpath "$2")}
limit=${LIMIT:-300}
chars=${CHARS:-200000000}
python=$repo/.venv/bin/python
work=$(mktemp -d "${TMPDIR:-/tmp}/tmt-long-line.XXXXXX")
trap 'rm -rf "$work"' EXIT

$python - "$work" "$chars" <<'EOF'
import gzip, sys
work, chars = sys.argv[1], int(sys.argv[2])
with open(f"{work}/huge.txt", "w") as f:
    f.write("Hund " * (chars // 5))
for side, long in (("de", "Hund " * 10_000_000), ("en", "a dog")):
    with gzip.open(f"transformer_mt/multi30k/train.{side}.gz", "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(2000)]
    open(f"{work}/short.{side}", "w", encoding="utf-8").writelines(lines)
    open(f"{work}/long.{side}", "w", encoding="utf-8").writelines([*lines, long + "\n"])
EOF
printf 'Hund\tdog\n' > "$work/glossary.tsv"
$python -c 'print("Ein Hund läuft über die Wiese.")' > "$work/one.txt"

# seconds and peak GiB of one command, or "killed" past the limit. Run from $work: python -m puts
# the working directory first on the path, and the repository's would shadow OLD_CHECKOUT.
measure() {
    local pythonpath=$1; shift
    local out="$work/time.txt"
    if (cd "$work" && PYTHONPATH=$pythonpath timeout "$limit" /usr/bin/time -f "%e %M" -o "$out" \
        "$python" -m transformer_mt "$@" >/dev/null 2>&1); then
        awk '{printf "%.1f s, %.2f GiB", $1, $2 / 1048576}' "$out"
    else
        echo "killed at $limit s"
    fi
}

data=(--set data.source=files --set data.valid=$repo/transformer_mt/multi30k/val
      --set data.test=$repo/transformer_mt/multi30k/test_2016_flickr)
commands=(
    "translate|translate -m $run_dir --beam 1 -i $work/huge.txt"
    "translate --glossary|translate -m $run_dir --beam 1 -i $work/huge.txt --glossary $work/glossary.tsv"
    "train --dry-run|train -c tiny ${data[*]} --set data.train=$work/long --set train.out_dir=$work/run --dry-run"
    "shortlist|shortlist -m $run_dir -i $work/long.de --ref $work/long.en -o $work/sl --overwrite --aligner ibm1"
    "terms|terms -c tiny ${data[*]} --set data.train=$work/long -o $work/terms.tsv --overwrite"
)
echo "| command | this tmt | ${old:+earlier tmt ($old) |} without the long line |"
echo "|---|---|${old:+---|}---|"
for entry in "${commands[@]}"; do
    name=${entry%%|*}; args=${entry#*|}
    # shellcheck disable=SC2086
    new=$(TMT_CACHE="$work/cache-new" measure "" $args)
    before=""
    if [ -n "$old" ]; then
        # shellcheck disable=SC2086
        before="$(TMT_CACHE="$work/cache-old" measure "$old" $args) |"
    fi
    short=${args//$work\/huge.txt/$work\/one.txt}
    short=${short//$work\/long/$work\/short}
    # shellcheck disable=SC2086
    alone=$(TMT_CACHE="$work/cache-short" measure "" $short)
    echo "| $name | $new | $before $alone |"
done
