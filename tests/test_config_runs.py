"""A config through a run: finished once, when its job is made (every `auto` resolved), and written by nothing
after (building the backend and the models, training, saving checkpoints); the config an older megakd saved in
a checkpoint resumes in today's key names."""

from __future__ import annotations

import yaml

from megakd.config import load_config
from megakd.configio import config_to_dict, read_yaml_file
from megakd.engine.pretrain import PretrainingJob
from megakd.engine.run import run_job
from megakd.finetune.config import FinetuneConfig
from megakd.finetune.jobs import FinetuneJob
from megakd.launch import Launch
from megakd.store import checkpoint
from tests.finetune.test_distributed import tiny_finetune
from tests.helpers import tiny_overrides


def test_pretraining_builds_and_trains_from_the_finished_config_unchanged(tiny_data, tmp_path):
    run = tmp_path / "run"
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, run, **{
        "train.max_steps": 2, "run.save_every": 1, "run.export_hf": "false"}))
    job = PretrainingJob(cfg, Launch())
    finished = config_to_dict(job.cfg)
    assert (finished["backend"]["name"], finished["model"]["generator"]["vocab_size"]) == ("single", 512)
    assert not run_job(job).stopped
    assert config_to_dict(job.cfg) == finished
    saved = run / "checkpoints" / "step_00000002" / "config.yaml"
    assert read_yaml_file(run / "config.yaml") == read_yaml_file(saved) == finished


def test_a_checkpoint_saved_with_an_old_key_name_resumes_without_a_change(tiny_data, tmp_path):
    """A checkpoint whose config.yaml says `train.save_every` (before it became `run.save_every`) and has no
    `electra.rtd_positions` (added after it) resumes: the saved config is read through the renames and with
    the keys added since at their defaults, so neither is a change to refuse."""
    run = tmp_path / "run"
    overrides = tiny_overrides(tiny_data, run, **{"run.save_every": 1, "run.export_hf": "false"})
    cfg = load_config("configs/electra-tiny.yaml", [*overrides, "train.max_steps=1"])
    assert not run_job(PretrainingJob(cfg, Launch())).stopped
    saved_file = run / "checkpoints" / "step_00000001" / "config.yaml"
    saved = read_yaml_file(saved_file)
    saved["train"]["save_every"] = saved["run"].pop("save_every")
    del saved["electra"]["rtd_positions"]
    saved_file.write_text(yaml.safe_dump(saved, sort_keys=False))
    checkpoint.write_manifest(saved_file.parent, 1)  # as written by that older version
    cfg = load_config("configs/electra-tiny.yaml", [*overrides, "train.max_steps=2"])
    outcome = run_job(PretrainingJob(cfg, Launch()), resume="auto")
    assert (outcome.stopped, outcome.step) == (False, 2)


def test_finetuning_builds_and_trains_from_the_finished_config_unchanged(tiny_data, tmp_path):
    _, _, recipe, *overrides = tiny_finetune(tiny_data[0], tmp_path / "run", "finetune.epochs=1", "finetune.lr=1e-3",
                                             "run.keep_last=0")
    job = FinetuneJob(load_config(recipe, overrides, cls=FinetuneConfig), Launch())
    finished = config_to_dict(job.cfg)
    assert (finished["backend"]["name"], finished["finetune"]["precision"]) == ("single", "fp32")  # the CPU
    assert not run_job(job).stopped
    assert config_to_dict(job.cfg) == finished
    assert read_yaml_file(tmp_path / "run" / "config.yaml") == finished
