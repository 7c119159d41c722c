"""The planner's arithmetic and its command line, on the real base/large recipes."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megakd.bench.hardware import GPUS, hardware_from_bench
from megakd.bench.memory import EngineShape, GiB, ZeroSettings, parameter_counts
from megakd.bench.planner import (
    ParallelPlan,
    _dp_comm_seconds,
    collective_bytes,
    evaluate,
    model_flops,
    partition,
    plan,
    sample_member_bytes,
    storage_io,
)
from megakd.bench.report import format_plan
from megakd.bench.step_time import Assumptions, predict_step
from megakd.cli import main
from megakd.config import ConfigError, load_config
from megakd.engine.deepspeed_config import EngineConfigs
from megakd.finish import finish_config


@pytest.fixture(scope="module")
def base():
    return finish_config(load_config("configs/electra-base.yaml"))


def test_partition_minimises_the_largest_stage():
    assert partition([1, 1, 1, 1], 2) == [(0, 2), (2, 4)]
    assert partition([5, 1, 1, 1, 1, 1], 2) == [(0, 1), (1, 6)]
    ranges = partition([3, 1, 4, 1, 5, 9, 2, 6], 3)
    assert ranges[0][0] == 0 and ranges[-1][1] == 8 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(sum([3, 1, 4, 1, 5, 9, 2, 6][lo:hi]) for lo, hi in ranges) == 14  # 3+1+4+1+5 | 9 | 2+6


def test_the_planner_times_a_step_as_the_computed_step_does(base):
    """`megakd plan` and docs/performance.md's computed step are one model (megakd/bench/step_time.py)."""
    hw = GPUS["a100"]
    p = evaluate(base, hw, 1, 80, ParallelPlan(0, 1, 8, False), efficiency=0.5)
    assert p.comm_s == 0 and p.accumulation == 256
    computed = predict_step(base, hw, 8, 256, parameter_counts(base)["total"], assume=Assumptions(0.5))
    assert p.step_s == pytest.approx(computed.step_s, rel=1e-12)
    eight = evaluate(base, hw, 8, 80, ParallelPlan(1, 1, 8, False), efficiency=0.5)
    zero1 = predict_step(base, hw, 8, 32, parameter_counts(base)["total"] / 8, comm_s=eight.comm_s,
                         assume=Assumptions(0.5))
    assert eight.step_s == pytest.approx(zero1.step_s, rel=1e-12)  # ZeRO-1: an eighth of the optimizer each


def test_collective_bytes_by_hand():
    """One engine of 1000 parameters (groups of 990 and 10; tensors of 900, 90, 10) on 4 ranks, 3 micro-batches,
    bf16 weights, gradients sent in fp32 (4 B) but at ZeRO-0 (bf16, as megakd derives it). Flat buffers pad each
    group to a multiple of 8: 992 + 16 = 1008. ZeRO-3 pads each tensor to a multiple of 4 (900 + 92 + 12 = 1004)
    and, at a persistence threshold of 100, keeps the 90- and 10-element tensors whole (92 + 12 gathered)."""
    shape = EngineShape((990, 10), (900, 90, 10), 900)

    def zero(stage, **keys):
        comm = "bf16" if stage == 0 else "fp32"
        return ZeroSettings.from_config({"zero_optimization": {"stage": stage, "param_persistence_threshold": 100,
                                                               **keys}, "communication_data_type": comm}, "bf16")

    def volumes(stage, **keys):
        return collective_bytes(shape, stage, 4, "bf16", zero(stage, **keys), 3)

    assert volumes(0) == {"all_reduce": 2 * 1000, "reduce_scatter": 0, "all_gather": 0}
    # BF16_Optimizer: its whole padded fp32 buffer once per step, then the updated bf16 weights
    assert volumes(1) == {"all_reduce": 4 * 1008, "reduce_scatter": 0, "all_gather": 2 * 1008}
    # ZeRO-2: every micro-batch's gradients, all-reduced bucket by bucket (or reduced to their owners)
    assert volumes(2) == {"all_reduce": 3 * 4 * 1000, "reduce_scatter": 0, "all_gather": 2 * 1008}
    assert volumes(2, use_multi_rank_bucket_allreduce=False)["reduce_scatter"] == 3 * 4 * 1000
    # ZeRO-3: gradients reduce-scattered per micro-batch; the 900-element tensor gathered once per micro-batch
    # (kept from forward into backward), or twice when nothing may stay live; the persistent ones after the step
    assert volumes(3) == {"all_reduce": 0, "reduce_scatter": 3 * 4 * 1004, "all_gather": 3 * 2 * 900 + 2 * 104}
    assert volumes(3, max_live_parameters=0)["all_gather"] == 3 * 2 * 2 * 900 + 2 * 104
    assert collective_bytes(shape, 3, 1, "bf16", zero(3), 3) == {"all_reduce": 0, "reduce_scatter": 0,
                                                                 "all_gather": 0}
    hw = GPUS["a100"]  # 8 GPUs: one node; an all-reduce moves twice its (n-1)/n share
    seconds = _dp_comm_seconds(hw, 8, 4, volumes(1))
    assert seconds == pytest.approx(3 / 4 * (2 * 4 * 1008 + 2 * 1008) / (hw.busbw_intra * 1e9), rel=1e-12)


def test_plans_count_the_optimizer_and_buffers_deepspeed_builds(base, tmp_path):
    """On electra-base (two engines, 184M parameters each) over 64 GPUs: ZeRO-1 + bf16 is BF16_Optimizer, whose
    gradients (bf16 and a whole fp32 buffer: 6 B per parameter, padding aside) are not partitioned; ZeRO-2
    stages its buckets at the size megakd derives; ZeRO-3 holds DeepSpeed's bucket (a user file's size)."""
    hw = GPUS["a100"]
    params = parameter_counts(base)
    z = {s: evaluate(base, hw, 64, 80, ParallelPlan(s, 1, 8, False)) for s in range(4)}
    assert z[1].memory["grads"] == pytest.approx(6 * params["total"], abs=4 * 2 * 2 * 128)
    assert z[1].memory["grads"] - (2 + 4 / 64) * params["total"] > 1.3 * GiB  # beyond a partitioned fp32 buffer
    configs = EngineConfigs(dataclasses.replace(base.backend, zero_stage=2), "bf16", 8)
    buckets = [configs.derived(0.0, 4, 64, params[m])["zero_optimization"]["reduce_bucket_size"]
               for m in ("generator", "discriminator")]
    # two bf16 staging buffers (overlap_comm) and the fp32 copy of the one being reduced
    assert z[2].memory["transient"] == sum(buckets) * (2 * 2 + 4)
    # ZeRO-3: reduce-scatter (fp32) and one bf16 gather per micro-batch beat ZeRO-2's fp32 all-reduces
    assert z[0].comm_s < z[1].comm_s < z[3].comm_s < z[2].comm_s
    assert z[3].memory["buffers"] == 2 * 500_000_000 * 4  # DeepSpeed's default bucket, in fp32, per engine
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1000}}))
    cfg = finish_config(load_config("configs/electra-base.yaml", [f"backend.deepspeed_config={user}"]))
    assert evaluate(cfg, hw, 64, 80, ParallelPlan(3, 1, 8, False)).memory["buffers"] == 2 * 1000 * 4
    ck = evaluate(base, hw, 64, 80, ParallelPlan(1, 1, 8, True))
    assert ck.memory["activations"] < z[1].memory["activations"] / 3 and ck.compute_s > z[1].compute_s


def test_zero3_activations_add_the_fused_qkv_bias_deepspeeds_linear_keeps(base):
    """Under ZeRO-3 each layer with fused QKV keeps its concatenated [3H] bias too (bench/memory.py),
    for every micro-batch in flight; nothing else in the activations differs from ZeRO-2."""
    hw, elem = GPUS["a100"], 2
    z2, z3 = (evaluate(base, hw, 64, 80, ParallelPlan(s, 1, 8, False)) for s in (2, 3))
    extra = sum(enc.num_layers * 3 * enc.hidden_size * elem
                for enc in (base.model.generator, base.model.discriminator) if enc.fused_qkv)
    assert extra > 0 and z3.memory["activations"] - z2.memory["activations"] == extra


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
    hw = hardware_from_bench(path, GPUS["a100"])
    assert hw.peak_tflops == {**GPUS["a100"].peak_tflops, "fp32": 0.03} and hw.busbw_intra == hw.busbw_inter == 1.3
    assert hw.hbm_gbps == GPUS["a100"].hbm_gbps  # not measured by `megakd bench`: the preset's datasheet


# Storage: the numbers below are written out by hand (512-byte tar blocks, a 128-byte .npy header),
# not computed by the planner's own functions.


@pytest.mark.parametrize("seq_len", [3, 128, 512, 1000])
@pytest.mark.parametrize("vocab_size", [30522, 65536, 65537, 128000])
def test_member_bytes_is_a_real_shard_member(seq_len, vocab_size):
    import numpy as np

    from megakd.data.shards import _npy_header, tar_member, token_dtype

    dtype = token_dtype(vocab_size)
    npy = _npy_header(seq_len, dtype) + np.zeros(seq_len, dtype).tobytes()
    assert len(tar_member("000000000000.ids.npy", npy)) == sample_member_bytes(seq_len, vocab_size)


def test_member_bytes_by_hand():
    assert sample_member_bytes(512, 30522) == 512 + 1536  # .npy 128 + 1024 -> 3 blocks
    assert sample_member_bytes(512, 128000) == 512 + 2560  # .npy 128 + 2048 -> 5 blocks
    assert sample_member_bytes(192, 65536) == 512 + 512  # 128 + 384 = 512 exactly: no padding block
    assert sample_member_bytes(193, 65536) == 512 + 1024


def test_storage_reads_by_hand(base, tmp_path):
    io = storage_io(base, GPUS["a100"], 16, storage_gbps="0.01", corpus_samples=1000)
    # Members of the batch with the 20 % overfetch budget; the indexes once a run per node.
    assert io.member_bytes == 3072 and io.step_bytes == math.ceil(2048 * 3072 * 1.2) == 7_549_748
    assert io.nodes == 2 and io.index_bytes_per_node == 12_000 and io.readers == 4 * 16
    assert io.storage_s == pytest.approx(7_549_748 / 1e7)
    assert io.need_gbps(0.5) == pytest.approx(7_549_748 / 0.5 / 1e9)
    assert io.bound_step_s(0.5) == pytest.approx(0.7549748) and io.bound_step_s(0.8) == 0.8
    assert storage_io(base, GPUS["a100"], 17).nodes == 3
    assert storage_io(base, GPUS["a100"], 8).storage_s == 0  # no bandwidth given: no bound
    # The corpus size: the shards' manifest when data.shards has one, else one pass of the run.
    assert storage_io(base, GPUS["a100"], 8).corpus_samples == 125000 * 2048
    (tmp_path / "manifest.json").write_text(json.dumps({"num_samples": 777}))
    cfg = finish_config(load_config("configs/electra-base.yaml", [f"data.shards={tmp_path}"]))
    assert storage_io(cfg, GPUS["a100"], 8).index_bytes_per_node == 12 * 777


def test_storage_bound_warning_exactly_when_bandwidth_is_below_need(base):
    plans = plan(base, GPUS["a100"], 64, 80, zero=2, pp=1, micro_batches=[32])
    best = next(p for p in plans if p.fits)
    need = math.ceil(2048 * 3072 * 1.2) / best.step_s / 1e9  # GB/s the planned step reads

    def text(gbps):
        io = storage_io(base, GPUS["a100"], 64, storage_gbps=gbps)
        return format_plan(base, GPUS["a100"], 64, 80, parameter_counts(base), model_flops(base), plans, 3,
                           0.45, io)

    for gbps in (None, need * 1.01, need, 10.0):
        assert "storage-bound" not in text(gbps) and "*" not in text(gbps)
    slow = text(need / 1.8)
    warnings = [line for line in slow.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "storage-bound: 1.8x the compute step time" in warnings[0]
    hours = 125000 * best.step_s * 1.8 / 3600
    assert f"125000 steps in {hours:.1f} h" in slow
    assert f"{need:.3g} GB/s job-wide, {need / 8:.3g} GB/s per node" in slow


@pytest.mark.parametrize("value", ["0", "-1", "abc", "nan", "inf"])
def test_cli_storage_gbps_must_be_positive(capsys, value):
    assert main(["plan", "configs/electra-base.yaml", "--gpus", "8", "--gpu-mem", "80",
                 f"--storage-gbps={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--storage-gbps" in err and "positive" in err


def test_cli_plan_reports_storage(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "configs/electra-base.yaml", "--gpus", "64", "--gpu-mem", "80", "--zero", "2",
                 "--pp", "1", "--micro-batch", "32", "--storage-gbps", "0.02", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "7.55 MB per step" in text and "warning: storage-bound:" in text
    assert json.loads(out.read_text())["storage"]["step_bytes"] == math.ceil(2048 * 3072 * 1.2)


def test_emit_overrides_is_the_best_runnable_layout_as_a_launcher_takes_it(capsys):
    """stdout holds only the words; loaded onto the recipe they are the plan's first fitting row, and the
    hardware preset the numbers assume is named on stderr."""
    assert main(["plan", "configs/electra-base.yaml", "--gpus", "8", "--gpu-mem", "40", "--emit-overrides"]) == 0
    captured = capsys.readouterr()
    words = captured.out.split()
    cfg = finish_config(load_config("configs/electra-base.yaml", words))
    best = next(p for p in plan(cfg, GPUS["a100"], 8, 40) if p.fits)
    assert ParallelPlan(cfg.backend.zero_stage, cfg.backend.pipeline_stages, cfg.train.micro_batch_size,
                        cfg.model.discriminator.activation_checkpointing) == best.layout
    assert cfg.backend.name == "deepspeed" and "hardware: 8 x A100-SXM4" in captured.err


def test_emit_overrides_skips_layouts_the_config_refuses(capsys):
    """The planner weighs ZeRO-1 pipelines, which megakd's pipeline backend refuses: such rows are skipped with
    the config's reason, and with none left the command stops in one line (exit 2)."""
    args = ["plan", "configs/electra-base.yaml", "--gpus", "8", "--gpu-mem", "40", "--pp", "2", "--emit-overrides"]
    assert main([*args, "train.precision=fp32"]) == 0
    captured = capsys.readouterr()
    assert "skipped #1: backend.pipeline_stages=2 needs backend.zero_stage=0" in captured.err
    words = captured.out.split()
    assert words[0] == "train.precision=fp32" and "backend.zero_stage=0" in words
    load_config("configs/electra-base.yaml", words)  # runnable as emitted
    assert main(args) == 2  # bf16: no pipeline layout megakd runs
    error = capsys.readouterr().err.splitlines()[-1]  # after the hardware lines, one line
    assert error.startswith("megakd: error: --emit-overrides:") and "needs train.precision=fp32" in error


def test_no_plan_sums_16bit_gradients_over_micro_batches_unless_asked(base):
    """ZeRO-0 under bf16 accumulates the micro-batches' gradients in bf16 (megakd's fp32 accumulation needs
    ZeRO >= 1): the planner leaves those layouts out, and offers them only to --zero 0."""
    hw = GPUS["a100"]
    offered = plan(base, hw, 8, 80)
    assert not [p for p in offered if p.layout.zero_stage == 0 and p.accumulation > 1]
    assert [p for p in offered if p.layout.zero_stage == 0 and p.accumulation == 1]
    asked = plan(base, hw, 8, 80, zero=0)
    assert [p for p in asked if p.accumulation > 1]
