"""`megakd bench` on real shards and models: one process in-process, two under torchrun (gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megakd.bench.flops import step_flops
from megakd.cli import main
from megakd.config import load_config
from megakd.engine.pretrain import build_models
from megakd.engine.profiling import PHASES
from tests.bench.flop_counting import counted_electra_step, rtd_projection_correction
from tests.helpers import tiny_overrides


def _counted_flops_per_token(cfg, seq_len: int) -> float:
    """torch's FlopCounterMode on one real ELECTRA step of `cfg`'s models, per token, over full rows
    whose masked share is exactly data.mask_prob (the share the analytic count assumes)."""
    sequences = 20  # 20 x seq_len x 0.15 masked positions is a whole number
    tokens = sequences * seq_len
    masked = round(cfg.data.mask_prob * tokens)
    assert masked == pytest.approx(cfg.data.mask_prob * tokens, abs=1e-6)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.model.generator.vocab_size, (sequences, seq_len), generator=g)
    mlm_mask = torch.zeros(tokens, dtype=torch.bool)
    mlm_mask[torch.randperm(tokens, generator=g)[:masked]] = True
    mlm_mask = mlm_mask.view(sequences, seq_len)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(mlm_mask), "mlm_mask": mlm_mask,
             "masked_input_ids": torch.where(mlm_mask, 4, ids)}
    counted = counted_electra_step(*build_models(cfg), batch)
    return (sum(counted.values()) + rtd_projection_correction(cfg.model.discriminator.hidden_size, tokens)) / tokens


def _check_train(t: dict, cfg) -> None:
    assert t["step_s"] > 0 and t["tokens_per_s"] > 0
    assert t["samples_per_s"] == pytest.approx(t["global_batch_size"] / t["step_s"])
    assert t["model_flops_per_step"] == pytest.approx(step_flops(cfg, t["global_batch_size"], t["seq_len"]).model)
    assert t["achieved_tflops_per_device"] == pytest.approx(
        t["model_flops_per_step"] / t["step_s"] / t["world_size"] / 1e12)
    assert t["mfu"] == pytest.approx(t["achieved_tflops_per_device"] / t["peak_tflops"])
    # "other" is the remainder by construction; the measured phases themselves must be real and fit.
    phases = {k: v for k, v in t["phases_s"].items() if v is not None and k != "other"}
    assert phases["forward"] > 0 and phases["backward"] > 0 and phases["optimizer"] > 0
    if t["world_size"] == 1:  # with more ranks each phase is the slowest rank's, so sums may exceed a step
        assert sum(phases.values()) <= t["step_s"] * 1.05
    # The profiled split names every phase; each one that the ELECTRA step has took time.
    split = t["phase_split_s"]
    assert set(split) == set(PHASES) and all(split[k] > 0 for k in PHASES)
    assert t["model_flops_per_token"] == pytest.approx(_counted_flops_per_token(cfg, t["seq_len"]), rel=1e-9)


def test_bench_one_process(tiny_data, tmp_path, capsys):
    overrides = tiny_overrides(tiny_data, tmp_path / "run")
    out = tmp_path / "bench"
    assert main(["bench", "-c", "configs/electra-tiny.yaml", "--parts", "collectives,matmul,loader,train",
                 "--matmul-n", "256", "--loader-batches", "3", "--steps", "2", "--warmup", "1",
                 "--peak-tflops", "0.05", "--out", str(out), *overrides]) == 0
    res = json.loads((out / "bench_w1.json").read_text())
    assert "collectives" not in res  # nothing to measure on one process
    assert set(res["matmul"]) >= {"fp32", "bf16"} and res["matmul"]["fp32"]["tflops"] > 0
    assert res["loader"]["samples_per_s"] == pytest.approx(res["loader"]["samples_per_s_per_rank"])
    _check_train(res["train"], load_config("configs/electra-tiny.yaml", overrides))
    assert res["train"]["phases_s"]["communication"] is None and res["train"]["peak_tflops"] == 0.05
    assert "MFU" in capsys.readouterr().out


def test_bench_bad_input(tmp_path, capsys):
    assert main(["bench", "--parts", "matmul,gpus", "--out", str(tmp_path)]) == 2
    assert "--parts" in capsys.readouterr().err
    assert main(["bench", "--parts", "train", "--out", str(tmp_path)]) == 2
    assert "-c CONFIG" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_two_processes_and_plot(tiny_data, tmp_path):
    overrides = tiny_overrides(tiny_data, tmp_path / "run")
    out = tmp_path / "bench"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29561",
           "-m", "megakd.cli", "bench", "-c", "configs/electra-tiny.yaml", "--min-bytes", "64K", "--max-bytes", "4M",
           "--iters", "3", "--matmul-n", "256", "--loader-batches", "3", "--steps", "2", "--warmup", "1",
           "--out", str(out), *overrides]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "busbw (GB/s)" in proc.stdout
    res = json.loads((out / "bench_w2.json").read_text())
    assert res["world_size"] == 2 and res["dist_backend"] == "gloo"
    for op, factor in (("all_reduce", 1.0), ("all_gather", 0.5), ("reduce_scatter", 0.5)):
        rows = res["collectives"][op]
        assert [r["bytes"] for r in rows] == [64 * 1024, 256 * 1024, 1024**2, 4 * 1024**2]
        for r in rows:  # nccl-tests: busbw = algbw x 2(n-1)/n or (n-1)/n, n = 2
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * factor)
            assert r["algbw_GBps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
    t = res["train"]
    assert t["peak_source"].startswith("measured fp32 matmul n=256")
    assert t["backend"] == "ddp" and t["world_size"] == 2 and t["phases_s"]["communication"] > 0
    _check_train(t, load_config("configs/electra-tiny.yaml", overrides))
    # The slowest rank sets the total pace, so the total is at most twice this rank's rate.
    assert res["loader"]["samples_per_s"] <= 2 * res["loader"]["samples_per_s_per_rank"] * (1 + 1e-9)

    assert main(["bench", "-c", "configs/electra-tiny.yaml", "--parts", "train", "--steps", "2", "--warmup", "1",
                 "--out", str(out), *overrides]) == 0
    assert main(["bench", "--out", str(out), "plot", str(out / "bench_w2.json"), str(out / "bench_w1.json")]) == 0
    for png in ("bandwidth.png", "scaling.png", "bandwidth_w2.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
