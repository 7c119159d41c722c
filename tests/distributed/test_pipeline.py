"""DeepSpeed pipeline parallelism (2 stages, 2 gloo processes) against the single-process run.

One `torchrun --nproc_per_node 2` launch trains ELECTRA (DecoupledOptim: generator then
discriminator in one pipeline), BERT-MLM (T5 relative positions: the bias table's gradient and
the tied MLM output matrix cross the stage boundary), that BERT-MLM as a DWT student (the
teacher, 3 pretraining steps on the tiny data, runs on the head's stage) and an ELECTRA resume
from step 2. With 2
stages there is one pipeline, so the reference is the `single` backend on the same global batch
(micro-batch 4, accumulation 4) with the same sampling generator (harness.py, world=1). What
differs is where float32 sums happen (the MLM loss joins λ·L_RTD in one backward, gradient norms
are summed over stages in float64), measured ≤ 1e-6 relative; RTOL = 1e-5 as in
test_backends.py still catches a wrong λ, averaging factor or clip threshold (all ≥ 1e-3).
"""

from __future__ import annotations

import pytest
import torch

from megakd.config import ConfigError, load_config
from megakd.engine.pretrain import run_pretraining
from megakd.store.checkpoint import latest_checkpoint
from megakd.store.checkpoint_models import read_unit_state
from tests.distributed.harness import (
    CONFIG,
    ELECTRA_KEYS,
    WEIGHT_ATOL,
    assert_clipping_bites,
    assert_metrics_close,
    assert_resume_exact,
    assert_same_weights,
    read_metrics,
    reference_run,
    torchrun,
)
from tests.helpers import tiny_overrides

STEPS = 4
COMMON = {
    "train.max_steps": STEPS, "train.global_batch_size": 16, "train.micro_batch_size": 4,
    "model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0, "run.export_hf": "false",
    "kernels.backend": "torch", "optim.generator.clip_norm": 0.94, "optim.discriminator.clip_norm": 0.45,
}
PIPE = {"backend.name": "deepspeed", "backend.pipeline_stages": 2}
MLM = {"model.objective": "mlm", "model.generator.num_layers": 2, "model.generator.position_encoding": "t5_relative"}
MLM_KEYS = ("gen_loss", "gen_acc", "lr_generator", "grad_norm_generator")
# α_h ≠ 1 and τ ≠ 1 so a dropped weight or τ² shows; α_s goes 4, 3, 2, 1 over the 4 steps
DWT = {"distill.alpha_hard": 0.5, "distill.temperature": 2.0, "distill.alpha_schedule": "linear"}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")

    def overrides(name: str, **extra) -> list[str]:
        return tiny_overrides(tiny_data, root / name, **{**COMMON, **extra})

    run_pretraining(load_config(CONFIG, overrides("teacher", **{"model.objective": "mlm", "train.max_steps": 3,
                                                                 "optim.generator.lr": 3e-3})))
    dwt = {**MLM, **DWT, "distill.teacher": str(root / "teacher")}
    torchrun(2, [
        {"overrides": overrides("electra", **PIPE, **{"run.save_every": 2, "run.keep_last": 0})},
        {"overrides": overrides("electra_resumed", **PIPE),
         "resume": str(root / "electra" / "checkpoints" / "step_00000002")},
        {"overrides": overrides("mlm", **PIPE, **MLM)},
        {"overrides": overrides("dwt", **PIPE, **dwt)},
    ], root / "spec.json")
    reference_run(overrides("electra_reference"), world=1)
    reference_run(overrides("mlm_reference", **MLM), world=1)
    reference_run(overrides("dwt_reference", **dwt), world=1)
    return root


@pytest.mark.slow
def test_electra_pipeline_matches_single_process(runs):
    """Loss/RTD trajectory, both LRs, both clipped gradient norms and final weights of both models."""
    want = read_metrics(runs / "electra_reference")
    assert_clipping_bites(want, "generator", COMMON["optim.generator.clip_norm"])
    assert_clipping_bites(want, "discriminator", COMMON["optim.discriminator.clip_norm"])
    got = read_metrics(runs / "electra")
    assert all(r["lr_generator"] != r["lr_discriminator"] for r in got[:-1])  # two schedules (both 0 at the end)
    assert_metrics_close(got, want, (*ELECTRA_KEYS, "replaced_frac"))
    assert all(r["tokens_per_s"] > 0 for r in got)
    for unit in ("generator", "discriminator"):
        assert_same_weights(runs / "electra", runs / "electra_reference", unit)


@pytest.mark.slow
def test_mlm_pipeline_matches_single_process(runs):
    """BERT-MLM split mid-encoder: tied output matrix and relative-bias table on both sides."""
    want = read_metrics(runs / "mlm_reference")
    assert_clipping_bites(want, "generator", COMMON["optim.generator.clip_norm"])
    got = read_metrics(runs / "mlm")
    assert_metrics_close(got, want, MLM_KEYS)
    assert "disc_loss" not in got[0]
    assert_same_weights(runs / "mlm", runs / "mlm_reference", "generator")


@pytest.mark.slow
def test_dwt_pipeline_matches_single_process(runs):
    """DWT with the BERT-MLM student split over both stages: the teacher's KD term, α_s per step, weights."""
    want = read_metrics(runs / "dwt_reference")
    got = read_metrics(runs / "dwt")
    assert [r["alpha_soft"] for r in got] == pytest.approx([4.0, 3.0, 2.0, 1.0])
    assert all(r["kd_loss"] > 0 for r in got)
    assert_metrics_close(got, want, (*MLM_KEYS, "kd_loss", "alpha_soft"))
    assert_same_weights(runs / "dwt", runs / "dwt_reference", "generator")


@pytest.mark.slow
def test_pipeline_resume_is_exact(runs):
    """The pipeline checkpoint of step 2 (stage modules, both optimizers and schedules) replays 3-4."""
    assert_resume_exact(runs / "electra", runs / "electra_resumed", [3, 4], ("generator", "discriminator"))


@pytest.mark.slow
def test_pipeline_checkpoint_exports_to_hf(runs, tmp_path):
    """`megakd convert to-hf` reads the consolidated units: the HF discriminator holds the reference weights."""
    from transformers import ElectraForPreTraining

    from megakd.convert import export_run

    out = export_run(runs / "electra", tmp_path / "hf")
    hf = ElectraForPreTraining.from_pretrained(out / "discriminator")
    ref = read_unit_state(latest_checkpoint(runs / "electra_reference"), "discriminator")
    torch.testing.assert_close(hf.discriminator_predictions.dense_prediction.weight.flatten(),
                               ref["head.prediction.weight"].flatten(), rtol=0, atol=WEIGHT_ATOL)


@pytest.mark.parametrize("overrides, message", [
    (["backend.pipeline_stages=2"], "backend.pipeline_stages=2 needs backend.name=deepspeed, got 'auto'"),
    (["backend.name=deepspeed", "backend.pipeline_stages=2", "backend.zero_stage=2"],
     "backend.pipeline_stages=2 needs backend.zero_stage=0"),
    (["backend.name=deepspeed", "backend.pipeline_stages=2", "train.precision=bf16"], "needs train.precision=fp32"),
    (["backend.name=deepspeed", "backend.pipeline_stages=2", "electra.decoupled=false"],
     "needs electra.decoupled=true"),
    (["backend.name=deepspeed", "backend.pipeline_stages=6"],
     "backend.pipeline_stages=6 exceeds the 5 encoder layers to split (model.generator.num_layers=2 + "
     "model.discriminator.num_layers=3)"),
])
def test_unsupported_pipeline_layouts_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)
