#!/usr/bin/env bash
# Launch with the `deepspeed` launcher, on this machine or on the hosts of a hostfile.
#
#   launch/deepspeed.sh [--hostfile launch/hostfile] [--num_gpus N] [COMMAND] [ARGS...]
#   launch/deepspeed.sh --num_gpus 2 finetune -c configs/finetune-rt.yaml backend.zero_stage=1
#   launch/deepspeed.sh --num_gpus 2 -c configs/electra-tiny.yaml    (no COMMAND: pretrain, as before)
#
# COMMAND is any megakd command (pretrain, distill, finetune, bench, ...). The hostfile lists
# "hostname slots=N" per line (see hostfile.example); the launcher reaches the hosts over
# passwordless ssh (pdsh) and starts N ranks on each. For commands that train, backend.name=deepspeed
# is added unless the arguments set backend.name. On CPU use --num_gpus to choose the number of
# ranks. Without --master_port the rendezvous takes a port that is free now (the launcher's fixed
# default would collide with a second job on the same machine). With --hostfile, an argument (or
# a variable DeepSpeed exports to the nodes) with a character outside [A-Za-z0-9_@%+=:,./-] is
# refused: DeepSpeed's pdsh runner would run it through a shell on every node. SIGTERM/SIGUSR1 to
# this script make the local ranks checkpoint and exit (remote ranks get the scheduler's signal on
# their own node).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
. "$here/common.sh"

launcher=()
while [ $# -gt 0 ]; do
    case "$1" in
        --hostfile|--num_gpus|--num_nodes|--master_addr|--master_port|--include|--exclude)
            launcher+=("$1" "$2"); shift 2 ;;
        --hostfile=*|--num_gpus=*|--num_nodes=*|--master_addr=*|--master_port=*|--include=*|--exclude=*)
            launcher+=("$1"); shift ;;
        *) break ;;
    esac
done
[[ " ${launcher[*]-} " == *" --master_port"* ]] || launcher+=(--master_port "$(free_port)")
command=pretrain
if [ $# -gt 0 ] && is_command_word "$1"; then command=$1; shift; fi
extra=()
if takes_backend "$command" && [[ " $* " != *" backend.name="* ]]; then extra+=(backend.name=deepspeed); fi
: "${OMP_NUM_THREADS:=1}"  # the deepspeed launcher does not set it
export OMP_NUM_THREADS
# /job/hostfile: the hostfile the launcher reads when none is given.
if [[ " ${launcher[*]} " == *" --hostfile"* ]] || [ -f /job/hostfile ]; then
    # Multi-node: the arguments pass through a shell on every node (see require_shell_safe in
    # common.sh), and so do the variables DeepSpeed exports there (the prefixes of its runner's
    # EXPORT_ENVS and NCCL), inside double quotes, where $ ` " and \ are still live.
    require_shell_safe argument "$command" "$@"
    for name in $(compgen -e); do
        case "$name" in PYTHON*|MLFLOW*|MV2*|UCX*|NCCL*)
            if [[ "${!name}" == *[\$\`\"\\]* ]]; then
                echo "launch: error: variable $name=${!name@Q}: expected no \$, \`, \" or \\ (DeepSpeed's" \
                     "multi-node launcher exports it through a shell on every node)" >&2
                exit 2
            fi ;;
        esac
    done
fi
# deepspeed runner -> deepspeed.launcher.launch -> ranks: the ranks are two levels down.
run_forwarding_signals 2 deepspeed "${launcher[@]}" --no_local_rank --module megakd.cli "$command" "$@" "${extra[@]}"
