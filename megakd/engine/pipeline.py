"""Pipeline parallelism through DeepSpeed's `PipelineModule`: BERT-MLM and ELECTRA (DecoupledOptim).

DeepSpeed's pipeline engine runs one optimizer and only `train_batch`, so ELECTRA becomes ONE
pipeline: generator (embeddings, layers, MLM head + sampling) then discriminator (embeddings,
layers, RTD head). Every rank builds both models in full from `train.seed` (the same init as any
other backend) and keeps the pieces of its stage; DeepSpeed gets exactly P stage modules and
places one per stage, so megakd decides the partition (`partition`): encoder layers balanced by
parameter count, embeddings with their model's first layer, heads with its last.

Between stages the activation is a tuple of tensors: the hidden states (and the T5 relative
bias, which then takes its gradient back to the stage that owns the table), the original ids,
the attention and MLM masks and, after the generator head, the corrupted ids and the MLM loss.
Under DWT the masked ids also travel from the first stage to the generator head's stage, where
the frozen teacher (`TeacherKD`, a plain object: no stage module, so DeepSpeed neither places
nor updates it) reads them with the masks; `GeneratorLoss` adds the KD term there exactly as on
every other backend, with α_s(t) from the step being computed.
The MLM loss travels down the pipeline as a tensor (one float per micro-batch, where the masked
hidden states would be [N, E] with N varying): the last stage returns L_MLM + λ·L_RTD (the layout's
`combined_loss`). λ cannot reach the generator: its parameters get gradient only through L_MLM (the
corrupted ids are integers and DecoupledOptim shares no embedding), so, as in the other backends, λ
only scales the discriminator's gradient, whose clipping threshold is clip_norm·λ.

The heads run the layout's own loss modules (`with_model`: the same settings) around `_Encoded`, a
stand-in model whose encoder already ran on earlier stages, and take what they compute from the
layout's step pieces, the ones its `micro_step` runs on every other backend (`generator_inputs`,
`corrupted`, `discriminator_inputs`, `combined_loss`): an objective is written once, in the layout.
Their statistics are summed on the stage that computes them and reduced over all ranks by the
trainer, like every other backend's.
DeepSpeed's `train_batch` has no way to hand a middle stage anything per call, so the step being
computed (its index and sampling generator) is bound to the stage for the duration of that one
call (`PipelineStage.running`) and unbound after it.

Precision: fp32 weights, gradients and optimizer state (`train.precision=fp32`, which the config
requires: per-model clipping runs on fp32 gradients), with the matmuls in TF32 on a CUDA device
unless `train.tf32=false` (`TrainingBackend.use_device_settings`).

The client optimizer (`PipelineOptimizer`) keeps each unit's own AdamW, LR schedule and clip
threshold: DeepSpeed's `gradient_clipping` is 0 and the per-unit norm is all-reduced over the
pipe group (squared norms), after summing the gradient of a weight held by two stages (the
generator's word embeddings, tied to its MLM output matrix) over those stages and counting it once.

Checkpoints: `engine.save_checkpoint(<step_dir>/pipeline, tag="ds")` for resumption, plus a
consolidated `<unit>.safetensors` (the single backend's weights file) that `megakd convert` and the
tests read without knowing the partition.
"""

from __future__ import annotations

import contextlib
import io
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from megakd.config import ConfigError
from megakd.engine.backends import (
    StepResult,
    TrainingBackend,
    default_device,
    leave_process_group,
    step_all_or_none,
)
from megakd.engine.deepspeed_backend import ProcessWideState, init_deepspeed
from megakd.engine.deepspeed_config import EngineConfigs
from megakd.engine.layouts import DecoupledElectra, Layout
from megakd.engine.losses import DiscriminatorLoss, GeneratorLoss
from megakd.engine.units import StepContext, Unit
from megakd.errors import UserError
from megakd.launch import Launch
from megakd.models.electra import MaskedLM
from megakd.models.encoder import Encoder, run_layer
from megakd.store.checkpoint import DEEPSPEED_TAG
from megakd.store.checkpoint_models import WEIGHTS_SUFFIX
from megakd.store.files import deepspeed_safe_loading, save_weights

# The order of the named tensors in an activation tuple (DeepSpeed sends tuples, not dicts).
ORDER = ("hidden", "position_bias", "mlm_loss", "masked_input_ids", "corrupted", "input_ids", "attention_mask",
         "mlm_mask")
DATA_KEYS = ("masked_input_ids", "input_ids", "attention_mask", "mlm_mask")  # what the first stage reads, in ORDER
MASKS = ("attention_mask", "mlm_mask")  # bool in the models, uint8 on the wire (not every backend sends bool)


def _ordered(keys) -> tuple[str, ...]:
    return tuple(k for k in ORDER if k in keys)


class _Encoded(nn.Module):
    """The model as a head's loss module sees it on a later stage: its encoder already ran.

    `forward` returns the hidden states the stage received (set in `hidden` just before the loss
    module runs); `head` and `hidden_at` are the real model's, so the loss modules' losses, sampling and
    statistics run unchanged.
    """

    hidden_at = MaskedLM.hidden_at

    def __init__(self, model: nn.Module):
        super().__init__()
        self.head = model.head
        self.hidden: Tensor | None = None

    def forward(self, *_inputs, **_options) -> Tensor:
        hidden, self.hidden = self.hidden, None
        return hidden


class _Embed(nn.Module):
    """A model's embeddings (and relative-bias table) through `Encoder.prepare`.

    The masked ids are dropped once embedded unless `keep_masked_ids` (DWT: the teacher on the
    generator head's stage reads them).
    """

    def __init__(self, encoder: Encoder, source: str, keep_masked_ids: bool = False):
        super().__init__()
        self._encoder = (encoder,)  # out of the module tree: its layers live on their own stages
        self.embeddings = encoder.embeddings
        self.relative_bias = encoder.relative_bias
        self.source = source
        self.dropped = set() if keep_masked_ids else {"masked_input_ids"}

    def keys_after(self, keys: set[str]) -> set[str]:
        keys = (keys - self.dropped) | {"hidden"}
        return keys | {"position_bias"} if self.relative_bias is not None else keys

    def forward(self, state: dict) -> dict:
        x, _, position_bias = self._encoder[0].prepare(state[self.source], state["attention_mask"])
        state = {k: v for k, v in state.items() if k not in self.dropped}
        state["hidden"] = x
        if position_bias is not None:
            state["position_bias"] = position_bias
        return state


class _Layer(nn.Module):
    """One encoder layer through the encoder's own `run_layer` (activation checkpointing included)."""

    def __init__(self, layer: nn.Module, activation_checkpointing: bool):
        super().__init__()
        self.layer = layer
        self.activation_checkpointing = activation_checkpointing

    def keys_after(self, keys: set[str]) -> set[str]:
        return keys

    def forward(self, state: dict) -> dict:
        key_mask = state["attention_mask"][:, None, None, :]
        hidden = run_layer(self.layer, state["hidden"], key_mask, state.get("position_bias"),
                           self.activation_checkpointing)
        return {**state, "hidden": hidden}


class _Head(nn.Module):
    """Base of the two heads: statistics summed over the micro-batches of a step, on the device they
    are computed on (read by the trainer once per log line, not per micro-batch)."""

    def __init__(self):
        super().__init__()
        self.stats: dict[str, Tensor] = {}

    def _add(self, stats: dict[str, Tensor]) -> None:
        for key, value in stats.items():
            value = value.detach().double()
            if key not in self.stats:
                self.stats[key] = torch.zeros((), dtype=torch.float64, device=value.device)
            self.stats[key] += value


class _GeneratorHead(_Head):
    """The generator's loss module on the hidden states (MLM, plus DWT's KD term); under ELECTRA also
    the corrupted ids. What it computes is the layout's (`Layout.generator_inputs`, `corrupted`)."""

    CONSUMED = ("hidden", "position_bias", "masked_input_ids")

    def __init__(self, layout: Layout, loss_module: GeneratorLoss, electra: bool):
        super().__init__()
        # `task`, not `loss_module`: the module tree's name, which keys the head's parameters
        # (task.model.head.*) in DeepSpeed's pipeline checkpoints; renaming it would orphan them.
        self.task = loss_module.with_model(_Encoded(loss_module.model))
        self.layout = layout  # a plain object: outside the module tree
        self.electra = electra
        self.step: StepContext | None = None  # bound by `PipelineStage.running` for one train_batch

    def keys_after(self, keys: set[str]) -> set[str]:
        keys = keys - set(self.CONSUMED)
        return keys | {"corrupted", "mlm_loss"} if self.electra else {"loss"}

    def forward(self, state: dict) -> dict:
        self.task.model.hidden = state["hidden"]
        if self.step is None:
            raise RuntimeError("pipeline generator head run outside PipelineStage.running(step)")
        # The student embedded its ids upstream; they are here only under DWT, for the teacher.
        batch = {**state, "masked_input_ids": state.get("masked_input_ids")}
        out = self.task(*self.layout.generator_inputs(batch, self.step))
        self._add(out["stats"])
        if not self.electra:
            return {"loss": out["loss"]}
        rest = {k: v for k, v in state.items() if k not in self.CONSUMED}
        return {**rest, "corrupted": self.layout.corrupted(state, out), "mlm_loss": out["loss"].reshape(1)}


class _DiscriminatorHead(_Head):
    """The discriminator's loss module on the hidden states; returns the step's one loss, the layout's
    `combined_loss` of the generator's (carried as `mlm_loss`) and its own."""

    def __init__(self, layout: DecoupledElectra, loss_module: DiscriminatorLoss):
        super().__init__()
        self.task = loss_module.with_model(_Encoded(loss_module.model))  # `task`: see _GeneratorHead
        self.layout = layout

    def keys_after(self, keys: set[str]) -> set[str]:
        return {"loss"}

    def forward(self, state: dict) -> dict:
        self.task.model.hidden = state["hidden"]
        out = self.task(*self.layout.discriminator_inputs(state, state["corrupted"]))
        self._add(out["stats"])
        return {"loss": self.layout.combined_loss(state["mlm_loss"][0], out["loss"])}


class PipelineStage(nn.Module):
    """The pieces one stage runs, between the activation tuples it receives and sends."""

    def __init__(self, pieces: list[nn.Module], in_keys: tuple[str, ...]):
        super().__init__()
        self.pieces = nn.ModuleList(pieces)
        self.in_keys = in_keys

    def forward(self, inputs: tuple[Tensor, ...]) -> Tensor | tuple[Tensor, ...]:
        state = {k: v.bool() if k in MASKS else v for k, v in zip(self.in_keys, inputs)}
        for piece in self.pieces:
            state = piece(state)
        if "loss" in state:
            return state["loss"]
        # p2p sends need contiguous tensors (the relative bias is a permuted view)
        return tuple(state[k].to(torch.uint8) if k in MASKS else state[k].contiguous() for k in _ordered(state))

    def heads(self) -> list[_Head]:
        return [p for p in self.pieces if isinstance(p, _Head)]

    @contextlib.contextmanager
    def running(self, step: StepContext):
        """Bind `step` to this stage's generator head for one `train_batch`, and unbind it after."""
        heads = [h for h in self.heads() if isinstance(h, _GeneratorHead)]
        for head in heads:
            head.step = step
        try:
            yield
        finally:
            for head in heads:
                head.step = None


def _model_pieces(model: nn.Module, head: nn.Module, source: str,
                  keep_masked_ids: bool = False) -> list[tuple[list[nn.Module], int]]:
    """(pieces, parameter count) per encoder layer: embeddings join the first layer, the head the last."""
    encoder = model.encoder
    items = []
    for i, layer in enumerate(encoder.layers):
        pieces: list[nn.Module] = [_Layer(layer, encoder.config.activation_checkpointing)]
        if i == 0:
            pieces.insert(0, _Embed(encoder, source, keep_masked_ids))
        if i == len(encoder.layers) - 1:
            pieces.append(head)
        items.append((pieces, sum(p.numel() for piece in pieces for p in piece.parameters())))
    return items


def partition(weights: list[int], num_stages: int) -> list[int]:
    """Stage boundaries [0, ..., len(weights)] with every stage non-empty and the heaviest one light."""
    from deepspeed.runtime.utils import partition_balanced

    return list(partition_balanced(weights, num_stages))


def build_stages(layout: Layout, num_stages: int) -> list[PipelineStage]:
    """The P stage modules over the layout's models (every rank builds all P; DeepSpeed keeps one)."""
    generator, discriminator = layout.pipeline_units()
    head = _GeneratorHead(layout, generator.loss_module, electra=discriminator is not None)
    items = _model_pieces(generator.model, head, "masked_input_ids", keep_masked_ids=layout.kd is not None)
    if discriminator is not None:
        items += _model_pieces(discriminator.model, _DiscriminatorHead(layout, discriminator.loss_module),
                               "corrupted")
    bounds = partition([w for _, w in items], num_stages)
    stages, keys = [], set(DATA_KEYS)
    for s in range(num_stages):
        pieces = [p for group, _ in items[bounds[s]:bounds[s + 1]] for p in group]
        stages.append(PipelineStage(pieces, _ordered(keys)))
        for piece in pieces:
            keys = piece.keys_after(keys)
    return stages


class _Schedules:
    """The units' LR schedules as the one client scheduler DeepSpeed steps (after applied updates)."""

    def __init__(self, units: list[Unit]):
        self.units = units

    def step(self, *_args, **_kwargs) -> None:
        for unit in self.units:
            unit.scheduler.step()

    def state_dict(self) -> dict:
        return {u.name: u.scheduler.state_dict() for u in self.units}

    def load_state_dict(self, state: dict) -> None:
        for u in self.units:
            u.scheduler.load_state_dict(state[u.name])


class PipelineOptimizer(torch.optim.Optimizer):
    """The units' own optimizers behind DeepSpeed's one optimizer slot, each with its own clipping.

    `step` sums the gradients of weights held by two stages, computes every unit's gradient norm
    over the whole pipeline (squared norms all-reduced over the pipe group, a shared weight counted
    on its first stage only), and `step_all_or_none` clips each unit at clip_norm·loss_scale as the
    single backend does and steps each unit's optimizer. A non-finite norm skips the update of every
    unit and sets `overflow`, which makes DeepSpeed leave the schedules alone; `norms` is then None.
    """

    def __init__(self, units: list[Unit], pipe_group, ties: list[tuple[nn.Parameter, object, bool]],
                 device: torch.device):
        # The groups are the units' own dicts, so the LRs DeepSpeed and the trainer read are live.
        super().__init__([g for u in units for g in u.optimizer.param_groups], {})
        self.units = units
        self.pipe_group = pipe_group
        self.ties = ties  # (parameter, process group of the stages holding it, counted here)
        self.device = device  # where a unit with no gradient on this stage puts its zero
        self.overflow = False
        self.norms: dict[str, float] | None = None

    @torch.no_grad()
    def step(self, closure=None):
        replicas = set()
        for param, group, counted in self.ties:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, group=group)
            if not counted:
                replicas.add(param)
        squares = []
        for unit in self.units:
            grads = [p.grad for g in unit.optimizer.param_groups for p in g["params"]
                     if p.grad is not None and p not in replicas]
            squares.append(sum((g.double().pow(2).sum() for g in grads),
                               torch.zeros((), dtype=torch.float64, device=self.device)))
        squares = torch.stack(squares)
        dist.all_reduce(squares, group=self.pipe_group)
        norms = squares.sqrt().tolist()  # the step's one host sync
        self.norms = step_all_or_none(self.units, norms, _clip_and_step,
                                      lambda unit: unit.optimizer.zero_grad(set_to_none=True))
        self.overflow = self.norms is None
        return None

    def state_dict(self) -> dict:
        return {u.name: u.optimizer.state_dict() for u in self.units}

    def load_state_dict(self, state_dict: dict) -> None:
        for u in self.units:
            u.optimizer.load_state_dict(state_dict[u.name])


def _clip_and_step(unit: Unit, norm: float) -> None:
    """Clip at the unit's threshold by torch.nn.utils.clip_grad_norm_'s factor, then step its optimizer."""
    coef = min(unit.max_grad_norm / (norm + 1e-6), 1.0)
    for g in unit.optimizer.param_groups:
        for p in g["params"]:
            if p.grad is not None:
                p.grad.mul_(coef)
    unit.optimizer.step()


class _MicroBatches:
    """The trainer's batches as DeepSpeed's (inputs, labels) pairs; counts the tokens it hands out.

    Every stage takes what it needs from the activation, so the labels slot stays empty.
    """

    def __init__(self, batches: Iterator[dict], device: torch.device):
        self.batches = batches
        self.device = device
        self.tokens = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batches)
        self.tokens += float(batch["attention_mask"].sum())  # still on the host: no sync
        return tuple(batch[k].to(self.device, non_blocking=True) for k in DATA_KEYS), None


class PipelineBackend(TrainingBackend):
    """All units in one DeepSpeed `PipelineEngine` over `backend.pipeline_stages` stages.

    Ranks form a (pipe × data) grid, rank = stage · D + d (DeepSpeed's layout): the stages of one
    pipeline read the same batches, so the data loader and the batch layout use `data_rank` and
    `data_world_size`. `train_step` is one `engine.train_batch`, which runs every micro-batch.
    No rank holds a whole model (`holds_whole_model`), and a step is never held back (`holds_steps`):
    a stop signal lets it finish, and storage lost mid-run raises.
    """

    name = "pipeline"  # the config's backend.name stays deepspeed; backend.pipeline_stages > 1 selects this
    holds_whole_model = False

    def __init__(self, engine_configs: EngineConfigs, launch: Launch):
        super().__init__(engine_configs.precision)
        self.num_stages = engine_configs.backend.pipeline_stages
        self.found = ProcessWideState()  # put back on close
        self.rank, self.world_size, self.local_rank = init_deepspeed(launch, engine_configs.backend.dist_backend)
        self.device = default_device(self.local_rank)
        self.engine_configs = engine_configs
        if self.world_size % self.num_stages:
            raise ConfigError(f"backend.pipeline_stages={self.num_stages} does not divide the world size "
                              f"{self.world_size}")
        self.stage_id = self.rank // self.data_world_size
        self.engine = None
        self.stage: PipelineStage | None = None
        self._stat_keys: list[str] | None = None

    @property
    def data_world_size(self) -> int:
        return self.world_size // self.num_stages

    @property
    def data_rank(self) -> int:
        return self.rank % self.data_world_size

    def prepare(self, layout: Layout, accumulation_steps: int) -> None:
        import deepspeed
        from deepspeed.pipe import PipelineModule

        self.use_device_settings()
        self.accumulation_steps = accumulation_steps
        units = list(layout.units.values())
        for unit in units:
            unit.loss_module.to(self.device)
        stages = build_stages(layout, self.num_stages)
        with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed prints its partition on rank 0
            module = PipelineModule(layers=stages, num_stages=self.num_stages, partition_method="uniform",
                                    dynamic_shape=True)  # batches are padded to their longest sample
        grid = module.mpu()
        if (grid.get_stage_id(), grid.get_data_parallel_rank()) != (self.stage_id, self.data_rank):
            raise RuntimeError("DeepSpeed's pipeline grid is not rank = stage * data_world_size + data_rank")
        self.stage = stages[self.stage_id]
        mine = {id(p) for p in self.stage.parameters()}
        for unit in units:  # each unit's optimizer updates the parameters of this stage only
            for group in unit.optimizer.param_groups:
                group["params"] = [p for p in group["params"] if id(p) in mine]
        optimizer = PipelineOptimizer(units, grid.get_pipe_parallel_group(), self._ties(stages, grid),
                                      self.device)
        # gradient_clipping 0: PipelineOptimizer clips per unit
        config = self.engine_configs.for_engine(0.0, accumulation_steps, self.data_world_size)
        self.engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, lr_scheduler=_Schedules(units),
                                                    config=config, dist_init_required=False)
        for unit in units:
            unit.wrapped = self.engine

    def _ties(self, stages: list[PipelineStage], grid) -> list[tuple[nn.Parameter, object, bool]]:
        """Weights held by several stages, with one process group per pipeline (every rank creates all)."""
        holders: dict[int, list[int]] = defaultdict(list)
        params: dict[int, nn.Parameter] = {}
        for s, stage in enumerate(stages):
            for p in stage.parameters():
                holders[id(p)].append(s)
                params[id(p)] = p
        ties = []
        for key, held_by in holders.items():
            if len(held_by) < 2:
                continue
            for d in range(self.data_world_size):
                group = dist.new_group([grid.stage_to_global(stage_id=s, data=d) for s in held_by])
                if d == self.data_rank and self.stage_id in held_by:
                    ties.append((params[key], group, self.stage_id == held_by[0]))
        return ties

    # -- the optimizer step --------------------------------------------------------------------
    def train_step(self, layout: Layout, micro_batches: Iterator[dict], step: StepContext) -> StepResult:
        """One `train_batch`; then one all-reduce for the stop flags (the engine checked finiteness).

        DeepSpeed interleaves the micro-batches' forward and backward passes over the stages, so
        this backend calls no `step.timer` phases: the whole step is one.
        """
        engine = self.engine
        feeds = engine.is_first_stage() or engine.is_last_stage()
        micro = _MicroBatches(micro_batches, self.device) if feeds else None
        with self.stage.running(step):
            engine.train_batch(micro)
        stats: dict[str, Tensor] = {}
        for head in self.stage.heads():
            stats.update(head.stats)
            head.stats.clear()
        if engine.is_first_stage():
            stats["tokens"] = torch.full((), micro.tokens, dtype=torch.float64, device=self.device)
        stop, interrupted = self.agree(*step.stop_flags())
        norms = engine.optimizer.norms
        return StepResult(norms, self._all_keys(stats), None if norms is not None else "non-finite gradient norm",
                          stop, interrupted)

    def _all_keys(self, stats: dict[str, Tensor]) -> dict[str, Tensor]:
        """The same statistic names on every rank (zeros where a stage computes none), for the sum."""
        if self._stat_keys is None:
            names: list = [None] * self.world_size
            dist.all_gather_object(names, sorted(stats))
            self._stat_keys = sorted(set().union(*names))
        return {k: stats.get(k, torch.zeros((), dtype=torch.float64, device=self.device)) for k in self._stat_keys}

    # -- checkpoint state ------------------------------------------------------------------------
    def save_units(self, units: list[Unit], directory: Path) -> None:
        self.engine.save_checkpoint(str(directory / "pipeline"), tag=DEEPSPEED_TAG)
        mine = {t.data_ptr() for t in self.stage.state_dict().values()}
        for unit in units:
            owned = {k: v.cpu() for k, v in unit.model.state_dict().items()
                     if self.data_rank == 0 and v.data_ptr() in mine}
            gathered: list | None = [None] * self.world_size if self.is_main else None
            dist.gather_object(owned, gathered, dst=0)
            if self.is_main:
                state = {k: v for part in gathered for k, v in part.items()}
                missing = sorted(set(unit.model.state_dict()) - set(state))
                if missing:
                    raise RuntimeError(f"{unit.name}: no stage holds {missing[0]!r} ({len(missing)} in all)")
                save_weights(state, directory / f"{unit.name}{WEIGHTS_SUFFIX}")

    def load_units(self, units: list[Unit], directory: Path) -> None:
        path = directory / "pipeline" / DEEPSPEED_TAG
        if not path.is_dir():
            raise FileNotFoundError(f"checkpoint {directory} has no DeepSpeed pipeline state (expected {path})")
        with deepspeed_safe_loading(path):
            loaded, _ = self.engine.load_checkpoint(str(directory / "pipeline"), tag=DEEPSPEED_TAG,
                                                    load_optimizer_states=True, load_lr_scheduler_states=True)
        if loaded is None:
            raise RuntimeError(f"DeepSpeed could not load {path}")

    def load_units_resharded(self, units: list[Unit], directory: Path, run_dir: Path, saved_world: int) -> None:
        """Refused: the pipeline engine cannot re-cut its stages' state."""
        raise UserError(f"checkpoint {directory} was written by {saved_world} processes, this run has "
                        f"{self.world_size}: a pipeline-parallel checkpoint resumes only at its world size; "
                        f"resume with {saved_world} processes, or start a new run from its weights "
                        f"(init.generator / init.discriminator = the checkpoint)")

    def close(self) -> None:
        super().close()
        leave_process_group()
        self.found.put_back()
