#!/usr/bin/env bash
# One-GPU check of the Megatron integration on megatron-core 0.19.x (megatron.training):
#  1. the spec-patcher tests against this megatron-core's GPT and hybrid specs;
#  2. megatron_patches.pretrain_gpt trains a small hybrid model (LLLS) with
#     --context-parallel-impl blelloch for 60 of 80 steps (--exit-interval 60, the schedule of an 80-step run) on mock data and saves a Megatron
#     checkpoint (torch_dist) at steps 30 and 60;
#  3. a second run resumes from it (--load) and trains to step 80.
# Logs and summary.txt go to $OUT (or /tmp/mp_out); each step is time-boxed (60 + 170 + 100 s)
# so the whole check ends within 6 minutes. Needs the 0.19 wheel on PYTHONPATH:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD && \
#   bash scripts/device_run.sh
set -u
OUT=${OUT:-/tmp/mp_out}
mkdir -p "$OUT"
CK=/tmp/mp_ckpt
rm -rf "$CK"
export CUDA_DEVICE_MAX_CONNECTIONS=1 OMP_NUM_THREADS=4
{ nvidia-smi --query-gpu=name --format=csv,noheader
  python3 -c "import sys, torch, megatron.core as m; print(sys.version.split()[0], 'torch',
torch.__version__, 'megatron-core', m.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>/dev/null || echo "fla: absent"
} > "$OUT/versions.txt" 2>&1

if python3 -c "import pytest" 2>/dev/null; then
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/megatron/test_megatron_specs.py \
    > "$OUT/specs.log" 2>&1; echo "specs pytest rc=$?" >> "$OUT/specs.log"
else
  echo "pytest missing on this machine: spec tests not run" > "$OUT/specs.log"
fi

. "$(dirname "$0")/megatron_small.sh"
ARGS=("${MEGATRON_SMALL[@]}"
      --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 8
      --lr-warmup-iters 5 --lr-decay-iters 80
      --sp-model-kind hybrid --sp-hybrid-pattern LLLS --context-parallel-impl blelloch
      --log-interval 5 --save "$CK" --save-interval 30)
LAUNCH=(torchrun --nproc-per-node 1 --master-port 29517 -m megatron_patches.pretrain_gpt)

timeout 170 "${LAUNCH[@]}" "${ARGS[@]}" --train-iters 80 --exit-interval 60 > "$OUT/train.log" 2>&1
echo "train rc=$?" >> "$OUT/train.log"
ls -R "$CK" > "$OUT/checkpoint_files.txt" 2>&1
timeout 100 "${LAUNCH[@]}" "${ARGS[@]}" --train-iters 80 --load "$CK" > "$OUT/resume.log" 2>&1
echo "resume rc=$?" >> "$OUT/resume.log"

{ echo "== versions"; cat "$OUT/versions.txt"
  echo "== specs"; tail -3 "$OUT/specs.log"
  echo "== train (iteration, lm loss)"; grep -o "iteration *[0-9]*/ *[0-9]*.*lm loss: [0-9.E+-]*" \
    "$OUT/train.log" | sed 's/|.*lm loss/ lm loss/'; tail -1 "$OUT/train.log"
  echo "== checkpoint"; grep -i "saved checkpoint\|successfully saved" "$OUT/train.log" | tail -2
  echo "== resume"; grep -i "loaded checkpoint\|loading checkpoint\|successfully loaded" \
    "$OUT/resume.log" | tail -2
  grep -o "iteration *[0-9]*/ *[0-9]*.*lm loss: [0-9.E+-]*" "$OUT/resume.log" \
    | sed 's/|.*lm loss/ lm loss/'; tail -1 "$OUT/resume.log"
} > "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
