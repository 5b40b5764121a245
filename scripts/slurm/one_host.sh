#!/usr/bin/env bash
# Run scripts/slurm/train.sbatch on one GPU host as if it were NODES nodes of GPUS GPUs each:
# stand-ins for `scontrol show hostnames` (every node is this host) and `srun` (one task per
# "node", each seeing its own GPUS GPUs), so the sbatch script's real path — one launcher per
# node, c10d rendezvous at the head node, NCCL between them — runs before a cluster is at hand.
#
#   bash scripts/slurm/one_host.sh 2 1 --preset tiny --context-parallel-size 2 --train-iters 20
#
# Arguments after NODES GPUS go to train.py (through train.sbatch). LAUNCHER=torchrun (default)
# or srun as in train.sbatch; the job id is $$ unless SLURM_JOB_ID is set. Exit status:
# train.sbatch's (75: stopped by SIGTERM after saving a checkpoint).
set -euo pipefail
if [ $# -lt 2 ]; then
    echo "usage: $0 NODES GPUS_PER_NODE [train.py arguments...]" >&2
    exit 2
fi
NODES=$1 GPUS=$2
shift 2
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$(mktemp -d)
trap 'rm -rf "$BIN"' EXIT
cat > "$BIN/scontrol" <<EOF
#!/usr/bin/env bash
case "\$1 \${2:-}" in
  "show hostnames") for i in \$(seq $NODES); do echo localhost; done ;;
  requeue*) echo "one_host.sh: scontrol \$* (nothing to requeue on one host)" ;;
  *) echo "one_host.sh: scontrol stand-in knows only 'show hostnames' and 'requeue'" >&2; exit 1 ;;
esac
EOF
# srun: drop its options; with --ntasks-per-node=N start N tasks per node (LAUNCHER=srun) else
# one; task t of node n sees GPUs n*GPUS ... n*GPUS+GPUS-1 and SLURM's task variables.
cat > "$BIN/srun" <<EOF
#!/usr/bin/env bash
per=1
while [ "\${1#--}" != "\$1" ]; do
  case "\$1" in --ntasks-per-node=*) per=\${1#*=} ;; esac
  shift
done
pids=()
trap 'kill -TERM "\${pids[@]}" 2>/dev/null' TERM INT
for n in \$(seq 0 \$(($NODES - 1))); do
  gpus=\$(seq -s, \$((n * $GPUS)) \$((n * $GPUS + $GPUS - 1)))
  for t in \$(seq 0 \$((per - 1))); do
    CUDA_VISIBLE_DEVICES=\$gpus SLURM_NODEID=\$n SLURM_LOCALID=\$t \\
      SLURM_PROCID=\$((n * per + t)) SLURM_NTASKS=\$(($NODES * per)) "\$@" &
    pids+=(\$!)
  done
done
rc=0
for p in "\${pids[@]}"; do
  while kill -0 "\$p" 2>/dev/null; do wait "\$p" || true; done
  wait "\$p" || { s=\$?; [ \$rc -eq 0 ] && rc=\$s; }
done
exit \$rc
EOF
chmod +x "$BIN/scontrol" "$BIN/srun"
export PATH="$BIN:$PATH" SLURM_JOB_NODELIST=localhost SLURM_JOB_NUM_NODES=$NODES
export SLURM_JOB_ID=${SLURM_JOB_ID:-$$} SLURM_GPUS_ON_NODE=$GPUS
export SLURM_SUBMIT_DIR=${SLURM_SUBMIT_DIR:-$(cd "$HERE/../.." && pwd)}
export PYTHON=${PYTHON:-python3}
rc=0
bash "$HERE/train.sbatch" "$@" || rc=$?
exit $rc
