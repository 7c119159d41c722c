"""Device placement on a simulated GPU (megakd/testing/device_audit.py): real training code, no mixed-device
op, a bounded number of host-device syncs per optimizer step, and an instrument that is proven to fail."""

from __future__ import annotations

import pytest
import torch

from megakd.config import load_config
from megakd.convert.export import save_hf_model
from megakd.data.stream import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.engine.backends import SingleProcessBackend
from megakd.engine.pretrain import build_trainer
from megakd.engine.probe import Probe
from megakd.engine.validation import Validator
from megakd.testing.device_audit import SIMULATED, MixedDeviceError, SimulatedTensor, simulated_cuda
from tests.helpers import tiny_overrides

# Per micro-batch: the masked positions of the sparse generator head (megakd/objectives/electra.py
# masked_positions) and the fused CE's target range check (kernels/linear_head.py _check_target).
# Per step: the finite-loss check and the units' gradient norms (megakd/engine/backends.py).
SYNCS_PER_MICRO_BATCH, SYNCS_PER_STEP = 2, 2


def _cfg(tiny_data, run_dir, **extra):
    """electra-tiny at test size, with the demo's (and the base recipe's) T5 relative positions: the
    shared bias table and its bucket indices are built on the device too, and the export is remote code."""
    relative = {f"model.{m}.{k}": v for m in ("generator", "discriminator")
                for k, v in (("position_encoding", "t5_relative"), ("relative_init", "local"))}
    return load_config("configs/electra-tiny.yaml", tiny_overrides(
        tiny_data, run_dir, **{"kernels.backend": "torch", "train.max_steps": 2, **relative, **extra}))


@pytest.fixture(scope="module")
def simulated(tiny_data, tmp_path_factory):
    """An electra-tiny trainer on the simulated cuda:0 after two steps, and the second step's sync counter."""
    cfg = _cfg(tiny_data, tmp_path_factory.mktemp("sim") / "run")
    with simulated_cuda() as syncs:
        trainer = build_trainer(cfg, backend=SingleProcessBackend("fp32", SIMULATED))
        batches = iter(trainer.loader)
        assert trainer.train_step(batches) is not None
        before = syncs.sites.copy()
        assert trainer.train_step(batches) is not None
    return trainer, syncs.sites - before


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


def test_instrument_catches_a_model_left_on_the_cpu(tiny_data, tmp_path):
    """The bug the single backend had: batches on the GPU, the model on the CPU."""

    class Unmoved(SingleProcessBackend):
        def wrap_units(self, units, accumulation_steps):
            self.accumulation_steps = accumulation_steps
            for unit in units:
                unit.wrapped = unit.loss_module

    with simulated_cuda(), pytest.raises(MixedDeviceError):
        trainer = build_trainer(_cfg(tiny_data, tmp_path / "run"), backend=Unmoved("fp32", SIMULATED))
        trainer.train_step(iter(trainer.loader))


def test_training_step_places_everything_on_the_device_with_bounded_syncs(simulated):
    trainer, syncs = simulated
    for unit in trainer.units.values():
        assert all(p.device == SIMULATED for p in unit.model.parameters())
        assert all(isinstance(v, SimulatedTensor) for state in unit.optimizer.state.values()
                   for k, v in state.items() if k != "step")
    assert all(v.device == SIMULATED for v in trainer.interval.values())
    bound = SYNCS_PER_MICRO_BATCH * trainer.backend.accumulation_steps + SYNCS_PER_STEP
    assert sum(syncs.values()) <= bound, syncs


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
