"""DDP and DeepSpeed ZeRO 1/2/3 over 2 real gloo processes against the single-process run.

One `torchrun --nproc_per_node 2` launch trains every variant (see worker.py); the reference is
the `single` backend replaying the same global batches as gradient accumulation (harness.py):
each 2-rank step (micro-batch 4, accumulation 2) = 4 micro-batches in one process, in rank order,
with each rank's sampling generator. The only remaining difference is the order of float32
summation (gloo all-reduce / ZeRO reduce-scatter vs. local accumulation), which measured ≤ 2e-7
relative on every logged metric over 4 steps; RTOL = 1e-5 leaves headroom for BLAS blocking on
other CPUs while still catching a wrong averaging factor, λ or clipping threshold (all ≥ 1e-3).
Clipping is set so that it engages on some steps and not on others (asserted).
"""

from __future__ import annotations

import pytest
import torch

from megakd.store.checkpoint import latest_checkpoint
from megakd.store.checkpoint_models import read_unit_state
from tests.distributed.harness import (
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

pytestmark = pytest.mark.slow

STEPS = 4
COMMON = {
    "train.max_steps": STEPS, "train.global_batch_size": 16, "train.micro_batch_size": 4,
    "model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0, "run.export_hf": "false",
    "kernels.backend": "torch", "optim.generator.clip_norm": 0.94, "optim.discriminator.clip_norm": 0.45,
}
VARIANTS = {  # run name -> overrides on top of COMMON
    "ddp": {"backend.name": "ddp"},
    "zero1": {"backend.name": "deepspeed", "backend.zero_stage": 1},
    "zero2": {"backend.name": "deepspeed", "backend.zero_stage": 2},
    "zero3": {"backend.name": "deepspeed", "backend.zero_stage": 3, "run.save_every": 2, "run.keep_last": 0},
    "joint_zero2": {"backend.name": "deepspeed", "backend.zero_stage": 2, "electra.decoupled": "false"},
}


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """Every 2-process run + the zero3 resume from step 2, and the two single-process references."""
    root = tmp_path_factory.mktemp("backends")

    def overrides(name: str, **extra) -> list[str]:
        return tiny_overrides(tiny_data, root / name, **{**COMMON, **extra})

    launch = [{"overrides": overrides(name, **extra)} for name, extra in VARIANTS.items()]
    launch.append({"overrides": overrides("zero3_resumed", **VARIANTS["zero3"]),
                   "resume": str(root / "zero3" / "checkpoints" / "step_00000002")})
    torchrun(2, launch, root / "spec.json")
    reference_run(overrides("reference"), world=2)
    reference_run(overrides("joint_reference", **{"electra.decoupled": "false"}), world=2)
    return root


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3"])
def test_two_processes_match_single_process(runs, name):
    want = read_metrics(runs / "reference")
    assert_clipping_bites(want, "generator", COMMON["optim.generator.clip_norm"])
    assert_clipping_bites(want, "discriminator", COMMON["optim.discriminator.clip_norm"])
    assert_metrics_close(read_metrics(runs / name), want)
    for unit in ("generator", "discriminator"):
        assert_same_weights(runs / name, runs / "reference", unit)


def test_original_electra_one_engine_matches_single_process(runs):
    """Shared embeddings, one optimizer over L_MLM + λ·L_RTD: one DeepSpeed engine (ZeRO-2)."""
    assert_metrics_close(read_metrics(runs / "joint_zero2"), read_metrics(runs / "joint_reference"))
    assert_same_weights(runs / "joint_zero2", runs / "joint_reference", "electra")


def test_zero3_resume_is_exact(runs):
    """Resuming the ZeRO-3 checkpoint of step 2 replays steps 3-4 bit for bit (2 ranks, 2 engines)."""
    assert_resume_exact(runs / "zero3", runs / "zero3_resumed", [3, 4], ("generator", "discriminator"))


def test_zero3_checkpoint_consolidates_into_hf_export(runs, tmp_path):
    """zero_to_fp32 → HF: the exported discriminator holds the single-process reference weights."""
    from transformers import ElectraForPreTraining

    from megakd.convert import export_run

    out = export_run(runs / "zero3", tmp_path / "hf")
    hf = ElectraForPreTraining.from_pretrained(out / "discriminator")
    ref = read_unit_state(latest_checkpoint(runs / "reference"), "discriminator")
    torch.testing.assert_close(hf.electra.embeddings.word_embeddings.weight,
                               ref["encoder.embeddings.word_embeddings.weight"], rtol=0, atol=WEIGHT_ATOL)
    torch.testing.assert_close(hf.discriminator_predictions.dense_prediction.weight.flatten(),
                               ref["head.prediction.weight"].flatten(), rtol=0, atol=WEIGHT_ATOL)
