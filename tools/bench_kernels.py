"""CPU benchmark: fused linear KL / cross-entropy (chunked torch path) against naive torch.

Each (op, implementation) runs in a fresh subprocess so peak memory is not polluted by the other.
Peak memory is the rise of the process high-water mark (Linux ``VmHWM``, reset through
``/proc/self/clear_refs``) over the resident size just before the timed calls, i.e. the working
memory one forward+backward needs on top of its inputs; tracemalloc cannot see torch allocations.
Time is the best of ``--repeat`` forward+backward calls (after two warm-up calls) over ``--rounds``
rounds that alternate naive and fused subprocesses: on a shared machine the minimum is the estimate
least disturbed by other load.

    python tools/bench_kernels.py                    # V=128000, N=2048, H=256
    python tools/bench_kernels.py --tokens 4096 --hidden 768 --ops ce
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _worker(op: str, impl: str, n: int, h: int, v: int, repeat: int, threads: int) -> dict:
    from megakd import kernels as K

    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=g) * 0.5).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * 0.05).requires_grad_(True)
    bias = torch.zeros(v).requires_grad_(True)
    if op == "kl":
        t_hidden = torch.randn(n, h, generator=g) * 0.5
        t_weight = torch.randn(v, h, generator=g) * 0.05
        if impl == "naive":
            def call():
                return K.fused_linear_kl_reference(hidden, weight, t_hidden, t_weight, 2.0, bias)
        else:
            def call():
                return K.fused_linear_kl(hidden, weight, t_hidden, t_weight, 2.0, bias, backend="torch")
    else:
        target = torch.randint(0, v, (n,), generator=g)
        if impl == "naive":
            def call():
                return K.fused_linear_cross_entropy_reference(hidden, weight, bias, target)
        else:
            def call():
                return K.fused_linear_cross_entropy(hidden, weight, bias, target, backend="torch")

    def step():
        for p in (hidden, weight, bias):
            p.grad = None
        loss = call()
        loss.backward()
        return loss.item()

    loss = step()  # warm-up
    step()
    times = []
    for p in (hidden, weight, bias):
        p.grad = None
    base = _status_kib("VmRSS")
    _reset_peak()
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = _status_kib("VmHWM") - base
    return {"op": op, "impl": impl, "loss": loss, "time_s": min(times), "peak_mib": peak / 1024}


def _run(op: str, impl: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--worker", op, impl, "--tokens", str(args.tokens),
           "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--repeat", str(args.repeat),
           "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=dict(os.environ))
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128000)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--ops", nargs="+", default=["kl", "ce"], choices=["kl", "ce"])
    p.add_argument("--worker", nargs=2, metavar=("OP", "IMPL"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(_worker(*args.worker, args.tokens, args.hidden, args.vocab, args.repeat, args.threads)))
        return

    print(f"N={args.tokens} tokens, H={args.hidden}, V={args.vocab}, fp32, forward+backward, "
          f"{args.threads} threads, best of {args.repeat} calls x {args.rounds} rounds")
    header = (f"{'op':<4} {'naive MiB':>10} {'fused MiB':>10} {'mem ratio':>10} "
              f"{'naive s':>8} {'fused s':>8} {'time ratio':>10} {'|dloss|':>9}")
    print(header)
    print("-" * len(header))
    for op in args.ops:
        runs = {"naive": [], "fused": []}
        for _ in range(args.rounds):
            for impl in runs:
                runs[impl].append(_run(op, impl, args))
        naive, fused = ({"loss": r[0]["loss"], "time_s": min(x["time_s"] for x in r),
                         "peak_mib": max(x["peak_mib"] for x in r)} for r in runs.values())
        print(f"{op:<4} {naive['peak_mib']:>10.0f} {fused['peak_mib']:>10.0f} "
              f"{naive['peak_mib'] / fused['peak_mib']:>9.1f}x {naive['time_s']:>8.2f} {fused['time_s']:>8.2f} "
              f"{fused['time_s'] / naive['time_s']:>9.2f}x {abs(naive['loss'] - fused['loss']):>9.1e}")
    print("mem ratio = naive/fused peak working memory (higher is better); time ratio = fused/naive.")


if __name__ == "__main__":
    main()
