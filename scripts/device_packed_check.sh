#!/usr/bin/env bash
# One-GPU check of packed documents (issue 24) and the gated layer (issue 25) in the Megatron
# integration on megatron-core 0.19.x; about 3 minutes on one H200:
#  1. tests/megatron/test_megatron_packed_gpu.py: THD batches built by the launcher's get_batch
#     from EOD tokens through softmax, linear, gated and LGLS-hybrid models (fp32: loss and
#     every gradient vs the plain-torch model per document in fp64; bf16: the loss, and a
#     control without boundaries that must be far off);
#  2. megatron_patches.pretrain_gpt (megatron.training) with --reset-attention-mask
#     --reset-position-ids --eod-mask-loss: an LGLS hybrid (linear, gated, softmax layers) on
#     mock data, 40 steps, each micro-batch one THD row of documents split at EOD; the loss must
#     be finite and fall.
# Prints what it checked and ends with "PASS" or "FAIL: ..." (exit status 0 / 1). Needs the
# 0.19 wheel (and fla-core for the fla path): ../shared/tools/device-wheels.sh, carry .whl.
#   bash scripts/device_packed_check.sh
set -u
. "$(dirname "$0")/device_env.sh"
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=4
fail=""
python3 -c "import sys, torch, megatron.core as m; print('python', sys.version.split()[0],
'torch', torch.__version__, 'megatron-core', m.__version__, torch.cuda.get_device_name())"
python3 -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla: absent"

echo "== 1. THD batches from EOD, every layer kind, vs the plain-torch model per document"
python3 -c "import pytest" 2>/dev/null || python3 -m pip install -q pytest > /dev/null 2>&1
timeout 200 python3 -m pytest -q -s -m gpu -p no:cacheprovider -rfE \
  tests/megatron/test_megatron_packed_gpu.py > "$OUT/packed_gpu.log" 2>&1
rc=$?
grep -E "^(softmax|linear|gated|hybrid) \{|passed|failed|Error" "$OUT/packed_gpu.log" | tail -n 8
[ $rc -eq 0 ] || fail="$fail gpu-test(rc=$rc)"

echo "== 2. pretrain_gpt --reset-attention-mask --reset-position-ids --eod-mask-loss (LGLS)"
. "$(dirname "$0")/megatron_small.sh"
ARGS=("${MEGATRON_SMALL[@]}"
      --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8
      --lr-warmup-iters 5 --lr-decay-iters 40
      --reset-attention-mask --reset-position-ids --eod-mask-loss
      --sp-model-kind hybrid --sp-hybrid-pattern LGLS --context-parallel-impl auto
      --log-interval 5 --train-iters 40)
timeout 200 torchrun --nproc-per-node 1 --master-port 29518 -m megatron_patches.pretrain_gpt \
  "${ARGS[@]}" > "$OUT/packed_train.log" 2>&1
rc=$?
losses=$(grep -o "lm loss: [0-9.E+-]*" "$OUT/packed_train.log" | awk '{print $3}')
echo "train rc=$rc, lm loss every 5 steps:" $losses
[ $rc -eq 0 ] || { fail="$fail train(rc=$rc)"; tail -n 20 "$OUT/packed_train.log"; }
python3 - "$losses" <<'EOF' || fail="$fail train-loss"
import math, sys
v = [float(x) for x in sys.argv[1].split()]
ok = len(v) >= 6 and all(math.isfinite(x) for x in v) and v[-1] < 0.8 * v[0]
print(f"loss {v[0] if v else None} -> {v[-1] if v else None}: {'falls' if ok else 'BAD'}")
sys.exit(0 if ok else 1)
EOF
if [ -z "$fail" ]; then echo "PASS"; else echo "FAIL:$fail"; exit 1; fi
