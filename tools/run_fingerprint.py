"""Fingerprint small real runs of every job kind, so that a refactor can show it changed no result.

A redesign that promises "behaviour unchanged" (issue #62) needs evidence stronger than passing tests:
every run's metrics, checkpoints and exports bit-identical before and after. `run` drives the real
`megakd` CLI through a short demo pretraining and its resume, a fine-tuning run, a GLUE run and a DWT
run, then records a digest of every file each run leaves (tensors by dtype, shape and bytes; JSON,
YAML and metrics lines by key, wall-clock fields dropped); `compare` prints what differs:

    python tools/run_fingerprint.py run --out /tmp/fp/before --data /tmp/fp/data   # on the old tree
    python tools/run_fingerprint.py run --out /tmp/fp/after --data /tmp/fp/data    # on the new tree
    python tools/run_fingerprint.py compare /tmp/fp/before/fingerprint.json /tmp/fp/after/fingerprint.json

The runs use the `megakd` the interpreter imports, not the current directory's (PYTHONPATH=<worktree>
fingerprints another tree; the header records `megakd.__file__`, and each run's log starts with the
one it imported). `--data` holds the generated GLUE files: written once, reused by every later run,
so both sides read the same input. Every file of a run directory is fingerprinted, so a file one side
adds shows up instead of being skipped; only the files in `VOLATILE` are recorded as present without
their content. The data cache ($MEGAKD_CACHE: tokenizer, shards) is shared, as a user's runs share it.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import platform
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

FORMAT = "megakd-run-fingerprint/1"
# Keys whose values are wall-clock measurements (megakd/engine/layouts.py tokens_per_s,
# megakd/finetune/layout.py samples_per_s, megakd/engine/probe.py probe_seconds): dropped wherever
# they occur (metrics lines, JSON, YAML, pickles).
TIMING_KEYS = frozenset({"tokens_per_s", "samples_per_s", "probe_seconds"})
# Files whose content is not a result: the run lock (host, pid, job id) and TensorBoard event files
# (wall-clock time stamps; the runs turn TensorBoard off, so one appearing is a difference by itself).
VOLATILE = (".lock", "events.out.tfevents.*")
# Sections that record other files' bytes, kept as the list of the files they name: each of those is
# fingerprinted by content, and its bytes vary where its content does not (a config.yaml holds the run
# directory; safetensors writes its metadata in hash-map order).
BYTE_DIGESTS = {"manifest.json": "files"}
# Entries that differ between two runs of one tree at 119f895: Python's and numpy's global random
# streams, saved in every checkpoint (megakd/engine/session.py rng_state) but seeded only for a rank
# added on resume (megakd/engine/loop.py RandomStreams.load_resharded), never on a fresh run. Nothing
# in megakd draws from them. `compare` lists them apart and does not count them as differences.
UNSEEDED = {"trainer_state_rank*.pt": ("rng.python", "rng.numpy")}
TENSOR_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".npy")
SHORT = 80  # a leaf whose JSON is at most this long is stored as itself, a longer one as its digest
WIDE = 64  # a plain list or dict with more items than this is one leaf (a vocabulary, an RNG state)

# Sizes: about 30 s for all five on 2 idle cores (3 min on busy ones), each through its real entry path;
# the demo accumulates two micro-batches per step and probes on both sides of its resume.
PRETRAIN = ["train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=2",
            "train.probe_every=4", "train.probe_fit_examples=64", "train.probe_eval_examples=32"]
QUIET = ["run.progress_bar=false", "run.tensorboard=false", "run.wandb=false"]
GLUE_TASKS = "cola,mrpc,stsb"  # one single-sentence task, one pair task, one regression task
GLUE_DATA = ["--tasks", GLUE_TASKS, "--train", "64", "--dev", "32", "--test", "16"]


def legs(out: Path, data: Path) -> list[tuple[str, Path, list[str]]]:
    """(name, run dir, CLI arguments) of each run, in order: the later ones read the demo's outputs."""
    demo = out / "demo"
    return [
        ("demo", demo, ["pretrain", "-c", "configs/electra-tiny.yaml", "train.max_steps=8", *PRETRAIN]),
        ("demo-resumed", demo, ["pretrain", "-c", "configs/electra-tiny.yaml", "--resume", "auto",
                                "--allow-change", "train.max_steps", "train.max_steps=12", *PRETRAIN]),
        ("finetune", out / "finetune", ["finetune", "-c", "configs/finetune-rt.yaml",
                                        f"model.path={demo}/hf/discriminator", "task.max_train_examples=128",
                                        "task.max_dev_examples=64", "finetune.epochs=1", "finetune.seeds=[0,1]"]),
        ("glue", out / "glue", ["glue", "-c", "configs/glue.yaml", f"model.path={demo}/hf/discriminator",
                                f"glue.data_dir={data / 'glue'}", f"glue.tasks=[{GLUE_TASKS}]", "finetune.epochs=1",
                                "glue.long_epochs=1", "finetune.seeds=[1]"]),
        ("dwt", out / "dwt", ["distill", "-c", "configs/dwt-tiny.yaml", f"distill.teacher={demo}",
                              "model.generator.num_layers=2", "train.max_steps=6", "train.global_batch_size=8",
                              "train.micro_batch_size=8", "train.log_every=2"]),
    ]


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


class Fingerprinter:
    """Digests of the files under a directory, with `out`/`data` paths written as <OUT>/<DATA> in every
    string so two runs in different directories compare equal."""

    def __init__(self, out: Path, data: Path):
        self.paths = sorted(((str(out.resolve()), "<OUT>"), (str(data.resolve()), "<DATA>")),
                            key=lambda p: -len(p[0]))

    def text(self, s: str) -> str:
        for path, name in self.paths:
            s = s.replace(path, name)
        return s

    def tree(self, root: Path) -> dict[str, dict]:
        """{relative path: {"kind": ..., "entries": {key: value or digest}}} of every file under `root`."""
        return {f.relative_to(root).as_posix(): self.file(f) for f in sorted(root.rglob("*")) if f.is_file()}

    def file(self, path: Path) -> dict:
        if any(fnmatch.fnmatch(path.name, pattern) for pattern in VOLATILE):
            return {"kind": "volatile", "entries": {}}
        suffix = path.suffix.lower()
        if suffix in TENSOR_SUFFIXES:
            return {"kind": "tensors", "entries": self.walk(load_tensors(path))}
        if suffix == ".zip":  # members, not the archive: its bytes carry the members' modification times
            with zipfile.ZipFile(path) as z:
                return {"kind": "zip", "entries": {i.filename: digest(z.read(i)) for i in z.infolist()}}
        raw = path.read_bytes()
        try:
            content = raw.decode("utf-8")
        except UnicodeDecodeError:
            return {"kind": "bytes", "entries": {"": digest(raw)}}
        if suffix == ".json":
            obj = json.loads(content)
            if path.name in BYTE_DIGESTS:
                obj[BYTE_DIGESTS[path.name]] = sorted(obj[BYTE_DIGESTS[path.name]])
            return {"kind": "json", "entries": self.walk(obj)}
        if suffix in (".yaml", ".yml"):
            import yaml

            return {"kind": "yaml", "entries": self.walk(yaml.safe_load(content))}
        if suffix == ".jsonl":  # line by line, however many: a changed line is named
            entries: dict[str, str] = {}
            for i, line in enumerate(ln for ln in content.splitlines() if ln.strip()):
                self.walk(json.loads(line), f"[{i}]", entries)
            return {"kind": "jsonl", "entries": entries}
        return {"kind": "text", "entries": {"": digest(self.text(content).encode())}}

    def walk(self, obj, key: str = "", into: dict | None = None) -> dict[str, str]:
        """Flatten `obj` into {dotted key: leaf}: a tensor as "dtype shape digest", a short plain value as
        its JSON, anything longer as "sha:digest"; keys in TIMING_KEYS are dropped."""
        into = {} if into is None else into
        if isinstance(obj, dict) and not (len(obj) > WIDE and plain(obj)):
            for k, v in obj.items():
                if str(k) not in TIMING_KEYS:
                    self.walk(v, f"{key}.{k}" if key else str(k), into)
        elif isinstance(obj, (list, tuple)) and not (len(obj) > WIDE and plain(obj)):
            for i, v in enumerate(obj):
                self.walk(v, f"{key}[{i}]", into)
        elif hasattr(obj, "dtype") and hasattr(obj, "shape"):  # torch tensor or numpy array
            into[key] = tensor_leaf(obj)
        else:
            value = json.dumps(self.normalized(obj), sort_keys=True, default=repr)
            into[key] = value if len(value) <= SHORT else f"sha:{digest(value.encode())}"
        return into

    def normalized(self, obj):
        if isinstance(obj, str):
            return self.text(obj)
        if isinstance(obj, dict):
            return {str(k): self.normalized(v) for k, v in obj.items() if str(k) not in TIMING_KEYS}
        if isinstance(obj, (list, tuple)):
            return [self.normalized(v) for v in obj]
        return obj


def plain(obj) -> bool:
    """JSON data only (no tensors), so that it can be digested as one leaf."""
    if isinstance(obj, dict):
        return all(plain(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(plain(v) for v in obj)
    return obj is None or isinstance(obj, (str, int, float, bool))


def load_tensors(path: Path):
    """The object a tensor file holds: safetensors' tensors and metadata, a numpy array, or a torch pickle
    (weights_only first; a pickle of other objects is loaded in full: these files are the runs' own)."""
    import torch

    if path.suffix == ".npy":
        import numpy as np

        return np.load(path, allow_pickle=False)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return {"metadata": f.metadata() or {}, "tensors": {k: f.get_tensor(k) for k in sorted(f.keys())}}
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        return torch.load(path, map_location="cpu", weights_only=False)


def tensor_leaf(t) -> str:
    import numpy as np
    import torch

    if not isinstance(t, torch.Tensor):  # a numpy array or scalar
        t = torch.from_numpy(np.ascontiguousarray(t))
    flat = t.detach().cpu().reshape(-1).contiguous()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} {digest(data)}"


def megakd_location(scratch: Path) -> dict:
    """Which megakd the runs import (PYTHONPATH's or the installed one: asked in `scratch`, a directory
    without one), and that tree's commit: the header of a fingerprint."""
    probe = "import megakd, torch; print(megakd.__file__); print(torch.__version__)"
    module, torch_version = subprocess.run([sys.executable, "-c", probe], cwd=scratch, check=True,
                                           capture_output=True, text=True).stdout.split()
    root = Path(module).resolve().parents[1]
    git = ["git", "-C", str(root)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout.strip()
    return {"megakd": module, "root": str(root), "commit": commit, "dirty": bool(dirty),
            "python": platform.python_version(), "torch": torch_version,
            "megakd_cache": os.environ.get("MEGAKD_CACHE", "")}


def entry(root: Path) -> list[str]:
    """The `megakd` console script as this tree's pyproject.toml declares it, run by this interpreter
    (the installed script belongs to whichever tree was installed; the command runs in `root`, so
    `root` is first on sys.path). Its first line of output names the megakd it imported."""
    module, function = re.search(r'^megakd\s*=\s*"([\w.]+):(\w+)"', (root / "pyproject.toml").read_text(),
                                 re.MULTILINE).groups()
    return [sys.executable, "-c", "import sys, megakd; print('imported', megakd.__file__, flush=True); "
            f"sys.argv[0] = 'megakd'; from {module} import {function}; {function}()"]


def run(out: Path, data: Path) -> int:
    out, data = out.resolve(), data.resolve()
    if out.exists() and any(out.iterdir()):
        sys.exit(f"--out {out}: not empty; choose a new directory")
    (out / "logs").mkdir(parents=True)
    header = megakd_location(out)
    root = Path(header["root"])
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    if not (data / "glue").exists():
        subprocess.run([sys.executable, str(root / "tools" / "make_glue_data.py"), "--out", str(data / "glue"),
                        *GLUE_DATA], cwd=root, env=env, check=True)
    fp = Fingerprinter(out, data)
    runs, started = {}, time.monotonic()
    for name, run_dir, args in legs(out, data):
        argv = [*entry(root), *args, f"run.dir={run_dir}", *QUIET]
        log_path = out / "logs" / f"{name}.log"
        began = time.monotonic()
        with log_path.open("w") as log:
            code = subprocess.run(argv, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        seconds = time.monotonic() - began
        if code != 0:
            print(log_path.read_text()[-3000:], file=sys.stderr)
            sys.exit(f"{name}: exit {code} after {seconds:.0f} s (log: {log_path})")
        imported = log_path.read_text().splitlines()[0]
        if imported != f"imported {header['megakd']}":
            sys.exit(f"{name}: {imported}, not {header['megakd']} (log: {log_path})")
        runs[name] = {"args": [fp.text(a) for a in args], "seconds": round(seconds, 1), "files": fp.tree(run_dir)}
        print(f"{name}: {seconds:.0f} s, {len(runs[name]['files'])} files", flush=True)
    result = {"format": FORMAT, **header, "seconds": round(time.monotonic() - started, 1),
              "inputs": fp.tree(data), "runs": runs}
    (out / "fingerprint.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {out / 'fingerprint.json'} ({result['seconds']:.0f} s; megakd {header['megakd']}, "
          f"commit {header['commit'][:9]}{' + changes' if header['dirty'] else ''})")
    return 0


def differences(a: dict, b: dict) -> tuple[list[str], list[str]]:
    """One line per artifact (input file, run command, run file) that differs between fingerprints `a` and
    `b`; and the files that differ only in their `UNSEEDED` entries."""
    lines, unseeded = [], []
    sides = {"(inputs)": ({"files": a["inputs"]}, {"files": b["inputs"]})}
    for name in sorted(set(a["runs"]) | set(b["runs"])):
        sides[name] = (a["runs"].get(name), b["runs"].get(name))
    for name, (ra, rb) in sides.items():
        if ra is None or rb is None:
            lines.append(f"{name}: run only in {'B' if ra is None else 'A'}")
            continue
        if ra.get("args") != rb.get("args"):
            lines.append(f"{name}: command differs: {ra.get('args')} -> {rb.get('args')}")
        for path in sorted(set(ra["files"]) | set(rb["files"])):
            fa, fb = ra["files"].get(path), rb["files"].get(path)
            if fa is None or fb is None:
                lines.append(f"{name}/{path}: only in {'B' if fa is None else 'A'}")
            elif results(path, fa) != results(path, fb):
                lines.append(f"{name}/{path}: {entry_changes(results(path, fa), results(path, fb))}")
            elif fa != fb:
                unseeded.append(f"{name}/{path}")
    return lines, unseeded


def results(path: str, fingerprint: dict) -> dict:
    """`fingerprint` (a file's) without its UNSEEDED entries."""
    skip = tuple(key for pattern, keys in UNSEEDED.items() if fnmatch.fnmatch(Path(path).name, pattern) for key in keys)
    return {**fingerprint, "entries": {k: v for k, v in fingerprint["entries"].items() if not k.startswith(skip)}}


def entry_changes(fa: dict, fb: dict, shown: int = 4) -> str:
    if fa["kind"] != fb["kind"]:
        return f"kind {fa['kind']} -> {fb['kind']}"
    ea, eb = fa["entries"], fb["entries"]
    changed = [k for k in ea if k in eb and ea[k] != eb[k]]
    parts = [f"{k or '(content)'}: {ea[k]} -> {eb[k]}" for k in changed[:shown]]
    parts += [f"{len(changed) - shown} more changed"] if len(changed) > shown else []
    for side, mine, other in (("A", ea, eb), ("B", eb, ea)):
        only = [k for k in mine if k not in other]
        if only:
            parts.append(f"only in {side}: {', '.join(only[:shown])}{' ...' if len(only) > shown else ''}")
    return f"{fa['kind']}, {len(changed)} of {len(ea)} entries differ; " + "; ".join(parts)


def compare(path_a: Path, path_b: Path) -> int:
    a, b = (json.loads(p.read_text()) for p in (path_a, path_b))
    for side, fp, path in (("A", a, path_a), ("B", b, path_b)):
        print(f"{side}: {path}: megakd {fp['megakd']}, commit {fp['commit'][:9]}"
              f"{' + changes' if fp['dirty'] else ''}, {fp['seconds']:.0f} s")
    lines, unseeded = differences(a, b)
    print("\n".join(lines) if lines else
          f"identical: {len(a['runs'])} runs, {sum(len(r['files']) for r in a['runs'].values())} files")
    if unseeded:
        print(f"not counted: {len(unseeded)} files differ only in random streams no run seeds "
              f"({', '.join(sorted({k for keys in UNSEEDED.values() for k in keys}))}): {', '.join(unseeded)}")
    return 1 if lines else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="run the five legs and write OUT/fingerprint.json")
    p_run.add_argument("--out", type=Path, required=True, help="a new directory for the runs and fingerprint.json")
    p_run.add_argument("--data", type=Path, required=True,
                       help="the inputs (generated GLUE files): written if missing, else reused as they are")
    p_cmp = sub.add_parser("compare", help="print what differs between two fingerprints (exit 1 if anything)")
    p_cmp.add_argument("a", type=Path)
    p_cmp.add_argument("b", type=Path)
    args = parser.parse_args(argv)
    return run(args.out, args.data) if args.command == "run" else compare(args.a, args.b)


if __name__ == "__main__":
    raise SystemExit(main())
