#!/usr/bin/env bash
# One-GPU check that Megatron-LM's own --recompute-* flags reach our layers through
# megatron_patches.pretrain_gpt (megatron-core 0.19.x, megatron.training): the small hybrid
# model of device_run.sh (LLLS: linear and softmax layers, --context-parallel-impl blelloch)
# trains 8 steps without recompute, with selective recompute of core attention and MLP, and
# with full recompute (uniform, 1 layer); the first step's lm loss must be identical in the
# three runs (the same forward), the later ones close. Logs and summary.txt in $OUT.
set -u
OUT=${OUT:-/tmp/mp_recompute}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=4
. "$(dirname "$0")/megatron_small.sh"
ARGS=("${MEGATRON_SMALL[@]}"
      --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 8
      --lr-warmup-iters 2 --lr-decay-iters 8 --train-iters 8
      --sp-model-kind hybrid --sp-hybrid-pattern LLLS --context-parallel-impl blelloch
      --log-interval 1)
LAUNCH=(torchrun --nproc-per-node 1 --master-port 29519 -m megatron_patches.pretrain_gpt)
declare -A MODES=(
  [none]=""
  [selective]="--recompute-granularity selective --recompute-modules core_attn mlp"
  [full]="--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
for mode in none selective full; do
  # shellcheck disable=SC2086
  timeout 150 "${LAUNCH[@]}" "${ARGS[@]}" ${MODES[$mode]} > "$OUT/$mode.log" 2>&1
  echo "exit $?" >> "$OUT/$mode.log"
  grep -o "iteration *[0-9]*/ *[0-9]*.*lm loss: [0-9.E+-]*" "$OUT/$mode.log" \
    | sed 's/|.*lm loss/ lm loss/' > "$OUT/$mode.loss"
done
{ for mode in none selective full; do
    echo "== $mode: $(tail -1 "$OUT/$mode.log")"; cat "$OUT/$mode.loss"
  done
  first() { head -1 "$OUT/$1.loss" | grep -o "lm loss: .*"; }
  if [ -n "$(first none)" ] && [ "$(first none)" = "$(first selective)" ] \
     && [ "$(first none)" = "$(first full)" ]; then
    echo "first-step lm loss identical in the three runs: $(first none)"
  else
    echo "FAILED: first-step lm loss differs or missing: $(first none) / $(first selective) / $(first full)"
  fi
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
