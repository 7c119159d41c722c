"""Soak: a long pretraining run with validation, probe and checkpoints, stopped by SIGTERM and resumed
twice, watched from outside. Resident memory, open file descriptors, the checkpoint directory's size
and the step time must stay flat; the first and last 10 % of the run are printed side by side.

The run is `megakd pretrain -c configs/electra-tiny.yaml` (the bundled corpus) with a smaller batch
so that many steps fit in little time, checkpoints, validation and the probe every `--every` steps
and `run.keep_last=2`, the probe every `--probe-every`. A sampler reads /proc/<pid> (Linux) of the
training process once a second (all samples are left in OUT/soak_samples.jsonl). The checkpoint
size of the first window is 0 until the first save.

    python tools/soak.py [--steps 20000] [--every 500] [--probe-every 2000] [--batch 8] [--out runs/soak]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def last_step(metrics: Path) -> int:
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0
    steps = [json.loads(line).get("step", 0) for line in lines if line.strip()]
    return max(steps, default=0)


class Sampler(threading.Thread):
    """Once a second: (wall time, step, RSS bytes, open fds, checkpoint bytes) of the running process."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.pid: int | None = None
        self.rows: list[dict] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            pid = self.pid
            if pid is None:
                continue
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                rss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmRSS"))
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except (OSError, StopIteration):
                continue
            self.rows.append({"time": time.monotonic(), "step": last_step(self.run_dir / "metrics.jsonl"),
                              "rss": rss, "fds": fds, "ckpt": tree_bytes(self.run_dir / "checkpoints")})


def valid_shards(out: Path) -> Path:
    """Held-out shards of the bundled corpus for validation (the documents `--valid-fraction 0.02` would hold out)."""
    import functools

    from megakd.config import BUNDLED_VOCAB_SIZE
    from megakd.data.default_corpus import bundled_corpus_files, prepare_default_data
    from megakd.data.shards import in_valid_split, write_shards
    from megakd.data.tokenizer import Tokenizer

    cache = os.environ.get("MEGAKD_CACHE", str(Path.home() / ".cache" / "megakd"))
    tokenizer_dir, _ = prepare_default_data(cache, vocab_size=BUNDLED_VOCAB_SIZE, seq_len=128)
    write_shards(bundled_corpus_files("classic"), Tokenizer.load(tokenizer_dir), 128, out,
                 keep=functools.partial(in_valid_split, fraction=0.02))
    return out


def train(args: argparse.Namespace, sampler: Sampler, stop_at: int | None, resume: bool) -> int:
    cmd = [sys.executable, "-m", "megakd.cli", "pretrain", "-c", "configs/electra-tiny.yaml",
           f"run.dir={args.out}", f"data.valid_shards={args.valid}", "train.eval_samples=256",
           f"train.max_steps={args.steps}", f"train.global_batch_size={args.batch}",
           f"train.micro_batch_size={args.batch}", f"run.save_every={args.every}", "run.keep_last=2",
           f"train.eval_every={args.every}", f"train.probe_every={args.probe_every}", "train.log_every=50",
           "run.progress_bar=false", "run.tensorboard=false"]
    if resume:
        cmd += ["--resume", "auto"]
    proc = subprocess.Popen(cmd)
    sampler.pid = proc.pid
    if stop_at is not None:
        while proc.poll() is None and last_step(args.out / "metrics.jsonl") < stop_at:
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
    code = proc.wait()
    sampler.pid = None
    return code


def window(rows: list[dict], lo: float, hi: float, steps: int) -> dict:
    picked = [r for r in rows if lo * steps <= r["step"] < hi * steps] or rows[:1]
    rate = [(b["step"] - a["step"]) / (b["time"] - a["time"]) for a, b in zip(picked, picked[1:])
            if b["step"] > a["step"] and b["time"] > a["time"]]
    return {"rss MiB": statistics.median(r["rss"] for r in picked) / 2**20,
            "open fds": statistics.median(r["fds"] for r in picked),
            "checkpoints MiB": max(r["ckpt"] for r in picked) / 2**20,
            "steps/s": statistics.median(rate) if rate else float("nan")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20_000)
    p.add_argument("--every", type=int, default=500, help="checkpoint and validation interval")
    p.add_argument("--probe-every", type=int, default=2000, help="probe interval (a probe fine-tunes for ~20 s)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--out", type=Path, default=Path("runs/soak"))
    args = p.parse_args()
    for path in (args.out, args.out.with_name(args.out.name + "-valid")):
        if path.exists():
            shutil.rmtree(path)
    args.valid = valid_shards(args.out.with_name(args.out.name + "-valid"))
    sampler = Sampler(args.out)
    sampler.start()
    started = time.monotonic()
    codes = []
    for stop_at, resume in ((args.steps // 3, False), (2 * args.steps // 3, True), (None, True)):
        codes.append(train(args, sampler, stop_at, resume))
        if codes[-1] != 0:
            sys.exit(f"soak: megakd pretrain exited with {codes[-1]}")
    sampler.stopped.set()
    samples = args.out / "soak_samples.jsonl"  # every sample, to see a trend inside the windows
    samples.write_text("".join(json.dumps(row) + "\n" for row in sampler.rows))
    final = last_step(args.out / "metrics.jsonl")
    print(f"{args.steps} steps (reached {final}) in {(time.monotonic() - started) / 60:.1f} min, exit codes {codes} "
          f"(SIGTERM at {args.steps // 3} and {2 * args.steps // 3}, then --resume auto)")
    first, last = window(sampler.rows, 0.0, 0.1, args.steps), window(sampler.rows, 0.9, 1.01, args.steps)
    print(f"{'':<18} {'first 10 %':>12} {'last 10 %':>12} {'last / first':>13}")
    for key in first:
        ratio = f"{last[key] / first[key]:>12.3f}x" if first[key] else f"{'n/a':>13}"
        print(f"{key:<18} {first[key]:>12.2f} {last[key]:>12.2f} {ratio}")


if __name__ == "__main__":
    main()
