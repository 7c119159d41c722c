"""Fine-tuning throughput on the RT task: one process against `launch/torchrun.sh N` (DDP over gloo on CPU).

Both sides run `megakd finetune -c configs/finetune-rt.yaml` with the same global batch, model and
data, one after the other in this run (so the machine's load affects both alike), from a random-init
encoder of the CPU demo discriminator's shape on the bundled tokenizer. Each side's speed is the
median of the `samples_per_s` its metrics.jsonl logs per interval (training time only: the epoch's
dev evaluation is excluded), after dropping the first interval (warm-up). Prints a table with the
ratio to one process.

    python tools/bench_finetune.py [--examples 2000] [--epochs 1] [--batch-size 32] [--nproc 2] [key=value ...]

Tiny smoke run: `--examples 64 --batch-size 8 model.encoder.hidden_size=16 model.encoder.num_layers=1
model.encoder.intermediate_size=32 model.encoder.num_heads=2`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megakd.config import load_config  # noqa: E402
from megakd.data.tokenizer import Tokenizer  # noqa: E402
from megakd.engine.pretrain import resolve_data  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEMO_DISCRIMINATOR = {"hidden_size": 128, "num_layers": 3, "num_heads": 4, "intermediate_size": 512,
                      "embedding_size": 64, "max_position_embeddings": 128}


def run_side(name: str, launcher: list[str], overrides: list[str], out: Path) -> float:
    """Run one side; its median samples/s over the logged intervals after the first."""
    run_dir = out / name
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    cmd = [*launcher, "finetune", "-c", str(REPO / "configs" / "finetune-rt.yaml"), f"run.dir={run_dir}", *overrides]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{name}: {' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rates = [r["samples_per_s"]
             for r in map(json.loads, (run_dir / "seed_0" / "metrics.jsonl").read_text().splitlines())
             if "samples_per_s" in r]
    if len(rates) < 2:
        sys.exit(f"{name}: only {len(rates)} logged intervals; raise --examples or lower --log-every")
    return statistics.median(rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=2000, help="RT train examples (task.max_train_examples)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch (finetune.batch_size)")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=5, help="steps per logged interval")
    parser.add_argument("overrides", nargs="*", help="key=value overrides for both sides, e.g. model.encoder.*")
    args = parser.parse_args()
    tokenizer, _ = resolve_data(load_config(REPO / "configs" / "electra-tiny.yaml"))
    vocab = Tokenizer.load(tokenizer).vocab_size
    common = ["model.path=", "model.init=random", f"model.tokenizer={tokenizer}", f"model.encoder.vocab_size={vocab}",
              *(f"model.encoder.{k}={v}" for k, v in DEMO_DISCRIMINATOR.items()),
              f"task.max_train_examples={args.examples}", "task.max_dev_examples=64", "finetune.max_seq_len=128",
              f"finetune.batch_size={args.batch_size}", f"finetune.epochs={args.epochs}", "finetune.seeds=[0]",
              "finetune.lr=1e-3", f"finetune.log_every={args.log_every}", "run.progress_bar=false",
              "run.tensorboard=false", *args.overrides]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        single = run_side("single", [sys.executable, "-m", "megakd.cli"], common, out)
        parallel = run_side(f"ddp{args.nproc}", [str(REPO / "launch" / "torchrun.sh"), str(args.nproc)],
                            [*common, "backend.name=ddp"], out)
    print(f"RT fine-tuning, {args.examples} train examples, global batch {args.batch_size}, {args.epochs} epoch(s); "
          f"samples/s = median over logged intervals of {args.log_every} steps (first dropped)")
    print("\n| backend | processes | samples/s | ratio to one process |\n|---|---|---|---|")
    print(f"| single | 1 | {single:.1f} | 1.00 |")
    print(f"| ddp (gloo on CPU) | {args.nproc} | {parallel:.1f} | {parallel / single:.2f} |")


if __name__ == "__main__":
    main()
