"""Fused QKV projection: the same parameters and function as three projections, in one matmul."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megakd.models.electra import Discriminator
from megakd.models.encoder import EncoderConfig
from megakd.store import rundir


def config(fused_qkv: bool, **overrides) -> EncoderConfig:
    base = dict(vocab_size=61, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64, embedding_size=16,
                max_position_embeddings=32, relative_buckets=8, relative_max_distance=20, dropout=0.1,
                attention_dropout=0.1, initializer_range=0.3, fused_qkv=fused_qkv)  # sharp attention: large key grads
    return EncoderConfig(**{**base, **overrides})


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(5, 61, (3, 13), generator=g)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    input_ids[mask == 0] = 0
    return input_ids, mask, torch.rand(3, 13, generator=g)


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
def test_fused_and_separate_projections_agree_in_float64(position_encoding: str) -> None:
    """Loss, hidden states and every gradient, with dropout on (the same seed draws the same masks)."""
    input_ids, mask, target = padded_batch()
    torch.manual_seed(0)
    fused = Discriminator(config(True, position_encoding=position_encoding)).double()
    separate = Discriminator(config(False, position_encoding=position_encoding)).double()
    separate.load_state_dict(fused.state_dict())  # one state dict, the same keys, serves both
    results = []
    for model in (fused, separate):
        model.train()
        embeds = model.encoder.embed(input_ids).detach().requires_grad_()
        torch.manual_seed(1)
        hidden = model(attention_mask=mask, inputs_embeds=embeds)
        logits = model.rtd_logits(hidden)
        loss = F.binary_cross_entropy_with_logits(logits[mask.bool()], target[mask.bool()].double())
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        results.append((hidden.detach(), loss.detach(), embeds.grad, grads))
    (h_f, loss_f, embeds_f, grads_f), (h_s, loss_s, embeds_s, grads_s) = results
    torch.testing.assert_close(h_f, h_s, rtol=0, atol=1e-12)
    torch.testing.assert_close(loss_f, loss_s, rtol=0, atol=1e-12)
    torch.testing.assert_close(embeds_f, embeds_s, rtol=0, atol=1e-12)
    assert grads_f.keys() == grads_s.keys() == dict(fused.named_parameters()).keys() - {
        "encoder.embeddings.word_embeddings.weight"}  # the embeddings were given as inputs_embeds
    for name in grads_f:
        torch.testing.assert_close(grads_f[name], grads_s[name], rtol=0, atol=1e-12, msg=name)
    assert grads_f["encoder.layers.1.attention.key.weight"].abs().max() > 1e-3  # the check has teeth


class CountMatmuls(TorchDispatchMode):
    """Counts the matrix products (aten.mm / addmm / bmm) dispatched under it."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_fused_projection_is_one_matmul_per_layer() -> None:
    """Forward of one layer's attention: 1 (qkv) + 1 (output) products fused, 3 + 1 separate."""
    counts = {}
    for fused_qkv in (True, False):
        layer = Discriminator(config(fused_qkv, attention_dropout=0.0)).encoder.layers[0].attention.eval()
        x = torch.randn(2, 5, 32)
        with torch.no_grad(), torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH), \
                CountMatmuls() as counter:
            layer(x, None, None)
        counts[fused_qkv] = counter.count
    assert counts[False] - counts[True] == 2


@pytest.mark.parametrize("saved,current", [
    ({}, True),  # a run started before the switch existed resumes with it on
    ({"fused_qkv": True}, False),  # and the switch may change at resume without --allow-change
])
def test_fused_qkv_changes_freely_at_resume(saved: dict, current: bool) -> None:
    old = {"model": {"discriminator": {"hidden_size": 32, **saved}}, "finetune": {"encoder": {**saved}}}
    new = {"model": {"discriminator": {"hidden_size": 32, "fused_qkv": current}},
           "finetune": {"encoder": {"fused_qkv": current}}}
    assert rundir.state_changes(old, new) == {}
    new["model"]["discriminator"]["hidden_size"] = 64  # other model fields stay state-bearing
    assert rundir.state_changes(old, new) == {"model.discriminator.hidden_size": (32, 64)}
