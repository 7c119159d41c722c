"""CUDA benchmark: Triton kernels against the torch paths and the naive references.

Times forward+backward with CUDA events (median of ``--repeat`` after warm-up) and reports peak
allocated memory from ``torch.cuda.max_memory_allocated``, with ratios against naive torch. Every
row's result is then checked against the float64 reference on the same inputs (loss and input
gradients; samples by their distribution, megakd/bench/kernel_parity.py): PASS/FAIL per row, a
failing or crashing row never stops the table, and the exit status is 1 if a torch or Triton row
failed (the naive row, the reference's own algorithm in the benchmark's dtype, is shown for scale).

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


def main() -> int:
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

    def ce(backend):
        return lambda a, w, b: K.fused_linear_cross_entropy(a, w, b, target, backend=backend)

    def kl(backend):
        return lambda a, w, b: K.fused_linear_kl(a, w, t_hidden, t_weight, 2.0, b, backend=backend)

    def sample(backend):
        return lambda a, w: K.fused_linear_sample(a, w, None, torch.Generator().manual_seed(0), backend=backend)

    def rtd(backend):
        return lambda a, w, b: K.fused_rtd_loss(a, w, b, corrupted, original, pad, backend=backend)

    def lip1(backend):
        return lambda *w: K.lipschitz_1norm(list(w), backend=backend)

    # op -> (inputs, {impl: fn(*inputs)}); the naive fn in float64 is the reference
    cases = {
        "kl": ([hidden, weight, bias], {
            "naive": lambda a, w, b: K.fused_linear_kl_reference(a, w, t_hidden.to(a.dtype), t_weight.to(a.dtype),
                                                                 2.0, b),
            "torch": kl("torch"), "triton": kl("triton")}),
        "ce": ([hidden, weight, bias], {
            "naive": lambda a, w, b: K.fused_linear_cross_entropy_reference(a, w, b, target),
            "torch": ce("torch"), "triton": ce("triton")}),
        "sample": ([hidden.detach(), weight.detach()], {
            "naive": lambda a, w: K.fused_linear_sample_reference(a, w, None, torch.Generator().manual_seed(0)),
            "torch": sample("torch"), "triton": sample("triton")}),
        "rtd": ([d_hidden, d_weight, d_bias], {
            "naive": lambda a, w, b: K.fused_rtd_loss_reference(a, w, b, corrupted, original, pad),
            "torch": rtd("torch"), "triton": rtd("triton")}),
        "lip1": (lip, {
            "naive": lambda *w: K.lipschitz_1norm_reference(list(w)), "torch": lip1("torch"),
            "triton": lip1("triton")}),
    }
    print(f"{torch.cuda.get_device_name()}: N={n}, H={h}, V={v}, {args.dtype}, fwd+bwd, median of {args.repeat}")
    header = f"{'op':<7}{'impl':<8}{'ms':>10}{'peak MiB':>11}{'time vs naive':>15}{'mem vs naive':>14}  check"
    print(header)
    print("-" * len(header))
    failed = []
    for op, (inputs, impls) in cases.items():
        ref_ms = ref_mib = None
        for impl, fn in impls.items():
            timing = f"{'-':>10}{'-':>11}{'-':>15}{'-':>14}"  # kept when the timing itself fails
            try:
                ms, mib = _measure(lambda fn=fn, xs=inputs: _loss(fn(*xs)), inputs, args.repeat)
                if impl == "naive":
                    ref_ms, ref_mib = ms, mib
                t_ratio = f"{ms / ref_ms:.2f}x" if ref_ms else "-"
                m_ratio = f"{ref_mib / max(mib, 1e-9):.1f}x less" if ref_mib else "-"
                timing = f"{ms:>10.2f}{mib:>11.0f}{t_ratio:>15}{m_ratio:>14}"
                status, detail = "PASS", _check(op, impls["naive"], fn, inputs, dt)
            except Exception as err:  # noqa: BLE001 - OOM, a compile error or a mismatch: this row's FAIL
                status, detail = "FAIL", f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:160]}"
            if impl == "naive":
                status = "ref"
            elif status == "FAIL":
                failed.append(f"{op}/{impl}")
            print(f"{op:<7}{impl:<8}{timing}  {status} {detail}", flush=True)
            torch.cuda.empty_cache()
    print(f"SUMMARY: {args.dtype}: {'FAIL ' + ', '.join(failed) if failed else 'every torch and Triton row PASS'}")
    return 1 if failed else 0


def _loss(out):
    """The timed value: a loss as is, a (samples, argmax) pair as a float (sampling has no backward)."""
    return out[0].float() if isinstance(out, tuple) else out


def _check(op: str, naive, fn, inputs: list, dtype: torch.dtype) -> str:
    """fn's result against the naive function in float64 on the same inputs; raises Mismatch."""
    from megakd.bench.kernel_parity import check_against_reference, check_sample

    if op == "sample":
        samples, argmax = fn(*inputs)
        return check_sample(samples, argmax, *inputs, None, 1.0)
    return check_against_reference(fn, naive, inputs, dtype)

if __name__ == "__main__":
    sys.exit(main())
