#!/usr/bin/env bash
# One device call (one GPU) for the integrations, each step logged under $OUT:
#   first_call  the first linear fwd+bwd in a fresh Triton cache (the package unpacks its
#               shipped autotune results itself)
#   train_1b    train.py ~1B Llama and hybrid presets at CP = 1: tokens/s, MFU (summary.json)
#   checks      GPU tests (-m gpu) beside scripts/device_run.sh (Megatron launcher)
# Usage: bash scripts/device_integrations.sh [first_call] [train_1b] [checks]
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
for step in ${*:-first_call train_1b checks}; do
  case $step in
    first_call)
      TRITON_CACHE_DIR=$(mktemp -d) timeout 300 python3 benchmarks/first_call.py \
        --dtypes bfloat16 --head-dims 128 --label package-seeded --out "$OUT/first_call.jsonl"
      ;;
    train_1b)
      for k in softmax hybrid; do
        OMP_NUM_THREADS=8 timeout 200 python3 train.py --preset 1b --sp-model-kind $k \
          --context-parallel-size 1 --vocab-size 128256 --micro-batch-size 4 \
          --global-batch-size 16 --train-iters 20 --lr-warmup-iters 2 --log-interval 5 \
          --no-progress-bar --log-dir "$OUT/train_1b_$k" > "$OUT/train_1b_$k.log" 2>&1 \
          || echo "train_1b $k FAILED"
        tail -n 4 "$OUT/train_1b_$k.log"; cat "$OUT/train_1b_$k/summary.json" 2>/dev/null; echo
      done ;;
    checks)
      timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider -rfE tests/linear tests/softmax \
        > "$OUT/gpu_tests.log" 2>&1 &
      OUT=$OUT/megatron bash scripts/device_run.sh > /dev/null 2>&1
      wait
      tail -n 15 "$OUT/gpu_tests.log"; cat "$OUT/megatron/summary.txt" | grep -v -i warn ;;
  esac
done
