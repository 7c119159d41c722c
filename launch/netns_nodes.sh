#!/usr/bin/env bash
# Two "nodes" on one machine: network namespaces joined by a veth pair (needs root + iproute2).
#
#   launch/netns_nodes.sh CMD [ARGS...]
#
# Runs CMD once in each namespace, with NNODES=2, NODE_RANK=0|1, MASTER_ADDR=<node 0's veth
# address>, MASTER_PORT, and GLOO_SOCKET_IFNAME=<that node's veth> (gloo would otherwise pick
# the namespace's loopback), so e.g. `launch/netns_nodes.sh launch/torchrun.sh 1 -c CONFIG ...`
# is a real 2-node rendezvous over the veth link. Exits with the first non-zero status; the
# namespaces are removed on exit. Exit status 77 = namespaces cannot be created here.
set -euo pipefail
tag="mkd$$"
subnet="10.$((200 + $$ % 50)).$(( ($$ / 50) % 250 )).0"
base="${subnet%.0}"
ns=("${tag}n0" "${tag}n1")
veth=("${tag}v0" "${tag}v1")

cleanup() {
    for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
}
trap cleanup EXIT

if ! ip netns add "${ns[0]}" 2>/dev/null; then
    echo "netns_nodes.sh: cannot create network namespaces (need root and iproute2)" >&2
    exit 77
fi
ip netns add "${ns[1]}"
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for i in 0 1; do
    ip link set "${veth[$i]}" netns "${ns[$i]}"
    ip -n "${ns[$i]}" addr add "$base.$((i + 1))/24" dev "${veth[$i]}"
    ip -n "${ns[$i]}" link set lo up
    ip -n "${ns[$i]}" link set "${veth[$i]}" up
done

pids=()
for i in 0 1; do
    ip netns exec "${ns[$i]}" env NNODES=2 NODE_RANK=$i MASTER_ADDR="$base.1" MASTER_PORT="${MASTER_PORT:-29500}" \
        GLOO_SOCKET_IFNAME="${veth[$i]}" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || { rc=$?; [ "$status" = 0 ] && status=$rc; }
done
exit "$status"
