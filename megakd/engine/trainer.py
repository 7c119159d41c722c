"""Pretraining (and DWT) as a job on the one training loop (`megakd.engine.loop`).

One optimizer step is one `backend.train_step(layout, batches, step)` call: `accumulation_steps`
micro-batches per rank, run as the training layout (`megakd.engine.layouts`) says. The trainer adds
what only pretraining has: the shard loader as the step source (held steps when storage fails, a stop
signal that ends a wait for data: `megakd.engine.held_steps`), validation and the probe, the
checkpoint's config and tokenizer, and loading a checkpoint at another world size. The run directory
and the resume decision are the run shell's (`megakd.engine.run`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from megakd.config import Config
from megakd.configio import save_config
from megakd.data.tokenizer import copy_tokenizer
from megakd.engine.held_steps import LoaderSteps
from megakd.engine.hooks import AtEnd, Hook, StepHook
from megakd.engine.layouts import Layout
from megakd.engine.loop import Checkpointer, LoopPlan, RandomStreams, TrainingLoop
from megakd.engine.probe import Probe
from megakd.engine.run import Outcome, Resume, Run, Stopped
from megakd.engine.runlog import MetricsWriter, plot_metrics
from megakd.engine.session import RunSession
from megakd.engine.units import StepInput, Unit
from megakd.engine.validation import Validator

log = logging.getLogger(__name__)


class Trainer:
    """Pretraining (or DWT) on the one training loop: the shard loader as its step source, validation and
    the probe as its evaluations, the checkpoint's config and tokenizer. `run` (megakd.engine.run) owns the
    run directory and decided the resume before this was built."""

    def __init__(self, cfg: Config, run: Run, layout: Layout, loader, *, tokenizer_dir: Path,
                 validator: Validator | None = None):
        self.cfg = cfg
        self.validator = validator  # scores held-out shards every train.eval_every steps
        self.tokenizer_dir = Path(tokenizer_dir)
        self.run = run
        self.backend = backend = run.backend
        self.run_dir = run.dir
        self.session: RunSession = run.session  # the run dir's lock, stop signals, saving
        self._probe: Probe | None = None  # built at the first probe step (loading and tokenizing the task)
        t, main, every = cfg.train, backend.is_main, cfg.run.save_every
        streams = RandomStreams(torch.Generator().manual_seed(t.seed * 100_003 + backend.data_rank),
                                fresh_seed=lambda: t.seed * 1_000_003 + backend.rank + 104_729 * self.step)
        plan = LoopPlan(
            max_steps=t.max_steps, log_every=t.log_every, save_due=lambda step: bool(every) and step % every == 0,
            save_at_end=True, bad_step_limit=t.max_bad_steps,
            bad_step_limit_text=f"train.max_bad_steps={t.max_bad_steps}",
            bar_values=_bar_values, show_bar=main and cfg.run.progress_bar,
            at_end=[AtEnd(self._plot)] if main and cfg.run.plots else [])
        metrics = (lambda step: MetricsWriter.for_run(self.run_dir, cfg, step)) if main else None
        self.loop = TrainingLoop(backend, layout, self.session, LoaderSteps(loader), streams, plan, metrics)
        self.loop.checkpointer = Checkpointer(self.session, self.run_dir, list(layout.units.values()), self.loop.parts,
                                              keep_last=cfg.run.keep_last, files=self._checkpoint_files,
                                              upgrade=_upgrade_flat_rank_state)
        if validator is not None:
            self.add_hook(StepHook(t.eval_every, validator.evaluate))
        self.add_hook(StepHook(t.probe_every, self._probe_line, own_line=True))
        streams.seed_rank(t.seed * 1_000_003 + backend.rank)  # dropout, after the models' shared init

    def add_hook(self, hook: Hook, state: str | None = None) -> None:
        """Run `hook` after every applied step (values it adds to the step's lines reach metrics.jsonl),
        after the hooks added before it, and its `end` when the run ends. With a `state` name, the hook is
        also a stateful part of the run (`state_dict`/`load_state_dict`): checkpointed and resumed."""
        self.loop.plan.evaluations.append(hook)
        if state is not None:
            self.loop.checkpointer.add(state, hook)

    # -- the loop's state, as the job's ---------------------------------------------------------------
    @property
    def step(self) -> int:
        return self.loop.progress.step

    @property
    def layout(self) -> Layout:
        return self.loop.layout

    @property
    def loader(self):
        """The shard loader the loop's step source reads."""
        return self.loop.source.loader

    @property
    def units(self) -> dict[str, Unit]:
        return self.layout.units

    def train_step(self, batches) -> dict[str, float] | None:
        """One optimizer step on `batches` (an iterator of micro-batches) outside the run, as the benchmarks
        drive it; returns the gradient norms, or None if the update was skipped."""
        return self.loop.step(StepInput(batches)).norms

    def _checkpoint_files(self, tmp: Path) -> None:
        """Rank 0's files in a checkpoint, which make it self-contained: conversion and resumption need no
        external paths."""
        save_config(self.cfg, tmp / "config.yaml")
        copy_tokenizer(self.tokenizer_dir, tmp / "tokenizer")

    def _plot(self) -> None:
        t = self.cfg.train  # the probe's task is validated (>= 2 labels) only when the probe is on
        plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "plots",
                     probe_chance=1 / t.probe_task.num_labels if t.probe_every else None)

    # -- the probe ------------------------------------------------------------------------------------
    def _probe_line(self, step: int) -> dict | None:
        rec = self.run_probe()
        if rec is not None:
            log.info("step %d: probe_acc %.4f (%.1f s)", step, rec["probe_acc"], rec["probe_seconds"])
        return rec

    def run_probe(self) -> dict | None:
        """probe_acc and probe_seconds on rank 0 (None elsewhere, or where the probe cannot run)."""
        if self._probe is None:
            self._probe = self._build_probe()
        return None if self._probe is False else {"step": self.step, **self._probe(self.probe_encoder())}

    def _build_probe(self) -> Probe | bool:
        """The downstream probe on rank 0, or False when the encoder is not whole on this rank."""
        if not self.backend.is_main:
            return False
        if not self.backend.holds_whole_model:
            log.warning("train.probe_every: the probe is off under ZeRO-3 and pipeline parallelism (no rank holds "
                        "the whole encoder)")
            return False
        from megakd.data.tokenizer import Tokenizer

        encoder = self.probe_encoder()
        return Probe(self.cfg, Tokenizer.load(self.tokenizer_dir), encoder.config.max_position_embeddings)

    def probe_encoder(self) -> torch.nn.Module:
        """The encoder a downstream task would fine-tune, as the layout says."""
        return self.layout.probe_encoder()

    # -- resuming ------------------------------------------------------------------------------------
    def load(self, resume: Resume) -> None:
        """Load the checkpoint the run decided on (at this world size, or resharded from another: the data
        position is global, so every rank continues the same global sample order; see the loop's parts for
        the rest), then make the changes the resume allowed take effect."""
        fresh = {name: _hyperparameters(unit) for name, unit in self.units.items()}
        saved_world = self.loop.checkpointer.load(resume.checkpoint, resharding=True)
        if saved_world != self.backend.world_size:
            log.warning("elastic resume: %d -> %d processes at step %d, global sample position %d",
                        saved_world, self.backend.world_size, self.step, self.loader.position)
        if any(key.startswith("optim.") for key in resume.changes):
            for name, unit in self.units.items():
                _apply_hyperparameters(unit, fresh[name])
        if resume.changes:
            log.warning("resumed from %s at step %d with changed %s", resume.checkpoint, self.step, ", ".join(
                f"{k} ({o!r} -> {n!r})" for k, (o, n) in resume.changes.items()))
        else:
            log.info("resumed from %s at step %d", resume.checkpoint, self.step)

    def close(self) -> None:
        """Stop the shard read-ahead (an error or a stop signal may have left it running) and end the run."""
        self.loader.close()
        self.run.close()

    # -- the run ---------------------------------------------------------------------------------------
    def train(self, export: Callable[[Path, Path], object] | None = None) -> Outcome:
        """Train to train.max_steps in the started run (`Run.start`); raises `Stopped` after the checkpoint of
        a stop signal.

        `export(run_dir, out)`: the end-of-run export, written by rank 0 into run_dir/hf once the run
        finished, still under the run directory's lock (`RunSession.export`).
        """
        end = self.loop.run()
        if end.stopped:
            raise Stopped(self.step, end.interrupted)
        outcome = Outcome(step=self.step)
        if export is not None:
            self.backend.close()  # the export is rank 0's alone: the other ranks may leave now
            if self.backend.is_main:
                outcome.exported, outcome.export_stopped_by = self.session.export(export)
        return outcome


def _upgrade_flat_rank_state(state: dict, rank: int) -> dict:
    """A pretraining rank state written before the loop's parts had names (step, bad_steps, interval, data
    and rng side by side): the same values under the parts' names. It saved no gradient norms, so the
    first log line after the resume averages those of the steps after it, as it did then."""
    if "progress" in state:
        return state
    return {"progress": {"step": state["step"], "bad_steps": state["bad_steps"]},
            "interval": {"sums": state["interval"], "norms": {}, "steps": 0},
            "data": state["data"], "rng": state["rng"]}


def _bar_values(line: dict) -> dict | None:
    """The progress bar's figures, from the step's log line (if it has one)."""
    return {k: f"{line[k]:.3g}" for k in ("gen_loss", "disc_loss", "rtd_f1", "tokens_per_s") if k in line} or None


_HYPERPARAMETERS = ("lr", "initial_lr", "betas", "eps", "weight_decay")


def _hyperparameters(unit: Unit) -> dict:
    """What the current config set on a unit's optimizer and schedule, before a checkpoint overwrites it."""
    groups = [{k: g[k] for k in _HYPERPARAMETERS if k in g} for g in unit.optimizer.param_groups]
    return {"groups": groups, "base_lrs": list(unit.scheduler.base_lrs)}


def _apply_hyperparameters(unit: Unit, fresh: dict) -> None:
    """Make allowed optim.* changes take effect: the loaded state keeps its moments, the config sets the rest.

    The LR of the next step is the new peak times the schedule's multiplier at the resumed step.
    """
    scheduler = unit.scheduler
    scheduler.base_lrs = list(fresh["base_lrs"])
    for group, values, base, multiplier in zip(unit.optimizer.param_groups, fresh["groups"], scheduler.base_lrs,
                                                scheduler.lr_lambdas):
        group.update(values)
        group["lr"] = base * multiplier(scheduler.last_epoch)
    scheduler._last_lr = [g["lr"] for g in unit.optimizer.param_groups]
