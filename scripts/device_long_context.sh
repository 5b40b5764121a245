#!/usr/bin/env bash
# Issue 26 on one H200: the loss benchmark, the longest-context sweep of train.py (two parts),
# Megatron's own trainer with --recompute-*, and the GPU tests of the loss kernels; each step
# logged under $OUT. Needs the wheels megatron-core 0.19.2, fla-core 0.6.0 and liger-kernel
# 0.8.5 in .whl/ (../shared/tools/device-wheels.sh liger-kernel==0.8.5).
#   bash scripts/device_long_context.sh [loss] [sweep1] [sweep2] [launcher] [tests]
# One device call each (guesses on an H200): sweep1 ~8 min (32K and 4K with every recompute
# setting, 256K full recompute, the longest hybrid), sweep2 ~7.5 min (64K, 128K, 256K, the
# longest softmax; SWEEP2_ARGS="--longest hybrid" drops the ~4-min softmax row), and
# "loss tests launcher" ~5 min together. Every row lands in $OUT/long_context.jsonl as it ends.
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
export TRITON_CACHE_AUTOTUNING=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
for step in ${*:-loss sweep1}; do
  case $step in
    loss)       # Liger vs ours vs Megatron's fused CE vs plain at 32K / 64K tokens
      timeout 240 python3 benchmarks/loss_bench.py --out "$OUT/loss_bench.jsonl" \
        > "$OUT/loss_bench.log" 2>&1; echo "loss_bench exit $?" | tee -a "$OUT/loss_bench.log"
      python3 benchmarks/long_context.py --table "$OUT/loss_bench.jsonl" ;;
    sweep1|sweep2)
      timeout 520 python3 benchmarks/long_context.py --part "${step#sweep}" \
        --budget-s "${SWEEP_BUDGET:-420}" \
        ${SWEEP_ARGS:-} $([ "$step" = sweep2 ] && echo "${SWEEP2_ARGS:-}") \
        --out "$OUT/long_context.jsonl" > "$OUT/$step.log" 2>&1
      echo "$step exit $?" | tee -a "$OUT/$step.log"
      grep -v '^{' "$OUT/$step.log" | grep -i "error\|Traceback" | tail -5
      python3 benchmarks/long_context.py --table "$OUT/long_context.jsonl" ;;
    launcher)   # Megatron-LM's trainer (megatron_patches.pretrain_gpt) with --recompute-*
      OUT=$OUT/launcher bash scripts/device_recompute_check.sh > /dev/null 2>&1
      cat "$OUT/launcher/summary.txt" ;;
    tests)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/train \
        > "$OUT/gpu_tests_train.log" 2>&1; echo "exit $?" >> "$OUT/gpu_tests_train.log"
      tail -n 15 "$OUT/gpu_tests_train.log" ;;
  esac
done
