"""Training layouts and the backend step contract, on real tiny models, shards and checkpoints."""

from __future__ import annotations

import pytest
import torch

from megakd.config import load_config
from megakd.engine.backends import SingleProcessBackend
from megakd.engine.layouts import DecoupledElectra, JointElectra, MaskedLMOnly, layout_class
from megakd.engine.pretrain import open_trainer
from megakd.engine.units import StepContext
from megakd.store import StoreError
from megakd.store.checkpoint import latest_checkpoint
from megakd.store.checkpoint_models import load_checkpoint
from megakd.store.rundir import RunDirLock
from tests.helpers import tiny_overrides

CONFIG = "configs/electra-tiny.yaml"
LAYOUTS = {"decoupled": ({}, DecoupledElectra, ["generator", "discriminator"]),
           "joint": ({"electra.decoupled": False}, JointElectra, ["electra"]),
           "mlm": ({"model.objective": "mlm"}, MaskedLMOnly, ["generator"])}


class _CountingBackend(SingleProcessBackend):
    """The single backend, counting the all-reduces a step issues."""

    def __init__(self, precision: str):
        super().__init__(precision)
        self.all_reduces = 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        self.all_reduces += 1
        return super().all_reduce_sum(tensor)


@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_units_steps_and_checkpoints(tiny_data, tmp_path, name):
    """Each layout's units, one all-reduce per step through the contract, and its checkpoint read back by store."""
    extra, cls, units = LAYOUTS[name]
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path / "run", **{"train.max_steps": 2, **extra}))
    assert layout_class(cfg) is cls
    backend = _CountingBackend(cfg.train.precision)
    trainer = open_trainer(cfg, backend=backend)
    backend.all_reduces = 0  # opening the run shared its decision
    try:
        assert type(trainer.layout) is cls and list(trainer.units) == units
        tokens_read: list[float] = []

        def batches():
            for batch in trainer.loader:
                tokens_read.append(float(batch["attention_mask"].sum()))
                yield batch

        flags_read = []
        step = StepContext(index=0, rng=trainer.loop.streams.sampling,
                           stop_flags=lambda: flags_read.append(1) or (True, False))
        result = backend.train_step(trainer.layout, batches(), step)
        # One agreement for finiteness and stopping: the stop flags were read once and came back agreed.
        assert backend.all_reduces == 1 and flags_read == [1]
        assert result.stop and not result.interrupted and result.skipped is None
        assert set(result.norms) == set(units) and all(n > 0 for n in result.norms.values())
        assert len(tokens_read) == backend.accumulation_steps and float(result.stats["tokens"]) == sum(tokens_read)
        metrics = trainer.layout.ratios({k: float(v) for k, v in result.stats.items()})
        assert ("rtd_f1" in metrics) == (name != "mlm") and 0 <= metrics["gen_acc"] <= 1
        trainer.train()  # the second step, then the final checkpoint
    finally:
        trainer.close()
    models = load_checkpoint(latest_checkpoint(tmp_path / "run"))
    expected = trainer.layout.probe_encoder().state_dict()
    got = (models.discriminator if name != "mlm" else models.generator).encoder.state_dict()
    assert all(torch.equal(expected[k], got[k]) for k in expected)


def test_the_run_dir_lock_is_held_from_open_to_close_and_released_on_a_failed_open(tiny_data, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, run, **{"train.max_steps": 1}))
    with pytest.raises(FileNotFoundError):
        open_trainer(cfg, str(tmp_path / "no-such-checkpoint"))
    with RunDirLock(run):  # the failed open released it
        pass
    trainer = open_trainer(cfg)
    try:
        with pytest.raises(StoreError, match="in use by another megakd job"):
            RunDirLock(run).acquire()
        trainer.train()
        with pytest.raises(StoreError, match="in use by another megakd job"):  # the run ends at close
            RunDirLock(run).acquire()
    finally:
        trainer.close()
    with RunDirLock(run):  # released when the run ended
        pass
