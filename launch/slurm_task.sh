#!/usr/bin/env bash
# One rank of a Slurm job (started by `srun` in slurm.sbatch): derives the rendezvous and runs
# `megakd COMMAND "$@"` (COMMAND: pretrain when the arguments start with an option, as before).
# megakd reads its rank, world size and local rank from SLURM_PROCID, SLURM_NTASKS and
# SLURM_LOCALID; this script adds MASTER_ADDR (the job's first node), a MASTER_PORT (slurm.sbatch
# sets a free one; under a bare srun it is derived from the job id) and one OpenMP thread per
# allocated CPU. Values already in the environment win.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$here/common.sh"
: "${SLURM_PROCID:?run this under srun (SLURM_PROCID is not set)}"
: "${SLURM_NTASKS:?run this under srun (SLURM_NTASKS is not set)}"
if [ -z "${MASTER_ADDR:-}" ]; then
    MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
: "${MASTER_PORT:=$((20000 + ${SLURM_JOB_ID:-0} % 20000))}"
: "${OMP_NUM_THREADS:=${SLURM_CPUS_PER_TASK:-1}}"
export MASTER_ADDR MASTER_PORT OMP_NUM_THREADS
command=pretrain
if [ $# -gt 0 ] && is_command_word "$1"; then command=$1; shift; fi
exec python -m megakd.cli "$command" "$@"
