"""Backend resolution shared by every kernel: ``backend="auto" | "triton" | "torch"``.

Rules (one place, so every kernel behaves the same):

- ``"torch"``: the chunked torch implementation (bounded memory, runs anywhere).
- ``"triton"``: the Triton kernel. On CUDA tensors it compiles; on CPU tensors it needs the Triton
  interpreter, i.e. ``TRITON_INTERPRET=1`` set before the kernel modules are first used (they are
  imported lazily, on the first Triton call, for exactly this reason). Anything else is an error,
  never a silent fallback.
- ``"auto"``: Triton when the tensors are on CUDA and Triton imports; otherwise the torch path.
  ``auto`` never picks the interpreter even when ``TRITON_INTERPRET=1``: it is a debugging tool
  100-300x slower than torch on CPU, so it must be asked for explicitly. Each fallback is logged
  once at INFO, naming the kernel and the reason.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "torch")


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpret() -> bool:
    """True when ``TRITON_INTERPRET`` asks for the interpreter (how Triton runs on CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class CudaTarget:
    """The GPU a Triton launch compiles for: what its launch configuration depends on."""

    arch: int  # compute capability as major * 10 + minor: 80 = A100, 90 = H100
    multiprocessors: int  # streaming multiprocessors: 108 on an A100, 132 on an H100 SXM

    @property
    def generation(self) -> str:
        """The configuration tables' key: "sm90" for Hopper and later, "sm80" for Ampere and Ada."""
        return "sm90" if self.arch >= 90 else "sm80"


_compile_target: contextvars.ContextVar[CudaTarget | None] = contextvars.ContextVar("compile_target", default=None)


def cuda_target(device: torch.device) -> CudaTarget:
    """The target of a launch on CUDA ``device``: the device itself, or the one :func:`compiling_for` names."""
    named = _compile_target.get()
    if named is not None:
        return named
    return _device_target(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _device_target(index: int) -> CudaTarget:
    props = torch.cuda.get_device_properties(index)
    return CudaTarget(props.major * 10 + props.minor, props.multi_processor_count)


@contextlib.contextmanager
def compiling_for(target: CudaTarget) -> Iterator[None]:
    """Within: the Triton wrappers choose their launches for ``target`` whatever their tensors' device.

    ``tools/compile_kernels.py`` runs the wrappers on CPU tensors under this, records the launches they
    make (without running them) and compiles each for ``target``: the configurations it checks are the
    wrappers' own choices, not a copy of them.
    """
    token = _compile_target.set(target)
    try:
        yield
    finally:
        _compile_target.reset(token)


@functools.cache
def _log_once(op: str, message: str) -> None:
    logger.info("megakd.kernels.%s: %s", op, message)


def resolve_backend(backend: str, device: torch.device, op: str) -> str:
    """Return ``"triton"`` or ``"torch"`` for a kernel ``op`` whose tensors live on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError(f"{op}: backend='triton' but the triton package is not installed")
        if device.type == "cuda":
            return "triton"
        if device.type == "cpu":
            if not triton_interpret():
                raise RuntimeError(
                    f"{op}: backend='triton' with CPU tensors needs TRITON_INTERPRET=1 set before the "
                    "first Triton call (or use backend='torch' / 'auto')"
                )
            return "triton"
        raise RuntimeError(f"{op}: backend='triton' supports cuda or cpu tensors, got device {device}")
    if device.type == "cuda" and triton_available():
        _log_once(op, "backend=auto chose triton (CUDA)")
        return "triton"
    reason = "no CUDA tensors" if device.type != "cuda" else "triton not installed"
    _log_once(op, f"backend=auto chose the chunked torch path ({reason})")
    return "torch"


def check_tensor(name: str, t: object, ndim: int, op: str) -> torch.Tensor:
    """Validate that argument ``name`` is a tensor with ``ndim`` dimensions (one-line error if not)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    return t


def check_float(name: str, t: torch.Tensor, op: str) -> None:
    """Reject non-floating tensors where the kernel computes in floating point."""
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be a floating tensor, got {t.dtype}")


# ----------------------------------------------------------------------------------------------
# The fused LM head's backward on the Triton path: which of its two variants runs.

HEAD_BACKWARDS = ("auto", "chunked", "atomic")
DEFAULT_HEAD_BACKWARD = "chunked"  # what "auto" means
_head_backward: contextvars.ContextVar[str] = contextvars.ContextVar("head_backward", default="auto")


@contextlib.contextmanager
def head_backward(name: str) -> Iterator[None]:
    """Within: the Triton head losses (``fused_linear_cross_entropy``/``_kl``/``_and_sample``) use backward
    ``name``: "chunked" (no atomics, bitwise reproducible), "atomic" (fp32 atomics) or "auto" (the
    roofline's choice, :func:`chosen_head_backward`). The choice is read when the loss's forward runs.
    The torch path is chunked whatever this says."""
    if name not in HEAD_BACKWARDS:
        raise ValueError(f"head_backward: expected one of {HEAD_BACKWARDS}, got {name!r}")
    token = _head_backward.set(name)
    try:
        yield
    finally:
        _head_backward.reset(token)


def chosen_head_backward() -> str:
    """"chunked" or "atomic": the variant :func:`head_backward` selects here, "auto" resolved to the one
    ``megakd.bench.roofline.head_backward_roofline`` predicts faster at electra-base's production shape
    (chunked, on both the H100 and the A100; tests/kernels/test_head_backward.py checks the two agree)."""
    name = _head_backward.get()
    return DEFAULT_HEAD_BACKWARD if name == "auto" else name
