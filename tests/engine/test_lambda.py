"""The paper's central claim on the real trainer: under DecoupledOptim, λ changes no update.

With separate embeddings and optimizers, scaling the discriminator loss by λ scales its
gradient by λ, which Adam's m/√v cancels (exactly, with ε → 0) and which megakd's clipping of
the unweighted gradient leaves alone. With shared embeddings (original ELECTRA) λ changes the
mixture of gradients in the shared tables, so the parameters move differently.
"""

from __future__ import annotations

import pytest
import torch

from megakd.config import load_config
from megakd.engine.pretrain import build_trainer
from tests.helpers import tiny_overrides

STEPS = 4


def _params_after(tiny_data, tmp_path, lam: float, decoupled: bool, clip: float, eps: float) -> dict:
    overrides = tiny_overrides(tiny_data, tmp_path / f"run-{lam}-{decoupled}-{clip}", **{
        "electra.loss_weight": lam, "electra.decoupled": decoupled, "train.max_steps": STEPS,
        "optim.generator.clip_norm": clip, "optim.discriminator.clip_norm": clip,
        "optim.generator.eps": eps, "optim.discriminator.eps": eps,
        "model.generator.embedding_size": 32, "model.discriminator.embedding_size": 32,
    })
    trainer = build_trainer(load_config("configs/electra-tiny.yaml", overrides))
    for unit in trainer.units.values():
        unit.model.double()  # float64 so that rounding cannot hide or fake a difference
    batches = iter(trainer.loader)
    clipped = False
    for _ in range(STEPS):
        norms = trainer.train_step(batches)
        clipped |= clip > 0 and max(norms.values()) > clip
    assert clipped == (clip > 0), "the clipped variant must actually clip"
    return {f"{u.name}.{k}": v.detach().clone() for u in trainer.units.values()
            for k, v in u.model.state_dict().items()}


def _max_diff(a: dict, b: dict) -> float:
    """Largest parameter difference, skipping attention key biases: their true gradient is exactly
    zero (softmax is invariant to the constant q·b_k they add per query), so with ε → 0 Adam
    turns ~1e-17 rounding noise into full-size steps whose sign depends on λ."""
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a if not k.endswith("attention.key.bias"))


@pytest.mark.parametrize("clip", [0.0, 0.05], ids=["no-clipping", "clipping-active"])
def test_lambda_is_a_noop_under_decoupled_optim(tiny_data, tmp_path, clip):
    # ε = 1e-30: Adam's update m/(√v + ε) is then exactly scale-invariant up to float64 rounding.
    a = _params_after(tiny_data, tmp_path, 1.0, True, clip, 1e-30)
    b = _params_after(tiny_data, tmp_path, 50.0, True, clip, 1e-30)
    # Clipping's coefficient is c/(‖g‖ + 1e-6) in torch: that 1e-6 is the only λ-dependent term left.
    assert _max_diff(a, b) < (1e-10 if clip == 0 else 1e-6)


def test_lambda_changes_updates_up_to_eps_only(tiny_data, tmp_path):
    # With the paper's ε = 1e-6 the difference is bounded by Adam's ε, not by λ: far below the
    # parameter change that λ causes with shared embeddings.
    decoupled = _max_diff(_params_after(tiny_data, tmp_path, 1.0, True, 0.0, 1e-6),
                          _params_after(tiny_data, tmp_path, 50.0, True, 0.0, 1e-6))
    shared = _max_diff(_params_after(tiny_data, tmp_path, 1.0, False, 0.0, 1e-6),
                       _params_after(tiny_data, tmp_path, 50.0, False, 0.0, 1e-6))
    assert shared > 1e-3
    assert decoupled < shared / 100


def test_lambda_matters_with_shared_embeddings(tiny_data, tmp_path):
    a = _params_after(tiny_data, tmp_path, 1.0, False, 0.0, 1e-30)
    b = _params_after(tiny_data, tmp_path, 50.0, False, 0.0, 1e-30)
    assert _max_diff(a, b) > 1e-3
    shared_key = "electra.generator.encoder.embeddings.word_embeddings.weight"
    assert (a[shared_key] - b[shared_key]).abs().max() > 1e-3
    assert torch.isfinite(a[shared_key]).all()
