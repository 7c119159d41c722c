"""Elastic resume of DeepSpeed ZeRO 1/2/3 checkpoints: 2 -> 1 and 1 -> 2 gloo processes, through
DeepSpeed's universal checkpoint (megakd/store/universal.py, `DeepSpeedBackend.load_units_elastic`).

ELECTRA with DecoupledOptim, so two engines (generator and discriminator) each re-cut their own
optimizer state. Dropout is off. Three launches train every stage at once (this file is also the
worker: `torchrun ... test_zero_elastic.py SPEC.json`, see `_worker`):

1. 1 process: `one_<s>`, 4 uninterrupted steps, checkpoints at steps 2 and 4.
2. 2 processes: `two_<s>` likewise; `one_to_two_<s>` resumes `one_<s>` step 2 (elastic) to step 4;
   `two_same_<s>` resumes `two_<s>` step 2 at its own world size (the ordinary, exact path).
3. 1 process: `two_to_one_<s>` resumes `two_<s>` step 2 (elastic) to step 4; `one_same_<s>`
   resumes `one_<s>` step 2 at its own world size.

Right after `open_trainer` (the checkpoint loaded) each resumed run gathers, per parameter of both units,
the fp32 master weight and Adam's exp_avg / exp_avg_sq (`safe_get_full_*`, on every rank; rank 0 writes them).

Asserted, and the tolerances:
- The state an elastic resume loads equals the state an ordinary resume of the same checkpoint
  loads, for both units: the universal conversion only moves bytes (fragments are copied and
  concatenated, never recomputed), so the comparison is exact (measured: 0 difference).
  exp_avg / exp_avg_sq are non-zero, so a fresh optimizer fails here; the schedule and engine
  step counters equal the checkpoint's step.
- Steps 3-4 after the elastic resume follow the uninterrupted run at the new world size: the
  generator's loss, accuracy, gradient norm and LR, both LRs, and the generator's final weights,
  to tests/distributed/harness.py's tolerances (RTOL 1e-5 on metrics, 1e-5 absolute on weights).
  With the same global batch and the same global sample order the arithmetic is the same up to the
  order of float32 sums (gloo all-reduce / ZeRO reduce-scatter), measured <= 3e-7 relative; a fresh
  Adam (moments 0, bias correction at step 1) moves the weights by ~lr = 2e-3, 100x the tolerance.
  The discriminator's trajectory is not compared with an uninterrupted run: it trains on the
  generator's *sampled* replacements, whose per-rank generators cannot continue across a layout
  change (docs/distributed.md), so only its loaded state is compared (above).
- The converted copy lives beside the checkpoints (`<run.dir>/universal/step_00000002`), the
  published checkpoint still verifies, and a second elastic resume reuses the copy.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megakd.engine.backends import free_local_port
from megakd.engine.deepspeed_backend import DeepSpeedBackend
from megakd.engine.pipeline import PipelineBackend
from megakd.errors import UserError
from megakd.store.checkpoint import latest_checkpoint, step_dir, verify
from megakd.store.checkpoint_models import read_unit_state
from megakd.store.universal import SOURCE_FILE, convert_to_universal, universal_root
from tests.distributed.harness import (
    CONFIG,
    assert_metrics_close,
    child_env,
    read_metrics,
)
from tests.helpers import tiny_overrides

STAGES = (1, 2, 3)
COMMON = {
    "train.max_steps": 4, "run.save_every": 2, "run.keep_last": 0, "train.global_batch_size": 16,
    "train.micro_batch_size": 4, "model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0,
    "run.export_hf": "false", "kernels.backend": "torch", "backend.name": "deepspeed",
}
# Final generator weights: measured max difference 6e-8 (ZeRO-2/3) and 2e-8 (ZeRO-1) absolute.
WEIGHT_RTOL, WEIGHT_ATOL = 1e-5, 1e-6
GENERATOR_KEYS = ("gen_loss", "gen_acc", "grad_norm_generator", "lr_generator", "lr_discriminator")
STATE_FILE = "loaded_state.pt"


def _launch(nprocs: int, runs: list[dict], spec_path: Path, timeout: float = 900) -> None:
    spec_path.write_text(json.dumps({"config": str(CONFIG), "runs": runs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}",
           f"--master_port={free_local_port()}", __file__, str(spec_path)]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("zero_elastic")

    def run(name: str, stage: int, resume: str | None = None, **extra) -> dict:
        overrides = tiny_overrides(tiny_data, root / f"{name}_{stage}",
                                   **{**COMMON, "backend.zero_stage": stage, **extra})
        return {"overrides": overrides, "resume": resume and str(step_dir(root / f"{resume}_{stage}", 2))}

    _launch(1, [run("one", s) for s in STAGES], root / "one.json")
    _launch(2, [r for s in STAGES for r in (run("two", s), run("one_to_two", s, "one"),
                                            run("two_same", s, "two", **{"train.max_steps": 2}))],
            root / "two.json")
    _launch(1, [r for s in STAGES for r in (run("two_to_one", s, "two"),
                                            run("one_same", s, "one", **{"train.max_steps": 2}))],
            root / "three.json")
    return root


def _loaded(run_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / STATE_FILE, weights_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("elastic,same,world", [("two_to_one", "two_same", "1"), ("one_to_two", "one_same", "2")])
def test_elastic_resume_loads_the_saved_optimizer_state(runs, stage, elastic, same, world):
    got, want = _loaded(runs / f"{elastic}_{stage}"), _loaded(runs / f"{same}_{stage}")
    assert int(got.pop("world_size")) == int(world) and int(want.pop("world_size")) != int(world)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
        if key.endswith(("/schedule_step", "/global_steps")):
            assert int(got[key]) == 2, key
    for unit in ("generator", "discriminator"):
        for moment in ("exp_avg", "exp_avg_sq"):
            # the moments are real state, not a fresh optimizer's zeros
            norms = [v.norm() for k, v in got.items() if k.startswith(f"{unit}/") and k.endswith(f"/{moment}")]
            assert norms and sum(n > 0 for n in norms) >= 0.9 * len(norms), (unit, moment)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("elastic,full", [("two_to_one", "one"), ("one_to_two", "two")])
def test_elastic_resume_follows_the_uninterrupted_run(runs, stage, elastic, full):
    resumed, uninterrupted = runs / f"{elastic}_{stage}", runs / f"{full}_{stage}"
    assert_metrics_close(read_metrics(resumed), read_metrics(uninterrupted)[2:], GENERATOR_KEYS)
    got, want = (read_unit_state(latest_checkpoint(d), "generator") for d in (resumed, uninterrupted))
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=WEIGHT_RTOL, atol=WEIGHT_ATOL, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("stage", STAGES)
def test_converted_copy_is_beside_the_checkpoint_which_still_verifies(runs, stage):
    for elastic, source in (("two_to_one", "two"), ("one_to_two", "one")):
        copy = universal_root(runs / f"{elastic}_{stage}") / "step_00000002"
        recorded = json.loads((copy / SOURCE_FILE).read_text())
        assert recorded["checkpoint"] == str(step_dir(runs / f"{source}_{stage}", 2).resolve())
        assert sorted(p.name for p in copy.iterdir()) == ["discriminator", "generator", SOURCE_FILE]
        assert (copy / "generator" / "ds" / "zero").is_dir()
        verify(step_dir(runs / f"{source}_{stage}", 2))
        # a second elastic resume of the same checkpoint reuses the copy (no reconversion)
        before = (copy / SOURCE_FILE).stat().st_mtime_ns
        assert convert_to_universal(runs / f"{elastic}_{stage}", step_dir(runs / f"{source}_{stage}", 2),
                                    ["generator", "discriminator"]) == copy
        assert (copy / SOURCE_FILE).stat().st_mtime_ns == before


def test_pipeline_checkpoint_at_another_world_size_is_refused_in_one_line(tmp_path):
    """The pipeline engine has no elastic load: the refusal names the saved world size and the way out."""
    assert not hasattr(PipelineBackend, "load_units_elastic")
    backend = PipelineBackend.__new__(PipelineBackend)  # only what the refusal reads
    backend.world_size, backend.rank = 4, 0
    with pytest.raises(UserError) as err:
        backend.load_units_resharded([], tmp_path, tmp_path, 2)
    message = str(err.value)
    assert "\n" not in message and "resume with 2 processes" in message and "init.discriminator" in message


def test_zero_checkpoint_without_universal_support_is_refused_in_one_line(tmp_path, monkeypatch):
    tag = tmp_path / "step_00000002" / "generator" / "ds"
    tag.mkdir(parents=True)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    monkeypatch.setattr("megakd.engine.deepspeed_backend.universal_support", lambda: "DeepSpeed 0.1 cannot")
    unit = type("Unit", (), {"name": "generator"})()
    with pytest.raises(UserError) as err:
        DeepSpeedBackend.load_units_elastic(None, [unit], tmp_path / "step_00000002", tmp_path)
    message = str(err.value)
    assert "\n" not in message and "DeepSpeed 0.1 cannot" in message and "resume with the saved world size" in message
    assert not (tmp_path / "universal").exists()


# -- the worker -------------------------------------------------------------------------------------

def _full_state(trainer) -> dict[str, torch.Tensor]:
    """Per parameter of every unit: fp32 master weight and Adam moments, gathered (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out = {"world_size": torch.tensor(trainer.backend.world_size)}
    for name, unit in trainer.units.items():
        link = getattr(unit.wrapped.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:
            # ZeRO-1/2 map each parameter's fragment of the loaded flat Adam state only in the first
            # step after an ordinary load; `safe_get_full_optimizer_state` needs that map now
            link()
        for i, group in enumerate(unit.optimizer.param_groups):
            out[f"{name}/group{i}/weight_decay"] = torch.tensor(group["weight_decay"])
        out[f"{name}/schedule_step"] = torch.tensor(unit.scheduler.last_epoch)
        out[f"{name}/global_steps"] = torch.tensor(unit.wrapped.global_steps)
        for pname, param in unit.wrapped.module.named_parameters():
            out[f"{name}/{pname}/fp32"] = safe_get_full_fp32_param(param).detach().cpu().clone()
            for key in ("exp_avg", "exp_avg_sq"):
                out[f"{name}/{pname}/{key}"] = safe_get_full_optimizer_state(param, key).detach().cpu().clone()
    return out


def _worker(spec_path: str) -> None:
    from megakd.config import load_config
    from megakd.engine.pretrain import open_trainer
    from tests.distributed.worker import one_process_group

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    with one_process_group():
        for run in spec["runs"]:
            trainer = open_trainer(load_config(spec["config"], run["overrides"]), run.get("resume"))
            try:
                if run.get("resume"):
                    state = _full_state(trainer)
                    if trainer.backend.is_main:
                        torch.save(state, trainer.run_dir / STATE_FILE)
                trainer.train()
            finally:
                trainer.close()


if __name__ == "__main__":
    from megakd.engine.backends import exit_process

    _worker(sys.argv[1])
    exit_process(0)
