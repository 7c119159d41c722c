#!/usr/bin/env bash
# Local (or simple multi-node) launch with torchrun: one process per CPU slot / GPU.
#
#   launch/torchrun.sh [NPROC] [COMMAND] [ARGS...]
#   launch/torchrun.sh 2 finetune -c configs/finetune-rt.yaml
#   launch/torchrun.sh 2 -c configs/electra-tiny.yaml train.micro_batch_size=16   (no COMMAND: pretrain)
#
# COMMAND is any megakd command (pretrain, distill, finetune, bench, ...). Commands that train run
# every rank as one run with backend.name auto (the default: ddp under a launcher), ddp or deepspeed;
# an explicit backend.name=single is refused under a launcher (bench measures it as ddp). NPROC
# defaults to the GPU count (or 2 on CPU). On one node the rendezvous is c10d on a port the OS
# picks, so two jobs on one machine never collide. Multi-node without a scheduler: set NNODES, NODE_RANK, MASTER_ADDR
# (and MASTER_PORT) on every node. SIGTERM/SIGUSR1 to this script make every rank save a
# checkpoint and exit; run the same command with --resume auto to continue.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$here/common.sh"

nproc=""
if [[ "${1:-}" =~ ^[0-9]+$ ]]; then nproc=$1; shift; fi
command=pretrain
if [ $# -gt 0 ] && is_command_word "$1"; then command=$1; shift; fi
if [ -z "$nproc" ]; then
    nproc=$(python -c 'import torch; print(torch.cuda.device_count() or 2)')
fi
: "${OMP_NUM_THREADS:=1}"
export OMP_NUM_THREADS

if [ "${NNODES:-1}" -gt 1 ]; then
    rendezvous=(--nnodes="$NNODES" --node_rank="${NODE_RANK:-0}"
                --master_addr="${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}" --master_port="${MASTER_PORT:-29500}")
else
    rendezvous=(--nnodes=1 --rdzv-backend=c10d --rdzv-endpoint=localhost:0 --rdzv-id="megakd-$$-$RANDOM")
fi
run_forwarding_signals 1 python -m torch.distributed.run --nproc_per_node="$nproc" "${rendezvous[@]}" \
    -m megakd.cli "$command" "$@"
