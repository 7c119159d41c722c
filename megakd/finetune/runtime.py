"""Where a `megakd finetune` command runs: its backend, device and precision, its run directory, stop signals.

One `Runtime` per command: it joins the process group (torchrun, the deepspeed launcher or Slurm
variables, through the pretraining backends), owns `run.dir` for the command's life (the same
refusal, `run.overwrite` and lock as pretraining, megakd/store/rundir.py; a new run that ends before
writing anything but its config.yaml removes it, leaving run.dir unused), catches SIGTERM,
SIGUSR1 and SIGINT so that the training in progress checkpoints and stops, and splits every global
batch over the data-parallel ranks.

`finetune.batch_size` is the global batch: rank r trains on the r-th contiguous part of each
batch (`torch.tensor_split`), and its loss is weighted by its share of the batch (n_r·W/n), so the
averaged data-parallel gradient is the gradient of the global batch mean even when the last
batch of an epoch does not divide evenly. A rank left without a row gets the batch's first row
with weight 0.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import Tensor

from megakd.config import ConfigError
from megakd.configio import config_to_dict, read_yaml_file, save_config
from megakd.engine import backend_factory
from megakd.engine.backends import (
    MicroBatchLoopBackend,
    SingleProcessBackend,
    default_device,
    resolve_precision,
)
from megakd.engine.session import RunSession
from megakd.errors import UserError
from megakd.finetune.config import FinetuneConfig
from megakd.finish import launched_world_size
from megakd.store import rundir
from megakd.store.files import StoreError

log = logging.getLogger(__name__)

# Besides the keys pretraining treats as steering (run.*, kernels.*, backend.dist_backend; see
# megakd/store/rundir.py), these may differ when a fine-tuning run resumes: they change no number
# that a finished seed or a checkpoint holds.
STEERING = ("finetune.log_every", "finetune.eval_batch_size")


class Stopped(Exception):
    """A stop signal arrived; the training in progress saved a checkpoint (`--resume auto` continues)."""

    def __init__(self, interrupted: bool):
        super().__init__("stopped on a signal")
        self.interrupted = interrupted  # SIGINT (the command exits 130) rather than SIGTERM/SIGUSR1 (exit 0)


def build_backend(cfg: FinetuneConfig) -> MicroBatchLoopBackend:
    """The run's backend (`megakd.engine.backend_factory`) on the device `finetune.device` asks for; a
    DeepSpeed engine takes one micro-batch per step, this rank's share of the global batch.

    `finetune.precision: auto` is replaced in `cfg` by what it means on that device (`resolve_precision`:
    bf16 on a CUDA device that supports it, fp32 on the CPU and under DeepSpeed, which refuses bf16
    here), so the run's config records the choice, as it does `backend.name: auto`."""
    f = cfg.finetune
    f.precision = resolve_precision(f.precision, _device(f.device, 0), bf16_allowed=cfg.backend.name != "deepspeed")
    backend = backend_factory.build_backend(cfg.backend, f.precision, f.batch_size // launched_world_size(), f.tf32)
    backend.device = _device(f.device, backend.local_rank)
    return backend


def _device(setting: str, local_rank: int) -> torch.device:
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("finetune.device=cuda: no CUDA device is visible to this process")
    return default_device(local_rank)  # one GPU bound per task: its device 0


class Runtime:
    """The backend, run directory and stop signals of one fine-tuning command (see the module docstring)."""

    def __init__(self, cfg: FinetuneConfig, resume: str | None = None, backend: MicroBatchLoopBackend | None = None,
                 steering: tuple[str, ...] = ()):
        if resume not in (None, "auto"):
            raise UserError(f"--resume {resume}: megakd finetune resumes with --resume auto (each seed continues "
                             "from its newest intact checkpoint in run.dir)")
        self.cfg = cfg
        self.resume = resume == "auto"
        self.steering = STEERING + steering  # keys a resumed run may change (a caller's own, e.g. megakd glue's)
        self.backend = backend or build_backend(cfg)
        if cfg.finetune.batch_size % self.world_size:
            raise ConfigError(f"finetune.batch_size={cfg.finetune.batch_size} (the global batch) is not divisible by "
                             f"the world size {self.world_size}")
        self.run_dir = Path(cfg.run.dir)
        self.session = RunSession(self.run_dir, self.backend)  # the run dir's lock, stop signals, saving
        self._signals = contextlib.ExitStack()  # the session's stop-signal handlers, from `open` to `close`
        self._fresh = False  # this command wrote config.yaml into an empty run.dir (see close)

    # -- who and where ---------------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        return self.backend.is_main

    @property
    def rank(self) -> int:
        return self.backend.data_rank

    @property
    def world_size(self) -> int:
        return self.backend.data_world_size

    @property
    def device(self) -> torch.device:
        return self.backend.device

    # -- the run directory -------------------------------------------------------------------------
    def open(self) -> Path:
        """Own run.dir: a new run needs an unused one; `--resume auto` needs the same config as before.

        Rank 0 decides; every rank learns the outcome, so a refusal stops all of them with its message.
        """
        self.session.own(self._claim)
        self.session.announce()
        if self.is_main:
            self._fresh = not rundir.used_entries(self.run_dir)
            save_config(self.cfg, self.run_dir / "config.yaml")
        self._signals.enter_context(self.session.stop_signals())
        return self.run_dir

    def _claim(self) -> None:
        """On rank 0, under the lock: `--resume auto` needs the saved config's values, a new run an unused run.dir."""
        saved = self.run_dir / "config.yaml"
        if self.resume and saved.is_file():
            self._check_same_config(saved)
        elif not self.resume:
            aside = rundir.claim_for_new_run(self.run_dir, self.cfg.run.overwrite)
            if aside is not None:
                log.warning("run.overwrite: moved the old contents of %s to %s", self.run_dir, aside)

    def _check_same_config(self, saved_file: Path) -> None:
        saved = read_yaml_file(saved_file)
        changes = rundir.state_changes(saved if isinstance(saved, dict) else {}, config_to_dict(self.cfg))
        changed = {k: v for k, v in changes.items() if not k.startswith(self.steering)}
        if changed:
            listed = "; ".join(f"{k}: {o!r} -> {n!r}" for k, (o, n) in changed.items())
            raise StoreError(f"{saved_file}: cannot resume with a different {listed} (finished seeds and checkpoints "
                             "were made with the saved values; start a new run.dir instead)")

    def close(self) -> None:
        self._signals.close()
        self._release_unused_run_dir()
        self.session.release()
        self.backend.close()

    def _release_unused_run_dir(self) -> None:
        """A new run that stopped before writing anything but its config.yaml (a task file refused, a model
        or teacher that does not fit, a traceback while reading them: before its first step) leaves run.dir
        as it found it, so the corrected command starts there without run.overwrite. Only the config.yaml
        this command wrote into an empty run.dir is removed, under the lock; a run that wrote anything
        else (a trial, a seed, a checkpoint) keeps it all."""
        if not self._fresh:
            return
        self._fresh = False
        config = self.run_dir / "config.yaml"
        if rundir.used_entries(self.run_dir) == [config.name] and config.is_file() and not config.is_symlink():
            try:
                config.unlink()
            except OSError as err:  # never hide the error that ended the run
                log.warning("%s: could not remove config.yaml (%s)", self.run_dir, err)
                return
            log.info("%s: nothing was written but config.yaml; removed it, so run.dir is unused again",
                     self.run_dir)

    # -- collectives -------------------------------------------------------------------------------
    def sum(self, tensor: Tensor) -> Tensor:
        """Sum over ranks (the identity in one process), returned on the CPU."""
        return self.backend.all_reduce_sum(tensor.to(self.device)).cpu()

    def barrier(self) -> None:
        self.backend.barrier()

    def local_rows(self, rows: Tensor) -> tuple[Tensor, int, int, float]:
        """(this rank's rows, their offset in the global batch, how many are real, loss weight n_r·W/n)."""
        parts = torch.tensor_split(rows, self.world_size)
        mine = parts[self.rank]
        offset = sum(len(p) for p in parts[: self.rank])
        if len(mine) == 0:
            return rows[:1], offset, 0, 0.0
        return mine, offset, len(mine), len(mine) * self.world_size / len(rows)

    def shard_batches(self, num_batches: int) -> range:
        """The evaluation batches this rank predicts: every world-th, so each batch is the one-process batch."""
        return range(self.rank, num_batches, self.world_size)


def describe(runtime: Runtime) -> str:
    b = runtime.backend
    zero = f" ZeRO-{runtime.cfg.backend.zero_stage}" if b.name == "deepspeed" else ""
    return f"{b.name}{zero}, {runtime.world_size} process(es), {runtime.device}, {b.precision}"


def single_process(cfg: FinetuneConfig) -> Runtime:
    """A one-process CPU runtime that owns no run directory (for calling `train_seed` directly)."""
    return Runtime(cfg, backend=SingleProcessBackend(resolve_precision(cfg.finetune.precision, torch.device("cpu"))))
