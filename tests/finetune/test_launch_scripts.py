"""The launch scripts' argument handling: any megakd command, `pretrain` when none is named."""

from __future__ import annotations

import subprocess

import pytest

from tests.finetune.test_distributed import LAUNCH, REPO, launch_env


@pytest.mark.parametrize("word,is_command", [("finetune", True), ("pretrain", True), ("bench", True),
                                             ("-c", False), ("--resume", False), ("train.max_steps=3", False)])
def test_command_words(word, is_command):
    code = subprocess.run(["bash", "-c", f'. {LAUNCH / "common.sh"}; is_command_word "$1"', "_", word]).returncode
    assert (code == 0) == is_command


def test_slurm_task_runs_the_named_command():
    env = {**launch_env(), "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "MASTER_ADDR": "127.0.0.1"}
    out = subprocess.run([str(LAUNCH / "slurm_task.sh"), "finetune", "--help"], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "usage: megakd finetune" in out.stdout and "--resume" in out.stdout
