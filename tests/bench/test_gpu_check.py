"""tools/gpu_check.py's CPU rehearsal: the kernel-parity step under the Triton interpreter at small shapes,
the bench step's head-backward section (chunked vs atomic, measured beside computed) at tiny ones, the
profile step's trace at test size, and the step list on one GPU and on two."""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megakd.kernels import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
from megakd.kernels.dispatch import triton_available

from megakd.bench.kernel_parity import Mismatch, check_against_reference
from tests.helpers import tiny_overrides

REPO = Path(__file__).parents[2]
OPS = ("ce", "kl", "sample", "rtd", "lip1")


def gpu_check(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(REPO / "tools" / "gpu_check.py"), "--device", "cpu", "--only",
                           "parity", "--small", "--out", str(out), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow  # two interpreter runs of every kernel: ~20 s
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_every_kernel_passes_and_a_planted_failure_fails(tmp_path):
    proc = gpu_check(tmp_path / "ok", "--dtypes", "fp32,bf16")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "| parity | PASS |" in (tmp_path / "ok" / "summary.md").read_text()
    log = (tmp_path / "ok" / "parity.log").read_text().splitlines()
    for op in OPS:
        for dtype in ("fp32", "bf16"):
            for backend in ("triton", "torch"):
                rows = [x for x in log if x.split()[1:4] == [op, dtype, backend]]
                assert rows and all(x.startswith("PASS") for x in rows), (op, dtype, backend, rows)

    proc = gpu_check(tmp_path / "planted", "--dtypes", "fp32", "--tol-scale", "0")  # no error is < 0
    assert proc.returncode == 1
    assert "| parity | FAIL |" in (tmp_path / "planted" / "summary.md").read_text()
    rows = [x for x in (tmp_path / "planted" / "parity.log").read_text().splitlines() if x[:4] in ("PASS", "FAIL")]
    assert {x.split()[1] for x in rows} == set(OPS) and all(x.startswith("FAIL") for x in rows), rows
    assert "FAIL parity" in proc.stdout


@pytest.mark.slow  # one interpreter run of the head's kernels, CE and KL, both backwards: ~7 s
@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_the_head_backwards_are_timed_side_by_side_beside_their_computed_time(tmp_path):
    proc = gpu_check(tmp_path, "--only", "bench")
    assert proc.returncode == 0, proc.stdout[-3000:]
    log = (tmp_path / "bench.log").read_text().splitlines()
    rows = {tuple(x.split()[:3]): x.split() for x in log
            if x.split()[:1] in (["ce"], ["kl"]) and x.split()[2:3] in (["forward"], ["backward"])}
    assert set(rows) == {(op, choice, phase) for op in ("ce", "kl") for choice in ("chunked", "atomic")
                         for phase in ("forward", "backward")}
    assert all("PASS" in row for row in rows.values()), rows
    # computed: the compulsory bytes at H100's 3,350 GB/s (memory-bound at N=40, H=24, V=300, fp32; the
    # CE head has a bias, the KL teacher none; the atomic backward also reads and writes its fp32 gradients)
    n, h, v, f32 = 40, 24, 300, 4
    ce_inputs = (n * h + v * h + v) * f32
    expected_ms = {("ce", "forward"): ce_inputs, ("kl", "forward"): ce_inputs + (n * h + v * h) * f32,
                   ("ce", "atomic backward"): ce_inputs + 2 * (n * h + v * h) * f32}
    for (op, phase), moved in expected_ms.items():
        key = (op, "atomic", "backward") if phase == "atomic backward" else (op, "chunked", phase)
        assert float(rows[key][4]) == pytest.approx(moved / 3350e9 * 1e3, rel=5e-3), (key, rows[key])
    for op in ("ce", "kl"):
        ratio = next(x for x in log if x.startswith(f"{op}  atomic / chunked backward"))
        measured = float(rows[op, "atomic", "backward"][3]) / float(rows[op, "chunked", "backward"][3])
        computed = float(rows[op, "atomic", "backward"][4]) / float(rows[op, "chunked", "backward"][4])
        assert f"measured {measured:.2f}x, computed {computed:.2f}x" in ratio, ratio


def test_a_wrong_reference_is_a_mismatch():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(8, 16, generator=g), torch.randn(50, 16, generator=g), None]
    target = torch.randint(0, 50, (8,), generator=g)

    def kernel(h, w, b):
        return fused_linear_cross_entropy(h, w, b, target, backend="torch")

    assert "loss_err" in check_against_reference(
        kernel, lambda h, w, b: fused_linear_cross_entropy_reference(h, w, b, target), xs, torch.float32)
    with pytest.raises(Mismatch, match="loss_err"):
        check_against_reference(
            kernel, lambda h, w, b: 1.001 * fused_linear_cross_entropy_reference(h, w, b, target), xs, torch.float32)


def test_the_base_step_reports_its_measured_step_beside_the_computed_one(tmp_path, monkeypatch):
    """On an H100 the base run's check prints docs/performance.md's computed step for the run's own config."""
    gpu_check = _import_gpu_check()
    from megakd.bench.hardware import GPUS
    from megakd.bench.memory import parameter_counts
    from megakd.bench.step_time import predict_step
    from megakd.config import load_config
    from megakd.configio import save_config
    from megakd.finish import finish_config

    cfg = finish_config(load_config(REPO / "configs" / "electra-base.yaml",
                                    ["data.vocab_size=8000", "train.global_batch_size=64"]))
    save_config(cfg, tmp_path / "config.yaml")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    computed = predict_step(cfg, GPUS["h100"], 32, 2, parameter_counts(cfg)["total"]).step_s
    text = gpu_check.computed_step(tmp_path, tokens_per_s=64 * 512 / 0.25)
    assert f"step 250 ms measured, {computed * 1e3:,.0f} ms computed for H100-SXM5" in text
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla T4")
    assert gpu_check.computed_step(tmp_path, 1e5) == ""  # no preset: nothing claimed


def _import_gpu_check():
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(REPO / "tools"))
    return gpu_check


def _steps(gpus: int, tmp_path: Path) -> dict:
    gpu_check = _import_gpu_check()
    args = argparse.Namespace(out=tmp_path, quick=True, device="cuda", dtypes=None, tol_scale=1.0, small=False,
                              only=list(gpu_check.STEPS), gpus=gpus)
    return {step.name: step for step in gpu_check.build_steps(args)}


def test_the_two_rank_nccl_step_runs_with_two_gpus_and_says_why_not_with_one(tmp_path):
    """One GPU: every step but nccl, which is skipped with its reason and within the --quick budget of 8
    minutes; two: nccl runs `megakd bench`'s collectives and electra-tiny under ZeRO-1 on two ranks. The
    syncs and profile steps train in bf16 under ZeRO-1, as a cluster run does."""
    one, two = _steps(1, tmp_path), _steps(2, tmp_path)
    assert list(one) == ["env", "parity", "bench", "tiny", "zero3", "base-bf16", "syncs", "profile", "nccl"]
    assert one["nccl"].skip == "two ranks over NCCL need two GPUs (1 visible)" and not two["nccl"].skip
    assert sum(s.budget for s in one.values() if not s.skip) <= 8 * 60
    assert sum(s.budget for s in two.values()) <= 8 * 60 + 90
    bench, train = two["nccl"].commands
    for cmd in (bench, train):
        assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc_per_node=2"]
    assert bench[bench.index("--parts") + 1] == "collectives"
    assert {"backend.name=deepspeed", "backend.zero_stage=1", "train.micro_batch_size=16"} <= set(train)
    for name in ("syncs", "profile"):
        cmd, = one[name].commands
        assert {"backend.name=deepspeed", "backend.zero_stage=1", "train.precision=bf16"} <= set(cmd), cmd
    assert str(tmp_path / "profile-bf16.json") in one["profile"].commands[0]


def test_a_skipped_step_runs_nothing_and_fails_nothing(tmp_path, monkeypatch):
    gpu_check = _import_gpu_check()
    for key in ("MEGAKD_CACHE", "HF_HUB_OFFLINE", "WANDB_MODE", "OMP_NUM_THREADS"):  # main sets them
        monkeypatch.setenv(key, os.environ.get(key, ""))
    assert gpu_check.main(["--only", "nccl", "--gpus", "1", "--out", str(tmp_path)]) == 0
    assert "| nccl | SKIP | 0 s | 90 s | two ranks over NCCL need two GPUs (1 visible) |" in \
        (tmp_path / "summary.md").read_text()
    assert not (tmp_path / "nccl.log").exists()


@pytest.mark.slow  # three electra-tiny steps, one under the profiler: 4-10 s on 2 shared cores
def test_the_profile_step_traces_exactly_one_bf16_optimizer_step(tiny_data, tmp_path, capsys):
    """The profile step's CPU rehearsal: a chrome trace of the third optimizer step alone (two micro-batches,
    each unit's optimizer stepped once), on electra-tiny at test size in bf16 autocast."""
    gpu_check = _import_gpu_check()
    trace = tmp_path / "profile-bf16.json"
    overrides = tiny_overrides(tiny_data, tmp_path / "run", **{"train.precision": "bf16", "backend.name": "single",
                                                                "kernels.backend": "torch", "train.max_steps": 3})
    assert gpu_check.internal_profile(str(trace), "configs/electra-tiny.yaml", overrides) == 0
    ranges = collections.Counter(e["name"] for e in json.loads(trace.read_text())["traceEvents"]
                                 if e.get("cat") == "user_annotation")
    assert ranges["megakd.optimizer"] == 1 and ranges["Optimizer.step#AdamW.step"] == 2  # generator, discriminator
    assert ranges["megakd.generator"] == ranges["megakd.discriminator"] == 2  # global batch 8 / micro-batch 4
    assert "SUMMARY: profile-bf16.json: one optimizer step (single, bf16)" in capsys.readouterr().out
