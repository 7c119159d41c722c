import numpy as np
import pytest
import torch

from megakd.data.masking import collate, mlm_mask, num_to_mask

SPECIALS = (0, 1, 2, 3, 4)


def random_samples(rng, n, vocab=600):
    out = []
    for _ in range(n):
        body = rng.integers(5, vocab, size=int(rng.integers(1, 70)))
        body[rng.random(len(body)) < 0.05] = 3  # a few [UNK]s, which must never be masked
        out.append(np.concatenate([[1], body, [2]]).astype(np.uint16))
    return out


def make(samples, epochs, indices, seed=0, p=0.15):
    return collate(samples, epochs, indices, pad_id=0, mask_id=4, special_ids=SPECIALS, seed=seed, mask_prob=p)


def test_exact_count_and_never_specials():
    rng = np.random.default_rng(0)
    samples = random_samples(rng, 200)
    b = make(samples, [0] * 200, range(200))
    for s, m, ids in zip(samples, b["mlm_mask"], b["input_ids"]):
        maskable = int((s > 4).sum())
        assert int(m.sum()) == num_to_mask(np.array([maskable]), 0.15)[0]
        assert int(m.sum()) == (max(1, int(np.floor(0.15 * maskable + 0.5))) if maskable else 0)
        assert not torch.isin(ids[m], torch.tensor(SPECIALS)).any()
        assert not m[len(s):].any()


def test_counts_at_the_edges():
    assert num_to_mask(np.array([0, 1, 2, 3, 10, 126, 510]), 0.15).tolist() == [0, 1, 1, 1, 2, 19, 77]
    assert num_to_mask(np.array([10]), 0.0).tolist() == [1]  # "at least one" wins, as specified
    assert num_to_mask(np.array([10]), 1.0).tolist() == [10]


def test_pure_function_of_seed_epoch_index():
    rng = np.random.default_rng(1)
    samples = random_samples(rng, 16)
    a = make(samples, [2] * 16, range(100, 116), seed=7)
    # Same samples in another order, inside other company, with other padding: same masks.
    perm = rng.permutation(16)
    extra = random_samples(rng, 1)
    extra[0] = np.concatenate([[1], np.full(90, 9), [2]]).astype(np.uint16)  # longer: more padding
    b = make([samples[i] for i in perm] + extra, [2] * 16 + [0], [100 + i for i in perm] + [999], seed=7)
    for row, i in enumerate(perm):
        n = len(samples[i])
        assert torch.equal(b["mlm_mask"][row, :n], a["mlm_mask"][i, :n])
    assert not torch.equal(make(samples, [3] * 16, range(100, 116), seed=7)["mlm_mask"], a["mlm_mask"])
    assert not torch.equal(make(samples, [2] * 16, range(100, 116), seed=8)["mlm_mask"], a["mlm_mask"])


def test_positions_are_uniform():
    # Over many epochs each of the 40 maskable positions of one sample is masked ~15% of the time.
    ids = np.concatenate([[1], np.arange(10, 50), [2]])[None, :].repeat(4000, 0)
    attn = np.ones_like(ids, dtype=bool)
    m = mlm_mask(ids, attn, np.arange(4000), np.full(4000, 17), seed=0, mask_prob=0.15, special_ids=SPECIALS)
    freq = m[:, 1:-1].mean(0)
    assert m.sum(1).tolist() == [6] * 4000 and not m[:, [0, -1]].any()
    assert freq.min() > 0.15 - 0.03 and freq.max() < 0.15 + 0.03


@pytest.mark.parametrize("p", [0.0, 0.3])
def test_mask_prob_is_honoured(p):
    rng = np.random.default_rng(2)
    b = make(random_samples(rng, 50), [0] * 50, range(50), p=p)
    maskable = (b["input_ids"] > 4).sum(1).numpy()
    assert b["mlm_mask"].sum(1).numpy().tolist() == num_to_mask(maskable, p).tolist()
