"""What a reader fetches: its positions, the ranged-read planner, the block order and the index cache."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import numpy as np
import pytest

from megakd.data.loader import PretrainingLoader
from megakd.data.masking import Masking
from megakd.data.order import ReadPlan, in_group_order
from megakd.data.shard_reader import coalesce
from megakd.data.shards import read_manifest, write_shards
from megakd.data.storage import ContentCache

from .conftest import corpus_docs, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


def plan(rank: int, world: int, micro_batch: int) -> ReadPlan:
    return ReadPlan(store=None, indexed=True, entries=(), dtype="uint16", total=1, seed=0, rank=rank,
                    world_size=world, micro_batch_size=micro_batch, masking=Masking(0, 0, (), 0.15),
                    shuffle_shards=1, skip_bad_shards=False, known_bad=frozenset(), vocab_size=1, seq_len=1,
                    verify=True, overfetch=0.0, read_block=1, index_cache=None)


@pytest.mark.parametrize(("rank", "world", "micro_batch", "every", "start"),
                         [(0, 1, 4, 1, 0), (1, 3, 5, 2, 3), (2, 3, 7, 3, 8), (0, 2, 1, 4, 1)])
def test_reader_positions_are_exactly_its_batches_in_the_range(rank, world, micro_batch, every, start):
    """Brute force: the positions of batches start, start + every, ... that fall in [lo, hi)."""
    p = plan(rank, world, micro_batch)
    mine = {q for b in range(start, 400, every) for q in p.batch_positions(b)}
    for lo, hi in [(0, 50), (37, 38), (101, 333), (5, 5), (250, 900)]:
        expected = sorted(q for q in mine if lo <= q < hi and q < p.batch_positions(400).start)
        got = p.reader_positions(start, every, lo, min(hi, p.batch_positions(400).start)).tolist()
        assert got == expected, (lo, hi)


def test_coalesce_reads_through_the_smallest_gaps_within_the_budget():
    starts = np.array([0, 10, 30, 31, 100, 104])
    ends = np.array([10, 20, 31, 40, 101, 110])  # wanted: 10 + 10 + 1 + 9 + 1 + 6 = 37 bytes
    assert coalesce(starts, ends) == [(0, 20), (30, 40), (100, 101), (104, 110)]  # touching ranges only
    # Gaps 10, 60, 3: 0.1 x 37 = 3.7 bytes read through the 3-byte gap, 0.4 x 37 = 14.8 also the 10-byte
    # one; 0.3 x 37 = 11.1 cannot add the 10 to the 3 already spent.
    assert coalesce(starts, ends, 0.1) == coalesce(starts, ends, 0.3) == [(0, 20), (30, 40), (100, 110)]
    assert coalesce(starts, ends, 0.4) == [(0, 40), (100, 110)]
    assert coalesce(starts, ends, 10.0) == [(0, 110)]
    rng = np.random.default_rng(0)
    for _ in range(50):
        sizes = rng.integers(1, 50, 40)
        keep = rng.random(40) < 0.4
        ends_all = np.cumsum(sizes)
        s, e = (ends_all - sizes)[keep], ends_all[keep]
        for budget in (0.0, 0.2, 1.0):
            ranges = coalesce(s, e, budget)
            read = sum(b - a for a, b in ranges)
            assert read <= (1 + budget) * int((e - s).sum()) + 1e-9
            assert all(any(a <= x and y <= b for a, b in ranges) for x, y in zip(s.tolist(), e.tolist()))


def test_block_order_keeps_runs_of_a_shard_together():
    counts = np.array([10, 7, 13])
    assert in_group_order(counts, 5, 2, 1, 1).tolist() == np.random.default_rng([5, 2, 1, 1]).permutation(30).tolist()
    order = in_group_order(counts, 5, 2, 1, 4)
    assert sorted(order.tolist()) == list(range(30))
    ends = np.cumsum(counts)
    # Cut the order where it jumps: every piece is a run of at most 4 consecutive samples of one shard,
    # starting at a multiple of 4 from its shard's start.
    pieces, current = [], [int(order[0])]
    for j in order[1:].tolist():
        if j == current[-1] + 1 and np.searchsorted(ends, j, "right") == np.searchsorted(ends, current[0], "right") \
                and len(current) < 4:
            current.append(j)
        else:
            pieces.append(current)
            current = [j]
    pieces.append(current)
    for piece in pieces:
        shard = int(np.searchsorted(ends, piece[0], "right"))
        assert (piece[0] - (ends[shard] - counts[shard])) % 4 == 0
    assert len(pieces) == sum(-(-c // 4) for c in counts)  # 3 + 2 + 4 runs


def test_a_rank_fetches_about_its_share(tokenizer, tmp_path):
    """2 ranks x 2 workers over one epoch: each rank's fetched bytes (members and indexes) are at most
    1.2 x its share of the shards' bytes plus each worker's indexes (the whole-shard reader: 2 x the corpus)."""
    src = write_jsonl(tmp_path / "c.jsonl", corpus_docs(4, 12))
    shards = tmp_path / "shards"
    write_shards([src], tokenizer, 64, shards, samples_per_shard=40)
    m = read_manifest(shards)
    corpus = sum(e["bytes"] for e in m["shards"])
    index = sum(e["index"]["bytes"] for e in m["shards"])
    for rank in range(2):
        loader = PretrainingLoader(shards, tokenizer, micro_batch_size=4, rank=rank, world_size=2, num_workers=2,
                                   seed=1, shuffle_shards=4)
        for _ in loader:
            if loader.position >= loader.num_samples:
                break
        assert loader.read_bytes <= 1.2 * corpus / 2 + 2 * index
        assert loader.read_bytes >= 0.4 * corpus  # it did read its samples


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_index_cache_fetches_once_for_racing_readers(tmp_path):
    data = os.urandom(1000)
    calls = []

    def fetch():
        calls.append(1)
        time.sleep(0.2)
        return data

    cache = ContentCache(tmp_path / "c")
    results = [None] * 6
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, cache.get(digest(data), fetch)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [data] * 6 and len(calls) == 1
    assert cache.get(digest(data), fetch) == data and len(calls) == 1  # later readers: from disk


def test_an_object_published_while_a_reader_took_the_lock_is_not_fetched_again(tmp_path, monkeypatch):
    """Reader B looks, finds nothing, and before B takes the lock reader A publishes the object and lets
    its lock go: B reads A's file instead of fetching the same bytes again (the rank's DataLoader
    workers read ahead the same group within milliseconds of each other)."""
    data = b"a shared read"
    cache = ContentCache(tmp_path / "c")
    looked = ContentCache._valid

    def look_then_a_publishes(self, path, valid):
        found = looked(self, path, valid)
        if found is None and not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)  # A's fetch ends now, between B's look and B's lock
        return found

    monkeypatch.setattr(ContentCache, "_valid", look_then_a_publishes)
    fetched = []
    assert cache.get(digest(data), lambda: fetched.append(1) or data) == data
    assert fetched == [] and not (tmp_path / "c" / f"{digest(data)}.lock").exists()


def test_index_cache_never_trusts_a_planted_or_damaged_file(tmp_path):
    data = b"the real index bytes"
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / digest(data)).write_bytes(b"planted bytes, not the index")
    cache = ContentCache(tmp_path / "c")
    assert cache.get(digest(data), lambda: data) == data
    assert (tmp_path / "c" / digest(data)).read_bytes() == data  # replaced by the verified bytes
    wrong = b"what a tampered store answers"
    assert cache.get(digest(b"other"), lambda: wrong) == wrong  # handed back for the caller to refuse
    assert not (tmp_path / "c" / digest(b"other")).exists()  # but never kept


def test_index_cache_breaks_a_dead_fetchers_lock_and_survives_a_read_only_dir(tmp_path):
    data = b"index"
    root = tmp_path / "c"
    root.mkdir()
    lock = root / f"{digest(data)}.lock"
    lock.touch()
    os.utime(lock, (time.time() - 120, time.time() - 120))
    assert ContentCache(root, wait_s=60).get(digest(data), lambda: data) == data
    assert not lock.exists() and (root / digest(data)).read_bytes() == data
    unusable = tmp_path / "a-file"  # a cache path that cannot be a directory (read-only mounts fail alike)
    unusable.write_text("not a directory")
    assert ContentCache(unusable).get(digest(data), lambda: data) == data


def test_a_released_lock_sends_its_waiters_to_fetch_at_once(tmp_path):
    """A reader that abandons a fetch in flight (a DataLoader worker ending) releases its lock. The
    readers waiting for the object then fetch it themselves, instead of waiting for the lock to go
    stale (``wait_s``), which the rank's last workers paid in full when a pass ended. The waiter's
    ``wait_s`` is an hour, so only the release can end its wait within the join's minute: no timing."""
    data = b"a shared read"
    abandoned, hung = ContentCache(tmp_path / "c", wait_s=3600), threading.Event()
    fetcher = threading.Thread(target=abandoned.get, args=(digest(data), lambda: (hung.wait(), b"")[1]), daemon=True)
    fetcher.start()
    try:
        lock = tmp_path / "c" / f"{digest(data)}.lock"
        deadline = time.monotonic() + 60
        while not lock.exists():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        got = []
        waiter = threading.Thread(target=lambda: got.append(ContentCache(tmp_path / "c", wait_s=3600).get(
            digest(data), lambda: data)), daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # waiting for the fetch in flight, as it should
        abandoned.release()
        waiter.join(60)
        assert not waiter.is_alive() and got == [data]  # not after wait_s
        assert (tmp_path / "c" / digest(data)).read_bytes() == data and not lock.exists()
    finally:
        hung.set()  # the abandoned fetch ends (with nothing): it must not remove what is there now
    fetcher.join(60)
    assert not fetcher.is_alive()
    assert (tmp_path / "c" / digest(data)).read_bytes() == data
