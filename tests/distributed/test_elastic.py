"""Elastic resume through the trainer: 2 -> 1 and 1 -> 2 gloo processes, 0 -> 2 data workers.

The data position is global (megakd/data/order.py), so with dropout off and no sampling (BERT-MLM)
a run that changes its layout at step 2 follows the uninterrupted run: same global batches, the
only difference the order of float32 sums (tests/distributed/harness.py's tolerances). The
loader-level tests in tests/data/test_stream.py check the per-epoch multiset of sample indices
for the same layout changes.
"""

from __future__ import annotations

import pytest

from megakd.config import load_config
from megakd.engine.pretrain import run_pretraining
from tests.distributed.harness import (
    CONFIG,
    assert_metrics_close,
    assert_same_weights,
    read_metrics,
    torchrun,
)
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.slow

KEYS = ("gen_loss", "gen_acc", "lr_generator", "grad_norm_generator")
COMMON = {"model.objective": "mlm", "model.generator.dropout": 0.0, "train.max_steps": 4, "run.save_every": 2,
          "train.global_batch_size": 16, "train.micro_batch_size": 4, "run.export_hf": "false",
          "run.keep_last": 0, "kernels.backend": "torch"}


def _overrides(tiny_data, run, **extra) -> list[str]:
    # validation every 2 steps on held-out shards, so DDP's evaluation is covered too
    return tiny_overrides(tiny_data, run, **{**COMMON, "data.valid_shards": str(tiny_data[1]),
                                             "train.eval_every": 2, "train.eval_samples": 8, **extra})


def _assert_validation_close(got: list[dict], want: list[dict]) -> None:
    got, want = ([r for r in rows if "val_gen_loss" in r] for rows in (got, want))
    assert [r["step"] for r in got] == [r["step"] for r in want] and got
    assert_metrics_close(got, want, ("val_gen_loss", "val_gen_acc"))


def _single(tiny_data, run, resume=None, **extra):
    run_pretraining(load_config(CONFIG, _overrides(tiny_data, run, **extra)), str(resume) if resume else None)


def test_two_to_one_and_one_to_two_processes_follow_the_uninterrupted_run(tiny_data, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    _single(tiny_data, one)
    torchrun(2, [{"overrides": _overrides(tiny_data, two, **{"backend.name": "ddp"})},
                 {"overrides": _overrides(tiny_data, tmp_path / "one_to_two", **{"backend.name": "ddp"}),
                  "resume": str(one / "checkpoints" / "step_00000002")}], tmp_path / "spec.json")
    _single(tiny_data, tmp_path / "two_to_one", resume=two / "checkpoints" / "step_00000002")
    _single(tiny_data, tmp_path / "workers", resume=one / "checkpoints" / "step_00000002", **{"data.num_workers": 2})
    full = read_metrics(one)
    assert_metrics_close(read_metrics(two), full, KEYS)  # the global order makes 2 ranks = 1 rank
    _assert_validation_close(read_metrics(two), full)  # every rank evaluates the same batches
    for name in ("one_to_two", "two_to_one", "workers"):
        assert_metrics_close(read_metrics(tmp_path / name), full[2:], KEYS)
        _assert_validation_close(read_metrics(tmp_path / name), full[2:])
        assert_same_weights(tmp_path / name, one, "generator")

