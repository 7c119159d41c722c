"""What validation costs: seconds per evaluation vs per training step, as a share of training time.

Builds the CPU demo recipe (configs/electra-tiny.yaml: bundled corpus, DecoupledOptim), times
training steps and evaluations of the same trainer side by side (one process, so machine load
affects both alike), and prints the share of wall time
validation takes at each `train.eval_every` (the issue's budget: under 5 % at 200). The training
shards double as the validation set: what an evaluation costs depends on its sample count and the
models, not on which samples they are.

    python tools/bench_validation.py [--steps 20] [--evals 3] [--eval-samples 512] [key=value ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megakd.config import load_config  # noqa: E402
from megakd.engine.pretrain import build_trainer, resolve_data  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/electra-tiny.yaml")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps (after 2 warm-up steps)")
    parser.add_argument("--evals", type=int, default=3, help="timed evaluations (after 1 warm-up)")
    parser.add_argument("--eval-samples", type=int, default=512)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as run_dir:
        base = load_config(args.config, args.overrides)
        _, shards = resolve_data(base)
        cfg = load_config(args.config, [*args.overrides, f"run.dir={run_dir}", f"data.valid_shards={shards}",
                                        "train.eval_every=200", f"train.eval_samples={args.eval_samples}",
                                        "run.progress_bar=false"])
        trainer = build_trainer(cfg)
        try:
            batches = iter(trainer.loader)
            for _ in range(2):
                trainer.train_step(batches)
            step_times = []
            for _ in range(args.steps):
                start = time.perf_counter()
                trainer.train_step(batches)
                step_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.validator.evaluate()  # the first one also reads the validation batches
            first = time.perf_counter() - start
            eval_times = []
            for _ in range(args.evals):
                start = time.perf_counter()
                trainer.validator.evaluate()
                eval_times.append(time.perf_counter() - start)
        finally:
            trainer.backend.close()
    step, evaluation = statistics.median(step_times), statistics.median(eval_times)
    samples = trainer.validator.num_batches * trainer.loader.plan.micro_batch_size
    print(f"config {args.config}, global batch {cfg.train.global_batch_size}, {samples} validation samples "
          f"per evaluation; medians of {args.steps} steps and {args.evals} evaluations")
    print("\n| | seconds | ratio to one training step |\n|---|---|---|")
    print(f"| training step | {step:.3f} | 1.00 |")
    print(f"| first evaluation (reads the validation shards) | {first:.3f} | {first / step:.2f} |")
    print(f"| evaluation | {evaluation:.3f} | {evaluation / step:.2f} |")
    print("\n| train.eval_every | validation share of wall time |\n|---|---|")
    for every in (50, 100, 200, 500, 1000):
        print(f"| {every} | {100 * evaluation / (every * step + evaluation):.2f} % |")


if __name__ == "__main__":
    main()
