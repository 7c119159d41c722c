"""Launching multi-process runs and the single-process reference they are compared with."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import torch

from megakd.config import load_config
from megakd.data.loader import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.engine.backends import free_local_port
from megakd.engine.pretrain import PretrainingJob
from megakd.engine.run import Run
from megakd.engine.runlog import read_metrics as read_metrics_file
from megakd.engine.trainer import Trainer
from megakd.launch import Launch
from megakd.store.checkpoint import latest_checkpoint
from megakd.store.checkpoint_models import read_unit_state

REPO = Path(__file__).parents[2]
CONFIG = REPO / "configs" / "electra-tiny.yaml"
WORKER = Path(__file__).with_name("worker.py")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for launched processes: one thread each (2 cores), shared caches, offline."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="offline",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    env.update(extra)
    return env


def torchrun(nprocs: int, runs: list[dict], spec_path: Path, timeout: float = 600) -> None:
    """Run `runs` (see worker.py) in one `torchrun --nproc_per_node nprocs` launch; raise with its log."""
    spec_path.write_text(json.dumps({"config": str(CONFIG), "runs": runs}))
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nprocs}",
           f"--master_port={free_local_port()}", str(WORKER), str(spec_path)]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")


def read_metrics(run_dir: Path) -> list[dict]:
    return read_metrics_file(run_dir / "metrics.jsonl")


# Every multi-process run is compared with its single-process replay in the same way. The only
# difference left is float32 summation order (gloo all-reduce, ZeRO reduce-scatter, stage
# boundaries), measured ≤ 2e-7 relative; RTOL = 1e-5 still catches a wrong averaging factor, λ or
# clipping threshold (all ≥ 1e-3).
RTOL = 1e-5
WEIGHT_ATOL = 1e-5
ELECTRA_KEYS = ("gen_loss", "gen_acc", "disc_loss", "disc_acc", "rtd_f1", "lr_generator", "lr_discriminator",
                "grad_norm_generator", "grad_norm_discriminator")


def assert_metrics_close(got: list[dict], want: list[dict], keys: tuple[str, ...] = ELECTRA_KEYS) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        for key in keys:
            # kd_loss is a KL: a small difference of two cross-entropies of size ~gen_loss, so its
            # float32 error is absolute (~1e-6 × gen_loss), not relative to its own small value.
            abs_tol = 1e-5 if key == "kd_loss" else 1e-9
            assert math.isclose(g[key], w[key], rel_tol=RTOL, abs_tol=abs_tol), (key, g["step"], g[key], w[key])


def assert_same_weights(run: Path, reference: Path, unit: str) -> None:
    got, ref = read_unit_state(latest_checkpoint(run), unit), read_unit_state(latest_checkpoint(reference), unit)
    assert got.keys() == ref.keys()
    for key in ref:
        torch.testing.assert_close(got[key], ref[key], rtol=0, atol=WEIGHT_ATOL, msg=f"{run.name} {unit} {key}")


def assert_clipping_bites(metrics: list[dict], unit: str, clip: float) -> None:
    """The clip threshold must engage on some steps and not all, or clipping goes untested."""
    clipped = [r[f"grad_norm_{unit}"] > clip for r in metrics]
    assert any(clipped) and not all(clipped), (unit, clipped)


def assert_resume_exact(full: Path, resumed: Path, steps: list[int], units: tuple[str, ...]) -> None:
    """A run resumed mid-way logs exactly the uninterrupted run's metrics and ends with its weights."""
    by_step = {r["step"]: r for r in read_metrics(full)}
    rows = read_metrics(resumed)
    assert [r["step"] for r in rows] == steps
    for r in rows:
        for key, value in r.items():
            if key != "tokens_per_s":
                assert value == by_step[r["step"]][key], (key, r["step"])
    for unit in units:
        a, b = read_unit_state(latest_checkpoint(full), unit), read_unit_state(latest_checkpoint(resumed), unit)
        assert all(torch.equal(a[k], b[k]) for k in a), unit


class _RankInterleaved:
    """The micro-batches of a `world`-rank step, in one process: rank 0's, rank 1's, ..."""

    def __init__(self, loaders: list[PretrainingLoader]):
        self.loaders = loaders

    def __iter__(self):
        iterators = [iter(loader) for loader in self.loaders]
        while True:
            for it in iterators:
                yield next(it)

    def state_dict(self) -> dict:
        return {"ranks": [loader.state_dict() for loader in self.loaders]}

    @property
    def read_retries(self) -> int:
        return sum(loader.read_retries for loader in self.loaders)

    @property
    def num_workers(self) -> int:
        return self.loaders[0].num_workers


class _RankRngLayout:
    """A trainer's layout whose micro-batch i of a step samples replacements with rank i's generator.

    Everything but `micro_step` is the wrapped layout's.
    """

    def __init__(self, layout, rngs: list[torch.Generator]):
        self.layout = layout
        self.rngs = rngs
        self.turn = 0

    def micro_step(self, run, batch, step):
        rng = self.rngs[self.turn % len(self.rngs)]
        self.turn += 1
        return self.layout.micro_step(run, batch, dataclasses.replace(step, rng=rng))

    def __getattr__(self, name):
        return getattr(self.layout, name)


def reference_run(overrides: list[str], world: int) -> Path:
    """Train with the `single` backend on exactly the global batches a `world`-rank run sees."""
    cfg = load_config(CONFIG, [*overrides, "backend.name=single"])
    job = PretrainingJob(cfg, Launch())  # one process
    run = Run(job, job.build_backend())  # the run shell's steps (`run_job`), training the replay in the job's place
    try:
        run.open()
        base = job.build(run)  # micro-batch as in the parallel run, so `world` x its accumulation
        tokenizer = Tokenizer.load(cfg.data.tokenizer)
        loaders = [PretrainingLoader(cfg.data.shards, tokenizer, micro_batch_size=cfg.train.micro_batch_size,
                                     rank=r, world_size=world, seed=cfg.train.seed, mask_prob=cfg.data.mask_prob)
                   for r in range(world)]
        rngs = []
        for r in range(world):
            # The sampling generator a rank-r trainer owns (checked against the trainer for rank 0).
            rngs.append(torch.Generator().manual_seed(cfg.train.seed * 100_003 + r))
        if not torch.equal(rngs[0].get_state(), base.loop.streams.sampling.get_state()):
            raise AssertionError("the trainer's sampling-generator seeding changed: update reference_run")
        # Micro-batch i of a step is what rank i sees, and its replacements are sampled with rank i's
        # generator, so the step's summed gradient is the data-parallel one: only summation order differs.
        replay = Trainer(cfg, run, _RankRngLayout(base.layout, rngs), _RankInterleaved(loaders),
                         tokenizer_dir=base.tokenizer_dir, validator=base.validator)
        run.start()
        replay.train()
    finally:
        job.close()
        run.close()
    return Path(cfg.run.dir)
