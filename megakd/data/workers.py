"""DataLoader workers: what each one builds and hands the loader, and why none dies of a stop signal.

Worker ``k`` of ``K`` builds micro-batches ``m ≡ k (mod K)`` of the rank's share of the global
order (:mod:`megakd.data.order`, point 3), one :class:`ReadBatch` each. Workers ignore the stop
signals, so a signal sent to the whole process group reaches only the training process, which
checkpoints; an exit handler kills workers an open iterator leaves behind.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import gc
import multiprocessing
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import IterableDataset, get_worker_info

from megakd.data.order import ReadPlan
from megakd.data.prefetch import SampleReader
from megakd.data.shard_reader import ShardError
from megakd.errors import UserError
from megakd.signals import STOP_SIGNALS


@dataclass(frozen=True)
class ReadBatch:
    """What a reader hands the loader for one micro-batch number, across the DataLoader worker boundary.

    ``tensors`` is None for a batch whose samples all sit in skipped bad shards (it keeps the
    round-robin order of batch numbers, and training never sees it); ``bad`` the shards found bad
    since the reader's previous record; ``io`` its storage counters' growth since then (retries,
    bytes fetched, requests); ``error`` a :class:`UserError` that ended the reader, which the
    loader raises as a one-line error (one raised in a worker arrives wrapped in a worker traceback).
    """

    batch: int
    tensors: dict[str, torch.Tensor] | None = None
    bad: tuple[tuple[str, str], ...] = ()
    io: tuple[int, int, int] = (0, 0, 0)
    error: UserError | None = None

    def pin_memory(self) -> ReadBatch:
        """The record with its tensors pinned: DataLoader's ``pin_memory`` calls this on an object that
        has it, and passes a dataclass through untouched otherwise."""
        if self.tensors is None:
            return self
        return dataclasses.replace(self, tensors={k: v.pin_memory() for k, v in self.tensors.items()})


class RankDataset(IterableDataset):
    """Worker ``k`` builds micro-batches ``first + k``, ``first + k + K``, ...: one :class:`ReadBatch` per
    batch number."""

    def __init__(self, plan: ReadPlan, first_batch: int) -> None:
        self.plan = plan
        self.first_batch = first_batch
        self._readers: list[SampleReader] = []  # made in this process (num_workers=0), for close()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_readers": []}

    def close(self, timeout: float = 2.0) -> None:
        """Give up the read-ahead of the readers iterating in this process (a worker's ends with its process)."""
        for reader in self._readers:  # kept: one that goes on reading reads ahead again, and is closed again
            reader.close(timeout)

    def __iter__(self) -> Iterator[ReadBatch]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        p = self.plan
        bad: list[tuple[str, str]] = []
        reader = SampleReader(p, bad, every=workers, first_batch=self.first_batch)
        self._readers.append(reader)
        batch_number = self.first_batch + worker
        counted = p.store.retried, p.store.fetched, p.store.requested
        try:
            while True:
                reader.at_batch = batch_number
                found = [x for x in map(reader.sample, p.batch_positions(batch_number)) if x is not None]
                tensors = None
                if found:
                    epochs, indices, samples = (list(column) for column in zip(*found))
                    tensors = p.masking.collate(samples, epochs, indices, p.seed)
                elif len(reader.known_bad) == len(p.files):
                    raise ShardError(f"shards {p.store}: every shard is bad; nothing left to read")
                now = p.store.retried, p.store.fetched, p.store.requested
                record = ReadBatch(batch_number, tensors, tuple(bad), tuple(b - a for a, b in zip(counted, now)))
                counted = now
                bad.clear()
                yield record
                batch_number += workers
        except UserError as e:
            yield ReadBatch(batch_number, error=e)
        finally:
            # Ended (a worker told to stop, an in-process iterator dropped): give the read-ahead up now,
            # and with it the cache locks of its fetches, which the rank's other workers may be waiting for.
            reader.close(timeout=0)


@contextlib.contextmanager
def stop_signals_blocked() -> Iterator[None]:
    """A DataLoader worker that died of a stop signal first would take the run down without a
    checkpoint when the signal goes to the whole process group (Slurm, `timeout`, a terminal's
    Ctrl-C), so workers ignore them. Hold the stop signals back while DataLoader workers are
    forked: a child inherits the mask, so none can die of one before `init_worker` runs.
    Held signals reach the training process (its handlers) when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def init_worker(_worker_id: int) -> None:
    """DataLoader `worker_init_fn`: ignore the stop signals (dropping any already pending), then
    unblock them; and put every object inherited from the parent out of the garbage collector's reach.

    A forked worker holds a copy of its parent's whole heap. Left to the collector, a full collection
    walks all of it (0.3-0.9 s here, writing to every page it touches), and inherited garbage
    is finalized in the worker: an fsspec filesystem's finalizer waits about 1 s on the parent's event
    loop, which does not run here. Either stalls whichever thread triggered it, a read-ahead or the
    worker between two batches (docs/performance.md, "Reading shards from object storage").
    """
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    gc.freeze()


def _kill_leftover_workers() -> None:
    """At exit, SIGKILL daemonic children (DataLoader workers) that are still alive.

    multiprocessing's own exit handler stops them with SIGTERM, which our workers ignore, and then
    waits forever. That happens whenever a loader iterator is still open at exit (a caller keeps a
    reference to it). atexit runs handlers last-registered-first, so this must be registered after
    multiprocessing's handler: :func:`kill_leftover_workers_at_exit` does that. An open iterator's
    SIGCHLD handler (DataLoader's) would report each of these deaths as a failed worker, with a
    traceback out of whichever exit handler runs next, so SIGCHLD goes back to its default first.
    """
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


@functools.cache
def kill_leftover_workers_at_exit() -> None:
    """Register :func:`_kill_leftover_workers` at exit, once, when a loader's first DataLoader workers
    have started: multiprocessing registered its exit handler before it started them, so this one
    runs first. Importing this module registers nothing."""
    atexit.register(_kill_leftover_workers)
