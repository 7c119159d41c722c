"""CUDA benchmark: Triton kernels against the torch paths and the naive references.

Times forward+backward with CUDA events (median of ``--repeat`` after warm-up) and reports peak
allocated memory from ``torch.cuda.max_memory_allocated``, with ratios against naive torch. Every
row's result is then checked against the float64 reference on the same inputs (loss and input
gradients; samples by their distribution, megakd/bench/kernel_parity.py): PASS/FAIL per row, a
failing or crashing row never stops the table, and the exit status is 1 if a torch or Triton row
failed (the naive row, the reference's own algorithm in the benchmark's dtype, is shown for scale).

Then the head's two backwards (``kernels.dispatch.head_backward``: "chunked", the default, and "atomic"),
CE and KL: the forward and the backward timed apart, beside what tools/compile_kernels.py computes
for the same launches (its roofline at the datasheet peaks of the GPU's generation, Triton launches only:
torch's own matmuls and fills are measured, not computed), each checked against float64, and the ratio
of the two backwards. ``--device cpu`` rehearses that section alone under the Triton interpreter
(``TRITON_INTERPRET=1``, tiny shapes; wall-clock times, the computed column for an H100).

    python tools/bench_kernels_cuda.py                      # N=4096, H=768, V=128000, bf16
    python tools/bench_kernels_cuda.py --dtype float32 --tokens 8192
    python tools/bench_kernels_cuda.py --tokens 2458 --heads-only   # the two head backwards, production shape
    TRITON_INTERPRET=1 python tools/bench_kernels_cuda.py --device cpu --tokens 40 --hidden 24 --vocab 300 \
        --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tools/compile_kernels.py: its roofline, not a copy
import compile_kernels  # noqa: E402


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
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cpu: the head-backward section alone, under TRITON_INTERPRET=1 (a rehearsal)")
    p.add_argument("--heads-only", action="store_true", help="only the two head backwards, chunked and atomic")
    args = p.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_kernels_cuda.py needs a CUDA device (torch.cuda.is_available() is False); "
                 "use tools/bench_kernels.py on CPU, or --device cpu for the head-backward rehearsal")
    from megakd import kernels as K

    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
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
    failed = []
    if args.device == "cuda" and not args.heads_only:
        failed += _ops_table(cases, args)
    failed += _head_backwards(cases, args)
    print(f"SUMMARY: {args.dtype}: {'FAIL ' + ', '.join(failed) if failed else 'every torch and Triton row PASS'}")
    return 1 if failed else 0


def _ops_table(cases: dict, args: argparse.Namespace) -> list[str]:
    """Every op, naive vs torch vs Triton, forward and backward together; the failed rows' names."""
    n, h, v = args.tokens, args.hidden, args.vocab
    dt = getattr(torch, args.dtype)
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
    return failed


def _elapsed_ms(device: torch.device, work) -> float:
    """Milliseconds ``work()`` takes on ``device``: CUDA events on a GPU, the wall clock on the CPU."""
    if device.type != "cuda":
        start = time.perf_counter()
        work()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    work()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _phase_ms(fn, inputs: list, repeat: int) -> tuple[float, float]:
    """Median milliseconds of the forward alone and of the backward alone, after one untimed step."""
    device = inputs[0].device
    forward, backward = [], []
    for i in range(repeat + 1):
        for x in inputs:
            x.grad = None
        out: list = []
        fwd = _elapsed_ms(device, lambda out=out: out.append(fn(*inputs)))
        bwd = _elapsed_ms(device, lambda out=out: out[0].backward())
        if i:
            forward.append(fwd)
            backward.append(bwd)
    return statistics.median(forward), statistics.median(backward)


def _computed_us(fn, inputs: list, target_name: str) -> dict[str, dict[str, float | None]]:
    """{"forward" | "backward": {kernel: µs}} of the Triton launches ``fn`` makes, recorded (not run) for
    ``target_name``'s GPU and costed by tools/compile_kernels.py's roofline; None: no cost model."""
    with compile_kernels.compiling_for(compile_kernels.GPUS[target_name].target):
        with compile_kernels.recorded_launches() as forward:
            loss = fn(*inputs)
        with compile_kernels.recorded_launches() as backward:
            loss.backward()
    phases: dict[str, dict[str, float | None]] = {"forward": {}, "backward": {}}
    for phase, launches in (("forward", forward), ("backward", backward)):
        for launch in launches:
            name = launch.kernel.fn.__name__
            computed = compile_kernels.launch_roofline(launch, target_name)
            before = phases[phase].get(name, 0.0)
            phases[phase][name] = None if computed is None or before is None else before + computed[0] * 1e6
    for x in inputs:
        x.grad = None
    return phases


def _head_backwards(cases: dict, args: argparse.Namespace) -> list[str]:
    """CE and KL under each head backward: forward and backward measured apart and computed; the failed rows."""
    from megakd.kernels.dispatch import head_backward

    dev = torch.device(args.device)
    if dev.type == "cuda":
        major, minor = torch.cuda.get_device_capability()
        target_name = "sm_90a" if major >= 9 else "sm_80"  # the datasheet peaks the roofline uses
        where = f"{torch.cuda.get_device_name()} (computed: {target_name}'s datasheet peaks)"
    else:
        target_name, where = "sm_90a", "CPU rehearsal, Triton interpreter (computed: sm_90a's datasheet peaks)"
    print(f"\nhead backwards: {where}; N={args.tokens}, H={args.hidden}, V={args.vocab}, {args.dtype}, "
          f"median of {args.repeat}")
    header = (f"{'op':<4}{'backward':<10}{'phase':<10}{'measured ms':>13}{'computed ms':>13}"
              "  kernels (computed ms)  check")
    print(header)
    print("-" * len(header))
    failed, backward_ms = [], {}
    for op in ("ce", "kl"):
        inputs, impls = cases[op]
        for choice in ("chunked", "atomic"):
            with head_backward(choice):
                try:
                    fwd_ms, bwd_ms = _phase_ms(impls["triton"], inputs, args.repeat)
                    computed = _computed_us(impls["triton"], inputs, target_name)
                    detail = _check(op, impls["naive"], impls["triton"], inputs, getattr(torch, args.dtype))
                    status = "PASS"
                except Exception as err:  # noqa: BLE001 - a crash or a mismatch is this row's FAIL
                    fwd_ms = bwd_ms = float("nan")
                    computed = {"forward": {}, "backward": {}}
                    status = "FAIL"
                    detail = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:160]}"
                    failed.append(f"{op}/{choice}")
            backward_ms[op, choice] = (bwd_ms, _total(computed["backward"]))
            for phase, measured in (("forward", fwd_ms), ("backward", bwd_ms)):
                kernels = computed[phase]
                said = ", ".join(f"{k} {'no cost model' if us is None else f'{us / 1e3:.3g}'}"
                                 for k, us in kernels.items())
                total = _total(kernels)
                print(f"{op:<4}{choice:<10}{phase:<10}{measured:>13.3f}{_ms(total):>13}  {said or '-'}  "
                      f"{status} {detail if phase == 'backward' else ''}".rstrip(), flush=True)
        (chunked, chunked_c), (atomic, atomic_c) = backward_ms[op, "chunked"], backward_ms[op, "atomic"]
        print(f"{op:<4}atomic / chunked backward: measured {atomic / chunked:.2f}x, computed "
              f"{'-' if not (atomic_c and chunked_c) else f'{atomic_c / chunked_c:.2f}x'}")
    return failed


def _total(kernels: dict[str, float | None]) -> float | None:
    """The kernels' computed µs summed; None when one has no cost model."""
    return None if None in kernels.values() else sum(kernels.values())


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1e3:.3g}"


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
