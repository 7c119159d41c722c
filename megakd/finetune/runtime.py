"""Where a fine-tuning job runs: its backend and device, and the data-parallel split of its batches.

The run shell (`megakd.engine.run`) owns the backend, `run.dir` and the stop signals for the command's
life; `Runtime` is what the fine-tuning code asks of them: who this rank is, and the collectives
that split and assemble its batches.

`finetune.batch_size` is the global batch: rank r trains on the r-th contiguous part of each
batch (`torch.tensor_split`), and its loss is weighted by its share of the batch (n_r·W/n), so the
averaged data-parallel gradient is the gradient of the global batch mean even when the last
batch of an epoch does not divide evenly. A rank left without a row gets the batch's first row
with weight 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megakd.config import ConfigError
from megakd.engine import backend_factory
from megakd.engine.backends import MicroBatchLoopBackend, default_device
from megakd.engine.run import Run
from megakd.finetune.config import FinetuneConfig
from megakd.finish import device_type
from megakd.launch import Launch


def build_backend(cfg: FinetuneConfig, launch: Launch) -> MicroBatchLoopBackend:
    """The backend of a finished config (`FinetuneConfig.finish`: backend.name and finetune.precision
    resolved) on the device `finetune.device` asks for; a DeepSpeed engine takes one micro-batch per step,
    this rank's share of the global batch."""
    f = cfg.finetune
    backend = backend_factory.build_backend(cfg.backend, f.precision, f.batch_size // launch.world_size, launch, f.tf32)
    # one GPU bound per task: its device 0 (`default_device`)
    backend.device = default_device(backend.local_rank) if device_type(f.device) == "cuda" else torch.device("cpu")
    return backend


class Runtime:
    """The fine-tuning code's view of its run (see the module docstring)."""

    def __init__(self, run: Run):
        self.run = run
        self.backend: MicroBatchLoopBackend = run.backend
        self.session = run.session  # the run dir's lock, stop signals, saving
        self.run_dir = run.dir
        batch_size = run.job.cfg.finetune.batch_size
        if batch_size % self.world_size:
            raise ConfigError(f"finetune.batch_size={batch_size} (the global batch) is not divisible by the world "
                              f"size {self.world_size}")

    @property
    def resume(self) -> bool:
        """`--resume auto`: finished parts are reused and every training continues from its newest checkpoint."""
        return self.run.requested == "auto"

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
    zero = f" ZeRO-{runtime.run.job.cfg.backend.zero_stage}" if b.name == "deepspeed" else ""
    return f"{b.name}{zero}, {runtime.world_size} process(es), {runtime.device}, {b.precision}"
