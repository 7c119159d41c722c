"""`backend.name: auto` (the default): single in one process, ddp when a launcher started several ranks."""

from __future__ import annotations

import pytest
import yaml

from megakd.cli import main
from megakd.config import BackendConfig, Config, load_config
from megakd.configio import config_to_dict
from megakd.finetune.config import FinetuneConfig
from megakd.finish import finish_backend, finish_config
from megakd.launch import Launch

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture
def bare(monkeypatch):
    """A process no launcher started."""
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize("env, name, resolved", [
    ({}, "auto", "single"),
    ({"RANK": "0", "WORLD_SIZE": "1"}, "auto", "single"),  # torchrun with one process
    ({"RANK": "1", "WORLD_SIZE": "2"}, "auto", "ddp"),
    ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, "auto", "ddp"),  # srun: Launch.from_environ reads these
    ({"SLURM_NTASKS": "4"}, "auto", "single"),  # an allocation, but no task of srun's
    ({"RANK": "1", "WORLD_SIZE": "2"}, "deepspeed", "deepspeed"),
    ({"RANK": "1", "WORLD_SIZE": "2"}, "single", "single"),  # explicit: refused later, by the backend
])
def test_auto_follows_the_launch_and_explicit_names_stay(bare, env, name, resolved):
    for var, value in env.items():
        bare.setenv(var, value)
    backend = BackendConfig(name=name)
    assert finish_backend(backend, Launch.from_environ()) == backend.name == resolved


def test_auto_is_the_default_of_both_trees():
    assert Config().backend.name == FinetuneConfig().backend.name == "auto"


@pytest.mark.parametrize("command, recipe", [("pretrain", "configs/electra-tiny.yaml"),
                                             ("finetune", "configs/finetune-rt.yaml")])
def test_print_config_shows_the_backend_auto_resolves_to(bare, capsys, command, recipe):
    assert main([command, "-c", recipe, "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["backend"]["name"] == "single"
    bare.setenv("WORLD_SIZE", "2")
    assert main([command, "-c", recipe, "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["backend"]["name"] == "ddp"


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
def test_the_finished_config_names_the_backend_that_is_built_and_building_changes_nothing(bare, command):
    launch = Launch.from_environ()
    if command == "pretrain":
        from megakd.engine.pretrain import build_backend

        cfg = finish_config(load_config("configs/electra-tiny.yaml"), launch=launch)
    else:
        from megakd.finetune.runtime import build_backend

        cfg = load_config("configs/finetune-rt.yaml", cls=FinetuneConfig).finish(launch)
    finished = config_to_dict(cfg)
    backend = build_backend(cfg, launch)
    try:
        assert backend.name == cfg.backend.name == "single"  # the run's config.yaml says single
        assert config_to_dict(cfg) == finished
    finally:
        backend.close()


@pytest.mark.parametrize("rank, lines", [("0", 1), ("1", 0)])
def test_an_explicit_single_under_a_launcher_is_refused_once(bare, tmp_path, capsys, rank, lines):
    """Each rank raises the same refusal; rank 0 alone prints it."""
    bare.setenv("WORLD_SIZE", "2")
    bare.setenv("RANK", rank)
    run = tmp_path / "run"
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", f"run.dir={run}", "backend.name=single"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == lines and all("backend.name=single, but the launcher started 2 ranks" in line
                                     for line in err)
    assert not (tmp_path / "run").exists()
