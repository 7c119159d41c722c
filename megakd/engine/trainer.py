"""The pretraining loop: ELECTRA (DecoupledOptim or original) and BERT-MLM on any backend.

One optimizer step = `accumulation_steps` micro-batches per rank. Under DecoupledOptim the
generator and discriminator are separate units: each gets its own backward, clipping, optimizer
step and LR schedule, and the discriminator's loss weight λ is folded into its clipping
threshold, so λ changes no update (DESIGN.md; test_lambda_invariance proves it).
"""

from __future__ import annotations

import logging
import random
import shutil
import signal
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from megakd.config import Config, ConfigError, config_to_dict, save_config
from megakd.engine import checkpoint
from megakd.engine.backends import Backend, Unit
from megakd.engine.metrics import MetricsWriter, plot_metrics
from megakd.engine.probe import Probe
from megakd.engine.tasks import TeacherKD
from megakd.objectives.electra import corrupt, precision_recall_f1

log = logging.getLogger(__name__)

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@dataclass
class TrainResult:
    step: int
    preempted: bool
    run_dir: Path


class Trainer:
    def __init__(self, cfg: Config, backend: Backend, units: list[Unit], loader, *, tokenizer_dir: Path,
                 kd: TeacherKD | None = None):
        self.cfg = cfg
        self.kd = kd  # DWT: told the step before each optimizer step, for α_s(t)
        self.tokenizer_dir = Path(tokenizer_dir)
        self.backend = backend
        self.units = {u.name: u for u in units}
        self.loader = loader
        self.run_dir = Path(cfg.run.dir)
        _, self.accumulation_steps = cfg.batch_layout(backend.data_world_size)
        self.step = 0
        self.bad_steps = 0
        # Running sums since the last log line, kept on the device so a micro-batch adds its
        # statistics without waiting for the GPU; they are copied to the host once per log line.
        self.interval: dict[str, torch.Tensor] = defaultdict(
            lambda: torch.zeros((), dtype=torch.float64, device=backend.device))
        self.rng = torch.Generator().manual_seed(cfg.train.seed * 100_003 + backend.data_rank)
        self._preempt_requested = False
        self._probe: Probe | None = None  # built at the first probe step (loading and tokenizing the task)

    def run_probe(self) -> dict | None:
        """probe_acc and probe_seconds on rank 0 (None elsewhere, or where the probe cannot run)."""
        if self._probe is None:
            self._probe = self._build_probe()
        return None if self._probe is False else {"step": self.step, **self._probe(self.probe_encoder())}

    def _build_probe(self) -> Probe | bool:
        """The downstream probe on rank 0, or False when the encoder is not whole on this rank."""
        cfg = self.cfg
        if not self.backend.is_main:
            return False
        if cfg.backend.name == "deepspeed" and (cfg.backend.zero_stage == 3 or cfg.backend.pipeline_stages > 1):
            log.warning("train.probe_every: the probe is off under ZeRO-3 and pipeline parallelism (no rank holds "
                        "the whole encoder)")
            return False
        from megakd.data.tokenizer import Tokenizer

        encoder = self.probe_encoder()
        return Probe(cfg, Tokenizer.load(self.tokenizer_dir), encoder.config.max_position_embeddings)

    def probe_encoder(self) -> torch.nn.Module:
        """The encoder a downstream task would fine-tune: the discriminator's, or the BERT-MLM model's."""
        if "electra" in self.units:
            return self.units["electra"].model.discriminator.encoder
        return self.units["discriminator" if "discriminator" in self.units else "generator"].model.encoder

    # -- state -----------------------------------------------------------------------------------
    def rank_state(self) -> dict:
        return {
            "step": self.step,
            "bad_steps": self.bad_steps,
            "interval": {k: v.cpu() for k, v in self.interval.items()},
            "data": self.loader.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "sampling": self.rng.get_state(),
                "python": random.getstate(),
                "numpy": np.random.get_state(),
            },
        }

    def load_rank_state(self, state: dict) -> None:
        self.step = state["step"]
        self.bad_steps = state["bad_steps"]
        self.interval.clear()
        self.interval.update({k: v.to(self.backend.device) for k, v in state["interval"].items()})
        self.loader.load_state_dict(state["data"])
        rng = state["rng"]
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.rng.set_state(rng["sampling"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])

    def save(self) -> Path:
        tmp, final = checkpoint.begin(self.run_dir, self.step, self.backend.is_main)
        self.backend.barrier()
        if self.backend.is_main:
            save_config(self.cfg, tmp / "config.yaml")
            # A checkpoint is self-contained: conversion and resumption need no external paths.
            shutil.copytree(self.tokenizer_dir, tmp / "tokenizer")
        self.backend.save_units(list(self.units.values()), tmp)
        checkpoint.save_rank_state(tmp, self.backend.rank, self.rank_state())
        self.backend.barrier()
        if self.backend.is_main:
            checkpoint.commit(tmp, final, self.cfg.run.keep_last)
        self.backend.barrier()
        return final

    def resume(self, spec: str) -> None:
        """`auto` = newest complete checkpoint in run.dir (or start fresh); else a checkpoint path."""
        path = checkpoint.latest_checkpoint(self.run_dir) if spec == "auto" else Path(spec)
        if path is None:
            log.info("no checkpoint in %s: starting from step 0", self.run_dir)
            return
        if not path.is_dir():
            raise FileNotFoundError(f"--resume {spec}: no checkpoint directory at {path}")
        _check_same_model(path, self.cfg)
        self.backend.load_units(list(self.units.values()), path)
        self.load_rank_state(checkpoint.load_rank_state(path, self.backend.rank))
        log.info("resumed from %s at step %d", path, self.step)

    # -- one optimizer step ------------------------------------------------------------------------
    def _micro_batch(self, batch: dict, last: bool) -> list[torch.Tensor]:
        b = self.backend
        if "electra" in self.units:  # original ELECTRA: one joint loss, one backward
            unit = self.units["electra"]
            with b.no_sync(unit, last):
                out = b.forward(unit, batch, self.rng)
                b.backward(unit, out["loss"])
            self._accumulate(out["stats"])
            return [out["loss"].detach()]
        gen = self.units["generator"]
        with b.no_sync(gen, last):
            g = b.forward(gen, batch, self.rng)
            b.backward(gen, g["loss"])
        self._accumulate(g["stats"])
        if "discriminator" not in self.units:
            return [g["loss"].detach()]
        disc = self.units["discriminator"]
        corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], g["samples"])
        with b.no_sync(disc, last):
            d = b.forward(disc, corrupted, batch["input_ids"], batch["attention_mask"])
            b.backward(disc, d["loss"])
        self._accumulate(d["stats"])
        return [g["loss"].detach(), d["loss"].detach()]

    def _accumulate(self, stats: dict) -> None:
        for key, value in stats.items():
            self.interval[key] += value.detach().double()

    def train_step(self, batches) -> dict[str, float] | None:
        """Run one optimizer step; returns grad norms, or None if the step was skipped."""
        if self.kd is not None:
            self.kd.step = self.step
        if self.backend.owns_step:  # pipeline: one engine call runs the whole step
            norms, stats = self.backend.train_step(list(self.units.values()), batches, self.rng)
            self._accumulate(stats)
            if norms is None:
                return self._skipped("non-finite gradient norm")
            self.bad_steps = 0
            self.step += 1
            return norms
        losses = []
        for i in range(self.accumulation_steps):
            batch = next(batches)
            self.interval["tokens"] += float(batch["attention_mask"].sum())
            batch = {k: v.to(self.backend.device) for k, v in batch.items()}
            losses += self._micro_batch(batch, last=i == self.accumulation_steps - 1)
        finite = torch.isfinite(torch.stack([x.float() for x in losses])).all().double()
        if self.backend.all_reduce_sum(finite).item() < self.backend.world_size:
            for unit in self.units.values():
                self.backend.skip_step(unit)
            return self._skipped("non-finite loss")
        self.bad_steps = 0
        norms = {}
        for name, unit in self.units.items():
            norms[name] = self.backend.step(unit)
        self.step += 1
        return norms

    def _skipped(self, what: str) -> None:
        self.bad_steps += 1
        log.warning("%s at step %d: step skipped (%d in a row)", what, self.step + 1, self.bad_steps)
        if self.bad_steps >= self.cfg.train.max_bad_steps:
            raise RuntimeError(
                f"{self.bad_steps} non-finite losses in a row (train.max_bad_steps="
                f"{self.cfg.train.max_bad_steps}): stopping at step {self.step}"
            )

    # -- metrics ---------------------------------------------------------------------------------
    def _record(self, norms_sum: dict[str, float], steps: int, seconds: float) -> dict:
        names = sorted(self.interval)
        totals = torch.stack([self.interval[k] for k in names])
        totals = self.backend.all_reduce_sum(totals).cpu()
        s = dict(zip(names, totals.tolist()))
        rec: dict = {"step": self.step}
        if s.get("masked"):
            rec["gen_loss"] = s["gen_loss_sum"] / s["masked"]
            rec["gen_acc"] = s["gen_correct"] / s["masked"]
        if s.get("rtd_tokens"):
            rec["disc_loss"] = s["disc_loss_sum"] / s["rtd_tokens"]
            rec["disc_acc"] = s["rtd_correct"] / s["rtd_tokens"]
            p, r, f1 = precision_recall_f1(s["rtd_tp"], s["rtd_fp"], s["rtd_fn"])
            rec.update(rtd_precision=p, rtd_recall=r, rtd_f1=f1, replaced_frac=s["replaced"] / s["rtd_tokens"])
        if s.get("kd_batches"):  # DWT: τ²·KL per masked token and the mean α_s of the interval
            rec["kd_loss"] = s["kd_loss_sum"] / max(s["masked"], 1.0)
            rec["alpha_soft"] = s["alpha_soft_sum"] / s["kd_batches"]
        for name, unit in self.units.items():
            key = "discriminator" if name == "electra" else name
            rec[f"lr_{key}"] = unit.lr
            rec[f"grad_norm_{key}"] = norms_sum.get(name, 0.0) / max(1, steps)
        if "electra" in self.units:  # one optimizer drives both models
            rec["lr_generator"] = rec["lr_discriminator"]
            rec["grad_norm_generator"] = rec["grad_norm_discriminator"]
        rec["tokens_per_s"] = s.get("tokens", 0.0) / max(seconds, 1e-9)
        self.interval.clear()
        return rec

    # -- the loop ----------------------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        log.warning("received %s: will save a checkpoint and stop after this step", signal.Signals(signum).name)
        self._preempt_requested = True

    def _stop_requested(self) -> bool:
        flag = torch.tensor(float(self._preempt_requested))
        return self.backend.all_reduce_sum(flag).item() > 0

    def train(self) -> TrainResult:
        cfg = self.cfg
        writer = None
        if self.backend.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.run_dir / "config.yaml")
            writer = MetricsWriter(
                self.run_dir, tensorboard=cfg.run.tensorboard, wandb=cfg.run.wandb,
                wandb_project=cfg.run.wandb_project, wandb_mode=cfg.run.wandb_mode,
                config=config_to_dict(cfg), resume_step=self.step,
            )
        previous = {s: signal.signal(s, self._on_signal) for s in PREEMPT_SIGNALS}
        bar = None
        if self.backend.is_main and cfg.run.progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=cfg.train.max_steps, initial=self.step, unit="step", dynamic_ncols=True)
        preempted = False
        last_saved = self.step
        try:
            for unit in self.units.values():
                unit.task.train()
            batches = iter(self.loader)
            norms_sum: dict[str, float] = defaultdict(float)
            steps_in_interval, t0 = 0, time.perf_counter()
            while self.step < cfg.train.max_steps:
                norms = self.train_step(batches)
                if norms is None:
                    continue
                for k, v in norms.items():
                    norms_sum[k] += v
                steps_in_interval += 1
                if bar is not None:
                    bar.update(1)
                if self.step % cfg.train.log_every == 0 or self.step == cfg.train.max_steps:
                    rec = self._record(norms_sum, steps_in_interval, time.perf_counter() - t0)
                    if writer is not None:
                        writer.write(rec)
                    if bar is not None:
                        bar.set_postfix({k: f"{rec[k]:.3g}" for k in ("gen_loss", "disc_loss", "rtd_f1",
                                                                         "tokens_per_s") if k in rec})
                    norms_sum.clear()
                    steps_in_interval, t0 = 0, time.perf_counter()
                if cfg.train.probe_every and self.step % cfg.train.probe_every == 0:
                    probe_start = time.perf_counter()
                    rec = self.run_probe()
                    if rec is not None:
                        log.info("step %d: probe_acc %.4f (%.1f s)", self.step, rec["probe_acc"], rec["probe_seconds"])
                        writer.write(rec)
                    t0 += time.perf_counter() - probe_start  # tokens_per_s measures training only
                if self._stop_requested():
                    self.save()
                    preempted = True
                    log.warning("stopped at step %d on a signal; continue with --resume auto", self.step)
                    break
                if cfg.train.save_every and self.step % cfg.train.save_every == 0:
                    self.save()
                    last_saved = self.step
            if not preempted and last_saved != self.step:
                self.save()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if bar is not None:
                bar.close()
            if writer is not None:
                writer.close()
        if self.backend.is_main and cfg.run.plots and not preempted:
            plot_metrics(self.run_dir / "metrics.jsonl", self.run_dir / "plots")
        return TrainResult(step=self.step, preempted=preempted, run_dir=self.run_dir)


def _check_same_model(path: Path, cfg: Config) -> None:
    """Refuse a checkpoint written for another model/objective, naming the first differing key."""
    saved_file = path / "config.yaml"
    if not saved_file.is_file():
        raise FileNotFoundError(f"{saved_file} is missing: {path} is not a complete megakd checkpoint")
    saved = yaml.safe_load(saved_file.read_text())
    current = config_to_dict(cfg)
    for section in ("model", "electra"):
        saved_flat = _flatten(saved.get(section, {}), section)
        for key, value in _flatten(current[section], section).items():
            if key in ("electra.loss_weight", "electra.sampling_temperature"):
                continue
            old = saved_flat.get(key)
            if old != value:
                raise ConfigError(
                    f"checkpoint {path} was written with {key}={old!r}, but the config says {value!r}"
                )


def _flatten(d: dict, prefix: str) -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}.{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out
