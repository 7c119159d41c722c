import logging

import pytest
import torch
from megakd.kernels import dispatch, fused_linear_cross_entropy, lipschitz_1norm


def test_unknown_backend_names_the_argument():
    with pytest.raises(ValueError, match="backend: expected one of"):
        lipschitz_1norm([torch.randn(3, 3)], backend="cuda")


def test_torch_and_auto_on_cpu_resolve_to_torch(caplog):
    dispatch._log_once.cache_clear()
    cpu = torch.device("cpu")
    assert dispatch.resolve_backend("torch", cpu, "op") == "torch"
    with caplog.at_level(logging.INFO, logger="megakd.kernels.dispatch"):
        assert dispatch.resolve_backend("auto", cpu, "op") == "torch"
        assert dispatch.resolve_backend("auto", cpu, "op") == "torch"
    # the fallback is announced, once
    msgs = [r.getMessage() for r in caplog.records if "chunked torch path" in r.getMessage()]
    assert len(msgs) == 1 and "op" in msgs[0]


def test_auto_never_picks_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.resolve_backend("auto", torch.device("cpu"), "op") == "torch"


def test_triton_on_cpu_without_interpreter_is_an_error(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h, w = torch.randn(4, 3), torch.randn(5, 3)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fused_linear_cross_entropy(h, w, None, torch.zeros(4, dtype=torch.long), backend="triton")
