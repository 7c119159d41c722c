"""Encoder behaviour: T5 buckets, shared relative bias, padding invariance, checkpointing, Admin, init."""

import math

import pytest
import torch
import torch.nn.functional as F

from megakd.models.admin import admin_initialize
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import Encoder, EncoderConfig, relative_position_bucket
from tests.helpers import mlm_logits


def tiny(**overrides) -> EncoderConfig:
    base = dict(vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, intermediate_size=64,
                max_position_embeddings=64, relative_buckets=8, relative_max_distance=20)
    base.update(overrides)
    return EncoderConfig(**base)


def padded_batch(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, vocab, (3, 13), generator=g)
    mask = torch.ones(3, 13, dtype=torch.long)
    mask[1, 9:] = 0
    mask[2, 5:] = 0
    input_ids[mask == 0] = 0
    return input_ids, mask, torch.randint(0, 2, (3, 13), generator=g)


def reference_bucket(relative: int, num_buckets: int, max_distance: int) -> int:
    """T5 bucketing written out scalar by scalar, in Python floats (float64)."""
    half = num_buckets // 2
    offset = half if relative > 0 else 0
    distance = abs(relative)
    max_exact = half // 2
    if distance < max_exact:
        return offset + distance
    far = max_exact + int(math.log(distance / max_exact) / math.log(max_distance / max_exact) * (half - max_exact))
    return offset + min(far, half - 1)


@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (128, 256), (8, 20)])
def test_relative_position_bucket_matches_reference(num_buckets: int, max_distance: int) -> None:
    offsets = torch.arange(-3 * max_distance, 3 * max_distance + 1)
    got = relative_position_bucket(offsets, num_buckets, max_distance).tolist()
    expected = [reference_bucket(r, num_buckets, max_distance) for r in offsets.tolist()]
    assert got == expected
    half = num_buckets // 2
    by_offset = dict(zip(offsets.tolist(), got))
    for d in range(1, 3 * max_distance + 1):
        assert by_offset[d] == by_offset[-d] + half  # sign split: positive offsets in the upper half
        assert by_offset[-d] < half
    assert by_offset[0] == 0
    assert {by_offset[d] for d in range(max_distance, 3 * max_distance + 1)} == {num_buckets - 1}
    assert {by_offset[-d] for d in range(max_distance, 3 * max_distance + 1)} == {half - 1}
    positive = [by_offset[d] for d in range(1, 3 * max_distance + 1)]
    assert positive == sorted(positive)  # monotone in distance
    # Every bucket is used except `half`, which would be offset +0 (zero lives in the lower half).
    assert set(got) == set(range(num_buckets)) - {half}


def test_one_relative_bias_table_shared_by_all_layers() -> None:
    config = tiny(position_encoding="t5_relative")
    encoder = Encoder(config)
    tables = [name for name, p in encoder.named_parameters() if "relative" in name]
    assert tables == ["relative_bias.relative_attention_bias.weight"]
    assert encoder.relative_bias.relative_attention_bias.weight.shape == (8, 4)
    assert encoder.embeddings.position_embeddings is None
    # Every layer receives the same bias tensor object from one computation per forward.
    seen = []
    for layer in encoder.layers:
        layer.register_forward_hook(lambda module, args, out: seen.append(args[2]))
    calls = []
    encoder.relative_bias.register_forward_hook(lambda module, args, out: calls.append(out))
    encoder.eval()(torch.randint(1, 61, (2, 9)))
    assert len(calls) == 1 and len(seen) == 3 and all(b is calls[0] for b in seen)


def test_relative_bias_enters_attention_as_key_minus_query() -> None:
    """One layer's attention against a float64 softmax(QKᵀ/√d + bias[bucket(k−q)] + mask) V."""
    torch.manual_seed(0)
    config = tiny(position_encoding="t5_relative", attention_dropout=0.0)
    encoder = Encoder(config).double().eval()
    with torch.no_grad():
        encoder.relative_bias.relative_attention_bias.weight.normal_(0, 1.0)
    attention = encoder.layers[0].attention
    batch, length, heads, dim = 2, 11, 4, 8
    x = torch.randn(batch, length, 32, dtype=torch.float64)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[1, 7:] = False
    table = encoder.relative_bias.relative_attention_bias.weight
    bias = torch.tensor([[[table[reference_bucket(k - q, 8, 20), h].item() for k in range(length)]
                          for q in range(length)] for h in range(heads)], dtype=torch.float64)

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(batch, length, heads, dim).transpose(1, 2)

    q, k, v = split(attention.query(x)), split(attention.key(x)), split(attention.value(x))
    scores = q @ k.transpose(-1, -2) / math.sqrt(dim) + bias
    scores = scores.masked_fill(~mask[:, None, None, :], -math.inf)
    expected = attention.output((scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, 32))
    with torch.no_grad():
        _, key_mask, position_bias = encoder.prepare(torch.zeros(batch, length, dtype=torch.long), mask)
        got = attention(x, key_mask, position_bias)
    torch.testing.assert_close(got, expected.detach(), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
def test_appended_padding_leaves_real_positions_unchanged(position_encoding: str) -> None:
    torch.manual_seed(0)
    encoder = Encoder(tiny(position_encoding=position_encoding)).eval()
    input_ids, mask, token_types = padded_batch(61)
    extra = 6
    longer_ids = F.pad(input_ids, (0, extra), value=0)
    longer_mask = F.pad(mask, (0, extra), value=0)
    longer_types = F.pad(token_types, (0, extra), value=0)
    with torch.no_grad():
        short = encoder(input_ids, mask, token_types)
        long = encoder(longer_ids, longer_mask, longer_types)
    real = mask.bool()
    torch.testing.assert_close(long[:, :13][real], short[real], atol=1e-5, rtol=1e-5)


def test_inputs_embeds_equals_input_ids() -> None:
    torch.manual_seed(0)
    encoder = Encoder(tiny(embedding_size=16)).eval()
    input_ids, mask, token_types = padded_batch(61)
    with torch.no_grad():
        from_ids = encoder(input_ids, mask, token_types)
        from_embeds = encoder(attention_mask=mask, token_type_ids=token_types, inputs_embeds=encoder.embed(input_ids))
    assert encoder.embed(input_ids).shape == (3, 13, 16)
    torch.testing.assert_close(from_embeds, from_ids, atol=0, rtol=0)


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
def test_activation_checkpointing_gives_identical_loss_and_gradients(position_encoding: str) -> None:
    input_ids, mask, token_types = padded_batch(61)
    target = torch.rand(3, 13)
    results = []
    for recompute in (False, True):
        torch.manual_seed(0)
        model = Discriminator(tiny(position_encoding=position_encoding, activation_checkpointing=recompute))
        model.train()  # dropout on: checkpointing must replay the same random masks
        torch.manual_seed(1)
        logits = model.rtd_logits(model(input_ids, mask, token_types))
        loss = F.binary_cross_entropy_with_logits(logits[mask.bool()], target[mask.bool()])
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss_plain, grads_plain), (loss_ckpt, grads_ckpt) = results
    assert torch.equal(loss_plain, loss_ckpt)
    assert grads_plain.keys() == grads_ckpt.keys()
    for name in grads_plain:
        torch.testing.assert_close(grads_ckpt[name], grads_plain[name], atol=1e-7, rtol=1e-6, msg=name)


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
def test_admin_profiling_sets_omega_from_branch_variances(position_encoding: str) -> None:
    torch.manual_seed(0)
    model = MaskedLM(tiny(init="admin", admin_profile="bert", position_encoding=position_encoding, embedding_size=16))
    encoder = model.encoder
    input_ids, mask, token_types = padded_batch(61)
    omegas = admin_initialize(encoder, input_ids, mask, token_types)
    assert encoder.training  # mode restored

    # Direct computation: replay the initialised model in eval mode, record x_0 and each branch
    # output f_j, and rebuild ω_i = sqrt(Var[x_0] + Σ_{j<i} Var[f_j]) over real tokens in float64.
    records: list[torch.Tensor] = []
    encoder.embeddings.register_forward_hook(lambda m, a, out: records.append(out))
    for layer in encoder.layers:
        layer.attention.register_forward_hook(lambda m, a, out: records.append(out))
        layer.ffn.register_forward_hook(lambda m, a, out: records.append(out))
    encoder.eval()
    with torch.no_grad():
        hidden = encoder(input_ids, mask, token_types)
    real = mask.bool()
    variances = [r[real].double().flatten().var(unbiased=False).item() for r in records]
    expected = [math.sqrt(sum(variances[: i + 1])) for i in range(2 * len(encoder.layers))]
    actual = [p for layer in encoder.layers for p in (layer.attention_omega, layer.ffn_omega)]
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got.double(), torch.full_like(got, want, dtype=torch.float64), rtol=1e-5, atol=0)
    assert omegas == pytest.approx(expected, rel=1e-5)
    assert all(b > a for a, b in zip(expected, expected[1:]))  # ω grows with depth
    assert expected[0] != pytest.approx(1.0, abs=0.05)  # the profiling really changed something
    assert torch.isfinite(hidden).all()
    assert torch.isfinite(mlm_logits(model, input_ids, mask, token_types)).all()


@pytest.mark.parametrize("position_encoding", ["absolute", "t5_relative"])
def test_admin_reference_profile_matches_the_reference_recursion_in_float64(position_encoding: str) -> None:
    """`reference`: Xavier layers, training mode (dropout on), every position; ω_1 = 1 and
    ω_{i+1} = sqrt(Var[ω_i·x_{i−1}] + Var[f_i]), rebuilt here from a replay with the same dropout masks."""
    torch.manual_seed(0)
    config = tiny(init="admin", position_encoding=position_encoding, dropout=0.2, attention_dropout=0.1)
    assert config.admin_profile == "reference"  # the default
    encoder = Encoder(config).double()
    hidden = config.hidden_size
    for layer in encoder.layers:  # Xavier-uniform bounds: q/k/v as one [3H, H] matrix, the others their own
        a, f = layer.attention, layer.ffn
        for linear, bound in ((a.query, math.sqrt(6 / (4 * hidden))), (a.value, math.sqrt(6 / (4 * hidden))),
                              (a.output, math.sqrt(6 / (2 * hidden))),
                              (f.fc_in, math.sqrt(6 / (hidden + config.intermediate_size)))):
            w = linear.weight.detach()
            assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound
            assert w.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.1)
            assert torch.count_nonzero(linear.bias) == 0
    input_ids, mask, token_types = padded_batch(61)
    encoder.eval()  # the profile must switch to training mode by itself
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    omegas = admin_initialize(encoder, input_ids, mask, token_types, seed=123)
    assert not encoder.training
    assert torch.equal(torch.rand(3), before)  # the caller's RNG stream is untouched

    inputs: list[torch.Tensor] = []  # x_{i−1} of every sublayer, then its branch output f_i (after dropout)
    branches: list[torch.Tensor] = []
    for layer in encoder.layers:
        layer.attention.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        layer.ffn.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
        layer.dropout.register_forward_hook(lambda m, a, out: branches.append(out))
    encoder.train()
    torch.manual_seed(123)  # the same dropout masks, drawn in the same order
    with torch.no_grad():
        encoder(input_ids, mask, token_types)
    actual = [p for layer in encoder.layers for p in (layer.attention_omega, layer.ffn_omega)]
    expected, ratio = [], 1.0
    for omega, x, f in zip(actual, inputs, branches):
        expected.append(ratio)
        kept = (omega.detach() * x).flatten()  # padding positions included, as the reference's view(-1)
        ratio = math.sqrt(kept.var(unbiased=False).item() + f.flatten().var(unbiased=False).item())
    assert len(expected) == 2 * config.num_layers and expected[0] == 1.0
    for got, want in zip(actual, expected):
        torch.testing.assert_close(got, torch.full_like(got, want), rtol=1e-12, atol=0)
    assert omegas == pytest.approx(expected, rel=1e-12)
    assert all(b > a for a, b in zip(expected, expected[1:]))

    # the bert profile of the same weights differs (eval mode, real tokens only, Var[x_0] + Σ Var[f])
    bert = Encoder(tiny(init="admin", admin_profile="bert", position_encoding=position_encoding, dropout=0.2,
                        attention_dropout=0.1)).double()
    bert.load_state_dict(encoder.state_dict())
    assert admin_initialize(bert, input_ids, mask, token_types)[-1] != pytest.approx(omegas[-1], rel=1e-3)


def test_admin_profile_is_validated() -> None:
    with pytest.raises(ValueError, match="model.admin_profile"):
        tiny(init="admin", admin_profile="fairseq").validate()


def test_admin_initialize_refuses_normal_init() -> None:
    with pytest.raises(ValueError, match="model.init"):
        admin_initialize(Encoder(tiny()), torch.ones(1, 4, dtype=torch.long))


def test_normal_init_matches_hf_convention() -> None:
    torch.manual_seed(0)
    config = tiny(vocab_size=4000, hidden_size=64, intermediate_size=256, pad_token_id=3)
    encoder = Encoder(config)
    word = encoder.embeddings.word_embeddings.weight
    assert torch.count_nonzero(word[3]) == 0
    assert abs(word.std().item() - 0.02) < 0.001
    assert abs(encoder.layers[0].ffn.fc_in.weight.std().item() - 0.02) < 0.001
    for name, p in encoder.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        if "norm" in name and name.endswith("weight"):
            assert torch.equal(p, torch.ones_like(p)), name
    assert not any("omega" in name for name, _ in encoder.named_parameters())


@pytest.mark.parametrize(
    "overrides,field",
    [
        (dict(hidden_size=30, num_heads=4), "model.hidden_size"),
        (dict(position_encoding="rotary"), "model.position_encoding"),
        (dict(init="xavier"), "model.init"),
        (dict(position_encoding="t5_relative", relative_buckets=7), "model.relative_buckets"),
        (dict(dropout=1.5), "model.dropout"),
        (dict(embedding_size=0), "model.embedding_size"),
        (dict(pad_token_id=61), "model.pad_token_id"),
        (dict(attention_kernel="flash"), "model.attention_kernel"),
        (dict(attention_kernel="flex", attention_dropout=0.1), "model.attention_kernel"),
    ],
)
def test_config_validation_names_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Encoder(tiny(**overrides))


def test_sequence_longer_than_position_table_is_refused() -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        Encoder(tiny(max_position_embeddings=8))(torch.ones(1, 9, dtype=torch.long))


def test_local_relative_init_biases_each_head_by_distance() -> None:
    """relative_init=local: bias(q, k) = −2^−h · (smallest |offset| of the bucket of k − q), per the
    reference bucketing."""
    config = tiny(position_encoding="t5_relative", relative_buckets=16, relative_max_distance=40,
                  relative_init="local")
    bias = Encoder(config).relative_bias(50)[0]  # [heads, L, L]
    nearest: dict[int, int] = {}
    for offset in range(-40, 41):
        b = reference_bucket(offset, 16, 40)
        nearest[b] = min(nearest.get(b, 99), abs(offset))
    for q, k in [(0, 0), (10, 11), (10, 9), (20, 26), (3, 49), (49, 0)]:
        distance = nearest[reference_bucket(k - q, 16, 40)]
        for h in range(config.num_heads):
            assert bias[h, q, k].item() == -distance * 2.0 ** -h
    assert distance == 23  # offset −49 shares the last bucket, whose nearest member is 23 away
    default = Encoder(tiny(position_encoding="t5_relative")).relative_bias.relative_attention_bias.weight
    assert default.std().item() < 0.05  # the default stays HF's N(0, initializer_range)
    with pytest.raises(ValueError, match="model.relative_init"):
        tiny(relative_init="alibi").validate()


@pytest.mark.parametrize("autocast", [False, True])
def test_masked_relative_bias_is_built_once_and_equals_masking_per_layer(autocast: bool) -> None:
    """`Encoder.forward` masks the relative bias once for all layers; each layer masking it itself
    (as pipeline stages do) computes the same: bitwise in the forward (float64, and under bf16
    autocast), to 1e-12 in every gradient (the layers' contributions are summed in another order)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMaskedFills(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten.masked_fill, torch.ops.aten.masked_fill_)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    encoder = Encoder(tiny(position_encoding="t5_relative", dropout=0.1, attention_dropout=0.1))
    encoder = encoder.train() if autocast else encoder.double().train()
    with torch.no_grad():
        encoder.relative_bias.relative_attention_bias.weight.normal_(0, 1.0)
    input_ids, mask, token_types = padded_batch(61)
    readout = torch.randn(3, 13, 32, generator=torch.Generator().manual_seed(2))
    results = []
    for hoisted in (True, False):
        encoder.zero_grad()
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), CountMaskedFills() as fills:
            if hoisted:
                out = encoder(input_ids, mask, token_types)
            else:
                out, key_mask, position_bias = encoder.prepare(input_ids, mask, token_types)
                for layer in encoder.layers:
                    out = layer(out, key_mask, position_bias)
        (out * readout.to(out.dtype)).sum().backward()  # a random readout: LayerNorm'd outputs have unit mean square
        results.append((out.detach(), fills.count, {n: p.grad.clone() for n, p in encoder.named_parameters()}))
    (out_once, fills_once, grads_once), (out_each, fills_each, grads_each) = results
    assert (fills_once, fills_each) == (1, 3)
    assert torch.equal(out_once, out_each)
    if not autocast:
        for name, grad in grads_each.items():
            torch.testing.assert_close(grads_once[name], grad, rtol=0, atol=1e-12, msg=name)
        assert grads_once["relative_bias.relative_attention_bias.weight"].abs().max() > 1e-4
