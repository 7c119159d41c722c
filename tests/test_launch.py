"""`Launch.from_environ`: the launch environment read once, as torchrun, srun or nothing leaves it."""

from __future__ import annotations

import pytest

from megakd.launch import Launch


@pytest.mark.parametrize("environ, expected", [
    ({}, Launch()),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1"},  # torchrun, deepspeed
     Launch(rank=3, local_rank=1, world_size=4, launched=True)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"},  # a task of srun
     Launch(rank=5, local_rank=1, world_size=8, launched=True, srun=True)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8"}, Launch(rank=5, world_size=8, launched=True, srun=True)),
    ({"SLURM_NTASKS": "8"}, Launch()),  # sbatch's batch shell: an allocation, no task of srun's
    ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},  # torchrun inside an allocation
     Launch(rank=1, world_size=2, launched=True)),
    ({"WORLD_SIZE": "2"}, Launch(world_size=2)),  # ranks announced but no RANK: no group to join
])
def test_from_environ(environ, expected):
    assert Launch.from_environ(environ) == expected


def test_the_variables_torch_reads_under_srun():
    launch = Launch.from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"})
    assert launch.torch_environ() == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}
    assert Launch.from_environ(launch.torch_environ()) == Launch(rank=5, local_rank=1, world_size=8, launched=True)


def test_it_reads_os_environ_by_default(monkeypatch):
    for key in ("RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert Launch.from_environ().world_size == 3
