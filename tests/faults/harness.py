"""What every fault-injection test needs: run a command, and prove what it did (not) change.

Each fault test is a table row: a bad input or an injected fault, the exit code the command must
end with, a fragment of the one-line message (naming the file or key), and whether the run
directory must be byte-identical before and after.
"""

from __future__ import annotations

import hashlib
import os
import re
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


def megakd(*args: str, env: dict[str, str] | None = None, timeout: float = 600,
           cwd: Path = REPO) -> Outcome:
    """Run `python -m megakd.cli ARGS` in a fresh process (so signals, exit codes and stderr are real)."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "megakd.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    return Outcome(proc.returncode, proc.stdout, proc.stderr)


# Runs the command as its own child and reports that child's peak resident memory (the child's
# waited-for descendants included) on its last stdout line, so earlier children of pytest do not count.
_PEAK_WRAPPER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
                 "print('\\npeak_kib=%d' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True); "
                 "sys.exit(code)")


def megakd_peak(*args: str, env: dict[str, str] | None = None, timeout: float = 600) -> tuple[Outcome, int]:
    """`megakd(*args)` and the command's peak resident memory in bytes."""
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-c", _PEAK_WRAPPER, sys.executable, "-m", "megakd.cli", *args],
                          cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout)
    found = re.search(r"\npeak_kib=(\d+)\n$", proc.stdout)
    assert found, proc.stdout[-500:]
    return Outcome(proc.returncode, proc.stdout[: found.start()], proc.stderr), int(found.group(1)) * 1024


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
