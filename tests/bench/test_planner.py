"""The planner's arithmetic and its command line, on the real base/large recipes."""

from __future__ import annotations

import json

import pytest

from megakd.bench.flops import step_flops
from megakd.bench.memory import GiB
from megakd.bench.planner import GPUS, Layout, evaluate, hardware_from_bench, partition, plan
from megakd.cli import main
from megakd.config import ConfigError, load_config
from megakd.engine.pretrain import resolve_config


@pytest.fixture(scope="module")
def base():
    return resolve_config(load_config("configs/electra-base.yaml"))


def test_partition_minimises_the_largest_stage():
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    ranges = partition([3, 1, 4, 1, 5, 9, 2, 6], 3)
    assert ranges[0][0] == 0 and ranges[-1][1] == 8 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6][lo:hi]) for lo, hi in ranges) == 14  # 3+1+4+1+5 | 9 | 2+6


def test_single_gpu_step_is_flops_over_peak(base):
    p = evaluate(base, GPUS["a100"], 1, 80, Layout(0, 1, 8, False), efficiency=0.5)
    assert p.comm_s == 0 and p.accumulation == 256
    assert p.step_s == pytest.approx(step_flops(base, 2048).hardware / (312e12 * 0.5), rel=1e-9)


def test_communication_grows_with_zero_stage_and_checkpointing_costs_compute(base):
    hw = GPUS["a100"]
    z = {s: evaluate(base, hw, 64, 80, Layout(s, 1, 8, False)) for s in range(4)}
    assert z[0].comm_s == pytest.approx(z[1].comm_s) and z[1].comm_s < z[2].comm_s < z[3].comm_s
    assert z[0].memory["total"] > z[1].memory["total"] > z[2].memory["total"] > z[3].memory["total"]
    ck = evaluate(base, hw, 64, 80, Layout(1, 1, 8, True))
    assert ck.memory["activations"] < z[1].memory["activations"] / 4 and ck.compute_s > z[1].compute_s


def test_plans_fit_first_and_respect_constraints(base):
    plans = plan(base, GPUS["a100"], 8, 40)
    fits = [p.fits for p in plans]
    assert any(fits) and fits == sorted(fits, reverse=True)
    assert all(p.memory["total"] <= 38 * GiB for p in plans if p.fits)
    assert not any(p.layout.pipeline_stages > 1 and p.layout.zero_stage > 1 for p in plans)
    assert all(2048 % (p.dp * p.layout.micro_batch) == 0 for p in plans)
    with pytest.raises(ConfigError, match="--pp"):
        plan(base, GPUS["a100"], 8, 40, pp=3)
    with pytest.raises(ConfigError, match="ZeRO stage 0 or 1"):
        plan(base, GPUS["a100"], 8, 40, zero=2, pp=2)
    with pytest.raises(ConfigError, match="train.precision=bf16"):
        plan(base, GPUS["v100"], 8, 32)


def test_cli_plan_table_and_json(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "configs/electra-large.yaml", "--gpus", "64", "--gpu-mem", "80", "--zero", "1",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "233.0M" in text and "434.5M" in text and "125000 steps" in text
    data = json.loads(out.read_text())
    assert data["parameters"]["total"] == 667531265
    assert {p["layout"]["zero_stage"] for p in data["plans"]} == {1}
    assert main(["plan", "configs/electra-base.yaml", "--gpus", "8", "--gpu-mem", "40", "--bench",
                 str(tmp_path / "missing.json")]) == 2
    assert "--bench" in capsys.readouterr().err


def test_hardware_from_bench_json(tmp_path):
    path = tmp_path / "b.json"
    path.write_text(json.dumps({"world_size": 2, "device": "cpu", "matmul": {"fp32": {"tflops": 0.03}},
                                "collectives": {"all_reduce": [{"busbw_GBps": 0.5}, {"busbw_GBps": 1.3}]}}))
    hw = hardware_from_bench(path)
    assert hw.peak_tflops == {"fp32": 0.03} and hw.busbw_intra == hw.busbw_inter == 1.3
