"""The store's pieces in one process (fast): commit and prune, verification, lock, formats, a full disk.

The end-to-end versions of these faults, through the CLI in fresh processes, are in
test_persistence.py and test_kill.py (slow).
"""

from __future__ import annotations

import errno
import json
import math
import os

import pytest
import torch

from megakd.cli import main
from megakd.engine.runlog import MetricsWriter
from megakd.store import checkpoint
from megakd.store.files import StoreError, load_state
from megakd.store.rundir import RunDirLock, check_changes
from tests.faults.test_persistence import CONFIG, Payload
from tests.helpers import tiny_overrides


def _publish(run, step, text):
    tmp, final = checkpoint.begin(run, step, True)
    (tmp / "state.txt").write_text(text)
    checkpoint.commit(tmp, final, step, keep_last=2)
    return final


def test_pruning_never_removes_the_checkpoint_just_written(tmp_path):
    for step in (10, 20, 30):
        _publish(tmp_path, step, f"old {step}")
    written = _publish(tmp_path, 5, "new 5")  # older than what is there (e.g. resumed from an earlier one)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step_00000005", "step_00000030"]
    assert (written / "state.txt").read_text() == "new 5"
    checkpoint.verify(written)


def test_saving_a_published_step_again_replaces_it(tmp_path):
    _publish(tmp_path, 3, "first")
    final = _publish(tmp_path, 3, "second")
    assert (final / "state.txt").read_text() == "second"
    checkpoint.verify(final)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003"]


def test_verify_names_the_damaged_file(tmp_path):
    final = _publish(tmp_path, 1, "abc")
    (final / "state.txt").write_text("abd")
    with pytest.raises(StoreError, match=r"state\.txt: sha256 differs from the manifest"):
        checkpoint.verify(final)
    assert checkpoint.newest_intact(tmp_path) is None


def test_weights_only_load_refuses_a_pickle_payload(tmp_path):
    marker, path = tmp_path / "marker", tmp_path / "state.pt"
    torch.save({"x": Payload(marker)}, path)
    with pytest.raises(StoreError, match=r"state\.pt: cannot read as a weights-only torch file") as err:
        load_state(path)
    assert "\n" not in str(err.value) and not marker.exists()


def test_lock_names_its_holder(tmp_path):
    first, second = RunDirLock(tmp_path), RunDirLock(tmp_path)
    first.acquire()
    first.announce()
    try:
        with pytest.raises(StoreError,
                           match=rf"in use by another megakd job \(host .*, pid {os.getpid()}, job [0-9a-f]+\)"):
            second.acquire()
    finally:
        first.release()
    second.acquire()  # released: the next job gets it
    second.release()


def test_config_change_policy_lists_every_difference():
    saved = {"optim": {"generator": {"lr": 1e-3}}, "train": {"max_steps": 10, "global_batch_size": 8}}
    current = {"optim": {"generator": {"lr": 2e-3}}, "train": {"max_steps": 20, "global_batch_size": 16}}
    with pytest.raises(StoreError, match=r"optim\.generator\.lr: 0\.001 -> 0\.002; train\.global_batch_size: 8 -> 16"):
        check_changes("ckpt", saved, current, ())
    assert set(check_changes("ckpt", saved, current, ("optim.generator.lr", "train.global_batch_size"))) == {
        "optim.generator.lr", "train.global_batch_size"}  # max_steps steers: never listed


def test_metrics_are_strict_json(tmp_path):
    writer = MetricsWriter(tmp_path, tensorboard=False, wandb=False, wandb_project="", wandb_mode="offline",
                           config={})
    writer.write({"step": 1, "gen_loss": math.nan, "disc_loss": math.inf, "gen_acc": 0.5})
    writer.close()

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    record = json.loads((tmp_path / "metrics.jsonl").read_text(), parse_constant=refuse)
    assert record == {"step": 1, "gen_loss": None, "disc_loss": None, "gen_acc": 0.5}


def test_disk_full_while_saving_removes_the_partial_checkpoint(tiny_data, tmp_path, monkeypatch, capsys):
    """ENOSPC injected into the optimizer-state write after half the bytes (the tmpfs version is slow)."""
    import megakd.engine.backends as backends

    real_save = backends.save_state

    def half_then_full(state, path):
        real_save(state, path)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(backends, "save_state", half_then_full)
    run = tmp_path / "run"
    code = main(["pretrain", "-c", str(CONFIG), *tiny_overrides(tiny_data, run, **{
        "train.max_steps": 1, "run.export_hf": "false"})])
    assert code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("megakd: error:")]
    assert len(err) == 1
    assert f"{run / 'checkpoints'}: no space left on device while saving step 1 (" in err[0]
    assert "KiB written" in err[0] and "older checkpoints are intact" in err[0]
    assert list((run / "checkpoints").iterdir()) == []
