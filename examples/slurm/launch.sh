#!/usr/bin/env bash
# One node's launch line, run by srun on every node of the allocation (train.sbatch):
#   srun bash examples/slurm/launch.sh <script> [args...]
# The rendezvous, the controller and the recovery store are served on the first node of the
# allocation; the job's name (FLASHCKPT_JOB, else the Slurm job name) keeps a requeued job's
# snapshots. flashckpt-run starts this node's agent and, on the first node, the controller.
set -euo pipefail
eval "$(python -m flashckpt.faults.slurm env)"
export FLASHCKPT_JOB FLASHCKPT_NODE="${FLASHCKPT_NODE:-$(hostname -s)}"
exec flashckpt-run \
  --nnodes="$FLASHCKPT_NNODES" \
  --nproc-per-node="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}" \
  --rdzv-backend=c10d \
  --rdzv-endpoint="$FLASHCKPT_RDZV_HOST:${RDZV_PORT:-29500}" \
  --rdzv-id="$FLASHCKPT_JOB" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  "$@"
