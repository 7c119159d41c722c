"""Device placement on a simulated GPU (tools/device_audit.py): real training code, no mixed-device
op, at most two host-device syncs per optimizer step on every backend and precision the simulation can run,
and an instrument that is proven to fail."""

from __future__ import annotations

import pytest
import torch

from device_audit import SIMULATED, MixedDeviceError, SimulatedTensor, simulated_cuda
from megakd.config import load_config
from megakd.convert.export import save_hf_model
from megakd.data.loader import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.engine import backends
from megakd.engine.backends import DDPBackend, SingleProcessBackend, free_local_port
from megakd.engine.pretrain import build_trainer
from megakd.engine.probe import Probe
from megakd.engine.validation import Validator
from megakd.errors import UserError
from megakd.launch import Launch
from megakd.objectives.electra import masked_positions
from tests.helpers import tiny_overrides

# Per optimizer step, whatever the accumulation: the finite-loss check and the units' gradient norms
# (megakd/engine/backends.py MicroBatchLoopBackend.train_step and .step). Nothing per micro-batch: the
# masked positions come with the batch (megakd/data/masking.py collate) and the fused CE's target check
# asserts on the device (kernels/linear_head.py _check_target).
SYNCS_PER_STEP = 2


def _cfg(tiny_data, run_dir, **extra):
    """electra-tiny at test size, with the demo's (and the base recipe's) T5 relative positions: the
    shared bias table and its bucket indices are built on the device too, and the export is remote code."""
    relative = {f"model.{m}.{k}": v for m in ("generator", "discriminator")
                for k, v in (("position_encoding", "t5_relative"), ("relative_init", "local"))}
    return load_config("configs/electra-tiny.yaml", tiny_overrides(
        tiny_data, run_dir, **{"kernels.backend": "torch", "train.max_steps": 2, **relative, **extra}))


def _train_two_steps(cfg, backend):
    """Two steps of an electra-tiny trainer on the simulated cuda:0: (trainer, the second step's syncs).
    The caller closes the trainer (the backend's TF32 switches and the loader)."""
    with simulated_cuda() as syncs:
        trainer = build_trainer(cfg, backend=backend)
        batches = iter(trainer.loader)
        assert trainer.train_step(batches) is not None
        before = syncs.sites.copy()
        assert trainer.train_step(batches) is not None
    return trainer, syncs.sites - before


@pytest.fixture(scope="module")
def simulated(tiny_data, tmp_path_factory):
    """An electra-tiny trainer on the simulated cuda:0 after two steps, and the second step's sync counter."""
    cfg = _cfg(tiny_data, tmp_path_factory.mktemp("sim") / "run")
    trainer, syncs = _train_two_steps(cfg, SingleProcessBackend("fp32", SIMULATED))
    yield trainer, syncs
    trainer.close()


def test_instrument_raises_on_mixed_devices_and_counts_syncs():
    with simulated_cuda() as syncs:
        x = torch.ones(3, device="cuda")
        assert isinstance(x, SimulatedTensor) and x.device == SIMULATED
        with pytest.raises(MixedDeviceError, match="aten.add.Tensor"):
            x + torch.ones(3)
        x + torch.tensor(2.0)  # a 0-dim cpu tensor is a scalar to CUDA
        with pytest.raises(MixedDeviceError, match="Generator"):
            torch.rand(3, generator=torch.Generator().manual_seed(0), device=x.device)
        assert float(x.sum()) == 3.0
        assert x[x > 0].shape == (3,)
    kinds = {kind: site for kind, site in syncs.sites}
    assert kinds.keys() == {"read value (.item)", "boolean mask indexing"}
    assert all(site.startswith(__file__) for site in kinds.values())


def test_target_check_raises_on_the_host_and_asserts_on_the_device_without_a_sync():
    """The fused CE's out-of-range target: a one-line ValueError on the CPU; on the GPU a device-side
    assertion (no host read: the simulation raises it at once, CUDA at the next sync)."""
    from kernels import fused_linear_cross_entropy

    hidden, weight = torch.randn(3, 4), torch.randn(5, 4)
    bad, good = torch.tensor([0, 5, -100]), torch.tensor([0, 4, -100])
    message = r"target values must be in \[0, 5\) or ignore_index=-100"
    with pytest.raises(ValueError, match=message):
        fused_linear_cross_entropy(hidden, weight, None, bad, backend="torch")
    with simulated_cuda() as syncs:
        h, w, bad_there, good_there = (t.to("cuda", non_blocking=True) for t in (hidden, weight, bad, good))
        with pytest.raises(RuntimeError, match=message):
            fused_linear_cross_entropy(h, w, None, bad_there, backend="torch")
        loss = fused_linear_cross_entropy(h, w, None, good_there, backend="torch")
    assert not syncs.sites
    assert float(loss.inner) == pytest.approx(float(torch.nn.functional.cross_entropy(hidden @ weight.T, good)))


def test_autocast_on_the_simulated_device_is_cpu_autocast():
    """bf16 runs for real: autocast("cuda") computes in bf16 on the host, and models asking about cuda hear so."""
    with simulated_cuda():
        x, w = torch.randn(2, 4, device="cuda"), torch.randn(3, 4, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = x @ w.T
            assert torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") == torch.bfloat16
        assert isinstance(y, SimulatedTensor) and y.dtype == torch.bfloat16
        assert torch.equal(y.inner, (x.inner.bfloat16() @ w.inner.bfloat16().T))
    assert not torch.is_autocast_enabled("cpu")


def test_instrument_catches_a_model_left_on_the_cpu(tiny_data, tmp_path):
    """The bug the single backend had: batches on the GPU, the model on the CPU."""

    class Unmoved(SingleProcessBackend):
        def wrap_units(self, units, accumulation_steps):
            self.accumulation_steps = accumulation_steps
            for unit in units:
                unit.wrapped = unit.loss_module

    backend = Unmoved("fp32", SIMULATED)
    try:
        with simulated_cuda(), pytest.raises(MixedDeviceError):
            trainer = build_trainer(_cfg(tiny_data, tmp_path / "run"), backend=backend)
            trainer.train_step(iter(trainer.loader))
    finally:
        backend.close()  # its TF32 switches


def test_training_step_places_everything_on_the_device_with_bounded_syncs(simulated):
    trainer, syncs = simulated
    for unit in trainer.units.values():
        assert all(p.device == SIMULATED for p in unit.model.parameters())
        assert all(isinstance(v, SimulatedTensor) for state in unit.optimizer.state.values()
                   for k, v in state.items() if k != "step")
    assert all(v.device == SIMULATED for v in trainer.loop.interval.sums.values())
    assert trainer.backend.accumulation_steps == 2  # a per-micro-batch sync would count twice
    assert sum(syncs.values()) <= SYNCS_PER_STEP, syncs


@pytest.fixture
def one_process_group(monkeypatch):
    """The environment a launcher gives a world of one: `DDPBackend` joins a real gloo group (left on close)."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_local_port())}.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize("backend_name, precision", [("single", "bf16"), ("ddp", "bf16")])
def test_syncs_per_optimizer_step_on_each_backend_and_precision(tiny_data, tmp_path, request, backend_name,
                                                                precision):
    """As the fp32 single-process step above, on the other backends and precisions the simulation runs: two
    micro-batches per step; bf16 autocasts for real (`test_autocast_on_the_simulated_device_is_cpu_autocast`);
    DDP joins a gloo group of one process, where torch's DDP wrapper is not used (docs/testing.md says why it
    cannot be simulated). The TF32 switch is on while the backend trains on the GPU, and put back on close."""
    if backend_name == "ddp":
        request.getfixturevalue("one_process_group")
        backend = DDPBackend(Launch.from_environ(), precision, "gloo")
        backend.device = SIMULATED
    else:
        backend = SingleProcessBackend(precision, SIMULATED)
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.matmul.fp32_precision
    trainer, syncs = _train_two_steps(_cfg(tiny_data, tmp_path / "run", **{"train.precision": precision}), backend)
    try:
        assert trainer.backend.accumulation_steps == 2
        assert sum(syncs.values()) <= SYNCS_PER_STEP, syncs
        assert torch.backends.cuda.matmul.allow_tf32
    finally:
        trainer.close()
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cuda.matmul.fp32_precision) == before


def test_the_batch_brings_its_masked_positions_from_the_host(tiny_data):
    """What the sparse head would otherwise ask the device for: the collate's positions are exactly
    `masked_positions` of the mask, in row-major order, as int64 indices."""
    tokenizer_dir, shards_dir = tiny_data
    loader = PretrainingLoader(shards_dir, Tokenizer.load(tokenizer_dir), micro_batch_size=4, seed=0,
                               mask_prob=0.15)
    for _, batch in zip(range(3), loader):
        positions = batch["mlm_positions"]
        assert positions.dtype == torch.int64 and positions.numel() > 0
        assert torch.equal(positions, masked_positions(batch["mlm_mask"]))


def test_validation_pass_on_the_device(simulated, tiny_data):
    trainer, _ = simulated
    tokenizer_dir, shards_dir = tiny_data
    loader = PretrainingLoader(shards_dir, Tokenizer.load(tokenizer_dir), micro_batch_size=4, seed=0,
                               mask_prob=0.15)
    with simulated_cuda():
        rec = Validator(loader, 8, trainer.backend, trainer.layout).evaluate(2)
    assert {"val_gen_loss", "val_disc_loss", "val_rtd_auc"} <= set(rec)


def test_probe_on_the_device(simulated, tiny_data):
    trainer, _ = simulated
    cfg = trainer.cfg
    cfg.train.probe_fit_examples, cfg.train.probe_eval_examples, cfg.train.probe_max_seq_len = 60, 30, 48
    with simulated_cuda():
        probe = Probe(cfg, Tokenizer.load(tiny_data[0]), 64)
        rec = probe(trainer.probe_encoder())
    assert 0 <= rec["probe_acc"] <= 1


def test_hf_export_of_the_trained_model(simulated, tiny_data, tmp_path):
    trainer, _ = simulated
    model = trainer.units["discriminator"].model
    with simulated_cuda():
        architecture = save_hf_model(model, "electra_discriminator", tmp_path, tiny_data[0])
    assert architecture == "MegakdForPreTraining" and (tmp_path / "model.safetensors").is_file()


def _srun_task(monkeypatch, local_rank: int, tasks: int = 8) -> None:
    """The environment srun gives task `local_rank` of one node: SLURM_* only; RANK/WORLD_SIZE/LOCAL_RANK are
    what `init_distributed` derives (registered with monkeypatch first, so that they are removed after)."""
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    for key, value in {"SLURM_PROCID": local_rank, "SLURM_LOCALID": local_rank, "SLURM_NTASKS": tasks}.items():
        monkeypatch.setenv(key, str(value))


@pytest.mark.parametrize("visible", [1, 8])
def test_eight_tasks_of_a_node_each_train_on_a_gpu_they_see(monkeypatch, visible):
    """Eight srun tasks on a node that binds one GPU per task (`--gpus-per-task=1`: each sees one, its 0) or
    shows each all eight: the nccl group is joined on, and the model placed on, device LOCAL_RANK where
    that many are visible, else the one device. The simulated `set_device` fails past the visible devices as
    CUDA does, so asking for `cuda:<LOCAL_RANK>` with one visible would fail here."""
    joined = []
    monkeypatch.setattr(backends, "create_process_group", lambda name, **kwargs: joined.append(name))
    for local_rank in range(8):
        _srun_task(monkeypatch, local_rank)
        with simulated_cuda(devices=visible):
            assert backends.init_distributed(Launch.from_environ(), "auto") == (local_rank, 8, local_rank)
            expected = local_rank if visible == 8 else 0
            assert torch.cuda.current_device() == expected  # where NCCL binds its communicator
            torch.cuda.set_device(visible - 1 - expected)  # moved away, so default_device must set it back
            assert backends.default_device(local_rank) == torch.device("cuda", expected)
            assert torch.cuda.current_device() == expected
    assert joined == ["nccl"] * 8
    with simulated_cuda(devices=1), pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.set_device(1)


def test_a_rank_without_a_gpu_of_its_own_names_the_variables(monkeypatch):
    """Two GPUs visible to each of eight tasks (neither one per task nor the node's all): task 5 has no device,
    and says which variables disagree."""
    _srun_task(monkeypatch, 5)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    with simulated_cuda(devices=2), pytest.raises(UserError) as err:
        backends.default_device(5)
    assert str(err.value).startswith("LOCAL_RANK=5 (SLURM_LOCALID=5) but this task sees 2 CUDA devices "
                                     "(CUDA_VISIBLE_DEVICES=4,5): expected every GPU of the node or exactly one")
