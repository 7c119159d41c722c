"""Inputs built to do harm → exit 2 and one short line naming the file, key or argument; nothing
outside what the command owns changes.

A run directory's `.lock` that is a link (or a directory), or that is removed or replaced while its
job runs (the job stops at its next commit, and a second job resuming the directory is the only
writer from then on), a "billion laughs" YAML config, a
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
import time
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


# -- another job takes over a run directory whose `.lock` was removed or replaced -----------------------

def _holder(lock: Path) -> bytes:
    return lock.read_bytes()


# (id, what is done to the held `.lock`, how the next commit's one-line error says it changed)
TAKEOVER_ROWS = [
    ("removed", lambda lock: lock.unlink(), r"was removed"),
    ("replaced-by-a-copy", lambda lock: (lock.with_name("copy").write_bytes(_holder(lock)),
                                         os.replace(lock.with_name("copy"), lock)),
     r"was replaced by another file naming host \S+, pid \d+, job [0-9a-f]{16}"),
    ("replaced-by-another-job", lambda lock: (lock.unlink(), lock.write_text("host h, pid 1, job 00\n")),
     r"was replaced by another file naming host h, pid 1, job 00"),
    ("rewritten-in-place", lambda lock: lock.write_text("host h, pid 1, job 00\n"),
     r"was rewritten to name host h, pid 1, job 00"),
]


@pytest.mark.parametrize(("change", "pattern"), [r[1:] for r in TAKEOVER_ROWS], ids=[r[0] for r in TAKEOVER_ROWS])
def test_lock_taken_over_refuses_the_next_commit(tmp_path, change, pattern):
    """Real files and flocks, one process: a commit under a lock whose file changed refuses, temp dir removed."""
    from megakd.store import checkpoint
    from megakd.store.rundir import RunDirLock, RunDirTakenOver

    run = tmp_path / "run"
    lock = RunDirLock(run)
    lock.acquire()
    lock.announce()
    try:
        tmp, final = checkpoint.begin(run, 3, True)
        (tmp / "weights.bin").write_bytes(b"w")
        change(run / ".lock")
        with pytest.raises(RunDirTakenOver) as err:
            checkpoint.commit(tmp, final, 3, keep_last=0)
        line = str(err.value)
        assert re.fullmatch(rf"another job took over {re.escape(str(run))} \(lock {re.escape(str(run))}/\.lock "
                            rf"{pattern}\): stopping without writing", line), line
        assert not tmp.exists() and not final.exists()
        with pytest.raises(RunDirTakenOver):  # nor does the next checkpoint start
            checkpoint.begin(run, 4, True)
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []
    finally:
        lock.release()


def test_lock_kept_commits_as_before(tmp_path):
    from megakd.store import checkpoint
    from megakd.store.rundir import RunDirLock

    with RunDirLock(tmp_path) as lock:
        lock.announce()
        tmp, final = checkpoint.begin(tmp_path, 1, True)
        (tmp / "weights.bin").write_bytes(b"w")
        checkpoint.commit(tmp, final, 1, keep_last=0)
        checkpoint.verify(final)


def _popen(cmd: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as out:
        return subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _wait(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def _saved_steps(log_text: str) -> list[int]:
    return [int(s) for s in re.findall(r"saved checkpoint \S+/step_(\d{8})$", log_text, re.M)]


TAKEOVER_RUN = {"train.max_steps": 100_000, "run.save_every": 2, "run.keep_last": 0, "run.export_hf": "false"}


@pytest.mark.parametrize("resumed", [True, False], ids=["removed-then-resumed-by-another-job", "replaced-by-a-copy"])
def test_lock_taken_over_mid_run_leaves_one_writer(tiny_data, tmp_path, resumed):
    """Job A runs; its `.lock` is removed and job B resumes the run dir (or the lock is replaced by a copy).

    A stops at its next commit, exit 2, one line naming the run dir, its temp checkpoint removed, and
    publishes no checkpoint after the change. With B: every checkpoint A published is at or before the
    step B resumed from, every later one is B's, B finishes, and metrics.jsonl holds steps 1..N in
    order, B's lines after its resume step all there, plus at most A's lines of the steps up to its
    next (refused) save (A checks ownership at commits, not at every metrics line).
    """
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "megakd.cli", "pretrain", "-c", str(CONFIG)]
    a_log, b_log = tmp_path / "a.log", tmp_path / "b.log"
    a = _popen([*cmd, *tiny_overrides(tiny_data, run, **TAKEOVER_RUN)], a_log)
    b = None
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step_00000002").is_dir():
            assert a.poll() is None and time.monotonic() < deadline, a_log.read_text()[-4000:]
            time.sleep(0.05)
        lock = run / ".lock"
        holder = lock.read_text()
        assert f"pid {a.pid}, job " in holder
        before = {p.name for p in (run / "checkpoints").iterdir() if not p.name.startswith(".")}
        if resumed:
            lock.unlink()
            b = _popen([*cmd, "--resume", "auto", *tiny_overrides(tiny_data, run, **{
                **TAKEOVER_RUN, "train.max_steps": 14, "run.save_every": 3})], b_log)
        else:
            lock.with_name("copy").write_text(holder)
            os.replace(lock.with_name("copy"), lock)
        assert _wait(a) == 2, a_log.read_text()[-4000:]
        a_text = a_log.read_text()
        a_last = [ln for ln in a_text.splitlines() if ln.strip()][-1]
        assert re.fullmatch(rf"megakd: error: another job took over {re.escape(str(run))} \(lock "
                            rf"{re.escape(str(lock))} was (removed|replaced by another file naming .*)\): "
                            "stopping without writing", a_last), a_text[-4000:]
        assert "Traceback" not in a_text
        if not resumed:
            after = {p.name for p in (run / "checkpoints").iterdir()}
            assert len(after - before) <= 1, (before, after)  # at most a commit already past its check
            assert not [p for p in after if p.startswith(".")]  # the refused temp checkpoint is gone
            return
        assert _wait(b) == 0, b_log.read_text()[-4000:]
        b_text = b_log.read_text()
        (resumed_at,) = [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", b_text)]
        assert resumed_at >= 2 and max(_saved_steps(a_text)) <= resumed_at, (resumed_at, _saved_steps(a_text))
        assert _saved_steps(b_text)[-1] == 14 and min(_saved_steps(b_text)) > resumed_at
        left = sorted(p.name for p in (run / "checkpoints").iterdir())
        assert not [p for p in left if p.startswith(".")], left
        steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert steps[:resumed_at] == list(range(1, resumed_at + 1)), steps
        # B's lines are all there, in order; A checks ownership at commits, so the only lines it can
        # still append are those of the steps up to its next (refused) save.
        expected, strays = iter(range(resumed_at + 1, 15)), []
        want = next(expected)
        for step in steps[resumed_at:]:
            if step == want:
                want = next(expected, None)
            else:
                strays.append(step)
        save_every = TAKEOVER_RUN["run.save_every"]
        assert want is None and all(resumed_at < s <= resumed_at + save_every for s in strays), steps
        assert f"pid {b.pid}, job " in lock.read_text()  # B's own lock file, released at its end
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def test_lock_is_held_until_the_export_is_published(tiny_data, tmp_path, monkeypatch):
    """Observed, not replaced: while `hf/` is being written the lock is held by this job (a second lock on
    the run dir is refused) and `hf/` is not there yet; the lock is released only after `hf/` appears."""
    from megakd.cli import main
    from megakd.convert import export
    from megakd.store import rundir
    from megakd.store.files import StoreError

    run = tmp_path / "run"
    seen: dict[str, object] = {}
    write, release = export.save_hf_model, rundir.RunDirLock.release

    def observed_write(*args, **kwargs):
        seen.setdefault("lock file during export", (run / ".lock").read_text())
        seen.setdefault("hf during export", (run / "hf").exists())
        try:
            rundir.RunDirLock(run).acquire()
            seen["second lock during export"] = "granted"
        except StoreError as err:
            seen["second lock during export"] = str(err)
        return write(*args, **kwargs)

    def observed_release(self):
        if self._fd is not None and self.path == run / ".lock":
            seen.setdefault("hf at release", (run / "hf" / "discriminator" / "model.safetensors").is_file())
        return release(self)

    monkeypatch.setattr(export, "save_hf_model", observed_write)
    monkeypatch.setattr(rundir.RunDirLock, "release", observed_release)
    assert main(["pretrain", "-c", str(CONFIG), *tiny_overrides(tiny_data, run, **{"train.max_steps": 2})]) == 0
    assert f"pid {os.getpid()}, job " in seen["lock file during export"]
    assert seen["hf during export"] is False
    assert "in use by another megakd job" in seen["second lock during export"], seen
    assert seen["hf at release"] is True
    assert not list(run.glob(".hf.*"))
    with rundir.RunDirLock(run):  # released at the end
        pass


def test_lock_taken_over_during_the_export_publishes_nothing(tiny_data, tmp_path, monkeypatch, capsys):
    """`.lock` replaced (same content) while `hf/` is written: exit 2, one line, no `hf/`, no partial export."""
    from megakd.cli import main
    from megakd.convert import export

    run = tmp_path / "run"
    write = export.save_hf_model

    def replacing_lock(*args, **kwargs):
        lock = run / ".lock"
        if not lock.with_name("copy").exists():
            lock.with_name("copy").write_bytes(lock.read_bytes())
            os.replace(lock.with_name("copy"), lock)
        return write(*args, **kwargs)

    monkeypatch.setattr(export, "save_hf_model", replacing_lock)
    code = main(["pretrain", "-c", str(CONFIG), *tiny_overrides(tiny_data, run, **{"train.max_steps": 2})])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert re.fullmatch(rf"megakd: error: another job took over {re.escape(str(run))} \(lock \S+ was replaced "
                        r"by another file naming .*\): stopping without writing", err[-1]), err
    assert not (run / "hf").exists() and not list(run.glob(".hf.*"))
    assert (run / "checkpoints" / "step_00000002").is_dir()


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
