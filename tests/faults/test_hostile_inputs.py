"""Inputs built to do harm → exit 2 and one short line naming the file, key or argument; nothing
outside what the command owns changes.

A run directory's `.lock` that is a link (or a directory), a "billion laughs" YAML config, a
megabyte-long value, numbers beyond every range a key can use, and, for the launch scripts, a
module in the current directory shadowing one megakd imports, a busy rendezvous port, and
arguments carrying shell code to DeepSpeed's multi-node runner.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.faults.harness import REPO, megakd, megakd_peak, snapshot
from tests.helpers import tiny_overrides

CONFIG = REPO / "configs" / "electra-tiny.yaml"
LAUNCH = REPO / "launch"
BOMB = "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9 if p else ['lol'] * 9)}]\n"
               for p, c in zip(["", *"abcdefgh"], "abcdefghi"))  # 9**9 strings from ~400 bytes


def assert_one_line(out, pattern: str, max_len: int = 1000) -> None:
    assert out.code == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.error_line()
    assert re.search(pattern, line), line[:2000]
    assert len(out.stderr) <= max_len, f"{len(out.stderr)} characters on stderr"


# (id, what `.lock` is made to be, error-line pattern)
LOCK_ROWS = [
    ("symlink-to-outside-file", "link", r"/run/\.lock: is a symbolic link; expected a regular file"),
    ("dangling-symlink", "dangling", r"/run/\.lock: is a symbolic link; expected a regular file"),
    ("directory", "dir", r"/run/\.lock: is a directory; expected a regular file"),
    ("fifo", "fifo", r"/run/\.lock: not a regular file; expected a regular file"),
]


@pytest.mark.parametrize(("kind", "pattern"), [r[1:] for r in LOCK_ROWS], ids=[r[0] for r in LOCK_ROWS])
def test_run_dir_lock_never_follows_a_link(tiny_data, tmp_path, kind, pattern):
    run, outside = tmp_path / "run", tmp_path / "outside.txt"
    run.mkdir()
    outside.write_text("precious\n")
    lock = run / ".lock"
    {"link": lambda: lock.symlink_to(outside), "dangling": lambda: lock.symlink_to(tmp_path / "created"),
     "dir": lock.mkdir, "fifo": lambda: os.mkfifo(lock)}[kind]()
    before = snapshot(tmp_path)
    out = megakd("pretrain", "-c", str(CONFIG), *tiny_overrides(tiny_data, run, **{"train.max_steps": 1}),
                 timeout=300)
    assert_one_line(out, r"^megakd: error: \S+" + pattern)
    assert outside.read_text() == "precious\n"
    assert not (tmp_path / "created").exists() and not (tmp_path / "created").is_symlink()
    assert snapshot(tmp_path) == before


def test_yaml_alias_bomb_is_refused_in_bounded_memory(tmp_path):
    (tmp_path / "bomb.yaml").write_text(BOMB)
    assert len(BOMB) < 500
    out, peak = megakd_peak("pretrain", "-c", str(tmp_path / "bomb.yaml"), f"run.dir={tmp_path / 'run'}")
    assert_one_line(out, r"^megakd: error: \S+/bomb.yaml, line \d+: YAML aliases expand this node to more than "
                         r"100000 values")
    assert peak < 2 * 1024**3, f"peak memory {peak} bytes"
    assert not (tmp_path / "run").exists()


def test_yaml_anchors_that_megakd_recipes_use_still_load():
    from megakd.config import load_config

    cfg = load_config(REPO / "configs" / "electra-base.yaml")  # `discriminator: *base`
    assert cfg.model.discriminator.hidden_size == cfg.model.generator.hidden_size == 768


# (id, config file text or None for electra-tiny.yaml, overrides, error-line pattern)
CONFIG_ROWS = [
    ("megabyte-string-for-an-integer", "train:\n  max_steps: '" + "x" * 1_000_000 + "'\n", [],
     r"train.max_steps: expected an integer, got 'x+\.\.\.x+' \(in \S+/bad.yaml\)$"),
    ("5000-digit-integer-in-a-file", "train:\n  max_steps: " + "9" * 5000 + "\n", [],
     r"\S+/bad.yaml, line 2: an integer of 5000 characters is too long \(expected a config value\)$"),
    ("5000-digit-override", None, ["train.max_steps=" + "9" * 5000],
     r"override train.max_steps: an integer of 5000 characters is too long"),
    ("400-digit-lr", None, ["optim.discriminator.lr=" + "9" * 400],
     r"optim.discriminator.lr: expected a finite number, got 9+\.\.\.9+ \(on the command line\)$"),
    ("seed-2**70", None, [f"train.seed={2**70}"], r"train.seed: expected a 64-bit integer, got \d+ "),
    ("seed-2**32", None, [f"train.seed={2**32}"],
     r"train.seed: expected a seed in \[0, 2\*\*32\), got 4294967296$"),
    ("seed-negative", None, ["train.seed=-1"], r"train.seed: expected a seed in \[0, 2\*\*32\), got -1$"),
    ("max-steps-2**40", None, [f"train.max_steps={2**40}"],
     r"train.max_steps: expected an integer below 2\*\*31"),
    ("batch-2**31", None, [f"train.global_batch_size={2**31}"],
     r"train.global_batch_size: expected an integer below 2\*\*31"),
    ("alias-bomb-override", None, ["train.seed=" + BOMB.replace("\n", ", ").join("{}")],
     r"override train.seed: YAML aliases expand this node to more than 100000 values"),
]


@pytest.mark.parametrize(("text", "overrides", "pattern"), [r[1:] for r in CONFIG_ROWS],
                         ids=[r[0] for r in CONFIG_ROWS])
def test_out_of_range_config_is_one_short_line(tmp_path, text, overrides, pattern):
    config = CONFIG
    if text is not None:
        config = tmp_path / "bad.yaml"
        config.write_text(text)
    before = snapshot(tmp_path)
    out = megakd("pretrain", "-c", str(config), f"run.dir={tmp_path / 'run'}", *overrides)
    assert_one_line(out, r"^megakd: error: " + pattern)
    assert snapshot(tmp_path) == before  # no run directory, no config.yaml


@pytest.mark.parametrize(("override", "pattern"), [
    ("finetune.seeds=[0, -1]", r"finetune.seeds\[1\]: expected a seed in \[0, 2\*\*32\), got -1$"),
    (f"finetune.epochs={2**40}", r"finetune.epochs: expected an integer below 2\*\*31"),
    (f"finetune.batch_size={2**70}", r"finetune.batch_size: expected a 64-bit integer"),
], ids=["seed-negative", "epochs-2**40", "batch-2**70"])
def test_out_of_range_finetune_config_is_one_line(tmp_path, override, pattern):
    out = megakd("finetune", "-c", str(REPO / "configs" / "finetune-rt-base.yaml"),
                 f"run.dir={tmp_path / 'run'}", override)
    assert_one_line(out, r"^megakd: error: " + pattern)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------------------
# launch/


def launch_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The test's Python first on PATH (the scripts call `python`), then a directory for stubs."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "PYTHONPATH", "PYTHONSAFEPATH")}
    env["PATH"] = os.pathsep.join([str(stubs), str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def stub(tmp_path: Path, name: str, body: str) -> None:
    """An executable `name` on launch_env's PATH that runs `body` (Python) with sys.argv."""
    path = tmp_path / "stubs" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"#!{sys.executable}\nimport json, os, sys\n{body}\n")
    path.chmod(0o755)


@pytest.mark.parametrize("cmd", [
    [str(LAUNCH / "torchrun.sh"), "1", "pretrain", "-c", str(CONFIG), "--print-config"],
    [str(LAUNCH / "slurm_task.sh"), "pretrain", "--help"],
], ids=["torchrun", "slurm_task"])
def test_launch_never_imports_from_the_current_directory(tmp_path, cmd):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "yaml.py").write_text("open('IMPORTED', 'w').close()\nraise SystemExit('yaml.py from the cwd')\n")
    env = launch_env(tmp_path, SLURM_PROCID="0", SLURM_NTASKS="1", MASTER_ADDR="127.0.0.1")
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert not (cwd / "IMPORTED").exists()


def test_slurm_port_is_free_not_derived_from_the_job_id(tmp_path):
    """Job 20001 starts while job 1's rendezvous listens on the port that 20000 + id % 20000 gives both."""
    stub(tmp_path, "srun", "open(os.environ['PORT_FILE'], 'w').write(os.environ['MASTER_PORT'])")
    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            busy.bind(("", 20001))
        except OSError:
            pytest.skip("port 20001 is in use here")
        busy.listen()
        env = launch_env(tmp_path, SLURM_JOB_ID="20001", MEGAKD_REPO=str(REPO),
                         PORT_FILE=str(tmp_path / "port"))
        out = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), "-c", str(CONFIG)], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        port = int((tmp_path / "port").read_text())
        assert port != 20001
        with socket.socket() as probe:
            probe.bind(("", port))  # was free when chosen and nobody took it since


PWN = "run.dir=/tmp/x$(touch PWNED)`touch PWNED2`; touch PWNED3"


def test_deepspeed_arguments_arrive_intact_on_one_node(tmp_path):
    stub(tmp_path, "deepspeed", "json.dump([os.environ.get('PYTHONSAFEPATH'), *sys.argv[1:]], "
                                "open(os.environ['ARGV_FILE'], 'w'))")
    env = launch_env(tmp_path, ARGV_FILE=str(tmp_path / "argv.json"))
    out = subprocess.run([str(LAUNCH / "deepspeed.sh"), "--num_gpus", "1", "-c", "x.yaml", PWN], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    safe_path, *argv = json.loads((tmp_path / "argv.json").read_text())
    assert safe_path == "1"  # the ranks the launcher starts keep the current directory off sys.path too
    assert argv[argv.index("megakd.cli") + 1:] == ["pretrain", "-c", "x.yaml", PWN, "backend.name=deepspeed"]
    assert not list(tmp_path.glob("PWNED*"))


@pytest.mark.parametrize(("args", "env", "pattern"), [
    ([PWN], {},
     r"^launch: error: argument 'run.dir=/tmp/x\$\(touch PWNED\).*': expected only letters, digits"),
    (["run.dir=/tmp/a b"], {}, r"^launch: error: argument 'run.dir=/tmp/a b': expected only letters"),
    (["run.dir=/tmp/ok"], {"NCCL_DEBUG_FILE": "$(touch PWNED)"},
     r"^launch: error: variable NCCL_DEBUG_FILE='\$\(touch PWNED\)': expected no \$"),
], ids=["command-substitution", "space", "exported-variable"])
def test_deepspeed_multi_node_refuses_shell_code(tmp_path, args, env, pattern):
    stub(tmp_path, "deepspeed", "open(os.environ['ARGV_FILE'], 'w').close()")
    (tmp_path / "hostfile").write_text("node1 slots=1\nnode2 slots=1\n")
    before = snapshot(tmp_path)
    out = subprocess.run([str(LAUNCH / "deepspeed.sh"), "--hostfile", "hostfile", "-c", "x.yaml", *args],
                         env=launch_env(tmp_path, ARGV_FILE=str(tmp_path / "called"), **env), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]), out.stderr
    assert not (tmp_path / "called").exists() and not list(tmp_path.glob("PWNED*"))
    assert snapshot(tmp_path) == before
