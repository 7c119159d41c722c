#!/usr/bin/env bash
# Local (or simple multi-node) launch with torchrun: one process per CPU slot / GPU.
#
#   launch/torchrun.sh [NPROC] -c configs/electra-tiny.yaml [--resume auto] [key=value ...]
#
# NPROC defaults to the GPU count (or 2 on CPU). Multi-node without a scheduler: set NNODES,
# NODE_RANK, MASTER_ADDR (and MASTER_PORT) on every node. SIGTERM/SIGUSR1 to this script make
# every rank save a checkpoint and exit; run the same command with --resume auto to continue.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$here/common.sh"

nproc=""
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi
if [ -z "$nproc" ]; then
    nproc=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
: "${OMP_NUM_THREADS:=1}"
export OMP_NUM_THREADS

args=(--nproc_per_node="$nproc" --nnodes="${NNODES:-1}" --node_rank="${NODE_RANK:-0}"
      --master_addr="${MASTER_ADDR:-127.0.0.1}" --master_port="${MASTER_PORT:-29500}")
run_forwarding_signals 1 python -m torch.distributed.run "${args[@]}" -m megakd.cli pretrain "$@"
