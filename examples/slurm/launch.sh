#!/usr/bin/env bash
# One node's launch line, run by srun on every node of the allocation (train.sbatch):
#   srun bash examples/slurm/launch.sh <script> [args...]
# With FLASHCKPT_CONTROL_NODE=1 (train.sbatch's default) the allocation's first node serves the
# job's control plane in a job step of its own and trains nothing: etcd for the rendezvous, and
# the controller, which serves the in-process recovery store at its port + 1. No training
# node's loss takes them.
# Without it, the first node trains and serves the rendezvous, the controller and the store.
# The job's name (FLASHCKPT_JOB, else the Slurm job name) keeps a requeued job's snapshots.
set -euo pipefail
eval "$(python -m flashckpt.faults.slurm env)"
export FLASHCKPT_JOB FLASHCKPT_NODE="${FLASHCKPT_NODE:-$(hostname -s)}"
if [ -n "${FLASHCKPT_CONTROL_HOST:-}" ]; then
  # (Not ETCD_*: etcd reads those variables as its own flags.)
  etcd_port="${RDZV_PORT:-2379}" controller_port="${CONTROLLER_PORT:-29401}"
  if [ "${FLASHCKPT_CONTROL:-0}" = 1 ]; then
    data="${TMPDIR:-/tmp}/flashckpt-etcd-$FLASHCKPT_JOB-${SLURM_JOB_ID:-0}"
    "${FLASHCKPT_ETCD:-etcd}" --enable-v2 --data-dir "$data" --log-level warn \
      --listen-client-urls "http://0.0.0.0:$etcd_port" \
      --advertise-client-urls "http://$FLASHCKPT_CONTROL_HOST:$etcd_port" \
      --listen-peer-urls "http://127.0.0.1:${RDZV_PEER_PORT:-2380}" &
    etcd_pid=$!
    trap 'kill $etcd_pid 2>/dev/null || true' EXIT
    trap 'exit 0' TERM INT  # the step ended (SIGTERM to all of it): a clean stop
    # Until train.sbatch ends this job step (the training step is over) or the job is cancelled.
    flashckpt-agent controller --bind "0.0.0.0:$controller_port" \
      --policy "${FLASHCKPT_RESTART_POLICY:-in-process}"
    exit 0
  fi
  export FLASHCKPT_CONTROLLER="$FLASHCKPT_CONTROL_HOST:$controller_port"
  export FLASHCKPT_RESTART_POLICY="${FLASHCKPT_RESTART_POLICY:-in-process}"
  rdzv=(--rdzv-backend=etcd-v2 "--rdzv-endpoint=$FLASHCKPT_CONTROL_HOST:$etcd_port")
else
  rdzv=(--rdzv-backend=c10d "--rdzv-endpoint=$FLASHCKPT_RDZV_HOST:${RDZV_PORT:-29500}")
fi
exec flashckpt-run \
  --nnodes="$FLASHCKPT_NNODES" \
  --nproc-per-node="${NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}" \
  "${rdzv[@]}" \
  --rdzv-id="$FLASHCKPT_JOB" \
  --max-restarts="${MAX_RESTARTS:-3}" \
  "$@"
