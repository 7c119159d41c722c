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

STEPS = 3


@pytest.fixture(scope="module")
def params_after(tiny_data, tmp_path_factory):
    """Parameters after STEPS steps for (λ, decoupled, clip, ε); each setting is trained once per module."""
    cache: dict = {}

    def get(lam: float, decoupled: bool, clip: float, eps: float, joint_clip: str = "weighted") -> dict:
        key = (lam, decoupled, clip, eps, joint_clip)
        if key not in cache:
            cache[key] = _params_after(tiny_data, tmp_path_factory.mktemp("lambda"), *key)
        return cache[key]

    return get


def _params_after(tiny_data, tmp_path, lam: float, decoupled: bool, clip: float, eps: float,
                  joint_clip: str = "weighted") -> dict:
    overrides = tiny_overrides(tiny_data, tmp_path / f"run-{lam}-{decoupled}-{clip}", **{
        "electra.loss_weight": lam, "electra.decoupled": decoupled, "train.max_steps": STEPS,
        "optim.joint_clip": joint_clip,
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
def test_lambda_is_a_noop_under_decoupled_optim(params_after, clip):
    # ε = 1e-30: Adam's update m/(√v + ε) is then exactly scale-invariant up to float64 rounding.
    a = params_after(1.0, True, clip, 1e-30)
    b = params_after(50.0, True, clip, 1e-30)
    # Clipping's coefficient is c/(‖g‖ + 1e-6) in torch: that 1e-6 is the only λ-dependent term left.
    assert _max_diff(a, b) < (1e-10 if clip == 0 else 1e-6)


def test_generator_never_sees_lambda_under_decoupled_optim(params_after):
    # With the paper's ε = 1e-6 the discriminator's update differs where |g| is comparable to ε
    # (that is the "up to ε"), but the generator's own optimizer never sees λ: bit-identical.
    # With shared embeddings, λ reaches the generator through the shared tables.
    def generator_params(decoupled, lam):
        params = params_after(lam, decoupled, 0.0, 1e-6 if decoupled else 1e-30)
        prefix = "generator." if decoupled else "electra.generator."
        return {k: v for k, v in params.items() if k.startswith(prefix)}

    a, b = generator_params(True, 1.0), generator_params(True, 50.0)
    assert a and all(torch.equal(a[k], b[k]) for k in a)
    assert _max_diff(generator_params(False, 1.0), generator_params(False, 50.0)) > 1e-3


def test_lambda_matters_with_shared_embeddings(params_after):
    a = params_after(1.0, False, 0.0, 1e-30)
    b = params_after(50.0, False, 0.0, 1e-30)
    assert _max_diff(a, b) > 1e-3
    shared_key = "electra.generator.encoder.embeddings.word_embeddings.weight"
    assert (a[shared_key] - b[shared_key]).abs().max() > 1e-3
    assert torch.isfinite(a[shared_key]).all()


def test_joint_unweighted_clip_is_the_weighted_clip_at_lambda_times_the_norm(params_after):
    """optim.joint_clip=unweighted bounds ∇(L_MLM/λ + L_RTD) by clip_norm, i.e. ∇(L_MLM + λ·L_RTD) by
    λ·clip_norm: the same run as `weighted` with a λ-times threshold, and a different one at the same threshold."""
    lam = 10.0
    unweighted = params_after(lam, False, 0.05, 1e-6, "unweighted")
    assert _max_diff(unweighted, params_after(lam, False, 0.05 * lam, 1e-6, "weighted")) < 1e-9
    assert _max_diff(unweighted, params_after(lam, False, 0.05, 1e-6, "weighted")) > 1e-4


def test_joint_mode_says_that_optim_generator_is_ignored(tiny_data, tmp_path, caplog):
    from megakd.engine.layouts import build_layout
    from megakd.engine.pretrain import build_models

    for decoupled in (True, False):
        caplog.clear()
        cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path, **{
            "electra.decoupled": decoupled, "optim.generator.clip_norm": 1.0}))
        with caplog.at_level("WARNING", logger="megakd.engine.pretrain"):
            build_layout(cfg, *build_models(cfg))
        warnings = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
        if decoupled:
            assert warnings == []
        else:  # tiny_overrides sets optim.generator.lr=2e-3; the recipe default is 2e-4
            assert len(warnings) == 1 and "\n" not in warnings[0]
            assert "optim.generator.lr=0.002" in warnings[0] and "optim.generator.clip_norm=1.0" in warnings[0]
            assert "optim.discriminator" in warnings[0]
