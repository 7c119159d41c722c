"""DeepSpeed backend: ZeRO stage 0-3, fp32 / bf16 / fp16, one engine per optimized unit.

Under DecoupledOptim the generator and discriminator each get their own engine (DeepSpeed allows
one optimizer per engine: the GAN-tutorial pattern), so each keeps its own optimizer, LR schedule
and clipping; original ELECTRA and BERT-MLM have one unit and so one engine. The engines wrap the
*loss* modules (loss computed in forward), which is what makes ZeRO-3 work: every parameter the
objective touches (e.g. the tied decoder weight used by the fused MLM loss) is read inside the
engine's forward, where ZeRO-3 gathers it on access.

Within the shared micro-batch loop (`MicroBatchLoopBackend.train_step`): `backward` gets the
per-micro-batch mean loss, and `step` runs once per optimizer step. DeepSpeed divides by the
accumulation steps itself and counts micro-batches in `engine.step()`, so `backward` advances that
counter off the boundary and `step` is the boundary call. Clipping is DeepSpeed's
(`gradient_clipping`, always set explicitly: DeepSpeed 0.19 clips at 1.0 by default) at
`clip_norm * loss_scale`, i.e. on the unweighted gradient, exactly as the single-process backend does.

User settings (`backend.deepspeed_config=FILE.json`) are merged into what megakd derives with
HF's `"auto"` convention: `"auto"` takes megakd's value, a value that contradicts a key megakd
derives from its own config is refused naming both, and everything else (bucket sizes,
overlap_comm, offload, activation settings, `data_types.grad_accum_dtype`, ...) passes through, replacing
megakd's defaults (`EngineConfigs.derived`). With
`zero_optimization.offload_optimizer` each unit's optimizer becomes DeepSpeed's CPU Adam (in
AdamW mode, same groups and hyperparameters): ZeRO-Offload steps on the CPU copy of the states.

Checkpoints: `<step_dir>/<unit>/ds/...` via `engine.save_checkpoint(<step_dir>/<unit>, tag="ds")`;
`megakd.convert` consolidates them (zero_to_fp32 under ZeRO 1-3; DeepSpeed's BF16_Optimizer, which
ZeRO-1 + bf16 with fp32 accumulation becomes, in `megakd.store.checkpoint_models`). DeepSpeed's loaders unpickle;
`megakd.store.files.deepspeed_safe_loading` makes them weights-only with an allow-list.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megakd.config import ConfigError
from megakd.engine.backends import (
    ProcessGroupBackend,
    create_process_group,
    free_local_port,
    init_distributed,
    local_cuda_index,
    step_all_or_none,
)
from megakd.engine.deepspeed_config import EngineConfigs
from megakd.engine.units import Unit
from megakd.errors import UserError
from megakd.launch import Launch
from megakd.store.checkpoint import DEEPSPEED_TAG
from megakd.store.checkpoint_models import WEIGHTS_SUFFIX
from megakd.store.files import StoreError, deepspeed_safe_loading
from megakd.store.universal import (
    convert_to_universal,
    saved_param_groups,
    universal_root,
    universal_support,
)

log = logging.getLogger(__name__)

def offloads_optimizer(ds_config: dict) -> bool:
    offload = ds_config.get("zero_optimization", {}).get("offload_optimizer") or {}
    return offload.get("device", "none") != "none"


def cpu_adam_like(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """DeepSpeed's CPU Adam with `optimizer`'s parameter groups and AdamW hyperparameters."""
    if type(optimizer) not in (torch.optim.AdamW, torch.optim.Adam):
        raise ConfigError(f"backend.deepspeed_config: offload_optimizer replaces the optimizer by DeepSpeed's CPU "
                          f"AdamW, which is not this run's {type(optimizer).__name__}; remove offload_optimizer")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    announce_op_build("CPUAdamBuilder", "ZeRO-Offload's CPU Adam")
    d = optimizer.defaults
    groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
    return DeepSpeedCPUAdam(groups, lr=d["lr"], betas=d["betas"], eps=d["eps"], adamw_mode=True)


def announce_op_build(builder_name: str, what: str) -> None:
    """One line before DeepSpeed loads its C++ op `builder_name` where that load compiles it first.

    DeepSpeed's `OpBuilder.load` imports an op built at install time (`DS_BUILD_*`) or one this process
    loaded already; otherwise torch's JIT loader runs g++ through ninja unless the extensions directory
    holds the library, newer than its sources (what ninja checks). An op DeepSpeed finds incompatible
    is skipped or refused at once. Nothing is built or loaded here (the directory is made, as a build would).
    """
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops
    from deepspeed.ops.op_builder.builder import OpBuilder, probe_is_compatible
    from torch.utils.cpp_extension import LIB_EXT, _get_build_directory

    builder = get_accelerator().create_op_builder(builder_name)
    if (builder is None or not probe_is_compatible(builder) or builder.name in OpBuilder._loaded_ops
            or (installed_ops.get(builder.name, False) and accelerator_name == get_accelerator()._name)):
        return
    directory = Path(_get_build_directory(builder.name, verbose=False))
    library = directory / f"{builder.name}{LIB_EXT}"
    sources = [Path(builder.deepspeed_src_path(source)) for source in builder.sources()]
    if library.is_file() and all(library.stat().st_mtime >= source.stat().st_mtime for source in sources):
        return
    log.info("compiling DeepSpeed's %s op (%s) with the C++ compiler into %s: once per machine, about a minute on 2 "
             "CPU cores (docs/distributed.md: pre-building it)", builder.name, what, directory)


def init_deepspeed(launch: Launch, dist_backend: str) -> tuple[int, int, int]:
    """Join the launcher's process group (or a private one-process group) and DeepSpeed's comm layer.

    Returns (rank, world_size, local_rank). DeepSpeed needs a process group even for one
    process; a private loopback one leaves RANK/MASTER_* alone.
    """
    import deepspeed

    rank, world, local_rank = init_distributed(launch, dist_backend)
    # deepspeed.initialize reads LOCAL_RANK from the environment, also when the process group
    # already exists (e.g. an earlier engine in this process); for a lone process it is 0. DeepSpeed
    # takes it as its CUDA device ordinal: with one GPU bound per task that is the task's device 0.
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    if torch.cuda.is_available():
        os.environ["LOCAL_RANK"] = str(local_cuda_index(local_rank))
    if not dist.is_initialized():
        create_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_local_port()}", rank=0, world_size=1)
    announce_op_build("ShareMemCommBuilder", "the shared-memory collectives of DeepSpeed's CPU comm layer")
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    return rank, world, local_rank


class ProcessWideState:
    """What DeepSpeed changes for the whole process, read before it runs so that it can be put back.

    ZeRO-3 (`deepspeed.initialize` runs `zero.Init` on the model) swaps `torch.nn.functional.linear` for
    its memory-efficient linear "until manually reset": every model built later in the process (a
    teacher, an evaluation, the next job or test) would run DeepSpeed's linear, which keeps each bias
    for backward and adds it after the matmul (bench/memory.py counts it under ZeRO-3). `LOCAL_RANK`
    is set by `init_deepspeed` for a lone process, and `sys.excepthook` wrapped by the process group
    DeepSpeed creates when none exists. `put_back` restores the three.
    """

    def __init__(self):
        self.linear = torch.nn.functional.linear
        self.local_rank = os.environ.get("LOCAL_RANK")
        self.excepthook = sys.excepthook

    def put_back(self) -> None:
        torch.nn.functional.linear = self.linear
        sys.excepthook = self.excepthook
        if self.local_rank is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = self.local_rank


class DeepSpeedBackend(ProcessGroupBackend):
    """One `deepspeed.DeepSpeedEngine` per unit, in the process group DeepSpeed's comm layer joined.
    What DeepSpeed changed process-wide lasts while the backend is open (`ProcessWideState`)."""

    name = "deepspeed"

    def __init__(self, engine_configs: EngineConfigs, launch: Launch):
        self.found = ProcessWideState()
        super().__init__(launch, engine_configs.precision, engine_configs.backend.dist_backend)
        self.zero_stage = engine_configs.backend.zero_stage
        self.engine_configs = engine_configs

    @property
    def holds_whole_model(self) -> bool:
        """ZeRO-3 partitions the parameters themselves over the ranks."""
        return self.zero_stage < 3

    @property
    def holds_steps(self) -> bool:
        """Only the plain fp32 engine (ZeRO-0) can skip an update whose gradients are finite (`skip_step`
        drops them and closes the window). The ZeRO, bf16 and fp16 optimizers skip only a non-finite
        step, so a held step would be applied (a resume after it would not be exact): under them a stop
        signal lets the step finish, and storage lost mid-run raises, as under the pipeline backend."""
        return self.precision == "fp32" and self.zero_stage == 0

    @staticmethod
    def join(launch: Launch, dist_backend: str) -> tuple[int, int, int]:
        return init_deepspeed(launch, dist_backend)

    def close(self) -> None:
        super().close()
        self.found.put_back()

    def wrap_units(self, units: list[Unit], accumulation_steps: int) -> None:
        import deepspeed

        self.accumulation_steps = accumulation_steps
        for unit in units:
            unit.loss_module.to(self.device)
            parameters = sum(p.numel() for group in unit.optimizer.param_groups for p in group["params"])
            ds_config = self.engine_configs.for_engine(unit.clip_norm * unit.loss_scale, accumulation_steps,
                                                       self.world_size, parameters)
            if offloads_optimizer(ds_config):
                unit.optimizer = cpu_adam_like(unit.optimizer)
                # the same schedule, now driving the CPU optimizer
                unit.scheduler = torch.optim.lr_scheduler.LambdaLR(unit.optimizer, unit.scheduler.lr_lambdas)
            # The torch optimizer and LambdaLR go in as client objects: DeepSpeed's ZeRO wrapper
            # steps this very optimizer (so `unit.lr` reads the live LR) and the engine steps the
            # schedule only when an update was applied. No DeepSpeed Adam is compiled.
            engine, _, _, _ = deepspeed.initialize(
                model=unit.loss_module, optimizer=unit.optimizer, lr_scheduler=unit.scheduler,
                config=ds_config, dist_init_required=False,
            )
            unit.wrapped = engine

    # -- one micro-batch (`no_sync` stays the loop's: the engine reduces at its own boundary) ----------
    def forward(self, unit: Unit, *args, **kwargs) -> dict:
        return unit.wrapped(*args, **kwargs)  # the engine casts to bf16/fp16 itself

    def backward(self, unit: Unit, loss: torch.Tensor) -> None:
        engine = unit.wrapped
        engine.backward(loss * unit.loss_scale)  # the engine divides by accumulation steps
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # off the boundary this only counts the micro-batch

    # -- the optimizer step --------------------------------------------------------------------
    def step(self, units: list[Unit]) -> dict[str, float] | None:
        """`step_all_or_none` on DeepSpeed engines, which clip at `gradient_clipping` themselves.

        On the plain fp32 path (ZeRO-0) every rank holds the full, reduced gradients, so the norms
        are known before any engine steps and a non-finite one skips every unit. The ZeRO, bf16 and
        fp16 optimizers compute the norm inside `engine.step()` and skip their own non-finite
        update (no schedule step); a unit whose norm was finite has then stepped, which is the one
        case where the two units' schedules can part by a step (`_stepped_anyway` logs it).
        """
        for unit in units:
            if not unit.wrapped.is_gradient_accumulation_boundary():
                raise RuntimeError(f"{unit.name}: optimizer step requested before the last micro-batch")
        if self.precision == "fp32" and self.zero_stage == 0:
            # the engine steps the bare torch optimizer (a wrapper's `_global_grad_norm` cannot tell:
            # BF16_Optimizer sets it only in its first step)
            norms = _on_host([_grad_norm(u.wrapped.module) for u in units])
            return step_all_or_none(units, norms, lambda unit, _norm: unit.wrapped.step(), self.skip_step)
        for unit in units:
            unit.wrapped.step()
        norms = _on_host([unit.wrapped.get_global_grad_norm() for unit in units])
        # (fp16: an overflow is the dynamic loss scaler's business, as in `MicroBatchLoopBackend.step`)
        return step_all_or_none(units, norms, _stepped_already, _stepped_anyway,
                                scaler_owns_overflow=self.precision == "fp16")

    def skip_step(self, unit: Unit) -> None:
        engine = unit.wrapped
        if hasattr(engine.optimizer, "overflow"):
            # ZeRO, bf16 and fp16 optimizers check the gradient norm and skip a non-finite step
            # themselves (no update, no schedule step, gradients dropped).
            engine.step()
            if engine.was_step_applied():
                log.warning("%s: DeepSpeed applied a step whose loss was non-finite (finite gradients)",
                            unit.name)
            return
        engine.zero_grad()
        engine.micro_steps += 1  # close the accumulation window without an update

    # -- checkpoint state ------------------------------------------------------------------------
    def save_units(self, units: list[Unit], directory: Path) -> None:
        """Every rank writes its own ZeRO partition. `save_checkpoint` holds barriers (after its directory,
        at its end): a rank whose write fails still goes through every engine's save, writing nothing more,
        and raises its first error after, so that no peer waits at a barrier it left (`RunSession.save`)."""
        error: BaseException | None = None
        for unit in units:
            engine = unit.wrapped
            writes = _WritesKeepGoing(engine.checkpoint_engine, failed=error)
            engine.checkpoint_engine = writes
            try:
                engine.save_checkpoint(str(directory / unit.name), tag=DEEPSPEED_TAG)
            finally:
                engine.checkpoint_engine = writes.inner
            error = writes.error
        if error is not None:
            raise error

    def load_units(self, units: list[Unit], directory: Path) -> None:
        for unit in units:
            path = directory / unit.name / DEEPSPEED_TAG
            if not path.is_dir():
                hint = (" (written by the single/ddp backend?)"
                        if (directory / f"{unit.name}{WEIGHTS_SUFFIX}").is_file() else "")
                raise FileNotFoundError(f"checkpoint {directory} has no DeepSpeed state for '{unit.name}' "
                                        f"(expected {path}){hint}")
            with deepspeed_safe_loading(path):
                loaded, _ = unit.wrapped.load_checkpoint(str(directory / unit.name), tag=DEEPSPEED_TAG,
                                                         load_optimizer_states=True, load_lr_scheduler_states=True)
            if loaded is None:
                raise RuntimeError(f"DeepSpeed could not load {path}")

    def load_units_resharded(self, units: list[Unit], directory: Path, run_dir: Path, saved_world: int) -> None:
        self.load_units_elastic(units, directory, run_dir)

    def load_units_elastic(self, units: list[Unit], directory: Path, run_dir: Path) -> None:
        """Load a checkpoint written by another number of processes (`load_units_resharded`).

        ZeRO 1-3 partition the optimizer state (and fp32 master weights) per saving rank: rank 0
        converts the checkpoint to DeepSpeed's universal form in `run_dir`
        (`megakd.store.universal`), every rank waits for it and loads its own new partition from
        there. Without ZeRO (stage 0) every rank saved the whole state, which loads as it is.
        """
        if not any((directory / u.name / DEEPSPEED_TAG).glob("*_optim_states.pt") for u in units):
            self.load_units(units, directory)
            return
        why = universal_support()
        if why is not None:
            raise UserError(f"checkpoint {directory} holds ZeRO state partitioned over another number of processes "
                            f"and {why}: resume with the saved world size, or start a new run from its weights "
                            f"(init.generator / init.discriminator = the checkpoint; optimizer and data start afresh)")
        error: BaseException | None = None
        if self.is_main:
            try:
                convert_to_universal(run_dir, directory, [u.name for u in units])
            except (StoreError, OSError) as err:
                error = err
        if self.all_reduce_sum(torch.tensor(float(error is not None))).item() > 0:
            raise error if error is not None else StoreError(
                f"{directory}: the universal checkpoint conversion failed on rank 0 (see its message)")
        converted = universal_root(run_dir) / directory.name
        for unit in units:
            path = converted / unit.name / DEEPSPEED_TAG
            with universal_loading(unit.wrapped), deepspeed_safe_loading(path):
                loaded, _ = unit.wrapped.load_checkpoint(str(converted / unit.name), tag=DEEPSPEED_TAG,
                                                         load_optimizer_states=True, load_lr_scheduler_states=True)
            if loaded is None:
                raise RuntimeError(f"DeepSpeed could not load the universal checkpoint {path}")
            _repair_universal_load(getattr(unit.wrapped.optimizer, "optimizer", unit.optimizer), path)


class _WritesKeepGoing:
    """A DeepSpeed checkpoint engine for one `save_checkpoint`: the first failed write (`save`, `makedirs`) is
    kept in `error` instead of raised, and every later write is skipped, so this rank reaches the save's
    barriers as its peers do. Everything else is the wrapped engine's."""

    def __init__(self, inner, failed: BaseException | None):
        self.inner, self.error = inner, failed

    def save(self, state_dict, path: str) -> None:
        self._write(self.inner.save, state_dict, path)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        self._write(self.inner.makedirs, path, exist_ok=exist_ok)

    def _write(self, write, *args, **kwargs) -> None:
        if self.error is not None:
            return
        try:
            write(*args, **kwargs)
        except (OSError, RuntimeError) as err:  # torch.save wraps an OSError in a RuntimeError
            self.error = err

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _repair_universal_load(optimizer: torch.optim.Optimizer, tag_dir: Path) -> None:
    """Undo two ZeRO-3 universal-loading faults of DeepSpeed 0.19 in the base optimizer (harmless under ZeRO-1/2).

    Its loader gives every parameter group the first group's hyperparameters (the no-decay group
    would decay): each group gets its own back from the converted copy, as ZeRO-1/2 load them.
    And it puts one `step` tensor into every group's state, which torch's Adam increments in
    place once per group and step (the second group's bias correction would run ahead): each
    state gets its own copy.
    """
    saved = saved_param_groups(tag_dir)
    if len(saved) != len(optimizer.param_groups):
        raise StoreError(f"{tag_dir}: {len(saved)} optimizer parameter groups, this run has "
                         f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved):
        group.update(values)
    for state in optimizer.state.values():
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


@contextlib.contextmanager
def universal_loading(engine):
    """Switch `checkpoint.load_universal` on in a built engine for one `load_checkpoint` call.

    DeepSpeed 0.19 reads the flag only while loading (`DeepSpeedEngine.load_universal_checkpoint()`
    in `load_checkpoint` / `_load_checkpoint` / `_load_zero_checkpoint`), never while building
    the engine or its ZeRO optimizer, so the engine built for training loads the universal copy as
    it is. Building a second engine instead would re-partition a module that ZeRO-3 already
    partitioned, and would turn every later same-size load into a universal one.
    """
    config = engine._config
    previous = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = previous



def _stepped_already(_unit: Unit, _norm: float) -> None:
    """A ZeRO/bf16/fp16 engine's update: it ran in `engine.step()`, which computed the norm."""


def _stepped_anyway(unit: Unit) -> None:
    """A ZeRO/bf16/fp16 engine skipped its own non-finite update; one whose norm was finite stepped."""
    if unit.wrapped.was_step_applied():
        log.warning("non-finite gradient norm: DeepSpeed skipped the update of the unit whose norm it was, "
                    "but %s stepped (finite norm)", unit.name)


def _grad_norm(module: torch.nn.Module) -> torch.Tensor | float:
    """The norm of the module's gradients, left on the device (`_on_host` reads all units' at once)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else 0.0


def _on_host(values: list) -> list[float]:
    """Each value (a float, or a 0-dim tensor on the device) as a float: one host-device sync for all the
    tensors, not one per unit."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    read = iter(torch.stack([t.detach().float().reshape(()) for t in tensors]).tolist() if tensors else ())
    return [next(read) if isinstance(v, torch.Tensor) else float(v) for v in values]
