# Shared by the launch scripts (sourced, not run).
#
# Preemption: the trainer saves a checkpoint and exits cleanly on SIGTERM or SIGUSR1. The
# launchers themselves must not die first (torchrun and the deepspeed launcher take SIGTERM as
# "kill the workers", and SIGUSR1 would end them outright), so the scripts run the launcher in
# the background, catch the signal, and pass SIGUSR1 to the training processes only.

# `python -m megakd.cli` would put the current directory first on sys.path, so a yaml.py (or any
# module name megakd imports) lying there would run in every rank. PYTHONSAFEPATH (Python >= 3.11,
# the environment form of `python -P`) keeps it off; unlike `python -I` it still honours PYTHONPATH
# and the user site, and being an environment variable it reaches the ranks that torchrun and the
# deepspeed launcher start (DeepSpeed's multi-node runner exports PYTHON* variables to every node).
# megakd itself is found through its install (`pip install -e .`), not through the directory.
export PYTHONSAFEPATH=1

# Print the pids DEPTH levels below PID (1 = children).
descendants_at() {
    local depth=$1 pids=$2 next child
    while [ "$depth" -gt 0 ]; do
        next=""
        for child in $pids; do
            next="$next $(ps -o pid= --ppid "$child" 2>/dev/null | tr -d ' ' | tr '\n' ' ')"
        done
        pids=$next
        depth=$((depth - 1))
    done
    echo $pids
}

# run_forwarding_signals DEPTH CMD...: run CMD; on SIGTERM/SIGUSR1/SIGINT send SIGUSR1 to the
# processes DEPTH levels below it (the training ranks), then wait for CMD and return its status.
run_forwarding_signals() {
    local depth=$1
    shift
    "$@" &
    local pid=$! status
    # shellcheck disable=SC2064  # expand $pid now
    trap "echo 'launch: signal received, asking the ranks to checkpoint and stop' >&2; \
          kill -USR1 \$(descendants_at $depth $pid) 2>/dev/null" TERM USR1 INT
    while :; do
        wait "$pid" && status=0 || status=$?
        kill -0 "$pid" 2>/dev/null || break  # wait returns early (>128) when a trap ran
    done
    trap - TERM USR1 INT
    return "$status"
}

# is_command_word ARG: whether ARG names a megakd command (pretrain, finetune, bench, ...) rather
# than an option or a key=value. Launch scripts run `pretrain` when their arguments start with
# neither, so older command lines ("-c CONFIG ...") keep working.
is_command_word() {
    case "$1" in
        -*|*=*) return 1 ;;
        *) return 0 ;;
    esac
}

# free_port: a TCP port the OS reports free on this machine right now.
free_port() {
    python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# require_shell_safe WHAT ARG...: exit 2 naming the first ARG with a character outside
# [A-Za-z0-9_@%+=:,./-]. DeepSpeed's multi-node (pdsh) runner joins the command line into one shell
# string run on every node, so such an argument would be split, or its $(...) run, there.
require_shell_safe() {
    local what=$1 arg
    shift
    for arg in "$@"; do
        if [[ "$arg" =~ [^A-Za-z0-9_@%+=:,./-] ]]; then
            echo "launch: error: $what ${arg@Q}: expected only letters, digits and _@%+=:,./- (DeepSpeed's" \
                 "multi-node launcher runs the command line through a shell on every node)" >&2
            exit 2
        fi
    done
}

# takes_backend COMMAND: whether COMMAND reads backend.name (commands that train).
takes_backend() {
    case "$1" in pretrain|distill|finetune|glue|bench) return 0 ;; *) return 1 ;; esac
}
