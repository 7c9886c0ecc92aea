#!/usr/bin/env bash
# Issue 60's GPU benchmark: one CUDA GPU, about 8 minutes, one table (docs/benchmarks.md keeps
# it with the date, the card and this command).
#
#   bash scripts/bench_gpu.sh                 # results and logs in runs/bench_gpu
#   STEPS=1000 bash scripts/bench_gpu.sh      # the goal's first 1,000 updates (default 200)
#   PARTS="profile compile" bash scripts/bench_gpu.sh    # the parts named (default: those of
#                                             # the 8 minutes: train e2e decode tests resume)
#   PACK=FILE bash scripts/bench_gpu.sh       # also every part's log and result in FILE (.tar.gz),
#                                             # refreshed after each part
#
# Parts, each under its own time limit (a part that runs out shows its exit status 124 in the
# table, and its log says how far it got); the default ones end in about 7 minutes (the fourth
# H200 run's took 123, 104, 92 s for e2e, decode, tests, train_graphs 94; the recipe's training
# has since dropped from 108 s to 54 with its CUDA graphs, and decode gained rows for bf16 and
# the decoder's CUDA graphs, its limit 110 s -> 150 s), their limits add up to 610 s:
#   train      bench_train.py: tmt and HF Marian, the base model (d_model 512, 6+6 layers, the
#              37k joint vocabulary of configs/base.yaml, which the bundled corpus trains) on
#              Multi30k en→de, at tmt's GPU batches (25,000 tokens, bounded shapes), bf16: the
#              first STEPS updates (every new shape in them) and WARM more over shapes seen;
#              tokens/s of real target tokens, MFU against the card's measured bf16 rate; then
#              10 warm updates profiled: the kernels' busy time against the update's wall time
#              (bound by the host or by its kernels), by kind of kernel
#   e2e        tmt train -c multi30k-gpu through torchrun (NCCL, one rank): wall time, updates,
#              then test2016 and validation BLEU (tmt evaluate)
#   decode     10,000 lines by that model at its defaults: tmt, transformers generate on tmt's
#              export, CTranslate2 on the GPU if its wheel runs there; tmt again with the
#              decoder's step as CUDA graphs (decode.cuda_graphs=on), bf16, both, and others
#   tests      tests/test_gpu.py
#   resume     configs/tiny.yaml killed after its checkpoint at step 4 and resumed: bit-exact
#   resume_graphs  the same with train.cuda_graphs=on (what making them the default waits for)
# and, when PARTS names them:
#   profile    the GPU recipe's model: its first updates (new shapes) timed one by one, then
#              the profiler's tables of new-shape and warm updates (profile.txt): where a new
#              batch shape's ~0.3 s goes
#   decode_profile  the e2e model decoding 2,500 lines (about one batch) timed, then under the
#              profiler: kernels busy against wall time (bound by the host or by which kernels),
#              the search's steps and rows a step
#   decode_profile_graphs  the same with decode.cuda_graphs=on
#   attention  tmt's first epoch of those batches with each of SDPA's kernels (model.attention_
#              backend), then the same batches again warm: what auto should choose
#   attention_graphs  the same over 20 updates with train.cuda_graphs=on: warm, the kernels'
#              own time per attention kernel (attention was 11 of a warm graphed update's 53 ms
#              on an H200)
#   train_graphs  train with tmt's step recorded as a CUDA graph per batch shape and replayed
#              (train.cuda_graphs=on), the recordings within its first updates; HF Marian as in
#              train, for the ratio
#   train_bf16_weights  train_graphs' tmt row with train.precision=bf16_weights (the model
#              bf16 throughout, Adam's float32 masters; no casts, half layer norm's traffic)
#   e2e_bf16_weights  e2e with train.precision=bf16_weights: its BLEU and wall time
#   e2e_eager  e2e with train.cuda_graphs=off: what the recipe's CUDA graphs buy
#   train_traced  train's tmt row with the model traced into CUDA graphs by torch.compile
#              (compile_mode cudagraphs)
#   compile    the GPU recipe's model (configs/multi30k-gpu.yaml) eager, recorded as CUDA
#              graphs (train.cuda_graphs=on), traced into CUDA graphs (train.compile_mode=
#              cudagraphs) and torch.compiled by Inductor (train.compile=on), first updates and
#              warm: what pays
#
# On the device tool's machine (no datasets there), carry wheels in .whl (git-ignored:
# .git/info/exclude), made here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --platform manylinux_2_28_x86_64 -d .whl datasets==5.2.0 dill==0.4.1 \
#     multiprocess==0.70.19 pyarrow==26.0.1
# and this script installs them into .site first. They are 56 MB, the tracked tree 7 MB: under
# the 64 MiB a run may carry. ctranslate2's wheel (43 MB) would pass it, so the decode row's
# CTranslate2 column runs only where the machine has ctranslate2 (else the row says why).
# -h, --help: the comment above. Its settings come from the environment, not arguments.
NO_ARGS=1 . "$(dirname "$0")/args.sh"
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/bench_gpu}
PY=${PY:-python3}
STEPS=${STEPS:-200}
WARM=${WARM:-50}
PARTS=${PARTS:-train e2e decode tests resume}
PACK=${PACK:-}
LINES=${LINES:-10000}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the parts run from the repository's root
[ -z "$PACK" ] || PACK=$(realpath -m "$PACK")  # written from inside OUT
: > "$OUT/parts.jsonl"
export TMT_CACHE=${TMT_CACHE:-$OUT/cache} PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl
  export PYTHONPATH=$PWD/.site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# A GPU benchmark without a GPU would run every part to a failure of its own: say so once.
if ! $PY -c "import sys, torch; sys.exit(not torch.cuda.is_available())" 2> /dev/null; then
  echo "bench_gpu.sh: no CUDA device for $PY ($($PY -c 'import torch; print("torch", torch.__version__)' 2>&1 | tail -1)); on a CPU, scripts/bench_train.py and scripts/bench_decode.py measure tmt" >&2
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# part NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output in OUT/NAME.log
part() {
  local name=$1 limit=$2 start end rc
  shift 2
  start=$(date +%s.%N)
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  end=$(date +%s.%N)
  printf '{"part": "%s", "rc": %d, "seconds": %s}\n' "$name" "$rc" \
    "$(awk "BEGIN { print $end - $start }")" >> "$OUT/parts.jsonl"
  echo "$name: exit $rc" >&2
  pack
}

# pack: every part's log and result so far into PACK, if it is set (replaced whole, never half)
pack() {
  [ -n "$PACK" ] || return 0
  (cd "$OUT" && tar czf "$PACK.tmp" -- *.log *.json *.jsonl *.txt 2> /dev/null)
  mv -f "$PACK.tmp" "$PACK"
}

# configs/base.yaml (en→de, as WMT14 there) on the bundled corpus instead of WMT14:
BASE=(--config base --set data.source=multi30k --set data.train=train --set data.valid=val
      --set data.test=test_2016_flickr --set data.num_proc=4)
# wanted NAME: whether PARTS names it
wanted() { [[ " $PARTS " == *" $1 "* ]]; }
# train_part NAME ARGS...: bench_train.py on the base model, its last line NAME's result
train_part() {
  local name=$1
  shift
  part "$name" 140 $PY scripts/bench_train.py --device cuda --precision bf16 "${BASE[@]}" \
    --cold-steps "$STEPS" --warm-steps "$WARM" --profile-steps 10 --warmup 0 --rounds 1 "$@"
  tail -1 "$OUT/$name.log" > "$OUT/$name.json"
}
# The headline figures first: a part cut off loses the least.
wanted train && train_part train --systems tmt,hf_marian
wanted e2e && part e2e 135 $PY scripts/bench_gpu.py e2e --out "$OUT"
wanted decode && part decode 150 $PY scripts/bench_gpu.py decode --out "$OUT" \
  --model "$OUT/multi30k" --lines "$LINES"
wanted tests && part tests 140 $PY -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
wanted resume && part resume 45 $PY scripts/bench_gpu.py resume --out "$OUT"
wanted resume_graphs && part resume_graphs 45 $PY scripts/bench_gpu.py resume --out "$OUT" \
  --label resume_graphs --set train.cuda_graphs=on
wanted profile && part profile 150 $PY scripts/bench_gpu.py profile --out "$OUT" --steps 40
wanted decode_profile && part decode_profile 60 $PY scripts/bench_gpu.py decode_profile \
  --out "$OUT" --model "$OUT/multi30k"
wanted decode_profile_graphs && part decode_profile_graphs 60 $PY scripts/bench_gpu.py \
  decode_profile --out "$OUT" --model "$OUT/multi30k" --label decode_profile_graphs \
  --set decode.cuda_graphs=on
wanted attention && part attention 60 $PY scripts/bench_gpu.py attention --out "$OUT" --steps 40
wanted attention_graphs && part attention_graphs 90 $PY scripts/bench_gpu.py attention \
  --out "$OUT" --steps 20 --label attention_graphs --set train.cuda_graphs=on
wanted train_graphs && train_part train_graphs --systems tmt,hf_marian --set train.cuda_graphs=on
wanted train_bf16_weights && train_part train_bf16_weights --systems tmt \
  --set train.cuda_graphs=on --precision bf16_weights
wanted e2e_bf16_weights && part e2e_bf16_weights 135 $PY scripts/bench_gpu.py e2e --out "$OUT" \
  --label e2e_bf16_weights --set train.precision=bf16_weights
wanted e2e_eager && part e2e_eager 150 $PY scripts/bench_gpu.py e2e --out "$OUT" \
  --label e2e_eager --set train.cuda_graphs=off
wanted train_traced && train_part train_traced --systems tmt --compile=cudagraphs
wanted compile && part compile 250 $PY scripts/bench_gpu.py compile --out "$OUT" --steps 60 \
  --seconds 60
$PY scripts/bench_gpu.py table "$OUT" | tee "$OUT/table.txt"
pack
