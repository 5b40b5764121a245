#!/usr/bin/env bash
# One device call: GPU tests, the cost model's calibration, the CP benchmarks at every GPU count
# in $WORLDS (sub-groups of the host's GPUs: P GPUs are GPUs 0 … P−1), the cost report; each
# step under its own timeout, every log and JSON line under $OUT (the device tool's output
# folder; ./device-out elsewhere). Usage on a GPU machine:
#   WORLDS="4 2" bash scripts/device_sweep.sh [tests] [calibrate] [linear] [softmax] [report]
#                                             [triton_cache]        (default: all but triton_cache)
# Knobs (environment): WORLDS (default: 4 2 1, those the machine has), LINEAR_ARGS /
# LINEAR_ARGS_P1, SOFTMAX_ARGS, TESTS (pytest paths), STEP_TIMEOUT (seconds per benchmark run).
# Needs fla-core (carry .whl from ../shared/tools/device-wheels.sh; yunchang for the Ulysses
# anchor). Every step ends by packing $OUT into $OUT/all.tgz (the device tool returns at most 8
# files). Timings on 4 x H100 (2026-11-26): linear at P = 4 with --ab graphs ~3.5 min, softmax
# at P = 4 with the anchors ~4 min, calibrate > 75 s, the multi-GPU tests on a fresh machine
# > 3 min (Triton compiles their shapes): split them over calls of 10 minutes. fla's autotune
# results for Hopper ship in the package; for other GPUs step
# `triton_cache` packs Triton's autotuning results into $OUT/autotune.tgz: copy it to
# .tritoncache/ here and carry it, the next machine starts from it.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
if [ -f .tritoncache/autotune.tgz ]; then
  mkdir -p "$HOME/.triton/cache" && tar xzf .tritoncache/autotune.tgz -C "$HOME/.triton/cache"
fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
WORLDS=$(for P in ${WORLDS:-4 2 1}; do [ "$P" -le "$NGPU" ] && echo "$P"; done)
LINEAR_ARGS=${LINEAR_ARGS:---t-local 8192 32768 --t-local-other 32768 --timing eager queued \
--cases fixed gated packed}
LINEAR_ARGS_P1=${LINEAR_ARGS_P1:---t-local 8192 32768 --timing queued --cases fixed}
SOFTMAX_ARGS=${SOFTMAX_ARGS:---t-local 8192 32768 --timing eager}

bench() {   # bench SCRIPT P ARGS...: one benchmark at P GPUs; rows appended to $OUT/NAME.jsonl
  local script=$1 P=$2; shift 2
  local name log
  name=$(basename "$script" .py)
  log="$OUT/${name}_p$P.log"
  if [ "$P" = 1 ]; then
    timeout "${STEP_TIMEOUT:-240}" python3 "$script" --out "$OUT/$name.jsonl" "$@" > "$log" 2>&1
  else
    timeout "${STEP_TIMEOUT:-240}" torchrun --standalone --nproc-per-node "$P" "$script" \
      --out "$OUT/$name.jsonl" "$@" > "$log" 2>&1
  fi
  echo "$name P=$P exit $? ($(grep -c '^{' "$log") rows)"
}

pack() { (cd "$OUT" && tar czf /tmp/sweep_all.tgz --exclude all.tgz . && cp /tmp/sweep_all.tgz all.tgz); }

for step in ${*:-tests calibrate linear softmax report}; do
  case $step in
    tests)      # -m gpu and -m multigpu (each multi-GPU test runs at P = 2 and 4 as GPUs allow)
      timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider \
        -rfE -s ${TESTS:-tests/linear tests/softmax} > "$OUT/gpu_tests.log" 2>&1
      echo "tests exit $?" | tee -a "$OUT/gpu_tests.log"; grep -E "passed|failed|Error" "$OUT/gpu_tests.log" | tail -8 ;;
    calibrate)  # kernels, NCCL links among 2 and $NGPU GPUs -> $OUT/calibration.json
      timeout 180 torchrun --standalone --nproc-per-node "$NGPU" -m sp_attention.calibrate \
        --out "$OUT/calibration.json" --jsonl "$OUT/calibrate.jsonl" > "$OUT/calibrate.log" 2>&1
      echo "calibrate exit $?" | tee -a "$OUT/calibrate.log"; tail -3 "$OUT/calibrate.log" ;;
    linear)
      for P in $WORLDS; do
        if [ "$P" = 1 ]; then bench benchmarks/linear_cp.py 1 $LINEAR_ARGS_P1
        else bench benchmarks/linear_cp.py "$P" $LINEAR_ARGS ${LINEAR_ARGS_EXTRA:-}; fi
      done ;;
    softmax)
      for P in $WORLDS; do bench benchmarks/softmax_cp.py "$P" $SOFTMAX_ARGS; done ;;
    report)     # the cost model against the rows above (acceptance: last line of each report):
                # linear against the GPU's own time (queued), softmax as a layer runs (eager)
      cal=$([ -f "$OUT/calibration.json" ] && echo "--calibration $OUT/calibration.json")
      for kind in linear softmax; do
        [ -f "$OUT/${kind}_cp.jsonl" ] || continue
        timing=queued; [ "$kind" = softmax ] && timing=eager
        mkdir -p "$OUT/report_$kind"
        python3 benchmarks/report.py "$OUT/${kind}_cp.jsonl" $cal --timing "$timing" \
          --out-dir "$OUT/report_$kind" > "$OUT/report_$kind.txt" 2>&1
        tail -3 "$OUT/report_$kind.txt"
      done ;;
    triton_cache)   # Triton's autotuning results (not the kernels) for the next machine
      (cd "$HOME/.triton/cache" && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T -)
      ls -la "$OUT/autotune.tgz" ;;
    *) echo "unknown step $step" ;;
  esac
  pack
done
