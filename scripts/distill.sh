#!/usr/bin/env bash
# `make distill`: fast students on Multi30k de→en, measured against their teacher. All runs use the
# 2,100-update recipe of scripts/budget_matrix.sh and make demo (the budget schedule, dropout 0.1,
# the last 3 checkpoints averaged, α 1.0):
#   teacher            the default preset's shape (4 encoder + 4 decoder layers) on the references
#                      (TEACHER=DIR uses a model trained so already)
#   student_refs       configs/student.yaml (6 encoder layers + 1 decoder layer) on the references
#   student_distilled  the same student trained by `tmt distill` on the teacher's translations
#                      (beam 4, of its 4 best the one nearest the reference by sentence chrF)
# then scripts/bench_decode.py decodes the validation split (where choices are made) and
# test_2016_flickr (reported) with every model, greedy and beam 4, tmt's engine and CTranslate2,
# fp32 and int8, in one run each: BLEU, chrF, sentences/s. Every step resumes when run again.
#   bash scripts/distill.sh
#   STEPS=630 OUT=runs/distill_630 bash scripts/distill.sh        # a quicker look
# -h, --help: the comment above. Its settings come from the environment, not arguments.
NO_ARGS=1 . "$(dirname "$0")/args.sh"
set -euo pipefail
cd "$(dirname "$0")/.."
TMT=${TMT:-.venv/bin/tmt}
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-2100}
OUT=${OUT:-runs/distill}
mkdir -p "$OUT"
recipe=(--set model.dropout=0.1 --set optim.schedule=budget --set train.average_last=3
        --set decode.length_penalty=1.0 --set train.max_minutes=0 --set train.max_steps="$STEPS")
teacher=${TEACHER:-$OUT/teacher}
if [ -z "${TEACHER:-}" ]; then
  "$TMT" train -c multi30k "${recipe[@]}" --set train.out_dir="$teacher" --json > "$OUT/teacher.train.json"
fi
"$TMT" train -c student "${recipe[@]}" --set train.out_dir="$OUT/student_refs" \
  --json > "$OUT/student_refs.train.json"
"$TMT" distill -m "$teacher" -c student "${recipe[@]}" -o "$OUT/distilled" --json \
  > "$OUT/distilled.json"
models=(--model "teacher=$teacher" --model "student_refs=$OUT/student_refs"
        --model "student_distilled=$OUT/distilled/student")
for split in valid test; do
  [ -f "$OUT/bench_$split.json" ] && continue
  "$PY" scripts/bench_decode.py "${models[@]}" --split "$split" | tee "$OUT/bench_$split.log"
  tail -1 "$OUT/bench_$split.log" > "$OUT/bench_$split.json"
done
