"""A multi-rank backend started as one bare process on a CUDA machine is sent to a launcher in one line."""

from __future__ import annotations

import pytest
import torch

from megakd.cli import main
from megakd.engine.backends import require_launcher
from megakd.errors import UserError
from megakd.launch import Launch
from tests.distributed.harness import CONFIG
from tests.helpers import tiny_overrides

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")


@pytest.fixture
def bare_cuda_process(monkeypatch):
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return monkeypatch


@pytest.mark.parametrize("name", ["deepspeed", "ddp"])
def test_refused_before_the_run_dir_is_claimed(tiny_data, tmp_path, capsys, bare_cuda_process, name):
    run = tmp_path / "run"
    assert main(["pretrain", "-c", str(CONFIG), *tiny_overrides(tiny_data, run, **{"backend.name": name})]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert f"backend.name={name} on a CUDA machine needs a launcher" in err
    assert "launch/torchrun.sh 1 [COMMAND] -c CONFIG" in err
    assert not run.exists()


def test_a_launcher_environment_or_a_cpu_machine_passes(bare_cuda_process):
    with pytest.raises(UserError, match="launch/deepspeed.sh --num_gpus 1"):
        require_launcher("deepspeed", Launch.from_environ())
    bare_cuda_process.setenv("SLURM_PROCID", "0")
    with pytest.raises(UserError):  # Slurm needs both variables, as Launch.from_environ reads them
        require_launcher("deepspeed", Launch.from_environ())
    bare_cuda_process.setenv("SLURM_NTASKS", "8")
    require_launcher("deepspeed", Launch.from_environ())
    for var in LAUNCHER_VARS:
        bare_cuda_process.delenv(var, raising=False)
    bare_cuda_process.setenv("RANK", "0")
    require_launcher("ddp", Launch.from_environ())
    bare_cuda_process.delenv("RANK")
    bare_cuda_process.setattr(torch.cuda, "is_available", lambda: False)
    require_launcher("deepspeed", Launch.from_environ())  # CPU: the lone process keeps its private gloo group
