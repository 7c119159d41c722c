"""What every fault-injection test needs: run a command, and prove what it did (not) change.

Each fault test is a table row: a bad input or an injected fault, the exit code the command must
end with, a fragment of the one-line message (naming the file or key), and whether the run
directory must be byte-identical before and after.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (relative path → digest); directories by their listing."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if path.is_file() and not path.is_symlink():
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        elif path.is_dir():
            out[rel + "/"] = ""
    return out


@dataclass
class Outcome:
    code: int
    stdout: str
    stderr: str

    def error_line(self) -> str:
        """The last non-empty stderr line: where a one-line error must be."""
        lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
        return lines[-1] if lines else ""


# What `megakd` commands import: torch, transformers (the export), the engine, fine-tuning, the data
# pipeline. A fresh interpreter pays ~2-4 s of imports per command, more than most fault rows' own
# work; a fork server imports them once per test process and forks each command from it.
_PRELOAD = ["megakd.cli", "megakd.convert", "megakd.engine.pretrain", "megakd.finetune.runtime",
            "megakd.data.shards", "megakd.data.loader"]


def _fork_server():
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def _command(args: list[str], env: dict[str, str], cwd: str, out: str, err: str, peak: str | None) -> None:
    """In the forked child: become `python -m megakd.cli ARGS` (its own cwd, environment, stdout and
    stderr files), and exit as the interpreter would (its atexit handlers included). With `peak`, write
    there the most resident memory the command and its waited-for children had, in KiB."""
    import atexit
    import resource

    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(file, fd)
        os.close(file)
    sys.argv = [str(REPO / "megakd" / "cli.py"), *args]
    from megakd.cli import console

    try:
        console()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    if peak is not None:
        usage = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        Path(peak).write_text(str(usage))
    os._exit(code)


def _run(args: tuple[str, ...], env: dict[str, str] | None, timeout: float, cwd: Path,
         peak: bool) -> tuple[Outcome, int | None]:
    import tempfile

    full_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="megakd-cmd-") as tmp:
        out, err, peak_file = (os.path.join(tmp, name) for name in ("stdout", "stderr", "peak_kib"))
        child = _fork_server().Process(target=_command, args=(list(args), full_env, str(cwd), out, err,
                                                              peak_file if peak else None))
        child.start()
        child.join(timeout)
        if child.is_alive():
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["megakd", *args], timeout)
        with open(out, encoding="utf-8", errors="replace") as o, open(err, encoding="utf-8", errors="replace") as e:
            outcome = Outcome(child.exitcode, o.read(), e.read())
        assert not peak or os.path.exists(peak_file), f"no peak memory reported (exit {child.exitcode})"
        return outcome, int(Path(peak_file).read_text()) * 1024 if peak else None


def megakd(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
           cwd: Path = REPO) -> Outcome:
    """Run `python -m megakd.cli ARGS` in a process of its own (so signals, exit codes and stderr are
    real), forked from a server that has imported megakd (`_PRELOAD`) but run nothing."""
    return _run(args, env, timeout, cwd, peak=False)[0]


def megakd_peak(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> tuple[Outcome, int]:
    """`megakd(*args)` and the command's peak resident memory in bytes (its own or a waited-for
    child's, whichever is larger: a forked command starts with the server's imports resident, as a
    fresh interpreter has them after importing)."""
    return _run(args, env, timeout, REPO, peak=True)


def two_step_run(tiny_data, root: Path, *, version1: bool = False) -> Path:
    """`root/run`: a 2-step tiny pretraining run with its checkpoint, what fault rows resume from.

    `version1` runs it on an unindexed (manifest version 1) copy of the shards in `root/shards`: the
    manifest is part of the data fingerprint, so rows about version-1 shards resume from this one.
    """
    import shutil

    from tests.data.conftest import unindexed
    from tests.helpers import tiny_overrides

    tokenizer_dir, shards = tiny_data
    if version1:
        shards = root / "shards"
        shutil.copytree(tiny_data[1], shards)
        unindexed(shards)
    run = root / "run"
    out = megakd("pretrain", "-c", "configs/electra-tiny.yaml",
                 *tiny_overrides((tokenizer_dir, shards), run, **{"train.max_steps": 2, "run.export_hf": "false"}))
    assert out.code == 0, out.stderr
    return run
