"""The process-wide state one test can leave behind for the next in the same pytest process.

Under pytest-xdist a worker runs many files one after another, and which files share a worker
changes from run to run: a library function swapped, a torch setting flipped, an environment
variable or a signal handler left set by one file changes what a later file sees, and the later
file fails at random, on some machines (docs/testing.md § Tests that cannot see their neighbours).
`snapshot()` reads that state, `changes()` names what differs, `restore()` puts a snapshot back.
`tests/conftest.py` compares each test file's end with its start, fails the file's last test
with the difference and restores it, so a leak fails at its cause and not in whichever file runs
next. `tests/test_layering.py` uses the same snapshot to show that importing megakd changes none of it.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed
import torch.nn.functional
import torch.nn.init

# Namespaces whose functions a library may swap process-wide (DeepSpeed's ZeRO-3 replaces
# torch.nn.functional.linear "until manually reset"): each attribute is compared by identity.
NAMESPACES = {"torch": torch, "torch.nn.functional": torch.nn.functional, "torch.Tensor": torch.Tensor,
              "torch.nn.Module": torch.nn.Module, "torch.nn.init": torch.nn.init,
              "torch.autograd": torch.autograd, "torch.distributed": torch.distributed}
# Not compared: set by torch.compile's inductor for the compiled code it loads (a pointer only that code
# reads), and by `import deepspeed` (how torch asks whether CUDA is there; a full run's collection
# imports deepspeed before any test).
NOT_COMPARED_ENVIRONMENT = ("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "PYTORCH_NVML_BASED_CUDA_CHECK")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGCHLD,
           signal.SIGALRM)


@dataclass(frozen=True)
class Setting:
    read: Callable[[], Any]
    write: Callable[[Any], None] | None = None  # None: cannot be put back from outside (reported only)


def _attribute(owner: Any, name: str) -> Setting:
    return Setting(lambda: getattr(owner, name), lambda value: setattr(owner, name, value))


def _deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _autocast(value: tuple[bool, torch.dtype]) -> None:
    torch.set_autocast_enabled("cpu", value[0])
    torch.set_autocast_dtype("cpu", value[1])


def _umask() -> int:
    """The umask, read by setting it and back (the test process creates no file meanwhile)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _saved_tensors_hooks() -> int:
    """How many `saved_tensors_hooks` contexts are open (each pushed pair is popped on exit)."""
    count, stack = 0, []
    while (top := torch._C._autograd._top_saved_tensors_default_hooks(False)) is not None:
        stack.append(top)
        torch._C._autograd._pop_saved_tensors_default_hooks()
        count += 1
    for pack, unpack in reversed(stack):
        torch._C._autograd._push_saved_tensors_default_hooks(pack, unpack)
    return count


SETTINGS: dict[str, Setting] = {
    "torch default dtype": Setting(torch.get_default_dtype, torch.set_default_dtype),
    "torch deterministic algorithms": Setting(
        lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()),
        _deterministic),
    "torch float32 matmul precision": Setting(torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "torch grad enabled": Setting(torch.is_grad_enabled, torch.set_grad_enabled),
    "torch anomaly detection": Setting(torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "torch inference mode": Setting(torch.is_inference_mode_enabled),
    "torch cpu autocast": Setting(lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")),
                                  _autocast),
    "torch threads": Setting(torch.get_num_threads, torch.set_num_threads),
    "torch function modes": Setting(torch._C._len_torch_function_stack),
    "torch dispatch modes": Setting(lambda: len(torch.utils._python_dispatch._get_current_dispatch_mode_stack())),
    "saved tensors hooks": Setting(_saved_tensors_hooks),
    "process umask": Setting(_umask, os.umask),  # the mode of every file a later test writes
    "sys.exit": _attribute(sys, "exit"),  # wandb wraps both, for good, when its service starts
    "sys.excepthook": _attribute(sys, "excepthook"),
    "torch.backends.fp32_precision": _attribute(torch.backends, "fp32_precision"),
    "torch.backends.mkldnn.enabled": _attribute(torch.backends.mkldnn, "enabled"),
    "torch.backends.mkldnn.deterministic": _attribute(torch.backends.mkldnn, "deterministic"),
    "torch.backends.mkldnn.matmul.fp32_precision": _attribute(torch.backends.mkldnn.matmul, "fp32_precision"),
    "torch.backends.cuda.matmul.allow_tf32": _attribute(torch.backends.cuda.matmul, "allow_tf32"),
    "torch.backends.cuda.matmul.fp32_precision": _attribute(torch.backends.cuda.matmul, "fp32_precision"),
    "torch.backends.cudnn.allow_tf32": _attribute(torch.backends.cudnn, "allow_tf32"),
    "torch.backends.cudnn.benchmark": _attribute(torch.backends.cudnn, "benchmark"),
    "torch.backends.cudnn.deterministic": _attribute(torch.backends.cudnn, "deterministic"),
}


def snapshot() -> dict[str, Any]:
    """Every setting above, each namespace attribute (by identity), the environment and signal handlers."""
    state: dict[str, Any] = {name: setting.read() for name, setting in SETTINGS.items()}
    for prefix, namespace in NAMESPACES.items():
        state.update({f"{prefix}.{name}": value for name, value in vars(namespace).items()})
    state.update({f"environment {key}": value for key, value in os.environ.items()
                  if key not in NOT_COMPARED_ENVIRONMENT})
    state.update({f"handler of {signal.Signals(s).name}": signal.getsignal(s) for s in SIGNALS})
    return state


def changes(before: dict[str, Any], after: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (before, after)} for what differs. A namespace attribute that appeared is not a change
    (a submodule imported later); one that was replaced or removed is."""
    out = {}
    for key in before.keys() | after.keys():
        old, new = before.get(key, _ABSENT), after.get(key, _ABSENT)
        if old is new or (old is _ABSENT and key.split(" ")[0] != "environment"):
            continue
        if _is_namespace_key(key) or old is _ABSENT or new is _ABSENT or old != new:
            out[key] = (old, new)
    return out


def restore(before: dict[str, Any], changed: dict[str, tuple[Any, Any]]) -> None:
    """Put back what `changes` found (what can be put back from outside), the settings in SETTINGS' order:
    a general one (the float32 matmul precision) first, then the backend ones it also set."""
    order = {key: i for i, key in enumerate(SETTINGS)}
    for key, (old, _new) in sorted(changed.items(), key=lambda item: order.get(item[0], len(order))):
        if key in SETTINGS:
            if SETTINGS[key].write is not None:
                SETTINGS[key].write(old)
        elif key.startswith("environment "):
            name = key.removeprefix("environment ")
            if old is _ABSENT:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        elif key.startswith("handler of "):
            signal.signal(signal.Signals[key.removeprefix("handler of ")], old)
        else:
            prefix, name = _split_namespace_key(key)
            setattr(NAMESPACES[prefix], name, old)


def describe(changed: dict[str, tuple[Any, Any]]) -> str:
    return "; ".join(f"{key}: {_short(old)} -> {_short(new)}" for key, (old, new) in sorted(changed.items()))


class _Absent:
    def __repr__(self) -> str:
        return "(unset)"


_ABSENT = _Absent()


def _is_namespace_key(key: str) -> bool:
    return _split_namespace_key(key) is not None


def _split_namespace_key(key: str) -> tuple[str, str] | None:
    for prefix in sorted(NAMESPACES, key=len, reverse=True):
        if key.startswith(prefix + ".") and "." not in key[len(prefix) + 1:]:
            return prefix, key[len(prefix) + 1:]
    return None


def _short(value: Any) -> str:
    if callable(value):
        text = f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '')}"
    else:
        text = repr(value)
    return text if len(text) < 120 else text[:117] + "..."
