"""Samples by global position, the shard group holding them in memory and the next one read ahead.

Each rank reads the shard groups that hold its slices of the global order
(:mod:`megakd.data.order`); a group's shards are read together and kept in memory while the order
passes through it (``shuffle_shards`` shards per rank and per DataLoader worker), so every rank
reads every shard once per epoch: the price of a layout-free order; decoding is cheap next to a
training step. The next group is read in a background thread meanwhile, and given up when the
position moves elsewhere or the reader is closed.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from megakd.data.order import ReaderOrder, ReadPlan, ShardGroup
from megakd.data.shard_reader import ShardError, SharedRead, read_index, read_members, read_whole_shard
from megakd.data.storage import ContentCache, ReadCancelled, cancel_on, check_cancelled

logger = logging.getLogger(__name__)


def _in_daemon_threads(call, jobs: list, width: int) -> list:
    """``[call(job) for job in jobs]``, at most ``width`` at a time, each in a daemon thread; once all
    have ended, the first error (in job order) is raised.

    Not ``concurrent.futures``: a process joins its pool threads when it exits. A DataLoader worker
    whose read-ahead was cancelled with a request in flight then waited for that request, and at exit
    the HTTP client's own retries (its resolver's executor already shut down) made that 10 s and more,
    which closing the loader paid (docs/data.md, "Read-ahead").
    """
    results: list = [None] * len(jobs)
    errors: list[BaseException | None] = [None] * len(jobs)
    pending = iter(range(len(jobs)))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                i = next(pending, None)
            if i is None:
                return
            try:
                results[i] = call(jobs[i])
            except BaseException as error:  # raised in the caller's thread below
                errors[i] = error

    threads = [threading.Thread(target=work, daemon=True, name="shard read") for _ in range(min(width, len(jobs)))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if (error := next((e for e in errors if e is not None), None)) is not None:
        raise error
    return results


class _Prefetch(threading.Thread):
    """Reads one shard group in the background (a daemon: a run that ends never waits for it).

    ``cancel()`` gives the read up: its reads stop between shards, between retries and out of a
    backoff wait (:func:`megakd.data.storage.cancel_on`), and the thread ends with
    :class:`ReadCancelled` as its ``error``, which nobody reads: the group was dropped, so nothing it
    held (samples, bad shards, a storage error) reaches the loader.
    """

    def __init__(self, read, group: ShardGroup) -> None:
        super().__init__(daemon=True, name=f"read-ahead epoch {group.epoch} group {group.index}")
        self.read, self.group, self.error = read, group, None
        self.cancelled = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            self.read(self.group, self.cancelled)
        except BaseException as error:  # handed to the reader's thread, which raises it
            self.error = error

    def cancel(self) -> None:
        self.cancelled.set()

    def close(self, timeout: float) -> bool:
        """Cancel, and wait up to ``timeout`` s for the thread to end; whether it has."""
        self.cancel()
        self.join(timeout)
        return not self.is_alive()

    def result(self) -> ShardGroup:
        self.join()
        if self.error is not None:
            raise self.error
        return self.group


class SampleReader(ReaderOrder):
    """Samples by global position; holds the current shard group in memory while positions stay in
    it, and reads the next one in the background meanwhile (``prefetch``).

    Unindexed shards (manifest version 1) are read whole. Indexed ones: on entering a group the
    reader fetches the members of exactly the positions it will be asked for there (its batches
    from ``at_batch`` on, every ``every``-th), nothing else. From an object store, with an index
    cache and more than one reader per rank (``every`` > 1), the rank's readers fetch what they
    want of a shard together, once (:class:`SharedRead`): the rank's batches from ``first_batch``
    on, in as few requests as for one reader. Those cache objects are discarded two groups later.
    """

    def __init__(self, plan: ReadPlan, bad: list[tuple[str, str]], every: int = 1, prefetch: bool = True,
                 first_batch: int = 0) -> None:
        super().__init__(plan, every)
        self.bad = bad
        self.prefetch = prefetch
        self.first_batch = first_batch  # the rank's first batch in this pass (the same in all its readers)
        self.index_cache = ContentCache(plan.index_cache) if plan.index_cache else None
        self.shared_reads = ContentCache(plan.shared_reads) if plan.shared_reads and every > 1 else None
        self._previous: ShardGroup | None = None
        self.known_bad = set(plan.known_bad)
        self.first_index = np.asarray([e["first_index"] for e in plan.entries])
        self.current: ShardGroup | None = None
        self._ahead: _Prefetch | None = None

    def _load_shard(self, group: ShardGroup, shard: int, wanted: np.ndarray | None,
                    together: np.ndarray | None, cancel: threading.Event | None = None):
        """The shard's samples (all of them, or the in-shard positions ``wanted``), or None if it is bad.

        Once ``cancel`` is set (a read-ahead given up) it raises :class:`ReadCancelled` instead, and
        records nothing: a read cut short is neither data nor a bad shard.
        """
        p = self.plan
        name = p.files[shard]
        if name in self.known_bad:
            return None
        with cancel_on(cancel):
            check_cancelled()
            return self._load_or_skip(group, shard, name, wanted, together, cancel)

    def _load_or_skip(self, group: ShardGroup, shard: int, name: str, wanted: np.ndarray | None,
                      together: np.ndarray | None, cancel: threading.Event | None):
        p = self.plan
        try:
            if wanted is None:
                return p.store.retrying("read", name, lambda: read_whole_shard(
                    p.store, p.entries[shard], p.dtype, vocab_size=p.vocab_size, seq_len=p.seq_len, verify=p.verify))
            if not len(wanted):
                return {}
            index = read_index(p.store, p.entries[shard], self.index_cache)
            shared = None if together is None else SharedRead(self.shared_reads, together, group.shared)
            return read_members(p.store, p.entries[shard], index, wanted, p.dtype, vocab_size=p.vocab_size,
                                seq_len=p.seq_len, overfetch=p.overfetch, shared=shared)
        except (ShardError, FileNotFoundError) as e:
            if cancel is not None and cancel.is_set():
                raise ReadCancelled(f"{p.store.url(name)}: read cancelled") from None
            if not p.skip_bad_shards:
                raise ShardError(str(e)) from None
            group.bad.append((name, str(e)))
            return None

    def _read(self, group: ShardGroup, cancel: threading.Event | None = None) -> None:
        """Read what this reader needs of the group's shards; an object store's shards concurrently.
        ``cancel``: see :meth:`_load_shard`."""
        wanted = self.wanted(group) if self.plan.indexed else [None] * len(group.shards)
        together = self.wanted(group, every=1, from_batch=self.first_batch) if self.shared_reads \
            else [None] * len(group.shards)
        jobs = [(int(shard), w, t) for shard, w, t in zip(group.shards, wanted, together)]
        if self.plan.store.remote and len(jobs) > 1:
            group.loaded = _in_daemon_threads(lambda job: self._load_shard(group, *job, cancel), jobs, width=8)
        else:
            group.loaded = [self._load_shard(group, *job, cancel) for job in jobs]

    def _enter(self, epoch: int, index: int) -> None:
        """Make group ``index`` of ``epoch`` current (the prefetched one if it is that), then start
        reading the group after it."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.group.key == (epoch, index):
            group = ahead.result()
        else:
            if ahead is not None:  # the position moved elsewhere: nobody will use that group
                ahead.cancel()
                self._discard(ahead.group)
            group = self.group_at(epoch, index)
            self._read(group)
        for name, reason in group.bad:
            logger.warning("skipping bad shard (skip_bad_shards=True): %s", reason)
            self.known_bad.add(name)
            self.bad.append((name, reason))
        self._discard(self._previous)  # two groups back: the rank's other readers are past it too
        self._previous, self.current = self.current, group
        if self.prefetch:
            self._ahead = _Prefetch(self._read, self.group_at(*self.next_group(group)))

    def _discard(self, group: ShardGroup | None) -> None:
        """Remove the shared reads of ``group`` from the cache (a reader still needing one fetches it again)."""
        if group is not None and self.shared_reads is not None:
            for name in group.shared:
                self.shared_reads.discard(name)

    def close(self, timeout: float = 2.0) -> bool:
        """Give up the read-ahead (if any) and wait up to ``timeout`` s for its thread to end; whether it
        has (a request already under way is not interrupted; if one is, the cache locks of its fetches
        are given up, so the rank's other readers do not wait for it). The reader stays usable: a
        later :meth:`sample` reads again."""
        ahead, self._ahead = self._ahead, None
        if ahead is None or ahead.close(timeout):
            if ahead is not None:
                self._discard(ahead.group)
            return True
        logger.debug("read-ahead of epoch %d group %d still finishing a request after %.1f s", ahead.group.epoch,
                     ahead.group.index, timeout)
        for cache in (self.index_cache, self.shared_reads):
            if cache is not None:  # the rank's other readers must not wait for what it may never fetch
                cache.release()
        return False

    def sample(self, position: int) -> tuple[int, int, np.ndarray] | None:
        """(epoch, global index, ids) at ``position``, or None if its shard is bad (and skipped)."""
        epoch, offset = divmod(position, self.plan.total)
        group = self.current
        if group is None or group.epoch != epoch or not group.first <= offset < group.first + group.shard_ends[-1]:
            self._enter(*self.group_of(position))
            group = self.current
        j = int(group.perm[offset - group.first])
        i = int(np.searchsorted(group.shard_ends, j, side="right"))
        samples = group.loaded[i]
        if samples is None:
            return None
        shard = int(group.shards[i])
        j -= int(group.shard_ends[i]) - int(self.counts[shard])
        return epoch, int(self.first_index[shard] + j), samples[j]
