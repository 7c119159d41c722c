"""electra.rtd_positions=masked (ELECTRA 15 %): the discriminator's RTD loss over the masked positions only.

Against a float64 reference BCE taken over the masked positions alone (the kernel tests' reference,
`fused_rtd_loss_reference`), through the loss module and both ELECTRA layouts (the one-stage pipeline's
case is in tests/engine/test_pipeline_heads.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megakd.kernels import fused_rtd_loss_reference
from megakd.kernels.dispatch import triton_available, triton_interpret

from megakd.config import ConfigError, load_config
from megakd.engine.layouts import build_layout
from megakd.engine.losses import DiscriminatorLoss
from megakd.engine.units import StepContext
from megakd.models.electra import Discriminator, MaskedLM
from megakd.objectives.electra import rtd_loss
from tests.helpers import RecordedRun, masked_batch, tiny_overrides
from tests.kernels.helpers import BACKENDS

CONFIG = "configs/electra-tiny.yaml"
STILL = {"model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0}


def _discriminator(tiny_data, tmp_path) -> Discriminator:
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path, **STILL))
    torch.manual_seed(0)
    return Discriminator(cfg.model.discriminator).double().eval()


def _reference(model: Discriminator, corrupted, original, attention_mask, keep) -> torch.Tensor:
    """Mean BCE (label 1 = replaced) of the discriminator's logits over `keep`, in float64, by plain autograd."""
    transformed = model.head.transform(model(corrupted, attention_mask))
    proj = model.head.prediction
    return fused_rtd_loss_reference(transformed.reshape(-1, transformed.shape[-1]), proj.weight.reshape(-1),
                                    proj.bias.reshape(()), corrupted.reshape(-1), original.reshape(-1),
                                    keep.reshape(-1))


def _corrupted(batch: dict[str, torch.Tensor], vocab: int) -> torch.Tensor:
    """Replacements at the masked slots, about half of them equal to the original (those count as original)."""
    g = torch.Generator().manual_seed(11)
    fresh = torch.randint(5, vocab, batch["input_ids"].shape, generator=g)
    keep_original = torch.rand(fresh.shape, generator=g) < 0.5
    replaced = torch.where(keep_original, batch["input_ids"], fresh)
    return torch.where(batch["mlm_mask"], replaced, batch["input_ids"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_loss_is_the_bce_over_masked_positions_only(tiny_data, tmp_path, backend):
    model = _discriminator(tiny_data, tmp_path)
    vocab = model.config.vocab_size
    batch = masked_batch(vocab, 4)
    corrupted = _corrupted(batch, vocab)
    original, attn, mlm = batch["input_ids"], batch["attention_mask"], batch["mlm_mask"]
    assert (corrupted != original).any() and ((corrupted == original) & mlm).any()  # both labels at masked slots

    masked = DiscriminatorLoss(model, backend, rtd_positions="masked")(corrupted, original, attn, mlm_mask=mlm)
    everywhere = DiscriminatorLoss(model, backend)(corrupted, original, attn, mlm_mask=mlm)
    want = _reference(model, corrupted, original, attn, attn & mlm)
    torch.testing.assert_close(masked["loss"], want, rtol=1e-10, atol=1e-12)
    # an independent count of the same mean: BCE at each masked slot of a padded batch, summed, divided
    logits = masked["logits"]
    labels = (corrupted != original).double()
    by_hand = F.binary_cross_entropy_with_logits(logits[mlm], labels[mlm], reduction="sum") / mlm.sum()
    torch.testing.assert_close(masked["loss"].detach(), by_hand, rtol=1e-10, atol=1e-12)
    # the `all` loss is a different number (the unmasked tokens are easy originals), over every real token
    torch.testing.assert_close(everywhere["loss"], _reference(model, corrupted, original, attn, attn),
                               rtol=1e-10, atol=1e-12)
    assert abs(float(masked["loss"].detach()) - float(everywhere["loss"].detach())) > 1e-3

    # the logged disc_loss is the same per-position BCE; the RTD counts still cover every real token
    stats = {k: float(v) for k, v in masked["stats"].items()}
    assert stats["disc_loss_tokens"] == float(mlm.sum()) and stats["rtd_tokens"] == float(attn.sum())
    ratios = DiscriminatorLoss.ratios(stats)
    assert ratios["disc_loss"] == pytest.approx(float(masked["loss"].detach()), rel=1e-6)
    assert ratios["rtd_f1"] == DiscriminatorLoss.ratios({k: float(v) for k, v in everywhere["stats"].items()})[
        "rtd_f1"]
    assert "disc_loss_tokens" not in everywhere["stats"]

    # gradients: only the masked positions' logits carry any
    hidden = model(corrupted, attn).detach().requires_grad_(True)
    transformed = model.head.transform(hidden)
    proj = model.head.prediction
    keep = DiscriminatorLoss(model, backend, "masked").loss_mask(attn, mlm)
    rtd_loss(transformed, proj.weight, proj.bias, corrupted, original, keep, backend).backward()
    touched = hidden.grad.abs().sum(-1) > 0
    assert torch.equal(touched, mlm)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masked_equals_all_when_every_token_is_masked(tiny_data, tmp_path, backend):
    model = _discriminator(tiny_data, tmp_path)
    batch = masked_batch(model.config.vocab_size, 4)
    attn = batch["attention_mask"]
    every = torch.ones_like(attn)  # padding "masked" too: the loss still skips it
    batch["mlm_mask"] = every
    corrupted = _corrupted(batch, model.config.vocab_size)
    masked = DiscriminatorLoss(model, backend, "masked")(corrupted, batch["input_ids"], attn, mlm_mask=every)
    everywhere = DiscriminatorLoss(model, backend, "all")(corrupted, batch["input_ids"], attn)
    torch.testing.assert_close(masked["loss"], everywhere["loss"], rtol=1e-12, atol=1e-14)
    assert DiscriminatorLoss.ratios(masked["stats"])["disc_loss"] == pytest.approx(
        float(DiscriminatorLoss.ratios(everywhere["stats"])["disc_loss"]), rel=1e-9)


def test_fused_kernel_and_torch_path_agree_on_the_masked_loss(tiny_data, tmp_path):
    """float32 activations as training runs them: the fused kernel (where this machine can run it) and the torch
    path give the masked loss and its gradients to float32 precision."""
    if not (triton_available() and triton_interpret()):
        pytest.skip("the fused RTD kernel needs triton with TRITON_INTERPRET=1 on CPU")
    available = ("torch", "triton")
    model = _discriminator(tiny_data, tmp_path).float()
    batch = masked_batch(model.config.vocab_size, 4)
    corrupted = _corrupted(batch, model.config.vocab_size)
    out = {}
    for backend in available:
        model.zero_grad()
        loss = DiscriminatorLoss(model, backend, "masked")(corrupted, batch["input_ids"], batch["attention_mask"],
                                                          mlm_mask=batch["mlm_mask"])["loss"]
        loss.backward()
        out[backend] = loss.detach(), model.head.prediction.weight.grad.clone()
    (l0, g0), (l1, g1) = out.values()
    torch.testing.assert_close(l0, l1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g0, g1, rtol=1e-4, atol=1e-6)


def test_masked_loss_without_the_mask_is_refused(tiny_data, tmp_path):
    model = _discriminator(tiny_data, tmp_path)
    batch = masked_batch(model.config.vocab_size, 4)
    with pytest.raises(ValueError, match="rtd_positions='masked' needs the batch's mlm_mask"):
        DiscriminatorLoss(model, "torch", "masked")(batch["input_ids"], batch["input_ids"], batch["attention_mask"])


@pytest.mark.parametrize("decoupled", [True, False])
def test_both_electra_layouts_take_the_loss_at_the_masked_positions(tiny_data, tmp_path, decoupled):
    """DecoupledElectra and JointElectra (original ELECTRA) pass the micro-batch's mlm_mask to the loss: the
    discriminator's loss is the reference BCE over the masked positions of the ids it saw."""
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path, **STILL, **{
        "electra.rtd_positions": "masked", "electra.decoupled": decoupled, "kernels.backend": "torch"}))
    torch.manual_seed(cfg.train.seed)
    generator, discriminator = MaskedLM(cfg.model.generator), Discriminator(cfg.model.discriminator)
    layout = build_layout(cfg, generator, discriminator)
    batch = masked_batch(cfg.model.generator.vocab_size, 4)
    run = RecordedRun()
    out = layout.micro_step(run, batch, StepContext(index=0, rng=torch.Generator().manual_seed(5)))
    attn, mlm = batch["attention_mask"], batch["mlm_mask"]
    with torch.no_grad():
        want = _reference(discriminator, out.corrupted, batch["input_ids"], attn, attn & mlm)
    stats = {k: float(v) for k, v in out.stats.items()}
    assert stats["disc_loss_tokens"] == float(mlm.sum())
    disc_loss = layout.ratios(stats)["disc_loss"]
    assert disc_loss == pytest.approx(float(want), rel=1e-5)
    if decoupled:
        torch.testing.assert_close(run.losses["discriminator"].detach(), want, rtol=1e-5, atol=1e-6)
    else:  # L_MLM + λ·L_RTD with the masked-position L_RTD
        gen_loss = stats["gen_loss_sum"] / stats["masked"]
        assert float(run.losses["electra"].detach()) == pytest.approx(gen_loss + cfg.electra.loss_weight * float(want),
                                                             rel=1e-5)


def test_unknown_rtd_positions_is_refused(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="electra.rtd_positions"):
        load_config(CONFIG, tiny_overrides(tiny_data, tmp_path, **{"electra.rtd_positions": "some"}))
