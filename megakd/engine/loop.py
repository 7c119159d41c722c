"""One training loop for every job (pretraining, DWT, every fine-tuning training), over stateful parts.

A job is a layout (what one micro-batch does), a step source (where each step's micro-batches come
from) and the hooks it adds. The loop owns the rest, once:

- the step and bad-step counters (`Progress`), and the rule for a skipped update;
- the interval sums and the log line (`Interval`): statistics summed on the device, reduced once per line;
- the hooks in their order: the log line, the job's evaluations, the metrics file, the progress bar,
  checkpoint cadence, the job's end-of-run work;
- the stop and save decisions: a stop signal, a full disk under the metrics file, a step every rank
  skipped because some rank's data failed.

Everything a resume needs is a stateful part (`state_dict`/`load_state_dict`) handed to one
`Checkpointer`: the loop's progress and interval, the data position, the random streams, and any
hook or objective with state. Adding run state (an EMA of the weights, say) is one more part.
docs/architecture.md § The training loop shows the parts and how to add one.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from time import monotonic
from typing import Protocol

import torch

from megakd.data.loader import StoppedWaitingForData
from megakd.engine.backends import STORAGE_FAILED, StepResult, TrainingBackend, stat_sums
from megakd.engine.held_steps import end_held_step
from megakd.engine.hooks import Checkpoints, Clock, Hook, Hooks, ProgressBar, StepHook
from megakd.engine.layouts import Layout
from megakd.engine.runlog import MetricsWriter
from megakd.engine.session import RunSession, rng_state, seed_rng, set_rng_state, skipped_update
from megakd.engine.units import StepContext, StepInput, Unit
from megakd.errors import UserError
from megakd.store import checkpoint
from megakd.store.files import HASH_BYTES_PER_S, LONG_WAIT_S, StoreError, about, human_bytes

log = logging.getLogger(__name__)

# A checkpoint's write speed until this process has timed one: rank 0 reads every byte back for the manifest's
# sha256 after the ranks wrote it (hashlib ~300 MB/s on the 2-core machine, docs/data.md), so about half that.
FIRST_SAVE_BYTES_PER_S = HASH_BYTES_PER_S / 2


def checkpoint_bytes(units: list[Unit]) -> int:
    """About what a checkpoint of `units` holds over all ranks: each weight at its dtype and AdamW's two fp32
    moments, plus an fp32 master copy of a 16-bit weight (DeepSpeed's bf16/fp16 engines keep one)."""
    total = 0
    for unit in units:
        for p in unit.model.parameters():
            numel = getattr(p, "ds_numel", p.numel())  # ZeRO-3 holds a partition; ds_numel is the whole
            total += numel * (p.element_size() + 8 + (4 if p.element_size() < 4 else 0))
    return total


class Stateful(Protocol):
    """A piece of run state a checkpoint holds. A part may also define `load_resharded(states, rank)`:
    how to continue from the states of another number of ranks (else it continues from its rank's
    state, or rank 0's where its rank did not exist)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


# -- the loop's own state ------------------------------------------------------------------------------

@dataclass
class Progress:
    """Optimizer steps counted so far, and updates skipped in a row (non-finite loss or gradient norm)."""

    step: int = 0
    bad_steps: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "bad_steps": self.bad_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.bad_steps = int(state["step"]), int(state["bad_steps"])


class RandomStreams:
    """Every random stream of this rank (torch, CUDA, Python, NumPy) and the job's own sampling generator.

    `fresh_seed()` seeds a rank that did not exist when the checkpoint was written (an elastic resume):
    its streams start anew, deterministically.
    """

    def __init__(self, sampling: torch.Generator | None = None, fresh_seed: Callable[[], int] | None = None):
        self.sampling = sampling
        self.fresh_seed = fresh_seed

    @staticmethod
    def seed_rank(seed: int) -> None:
        """Seed this rank's global streams (dropout) once the models are built from the shared seed: the
        job picks `seed` so that it differs per rank and reproduces."""
        torch.manual_seed(seed)

    def state_dict(self) -> dict:
        return rng_state(self.sampling)

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state, self.sampling)

    def load_resharded(self, states: list[dict], rank: int) -> None:
        if rank < len(states):
            self.load_state_dict(states[rank])
        elif self.fresh_seed is None:
            raise UserError(f"rank {rank}: no random state saved for it and no way to seed a new rank")
        else:
            seed_rng(self.fresh_seed(), self.sampling)


class Interval:
    """What the next log line averages: this rank's statistics summed on the device (a step adds its
    own without waiting for the GPU), the applied steps' gradient norms, and how many steps applied."""

    def __init__(self, device: torch.device):
        self.device = device
        self.sums: dict[str, torch.Tensor] = stat_sums(device)
        self.norms: dict[str, float] = defaultdict(float)
        self.steps = 0

    def add(self, result: StepResult) -> None:
        """An applied step's statistics and norms (a skipped update's count for nothing)."""
        for key, value in result.stats.items():
            self.sums[key] += value.to(self.device)
        for key, value in result.norms.items():
            self.norms[key] += value
        self.steps += 1

    def reduce(self, backend: TrainingBackend, counters: dict[str, float]) -> tuple[dict[str, float], dict[str, int]]:
        """The sums over all ranks, and `counters` (per-rank totals) summed on the same all-reduce."""
        names = sorted(self.sums)
        extra = torch.tensor(list(counters.values()), dtype=torch.float64).to(backend.device)
        totals = backend.all_reduce_sum(torch.cat([torch.stack([self.sums[k] for k in names]), extra]))
        totals = totals.cpu().tolist()
        return dict(zip(names, totals)), {k: int(v) for k, v in zip(counters, totals[len(names):])}

    def mean_norms(self) -> dict[str, float]:
        steps = max(1, self.steps)
        return {k: v / steps for k, v in self.norms.items()}

    def clear(self) -> None:
        self.sums.clear()
        self.norms.clear()
        self.steps = 0

    def state_dict(self) -> dict:
        return {"sums": {k: v.cpu() for k, v in self.sums.items()}, "norms": dict(self.norms), "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.clear()
        self.sums.update({k: v.to(self.device) for k, v in state["sums"].items()})
        self.norms.update(state["norms"])
        self.steps = state["steps"]

    def load_resharded(self, states: list[dict], rank: int) -> None:
        """Rank 0 takes over every saved rank's sums (the line's totals stay the job's); the others start at 0."""
        self.clear()
        self.norms.update(states[0]["norms"])
        self.steps = states[0]["steps"]
        if rank == 0:
            for state in states:
                for key, value in state["sums"].items():
                    self.sums[key] += value.to(self.device)


# -- where a step's micro-batches come from ----------------------------------------------------------

class StepSource(Stateful, Protocol):
    """Where each step's micro-batches come from (pretraining's shard loader, fine-tuning's epoch sampler)."""

    can_hold: bool  # its steps can be held (`StepInput.held`): this rank's data failed, or a stop ended a wait
    failure: UserError | None  # set when this rank's data failed for good mid-run (the step was held)

    def next_step(self) -> StepInput: ...

    def counters(self) -> dict[str, float]:
        """Per-rank running totals that the log line reports summed over ranks (e.g. read retries)."""

    def line_values(self) -> dict:
        """Values of the data position the log line reports as they are (e.g. the epoch)."""

    def start(self, session: RunSession, backend: TrainingBackend) -> contextlib.AbstractContextManager:
        """Context for the loop's run: how this source waits for data under the session's stop signals."""


# -- one save path, one resume path -------------------------------------------------------------------

class Checkpointer:
    """Saves and restores the run's units (through the backend) and its stateful parts, by name.

    A checkpoint is `root/checkpoints/step_N/`: each unit's files as the backend writes them, rank 0's
    `files(tmp)` (the config, the tokenizer), and `trainer_state_rank<r>.pt` = {part name: its state}.
    `upgrade(state, rank)` turns a rank state of an older layout into this one (the job knows its own).
    """

    def __init__(self, session: RunSession, root: Path, units: list[Unit], parts: dict[str, Stateful], *,
                 keep_last: int, files: Callable[[Path], None] | None = None,
                 upgrade: Callable[[dict, int], dict] = lambda state, rank: state):
        self.session, self.backend = session, session.backend
        self.root, self.units, self.parts = Path(root), units, parts
        self.keep_last, self.files, self.upgrade = keep_last, files, upgrade
        self.bytes_per_s = FIRST_SAVE_BYTES_PER_S  # measured by every save

    def save(self, step: int) -> Path:
        """Every rank writes its part; the run session publishes the checkpoint once all agree.

        A save expected to take `LONG_WAIT_S` or longer (its size at the last save's speed) is announced first.
        """
        b = self.backend

        def write(tmp: Path) -> None:
            # The units first: their save may hold collectives (DeepSpeed's barriers), which every rank
            # must reach; a failure of the rank-local writes after them cannot keep a peer waiting.
            b.save_units(self.units, tmp)
            if b.is_main and self.files is not None:
                self.files(tmp)
            checkpoint.save_rank_state(tmp, b.rank, self.state_dict())

        size = checkpoint_bytes(self.units)
        expected_s = size / self.bytes_per_s
        if b.is_main and expected_s >= LONG_WAIT_S:
            log.info("saving checkpoint step %d (~%s) to %s: %s", step, human_bytes(size),
                     checkpoint.step_dir(self.root, step), about(expected_s))
        started = monotonic()
        path = self.session.save(self.root, step, write, self.keep_last, expected_s)
        self.bytes_per_s = size / max(monotonic() - started, 1e-3)
        return path

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def add(self, name: str, part: Stateful) -> None:
        """Save and restore `part` under `name` from now on."""
        if name in self.parts:
            raise ValueError(f"a stateful part named {name!r} is already saved")
        self.parts[name] = part

    def load(self, path: Path, *, resharding: bool) -> int:
        """Restore `path` (verified already); returns the world size that wrote it.

        At another world size, `resharding` asks the backend to reshard the units (or refuse in one
        line) and each part to continue from the saved ranks' states; without it, the load is refused.
        """
        b = self.backend
        saved_world = len(list(path.glob("trainer_state_rank*.pt")))
        if saved_world < 1:
            raise UserError(f"checkpoint {path} has no trainer_state_rank*.pt: it is incomplete or not a "
                            f"megakd checkpoint")
        if saved_world == b.world_size:
            b.load_units(self.units, path)
            state = self.upgrade(checkpoint.load_rank_state(path, b.rank), b.rank)
            self._check_parts(path, state)
            for name, part in self.parts.items():
                part.load_state_dict(state[name])
            return saved_world
        if not resharding:
            raise StoreError(f"{path}: written by {saved_world} processes, this run has {b.world_size}; resume a "
                             "fine-tuning run with the world size it was started with")
        b.load_units_resharded(self.units, path, self.root, saved_world)
        states = [self.upgrade(checkpoint.load_rank_state(path, r), r) for r in range(saved_world)]
        self._check_parts(path, states[0])
        for name, part in self.parts.items():
            saved = [state[name] for state in states]
            if hasattr(part, "load_resharded"):
                part.load_resharded(saved, b.rank)
            else:
                part.load_state_dict(saved[b.rank] if b.rank < saved_world else saved[0])
        return saved_world

    def _check_parts(self, path: Path, state: dict) -> None:
        missing = [name for name in self.parts if name not in state]
        if missing:
            raise StoreError(f"{path}: no saved state for {', '.join(missing)} (the checkpoint was written by a run "
                             f"without it; it holds {', '.join(sorted(state))})")


# -- the loop ---------------------------------------------------------------------------------------

@dataclass
class LoopEnd:
    """How a run of the loop ended: at its last step, or on a stop signal after a checkpoint."""

    stopped: bool = False
    interrupted: bool = False  # the signal was SIGINT on some rank


@dataclass
class LoopPlan:
    """What differs between jobs in how the loop runs them."""

    max_steps: int
    log_every: int
    save_due: Callable[[int], bool]  # checkpoint cadence after a counted step
    save_at_end: bool  # also after the last step (fine-tuning writes its result instead)
    bad_step_limit: int
    bad_step_limit_text: str  # where the limit comes from, for the error
    bad_step_label: str = ""  # prefixes what a skipped update reports (e.g. "seed 3: ")
    count_skipped: bool = False  # a skipped update still counts as a step (an epoch has a fixed number of batches)
    bar_values: Callable[[dict], dict | None] = lambda line: None  # the progress bar's figures from a log line
    bar_label: str | None = None
    show_bar: bool = False
    evaluations: list[Hook] = field(default_factory=list)  # after the log line, before the metrics file
    at_end: list[Hook] = field(default_factory=list)  # after checkpoint cadence (e.g. the plots)


class TrainingLoop:
    """Steps until `plan.max_steps` or a stop; counters, log line, hooks, saves and stops as the module says."""

    def __init__(self, backend: TrainingBackend, layout: Layout, session: RunSession, source: StepSource,
                 streams: RandomStreams, plan: LoopPlan, metrics: Callable[[int], MetricsWriter] | None):
        self.backend, self.layout, self.session, self.source = backend, layout, session, source
        self.streams, self.plan = streams, plan
        self.progress = Progress()
        self.interval = Interval(backend.device)
        self.checkpointer: Checkpointer | None = None  # set by the job once its parts are known
        self._metrics_for = metrics  # rank 0's metrics file for a run starting at a step (None: other ranks)
        self._metrics: MetricsWriter | None = None
        self._step_lrs: dict[str, float] = {}  # each unit's rate for the step just run
        self._last_skipped = False  # the step just counted had its update skipped (no log line for it)
        self._clock: Clock | None = None

    @property
    def parts(self) -> dict[str, Stateful]:
        """The loop's stateful parts; a job adds its own (objective, evaluation hooks) beside them."""
        return {"progress": self.progress, "interval": self.interval, "data": self.source, "rng": self.streams}

    # -- one step ------------------------------------------------------------------------------------
    def step(self, given: StepInput) -> StepResult:
        """One optimizer step through the backend; the counters and interval sums follow its result."""
        p = self.progress
        context = StepContext(index=p.step, rng=self.streams.sampling, stop_flags=self.stop_flags, held=given.held,
                              epoch=given.epoch, loss_weight=given.loss_weight)
        self._step_lrs = {name: unit.lr for name, unit in self.layout.units.items()}
        result = self.backend.train_step(self.layout, given.micro_batches, context)
        if result.skipped == STORAGE_FAILED:
            return result  # nothing of this step counts: the checkpoint repeats it on resume
        if result.norms is None:
            attempted = p.step + 1
            p.bad_steps += 1
            if self.plan.count_skipped:
                p.step = attempted
            plan = self.plan
            skipped_update(p.bad_steps, f"{plan.bad_step_label}{result.skipped}", attempted, plan.bad_step_limit,
                           plan.bad_step_limit_text, self.checkpointer.root)
            return result
        self.interval.add(result)
        p.bad_steps = 0
        p.step += 1
        return result

    def stop_flags(self) -> tuple[bool, bool]:
        """The session's stop flags (`RunSession.stop_flags`); a failed metrics write on rank 0 asks for a stop too."""
        stop, interrupted = self.session.stop_flags()
        return stop or (self._metrics is not None and self._metrics.failure is not None), interrupted

    # -- the log line --------------------------------------------------------------------------------
    def log_line(self, step: int) -> dict | None:
        """The interval's sums over all ranks as the layout's ratios, its optimizer metrics and throughput
        over the interval's training seconds, and the data's figures; the interval starts again. None
        after a skipped update: its steps wait for the next line."""
        if self._last_skipped:
            return None
        seconds = self._clock.lap()
        sums, counters = self.interval.reduce(self.backend, self.source.counters())
        ratios = self.layout.ratios({**sums, "steps": self.interval.steps})
        optimizer = self.layout.optimizer_metrics(self.interval.mean_norms(), self._step_lrs)
        line = {"step": step, **self.source.line_values(), **ratios, **counters, **optimizer,
                **self.layout.throughput(sums, seconds)}
        self.interval.clear()
        return line

    # -- saving ---------------------------------------------------------------------------------------
    def save(self) -> Path:
        """Checkpoint the run at its current step (every rank); first, stop unsaved if rank 0's metrics failed."""
        self._stop_if_metrics_failed()
        return self.checkpointer.save(self.progress.step)

    def _stop_if_metrics_failed(self) -> None:
        """If rank 0's metrics writes hit a full disk, every rank stops here without saving.

        Its `failure` was already a stop request (`stop_flags`), so the ranks got here together at the
        next step (or at the end of the run); the newest checkpoint stays the one to resume from, and
        its metrics.jsonl lines are all intact.
        """
        failure = self._metrics.failure if self._metrics is not None else None
        if self.backend.all_reduce_sum(torch.tensor(float(failure is not None))).item() == 0:
            return
        if failure is not None:
            raise failure
        raise StoreError(f"{self.checkpointer.root}: rank 0 could not write the run's metrics (see its message); "
                         "stopped without saving")

    # -- the run --------------------------------------------------------------------------------------
    def hooks(self) -> Hooks:
        """In order: the log line, the job's evaluations, (rank 0) the metrics file, the progress bar,
        checkpoint cadence, the job's end-of-run work."""
        plan, p = self.plan, self.progress
        hooks = Hooks()
        hooks.add(StepHook(plan.log_every, self.log_line, also_at=plan.max_steps))
        for hook in plan.evaluations:
            hooks.add(hook)
        if self._metrics_for is not None:
            self._metrics = self._metrics_for(p.step)
            hooks.add(self._metrics)
        hooks.add(ProgressBar(plan.max_steps, p.step, lambda end: plan.bar_values(end.lines[0]),
                              desc=plan.bar_label, enabled=plan.show_bar))
        hooks.add(Checkpoints(self.save, plan.save_due, at_end=plan.save_at_end, last_saved=p.step))
        for hook in plan.at_end:
            hooks.add(hook)
        return hooks

    def run(self) -> LoopEnd:
        """Train from the current step to the last one, or to a stop signal (after saving that step)."""
        hooks = self.hooks()
        end, finished = LoopEnd(), False
        try:
            self.layout.train()
            hooks.start(self.progress.step)
            self._clock = Clock(hooks)
            # A held step is rewound to where it began; only a source and backend that can hold one need to know.
            rewindable = self.source.can_hold and self.backend.holds_steps
            with self.source.start(self.session, self.backend):
                while self.progress.step < self.plan.max_steps:
                    before = (self.source.state_dict(), self.streams.state_dict()) if rewindable else None
                    try:
                        result = self.step(self.source.next_step())
                    except StoppedWaitingForData:  # before the first batch: the run is as its last save left it
                        end = LoopEnd(True, self.session.stop_flags()[1])
                        log.warning("stopped at step %d on a signal while waiting for data; nothing new to save, "
                                    "continue with --resume auto", self.progress.step)
                        break
                    failed = result.skipped == STORAGE_FAILED
                    if failed:  # rewound to where the step began (it changed nothing else), saved, then ended
                        self.source.load_state_dict(before[0])
                        self.streams.load_state_dict(before[1])
                        end_held_step(self.source.failure, self.save(), self.progress.step, stop=result.stop)
                    elif result.norms is not None or self.plan.count_skipped:
                        self._last_skipped = result.norms is None
                        hooks.after_step(self.progress.step, stopping=result.stop,
                                         values=None if result.norms is None else result.stats)
                    if result.stop:
                        if not failed:
                            self.save()
                        end = LoopEnd(True, result.interrupted)
                        log.warning("stopped at step %d on a signal; continue with --resume auto", self.progress.step)
                        break
            finished = not end.stopped
        finally:
            hooks.end(self.progress.step, finished)  # the last checkpoint, the job's end work; closes the metrics file
        return end
