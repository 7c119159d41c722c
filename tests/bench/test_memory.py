"""Planner memory against references: DeepSpeed's own ZeRO estimators on real models,
docs/methods.md § Pretraining recipes parameter counts, and the bytes autograd really saves for an encoder layer."""

from __future__ import annotations

import re

import pytest
import torch

from megakd.bench.memory import layer_activation_bytes, model_blocks, model_state_bytes, parameter_counts
from megakd.config import load_config
from megakd.finish import finish_config
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import Encoder, EncoderConfig

ds_stage2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
ds_stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")


@pytest.fixture(scope="module")
def base_models():
    """The real electra-base generator and discriminator (370M parameters, on CPU)."""
    cfg = finish_config(load_config("configs/electra-base.yaml"))
    return cfg, {"generator": MaskedLM(cfg.model.generator), "discriminator": Discriminator(cfg.model.discriminator)}


def _states(cfg, model_name, stage, gpus):
    blocks = [b for b in model_blocks(cfg) if b.model == model_name]
    params = sum(b.params for b in blocks)
    largest = max(b.largest_module for b in blocks)
    return sum(model_state_bytes(params, largest, stage, gpus, "bf16").values())


@pytest.mark.parametrize("gpus_per_node,nodes", [(1, 1), (8, 1), (8, 8)])
def test_model_states_match_deepspeed_estimators(base_models, capsys, gpus_per_node, nodes):
    cfg, models = base_models
    gpus = gpus_per_node * nodes
    for name, model in models.items():
        total, largest = ds_stage3.model_to_params(model)
        assert parameter_counts(cfg)[name] == total  # meta-device count == DeepSpeed's count of the real model
        _, gpu2 = ds_stage2.estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=False)
        _, gpu3, _ = ds_stage3.estimate_zero3_model_states_mem_needs(total, largest, gpus_per_node, nodes,
                                                                     cpu_offload=False)
        assert _states(cfg, name, 2, gpus) == pytest.approx(gpu2, abs=1)
        assert _states(cfg, name, 3, gpus) == pytest.approx(gpu3, abs=1)
        # The *_all_live entry points (what users run) print the same figures, in GB.
        for estimator, stage in ((ds_stage2.estimate_zero2_model_states_mem_needs_all_live, 2),
                                 (ds_stage3.estimate_zero3_model_states_mem_needs_all_live, 3)):
            capsys.readouterr()
            estimator(model, num_gpus_per_node=gpus_per_node, num_nodes=nodes)
            no_offload = [ln for ln in capsys.readouterr().out.splitlines() if re.search(r"offload_\w+=none", ln)]
            printed_gb = float(re.findall(r"([\d.]+)GB", no_offload[-1])[1])
            assert _states(cfg, name, stage, gpus) / 2**30 == pytest.approx(printed_gb, abs=0.006)


def test_stages_order_and_fp32():
    p, largest = 1_000_000, 1000
    totals = [sum(model_state_bytes(p, largest, s, 8, "bf16").values()) for s in range(4)]
    assert totals[0] == 20 * p and totals[0] > totals[1] > totals[2] > totals[3]
    assert sum(model_state_bytes(p, largest, 0, 8, "fp32").values()) == 16 * p
    assert sum(model_state_bytes(p, largest, 3, 8, "fp32").values()) == 16 * p / 8 + 8 * largest
    with pytest.raises(ValueError, match="zero_stage"):
        model_state_bytes(p, largest, 4, 8, "bf16")


@pytest.mark.parametrize("size,expected", [("base", 370e6), ("large", 665e6)])
def test_parameter_counts_match_spec(size, expected):
    # docs/methods.md § Pretraining recipes: two 128K x hidden embedding tables (DecoupledOptim), ≈370M / ≈665M.
    counts = parameter_counts(finish_config(load_config(f"configs/electra-{size}.yaml")))
    assert counts["total"] == pytest.approx(expected, rel=0.01)
    assert counts["total"] == counts["generator"] + counts["discriminator"]


def _saved_bytes(encoder, x, key_mask, bias) -> int:
    """Bytes of every distinct storage autograd saves for the encoder's first layer, its parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in encoder.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        encoder.layers[0](x, key_mask, bias)
    return sum(saved.values())


@pytest.mark.parametrize("zero3", [False, True], ids=["torch_linear", "zero3_linear"])
@pytest.mark.parametrize("fused_qkv", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layer_activations_match_saved_tensors(dropout, fused_qkv, zero3, monkeypatch):
    """Every tensor autograd saves for one layer (parameters excluded, shared storage once), with torch's
    linear and with the linear DeepSpeed's ZeRO-3 puts in its place (which keeps the bias too)."""
    if zero3:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    cfg = EncoderConfig(vocab_size=512, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=256,
                        dropout=dropout, attention_dropout=0.0, max_position_embeddings=128, fused_qkv=fused_qkv)
    encoder = Encoder(cfg).train()
    ids = torch.randint(5, 500, (4, 128))
    x, key_mask, bias = encoder.prepare(ids, torch.ones_like(ids))
    x = x.detach().requires_grad_()
    saved = _saved_bytes(encoder, x, key_mask, bias)
    # CPU dropout keeps its mask as float32 (CUDA keeps bool: mask_bytes=1).
    assert saved == layer_activation_bytes(cfg, 128, 4, elem=4, mask_bytes=4, zero3=zero3)


@pytest.mark.parametrize("seq_len", [128, 100])  # 100: the bias and masks padded to flex's 128 blocks
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_flex_layer_activations_match_saved_tensors(dropout, seq_len, monkeypatch):
    """The flex path for T5 relative positions (what `auto` runs on CUDA with attention dropout off): every
    tensor the compiled flex_attention's autograd saves for one layer, counted as in the test above. On CPU
    it is compiled with the aot_eager backend: AOTAutograd's partition (what a compiled backward gets
    saved) with eager kernels, since torch 2.13's inductor has no CPU flex backward; eager flex_attention
    keeps its row maxima and lengths too, which the compiled backward does not read."""
    import torch.nn.attention.flex_attention as flex_module

    from megakd.models import encoder as encoder_module
    from megakd.models.encoder import flex_bias, flex_block_mask

    compiled = torch.compile(flex_module.flex_attention, backend="aot_eager")
    monkeypatch.setattr(encoder_module, "compiled_flex_attention", lambda: compiled)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # its CPU no-backward check
    cfg = EncoderConfig(vocab_size=512, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=256,
                        dropout=dropout, attention_dropout=0.0, max_position_embeddings=128,
                        position_encoding="t5_relative")
    encoder = Encoder(cfg).train()
    ids = torch.randint(5, 500, (4, seq_len))
    mask = torch.ones_like(ids)
    mask[1, seq_len // 2:] = 0
    x, key_mask, bias = encoder.prepare(ids, mask)
    x = x.detach().requires_grad_()
    key_mask, bias = flex_block_mask(key_mask), flex_bias(bias, x.dtype)  # as Encoder.forward makes them
    saved = _saved_bytes(encoder, x, key_mask, bias)
    assert saved == layer_activation_bytes(cfg, seq_len, 4, elem=4, mask_bytes=4)
