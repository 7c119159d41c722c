"""The run session: the mechanics every training command shares, whatever its loop.

The training loop (`engine/loop.py`) owns the steps, the log line and the checkpoints of every job.
What the loop and the commands around it share with the run directory and the process lives here:

- **ownership**: rank 0 takes `<run.dir>/.lock` and decides (claim a new run dir, find the
  checkpoint to resume); every rank learns the outcome, so a refusal stops all of them;
- **stop signals**: SIGTERM, SIGUSR1 and SIGINT ask for a checkpoint after the current step, a
  second SIGINT aborts at once; each step's agreement all-reduce carries `stop_flags()`;
- **saving**: every rank writes its part into a temporary step directory, all ranks agree on
  any failure before rank 0 publishes it, and again after (a full disk on one rank ends every
  rank with one line instead of a hang; a rank that dies or stops answering mid-save ends the
  others within a bounded time, also with one line);
- **random streams**: every stream a rank draws from, captured and restored as one state;
- **non-finite steps**: a skipped update is counted, `limit` in a row stop the run;
- **the end-of-run export**: written by rank 0 under the lock, published whole or not at all, and
  stopped cleanly by a stop signal.

The work a loop does after each step and at its end (log line, evaluations, metrics file, progress
bar, checkpoint cadence, plots) are hooks, `megakd/engine/hooks.py`.

docs/architecture.md § The training loop shows how the loop uses it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import re
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from megakd.data.loader import StoppedWaitingForData
from megakd.engine.backends import TrainingBackend
from megakd.errors import UserError
from megakd.signals import STOP_SIGNALS
from megakd.store import checkpoint, rundir
from megakd.store.files import StoreError, first_line, human_bytes, is_disk_full, tree_bytes

log = logging.getLogger(__name__)

# How long a save's collectives wait for a rank that stopped answering, beyond four times the save's
# expected duration (docs/reliability.md § A failure during a save, across ranks).
SAVE_TIMEOUT_S = 300.0


class TooManyBadSteps(UserError):
    """Too many non-finite steps in a row: the run stops, its last checkpoint intact."""


class RunSession:
    """Ownership of one run directory, stop signals and the all-ranks-agree save, on one backend."""

    def __init__(self, run_dir: Path, backend: TrainingBackend):
        self.run_dir = Path(run_dir)
        self.backend = backend
        self.lock = rundir.RunDirLock(self.run_dir)
        self._holding = contextlib.ExitStack()  # the lock (rank 0), from `own` until `release`
        self._stop_signal: int | None = None  # the first stop signal received, if any
        self._waiting = False  # inside `waiting_for_data`: a stop signal ends the wait

    # -- ownership ---------------------------------------------------------------------------------
    def own(self, decide: Callable[[], int | None] = lambda: None) -> int | None:
        """Take the run directory: rank 0 locks it and runs `decide` under the lock (claim it for a new
        run, find the checkpoint to resume); every rank gets `decide`'s step (or None), or the refusal raised.

        The caller calls `announce` once nothing can refuse the run any more, so a refused start leaves
        the run directory byte-identical.
        """
        main = self.backend.is_main
        error: BaseException | None = None
        value: int | None = None
        with contextlib.ExitStack() as holding:  # releases the lock if anything below fails
            if main:
                try:
                    holding.enter_context(self.lock)
                    value = decide()
                except (StoreError, OSError) as err:
                    error = err
            failed, value = self._from_main(error is not None, value)
            if failed:
                raise error if error is not None else StoreError(f"{self.run_dir}: refused on rank 0 (see its "
                                                                 "message)")
            self._holding = holding.pop_all()
        return value

    def share(self, value: int | None) -> int | None:
        """Rank 0's `value` (a step, or None) on every rank."""
        return self._from_main(False, value)[1]

    def _from_main(self, failed: bool, value: int | None) -> tuple[bool, int | None]:
        """Any rank's `failed`, and rank 0's `value`, on every rank: one integer all-reduce."""
        mine = value + 1 if self.backend.is_main and value is not None else 0
        flags = torch.tensor([int(failed), int(mine)], dtype=torch.int64)
        failed_count, shared = self.backend.all_reduce_sum(flags).tolist()
        return failed_count > 0, shared - 1 if shared else None

    def announce(self) -> None:
        """Record this job as the run directory's holder (rank 0): the run starts."""
        if self.backend.is_main:
            self.lock.announce()

    def release(self) -> None:
        """Give the run directory up (rank 0's lock); nothing to do where it is not held."""
        self._holding.close()

    # -- the end-of-run export ---------------------------------------------------------------------
    def export(self, write: Callable[[Path, Path], object], name: str = "hf") -> tuple[Path | None, int | None]:
        """Rank 0, while the run directory is still held: `write(run_dir, out)` published as run_dir/`name`
        (`rundir.publish_export`: only while this job owns it, nothing partial left behind). A stop signal
        during it removes the partial export instead of killing the process mid-write: returns
        (the export, None) or (None, the signal)."""
        try:
            with _stop_signals_raise():
                return rundir.publish_export(self.run_dir, write, name), None
        except _StoppedDuringExport as stop:
            return None, stop.signum

    # -- stop signals ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def stop_signals(self) -> Iterator[None]:
        """Within: a stop signal is recorded for the next step's agreement instead of ending the process."""
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_signal(self, signum, _frame) -> None:
        if signum == signal.SIGINT and self._stop_signal == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: abort now, without a checkpoint
        name = signal.Signals(signum).name
        if self._stop_signal is None:
            log.warning("received %s: will save a checkpoint and stop after this step%s", name,
                        " (a second SIGINT aborts at once)" if signum == signal.SIGINT else "")
            self._stop_signal = signum
        elif signum == signal.SIGINT:
            self._stop_signal = signum  # already stopping; the next SIGINT aborts
        if self._waiting:
            self._waiting = False
            raise StoppedWaitingForData(f"received {name} while waiting for data")

    @contextlib.contextmanager
    def waiting_for_data(self, interrupt: bool = True) -> Iterator[None]:
        """Within (inside `stop_signals`): a stop signal, besides being recorded, raises
        `StoppedWaitingForData` at once (`interrupt`: the reads run in this process, in code that
        cleans up as it unwinds), so a loop waiting on storage that stalls or retries stops within
        seconds instead of after the read's timeouts and retries. A loader with DataLoader workers
        is not interrupted (that could cut a tensor's hand-over from a worker); it polls
        `stop_flags` instead (`PretrainingLoader.stop_waiting`). A signal before the block raises at
        its start."""
        if self._stop_signal is not None:
            raise StoppedWaitingForData("a stop was asked for before the wait for data")
        self._waiting = interrupt
        try:
            yield
        finally:
            self._waiting = False

    def stop_flags(self) -> tuple[bool, bool]:
        """(a stop was asked for, a SIGINT was among the signals) on this rank.

        A signal may reach one rank only (or one rank first); each step's agreement all-reduce makes
        every rank stop after the same step, so the checkpoint holds one consistent step.
        """
        return self._stop_signal is not None, self._stop_signal == signal.SIGINT

    # -- saving ------------------------------------------------------------------------------------
    def save(self, root: Path, step: int, write: Callable[[Path], None], keep_last: int, expected_s: float) -> Path:
        """Checkpoint `step` into `root/checkpoints/`: every rank's `write(tmp)`, then rank 0 publishes
        atomically (megakd.store.checkpoint). A failed save leaves no trace and raises on every rank.

        Every rank reaches the same collectives whether or not its own writes failed (`write` must too:
        `TrainingBackend.save_units` keeps going through its collectives after a failed write), so a
        failure on one rank ends every rank with its error instead of a hang. A rank that died or stopped
        answering is the one case left: the save's collectives give up after `SAVE_TIMEOUT_S` plus four
        times the save's `expected_s`, and a collective that fails ends this rank with one line.
        """
        with _collectives_bounded(self.backend, SAVE_TIMEOUT_S + 4 * expected_s):
            state = _SaveState(checkpoint.temp_dir(root, step), checkpoint.step_dir(root, step))
            try:
                return self._save(root, step, write, keep_last, state)
            except _PeersLost as lost:
                raise self._lost(lost, step, state) from None

    def _save(self, root: Path, step: int, write: Callable[[Path], None], keep_last: int, state: _SaveState) -> Path:
        main = self.backend.is_main
        try:
            state.tmp, state.final = checkpoint.begin(root, step, main)  # checks run-dir ownership on rank 0
        except (OSError, StoreError) as err:
            state.error = err
        _together(self.backend.barrier)
        if state.error is None:
            try:
                write(state.tmp)
            except (OSError, RuntimeError) as err:
                state.error = err
        self._agree_or_abort(state, step)
        if main:
            try:
                checkpoint.commit(state.tmp, state.final, step, keep_last)  # checks run-dir ownership
                state.published = True
            except (OSError, RuntimeError, StoreError) as err:
                state.error = err
        self._agree_or_abort(state, step)
        return state.final

    def _agree_or_abort(self, state: _SaveState, step: int) -> None:
        """All ranks learn whether any rank failed; then rank 0 removes the temp dir and all raise."""
        error, tmp = state.error, state.tmp
        failed = _together(self.backend.all_reduce_sum, torch.tensor(float(error is not None))).item() > 0
        if not failed:
            return
        written = tree_bytes(tmp) if tmp.is_dir() else 0
        _together(self.backend.barrier)  # every rank has measured the partial checkpoint before it goes
        if self.backend.is_main:
            checkpoint.abort(tmp)
            # A lost run directory explains any failure (another job may have removed the temp dir).
            taken = error if isinstance(error, rundir.RunDirTakenOver) else self.lock.ownership_error()
            if taken is not None:
                raise taken from None
        if error is None:
            raise StoreError(f"{tmp.parent}: saving step {step} failed on another rank; the partial checkpoint "
                             "was removed, older checkpoints are intact")
        previous = checkpoint.latest_checkpoint(tmp.parent.parent)
        needed = f", about {human_bytes(tree_bytes(previous))} needed" if previous is not None else ""
        what = "no space left on device" if is_disk_full(error) else first_line(error)
        raise StoreError(f"{tmp.parent}: {what} while saving step {step} ({human_bytes(written)} written"
                         f"{needed}); the partial checkpoint was removed, older checkpoints are intact") from None

    def _lost(self, lost: _PeersLost, step: int, state: _SaveState) -> StoreError:
        """The one-line error of a save whose collective failed: a rank died, or stopped answering.

        No further collective can run. Rank 0 removes the unpublished temp dir (`--resume auto` takes the
        newest published checkpoint; the next start removes any temp dir left by another rank's death).
        """
        where = state.tmp.parent
        why = _reason(state.error if state.error is not None else lost.error)  # the first thing that failed here
        if state.published:
            return StoreError(f"{where}: step {step} was saved, then another rank ended or stopped answering ({why})")
        if self.backend.is_main:
            checkpoint.abort(state.tmp)
        return StoreError(f"{where}: saving step {step}: another rank ended or stopped answering ({why}); step "
                          f"{step} was not published, older checkpoints are intact")


@dataclass
class _SaveState:
    """Where one save stands on this rank: its directories, this rank's first error, and whether rank 0
    published it (what a failed collective's message says)."""

    tmp: Path
    final: Path
    error: BaseException | None = None
    published: bool = False


class _PeersLost(Exception):
    """A collective of a save failed: another rank died, or did not reach it within the save's timeout."""

    def __init__(self, error: RuntimeError):
        super().__init__(str(error))
        self.error = error


def _reason(err: BaseException) -> str:
    """An error's first line without the C++ source location gloo puts first, cut after its first sentence
    (gloo adds advice and an emoji to a lost connection)."""
    return re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first_line(err)).split(". ")[0]


def _together(collective: Callable, *args):
    """`collective(*args)`; its failure (gloo and NCCL raise RuntimeError: a peer's connection closed, or
    the timeout passed) as `_PeersLost`."""
    try:
        return collective(*args)
    except RuntimeError as err:
        raise _PeersLost(err) from None


@contextlib.contextmanager
def _collectives_bounded(backend: TrainingBackend, seconds: float) -> Iterator[None]:
    """Within: the default process group's collectives give up after `seconds` (megakd creates it with 30
    minutes, `backends.create_process_group`), so a save whose peer stopped answering ends in bounded time.
    The group's own timeout is put back after."""
    if backend.world_size == 1 or not dist.is_initialized():
        yield
        return
    group = dist.distributed_c10d._get_default_group()
    before = group._get_backend(group._device_types[0]).options._timeout
    dist.distributed_c10d._set_pg_timeout(timedelta(seconds=seconds), group)
    try:
        yield
    finally:
        dist.distributed_c10d._set_pg_timeout(before, group)


class _StoppedDuringExport(BaseException):
    """A stop signal during the export (a BaseException, as KeyboardInterrupt is, so that no
    `except Exception` on the way swallows it and the export's temporary directory is removed)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[None]:
    def stop(signum, _frame):
        raise _StoppedDuringExport(signum)

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


# -- non-finite steps ---------------------------------------------------------------------------

def skipped_update(in_a_row: int, what: str, step: int, limit: int, limit_text: str, where: Path) -> None:
    """Report an update skipped at `step` because of `what`, the `in_a_row`-th in a row (the loop keeps
    the count in its checkpointed state); raise `TooManyBadSteps` at `limit`.

    `limit_text` says where the limit comes from; `where` holds the checkpoints left untouched.
    """
    log.warning("%s at step %d: update skipped (%d in a row)", what, step, in_a_row)
    if in_a_row >= limit:
        raise TooManyBadSteps(f"{limit_text}: {in_a_row} steps in a row had a non-finite loss or gradient norm "
                              f"(last: {what}); stopped at step {step - 1} without saving, the checkpoints in "
                              f"{where / 'checkpoints'} are untouched")


# -- random streams -------------------------------------------------------------------------------

def rng_state(sampling: torch.Generator | None = None) -> dict:
    """Every random stream of this rank (host-side copies: no device sync); `sampling` is the loop's own."""
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "sampling": sampling.get_state() if sampling is not None else None,
        "python": random.getstate(),
        # numpy's state holds an ndarray, which a weights-only load refuses: store it as a tensor
        "numpy": _numpy_state_to_plain(np.random.get_state()),
    }


def set_rng_state(state: dict, sampling: torch.Generator | None = None) -> None:
    """Restore what `rng_state` captured."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if sampling is not None:
        sampling.set_state(state["sampling"])
    random.setstate(state["python"])
    np.random.set_state(_numpy_state_from_plain(state["numpy"]))


def seed_rng(seed: int, sampling: torch.Generator | None = None) -> None:
    """Seed every stream `rng_state` captures (a rank that has no saved state to continue from)."""
    torch.manual_seed(seed)
    if sampling is not None:
        sampling.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def _numpy_state_to_plain(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)


def _numpy_state_from_plain(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached = state
    return name, keys.numpy().astype(np.uint32), pos, has_gauss, cached
