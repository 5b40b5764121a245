#!/usr/bin/env bash
# The cost model's GPU acceptance in one device call on a 4-GPU machine (under 10 minutes):
#  1. calibrate: torchrun --nproc-per-node 4 -m sp_attention.calibrate: the kernels, the NCCL
#     links among 2 and 4 GPUs, the overlap cost and a CP rank's linear factors at P = 4
#     -> $OUT/calibration.json (refused, nothing written, if a fit is implausible);
#  2. linear, softmax: benchmarks/linear_cp.py and benchmarks/softmax_cp.py at P = 1, 2, 4
#     (queued timing: the GPU's own time, what the model predicts) -> $OUT/{linear,softmax}.jsonl;
#  3. report: benchmarks/report.py: the prediction error of every row (acceptance: ±20 %) and
#     whether auto's pick is within 5 % of the best measured schedule -> $OUT/cost_report.md,
#     $OUT/report.txt (last line: "acceptance: PASS" or "FAIL").
# Needs fla-core (carry .whl from ../shared/tools/device-wheels.sh). Usage:
#   bash scripts/device_cost_check.sh [calibrate] [linear] [softmax] [report]   (default: all)
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
PS=$(for P in 1 2 4; do [ "$P" -le "$NGPU" ] && echo "$P"; done)

bench() {   # bench SCRIPT P TIMEOUT ARGS...: one benchmark at P GPUs, rows appended to $OUT
  local script=$1 P=$2 t=$3; shift 3
  local log="$OUT/$(basename "$script" .py)_p$P.log"
  if [ "$P" = 1 ]; then timeout "$t" python3 "$script" "$@" > "$log" 2>&1
  else timeout "$t" torchrun --standalone --nproc-per-node "$P" "$script" "$@" > "$log" 2>&1
  fi
  echo "$script P=$P exit $?"
}

for step in ${*:-calibrate linear softmax report}; do
  case $step in
    calibrate)
      timeout 180 torchrun --standalone --nproc-per-node "$NGPU" -m sp_attention.calibrate \
        --out "$OUT/calibration.json" --jsonl "$OUT/calibrate.jsonl" > "$OUT/calibrate.log" 2>&1
      echo "calibrate exit $?" | tee -a "$OUT/calibrate.log"; tail -4 "$OUT/calibrate.log" ;;
    linear)
      for P in $PS; do
        bench benchmarks/linear_cp.py "$P" $((45 + 12 * P)) --t-local 8192 32768 \
          --timing queued --no-phases --out "$OUT/linear.jsonl"
      done ;;
    softmax)
      for P in $PS; do
        bench benchmarks/softmax_cp.py "$P" $((30 + 10 * P)) --t-local 8192 16384 \
          --timing queued --strides default --no-torch-cp --out "$OUT/softmax.jsonl"
      done ;;
    report)
      cal=$([ -f "$OUT/calibration.json" ] && echo "--calibration $OUT/calibration.json")
      python3 benchmarks/report.py $(ls "$OUT"/linear.jsonl "$OUT"/softmax.jsonl 2>/dev/null) \
        $cal --out-dir "$OUT" > "$OUT/report.txt" 2>&1
      tail -40 "$OUT/report.txt" ;;
  esac
done
