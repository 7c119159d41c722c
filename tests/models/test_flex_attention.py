"""The flex_attention and Triton-kernel paths for T5 relative positions against the SDPA path: outputs and gradients.

torch 2.13 runs flex_attention on CPU only forward (its public entry refuses inputs that need a
gradient on CPU, and its compiled backward is CUDA-only), so the gradient tests run the eager flex
operator with that device check lifted: the same score_mod, BlockMask and captured bias the CUDA
kernel gets, computed densely. Only the forward of the compiled CPU kernel is checked (slow: it compiles).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.flex_attention as flex_module

from megakd.models import encoder as encoder_module
from megakd.models.dropout import attention
from megakd.models.encoder import (
    Encoder,
    EncoderConfig,
    attention_bias,
    attention_kernel,
    flex_block_mask,
    flex_relative_attention,
    run_layer,
    segment_mask,
)

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
HEADS, LENGTH = 3, 37  # 37: no multiple of flex's 128 blocks nor of any kernel tile


def config(kernel: str, **overrides) -> EncoderConfig:
    base = dict(vocab_size=61, hidden_size=24, num_layers=2, num_heads=HEADS, intermediate_size=48,
                max_position_embeddings=64, position_encoding="t5_relative", relative_buckets=8,
                relative_max_distance=20, dropout=0.0, attention_dropout=0.0, initializer_range=0.3,
                attention_kernel=kernel)
    return EncoderConfig(**{**base, **overrides})


@pytest.fixture
def eager_flex(monkeypatch):
    """flex_attention uncompiled, with its CPU no-backward check lifted (see the module docstring)."""
    monkeypatch.setattr(encoder_module, "compiled_flex_attention", lambda: flex_module.flex_attention)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)


def masks(kind: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(attention_mask, segment_ids) [2, LENGTH]: right padding, or packed documents ending in padding."""
    if kind == "padding":
        attention_mask = torch.ones(2, LENGTH, dtype=torch.long)
        attention_mask[1, 29:] = 0
        return attention_mask, None
    segment_ids = torch.zeros(2, LENGTH, dtype=torch.long)
    segment_ids[0, :11], segment_ids[0, 11:30], segment_ids[0, 30:] = 1, 2, 3
    segment_ids[1, :20], segment_ids[1, 20:33] = 1, 2  # then 4 padding tokens (segment 0)
    return None, segment_ids


@pytest.mark.parametrize("kind", ["padding", "packed"])
def test_flex_attention_matches_sdpa_in_float64(eager_flex, kind: str) -> None:
    """One attention call: same output, and same gradients of q, k, v and of the relative-bias table
    (through the [1, heads, L, L] bias it gathers), to float64 rounding."""
    attention_mask, segment_ids = masks(kind)
    key_mask = (attention_mask.bool()[:, None, None, :] if segment_ids is None else segment_mask(segment_ids))
    encoder = Encoder(config("flex")).double()
    table = encoder.relative_bias.relative_attention_bias.weight
    with torch.no_grad():
        table.normal_(0, 2.0)  # large, so that a misplaced bias entry moves the result
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, HEADS, LENGTH, 8, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    readout = torch.randn(2, HEADS, LENGTH, 8, generator=g, dtype=torch.float64)
    results = []
    for flex in (True, False):
        bias = encoder.relative_bias(LENGTH)
        out = (flex_relative_attention(q, k, v, flex_block_mask(key_mask), bias) if flex
               else attention(q, k, v, attention_bias(key_mask, bias, torch.float64), 0.0, False))
        grads = torch.autograd.grad((out * readout).sum(), (q, k, v, table))
        results.append((out.detach(), grads))
    (out_flex, grads_flex), (out_sdpa, grads_sdpa) = results
    torch.testing.assert_close(out_flex, out_sdpa, rtol=0, atol=1e-13)
    for name, a, b in zip(("q", "k", "v", "table"), grads_flex, grads_sdpa):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)
    assert grads_sdpa[3].abs().max() > 1e-1  # the table trains: a bias lost on the way would show


@pytest.mark.parametrize("kind", ["padding", "packed"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_encoder_on_flex_matches_sdpa_and_per_layer_masks(eager_flex, kind: str, checkpointing: bool) -> None:
    """A training step of a whole encoder (float64): flex (the BlockMask built once in `Encoder.forward`,
    or per layer from the tensor mask as pipeline stages pass it) against SDPA, outputs and every
    parameter gradient, with and without activation checkpointing. Under checkpointing the bias table is
    frozen: torch 2.13's eager (CPU) flex backward returns uninitialised memory as the gradient of a
    captured tensor when checkpointing recomputes it, which the compiled CUDA kernel does not share."""
    attention_mask, segment_ids = masks(kind)
    input_ids = torch.randint(1, 61, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    readout = torch.randn(2, LENGTH, 24, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.manual_seed(0)
    reference = Encoder(config("sdpa")).double()
    with torch.no_grad():
        reference.relative_bias.relative_attention_bias.weight.normal_(0, 2.0)
    results = {}
    for path in ("sdpa", "flex", "flex per layer"):
        encoder = Encoder(config(path.split()[0], activation_checkpointing=checkpointing)).double().train()
        encoder.load_state_dict(reference.state_dict())
        encoder.relative_bias.relative_attention_bias.weight.requires_grad_(not checkpointing)
        if path == "flex per layer":
            out, key_mask, position_bias = encoder.prepare(input_ids, attention_mask, segment_ids=segment_ids)
            for layer in encoder.layers:
                out = run_layer(layer, out, key_mask, position_bias, checkpointing)
        else:
            out = encoder(input_ids, attention_mask, segment_ids=segment_ids)
        (out * readout).sum().backward()
        results[path] = out.detach(), {n: p.grad for n, p in encoder.named_parameters() if p.requires_grad}
    out_sdpa, grads_sdpa = results["sdpa"]
    assert checkpointing or grads_sdpa["relative_bias.relative_attention_bias.weight"].abs().max() > 1e-1
    for path in ("flex", "flex per layer"):
        out, grads = results[path]
        torch.testing.assert_close(out, out_sdpa, rtol=0, atol=1e-12, msg=path)
        assert grads.keys() == grads_sdpa.keys()
        for name, grad in grads_sdpa.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-11, msg=f"{path}: {name}")


def test_auto_picks_flex_only_where_it_compiles_and_attention_dropout_is_off() -> None:
    relative, absolute = config("auto", attention_dropout=0.1), config("auto", position_encoding="absolute")
    assert attention_kernel(relative, training=False, flex_compiles=True) == "flex"
    assert attention_kernel(relative, training=True, flex_compiles=True) == "triton"  # flex has no dropout
    assert attention_kernel(relative, training=True, flex_compiles=False) == "sdpa"
    assert attention_kernel(config("triton"), training=False, flex_compiles=False) == "triton"
    assert attention_kernel(config("auto"), training=True, flex_compiles=True) == "flex"
    assert attention_kernel(relative, training=False, flex_compiles=False) == "sdpa"  # CPU, or no Triton
    assert attention_kernel(absolute, training=False, flex_compiles=True) == "sdpa"
    assert attention_kernel(config("flex"), training=True, flex_compiles=False) == "flex"
    assert attention_kernel(config("sdpa"), training=False, flex_compiles=True) == "sdpa"
    assert not encoder_module.runs_flex(relative, torch.zeros(1), training=False)  # this CPU machine


@pytest.mark.parametrize("kind,dropout", [("padding", 0.0), ("packed", 0.2)])
def test_encoder_on_triton_matches_sdpa_in_float64(kind: str, dropout: float, monkeypatch) -> None:
    """A training step of a 2-layer encoder (float64) on megakd's Triton kernel (under the interpreter) against
    SDPA: outputs and every parameter gradient, the relative table's included. With attention dropout the SDPA
    path (dropout.py's CPU attention) is handed the kernel's keep mask for each layer's seed, so both drop the
    same probabilities. One 64 x 64 tile per (batch, head): tests/kernels/test_attention.py covers the tiling,
    and the interpreter runs a program per tile (its default 16 x 8 tiles make this test 4x slower)."""
    from megakd.kernels import attention as kernel_attention
    from megakd.kernels import attention_parts, attention_triton
    from megakd.kernels.launch import LaunchConfig

    from megakd.models import dropout as dropout_module

    monkeypatch.setattr(attention_triton, "INTERPRETER_CONFIG", LaunchConfig.of(BLOCK_M=64, BLOCK_N=64))

    drawn: list[int] = []

    def layer_seed() -> int:
        """11, then 22: one per layer, in order, on both paths."""
        drawn.append(11 * (len(drawn) + 1))
        return drawn[-1]

    def kernel_keep_mask(shape, p):
        return (kernel_attention.attention_keep_mask(layer_seed(), p, *shape[:3]),
                attention_parts.dropout_threshold(p)[1])

    monkeypatch.setattr(kernel_attention, "draw_seed", layer_seed)
    monkeypatch.setattr(dropout_module, "keep_mask", kernel_keep_mask)
    attention_mask, segment_ids = masks(kind)
    input_ids = torch.randint(1, 61, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    readout = torch.randn(2, LENGTH, 24, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    torch.manual_seed(0)
    reference = Encoder(config("sdpa", attention_dropout=dropout)).double()
    with torch.no_grad():
        reference.relative_bias.relative_attention_bias.weight.normal_(0, 2.0)
    results = {}
    for path in ("sdpa", "triton"):
        drawn.clear()
        encoder = Encoder(config(path, attention_dropout=dropout)).double().train()
        encoder.load_state_dict(reference.state_dict())
        out = encoder(input_ids, attention_mask, segment_ids=segment_ids)
        (out * readout).sum().backward()
        results[path] = out.detach(), {n: p.grad for n, p in encoder.named_parameters()}
        assert len(drawn) == (2 if dropout else 0)  # each layer drew its mask once
    (out_sdpa, grads_sdpa), (out_triton, grads_triton) = results["sdpa"], results["triton"]
    assert grads_sdpa["relative_bias.relative_attention_bias.weight"].abs().max() > 1e-1
    torch.testing.assert_close(out_triton, out_sdpa, rtol=0, atol=1e-12)
    assert grads_triton.keys() == grads_sdpa.keys()
    for name, grad in grads_sdpa.items():
        torch.testing.assert_close(grads_triton[name], grad, rtol=0, atol=1e-11, msg=name)


def test_triton_dropout_masks_survive_checkpointing(monkeypatch) -> None:
    """Activation checkpointing recomputes each layer in backward: the kernel's dropout key comes from torch's
    CPU generator, whose state checkpointing restores, so the recomputed forward drops the same probabilities and
    the step is bitwise the one without checkpointing; and another generator state drops others."""
    from megakd.kernels import attention_triton
    from megakd.kernels.launch import LaunchConfig

    monkeypatch.setattr(attention_triton, "INTERPRETER_CONFIG", LaunchConfig.of(BLOCK_M=64, BLOCK_N=64))
    attention_mask, _ = masks("padding")
    input_ids = torch.randint(1, 61, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = Encoder(config("triton", attention_dropout=0.3)).double()
    results = []
    for checkpointing, seed in ((False, 5), (True, 5), (False, 6)):
        encoder = Encoder(config("triton", attention_dropout=0.3, activation_checkpointing=checkpointing)).double()
        encoder.load_state_dict(reference.state_dict())
        torch.manual_seed(seed)
        out = encoder.train()(input_ids, attention_mask)
        out.sum().backward()
        results.append((out.detach(), [p.grad for p in encoder.parameters()]))
    (out, grads), (out_checkpointed, grads_checkpointed), (out_other, _) = results
    assert torch.equal(out, out_checkpointed)
    assert all(torch.equal(a, b) for a, b in zip(grads, grads_checkpointed))
    assert (out - out_other).abs().max() > 1e-2


@pytest.mark.slow  # compiles flex_attention for CPU: ~6 s of inductor on one core
def test_compiled_flex_forward_on_cpu_matches_sdpa() -> None:
    """The real compiled kernel (forward only on CPU in torch 2.13), float32, packed documents."""
    _, segment_ids = masks("packed")
    input_ids = torch.randint(1, 61, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    reference = Encoder(config("sdpa"))
    outs = []
    for kernel in ("flex", "sdpa"):
        encoder = Encoder(config(kernel)).eval()
        encoder.load_state_dict(reference.state_dict())
        with torch.no_grad():
            outs.append(encoder(input_ids, segment_ids=segment_ids))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-5)


@pytest.mark.slow  # compiles flex_attention's forward and backward kernels
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention's compiled backward needs CUDA")
@pytest.mark.parametrize("length", [512, 200])  # 200: a last block of 72, past which the kernels index
@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_flex_on_cuda_matches_sdpa(length: int, checkpointing: bool) -> None:
    """The real kernels: a float32 training step with packed documents and padding, `auto` (flex on CUDA,
    attention dropout off) against SDPA, in the output and every gradient, the bias table's included."""
    segment_ids = torch.zeros(2, length, dtype=torch.long)
    segment_ids[0, :length // 3], segment_ids[0, length // 3:length - 5], segment_ids[1, :length - 17] = 1, 2, 1
    input_ids = torch.randint(1, 61, (2, length), generator=torch.Generator().manual_seed(1))
    readout = torch.randn(2, length, 24, generator=torch.Generator().manual_seed(2))
    reference = Encoder(config("sdpa"))
    results = []
    for kernel in ("auto", "sdpa"):
        encoder = Encoder(config(kernel, activation_checkpointing=checkpointing)).cuda().train()
        encoder.load_state_dict(reference.state_dict())
        assert encoder_module.runs_flex(encoder.config, readout.cuda(), training=True) == (kernel == "auto")
        out = encoder(input_ids.cuda(), segment_ids=segment_ids.cuda())
        (out * readout.cuda()).sum().backward()
        results.append((out.detach(), {n: p.grad for n, p in encoder.named_parameters()}))
    (out_flex, grads_flex), (out_sdpa, grads_sdpa) = results
    torch.testing.assert_close(out_flex, out_sdpa, rtol=1e-3, atol=1e-4)
    for name, grad in grads_sdpa.items():
        torch.testing.assert_close(grads_flex[name], grad, rtol=1e-3, atol=1e-4, msg=name)
