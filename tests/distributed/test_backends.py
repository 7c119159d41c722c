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

import math

import pytest
import torch

from megakd.convert.checkpoints import read_unit_state
from megakd.engine.checkpoint import latest_checkpoint
from tests.distributed.harness import read_metrics, reference_run, torchrun
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.slow

RTOL = 1e-5
WEIGHT_ATOL = 1e-5
STEPS = 4
COMPARED = ("gen_loss", "gen_acc", "disc_loss", "disc_acc", "rtd_f1", "lr_generator", "lr_discriminator",
            "grad_norm_generator", "grad_norm_discriminator")
COMMON = {
    "train.max_steps": STEPS, "train.global_batch_size": 16, "train.micro_batch_size": 4,
    "model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0, "run.export_hf": "false",
    "kernels.backend": "torch", "optim.generator.clip_norm": 1.0, "optim.discriminator.clip_norm": 0.45,
}
VARIANTS = {  # run name -> overrides on top of COMMON
    "ddp": {"backend.name": "ddp"},
    "zero1": {"backend.name": "deepspeed", "backend.zero_stage": 1},
    "zero2": {"backend.name": "deepspeed", "backend.zero_stage": 2},
    "zero3": {"backend.name": "deepspeed", "backend.zero_stage": 3, "train.save_every": 2, "run.keep_last": 0},
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


def _final_state(run_dir, unit: str) -> dict[str, torch.Tensor]:
    return read_unit_state(latest_checkpoint(run_dir), unit)


def _assert_close_metrics(got: list[dict], want: list[dict], rtol: float) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, STEPS + 1))
    for g, w in zip(got, want):
        for key in COMPARED:
            assert math.isclose(g[key], w[key], rel_tol=rtol, abs_tol=1e-9), (key, g["step"], g[key], w[key])


@pytest.mark.parametrize("name", ["ddp", "zero1", "zero2", "zero3"])
def test_two_processes_match_single_process(runs, name):
    want = read_metrics(runs / "reference")
    # The thresholds must actually bite on some steps (and not all), or clipping goes untested.
    for unit, clip in (("generator", COMMON["optim.generator.clip_norm"]),
                       ("discriminator", COMMON["optim.discriminator.clip_norm"])):
        clipped = [r[f"grad_norm_{unit}"] > clip for r in want]
        assert any(clipped) and not all(clipped), (unit, clipped)
    _assert_close_metrics(read_metrics(runs / name), want, RTOL)
    for unit in ("generator", "discriminator"):
        got, ref = _final_state(runs / name, unit), _final_state(runs / "reference", unit)
        assert got.keys() == ref.keys()
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], rtol=0, atol=WEIGHT_ATOL, msg=f"{name} {unit} {key}")


def test_original_electra_one_engine_matches_single_process(runs):
    """Shared embeddings, one optimizer over L_MLM + λ·L_RTD: one DeepSpeed engine (ZeRO-2)."""
    _assert_close_metrics(read_metrics(runs / "joint_zero2"), read_metrics(runs / "joint_reference"), RTOL)
    got, ref = _final_state(runs / "joint_zero2", "electra"), _final_state(runs / "joint_reference", "electra")
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=WEIGHT_ATOL, msg=key)


def test_zero3_resume_is_exact(runs):
    """Resuming the ZeRO-3 checkpoint of step 2 replays steps 3-4 bit for bit (2 ranks, 2 engines)."""
    full = {r["step"]: r for r in read_metrics(runs / "zero3")}
    resumed = read_metrics(runs / "zero3_resumed")
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        for key, value in r.items():
            if key != "tokens_per_s":
                assert value == full[r["step"]][key], (key, r["step"])
    for unit in ("generator", "discriminator"):
        a, b = _final_state(runs / "zero3", unit), _final_state(runs / "zero3_resumed", unit)
        assert all(torch.equal(a[k], b[k]) for k in a), unit


def test_zero3_checkpoint_consolidates_into_hf_export(runs, tmp_path):
    """zero_to_fp32 → HF: the exported discriminator holds the single-process reference weights."""
    from transformers import ElectraForPreTraining

    from megakd.convert import export_run

    out = export_run(runs / "zero3", tmp_path / "hf")
    hf = ElectraForPreTraining.from_pretrained(out / "discriminator")
    ref = _final_state(runs / "reference", "discriminator")
    torch.testing.assert_close(hf.electra.embeddings.word_embeddings.weight, ref["encoder.embeddings.word_embeddings.weight"],
                               rtol=0, atol=WEIGHT_ATOL)
    torch.testing.assert_close(hf.discriminator_predictions.dense_prediction.weight.flatten(),
                               ref["head.prediction.weight"].flatten(), rtol=0, atol=WEIGHT_ATOL)
