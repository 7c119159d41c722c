"""Shard storage lost for good mid-run: the run saves as it was before the failed step, stops in one
line naming the object, and resumes bit-exactly once the storage is back (a real HTTP server)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from megakd.config import load_config
from megakd.data.shards import write_shards
from megakd.data.storage import StorageError
from megakd.data.tokenizer import Tokenizer
from megakd.store import checkpoint
from tests.helpers import tiny_overrides, trained
from tests.remote_servers import http_server  # noqa: F401  (fixture)


def _train(tiny_data, run_dir, shards, resume=None, **extra):
    steps = {"train.max_steps": 16, "run.save_every": 0, "train.log_every": 1, "data.shuffle_shards": 1,
             "data.read_retries": 1, "data.shards": shards, **extra}
    return trained(load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, run_dir, **steps)), resume)


def _metrics(run_dir):
    """The logged rows without speed and retry counts (the failed run retried before it stopped:
    a background read of the next group may count its retries in a row logged before the failure)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "read_retries")} for r in rows]


def _params(trainer):
    return {f"{u.name}.{k}": v.detach().clone()
            for u in trainer.units.values() for k, v in u.model.state_dict().items()}


def _fail_when_logged(server, metrics, lines):
    """From the `lines`-th logged step on, the server answers every request 503 (kept-alive
    connections included, which a stopped server would still serve)."""
    def watch():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= lines:
                server.fail(10**9)
                return
            time.sleep(0.005)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_storage_lost_mid_run_saves_before_the_step_and_resumes_bit_exactly(tiny_data, tmp_path, http_server):  # noqa: F811
    tokenizer_dir, _ = tiny_data
    shards = tmp_path / "shards"  # shards of 16 samples, one per group: a group is read every 2 steps
    write_shards([tokenizer_dir.parent / "slice.jsonl"], Tokenizer.load(tokenizer_dir), 64, shards,
                 samples_per_shard=16)
    full = _train(tiny_data, tmp_path / "full", str(shards))

    server = http_server(shards)
    run = tmp_path / "remote"
    watcher = _fail_when_logged(server, run / "metrics.jsonl", 3)
    with pytest.raises(StorageError) as err:
        _train(tiny_data, run, server.url)
    watcher.join()
    message = str(err.value)
    assert ("\n" not in message and message.startswith(f"{server.url}/shard-")
            and "still failing after 2 tries" in message)
    saved = checkpoint.latest_checkpoint(run)
    step = checkpoint.step_of(saved)
    assert 3 <= step < 16
    assert len(_metrics(run)) == step  # nothing logged for the step that failed
    data = checkpoint.load_rank_state(saved, 0)["data"]
    assert data["position"] == step * 8  # the data position of the step boundary, not of the failed reads

    server.fail(0)
    resumed = _train(tiny_data, run, server.url, resume="auto")
    assert resumed.step == 16
    assert _metrics(run) == _metrics(tmp_path / "full")
    a, b = _params(full), _params(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
