#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks, each step logged under $OUT (the device
# tool's output folder; defaults to ./device-out elsewhere). Usage on a 2-GPU machine:
#   bash scripts/device_sweep.sh [tests_softmax|softmax|linear|tests_linear|profile|
#                                 linear_profile|host_launch|overlap_probe|linear_kernels|
#                                 rank_programs|softmax_pieces|softmax_env|calibrate|
#                                 triton_cache ...]
# (default: all but profile)
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
export PYTHONUNBUFFERED=1 TRITON_CACHE_AUTOTUNING=1
# The package ships fla's autotune results for Hopper (sp_attention/linear/autotune_seeds.py);
# for other GPUs or versions, fla autotunes (~4 min on a fresh machine). Its results (small
# JSON files, not the compiled kernels) travel: step `triton_cache` packs them into $OUT/autotune.tgz;
# copy that to .tritoncache/ here and carry it, and the next machine starts from it.
if [ -f .tritoncache/autotune.tgz ]; then
  mkdir -p "$HOME/.triton/cache" && tar xzf .tritoncache/autotune.tgz -C "$HOME/.triton/cache"
fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpus.txt"
env | grep '^NCCL_' | tee "$OUT/nccl_env.txt"
steps=${*:-tests_softmax softmax linear tests_linear}
for step in $steps; do
  case $step in
    tests_softmax|tests_linear)   # log written straight to $OUT: a killed run keeps it
      timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -q -m "gpu or multigpu" -p no:cacheprovider \
        -rA -s $(python3 -c 'import pytest_timeout' 2>/dev/null && echo --timeout 300) \
        "tests/${step#tests_}" > "$OUT/gpu_$step.log" 2>&1
      echo "exit $?" >> "$OUT/gpu_$step.log"
      grep -v "^PASSED" "$OUT/gpu_$step.log" | tail -40 ;;
    overlap_probe)   # a hop beside attention / fla kernels per transport (NCCL, high-priority
                     # NCCL, copy engine) and launch order; OP_ARGS e.g. "--mib 1 128"
      [ "$NGPU" -ge 2 ] && torchrun --standalone --nproc-per-node 2 benchmarks/overlap_probe.py \
        --out "$OUT/overlap_probe.jsonl" ${OP_ARGS:-} > "$OUT/overlap_probe.log" 2>&1
      tail -5 "$OUT/overlap_probe.log"; python3 benchmarks/summarize.py "$OUT/overlap_probe.jsonl" ;;
    linear)   # LINEAR_ARGS e.g. "--t-local 16384 32768 --cuda-graph"
      [ "${LINEAR_P1:-1}" = 1 ] && python3 benchmarks/linear_cp.py --out "$OUT/linear.jsonl" \
        ${LINEAR_ARGS:-} > /dev/null
      [ "$NGPU" -ge 2 ] && torchrun --standalone --nproc-per-node 2 benchmarks/linear_cp.py \
        --out "$OUT/linear.jsonl" ${LINEAR_ARGS:-} > /dev/null
      python3 benchmarks/summarize.py "$OUT/linear.jsonl" ;;
    linear_profile)   # one profiled linear CP step per layout x scan at 32K, text timelines
      [ "$NGPU" -ge 2 ] && torchrun --standalone --nproc-per-node 2 benchmarks/linear_cp.py \
        --t-local 32768 --no-phases --profile /tmp/lprof --out "$OUT/linear_profiled.jsonl" \
        > /dev/null 2> "$OUT/linear_profile.log"
      tar czf "$OUT/linear_traces.tgz" -C /tmp lprof && grep -A3 "# timeline" "$OUT/linear_profile.log" ;;
    linear_kernels)   # GPU ms (queued) and host µs of every kernel of the linear step, 1 GPU
      python3 benchmarks/linear_kernels.py --t-local ${LK_T:-32768} --out "$OUT/linear_kernels.jsonl" \
        > /dev/null && python3 benchmarks/summarize.py "$OUT/linear_kernels.jsonl" ;;
    rank_programs)   # every rank's linear step alone at P = 1 (zigzag), 2, 4, contiguous and
                     # zigzag, + the P = 2 A/B rows, 1 GPU; RP_ARGS e.g. "--worlds 2 --no-ab"
      python3 benchmarks/linear_rank_programs.py --t-local ${RP_T:-16384 32768} ${RP_ARGS:-} \
        --out "$OUT/rank_programs.jsonl" > /dev/null
      python3 benchmarks/linear_rank_programs.py --summary "$OUT/rank_programs.jsonl" ;;
    softmax_pieces)   # each rank's ring and all-gather schedules without communication, 1 GPU;
                      # SP_ARGS e.g. "--strides 1 2 4 --bwd-first 1"
      python3 benchmarks/softmax_pieces.py --t-local ${SP_T:-8192 32768} --timing queued \
        ${SP_ARGS:-} --out "$OUT/softmax_pieces.jsonl" > /dev/null
      python3 benchmarks/softmax_pieces.py --summary "$OUT/softmax_pieces.jsonl" ;;
    softmax_env)   # ring/ring at 8K under NCCL settings (SOFTMAX_ENVS: space-separated, "-" = none)
      for e in ${SOFTMAX_ENVS:--}; do
        [ "$NGPU" -ge 2 ] || break
        env $( [ "$e" = "-" ] || echo "$e" ) torchrun --standalone --nproc-per-node 2 \
          benchmarks/softmax_cp.py --t-local ${SE_T:-8192} --pairs ${SE_PAIRS:-ring/ring} \
          --strides default --no-torch-cp --out "$OUT/softmax_env.jsonl" ${SE_ARGS:-} \
          > "$OUT/softmax_env_$e.log" 2>&1 || tail -5 "$OUT/softmax_env_$e.log"
      done
      python3 benchmarks/summarize.py "$OUT/softmax_env.jsonl" ;;
    calibrate)   # the cost model's calibration: local kernels (fla, cuDNN) and element-wise
                 # bandwidth, peak memory; with >= 2 GPUs the NCCL links too (< 1 min warm)
      python3 -m sp_attention.calibrate --device cuda --world "$NGPU" \
        --out "$OUT/calibration.json" --jsonl "$OUT/calibrate.jsonl" > "$OUT/calibrate.log" 2>&1
      echo "exit $?" >> "$OUT/calibrate.log"; tail -3 "$OUT/calibrate.log" ;;
    triton_cache)   # pack Triton's autotuning results (not the kernels) for the next machine
      (cd "$HOME/.triton/cache" && find . -name '*.autotune.json' | tar czf "$OUT/autotune.tgz" -T -)
      ls -la "$OUT/autotune.tgz" ;;
    host_launch)   # host µs per call of each piece of the linear step (host-bound check)
      python3 benchmarks/host_launch.py | tee "$OUT/host_launch.txt" ;;
    softmax)
      [ "$NGPU" -ge 2 ] && torchrun --standalone --nproc-per-node 2 benchmarks/softmax_cp.py \
        --out "$OUT/softmax.jsonl" ${SOFTMAX_ARGS:-} > "$OUT/softmax_stdout.log" 2>&1
      python3 benchmarks/summarize.py "$OUT/softmax.jsonl" ;;
    profile)   # timeline of one fwd+bwd step per pair at T_local 8K, packed into one file
      [ "$NGPU" -ge 2 ] && torchrun --standalone --nproc-per-node 2 benchmarks/softmax_cp.py \
        --t-local 8192 --strides default --no-torch-cp --profile /tmp/prof \
        --pairs ${PROFILE_PAIRS:-ring/ring ring/allgather allgather/allgather allgather/ring} \
        --out "$OUT/softmax_profiled.jsonl" > "$OUT/profile_tables.log" 2>&1
      tar czf "$OUT/softmax_traces.tgz" -C /tmp prof && tail -60 "$OUT/profile_tables.log" ;;
  esac
done
