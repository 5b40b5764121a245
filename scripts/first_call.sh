#!/usr/bin/env bash
# Device call: the first-call figure on a fresh machine, and the autotune results it produced.
#   1. empty Triton cache: import + first fwd+bwd of lightning_attention (bf16, K = V = 128)
#   2. the other (dtype, head dim) keys, one process each in parallel, each its own cache
#   3. a fresh cache holding only the autotune results of 1-2: the same first call again
# Writes $OUT/first_call.jsonl and $OUT/autotune_seeds.tgz (the *.autotune.json files).
set -uo pipefail
OUT=${OUT:-$PWD/device-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c 'import triton, fla, torch; print("triton", triton.__version__, "fla", fla.__version__, "torch", torch.__version__)' | tee "$OUT/versions.txt"
fc() { timeout "${FC_TIMEOUT:-400}" python3 benchmarks/first_call.py --out "$OUT/first_call.jsonl" "$@"; }
mkdir -p /tmp/tc/main /tmp/tc/seeded
TRITON_CACHE_DIR=/tmp/tc/main fc --dtypes bfloat16 --head-dims 128 --label fresh-bf16-128
i=0
for key in "float32 128" "bfloat16 64" "float32 64"; do
  set -- $key; i=$((i + 1)); mkdir -p /tmp/tc/k$i
  TRITON_CACHE_DIR=/tmp/tc/k$i fc --dtypes "$1" --head-dims "$2" --label "fresh-parallel-$1-$2" &
done
wait
(cd /tmp/tc && find . -name '*.autotune.json' | sed 's#^\./[^/]*/##' | sort -u | wc -l)
for d in /tmp/tc/main /tmp/tc/k*; do (cd "$d" && find . -name "*.autotune.json" | tar cf - -T -) | tar xf - -C /tmp/tc/seeded; done
(cd /tmp/tc/seeded && tar czf "$OUT/autotune_seeds.tgz" .)
TRITON_CACHE_DIR=/tmp/tc/seeded fc --label seeded-all
TRITON_CACHE_DIR=/tmp/tc/seeded fc --label seeded-warm
python3 benchmarks/summarize.py "$OUT/first_call.jsonl" 2>/dev/null || cat "$OUT/first_call.jsonl"
