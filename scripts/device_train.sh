#!/usr/bin/env bash
# One device call for training on this machine's P GPUs: each step under its own timeout, JSON
# rows and logs under $OUT (the device tool's output folder; ./device-out elsewhere), packed
# into $OUT/all.tgz after every step. Usage on a GPU machine:
#   bash scripts/device_train.sh [first_step [first_seeded]] [scaling] [launcher] [hf] [parity] [slurm]
#     first_step  the first step of each model kind at CP = P in empty Triton + Inductor caches (a fresh
#                 machine; the package installs its shipped autotune results), the hybrid with
#                 packed documents first; what Triton autotuned anyway -> autotune_new.tgz,
#                 the shipped archive plus the compiled kernels -> seeds_with_kernels.tgz
#     first_seeded  after first_step: the same first steps in new empty caches, the package
#                 shipping seeds_with_kernels.tgz (rows -> seeded_step.jsonl)
#     scaling     train_scaling.py: FIRST_KINDS at cp1 and cpP (tp2/dp2 layouts from P = 4)
#     launcher    launcher_vs_train.py (megatron-core 0.19 with megatron.training): tokens/s
#                 beside train.py, then the launcher's save + resume on the P GPUs (on a
#                 fresh machine add LAUNCHER_EXTRA="--warm 240": an untimed train.py run
#                 compiles the kernels first)
#     hf          examples/hf_llama_cp.py --device cuda, every --model at CP = P and CP = 1
#                 (one Triton cache per model; what autotuned -> autotune_hf.tgz)
#     parity      train_parity.py: CP = P against two CP = 1 runs, 300 steps, PNG
#     slurm       scripts/slurm/one_host.sh 2 P/2: the sbatch path as two nodes, save + resume
#     graphs      KINDS at CP = P eager (--no-cuda-graphs) and with GRAPH_FLAGS (--cuda-graphs,
#                 the default at CP > 1: layers replayed from CUDA graphs; --linear-op-graphs: the
#                 linear ops alone), each pair on
#                 this machine
#     distopt     KINDS at CP = P three ways in one call: the replicated optimizer,
#                 --use-distributed-optimizer, and with --overlap-param-gather too
#     profile     train_profile.py at CP = P (PROFILE_KINDS: hybrid softmax; PROFILE_EXTRA: more
#                 train.py flags), train.py's defaults: each rank's step split into compute,
#                 NCCL alone, NCCL hidden and idle, its host waits, the top kernels, as JSON
#                 lines in profile.jsonl (the traces too with PROFILE_TRACES=1)
#     long        the longest context at CP = P: LONG_KINDS (hybrid softmax) at LONG_SEQS
#                 (524288 1048576) with --recompute-granularity LONG_RECOMPUTE (auto: the
#                 least recompute that fits; e.g. "full --recompute-method uniform
#                 --recompute-num-layers 1") and --use-distributed-optimizer, 3 steps (the
#                 estimate beside the measured peak in each row)
# Knobs: KINDS (softmax hybrid gated), SEQ (32768), ITERS (10), SCALE_EXTRA (train.py flags for
# every scaling run, after "--"), FIRST_KINDS (hybrid-packed gated softmax linear),
# FIRST_LAYOUTS (cp<P>; e.g. "cp4 cp1": a CP 1 run compiles kernels a CP 4 run does not), HF_MODELS
# (llama linear gated hybrid), STEP_TIMEOUT (seconds per run, 240; a fresh machine compiles
# the HF example's linear kernels for ~70 s before its first step).
set -uo pipefail
. "$(dirname "$0")/device_env.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
P=$(python3 -c 'import torch; print(torch.cuda.device_count())')
H=$((P / 2))
KINDS=${KINDS:-softmax hybrid gated}
SEQ=${SEQ:-32768}
ITERS=${ITERS:-10}
T=${STEP_TIMEOUT:-240}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
pack() { (cd "$OUT" && tar czf /tmp/train_all.tgz --exclude all.tgz . && cp /tmp/train_all.tgz all.tgz); }
reap() {   # a run killed at its time limit must not leave workers holding GPU memory
  nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9 2>/dev/null; sleep 1; }
layouts() { echo cp1 "cp$P"; [ "$P" -ge 4 ] && echo "tp2cp$H dp2cp$H"; }
collect_autotune() {  # DIR ARCHIVE: every <hash>/<kernel>.autotune.json under DIR, packed as the
  # shipped seeds are (sp_attention/linear/tuned/; merge the new ones into that archive)
  python3 - "$1" "$2" <<'PY'
import glob, os, sys, tarfile
seen = {}
for f in glob.glob(os.path.join(sys.argv[1], "**", "*.autotune.json"), recursive=True):
    seen.setdefault(os.path.join(*f.split(os.sep)[-2:]), f)
with tarfile.open(sys.argv[2], "w:gz") as tar:
    for name, f in sorted(seen.items()):
        tar.add(f, arcname=name)
print(len(seen), "autotune results")
PY
}

first_steps() {  # NAME: the first step of each FIRST_KIND at CP = P, each in an empty Triton
  # cache /tmp/NAME/<kind> (the package installs its shipped archive there); rows -> NAME_step.jsonl
  for k in ${FIRST_KINDS:-hybrid-packed gated softmax linear}; do
    kind=${k%-packed}; extra=(); [ "$k" != "$kind" ] && extra=(-- --packing documents)
    python3 benchmarks/train_scaling.py --kinds "$kind" --layouts ${FIRST_LAYOUTS:-cp$P} --seq-length "$SEQ" \
      --train-iters 2 --timeout "$T" --fresh-triton-cache "/tmp/$1/$k" \
      --log-root "$OUT/$1_step_$k" --out "$OUT/$1_step.jsonl" "${extra[@]}" > /dev/null 2>&1
    python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).readlines()[-1]); print(sys.argv[2], r["status"], "first step", r.get("first_step_s"), "s", r.get("log_tail", "")[-300:])' \
      "$OUT/$1_step.jsonl" "$k"
    (cd "/tmp/$1/$k" && find . -name '*.json' ! -name '__grp__*' | sed 's#.*/##' | sort \
      | uniq -c > "$OUT/$1_step_$k/triton_cache.txt")
  done
}

for step in ${*:-first_step scaling}; do
  echo "== $step $(date +%T)"
  case $step in
    first_step)
      first_steps first
      # every autotune result of these runs (<hash>/<kernel>.autotune.json, as the shipped seeds)
      collect_autotune /tmp/first "$OUT/autotune_new.tgz"
      # and their compiled kernels, merged into a copy of the shipped archive (carry it back
      # to sp_attention/linear/tuned/ after checking its size)
      seeds=$(ls sp_attention/linear/tuned/sm90_*.tgz | head -1)
      cp "$seeds" "$OUT/seeds_with_kernels.tgz"
      # /tmp/first/<kind>/<kind>_cp<P>/: one run's Triton folder (home/.triton/cache) and the
      # one Inductor moved it to (inductor/triton/<device>)
      for d in /tmp/first/*/*/home/.triton/cache /tmp/first/*/*/inductor/triton/*; do
        [ -d "$d" ] && python3 scripts/harvest_triton_cache.py "$d" --into "$OUT/seeds_with_kernels.tgz"
      done
      # later steps start from these kernels (as a second run on this machine would)
      mkdir -p "$HOME/.triton/cache"
      for d in /tmp/first/*/*/home/.triton/cache; do cp -rn "$d"/. "$HOME/.triton/cache/" 2>/dev/null; done ;;
    first_seeded)
      # the first steps again in empty Triton and Inductor caches with the package shipping
      # this machine's harvest (first_step's seeds_with_kernels.tgz): a fresh machine's first
      # step once those kernels are in the tree
      seeds=$(ls sp_attention/linear/tuned/sm90_*.tgz | head -1)
      cp "$OUT/seeds_with_kernels.tgz" "$seeds"
      first_steps seeded ;;
    scaling)
      python3 benchmarks/train_scaling.py --kinds $KINDS --layouts $(layouts) --seq-length "$SEQ" \
        --train-iters "$ITERS" --timeout "$T" --out "$OUT/train_scaling.jsonl" \
        --log-root "$OUT/scaling" ${SCALE_EXTRA:-} >> "$OUT/train_scaling.log" 2>&1
      python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l); print(r["model_kind"], r["layout"], r["status"], "mfu", round(100 * r.get("mfu", 0), 1), "tok/s", round(r.get("tokens_per_s", 0)), "mem", round(r.get("mem_gb", 0), 1))' "$OUT/train_scaling.jsonl" ;;
    launcher)
      lays="cp$P"; [ "$P" -ge 4 ] && lays="cp$P tp2cp$H"
      timeout $((4 * T)) python3 benchmarks/launcher_vs_train.py --kinds softmax hybrid \
        --layouts $lays --seq-length "${LAUNCHER_SEQ:-16384}" --timeout "$T" --resume-check \
        --log-root "$OUT/launcher" ${LAUNCHER_EXTRA:-} --out "$OUT/launcher_vs_train.jsonl" \
        > "$OUT/launcher_vs_train.log" 2>&1
      cut -c1-400 "$OUT/launcher_vs_train.jsonl" ;;
    hf)
      for m in ${HF_MODELS:-llama linear gated hybrid}; do
        for cp in "$P" 1; do
          TRITON_CACHE_DIR=/tmp/hfcache/$m timeout "$T" torchrun --nproc-per-node "$cp" \
            --master-port 29631 examples/hf_llama_cp.py --cp "$cp" --device cuda --model "$m" \
            > "$OUT/hf_${m}_cp$cp.log" 2>&1
          echo "hf $m cp$cp exit $?: $(tail -n 1 "$OUT/hf_${m}_cp$cp.log")"
        done
        # the printed losses (every 10 steps) of CP = P against CP = 1: one JSON line
        python3 - "$OUT/hf_${m}_cp$P.log" "$OUT/hf_${m}_cp1.log" "$m" "$P" >> "$OUT/hf_cp.jsonl" <<'PY'
import json, re, sys, time
import torch
def losses(path):
    return {int(s): float(x) for s, x in re.findall(r"step +(\d+)  loss ([0-9.]+)", open(path).read())}
cp, one = losses(sys.argv[1]), losses(sys.argv[2])
steps = sorted(set(cp) & set(one))
diff = [abs(cp[s] - one[s]) for s in steps]
print(json.dumps({"bench": "hf_cp", "model": sys.argv[3], "cp": int(sys.argv[4]),
                  "steps_compared": len(steps), "max_abs_diff": max(diff) if diff else None,
                  "final_cp": cp.get(max(steps)) if steps else None,
                  "final_cp1": one.get(max(steps)) if steps else None,
                  "device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
                  "command": f"torchrun --nproc-per-node {sys.argv[4]} examples/hf_llama_cp.py "
                             f"--cp {sys.argv[4]} --device cuda --model {sys.argv[3]} (and --cp 1)"}))
PY
      done
      cat "$OUT/hf_cp.jsonl"
      # what the example autotuned (its head dim 32): ship what sp_attention/linear/tuned lacks
      collect_autotune /tmp/hfcache "$OUT/autotune_hf.tgz" ;;
    parity)
      timeout $((3 * T)) python3 benchmarks/train_parity.py --cp "$P" --kind hybrid \
        --train-iters 300 --png "$OUT/train_parity_cp$P.png" --out "$OUT/train_parity.jsonl" \
        > "$OUT/train_parity.log" 2>&1
      tail -n 3 "$OUT/train_parity.log" | cut -c1-600 ;;
    slurm)
      rm -rf /tmp/slurm_ck
      args=(--preset 1b --num-layers 4 --seq-length 8192 --context-parallel-size "$P"
            --save /tmp/slurm_ck --save-interval 5)
      timeout "$T" bash scripts/slurm/one_host.sh 2 "$H" "${args[@]}" --train-iters 10 \
        --log-dir "$OUT/slurm" > "$OUT/slurm_train.log" 2>&1
      echo "slurm train exit $?"
      timeout "$T" bash scripts/slurm/one_host.sh 2 "$H" "${args[@]}" --train-iters 20 \
        --load /tmp/slurm_ck --log-dir "$OUT/slurm" > "$OUT/slurm_resume.log" 2>&1
      echo "slurm resume exit $?"
      grep -h "sp-train:\|resumed\|step 10/\|step 20/\|saved checkpoint" "$OUT"/slurm_*.log ;;
    distopt)
      for flags in "" "--use-distributed-optimizer" \
                   "--use-distributed-optimizer --overlap-param-gather"; do
        python3 benchmarks/train_scaling.py --kinds $KINDS --layouts "cp$P" --seq-length "$SEQ" \
          --train-iters "$ITERS" --timeout "$T" --out "$OUT/train_distopt.jsonl" \
          --log-root "$OUT/distopt_${flags// /_}" -- $flags >> "$OUT/train_distopt.log" 2>&1
      done
      python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l); c = r["command"]
    print(r["model_kind"], r["status"], "mfu", round(100 * r.get("mfu", 0), 1), "mem", round(r.get("mem_gb", 0), 1), "overlap" if "overlap-param" in c else "distopt" if "distributed-opt" in c else "replicated")' "$OUT/train_distopt.jsonl" ;;
    graphs)
      # --cuda-graphs against the same runs without it, KINDS at CP = P, each kind's eager run
      # first (it compiles the kernels both use), then its graphed run
      for kind in $KINDS; do
        for flags in "--no-cuda-graphs" "${GRAPH_FLAGS:---cuda-graphs}"; do
          python3 benchmarks/train_scaling.py --kinds "$kind" --layouts "cp$P" --seq-length "$SEQ" \
            --train-iters "$ITERS" --timeout "$T" --out "$OUT/train_graphs.jsonl" \
            --log-root "$OUT/graphs_${kind}${flags// /_}" -- $flags >> "$OUT/train_graphs.log" 2>&1
          reap; pack
        done
      done
      python3 -c 'import json,sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(r["model_kind"], r["status"], "mfu", round(100 * (r.get("mfu") or 0), 1), "step", r.get("step_time_s"), " ".join(f for f in r["command"].split() if "graphs" in f) or "eager")' "$OUT/train_graphs.jsonl" ;;
    profile)
      # where a CP = P step goes on each GPU (compute / NCCL alone / NCCL hidden / idle, the host's
      # waits, the exposed NCCL by collective, the step boundary), PROFILE_KINDS at SEQ with
      # train.py's defaults (+ PROFILE_EXTRA, e.g. "--packing documents"): each rank's tables as
      # a JSON line in profile.jsonl; the traces (gzip) only
      # with PROFILE_TRACES=1 (they are large: the device tool brings back 8 files)
      for kind in ${PROFILE_KINDS:-hybrid softmax}; do
        timeout "$T" torchrun --nproc-per-node "$P" --master-port 29641 benchmarks/train_profile.py \
          --profile-skip 3 --profile-steps 2 --cuda-only --trace "/tmp/profile_${kind}_rank{rank}.json" \
          --out "$OUT/profile.jsonl" \
          --preset 1b --sp-model-kind "$kind" --context-parallel-size "$P" --seq-length "$SEQ" \
          --train-iters 5 --micro-batch-size 1 --global-batch-size 1 --vocab-size 128256 \
          --no-progress-bar --log-dir "/tmp/profile_$kind" ${PROFILE_EXTRA:-} > "$OUT/profile_$kind.log" 2>&1
        echo "profile $kind exit $?"
        grep -h "timeline per step\|per step (ms) by kind\|by collective\|between the steps" \
          "$OUT/profile_$kind.log" | cut -c1-300
        if [ "${PROFILE_TRACES:-0}" = 1 ]; then gzip -f /tmp/profile_"$kind"_rank*.json && mv /tmp/profile_"$kind"_rank*.json.gz "$OUT/"; fi
      done ;;
    long)
      for seq in ${LONG_SEQS:-524288 1048576}; do
        python3 benchmarks/train_scaling.py --kinds ${LONG_KINDS:-hybrid softmax} --layouts "cp$P" \
          --seq-length "$seq" --train-iters 3 --timeout "$T" --out "$OUT/long_context_cp$P.jsonl" \
          --log-root "$OUT/long_$seq" -- --recompute-granularity ${LONG_RECOMPUTE:-auto} \
          --use-distributed-optimizer >> "$OUT/long.log" 2>&1
      done
      cut -c1-400 "$OUT/long_context_cp$P.jsonl" ;;
    *) echo "unknown step $step" ;;
  esac
  reap
  pack
done
