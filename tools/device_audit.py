"""A simulated CUDA device on CPU: catches mixed-device bugs and counts host-device syncs in CPU tests.

Every test runs on CPU, where nothing can mix devices. Under `simulated_cuda()`, a tensor asked
for on `cuda` (a factory's `device=`, `.to`, `.cuda()`) becomes a `SimulatedTensor`: a wrapper
whose `.device` says `cuda:0` while it holds a real CPU tensor, so the arithmetic, the numbers and
the control flow are the real ones. Each aten op on a simulated tensor is checked as CUDA would
check it: a plain CPU tensor among its arguments that is not 0-dim (CUDA accepts CPU scalars, and
CPU indices for indexing) raises `MixedDeviceError` naming the op, and so does a CPU
`torch.Generator` drawing for a CUDA tensor. Whatever makes the host wait for the device is
counted in `SyncCounter` with the Python caller's file:line: reading a value (`.item()`,
`float()`, `bool()`), copies to the host, blocking copies to the device, and ops whose output
size depends on the data (boolean-mask indexing, `nonzero`, `masked_select`, `unique`, ...).

Why not a wrapper that is a CUDA tensor to C++ too: on a CPU-only torch, autograd looks up the
device guard of every tensor it records and aborts the process for `cuda`, and factories reach
the CUDA lazy-init before any dispatch mode sees them. So C++ sees CPU, the Python-visible
`device` says cuda, a `TorchFunctionMode` moves factories and copies, and the wrapper's
`__torch_dispatch__` checks and counts. Autocast on `cuda` becomes CPU autocast (same dtype), so bf16
runs for real (C++ sees CPU tensors; CPU autocast's op lists are close to CUDA's, not identical), and
an op CUDA has and the CPU lacks runs as its host equivalent (`_CUDA_ONLY`). Nothing else that calls
the CUDA runtime itself (torch.cuda.*, a cuda `torch.Generator`, fp16's `GradScaler`, pinned memory)
can run under it: keep simulated runs to fp32 or bf16 and `kernels.backend=torch`.

`simulated_cuda(devices=N)` also answers the device queries that choose a rank's GPU (`is_available`,
`device_count`, `set_device`, `current_device`) as a process that sees N GPUs: `set_device` past them
fails as CUDA does ("invalid device ordinal"). The tensors stay on the one simulated `cuda:0`.

Support for tests/ and tools/ only, so not in the installed package: tests import it as `device_audit`
(tests/conftest.py puts tools/ on the path), as tools/bench_electra_step.py does from beside it.
"""

from __future__ import annotations

import contextlib
import importlib
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

SIMULATED = torch.device("cuda", 0)
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)
_aten = torch.ops.aten

# Ops whose output size depends on the data: CUDA must copy a count to the host first.
_DATA_DEPENDENT = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
                   _aten.unique_dim.default, _aten.unique_consecutive.default, _aten.repeat_interleave.Tensor,
                   _aten.nonzero_static.default}
_INDEXING = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default,
             _aten._index_put_impl_.default}
_COPIES = {_aten.copy_.default, _aten._to_copy.default}


def _mm_into(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """CUDA's `torch.mm(a, b, out_dtype=)` on the host: 16-bit products accumulated in `out_dtype` (exact
    products in fp32, as cuBLAS accumulates them), where the CPU has no such GEMM."""
    return _aten.mm.default(_aten._to_copy.default(a, dtype=out_dtype), _aten._to_copy.default(b, dtype=out_dtype))


# Ops CUDA has and the CPU lacks, with their host equivalents.
_CUDA_ONLY = {_aten.mm.dtype: _mm_into}


class MixedDeviceError(RuntimeError):
    """An op that would fail on a GPU: CUDA and (non-scalar) CPU tensors, or a CPU generator for CUDA."""


@dataclass
class SyncCounter:
    """Host-device synchronisations seen under `simulated_cuda`, by (kind, caller file:line)."""

    sites: Counter = field(default_factory=Counter)

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def add(self, kind: str) -> None:
        self.sites[(kind, _caller())] += 1

    def top(self, n: int = 10) -> list[tuple[str, str, int]]:
        return [(kind, site, count) for (kind, site), count in self.sites.most_common(n)]

    def report(self, n: int = 10) -> str:
        return "\n".join(f"{count:4d}  {kind:<22} {site}" for kind, site, count in self.top(n))


_counter: SyncCounter | None = None  # the active simulation's counter


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module (where the sync was asked for)."""
    for frame in reversed(traceback.extract_stack()):
        name = str(Path(frame.filename).resolve())
        if name != _HERE and not name.startswith(_TORCH):
            return f"{frame.filename}:{frame.lineno}"
    return "?"


def _count(kind: str) -> None:
    if _counter is not None:
        _counter.add(kind)


class SimulatedTensor(torch.Tensor):
    """A CPU tensor (`inner`) that reports `cuda:0` to Python; see the module docstring."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, layout=inner.layout, device=inner.device, requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor):
        self.inner = inner

    device = property(lambda self: SIMULATED)
    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)

    def get_device(self) -> int:
        return SIMULATED.index

    def __repr__(self) -> str:
        return f"SimulatedTensor({self.inner!r})"

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, _meta, _size, _stride):
        return SimulatedTensor(inner_tensors["inner"])

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _COPIES:
            return _dispatch_copy(func, args, kwargs)
        checked = (args, kwargs)
        if func in _INDEXING:
            indices = [t for t in tree_flatten(args[1])[0] if isinstance(t, torch.Tensor)]
            if any(t.dtype in (torch.bool, torch.uint8) for t in indices):
                _count("boolean mask indexing")
            if any(not isinstance(t, SimulatedTensor) and t.dim() > 0 for t in indices):
                _count("blocking copy to device")  # CUDA moves cpu indices itself
            checked = (args[0], args[2:], kwargs)
        plain = [t for t in tree_flatten(checked)[0]
                 if isinstance(t, torch.Tensor) and not isinstance(t, SimulatedTensor) and t.dim() > 0]
        if plain:
            raise MixedDeviceError(f"{func}: mixes cuda tensors with cpu tensors of shape "
                                   f"{[tuple(t.shape) for t in plain]} (only 0-dim cpu tensors may join a "
                                   "cuda op)")
        if func in _DATA_DEPENDENT:
            _count(f"data-dependent {func.__name__.split('.')[0]}")
        if func is _aten._local_scalar_dense.default:
            _count("read value (.item)")
            return func(args[0].inner)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, SimulatedTensor)]
        wrappers = {id(t.inner): t for t in tensors}  # an in-place op returns its argument, not a new wrapper
        out = _CUDA_ONLY.get(func, func)(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        return tree_map(lambda t: _rewrap(t, wrappers), out)


def _unwrap(t):
    return t.inner if isinstance(t, SimulatedTensor) else t


def _wrap(t: torch.Tensor) -> SimulatedTensor:
    return SimulatedTensor(t)


def _rewrap(t, wrappers: dict):
    if not isinstance(t, torch.Tensor):
        return t
    return wrappers[id(t)] if id(t) in wrappers else SimulatedTensor(t)


def _dispatch_copy(func, args, kwargs):
    """`copy_` between the host and the device (counted when it blocks); `_to_copy` stays where it is.

    C++ sees a simulated tensor as a CPU one, so a `_to_copy` reaching here never changes device:
    moves go through `_move`.
    """
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if isinstance(dst, SimulatedTensor) != isinstance(src, SimulatedTensor) and not non_blocking:
            _count("blocking copy to host" if isinstance(src, SimulatedTensor) else "blocking copy to device")
        _unwrap(dst).copy_(_unwrap(src))
        return dst
    kwargs = {k: v for k, v in kwargs.items() if k != "device"}
    return SimulatedTensor(func(_unwrap(args[0]), *args[1:], **kwargs))


class _Move(torch.autograd.Function):
    """A copy between the host and the simulated device that autograd differentiates (grad moves back)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, to_device: bool):
        ctx.to_device = to_device
        return _wrap(_unwrap(x).clone()) if to_device else _unwrap(x).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_unwrap(grad) if ctx.to_device else _wrap(grad)), None


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu}


class _SimulateCuda(TorchFunctionMode):
    """Factories and copies that name `cuda` make simulated tensors; host reads of them are counted."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _MOVES:
            return _move(func, args, kwargs)
        if func in (torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__) and \
                isinstance(args[0], SimulatedTensor):
            _count(f"read values (.{func.__name__})")
            return func(args[0].inner, *args[1:], **kwargs)
        generator = kwargs.get("generator")
        device = kwargs.get("device")
        if _is_cuda(device):
            kwargs["device"] = "cpu"
        on_device = _is_cuda(device) or any(isinstance(t, SimulatedTensor) for t in tree_flatten(args)[0])
        if on_device and isinstance(generator, torch.Generator) and generator.device.type != "cuda":
            raise MixedDeviceError(f"{getattr(func, '__name__', func)}: a {generator.device.type} "
                                   "torch.Generator draws for a cuda tensor (CUDA needs a cuda generator)")
        out = func(*args, **kwargs)
        if not _is_cuda(device):
            return out
        if func in (torch.tensor, torch.as_tensor):
            _count("blocking copy to device")
        return tree_map(lambda t: _wrap(t) if type(t) is torch.Tensor else t, out)


def _move(func, args, kwargs):
    """`.to`, `.cuda()`, `.cpu()`: where the data is going, whether it blocks, and autograd through it."""
    src, rest = args[0], args[1:]
    on_device = isinstance(src, SimulatedTensor)
    if func is torch.Tensor.cuda:
        to_device, dtype, non_blocking = True, None, kwargs.get("non_blocking", False)
    elif func is torch.Tensor.cpu:
        to_device, dtype, non_blocking = False, None, False
    else:
        if rest and isinstance(rest[0], torch.Tensor):
            other = rest[0]
            device, dtype, non_blocking = other.device, other.dtype, kwargs.get("non_blocking", False)
        else:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*rest, **kwargs)
        to_device = on_device if device is None else _is_cuda(device)
        if dtype is not None:
            src = src.to(dtype)
    if to_device == on_device:
        return src if dtype is None else src.to(dtype)
    if not non_blocking:
        _count("blocking copy to device" if to_device else "blocking copy to host")
    return _Move.apply(src, to_device)


class _CpuAutocast(torch.autocast):
    """`torch.autocast("cuda", ...)` as CPU autocast: what C++ sees of a simulated tensor is a CPU tensor."""

    def __init__(self, device_type: str, *args, **kwargs):
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


def _on_cpu_for_cuda(query):
    """An autocast query (`torch.is_autocast_enabled`, `torch.get_autocast_dtype`) that asks CPU autocast
    about `cuda`, which `_CpuAutocast` turned on."""
    return lambda device_type="cuda": query("cpu" if device_type == "cuda" else device_type)


def _grouped_on_simulated(group):
    """torch's foreach grouping keyed by the device Python sees (C++ would say cpu for a simulated tensor)."""

    def grouped(tensorlistlist, with_indices=False):
        out = {}
        for (device, dtype), value in group(tensorlistlist, with_indices).items():
            first = next((t for t in value[0][0] if t is not None), None)
            out[(SIMULATED if isinstance(first, SimulatedTensor) else device, dtype)] = value
        return out

    return grouped


_GROUPING_USERS = (torch.utils._foreach_utils, torch.nn.utils.clip_grad,
                   importlib.import_module("torch.optim.optimizer"))


class _VisibleDevices:
    """The device queries of a process that sees `count` GPUs (`simulated_cuda(devices=)`)."""

    def __init__(self, count: int):
        self.count, self.current = count, 0

    def set_device(self, device) -> None:
        index = device if isinstance(device, int) else torch.device(device).index or 0
        if not 0 <= index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal (device {index}, {self.count} visible)")
        self.current = index

    def patches(self) -> list:
        return [mock.patch("torch.cuda.is_available", lambda: self.count > 0),
                mock.patch("torch.cuda.device_count", lambda: self.count),
                mock.patch("torch.cuda.set_device", self.set_device),
                mock.patch("torch.cuda.current_device", lambda: self.current)]


@contextlib.contextmanager
def simulated_cuda(devices: int | None = None) -> Iterator[SyncCounter]:
    """Run the block as if on `cuda:0` (see the module docstring); yields the block's sync counter.
    `devices`: answer the device queries as a process that sees that many GPUs (None leaves them alone)."""
    global _counter
    if _counter is not None:
        raise RuntimeError("simulated_cuda() is already active")
    _counter = SyncCounter()
    try:
        with contextlib.ExitStack() as stack:
            for module in _GROUPING_USERS:
                group = module._group_tensors_by_device_and_dtype
                stack.enter_context(mock.patch.object(module, "_group_tensors_by_device_and_dtype",
                                                      _grouped_on_simulated(group)))
            # fork_rng(devices=[cuda]) saves and restores the device's RNG state; a simulated tensor
            # draws from the CPU generator, which fork_rng restores itself.
            stack.enter_context(mock.patch("torch.cuda.get_rng_state",
                                           lambda device="cuda": torch.get_rng_state()))
            stack.enter_context(mock.patch("torch.cuda.set_rng_state", lambda new_state, device="cuda": None))
            stack.enter_context(mock.patch("torch.autocast", _CpuAutocast))
            for query in ("is_autocast_enabled", "get_autocast_dtype"):
                stack.enter_context(mock.patch(f"torch.{query}", _on_cpu_for_cuda(getattr(torch, query))))
            for patch in _VisibleDevices(devices).patches() if devices is not None else []:
                stack.enter_context(patch)
            stack.enter_context(_SimulateCuda())
            yield _counter
    finally:
        _counter = None
