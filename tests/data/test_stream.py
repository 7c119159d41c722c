import contextlib
import gc
import itertools
import json
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from megakd.config import DataConfig
from megakd.data.loader import PretrainingLoader
from megakd.data.shards import read_manifest
from megakd.data.storage import ShardStore
from megakd.data.workers import ReadBatch, init_worker
from megakd.errors import UserError

from .test_shards import all_samples

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

KEYS = ("input_ids", "attention_mask", "masked_input_ids", "mlm_mask", "mlm_positions", "index", "epoch")


def take(loader, n):
    return list(itertools.islice(iter(loader), n))


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys() == set(KEYS)
        for k in KEYS:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


def epoch0_of_rank(shards, tokenizer, rank, world, workers, mbs):
    """All epoch-0 samples this rank yields, read until every slot has finished epoch 0."""
    loader = PretrainingLoader(shards, tokenizer, micro_batch_size=mbs, rank=rank, world_size=world,
                               num_workers=workers, seed=3)
    seen = {}
    for batch in loader:
        for i, e, ids, attn in zip(batch["index"], batch["epoch"], batch["input_ids"], batch["attention_mask"]):
            if e == 0:
                assert int(i) not in seen, f"sample {int(i)} twice in epoch 0"
                seen[int(i)] = ids[attn].numpy()
        if loader.position >= loader.num_samples:  # every later batch of this rank starts in epoch 1
            return seen


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("workers", [0, 1, 2, 3])
def test_every_sample_exactly_once_per_epoch(small_shards, tokenizer, world, workers):
    m = read_manifest(small_shards)
    n = m["num_samples"]  # 395 samples in 11 shards: most slot counts divide neither
    stored = all_samples(small_shards)
    union = {}
    for rank in range(world):
        part = epoch0_of_rank(small_shards, tokenizer, rank, world, workers, mbs=7)
        assert not union.keys() & part.keys(), "two ranks share a sample"
        union.update(part)
    assert sorted(union) == list(range(n))
    for i, ids in union.items():
        assert np.array_equal(ids, stored[i].astype(np.int64)), f"sample {i} content differs from shard"


def test_order_is_shuffled_and_changes_per_epoch(small_shards, tokenizer):
    loader = PretrainingLoader(small_shards, tokenizer, micro_batch_size=5, seed=1)
    n = loader.num_samples
    idx = torch.cat([b["index"] for b in take(loader, 2 * n // 5 + 1)])[: 2 * n]
    e0, e1 = idx[:n].tolist(), idx[n:].tolist()
    assert sorted(e0) == sorted(e1) == list(range(n))
    assert e0 != e1 and e0 != sorted(e0)
    other_seed = PretrainingLoader(small_shards, tokenizer, micro_batch_size=5, seed=2)
    assert torch.cat([b["index"] for b in take(other_seed, 4)]).tolist() != idx[:20].tolist()


@pytest.mark.parametrize("group", [1, 3, 16])
def test_shuffle_shards_interleaves_exactly_the_groups_shards(small_shards, tokenizer, group):
    """Epoch order = the seeded shard permutation cut into groups of `shuffle_shards`, each group's
    samples in one permutation: position ranges hold exactly their group's samples, and a batch
    mixes shards whenever a group has more than one."""
    from megakd.data.order import epoch_shard_order

    m = read_manifest(small_shards)
    counts = [e["samples"] for e in m["shards"]]
    shard_of = {e["first_index"] + j: k for k, e in enumerate(m["shards"]) for j in range(e["samples"])}
    loader = PretrainingLoader(small_shards, tokenizer, micro_batch_size=5, seed=1, shuffle_shards=group)
    n = loader.num_samples
    idx = torch.cat([b["index"] for b in take(loader, n // 5 + 1)])[:n].tolist()
    assert sorted(idx) == list(range(n))
    order = epoch_shard_order(len(counts), 1, 0).tolist()
    start = 0
    for g in range(0, len(order), group):
        shards = order[g:g + group]
        end = start + sum(counts[k] for k in shards)
        assert {shard_of[i] for i in idx[start:end]} == set(shards)
        start = end
    mixed = [len({shard_of[i] for i in idx[b:b + 5]}) > 1 for b in range(0, counts[order[0]] - 5, 5)]
    assert all(not x for x in mixed) if group == 1 else any(mixed)


def test_batch_format(small_shards, tokenizer):
    b = take(PretrainingLoader(small_shards, tokenizer, micro_batch_size=6), 1)[0]
    assert b["input_ids"].dtype == b["masked_input_ids"].dtype == b["index"].dtype == torch.int64
    assert b["attention_mask"].dtype == b["mlm_mask"].dtype == torch.bool
    lengths = b["attention_mask"].sum(1)
    assert b["input_ids"].shape == (6, int(lengths.max())) and b["input_ids"].shape[1] <= 64
    assert (b["input_ids"][~b["attention_mask"]] == tokenizer.pad_id).all()
    assert torch.equal(b["masked_input_ids"][~b["mlm_mask"]], b["input_ids"][~b["mlm_mask"]])
    assert (b["masked_input_ids"][b["mlm_mask"]] == tokenizer.mask_id).all()


def test_zero_and_one_worker_give_the_same_stream(small_shards, tokenizer):
    a = take(PretrainingLoader(small_shards, tokenizer, micro_batch_size=8, num_workers=0, seed=5), 12)
    b = take(PretrainingLoader(small_shards, tokenizer, micro_batch_size=8, num_workers=1, seed=5), 12)
    assert_same_batches(a, b)


@pytest.mark.parametrize(("world", "workers"), [(1, 0), (1, 2), (2, 2), (3, 1), (2, 3)])
@pytest.mark.parametrize("split", ["mid_epoch", "across_epoch"])
def test_resume_is_exact(small_shards, tokenizer, world, workers, split):
    mbs = 8
    for rank in range(world):
        def make(rank=rank):
            return PretrainingLoader(small_shards, tokenizer, micro_batch_size=mbs, rank=rank, world_size=world,
                                     num_workers=workers, seed=11)

        per_epoch = make().num_samples // (world * mbs)  # batches a rank yields per epoch, about
        first = 5 if split == "mid_epoch" else per_epoch - 2
        then = 4 if split == "mid_epoch" else 7
        reference = take(make(), first + then)
        assert split == "mid_epoch" or reference[-1]["epoch"].max() == 1
        original = make()
        head = take(original, first)
        assert_same_batches(head, reference[:first])
        state = json.loads(json.dumps(original.state_dict()))
        restored = make()
        restored.load_state_dict(state)
        assert_same_batches(take(restored, then), reference[first:])
        # Twice in a row: a resumed loader's own state resumes exactly too.
        again = make()
        again.load_state_dict(restored.state_dict())
        assert_same_batches(take(again, 2), take(original, then + 2)[then:])


def test_masks_do_not_depend_on_layout(small_shards, tokenizer):
    def masks(world, workers):
        out = {}
        for rank in range(world):
            loader = PretrainingLoader(small_shards, tokenizer, micro_batch_size=4, rank=rank, world_size=world,
                                       num_workers=workers, seed=9)
            for b in take(loader, 12):
                for i, e, m, a in zip(b["index"], b["epoch"], b["mlm_mask"], b["attention_mask"]):
                    out[(int(e), int(i))] = m[a]
        return out

    a, b = masks(1, 0), masks(2, 2)
    common = a.keys() & b.keys()
    assert len(common) >= 5
    for key in common:
        assert torch.equal(a[key], b[key])


def _global_stream(small_shards, tokenizer, layout, start_states=None, steps=0, seed=4):
    """(epoch, index) in global order for `steps` steps of a (world, workers, micro) layout.

    Each step every rank yields one micro-batch; the ranks' batches are laid side by side in rank
    order, which is the global order by construction. Returns the sequence and each rank's state.
    """
    world, workers, micro = layout
    loaders = [PretrainingLoader(small_shards, tokenizer, micro_batch_size=micro, rank=r, world_size=world,
                                 num_workers=workers, seed=seed) for r in range(world)]
    if start_states is not None:
        for r, loader in enumerate(loaders):
            # a rank that did not exist takes rank 0's state, as the trainer does
            loader.load_state_dict(json.loads(json.dumps(start_states[min(r, len(start_states) - 1)])))
    iterators = [iter(loader) for loader in loaders]
    seq = []
    for _ in range(steps):
        for it in iterators:
            b = next(it)
            seq += list(zip(b["epoch"].tolist(), b["index"].tolist()))
    return seq, [loader.state_dict() for loader in loaders]


@pytest.mark.parametrize(("before", "after"), [
    ((2, 0, 4), (1, 0, 4)),   # 2 -> 1 processes
    ((1, 0, 4), (2, 0, 4)),   # 1 -> 2 processes
    ((1, 0, 8), (1, 2, 8)),   # 0 -> 2 workers
    ((2, 3, 6), (3, 1, 4)),   # world, workers and micro-batch size at once (global batch 12)
    ((1, 0, 12), (2, 2, 2)),
])
def test_resume_in_another_layout_continues_the_global_order(small_shards, tokenizer, before, after):
    """Across the change nothing is replayed or skipped: every sample once per epoch, in the same order."""
    n = read_manifest(small_shards)["num_samples"]
    grid_before, grid_after = before[0] * before[2], after[0] * after[2]
    step_samples = 12
    steps_before = 20  # mid-epoch 0 (395 samples): 240 consumed
    head, states = _global_stream(small_shards, tokenizer, before, steps=steps_before * step_samples // grid_before)
    total = 2 * n + 2 * step_samples  # into epoch 2, so epochs 0 and 1 are complete
    tail, _ = _global_stream(small_shards, tokenizer, after, states, steps=-(-(total - len(head)) // grid_after))
    reference, _ = _global_stream(small_shards, tokenizer, (1, 0, step_samples), steps=-(-total // step_samples))
    seq = head + tail
    assert seq[:total] == reference[:total]
    for epoch in (0, 1):
        assert sorted(i for e, i in seq if e == epoch) == list(range(n))


def test_layout_change_off_the_grid_and_seed_change_are_refused(small_shards, tokenizer):
    a = PretrainingLoader(small_shards, tokenizer, micro_batch_size=4, world_size=1)
    take(a, 1)  # position 4
    b = PretrainingLoader(small_shards, tokenizer, micro_batch_size=4, world_size=3, num_workers=2)
    with pytest.raises(ValueError, match="global position 4 .* is not a multiple of world_size=3 x micro_batch_size=4"):
        b.load_state_dict(a.state_dict())
    c = PretrainingLoader(small_shards, tokenizer, micro_batch_size=4, seed=1)
    with pytest.raises(ValueError, match="seed=0 does not match this loader's 1"):
        c.load_state_dict(a.state_dict())


def test_a_loader_from_its_config_section_is_the_one_its_keywords_make(small_shards, tokenizer):
    """`from_config` passes every loader setting of the data section; the run supplies the rest."""
    data = DataConfig(num_workers=2, mask_prob=0.3, shuffle_shards=2, skip_bad_shards=True, read_block=2,
                      read_overfetch=0.5)
    a = PretrainingLoader.from_config(data, ShardStore(small_shards), tokenizer, micro_batch_size=4, seed=7, rank=1,
                                      world_size=2, index_cache="/unused")
    b = PretrainingLoader(small_shards, tokenizer, micro_batch_size=4, seed=7, rank=1, world_size=2, num_workers=2,
                          mask_prob=0.3, shuffle_shards=2, skip_bad_shards=True, read_block=2, read_overfetch=0.5,
                          index_cache="/unused")
    assert {**vars(a.plan), "store": None} == {**vars(b.plan), "store": None}
    assert a.state_dict() == b.state_dict()
    assert_same_batches(take(a, 3), take(b, 3))


class _Cycle:
    """Garbage only the cyclic collector can free."""

    def __init__(self) -> None:
        self.me = self


def _collect_in_worker(init: bool) -> None:
    if init:
        init_worker(0)
    gc.collect()


def test_a_worker_never_finalizes_what_it_inherited(tmp_path):
    """A DataLoader worker is a fork: the parent's uncollected garbage comes with it. Finalized there,
    an fsspec filesystem waits ~1 s on the parent's event loop, in the middle of a read. After
    `init_worker`, a full collection in the worker finalizes nothing it inherited; without it, it
    does (the control arm, so the test can tell the two apart)."""
    def mark(directory: str) -> None:
        Path(directory, str(os.getpid())).touch()

    gc.disable()
    try:
        garbage = _Cycle()
        weakref.finalize(garbage, mark, str(tmp_path))
        del garbage
        finalized = {}
        for init in (False, True):
            worker = multiprocessing.get_context("fork").Process(target=_collect_in_worker, args=(init,))
            worker.start()
            worker.join(60)
            assert worker.exitcode == 0
            finalized[init] = (tmp_path / str(worker.pid)).exists()
    finally:
        gc.enable()
        gc.collect()
    assert finalized == {False: True, True: False}


def test_a_read_batch_crosses_the_worker_boundary_and_pins_its_tensors(monkeypatch):
    """What a worker sends is a plain picklable record; DataLoader's pin_memory passes a dataclass through
    untouched unless it has a `pin_memory` method, which pins the record's tensors (here a stand-in for
    Tensor.pin_memory, which needs an accelerator)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    record = ReadBatch(3, {"input_ids": torch.arange(4)}, (("shard-000001.tar", "missing"),), (1, 2, 3))
    back = pickle.loads(pickle.dumps(record))
    assert (back.batch, back.bad, back.io, back.error) == (3, record.bad, (1, 2, 3), None)
    assert torch.equal(back.tensors["input_ids"], record.tensors["input_ids"])
    assert str(pickle.loads(pickle.dumps(ReadBatch(4, error=UserError("shard x: bad")))).error) == "shard x: bad"
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *args: self + 100)
    pinned = pin_memory(record)
    assert isinstance(pinned, ReadBatch) and pinned.batch == 3 and pinned.io == (1, 2, 3)
    assert pinned.tensors["input_ids"].tolist() == [100, 101, 102, 103]
    empty = ReadBatch(5)
    assert pin_memory(empty) is empty


EXIT_WITH_OPEN_ITERATORS = """
import atexit, sys
ours = []
register = atexit.register
atexit.register = lambda f, *a, **k: (ours.append(f) if (f.__module__ or "").startswith("megakd") else None,
                                      register(f, *a, **k))[1]
from megakd.data.loader import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
assert not ours, ours
loader = PretrainingLoader(sys.argv[1], Tokenizer.load(sys.argv[2]), micro_batch_size=4, num_workers=2)
kept = [iter(loader) for _ in range(2)]  # open at exit: their workers ignore SIGTERM
for batches in kept:
    next(batches)
assert len(ours) == 1, ours
"""


def test_import_registers_nothing_and_open_worker_iterators_do_not_block_exit(small_shards, tokenizer):
    """The exit handler that kills leftover workers is registered by the first loader whose workers
    start (once), not by importing the module; a process that exits with worker iterators open ends,
    and their killed workers are not reported as failures."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(EXIT_WITH_OPEN_ITERATORS), str(small_shards),
                              str(tokenizer.path)], stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = child.communicate(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)  # a hung exit leaves its workers behind too
    assert child.returncode == 0 and "Traceback" not in err, err[-3000:]
