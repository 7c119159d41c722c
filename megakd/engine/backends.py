"""Backends: how the units of a training layout run on one process or many.

A *unit* is one optimizer's world: the loss module it trains, its optimizer, LR schedule,
gradient clipping and loss scale; a layout (`megakd.engine.layouts`) owns its units. Every
backend implements one contract, `train_step(layout, micro_batches, step)`: one optimizer step
over `accumulation_steps` micro-batches, returning the gradient norms (or None when the step was
skipped), the summed statistics and the stop decision all ranks agreed on. `single`, `ddp` and
`deepspeed` share the micro-batch loop of `MicroBatchLoopBackend` (`SingleProcessBackend` is it
on one process; `ProcessGroupBackend` is it over the launcher's process group, which `DDPBackend`
and `DeepSpeedBackend` wrap their units for) and differ in how a unit's forward, backward and
optimizer step run; the pipeline backend hands the whole step to DeepSpeed's pipeline engine.
Every backend's optimizer step ends in `step_all_or_none`. What a backend can do is declared on
it (`TrainingBackend`), so no caller asks for its name or class. Models never import a backend.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import math
import os
import socket
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from megakd.engine.profiling import phase
from megakd.engine.units import StepContext, Unit
from megakd.errors import LaunchError, UserError
from megakd.launch import Launch
from megakd.store.checkpoint_models import OPTIM_SUFFIX, WEIGHTS_SUFFIX, load_state_checked
from megakd.store.files import load_state, load_weights, save_state, save_weights

if TYPE_CHECKING:
    from megakd.engine.layouts import Layout

log = logging.getLogger(__name__)


def init_distributed(launch: Launch, dist_backend: str = "auto") -> tuple[int, int, int]:
    """Join the process group of `launch` (torchrun / deepspeed / Slurm environment variables).

    Returns (rank, world_size, local_rank); a no-op returning (0, 1, 0) without a launcher. Under srun the
    variables torch's env:// rendezvous reads (RANK, WORLD_SIZE, LOCAL_RANK) are set from the launch.
    """
    if not launch.launched:
        return 0, 1, 0
    if launch.srun:
        for key, value in launch.torch_environ().items():
            os.environ.setdefault(key, value)
    rank, world, local_rank = launch.rank, launch.world_size, launch.local_rank
    if not dist.is_initialized():
        if dist_backend == "auto":
            dist_backend = "nccl" if torch.cuda.is_available() else "gloo"
        if dist_backend == "nccl":
            torch.cuda.set_device(local_cuda_index(local_rank))
        if rank == 0:  # a rank that never started (a node down, a bad host list) makes this wait for all
            log.info("joining the %s process group of %d ranks at %s:%s: waits until every rank has joined",
                     dist_backend, world, os.environ.get("MASTER_ADDR", "?"), os.environ.get("MASTER_PORT", "?"))
        create_process_group(dist_backend)
    return rank, world, local_rank


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a one-process group, a test server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_launcher(name: str, launch: Launch) -> None:
    """Refuse a multi-rank backend started as one bare process on a CUDA machine.

    Without RANK/WORLD_SIZE (or Slurm's SLURM_PROCID/SLURM_NTASKS, as `Launch.from_environ` reads them)
    DeepSpeed gets a private one-process gloo group holding CUDA tensors and DDP a world of one: a
    run that looks distributed and is not. On CPU that lone process is the reference run the tests
    compare against, so it stays.
    """
    if launch.launched or not torch.cuda.is_available():
        return
    gpus = max(torch.cuda.device_count(), 1)
    raise UserError(f"backend.name={name} on a CUDA machine needs a launcher, not a bare process: "
                    f"launch/torchrun.sh {gpus} [COMMAND] -c CONFIG (or launch/deepspeed.sh --num_gpus {gpus}, "
                    f"or launch/slurm.sbatch under sbatch)")


_created_process_group = False


_excepthooks: tuple = ()  # (sys.excepthook before the group, the one init_process_group put in its place)


def create_process_group(dist_backend: str, **kwargs) -> None:
    """`dist.init_process_group` with megakd's timeout, remembered for `exit_process`.

    torch wraps `sys.excepthook` to prefix tracebacks with `[rank<r>]` and never unwraps it: a process
    that joins groups one after another (GLUE's fine-tunings, a test worker) would stack one prefix per
    group. `leave_process_group` puts the hook back."""
    global _created_process_group, _excepthooks
    before = sys.excepthook
    dist.init_process_group(dist_backend, timeout=datetime.timedelta(minutes=30), **kwargs)
    _created_process_group = True
    _excepthooks = (before, sys.excepthook)


def exit_process(code: int) -> None:
    """End a command's process; one that created a process group skips the interpreter's teardown.

    gloo's worker threads release the tensors of the last collective they ran, which needs the GIL.
    DeepSpeed keeps references to its process groups (engines, ZeRO's parameters, its group
    registry), so `dist.destroy_process_group` cannot join those threads; if the interpreter has
    begun to finalize when one of them asks for the GIL, the thread is unwound inside a noexcept
    destructor and the process aborts ("terminate called without an active exception", SIGABRT)
    after a run that succeeded. So: run the atexit handlers (logging, wandb, DataLoader cleanup),
    flush, and `os._exit`. Without a process group this is plain `sys.exit`. docs/decisions.md has
    the details.
    """
    if not _created_process_group:
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


STORAGE_FAILED = "storage failure"  # `StepResult.skipped` when some rank's batches were stand-ins


@dataclass
class StepResult:
    """One optimizer step as every rank agreed on it."""

    norms: dict[str, float] | None  # each unit's gradient norm of its unweighted loss; None = skipped
    stats: dict[str, torch.Tensor]  # this rank's statistics summed over the micro-batches (incl. "tokens")
    skipped: str | None = None  # why the update was skipped
    stop: bool = False  # some rank received a stop signal: save and stop after this step
    interrupted: bool = False  # that signal was SIGINT on some rank


def local_cuda_index(local_rank: int) -> int:
    """The CUDA ordinal local rank `local_rank` trains on, among the devices this process sees.

    A launcher that shows each task all of its node's GPUs (torchrun, the deepspeed launcher, srun
    without GPU binding) leaves local rank r on device r. A site that binds one GPU per task
    (`--gpus-per-task=1`, `--gpu-bind=single:1`, device cgroups) shows each task one device, its 0,
    whatever its LOCAL_RANK: asking for device r there fails with "invalid device ordinal".
    """
    visible = torch.cuda.device_count()
    if local_rank < visible:
        return local_rank
    if visible == 1:
        return 0
    raise UserError(f"LOCAL_RANK={local_rank} (SLURM_LOCALID={os.environ.get('SLURM_LOCALID', 'unset')}) but this "
                    f"task sees {visible} CUDA devices (CUDA_VISIBLE_DEVICES="
                    f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): expected every GPU of the node or exactly "
                    "one per task (docs/cluster.md)")


def default_device(local_rank: int) -> torch.device:
    """This rank's GPU (`local_cuda_index`, made the current device, where Triton launches) when CUDA is
    available, else cpu."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = local_cuda_index(local_rank)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def cuda_tf32(enabled: bool) -> Callable[[], None]:
    """Let fp32 matmuls (cuBLAS) and convolutions (cuDNN) on CUDA run in TF32 (`enabled`) or IEEE fp32;
    returns what puts every switch back exactly as it was. CPU matmuls do not read these switches.

    Set through the `allow_tf32` switches: torch refuses to read those once `fp32_precision` has set
    the same thing (tests/global_state.py reads both). Setting cuBLAS's `allow_tf32` also turns its
    `fp32_precision` from "none" to "tf32" or "ieee", so putting back restores that too.
    """
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    saved = matmul.allow_tf32, matmul.fp32_precision, cudnn.allow_tf32
    matmul.allow_tf32 = cudnn.allow_tf32 = enabled

    def put_back() -> None:
        matmul.allow_tf32, cudnn.allow_tf32 = saved[0], saved[2]
        matmul.fp32_precision = saved[1]

    return put_back


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A CPU batch on `device`; the copies do not block the host (the loader pins its batches on CUDA)."""
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def stat_sums(device: torch.device) -> defaultdict[str, torch.Tensor]:
    """Running float64 sums on `device`: a micro-batch adds its statistics without a host sync."""
    return defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=device))


class TrainingBackend:
    """The contract every backend implements, and what all of them share (ranks, collectives).

    What a backend can do is declared here, for the trainer and the commands to ask instead of its
    name or class:

    - `holds_steps`: whether `train_step` honours `StepContext.held` (skips the update on every rank);
    - `holds_whole_model`: whether every process holds every parameter of the units' models, so that
      rank 0 can run a side job on them (the downstream probe); not under ZeRO-3 or the pipeline;
    - `load_units_resharded(units, directory, run_dir, saved_world)`: load a checkpoint written by
      another number of processes (the trainer's elastic resume), or refuse in one line naming the
      checkpoint and what to do instead.

    `name` says which backend this is, for logs and summaries only.
    """

    name = "base"
    holds_steps = False
    holds_whole_model = True
    tf32 = True  # fp32 matmuls and convolutions on a CUDA device run in TF32 (`use_device_settings`)

    def __init__(self, precision: str = "fp32", device: torch.device | None = None):
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = device if device is not None else torch.device("cpu")
        self.precision = precision
        self.accumulation_steps = 1
        self._put_back_tf32: Callable[[], None] | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """Rank in the data-parallel group (pipeline stages of one replica share their batches)."""
        return self.rank

    @property
    def data_world_size(self) -> int:
        return self.world_size

    def use_device_settings(self) -> None:
        """Set `tf32` (`cuda_tf32`) while the backend is open, on a CUDA device only: `prepare` calls this,
        once the device is final (fine-tuning picks its own), and `close` puts the settings back."""
        if self.device.type == "cuda" and self._put_back_tf32 is None:
            self._put_back_tf32 = cuda_tf32(self.tf32)

    # -- the contract ----------------------------------------------------------------------------
    def prepare(self, layout: Layout, accumulation_steps: int) -> None:
        """Wrap the layout's units for this backend; called once, before the first step."""
        raise NotImplementedError

    def train_step(self, layout: Layout, micro_batches: Iterator[dict], step: StepContext) -> StepResult:
        """One optimizer step over the next `accumulation_steps` micro-batches of `micro_batches`."""
        raise NotImplementedError

    def forward(self, unit: Unit, *args, **kwargs) -> dict:
        """A unit's forward outside training (validation), under the backend's wrapper and precision."""
        raise NotImplementedError

    def save_units(self, units: list[Unit], directory: Path) -> None:
        """Write every unit's state into `directory`. A backend whose save holds collectives reaches all of
        them on every rank even when this rank's writes fail, and raises the first error after
        (`RunSession.save` agrees on failures only after the writes: a rank that left early would hang
        its peers)."""
        raise NotImplementedError

    def load_units(self, units: list[Unit], directory: Path) -> None:
        raise NotImplementedError

    def load_units_resharded(self, units: list[Unit], directory: Path, run_dir: Path, saved_world: int) -> None:
        """Load a checkpoint that `saved_world` processes wrote into this world of another size.

        Here every rank saved or holds the whole (replicated) state, which loads as it is; a backend
        that partitions state re-cuts it (`run_dir` holds any converted copy) or refuses.
        """
        self.load_units(units, directory)

    def agree(self, *local_flags: bool) -> list[bool]:
        """Each flag, true on every rank if it is true on any (one all-reduce for all of them)."""
        total = self.all_reduce_sum(torch.tensor([float(f) for f in local_flags], dtype=torch.float64))
        return (total > 0).tolist()

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            tensor = tensor.to(self.device)
            dist.all_reduce(tensor)
        return tensor

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def close(self) -> None:
        """Put back what `use_device_settings` set (a subclass that overrides this calls it too)."""
        if self._put_back_tf32 is not None:
            self._put_back_tf32()
            self._put_back_tf32 = None


class MicroBatch:
    """One micro-batch's passes as a layout's `micro_step` drives them.

    `with run.unit(u):` opens unit u's pass (gradient sync held back unless this is the step's last
    micro-batch); inside it `forward` and `backward` run through the backend and the step's timer.
    """

    def __init__(self, backend: MicroBatchLoopBackend, last: bool,
                 timer: Callable[[str], contextlib.AbstractContextManager]):
        self.backend = backend
        self.last = last
        self.timer = timer

    def unit(self, unit: Unit) -> contextlib.AbstractContextManager:
        return self.backend.no_sync(unit, self.last)

    def forward(self, unit: Unit, *args, **kwargs) -> dict:
        with self.timer("forward"):
            return self.backend.forward(unit, *args, **kwargs)

    def backward(self, unit: Unit, loss: torch.Tensor) -> None:
        with self.timer("backward"):
            self.backend.backward(unit, loss)


def precision_autocast(precision: str, device: torch.device):
    """What `train.precision` does to a forward pass: nothing at fp32, autocast to bf16/fp16 otherwise
    (weights and optimizers stay fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


def step_all_or_none(units: list[Unit], norms: list[float], update: Callable[[Unit, float], None],
                     skip: Callable[[Unit], None], scaler_owns_overflow: bool = False) -> dict[str, float] | None:
    """The optimizer-step decision every backend makes, on each unit's gradient norm of its λ-weighted loss.

    Every unit updates (`update(unit, norm)`) or none does: a non-finite norm `skip`s each unit,
    which drops its gradients and leaves its LR schedule where it was, so the units' schedules and
    the trainer's step counter stay together. Returns each unit's norm of the unweighted loss (norm / λ,
    as its clip threshold `Unit.max_grad_norm` is λ times clip_norm), or None when skipped. With
    `scaler_owns_overflow` (fp16's dynamic loss scale) a non-finite norm is the scaler's business:
    every unit goes on to `update`, where the scaler skips the overflowed update.
    """
    if not scaler_owns_overflow and not all(math.isfinite(n) for n in norms):
        for unit in units:
            skip(unit)
        return None
    for unit, norm in zip(units, norms):
        update(unit, norm)
    return {unit.name: norm / unit.loss_scale for unit, norm in zip(units, norms)}


class MicroBatchLoopBackend(TrainingBackend):
    """The micro-batch loop that the single, ddp and deepspeed backends share, complete on one process.

    `SingleProcessBackend` is this loop as it stands; the `ProcessGroupBackend`s (`DDPBackend`,
    `DeepSpeedBackend`) change how a unit is wrapped, how its gradients sync, and how it steps. The
    pipeline backend hands the whole step to DeepSpeed and derives from `TrainingBackend` instead.
    """

    holds_steps = True

    # -- setup -------------------------------------------------------------------------------
    def prepare(self, layout: Layout, accumulation_steps: int) -> None:
        self.use_device_settings()
        self.wrap_units(list(layout.units.values()), accumulation_steps)

    def wrap_units(self, units: list[Unit], accumulation_steps: int) -> None:
        """Move each unit's loss module (and so its optimizer's parameters, whose state follows them) to the
        backend's device and wrap it for this backend (its own gradient sync, precision, engine)."""
        self.accumulation_steps = accumulation_steps
        for unit in units:
            unit.loss_module.to(self.device)
            unit.wrapped = unit.loss_module
            if self.precision == "fp16":
                unit.scaler = torch.amp.GradScaler(self.device.type)

    def autocast(self):
        return precision_autocast(self.precision, self.device)

    # -- the step ------------------------------------------------------------------------------
    def train_step(self, layout: Layout, micro_batches: Iterator[dict], step: StepContext) -> StepResult:
        """The micro-batch loop; then all ranks agree (one all-reduce) on finiteness and stopping.

        A non-finite loss on any rank skips every unit's update; so does a non-finite gradient norm
        (`step`) and a rank whose storage failed (`StepContext.held`). The stop flags ride on the
        same all-reduce.
        """
        stats = stat_sums(self.device)
        losses: list[torch.Tensor] = []
        units = list(layout.units.values())
        for i in range(self.accumulation_steps):
            with phase("data"):
                batch = next(micro_batches)
                stats["tokens"] += float(batch["attention_mask"].sum())  # still on the host: no sync
                batch = to_device(batch, self.device)
            run = MicroBatch(self, last=i == self.accumulation_steps - 1, timer=step.timer)
            out = layout.micro_step(run, batch, step)
            losses += out.losses
            for key, value in out.stats.items():
                stats[key] += value.detach().double()
        finite = bool(torch.isfinite(torch.stack([x.float() for x in losses])).all())
        non_finite, stop, interrupted, held = self.agree(not finite, *step.stop_flags(), step.held())
        if non_finite or held:
            for unit in units:
                self.skip_step(unit)
            return StepResult(None, dict(stats), STORAGE_FAILED if held else "non-finite loss", stop, interrupted)
        with step.timer("optimizer"), phase("optimizer"):
            norms = self.step(units)
        return StepResult(norms, dict(stats), None if norms is not None else "non-finite gradient norm",
                          stop, interrupted)

    # -- one unit's pass -------------------------------------------------------------------------
    def no_sync(self, unit: Unit, last_micro_batch: bool):
        """Context for forward+backward of a micro-batch that is not the last of its step."""
        return contextlib.nullcontext()

    def forward(self, unit: Unit, *args, **kwargs) -> dict:
        with self.autocast():
            return unit.wrapped(*args, **kwargs)

    def backward(self, unit: Unit, loss: torch.Tensor) -> None:
        loss = loss * (unit.loss_scale / self.accumulation_steps)
        if unit.scaler is not None:
            loss = unit.scaler.scale(loss)
        loss.backward()

    # -- the optimizer step --------------------------------------------------------------------
    def step(self, units: list[Unit]) -> dict[str, float] | None:
        """Unscale (fp16) and clip every unit's gradients, then `step_all_or_none`.

        Under fp16 the loss scaler owns overflow: a non-finite norm there means the scale was too
        high; `GradScaler.step` skips that update and `update` lowers the scale, as it always has.
        """
        norms = torch.stack([self._clip(unit).to(self.device) for unit in units]).tolist()  # one host sync
        return step_all_or_none(units, norms, self._update, self.skip_step,
                                scaler_owns_overflow=any(unit.scaler is not None for unit in units))

    def _clip(self, unit: Unit) -> torch.Tensor:
        """Unscale (fp16) and clip this unit's gradients; returns the norm before clipping (on the
        device: `step` reads all units' norms with one host sync)."""
        if unit.scaler is not None:
            unit.scaler.unscale_(unit.optimizer)
        params = [p for g in unit.optimizer.param_groups for p in g["params"]]
        return torch.nn.utils.clip_grad_norm_(params, unit.max_grad_norm)

    @staticmethod
    def _update(unit: Unit, _norm: float) -> None:
        if unit.scaler is not None:
            unit.scaler.step(unit.optimizer)
            unit.scaler.update()
        else:
            unit.optimizer.step()
        unit.scheduler.step()
        unit.optimizer.zero_grad(set_to_none=True)

    def skip_step(self, unit: Unit) -> None:
        """Drop this step's gradients (non-finite loss or norm) without touching optimizer or schedule."""
        unit.optimizer.zero_grad(set_to_none=True)

    # -- checkpoint state ------------------------------------------------------------------------
    def save_units(self, units: list[Unit], directory: Path) -> None:
        """Every unit's weights (`<unit>.safetensors`) and optimizer/schedule/scaler state (`<unit>.optim.pt`)."""
        if not self.is_main:
            return
        for unit in units:
            save_weights(unit.model.state_dict(), directory / f"{unit.name}{WEIGHTS_SUFFIX}")
            state = {"optimizer": unit.optimizer.state_dict(), "scheduler": unit.scheduler.state_dict()}
            if unit.scaler is not None:
                state["scaler"] = unit.scaler.state_dict()
            save_state(state, directory / f"{unit.name}{OPTIM_SUFFIX}")

    def load_units(self, units: list[Unit], directory: Path) -> None:
        for unit in units:
            weights = directory / f"{unit.name}{WEIGHTS_SUFFIX}"
            if not weights.is_file():
                raise FileNotFoundError(f"checkpoint {directory} has no state for '{unit.name}' ({weights.name})")
            load_state_checked(unit.model, load_weights(weights, self.device), str(weights),
                               f"{directory / 'config.yaml'} (model)")
            state = load_state(directory / f"{unit.name}{OPTIM_SUFFIX}", self.device)
            unit.optimizer.load_state_dict(state["optimizer"])
            unit.scheduler.load_state_dict(state["scheduler"])
            if unit.scaler is not None and "scaler" in state:
                unit.scaler.load_state_dict(state["scaler"])


class SingleProcessBackend(MicroBatchLoopBackend):
    """`backend.name=single`: one process, no gradient sync; the micro-batch loop as it stands."""

    name = "single"


def leave_process_group() -> None:
    """Destroy the process group; through `deepspeed.comm` once DeepSpeed has joined it, whose teardown
    also drops the groups DeepSpeed cached. A DeepSpeed engine in a group joined again in the same
    process still hangs in `new_group` (DeepSpeed 0.19: `groups._clone_world_group`), so a process runs
    one distributed DeepSpeed command; tests that run several keep one group (tests/distributed/worker.py)."""
    if not dist.is_initialized():
        return
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and ds_comm.cdb is not None:
        ds_comm.destroy_process_group()
    else:
        dist.destroy_process_group()
    if _excepthooks and sys.excepthook is _excepthooks[1]:
        sys.excepthook = _excepthooks[0]


def single_process_backend(precision: str, launch: Launch) -> SingleProcessBackend:
    """`backend.name=single`, refused in a rank that a launcher started among several.

    Each of those ranks would otherwise train the whole run on its own, and all but one would be
    turned away by the run directory's lock with a message that hides the cause.
    """
    if launch.world_size > 1:
        raise LaunchError(f"backend.name=single, but the launcher started {launch.world_size} ranks: set "
                          "backend.name=ddp (or auto, or deepspeed) to train them as one run, or start one "
                          "process")
    return SingleProcessBackend(precision, default_device(launch.local_rank))


class ProcessGroupBackend(MicroBatchLoopBackend):
    """The micro-batch loop over the launcher's process group: joined when built, left on `close`."""

    def __init__(self, launch: Launch, precision: str = "fp32", dist_backend: str = "auto"):
        super().__init__(precision)
        self.rank, self.world_size, self.local_rank = self.join(launch, dist_backend)
        self.device = default_device(self.local_rank)

    @staticmethod
    def join(launch: Launch, dist_backend: str) -> tuple[int, int, int]:
        """Join the launcher's process group: (rank, world_size, local_rank)."""
        return init_distributed(launch, dist_backend)

    def close(self) -> None:
        super().close()
        leave_process_group()


class DDPBackend(ProcessGroupBackend):
    """torch DistributedDataParallel over gloo (CPU) or nccl (GPU); one DDP wrapper per unit."""

    name = "ddp"

    def wrap_units(self, units: list[Unit], accumulation_steps: int) -> None:
        super().wrap_units(units, accumulation_steps)
        if self.world_size == 1:
            return
        for unit in units:
            unit.wrapped = nn.parallel.DistributedDataParallel(
                unit.loss_module, device_ids=[self.device.index] if self.device.type == "cuda" else None
            )

    def no_sync(self, unit: Unit, last_micro_batch: bool):
        if last_micro_batch or not isinstance(unit.wrapped, nn.parallel.DistributedDataParallel):
            return contextlib.nullcontext()
        return unit.wrapped.no_sync()
