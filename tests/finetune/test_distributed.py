"""`megakd finetune` on several processes (launch/torchrun.sh, launch/deepspeed.sh) and across restarts.

A 2-process run (gloo) trains on the same global batches as one process, each rank on its share
with a share-weighted loss, so the two differ only by float32 summation order: weights, dev
logits and logged losses are compared at 1e-5. The train split (17 examples, global batch 8)
ends each epoch with a 1-row batch, so one rank trains on a padding row of weight 0 there: the
uneven split is part of what is compared. A resumed run (SIGTERM through the launcher, or
kill -9) must equal the uninterrupted one bit for bit. Every run is its own process with one
OpenMP thread, as the bit-for-bit comparisons need.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megakd.store.model_dir import load_classifier
from tests.distributed.harness import child_env

pytestmark = pytest.mark.slow

REPO = Path(__file__).parents[2]
LAUNCH = REPO / "launch"
RTOL, ATOL = 1e-5, 1e-6


def tiny_finetune(tokenizer: Path, run_dir: Path, *extra: str, config: str = "finetune-rt.yaml") -> list[str]:
    """A seconds-long random-init fine-tuning run (dropout off): an LR choice among two rates, then one seed."""
    encoder = {"vocab_size": 512, "hidden_size": 16, "num_layers": 1, "intermediate_size": 32,
               "max_position_embeddings": 32, "attention_dropout": 0.0}  # finetune.dropout=0 sets the others
    return ["finetune", "-c", str(REPO / "configs" / config), f"run.dir={run_dir}", "model.path=",
            "model.init=random", f"model.tokenizer={tokenizer}",
            *(f"model.encoder.{k}={v}" for k, v in encoder.items()),
            "task.max_train_examples=17", "task.max_dev_examples=16", "finetune.max_seq_len=32",
            "finetune.batch_size=8", "finetune.eval_batch_size=6", "finetune.epochs=4", "finetune.dropout=0.0",
            "finetune.warmup_frac=0.25", "finetune.lr=[1e-3,3e-3]", "finetune.lr_select_frac=0.3",
            "finetune.seeds=[0]", "finetune.log_every=1", "run.progress_bar=false", "run.tensorboard=false",
            "kernels.backend=torch", *extra]


def launch_env() -> dict[str, str]:
    """The test's Python (and its deepspeed script) first on PATH: the launch scripts call `python`."""
    env = child_env()
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, env=launch_env(), cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout: float = 3600) -> None:
    try:
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0, f"{proc.args} exited {code}:\n{log.read_text()[-6000:]}"


def step_records(path: Path) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def assert_close_runs(got: Path, want: Path, trainings: list[str]) -> None:
    """Same LR choice, logged losses, gradient norms and rates, dev logits and weights (to RTOL/ATOL)."""
    a, b = json.loads((got / "summary.json").read_text()), json.loads((want / "summary.json").read_text())
    assert a["lr"]["lr"] == b["lr"]["lr"]
    for name in trainings:
        ra, rb = step_records(got / name / "metrics.jsonl"), step_records(want / name / "metrics.jsonl")
        assert [r["step"] for r in ra] == [r["step"] for r in rb] and len(ra) > 0
        for key in ("loss", "grad_norm", "lr"):
            np.testing.assert_allclose([r[key] for r in ra], [r[key] for r in rb], rtol=RTOL, atol=ATOL, err_msg=key)
    seed = trainings[-1]
    np.testing.assert_allclose(np.load(got / seed / "dev_logits.npy"), np.load(want / seed / "dev_logits.npy"),
                               rtol=RTOL, atol=ATOL)
    assert_same_classifier(got / seed / "model", want / seed / "model", atol=1e-5)


def assert_same_classifier(got: Path, want: Path, atol: float) -> None:
    a, b = load_classifier(got)[0].state_dict(), load_classifier(want)[0].state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def assert_identical_runs(got: Path, want: Path, trainings: list[str]) -> None:
    """Bit for bit: every logged number but the speed, the dev logits, the weights, the LR record."""
    for name in trainings:
        ra, rb = (list(map(json.loads, (d / name / "metrics.jsonl").read_text().splitlines())) for d in (got, want))
        strip = lambda rows: [{k: v for k, v in r.items() if k != "samples_per_s"} for r in rows]  # noqa: E731
        assert strip(ra) == strip(rb), name
        assert (json.loads((got / name / "result.json").read_text())
                == json.loads((want / name / "result.json").read_text()))
    seed = trainings[-1]
    assert np.array_equal(np.load(got / seed / "dev_logits.npy"), np.load(want / seed / "dev_logits.npy"))
    assert_same_classifier(got / seed / "model", want / seed / "model", atol=0)
    assert json.loads((got / "summary.json").read_text()) == json.loads((want / "summary.json").read_text())


TRAININGS = ["lr_select/lr_0.001", "lr_select/lr_0.003", "seed_0"]


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """2-process DDP and SoTeacher runs (two torchrun launches at once: each rendezvous picks its own
    free port; backend.name left at auto) and their one-process twins, all started together."""
    root = tmp_path_factory.mktemp("ft_dist")
    tok = tiny_data[0]
    sot = ["soteacher.enabled=true", "soteacher.lambda_lr=1e-2", "soteacher.student.init=random",
           "soteacher.student.path=", f"soteacher.student.tokenizer={tok}", "soteacher.student.encoder.vocab_size=512",
           "soteacher.student.encoder.hidden_size=8", "soteacher.student.encoder.num_layers=1",
           "soteacher.student.encoder.intermediate_size=16", "soteacher.student.encoder.max_position_embeddings=32",
           "soteacher.student.encoder.attention_dropout=0.0",
           "finetune.lr=3e-3"]
    launches = {name: start([str(LAUNCH / "torchrun.sh"), "2", *tiny_finetune(tok, root / name, *extra)],
                            root / f"{name}.log")
                for name, extra in (("ddp", []), ("sot_ddp", sot))}
    launches.update({name: start([sys.executable, "-m", "megakd.cli", *tiny_finetune(tok, root / name, *extra)],
                                 root / f"{name}.log") for name, extra in (("single", []), ("sot_single", sot))})
    for name, proc in launches.items():
        finish(proc, root / f"{name}.log")
    return root


def test_two_processes_match_one_on_the_same_global_batch(runs):
    for name, backend in (("ddp", "ddp"), ("single", "single")):  # what backend.name auto became
        assert yaml.safe_load((runs / name / "config.yaml").read_text())["backend"]["name"] == backend
    assert_close_runs(runs / "ddp", runs / "single", TRAININGS)
    assert not list(runs.glob("*/*/checkpoints")) and not list(runs.glob("*/*/*/checkpoints"))  # dropped when done


def test_soteacher_and_its_kd_student_on_two_processes_match_one(runs):
    got, want = runs / "sot_ddp", runs / "sot_single"
    for part in ("teacher", "student"):
        for key in ("loss", "grad_norm"):
            a = [r[key] for r in step_records(got / part / "seed_0" / "metrics.jsonl")]
            b = [r[key] for r in step_records(want / part / "seed_0" / "metrics.jsonl")]
            np.testing.assert_allclose(a, b, rtol=RTOL, atol=ATOL, err_msg=f"{part} {key}")
        np.testing.assert_allclose(np.load(got / part / "seed_0" / "dev_logits.npy"),
                                   np.load(want / part / "seed_0" / "dev_logits.npy"), rtol=RTOL, atol=ATOL)
    # The consistency term read running means built from both ranks' predictions: rank 0's store
    # holds every train example, as the one-process store does.
    store = [np.load(d / "teacher" / "seed_0" / "cr_store" / "mean.npy") for d in (got, want)]
    count = [np.load(d / "teacher" / "seed_0" / "cr_store" / "count.npy") for d in (got, want)]
    assert np.array_equal(count[0], count[1]) and sorted(set(count[0].tolist())) == [0, 4]
    np.testing.assert_allclose(store[0], store[1], rtol=RTOL, atol=ATOL)
    assert any("cr" in r for r in step_records(got / "teacher" / "seed_0" / "metrics.jsonl"))


def test_deepspeed_zero2_matches_one_process(runs, tiny_data, tmp_path):
    """launch/deepspeed.sh with a command word; the script adds backend.name=deepspeed and a free port."""
    log = tmp_path / "ds.log"
    proc = start([str(LAUNCH / "deepspeed.sh"), "--num_gpus", "2",
                  *tiny_finetune(tiny_data[0], tmp_path / "ds", "backend.zero_stage=2")], log)
    finish(proc, log)
    assert "name: deepspeed" in (tmp_path / "ds" / "config.yaml").read_text()
    assert_close_runs(tmp_path / "ds", runs / "single", TRAININGS)


def test_sigterm_to_the_launcher_checkpoints_and_resume_auto_is_exact(runs, tiny_data, tmp_path):
    """SIGTERM while the first LR trial trains: every rank checkpoints, exit 0; --resume auto finishes the same run."""
    run, log = tmp_path / "run", tmp_path / "first.log"
    args = tiny_finetune(tiny_data[0], run, "backend.name=ddp", "run.save_every=1")
    proc = start([str(LAUNCH / "torchrun.sh"), "2", *args], log)
    metrics = run / TRAININGS[0] / "metrics.jsonl"
    deadline = time.monotonic() + 3600
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    finish(proc, log)
    assert "stopped on a signal" in log.read_text()
    assert not (run / "summary.json").exists()
    log2 = tmp_path / "second.log"
    finish(start([str(LAUNCH / "torchrun.sh"), "2", "finetune", "--resume", "auto", *args[1:]], log2), log2)
    assert_identical_runs(run, runs / "ddp", TRAININGS)


def test_kill_9_then_resume_auto_is_bit_exact(runs, tiny_data, tmp_path):
    run = tmp_path / "run"
    args = tiny_finetune(tiny_data[0], run, "run.save_every=1")
    proc = start([sys.executable, "-m", "megakd.cli", *args], tmp_path / "first.log")
    deadline = time.monotonic() + 3600
    while not list((run / TRAININGS[0]).glob("checkpoints/step_*")) and proc.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    assert not (run / "seed_0" / "result.json").exists()
    resumed = start([sys.executable, "-m", "megakd.cli", args[0], "--resume", "auto", *args[1:]],
                    tmp_path / "second.log")
    finish(resumed, tmp_path / "second.log")
    assert_identical_runs(run, runs / "single", TRAININGS)
