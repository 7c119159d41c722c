"""The suite's leak guard (tests/global_state.py): what one test file may not leave behind is seen,
named and put back."""

from __future__ import annotations

import os
import signal

import torch

from tests import global_state


def test_a_leak_of_each_kind_is_named_and_put_back(monkeypatch):
    before = global_state.snapshot()
    linear = torch.nn.functional.linear
    handler = signal.getsignal(signal.SIGUSR2)
    monkeypatch.delenv("MEGAKD_LEAK_PROBE", raising=False)

    def leaked_linear(*args):
        return linear(*args)

    torch.nn.functional.linear = leaked_linear  # what DeepSpeed's ZeRO-3 did
    os.environ["MEGAKD_LEAK_PROBE"] = "1"
    signal.signal(signal.SIGUSR2, lambda *_: None)
    torch.set_float32_matmul_precision("medium")
    torch.set_grad_enabled(False)
    umask = os.umask(0o077)
    try:
        changed = global_state.changes(before, global_state.snapshot())
        assert {"environment MEGAKD_LEAK_PROBE", "handler of SIGUSR2", "torch float32 matmul precision",
                "torch.backends.mkldnn.matmul.fp32_precision",  # "medium": fp32 matmuls in bf16 on oneDNN
                "torch grad enabled", "torch.nn.functional.linear", "process umask"} <= set(changed)
        assert "torch.nn.functional.linear: torch._C._nn.linear -> " in global_state.describe(changed)
        global_state.restore(before, changed)
        assert global_state.changes(before, global_state.snapshot()) == {}
        assert torch.nn.functional.linear is linear and "MEGAKD_LEAK_PROBE" not in os.environ
        assert signal.getsignal(signal.SIGUSR2) is handler and torch.is_grad_enabled()
        assert os.umask(umask) == umask
    finally:
        torch.nn.functional.linear = linear
        signal.signal(signal.SIGUSR2, handler)
        os.umask(umask)
        global_state.restore(before, global_state.changes(before, global_state.snapshot()))


def test_an_attribute_that_appears_is_not_a_leak_but_one_replaced_by_an_equal_object_is():
    before = global_state.snapshot()
    after = dict(before)
    after["torch.some_submodule_imported_later"] = object()
    assert global_state.changes(before, after) == {}
    after["torch.Tensor.backward"] = lambda *a: None
    assert list(global_state.changes(before, after)) == ["torch.Tensor.backward"]
