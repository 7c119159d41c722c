import pytest
import torch
from megakd.kernels import (
    fused_linear_cross_entropy,
    fused_linear_cross_entropy_and_sample,
    fused_linear_cross_entropy_reference,
    fused_linear_kl,
    fused_linear_kl_reference,
    fused_linear_sample,
    fused_linear_sample_reference,
    linear_head,
)
from scipy.stats import chi2

from .helpers import BACKENDS, assert_matches, value_and_grads

# (N, H, V): single row, sizes off the block grid (interpreter blocks are 16 x 32 x 16), exact fits.
SHAPES = [(1, 5, 7), (37, 21, 83), (70, 40, 300), (32, 16, 64)]


@pytest.fixture(params=[None, 500], ids=["one-chunk", "many-chunks"])
def chunk_elems(request, monkeypatch):
    """Run the torch path with its default chunking and with chunks of a few rows."""
    if request.param is not None:
        monkeypatch.setattr(linear_head, "_CHUNK_ELEMS", request.param)


@pytest.fixture(params=["torch", "torch-small-chunks", BACKENDS[1]])
def backend_any(request, monkeypatch):
    """Each backend once, plus the torch path forced to process a few rows per chunk."""
    if request.param == "torch-small-chunks":
        monkeypatch.setattr(linear_head, "_CHUNK_ELEMS", 500)
        return "torch"
    return request.param


def _randn(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("n,h,v", SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("ignore", ["some", "all", "none"])
def test_cross_entropy_matches_reference(backend_any, n, h, v, with_bias, ignore):
    backend = backend_any
    g = torch.Generator().manual_seed(n + h + v)
    hidden, weight = _randn(g, n, h), _randn(g, v, h, scale=0.5)
    bias = _randn(g, v) if with_bias else None
    ignore_index = -1 if ignore == "some" else -100
    target = torch.randint(0, v, (n,), generator=g)
    if ignore == "some":
        target[::3] = ignore_index
    elif ignore == "all":
        target[:] = ignore_index
    ref = value_and_grads(lambda a, b, c: fused_linear_cross_entropy_reference(a, b, c, target, ignore_index),
                          hidden, weight, bias)
    out = value_and_grads(
        lambda a, b, c: fused_linear_cross_entropy(a, b, c, target, ignore_index=ignore_index, backend=backend),
        hidden, weight, bias,
    )
    assert_matches(out, ref)
    if ignore == "all":
        assert out[0].item() == 0.0


@pytest.mark.parametrize("n,h,v", SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 2.5, 0.5])
@pytest.mark.parametrize("biases", ["both", "student", "none"])
def test_kl_matches_reference(backend_any, n, h, v, temperature, biases):
    backend = backend_any
    g = torch.Generator().manual_seed(n * v + h)
    ht = h + 3  # teacher width differs from the student's
    hs, ws = _randn(g, n, h), _randn(g, v, h, scale=0.5)
    t_hidden, t_weight = _randn(g, n, ht), _randn(g, v, ht, scale=0.5)
    bs = _randn(g, v) if biases in ("both", "student") else None
    bt = _randn(g, v) if biases == "both" else None
    ref = value_and_grads(lambda a, b, c: fused_linear_kl_reference(a, b, t_hidden, t_weight, temperature, c, bt),
                          hs, ws, bs)
    out = value_and_grads(
        lambda a, b, c: fused_linear_kl(a, b, t_hidden, t_weight, temperature, c, bt, backend=backend),
        hs, ws, bs,
    )
    assert_matches(out, ref)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kl_is_zero_for_identical_heads_and_teacher_gets_no_grad(backend):
    g = torch.Generator().manual_seed(3)
    h, w = _randn(g, 20, 8), _randn(g, 50, 8)
    th, tw = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
    sh = h.clone().requires_grad_(True)
    loss = fused_linear_kl(sh, w, th, tw, temperature=1.7, backend=backend)
    assert abs(loss.item()) < 1e-12
    (2.0 * loss).backward()
    assert th.grad is None and tw.grad is None
    assert sh.grad.abs().max().item() < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_close_to_float64_reference(backend):
    g = torch.Generator().manual_seed(11)
    hs, ws, bs = _randn(g, 45, 24), _randn(g, 130, 24, scale=0.3), _randn(g, 130)
    th, tw = _randn(g, 45, 20), _randn(g, 130, 20, scale=0.3)
    ref = value_and_grads(lambda a, b, c: fused_linear_kl_reference(a, b, th, tw, 2.0, c), hs, ws, bs)
    out = value_and_grads(
        lambda a, b, c: fused_linear_kl(a, b, th.float(), tw.float(), 2.0, c, backend=backend),
        hs.float(), ws.float(), bs.float(),
    )
    assert out[0].dtype == torch.float32
    assert_matches((out[0].double(), [x.double() for x in out[1]]), ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("temperature", [0.8, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("vocab", [97, 2 * 256 + 37])  # inside one CDF block; over two blocks and a partial one
def test_torch_sampling_is_reproducible_and_equals_reference(chunk_elems, temperature, dtype, vocab):
    g = torch.Generator().manual_seed(5)
    hidden, weight, bias = (t.to(dtype) for t in (_randn(g, 41, 12), _randn(g, vocab, 12), _randn(g, vocab)))
    draws = []
    for seed in (123, 123, 124):
        gen = torch.Generator().manual_seed(seed)
        draws.append(fused_linear_sample(hidden, weight, bias, generator=gen, temperature=temperature,
                                         backend="torch"))
    ref = fused_linear_sample_reference(hidden, weight, bias, torch.Generator().manual_seed(123), temperature)
    assert torch.equal(draws[0][0], draws[1][0])
    assert torch.equal(draws[0][0], ref[0])
    assert not torch.equal(draws[0][0], draws[2][0])
    assert torch.equal(draws[0][1], (hidden @ weight.T + bias).argmax(-1))


@pytest.mark.parametrize("temperature", [2.0, 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("with_bias", [True, False])
def test_cross_entropy_and_sample_equal_the_two_ops(backend_any, temperature, dtype, with_bias):
    """One pass over the logits gives exactly what the loss and the sampler give one after the other:
    the same loss and gradients and the same draws from the same generator state."""
    g = torch.Generator().manual_seed(11)
    n, h, v = 45, 12, 2 * 256 + 37
    hidden, weight = _randn(g, n, h).to(dtype), _randn(g, v, h, scale=0.5).to(dtype)
    bias = _randn(g, v).to(dtype) if with_bias else None
    target = torch.randint(0, v, (n,), generator=g)
    target[::4] = -100
    draws = {}

    def fused(a, b, c):
        loss, *draws["fused"] = fused_linear_cross_entropy_and_sample(
            a, b, c, target, torch.Generator().manual_seed(7), temperature, backend=backend_any)
        return loss

    def separate(a, b, c):
        loss = fused_linear_cross_entropy(a, b, c, target, backend=backend_any)
        draws["separate"] = fused_linear_sample(a, b, c, torch.Generator().manual_seed(7), temperature,
                                                backend=backend_any)
        return loss

    got, want = value_and_grads(fused, hidden, weight, bias), value_and_grads(separate, hidden, weight, bias)
    assert torch.equal(got[0], want[0])
    for g_got, g_want in zip(got[1], want[1]):
        assert (g_got is None and g_want is None) or torch.equal(g_got, g_want)
    assert all(torch.equal(a, b) for a, b in zip(draws["fused"], draws["separate"]))
    assert not any(t.requires_grad for t in draws["fused"])


@pytest.mark.parametrize("backend,rows", [("torch", 20000), pytest.param(*BACKENDS[1].values, 4000,
                                                                          marks=BACKENDS[1].marks)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_sampling_distribution(backend, rows, with_bias, monkeypatch):
    """Many rows with the same logits are independent draws: chi-square against softmax(z / tau). The
    interpreter runs 256-row tiles here: its cost is per program, and the draws do not depend on tiles."""
    from megakd.kernels import linear_head_triton
    from megakd.kernels.launch import LaunchConfig

    monkeypatch.setattr(linear_head_triton, "INTERPRETER_CONFIG", LaunchConfig.of(BLOCK_N=256, BLOCK_V=32, BLOCK_H=16))
    g = torch.Generator().manual_seed(9)
    v, h, tau = 37, 6, 0.7  # 37 = one full 32-wide tile plus a partial one under the interpreter
    weight, bias = _randn(g, v, h, scale=0.4), (_randn(g, v, scale=0.3) if with_bias else None)
    hidden = _randn(g, 1, h).expand(rows, h).contiguous()
    samples, argmax = fused_linear_sample(hidden, weight, bias, torch.Generator().manual_seed(1), tau,
                                          backend=backend)
    logits = hidden[0] @ weight.T + (bias if bias is not None else 0)
    assert torch.equal(argmax, logits.argmax().expand(rows))
    expected = torch.softmax(logits / tau, -1) * rows
    observed = torch.bincount(samples, minlength=v).double()
    stat = ((observed - expected) ** 2 / expected).sum().item()
    # a correct sampler fails this with probability 1e-6
    assert stat < chi2.ppf(1 - 1e-6, df=v - 1), stat


def test_torch_sampling_distribution_over_several_cdf_blocks():
    """Chi-square over 549 tokens (two full 256-wide CDF blocks and a partial one); zero-probability
    tokens, at a block's start and end and in the partial block, are never drawn."""
    g = torch.Generator().manual_seed(3)
    v, rows = 2 * 256 + 37, 60000
    logits = _randn(g, v, scale=0.5).float()
    impossible = torch.tensor([0, 255, 256, 511, 530, v - 1])
    logits[impossible] = -1e4  # exp underflows to exactly 0 in float32
    hidden, weight = torch.ones(rows, 1), logits.unsqueeze(1)  # hidden @ weight.T = logits in every row
    samples, _ = fused_linear_sample(hidden, weight, None, torch.Generator().manual_seed(2), backend="torch")
    observed = torch.bincount(samples, minlength=v).double()
    assert observed[impossible].sum() == 0
    possible = torch.ones(v, dtype=torch.bool)
    possible[impossible] = False
    expected = torch.softmax(logits.double()[possible], -1) * rows
    stat = ((observed[possible] - expected) ** 2 / expected).sum().item()
    assert stat < chi2.ppf(1 - 1e-6, df=int(possible.sum()) - 1), stat


@pytest.mark.parametrize("backend", BACKENDS)
def test_argmax_ties_pick_first_index(backend):
    weight = torch.zeros(70, 4, dtype=torch.float64)
    weight[[5, 40, 69], 0] = 1.0  # three equal maxima, in different interpreter tiles
    hidden = torch.tensor([[2.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    _, argmax = fused_linear_sample(hidden, weight, None, backend=backend)
    assert argmax.tolist() == [5]


def test_bad_input_names_the_argument():
    h, w = torch.randn(4, 3), torch.randn(6, 3)
    with pytest.raises(ValueError, match="weight must be"):
        fused_linear_cross_entropy(h, torch.randn(6, 5), None, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="target values must be in"):
        fused_linear_cross_entropy(h, w, None, torch.full((4,), 6))
    with pytest.raises(ValueError, match="temperature must be a positive number"):
        fused_linear_kl(h, w, h, w, temperature=0.0)
    with pytest.raises(ValueError, match="teacher_weight vocabulary"):
        fused_linear_kl(h, w, h, torch.randn(7, 3))
    with pytest.raises(ValueError, match="student_bias must have shape"):
        fused_linear_kl(h, w, h, w, student_bias=torch.randn(5))


@pytest.mark.parametrize("op", ["ce", "kl"])
def test_torch_path_never_allocates_tokens_by_vocab(op, monkeypatch):
    """The largest allocation of any op stays far below one [N x V] tensor (the naive path makes several)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(linear_head, "_CHUNK_ELEMS", 1 << 14)  # 3 rows per chunk at V = 5000
    g = torch.Generator().manual_seed(0)
    n, h, v = 64, 16, 5000
    hidden, weight = _randn(g, n, h).requires_grad_(True), _randn(g, v, h).requires_grad_(True)
    t_hidden, t_weight, target = _randn(g, n, h), _randn(g, v, h), torch.randint(0, v, (n,), generator=g)
    calls = {
        "ce": (lambda: fused_linear_cross_entropy(hidden, weight, None, target, backend="torch"),
               lambda: fused_linear_cross_entropy_reference(hidden, weight, None, target)),
        "kl": (lambda: fused_linear_kl(hidden, weight, t_hidden, t_weight, 2.0, backend="torch"),
               lambda: fused_linear_kl_reference(hidden, weight, t_hidden, t_weight, 2.0)),
    }[op]
    largest = []
    for call in calls:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            call().backward()
        largest.append(max(e.cpu_memory_usage for e in prof.events()))
    full = n * v * 8
    assert largest[1] >= full  # the profiler does see the naive [N x V] logits
    assert largest[0] < full / 3, largest
