"""The global sample order of pretraining: a pure function of the seed, never of timing or of the world layout.

1. Epoch ``e`` has one global sequence of all N samples: shards in a seeded permutation, cut
   into groups of ``shuffle_shards`` consecutive shards, and inside each group all its samples in
   one seeded permutation (shards are written in input order, so a single shard is a few pages of
   one source; interleaving a group's shards makes every batch a mix). Epochs follow each other,
   so global position ``p`` is sample ``p mod N`` of epoch ``p div N``'s sequence.
2. Micro-batches are consecutive slices of that global sequence, dealt to ranks in turn: a rank's
   ``m``-th micro-batch is positions ``[(m*W + r)*B, (m*W + r + 1)*B)`` for rank ``r`` of ``W``
   with micro-batch size ``B``. An optimizer step of ``A`` accumulation rounds thus consumes the
   consecutive global batch ``[t*G, (t+1)*G)`` (``G = A*W*B``) whatever ``W``, ``B`` and ``A`` are,
   and the same micro-batches in the same order as one process accumulating ``A*W`` of them.
   A batch may straddle an epoch boundary; each sample carries its own ``epoch``.
3. ``num_workers`` only decides who reads: worker ``k`` of ``K`` builds micro-batches
   ``m ≡ k (mod K)`` and the DataLoader hands them out round-robin, i.e. in order
   (:mod:`megakd.data.workers`).

The loader's resume position is a point of this order (:mod:`megakd.data.loader`). Masks are pure
functions of (seed, epoch, index) too (:mod:`megakd.data.masking`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from megakd.data.masking import Masking
from megakd.data.storage import ShardStore


def epoch_shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch, 0]).permutation(num_shards)


def in_group_order(shard_counts: np.ndarray, seed: int, epoch: int, group: int, block: int = 1) -> np.ndarray:
    """The group's samples (numbered through its shards in epoch order) in one seeded permutation.

    ``block`` > 1 permutes runs of ``block`` consecutive samples of a shard (the last run of a shard
    may be shorter) instead of single samples, so a reader's slice of the order is a few contiguous
    byte ranges rather than one range per sample (docs/decisions.md § Reads proportional to the share).
    """
    rng = np.random.default_rng([seed, epoch, 1, group])
    total = int(np.sum(shard_counts))
    if block == 1:
        return rng.permutation(total)
    ends = np.cumsum(shard_counts)
    starts = np.concatenate([np.arange(e - c, e, block)
                             for e, c in zip(ends.tolist(), np.asarray(shard_counts).tolist())])
    lengths = np.minimum(block, np.repeat(ends, -(-np.asarray(shard_counts) // block)) - starts)
    order = rng.permutation(len(starts))
    first, size = starts[order], lengths[order]
    return np.repeat(first - np.cumsum(size) + size, size) + np.arange(total)


@dataclass(frozen=True)
class ReadPlan:
    """Everything a worker needs, small and picklable."""

    store: ShardStore
    indexed: bool  # manifest version 2: ranged reads of this reader's members only
    entries: tuple[dict, ...]  # the manifest's shard entries
    dtype: str
    total: int
    seed: int  # of the order and of the masks
    rank: int
    world_size: int
    micro_batch_size: int
    masking: Masking
    shuffle_shards: int  # shards whose samples are interleaved (one seeded permutation per group)
    skip_bad_shards: bool
    known_bad: frozenset[str]
    vocab_size: int
    seq_len: int
    verify: bool
    overfetch: float  # gap bytes a ranged read may read through, as a fraction of the wanted bytes
    read_block: int  # consecutive samples of a shard kept together in the order (in_group_order)
    index_cache: str | None  # directory of a ContentCache for member indexes (None: fetch them each time)
    shared_reads: str | None = None  # directory of a ContentCache for the rank's workers' shared reads (SharedRead)

    @functools.cached_property
    def files(self) -> tuple[str, ...]:
        return tuple(e["file"] for e in self.entries)

    @functools.cached_property
    def counts(self) -> tuple[int, ...]:
        return tuple(e["samples"] for e in self.entries)

    def batch_positions(self, batch: int) -> range:
        """Global positions of this rank's micro-batch number ``batch``."""
        start = (batch * self.world_size + self.rank) * self.micro_batch_size
        return range(start, start + self.micro_batch_size)

    def reader_positions(self, from_batch: int, every: int, lo: int, hi: int) -> np.ndarray:
        """Global positions in ``[lo, hi)`` of this rank's micro-batches ``from_batch``, ``from_batch + every``, ...

        One DataLoader worker reads every ``every``-th batch: this is exactly what it will ask for
        while the order passes through ``[lo, hi)``, so it is all that it fetches there.
        """
        size, stride = self.micro_batch_size, self.world_size * self.micro_batch_size
        first = max(from_batch, (lo - (self.rank + 1) * size) // stride + 1)  # first batch ending after lo
        first += (from_batch - first) % every  # ... that this reader owns
        last = -(-(hi - self.rank * size) // stride) - 1  # last batch starting before hi
        if last < first:
            return np.zeros(0, np.int64)
        starts = (np.arange(first, last + 1, every, dtype=np.int64) * self.world_size + self.rank) * size
        positions = (starts[:, None] + np.arange(size, dtype=np.int64)).ravel()
        return positions[(positions >= lo) & (positions < hi)]


@dataclass
class ShardGroup:
    """One shard group of one epoch, as a reader sees it: its shards, their order and what it read."""

    epoch: int
    index: int  # the group's number in its epoch
    shards: np.ndarray  # shard numbers, in epoch order
    shard_ends: np.ndarray  # cumulative sample counts of those shards
    first: int  # the epoch offset of the group's first position
    perm: np.ndarray  # the group's sample order (in_group_order)
    loaded: list = field(default_factory=list)  # per shard: its samples (list or dict by position) or None
    bad: list[tuple[str, str]] = field(default_factory=list)  # shards found bad while reading it
    shared: list[str] = field(default_factory=list)  # its shared reads' cache objects (SharedRead)

    @property
    def key(self) -> tuple[int, int]:
        return self.epoch, self.index


class ReaderOrder:
    """The global order as one reader walks it: the epochs' shard groups, and which of a group's
    samples the reader will be asked for (those of its batches ``at_batch``, ``at_batch + every``, ...)."""

    def __init__(self, plan: ReadPlan, every: int = 1) -> None:
        self.plan = plan
        self.every = every
        self.at_batch = 0  # the batch being built; set by the caller before it asks for positions
        self.counts = np.asarray(plan.counts)
        self._epochs: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}

    def epoch_groups(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """The epoch's shard groups (the seeded shard order cut into ``shuffle_shards``) and their end offsets."""
        if epoch not in self._epochs:
            order = epoch_shard_order(len(self.counts), self.plan.seed, epoch)
            size = self.plan.shuffle_shards
            groups = [order[i:i + size] for i in range(0, len(order), size)]
            self._epochs = {e: v for e, v in self._epochs.items() if e >= epoch - 1}
            self._epochs[epoch] = groups, np.cumsum([self.counts[g].sum() for g in groups])
        return self._epochs[epoch]

    def group_of(self, position: int) -> tuple[int, int]:
        """(epoch, group number) of the group that holds global ``position``."""
        epoch, offset = divmod(position, self.plan.total)
        _, ends = self.epoch_groups(epoch)
        return epoch, int(np.searchsorted(ends, offset, side="right"))

    def group_at(self, epoch: int, index: int) -> ShardGroup:
        """Group ``index`` of ``epoch``, nothing read yet."""
        groups, ends = self.epoch_groups(epoch)
        shards = groups[index]
        shard_ends = np.cumsum(self.counts[shards])
        perm = in_group_order(self.counts[shards], self.plan.seed, epoch, index, self.plan.read_block)
        return ShardGroup(epoch, index, shards, shard_ends, int(ends[index]) - int(shard_ends[-1]), perm)

    def wanted(self, group: ShardGroup, every: int | None = None, from_batch: int | None = None) -> list[np.ndarray]:
        """For each shard of ``group``: the sorted in-shard positions of the samples this reader will
        be asked for in it (from batch ``at_batch`` on); or those of every ``every``-th batch from
        ``from_batch`` on."""
        base = group.epoch * self.plan.total + group.first
        positions = self.plan.reader_positions(self.at_batch if from_batch is None else from_batch,
                                               self.every if every is None else every,
                                               base, base + int(group.shard_ends[-1]))
        j = group.perm[positions - base]
        owner = np.searchsorted(group.shard_ends, j, side="right")
        local = j - (group.shard_ends[owner] - self.counts[group.shards][owner])
        return [np.unique(local[owner == i]) for i in range(len(group.shards))]

    def next_group(self, group: ShardGroup) -> tuple[int, int]:
        """(epoch, group number) of the group after ``group``."""
        groups, _ = self.epoch_groups(group.epoch)
        return (group.epoch, group.index + 1) if group.index + 1 < len(groups) else (group.epoch + 1, 0)
