"""backend.deepspeed_config: the user's DeepSpeed JSON merged into megakd's by HF's "auto" convention."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megakd.cli import main
from megakd.config import BackendConfig, ConfigError, load_config
from megakd.engine.deepspeed_backend import cpu_adam_like
from megakd.engine.deepspeed_config import EngineConfigs, merge_user_config
from megakd.engine.pretrain import open_trainer
from tests.distributed.harness import (
    CONFIG,
    assert_metrics_close,
    assert_same_weights,
    read_metrics,
    torchrun,
)
from tests.helpers import tiny_overrides

DERIVED = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "train_batch_size": 8,
           "gradient_clipping": 100.0, "zero_optimization": {"stage": 2}, "steps_per_print": 2**31 - 1,
           "bf16": {"enabled": False}, "fp16": {"enabled": False}}


def test_auto_takes_megakds_value_and_other_keys_pass_through():
    user = {"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto", "steps_per_print": 10,
            "zero_optimization": {"stage": "auto", "overlap_comm": True, "reduce_bucket_size": 12345}}
    merged = merge_user_config(DERIVED, user, "f.json")
    assert merged == {**DERIVED, "steps_per_print": 10,
                      "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 12345}}
    assert merge_user_config(DERIVED, {"train_batch_size": 8}, "f.json") == DERIVED  # equal values are fine


@pytest.mark.parametrize("user, message", [
    ({"train_micro_batch_size_per_gpu": 8}, "'train_micro_batch_size_per_gpu'=8 contradicts train.micro_batch_size"),
    ({"zero_optimization": {"stage": 3}}, "'zero_optimization.stage'=3 contradicts backend.zero_stage"),
    ({"bf16": {"enabled": True}}, "'bf16.enabled'=True contradicts train.precision"),
    ({"gradient_clipping": 1.0}, "'gradient_clipping'=1.0 contradicts optim.<model>.clip_norm"),
    ({"optimizer": {"type": "Adam"}}, "'optimizer' is built by megakd"),
    ({"wall_clock_breakdown": "auto"}, "'wall_clock_breakdown' is \"auto\" but megakd derives no value"),
])
def test_contradictions_are_refused_naming_the_key(user, message):
    with pytest.raises(ConfigError, match="f.json: ") as err:
        merge_user_config(DERIVED, user, "f.json")
    assert message in str(err.value)


def test_the_engine_runs_with_the_merged_config(tiny_data, tmp_path):
    """One real DeepSpeed engine per unit built from the merged config (single process). What ZeRO-3
    changed for the whole process (torch's linear swapped for DeepSpeed's, LOCAL_RANK set) lasts while
    the backend is open: the next model in this process must not run DeepSpeed's linear."""
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "gradient_clipping": "auto",
                                "zero_optimization": {"stage": "auto", "reduce_bucket_size": 12345}}))
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path / "run", **{
        "backend.name": "deepspeed", "backend.zero_stage": 3, "backend.deepspeed_config": str(user),
        "train.max_steps": 1, "run.export_hf": "false"}))
    linear, local_rank = torch.nn.functional.linear, os.environ.get("LOCAL_RANK")
    trainer = open_trainer(cfg)
    try:
        assert torch.nn.functional.linear is not linear  # ZeRO-3's memory-efficient linear, while open
        for unit in trainer.units.values():
            engine = unit.wrapped
            assert engine.zero_optimization_stage() == 3 and engine.train_micro_batch_size_per_gpu() == 4
            assert engine.zero_reduce_bucket_size() == 12345
            assert engine.gradient_clipping() == pytest.approx(unit.max_grad_norm)
        assert trainer.train().step == 1
    finally:
        trainer.close()
    assert torch.nn.functional.linear is linear and os.environ.get("LOCAL_RANK") == local_rank


def test_cli_refuses_a_contradicting_file_in_one_line(tiny_data, tmp_path, capsys):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"train_micro_batch_size_per_gpu": 16}))
    run = tmp_path / "run"
    args = tiny_overrides(tiny_data, run, **{"backend.name": "deepspeed", "backend.deepspeed_config": str(user)})
    assert main(["pretrain", "-c", str(CONFIG), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'train_micro_batch_size_per_gpu'=16" in err and str(user) in err
    assert not run.exists()
    user.write_text("{not json")
    assert main(["pretrain", "-c", str(CONFIG), *args]) == 2
    assert f"{user} is not valid JSON" in capsys.readouterr().err
    assert main(["pretrain", "-c", str(CONFIG), *tiny_overrides(tiny_data, run),
                 f"backend.deepspeed_config={user}"]) == 2
    assert "backend.deepspeed_config needs backend.name=deepspeed" in capsys.readouterr().err


def _engine_configs(cfg) -> EngineConfigs:
    """A pretraining config's engine configs, as `megakd.engine.backend_factory` builds them."""
    return EngineConfigs(cfg.backend, cfg.train.precision, cfg.train.micro_batch_size)


@pytest.mark.parametrize("precision, stage, accum", [
    ("bf16", 1, "fp32"), ("bf16", 3, "fp32"), ("fp16", 2, "fp32"), ("fp32", 2, None),
    ("bf16", 0, None),  # DeepSpeed 0.19 refuses another accumulation dtype without ZeRO
])
def test_low_precision_accumulates_in_fp32_unless_the_user_says_otherwise(tiny_data, tmp_path, precision, stage,
                                                                          accum):
    overrides = {"backend.name": "deepspeed", "backend.zero_stage": stage, "train.precision": precision}
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path / "run", **overrides))
    assert _engine_configs(cfg).for_engine(1.0, 8, 1).get("data_types", {}).get("grad_accum_dtype") == accum
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"data_types": {"grad_accum_dtype": "bf16"}}))
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path / "run", **overrides,
                                             **{"backend.deepspeed_config": str(user)}))
    assert _engine_configs(cfg).for_engine(1.0, 8, 1)["data_types"] == {"grad_accum_dtype": "bf16"}


@pytest.mark.parametrize("precision, stage, chosen, sent_as", [
    ("bf16", 1, "auto", "fp32"), ("bf16", 2, "auto", "fp32"), ("fp16", 3, "auto", "fp32"),
    ("bf16", 0, "auto", "bf16"),  # without ZeRO the gradients accumulate in bf16: sent as they are
    ("fp32", 2, "auto", "fp32"), ("bf16", 2, "bf16", "bf16"), ("fp16", 1, "fp16", "fp16"), ("bf16", 0, "fp32", "fp32"),
])
def test_gradients_are_sent_in_fp32_where_they_accumulate_in_fp32(precision, stage, chosen, sent_as):
    backend = BackendConfig(name="deepspeed", zero_stage=stage, grad_comm_dtype=chosen)
    assert EngineConfigs(backend, precision, 4).for_engine(1.0, 2, 2)["communication_data_type"] == sent_as


def test_a_16_bit_reduction_other_than_the_models_dtype_is_refused():
    with pytest.raises(ConfigError, match="backend.grad_comm_dtype=bf16: expected auto, fp32 or the model's own "
                                          "16-bit dtype, and this run trains in fp16"):
        EngineConfigs(BackendConfig(name="deepspeed", zero_stage=2, grad_comm_dtype="bf16"), "fp16", 4)
    with pytest.raises(ConfigError, match="backend.grad_comm_dtype=fp32 needs backend.name=deepspeed, got 'ddp'"):
        BackendConfig(name="ddp", grad_comm_dtype="fp32").validate()


def test_zero2_reduces_in_eight_overlapped_buckets_unless_the_user_file_says_otherwise(tmp_path):
    def zero(stage: int, user: dict | None = None) -> dict:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(user or {}))
        backend = BackendConfig(name="deepspeed", zero_stage=stage, deepspeed_config=str(path))
        return EngineConfigs(backend, "bf16", 4).for_engine(1.0, 2, 2, parameters=184_000_001)["zero_optimization"]

    assert zero(2) == {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                       "reduce_bucket_size": 23_000_001}  # ceil(184_000_001 / 8)
    for stage in (1, 3):  # BF16_Optimizer reduces after backward at any setting; ZeRO-3 has its own defaults
        assert zero(stage) == {"stage": stage}
    user = {"zero_optimization": {"stage": "auto", "overlap_comm": False, "reduce_bucket_size": 5e8}}
    assert zero(2, user) == {"stage": 2, "overlap_comm": False, "contiguous_gradients": True,
                             "reduce_bucket_size": 5e8}
    with pytest.raises(ConfigError, match="'communication_data_type'='bf16' contradicts backend.grad_comm_dtype "
                                          "\\(megakd derives 'fp32'; use \"auto\"\\)"):
        zero(2, {"communication_data_type": "bf16"})


def test_fp32_accumulation_without_zero_is_refused_in_one_line(tiny_data, tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"data_types": {"grad_accum_dtype": "fp32"}}))
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path / "run", **{
        "backend.name": "deepspeed", "backend.zero_stage": 0, "train.precision": "bf16",
        "backend.deepspeed_config": str(user)}))
    with pytest.raises(ConfigError, match="grad_accum_dtype='fp32' needs backend.zero_stage >= 1"):
        _engine_configs(cfg).for_engine(1.0, 8, 1)


@pytest.mark.slow
def test_zero2_cpu_offload_matches_the_run_without_offload(tiny_data, tmp_path):
    """ZeRO-2 with optimizer states offloaded to DeepSpeed's CPU Adam, 2 gloo processes, vs plain ZeRO-2.

    The same AdamW update computed by another kernel (DeepSpeed's vectorised C++ loop instead of
    torch's foreach path): float32 rounding differs, nothing else, so metrics and weights agree to
    the distributed tests' tolerances.
    """
    offload = tmp_path / "offload.json"
    offload.write_text(json.dumps({"zero_optimization": {"stage": "auto", "offload_optimizer": {"device": "cpu"}}}))
    common = {"train.max_steps": 4, "train.global_batch_size": 16, "train.micro_batch_size": 4,
              "model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0, "run.export_hf": "false",
              "kernels.backend": "torch", "backend.name": "deepspeed", "backend.zero_stage": 2}
    runs = {"plain": {}, "offload": {"backend.deepspeed_config": str(offload)}}
    torchrun(2, [{"overrides": tiny_overrides(tiny_data, tmp_path / name, **{**common, **extra})}
                 for name, extra in runs.items()], tmp_path / "spec.json", timeout=900)
    assert_metrics_close(read_metrics(tmp_path / "offload"), read_metrics(tmp_path / "plain"))
    for unit in ("generator", "discriminator"):
        assert_same_weights(tmp_path / "offload", tmp_path / "plain", unit)
    # and the offloaded run really stepped DeepSpeed's CPU Adam (its groups carry `bias_correction`;
    # torch's AdamW groups do not), for both models
    for run, cpu_adam in (("offload", True), ("plain", False)):
        files = sorted((tmp_path / run / "checkpoints").rglob("*optim_states.pt"))
        assert len(files) == 4  # 2 models x 2 ranks
        for file in files:
            state = torch.load(file, weights_only=False)["optimizer_state_dict"]
            groups = state["base_optimizer_state"]["param_groups"]
            assert ("bias_correction" in groups[0]) == cpu_adam, file


def test_offload_refuses_an_optimizer_it_would_silently_replace():
    """Fine-tuning's Adamax is not DeepSpeed's CPU AdamW: offloading it would change the method, so it is
    refused naming the optimizer (pretraining's AdamW offloads; the test above)."""
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not this run's Adamax; remove offload_optimizer"):
        cpu_adam_like(torch.optim.Adamax(model.parameters(), lr=1e-3))
