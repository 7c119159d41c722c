"""Streaming pretraining data with an exact, cheap resume that survives a change of layout.

The order is global (:mod:`megakd.data.order`), so the loader's state is one number: the next
micro-batch index, which in layout terms is the global position ``m*W*B``. A resume with the same
layout continues at ``m``; with another world size, micro-batch size or worker count it continues
at position ``m*W*B`` of the same global order (it must fall on the new layout's micro-batch grid,
which holds at every step boundary since ``W*B`` divides the global batch). Nothing is replayed or
skipped, and nothing before the position is read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from megakd.config import DataConfig
from megakd.data.masking import Masking
from megakd.data.order import ReaderOrder, ReadPlan
from megakd.data.shard_reader import ShardError, shard_problem
from megakd.data.shards import MANIFEST, read_manifest
from megakd.data.storage import ShardStore
from megakd.data.tokenizer import Tokenizer
from megakd.data.workers import (
    RankDataset,
    ReadBatch,
    init_worker,
    kill_leftover_workers_at_exit,
    stop_signals_blocked,
)
from megakd.errors import UserError

logger = logging.getLogger(__name__)

STATE_VERSION = 2  # 1 = per-slot cursors of the old contiguous-range layout


class StoppedWaitingForData(BaseException):
    """A stop asked for while the training loop waited for its next batch.

    Raised by the run's signal handler (in-process reads) or by the loader's poll of
    ``PretrainingLoader.stop_waiting`` (DataLoader workers). A ``BaseException`` like
    ``KeyboardInterrupt``: it ends the wait (a fetch, a retry's backoff) and nothing on the way up
    may take it for a storage error.
    """


def _check_arguments(rank: int, world_size: int, micro_batch_size: int, num_workers: int, mask_prob: float,
                     shuffle_shards: int, read_block: int) -> None:
    """The loader arguments that callers pass directly (a command's flags, a tool's, a test's) as well as
    from data.*; read_overfetch comes only from data.read_overfetch, which ``Config.validate`` checked."""
    if not 0 <= rank < world_size:
        raise UserError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size")
    if micro_batch_size < 1 or num_workers < 0 or not 0.0 <= mask_prob <= 1.0 or shuffle_shards < 1 \
            or read_block < 1:
        raise UserError(f"micro_batch_size={micro_batch_size}, num_workers={num_workers}, "
                         f"mask_prob={mask_prob}, shuffle_shards={shuffle_shards}, "
                         f"read_block={read_block}: expected ≥ 1, ≥ 0, in [0, 1], ≥ 1, ≥ 1")


def _bad_local_shards(store: ShardStore, manifest: dict, skip_bad_shards: bool) -> dict[str, str]:
    """Local shards that are missing or of the wrong size, by file (:func:`shard_problem`): skipped
    (logged) with ``skip_bad_shards``, else the first is a :class:`ShardError`. An object store is
    asked nothing before the first read (one request per shard and rank would be a storm at scale):
    a missing or resized object is named when it is read."""
    bad: dict[str, str] = {}
    for entry in [] if store.remote else manifest["shards"]:
        problem = shard_problem(store, entry)
        if problem and not skip_bad_shards:
            raise ShardError(problem)
        if problem:
            logger.warning("skipping bad shard (skip_bad_shards=True): %s", problem)
            bad[entry["file"]] = problem
    return bad


WAIT_POLL_S = 1.0  # how often a loader with workers asks `stop_waiting` while it waits for a batch


class PretrainingLoader:
    """Endless micro-batches for one rank, with ``state_dict``/``load_state_dict`` for exact resume.

    Batch keys: ``input_ids``, ``attention_mask``, ``masked_input_ids``, ``mlm_mask``, ``mlm_positions``, ``index``,
    ``epoch``, and ``segment_ids`` for packed shards (see :func:`megakd.data.masking.collate`).
    The state counts only batches this object has handed out, so DataLoader prefetching never
    leaks into a checkpoint.

    ``shards_dir`` is a local directory, an object-store URL or a :class:`ShardStore`. Every sample
    is verified as it is read (:mod:`megakd.data.shard_reader`; indexed shards: each member against
    its index digest; unindexed ones: the shard's sha256), with its length and
    token ids below ``tokenizer.vocab_size``; ``verify=False`` (unindexed shards only) exists only
    for ``tools/bench_data.py``. ``index_cache``: a directory where member indexes are kept once
    fetched (:class:`ContentCache`; node-local disk shared by the node's ranks and workers).

    A run's training stream comes from its ``data`` section (:meth:`from_config`); the keyword
    arguments are for callers that choose their own (validation, Admin's profiling, ``megakd eval-rtd``,
    tools and tests).
    """

    def __init__(
        self,
        shards_dir: str | Path | ShardStore,
        tokenizer: Tokenizer,
        *,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        mask_prob: float = 0.15,
        check_tokenizer: bool = True,
        skip_bad_shards: bool = False,
        pin_memory: bool = False,
        verify: bool = True,
        shuffle_shards: int = 16,
        read_overfetch: float = 0.2,
        read_block: int = 1,
        index_cache: str | Path | None = None,
    ) -> None:
        self.store = shards_dir if isinstance(shards_dir, ShardStore) else ShardStore(shards_dir)
        manifest = read_manifest(self.store)
        if check_tokenizer and manifest["tokenizer"]["vocab_hash"] != tokenizer.vocab_hash:
            raise UserError(f"{self.store.url(MANIFEST)}: shards were written with tokenizer vocab_hash "
                             f"{manifest['tokenizer']['vocab_hash']}, but tokenizer {tokenizer.path} has "
                             f"{tokenizer.vocab_hash}")
        _check_arguments(rank, world_size, micro_batch_size, num_workers, mask_prob, shuffle_shards, read_block)
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.bad_shards: dict[str, str] = _bad_local_shards(self.store, manifest, skip_bad_shards)
        self.read_retries = 0  # transient storage errors retried so far by this rank's readers
        self.read_bytes = 0  # bytes this rank's readers fetched from storage so far (shards and indexes)
        self.read_requests = 0  # reads they asked of it (an object store charges and waits for each)
        self._fingerprint = hashlib.sha256(
            json.dumps([manifest["shards"], manifest["tokenizer"]], sort_keys=True).encode()).hexdigest()[:16]
        # The rank's workers read from an object store together (SharedRead), through node-local disk.
        shared_reads = Path(index_cache) / "shared-reads" / f"{self._fingerprint}-rank{rank}-of-{world_size}" \
            if index_cache and self.store.remote and manifest["version"] >= 2 and num_workers > 1 else None
        self.plan = ReadPlan(
            store=self.store,
            indexed=manifest["version"] >= 2,
            entries=tuple(manifest["shards"]),
            dtype=manifest["dtype"],
            total=manifest["num_samples"],
            seed=seed,
            rank=rank,
            world_size=world_size,
            micro_batch_size=micro_batch_size,
            masking=Masking(tokenizer.pad_id, tokenizer.mask_id, tuple(sorted(tokenizer.special_ids)), mask_prob,
                            tokenizer.cls_id if manifest.get("packed") else None),
            skip_bad_shards=skip_bad_shards,
            known_bad=frozenset(self.bad_shards),
            vocab_size=tokenizer.vocab_size,
            seq_len=manifest["seq_len"],
            verify=verify,
            shuffle_shards=shuffle_shards,
            overfetch=read_overfetch,
            read_block=read_block,
            index_cache=str(index_cache) if index_cache else None,
            shared_reads=str(shared_reads) if shared_reads else None,
        )
        if read_block > 1 and not manifest.get("shuffled"):
            logger.warning("%s: read_block=%d keeps %d consecutive samples of a shard together, but these shards "
                           "were written in input order (consecutive pieces of one document); write them with "
                           "`megakd data shards --shuffle` for mixed batches", self.store.url(MANIFEST), read_block,
                           read_block)
        self.seq_len: int = manifest["seq_len"]
        self.packed: bool = bool(manifest.get("packed", False))
        self.num_samples: int = manifest["num_samples"]
        self._next_batch = 0  # this rank's next micro-batch number (see the module docstring)
        # Asked every WAIT_POLL_S while DataLoader workers have no batch ready: true ends the wait
        # with StoppedWaitingForData (the training loop's stop flag; None: wait as long as it takes).
        self.stop_waiting: Callable[[], bool] | None = None
        self._datasets: weakref.WeakSet = weakref.WeakSet()  # those of the open iterators, for close()

    @classmethod
    def from_config(cls, data: DataConfig, shards: ShardStore, tokenizer: Tokenizer, *, micro_batch_size: int,
                    seed: int, rank: int = 0, world_size: int = 1, index_cache: str | Path | None = None,
                    pin_memory: bool = False) -> PretrainingLoader:
        """The training stream a run's data section describes; the rest is the run's: its micro-batch
        size, data-parallel rank and world size, train.seed, the node-local index cache."""
        return cls(shards, tokenizer, micro_batch_size=micro_batch_size, rank=rank, world_size=world_size,
                   num_workers=data.num_workers, seed=seed, mask_prob=data.mask_prob,
                   skip_bad_shards=data.skip_bad_shards, pin_memory=pin_memory, shuffle_shards=data.shuffle_shards,
                   read_overfetch=data.read_overfetch, read_block=data.read_block, index_cache=index_cache)

    def close(self, timeout: float = 2.0) -> None:
        """Give up the shard read-ahead of the iterators handed out so far, waiting up to ``timeout`` s
        for each to end (see :meth:`__iter__`): for the end of a run, a loader given up after an error,
        a test done with it. Nothing else changes: an iterator that goes on reads its next group when
        it gets there, and ``iter()`` starts at the loader's position as before."""
        for dataset in list(self._datasets):
            dataset.close(timeout)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        """Micro-batches from this loader's position on.

        When the iterator ends (closed, dropped, or raising), the shard group its reader read ahead
        is given up at once (:meth:`close`): against a store that stopped answering, that read would
        otherwise go on retrying for a minute. The read-ahead of DataLoader workers ends with the
        worker processes, when the iterator is released (or at exit).
        """
        dataset = RankDataset(self.plan, self._next_batch)
        self._datasets.add(dataset)
        # A private generator: DataLoader otherwise draws its base seed from the global RNG on
        # every iter(), which would shift dropout randomness and break bit-exact resume.
        loader = DataLoader(dataset, batch_size=None, num_workers=self.num_workers, pin_memory=self.pin_memory,
                            generator=torch.Generator().manual_seed(0),
                            worker_init_fn=init_worker if self.num_workers else None,
                            timeout=WAIT_POLL_S if self.num_workers and self.stop_waiting else 0)
        self._clear_shared_reads()  # a crashed run's, or this loader's last pass's
        if self.store.remote:
            self._announce_first_read()
        with stop_signals_blocked():  # workers start here, with the stop signals held back
            batches = iter(loader)
        if self.num_workers:
            kill_leftover_workers_at_exit()
        try:
            while (record := self._next(batches)) is not None:
                if record.error is not None:
                    raise record.error
                self._next_batch = record.batch + 1
                retries, fetched, requests = record.io
                self.read_retries += retries
                self.read_bytes += fetched
                self.read_requests += requests
                for name, reason in record.bad:
                    self.bad_shards.setdefault(name, reason)
                if record.tensors is not None:
                    yield record.tensors
        finally:
            dataset.close()  # closed, dropped or raising: the group read ahead is no one's now
            del batches  # DataLoader's workers stop here (not whenever the collector gets to them)
            self._clear_shared_reads()

    def _announce_first_read(self) -> None:
        """One line before the first batch from an object store: the rank's readers fetch their part of the
        shard group at this position (and the member indexes the node's cache lacks) before their first
        batches; later groups are read ahead meanwhile."""
        p = self.plan
        order = ReaderOrder(p)
        group = order.group_at(*order.group_of(p.batch_positions(self._next_batch)[0]))
        entries = [p.entries[shard] for shard in group.shards]
        if not p.indexed:  # each reader reads the group's shards whole
            size = sum(e["bytes"] for e in entries) * max(1, self.num_workers)
        else:
            size = 0.0
            for wanted, e in zip(order.wanted(group, every=1, from_batch=self._next_batch), entries):
                if len(wanted):
                    cached = p.index_cache and (Path(p.index_cache) / e["index"]["sha256"]).is_file()
                    size += len(wanted) * e["bytes"] / e["samples"] + (0 if cached else e["index"]["bytes"])
        logger.info("reading shard group %d of epoch %d from %s before the first batch: %d shards, ~%.1f MB for "
                    "this rank", group.index, group.epoch, self.store, len(entries), size / 1e6)

    def _next(self, batches) -> ReadBatch | None:
        """The next batch (None at the end); while workers have none ready, ``stop_waiting`` is asked
        every WAIT_POLL_S (DataLoader's own timeout, which leaves its iterator as it was)."""
        while True:
            try:
                return next(batches)
            except StopIteration:
                return None
            except RuntimeError as error:
                if not str(error).startswith("DataLoader timed out") or self.stop_waiting is None:
                    raise
                if self.stop_waiting():
                    # The workers are mid-read (stalled, or retrying) and would be joined for 5 s each
                    # before DataLoader gives up on them: they ignore stop signals, so end them now.
                    for worker in getattr(batches, "_workers", ()):  # DataLoader's worker processes
                        worker.kill()
                    raise StoppedWaitingForData("a stop was asked for while the workers read") from None

    def _clear_shared_reads(self) -> None:
        """Empty this rank's shared-reads directory (its workers discard as they go; this takes what a
        pass leaves behind: the groups they were in when it ended). A worker still reading fetches again."""
        if self.plan.shared_reads:
            shutil.rmtree(self.plan.shared_reads, ignore_errors=True)

    @property
    def position(self) -> int:
        """Global position of this rank's next micro-batch grid point: ``next batch × world × micro-batch``."""
        return self._next_batch * self.plan.world_size * self.plan.micro_batch_size

    def state_dict(self) -> dict[str, Any]:
        """Position after the batches handed out so far (JSON-able)."""
        p = self.plan
        return {
            "version": STATE_VERSION,
            "data_fingerprint": self._fingerprint,
            "seed": p.seed,
            "mask_prob": p.masking.mask_prob,
            "read_block": p.read_block,
            "rank": p.rank,
            "world_size": p.world_size,
            "num_workers": self.num_workers,
            "micro_batch_size": p.micro_batch_size,
            "next_batch": self._next_batch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue exactly where the saved loader stopped, in this loader's layout.

        Same world size, rank and micro-batch size: the saved batch number. Otherwise the saved
        global position, which must fall on this layout's grid of ``world × micro-batch`` samples.
        The worker count never matters. Another seed, mask rate or data set is refused.
        """
        mine = self.state_dict()
        if state.get("version") != STATE_VERSION:
            raise UserError(f"loader state: version {state.get('version')!r} (written by an older megakd with "
                             f"per-slot cursors), expected {STATE_VERSION}")
        for key in ("data_fingerprint", "seed", "mask_prob", "read_block"):
            if state.get(key, 1 if key == "read_block" else None) != mine[key]:  # states before read_block had 1
                raise UserError(f"loader state: {key}={state.get(key)!r} does not match this loader's {mine[key]!r}")
        self.close(timeout=0)  # a position set anew: what open iterators read ahead is no one's now
        if all(state.get(k) == mine[k] for k in ("world_size", "rank", "micro_batch_size")):
            self._next_batch = int(state["next_batch"])
            return
        position, grid = int(state["position"]), self.plan.world_size * self.plan.micro_batch_size
        if position % grid:
            raise UserError(f"loader state: global position {position} (world_size={state.get('world_size')} x "
                             f"micro_batch_size={state.get('micro_batch_size')} x {state.get('next_batch')} batches) "
                             f"is not a multiple of world_size={self.plan.world_size} x "
                             f"micro_batch_size={self.plan.micro_batch_size}")
        self._next_batch = position // grid
