"""CUDA benchmark: Triton kernels against the torch paths and the naive references.

Times forward+backward with CUDA events (median of ``--repeat`` after warm-up) and reports peak
allocated memory from ``torch.cuda.max_memory_allocated``, with ratios against naive torch.

    python tools/bench_kernels_cuda.py                      # N=4096, H=768, V=128000, bf16
    python tools/bench_kernels_cuda.py --dtype float32 --tokens 8192
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch


def _measure(fn, params, repeat: int) -> tuple[float, float]:
    def step():
        for p in params:
            p.grad = None
        out = fn()
        if out.requires_grad:
            out.backward()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--vocab", type=int, default=128000)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--repeat", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels_cuda.py needs a CUDA device (torch.cuda.is_available() is False); "
                 "use tools/bench_kernels.py on CPU")
    from megakd import kernels as K

    dev, dt = torch.device("cuda"), getattr(torch, args.dtype)
    n, h, v = args.tokens, args.hidden, args.vocab
    g = torch.Generator(device=dev).manual_seed(0)

    def param(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt).requires_grad_(True)

    hidden, weight, bias = param(n, h, scale=0.5), param(v, h, scale=0.05), param(v, scale=0.0)
    t_hidden, t_weight = param(n, h, scale=0.5).detach(), param(v, h, scale=0.05).detach()
    target = torch.randint(0, v, (n,), generator=g, device=dev)
    d_hidden, d_weight, d_bias = param(n * 4, h), param(h, scale=0.05), param((), scale=0.0)
    original = torch.randint(0, v, (n * 4,), generator=g, device=dev)
    corrupted = torch.where(torch.rand(n * 4, generator=g, device=dev) < 0.15, target.repeat(4), original)
    pad = torch.rand(n * 4, generator=g, device=dev) < 0.9
    lip = [param(h, h), param(4 * h, h), param(h, 4 * h)] * 12

    cases = {
        "kl": ([hidden, weight, bias], {
            "naive": lambda: K.fused_linear_kl_reference(hidden, weight, t_hidden, t_weight, 2.0, bias),
            "torch": lambda: K.fused_linear_kl(hidden, weight, t_hidden, t_weight, 2.0, bias, backend="torch"),
            "triton": lambda: K.fused_linear_kl(hidden, weight, t_hidden, t_weight, 2.0, bias, backend="triton"),
        }),
        "ce": ([hidden, weight, bias], {
            "naive": lambda: K.fused_linear_cross_entropy_reference(hidden, weight, bias, target),
            "torch": lambda: K.fused_linear_cross_entropy(hidden, weight, bias, target, backend="torch"),
            "triton": lambda: K.fused_linear_cross_entropy(hidden, weight, bias, target, backend="triton"),
        }),
        "sample": ([], {
            "naive": lambda: K.fused_linear_sample_reference(hidden.detach(), weight.detach(), None)[0].float(),
            "torch": lambda: K.fused_linear_sample(hidden, weight, None, backend="torch")[0].float(),
            "triton": lambda: K.fused_linear_sample(hidden, weight, None, backend="triton")[0].float(),
        }),
        "rtd": ([d_hidden, d_weight, d_bias], {
            "naive": lambda: K.fused_rtd_loss_reference(d_hidden, d_weight, d_bias, corrupted, original, pad),
            "torch": lambda: K.fused_rtd_loss(d_hidden, d_weight, d_bias, corrupted, original, pad, backend="torch"),
            "triton": lambda: K.fused_rtd_loss(d_hidden, d_weight, d_bias, corrupted, original, pad,
                                               backend="triton"),
        }),
        "lip1": (lip, {
            "naive": lambda: K.lipschitz_1norm_reference(lip),
            "torch": lambda: K.lipschitz_1norm(lip, backend="torch"),
            "triton": lambda: K.lipschitz_1norm(lip, backend="triton"),
        }),
    }
    print(f"{torch.cuda.get_device_name()}: N={n}, H={h}, V={v}, {args.dtype}, fwd+bwd, median of {args.repeat}")
    header = f"{'op':<7}{'impl':<8}{'ms':>10}{'peak MiB':>11}{'time vs naive':>15}{'mem vs naive':>14}"
    print(header)
    print("-" * len(header))
    for op, (params, impls) in cases.items():
        ref_ms = ref_mib = None
        for impl, fn in impls.items():
            try:
                ms, mib = _measure(fn, params, args.repeat)
            except torch.cuda.OutOfMemoryError:
                print(f"{op:<7}{impl:<8}{'OOM':>10}")
                torch.cuda.empty_cache()
                continue
            if impl == "naive":
                ref_ms, ref_mib = ms, mib
            t_ratio = f"{ms / ref_ms:.2f}x" if ref_ms else "-"
            m_ratio = f"{ref_mib / max(mib, 1e-9):.1f}x less" if ref_mib else "-"
            print(f"{op:<7}{impl:<8}{ms:>10.2f}{mib:>11.0f}{t_ratio:>15}{m_ratio:>14}")


if __name__ == "__main__":
    main()
