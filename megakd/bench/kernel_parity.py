"""Every fused kernel against its float64 reference, per dtype, at production or small shapes.

The inputs are rounded to the kernel's dtype first and the reference runs on those same values in
float64, so what is measured is the kernel's own error (accumulation order, low-precision
arithmetic, the online softmax), never the rounding of its inputs. `tools/gpu_check.py` runs this
on the GPU (and on CPU under TRITON_INTERPRET=1 at small shapes); `tools/bench_kernels_cuda.py`
checks its results with `check_against_reference`.

    python -m megakd.bench.kernel_parity --device cuda                 # production shapes
    TRITON_INTERPRET=1 python -m megakd.bench.kernel_parity --device cpu --small --dtypes fp32
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Sequence

import torch

from megakd import kernels as K

fp32, bf16, fp16 = torch.float32, torch.bfloat16, torch.float16
# name -> (activation dtype, weight dtype): DeepSpeed bf16/fp16 casts both; autocast keeps fp32 weights
DTYPES = {"fp32": (fp32, fp32), "bf16": (bf16, bf16), "fp16": (fp16, fp16), "bf16-w32": (bf16, fp32)}
# activation dtype -> (loss error, gradient relative-norm error); the loss error is relative to
# max(|loss|, 1), i.e. absolute for the small KL values
TOL = {fp32: (1e-5, 1e-4), bf16: (8e-3, 2e-2), fp16: (2e-3, 5e-3)}
# standard errors a sampled E[log p] may sit from its exact value
SAMPLE_Z = 6.0
BACKENDS = ("triton", "torch")


class Mismatch(AssertionError):
    """A kernel's result outside its tolerance (the message says by how much)."""


def rel_norm(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    norm = float(b.norm())
    return float((a - b).norm()) / norm if norm > 0 else float((a - b).abs().max())


def value_grads(fn: Callable, xs: Sequence[torch.Tensor | None]) -> tuple[torch.Tensor, list]:
    """fn(*xs) and the gradient of each tensor input (fresh leaves, so repeated calls are independent)."""
    leaves = [None if x is None else x.detach().clone().requires_grad_(x.is_floating_point()) for x in xs]
    out = fn(*leaves)
    if out.requires_grad:
        out.backward()
    return out.detach(), [None if x is None else x.grad for x in leaves]


def check_against_reference(fn: Callable, reference: Callable, xs: Sequence[torch.Tensor | None],
                            dtype: torch.dtype, tol_scale: float = 1.0) -> str:
    """Compare fn(*xs) and its input gradients with reference(*xs in float64); raise `Mismatch`."""
    out, grads = value_grads(fn, xs)
    ref, ref_grads = value_grads(reference, [None if x is None or not x.is_floating_point() else x.double()
                                             for x in xs])
    loss_tol, grad_tol = (t * tol_scale for t in TOL[dtype])
    loss_err = abs(float(out) - float(ref)) / max(abs(float(ref)), 1.0)
    grad_err = max((rel_norm(g, r) for g, r in zip(grads, ref_grads) if r is not None), default=0.0)
    detail = f"loss_err={loss_err:.1e} grad_err={grad_err:.1e}"
    # strict: a tolerance of 0 fails every case, which is how a planted failure is made
    if not (math.isfinite(float(out)) and loss_err < loss_tol and grad_err < grad_tol):
        raise Mismatch(f"{detail} (tolerances {loss_tol:.0e}, {grad_tol:.0e}; "
                       f"loss {float(out):.6g} vs {float(ref):.6g})")
    return detail


def check_sample(samples: torch.Tensor, argmax: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, temperature: float, tol_scale: float = 1.0) -> str:
    """Samples in range, argmax of the fp64 logits, and mean log p(sample) within SAMPLE_Z standard errors."""
    logits = hidden.double() @ weight.double().T + (0 if bias is None else bias.double())
    vocab = logits.shape[1]
    if int(samples.min()) < 0 or int(samples.max()) >= vocab:
        raise Mismatch(f"sample out of range [0, {vocab})")
    gap = logits.max(-1).values - logits.gather(1, argmax.long()[:, None])[:, 0]
    if float(gap.max()) > 1e-3 * max(1.0, float(logits.abs().max())) * tol_scale or tol_scale == 0:
        raise Mismatch(f"argmax off by {float(gap.max()):.2e} in logit")
    logp = torch.log_softmax(logits / temperature, -1)
    mean = float(logp.gather(1, samples.long()[:, None]).mean())
    p = logp.exp()
    expect = (p * logp).sum(-1)
    var = ((p * logp * logp).sum(-1) - expect**2).clamp_min(1e-30)
    z = (mean - float(expect.mean())) * len(samples) / math.sqrt(float(var.sum()))  # standard error: sqrt(Σvar)/rows
    if not abs(z) < SAMPLE_Z * tol_scale:
        raise Mismatch(f"E[log p(sample)]={mean:.4f} vs {float(expect.mean()):.4f}, z={z:+.1f}: wrong distribution")
    return f"z={z:+.2f}"


def parity_cases(device: torch.device, small: bool, dtypes: Sequence[str], backends: Sequence[str] = BACKENDS,
                 tol_scale: float = 1.0) -> list[tuple[str, Callable[[], str]]]:
    """(name, thunk) per comparison; a thunk returns its errors or raises `Mismatch`."""
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, scale=1.0, dtype=fp32):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    def randint(high, n):
        return torch.randint(0, high, (n,), device=device, generator=g)

    ce_shapes = [(1, 16, 7), (37, 32, 300)] if small else [(37, 64, 1000), (300, 256, 30522), (2458, 768, 128000)]
    kl_shapes = [(19, 16, 24, 300)] if small else [(37, 64, 67, 1000), (2458, 256, 768, 128000)]
    sample_shapes = [(37, 16, 4000, 0.7)] if small else [(37, 16, 200_000, 0.7), (128000, 768, 8192, 1.0),
                                                          (128000, 768, 8192, 2.0)]
    rtd_shape = (256, 32) if small else (16384, 768)
    lip_shapes = [(32, 32), (64, 32), (32, 64)] if small else [(768, 768), (3072, 768), (768, 3072)]
    cases = []
    for dname in dtypes:
        act, wdt = DTYPES[dname]
        for backend in backends:
            tag = f"{dname:8} {backend:6}"
            for n, h, v in ce_shapes:
                def ce(n=n, h=h, v=v, act=act, wdt=wdt, backend=backend):
                    target = randint(v, n)
                    target[1::3] = -100
                    return check_against_reference(
                        lambda a, w, b: K.fused_linear_cross_entropy(a, w, b, target, backend=backend),
                        lambda a, w, b: K.fused_linear_cross_entropy_reference(a, w, b, target),
                        [randn(n, h, dtype=act), randn(v, h, scale=0.05, dtype=wdt), randn(v, scale=0.1, dtype=wdt)],
                        act, tol_scale)
                cases.append((f"ce      {tag} N={n} H={h} V={v}", ce))
            for n, hs, ht, v in kl_shapes:
                def kl(n=n, hs=hs, ht=ht, v=v, act=act, wdt=wdt, backend=backend):
                    th, tw = randn(n, ht), randn(v, ht, scale=0.05)  # the frozen teacher stays fp32
                    return check_against_reference(
                        lambda a, w, b: K.fused_linear_kl(a, w, th, tw, 2.0, b, backend=backend),
                        lambda a, w, b: K.fused_linear_kl_reference(a, w, th.double(), tw.double(), 2.0, b),
                        [randn(n, hs, dtype=act), randn(v, hs, scale=0.05, dtype=wdt), randn(v, scale=0.1, dtype=wdt)],
                        act, 2 * tol_scale)
                cases.append((f"kl      {tag} N={n} Hs={hs} Ht={ht} V={v}", kl))
            for v, h, rows, tau in sample_shapes:
                def sample(v=v, h=h, rows=rows, tau=tau, act=act, wdt=wdt, backend=backend):
                    w, b = randn(v, h, scale=0.5 if v < 100 else 0.05, dtype=wdt), randn(v, scale=0.3, dtype=wdt)
                    hidden = randn(1, h, dtype=act).expand(rows, h).contiguous()  # one distribution, many draws
                    gen = torch.Generator().manual_seed(1)  # a CPU generator, as the trainer's sampling stream
                    s, a = K.fused_linear_sample(hidden, w, b, gen, tau, backend=backend)
                    return check_sample(s, a, hidden, w, b, tau, tol_scale)
                cases.append((f"sample  {tag} V={v} H={h} rows={rows} tau={tau}", sample))
            n, h = rtd_shape

            def rtd(n=n, h=h, act=act, wdt=wdt, backend=backend):
                original = randint(128000, n)
                corrupted = torch.where(torch.rand(n, device=device, generator=g) < 0.15, original + 1, original)
                mask = torch.rand(n, device=device, generator=g) < 0.9
                return check_against_reference(
                    lambda a, w, b: K.fused_rtd_loss(a, w, b, corrupted, original, mask, backend=backend),
                    lambda a, w, b: K.fused_rtd_loss_reference(a, w, b, corrupted, original, mask),
                    [randn(n, h, dtype=act), randn(h, scale=0.05, dtype=wdt), randn((), scale=0.1, dtype=wdt)],
                    act, tol_scale)
            cases.append((f"rtd     {tag} N={n} H={h}", rtd))
            if act == wdt:  # weights only: bf16-w32 is the fp32 case again
                def lip(act=act, backend=backend):
                    ws = [randn(*s, scale=0.05, dtype=act) for s in lip_shapes] + [randn(40, 3, dtype=act).t()]
                    return check_against_reference(lambda *w: K.lipschitz_1norm(list(w), backend=backend),
                                                   lambda *w: K.lipschitz_1norm_reference(list(w)), ws, act, tol_scale)
                cases.append((f"lip1    {tag} {len(lip_shapes) + 1} matrices", lip))
    return cases


def run_cases(cases: list[tuple[str, Callable[[], str]]], device: torch.device) -> int:
    """Run every case (one failure never stops the rest); print PASS/FAIL lines; return the failures."""
    failed = 0
    for name, thunk in cases:
        start = time.perf_counter()
        try:
            detail, status = thunk(), "PASS"
        except Exception as err:  # noqa: BLE001 - a kernel error is this case's FAIL, not the run's end
            detail, status = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[-1][:300]}", "FAIL"
            failed += 1
        print(f"{status} {name}  {detail}  ({time.perf_counter() - start:.1f}s)", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"SUMMARY: {len(cases) - failed}/{len(cases)} kernel comparisons within tolerance", flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="small shapes (the Triton interpreter on CPU)")
    p.add_argument("--dtypes", default=",".join(DTYPES), help=f"comma-separated, of {', '.join(DTYPES)}")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--tol-scale", type=float, default=1.0, help="multiplies every tolerance (0 fails every case)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    # fp32 Triton dots then use input_precision="ieee", as the references do
    torch.backends.cuda.matmul.allow_tf32 = False
    dtypes = [d for d in args.dtypes.split(",") if d]
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        p.error(f"--dtypes: unknown {unknown}, expected some of {list(DTYPES)}")
    cases = parity_cases(device, args.small, dtypes, args.backends.split(","), args.tol_scale)
    return 1 if run_cases(cases, device) else 0


if __name__ == "__main__":
    sys.exit(main())
