"""The promises at the edges: storage that lies or stalls, outputs someone else writes into, run
directories that are not runs, configs with absurd sizes, credentials in URLs, a full disk.

Each row attacks a promise of the README or docs/reliability.md with the real thing: a local HTTP
server that misbehaves on purpose (tests/remote_servers.py: a stall, a lying length, an endless
body), the real CLI in a fresh process, a real tmpfs that is full. Timeouts are set small here
(1 s) so each attack takes seconds; the defaults that fit a cluster are checked against docs/data.md.
"""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from tests.remote_servers are test arguments)
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import pytest
import yaml

from megakd.cli import main
from megakd.config import Config
from megakd.data.loader import PretrainingLoader
from megakd.data.shards import INDEX_DTYPE, MANIFEST, write_shards
from megakd.data.storage import ShardStore, StorageError
from megakd.data.tokenizer import Tokenizer
from tests.faults.harness import REPO, megakd, snapshot
from tests.helpers import tiny_overrides
from tests.remote_servers import http_server  # noqa: F401 (fixture)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

CONFIG = REPO / "configs" / "electra-tiny.yaml"
SMALL = 16  # samples per shard of `small_shards`: a shard group is two steps of the tiny run


@pytest.fixture(scope="module")
def small_shards(tiny_data, tmp_path_factory) -> Path:
    """The tiny data in shards of 16 samples, so a run over HTTP fetches a new shard every two steps."""
    tokenizer_dir, _ = tiny_data
    out = tmp_path_factory.mktemp("edges") / "shards"
    write_shards([tokenizer_dir.parent / "slice.jsonl"], Tokenizer.load(tokenizer_dir), 64, out,
                 samples_per_shard=SMALL)
    return out


def shard_stems(shards: Path) -> set[str]:
    return {p.stem for p in shards.glob("*.tar")}


def worst_case_s(store: ShardStore) -> float:
    """The longest a read of a store that stops answering may take to fail for good: every try waits out
    both timeouts (connecting, then for the next byte), and the doubling backoffs between them."""
    backoff = sum(min(store.backoff_s * 2 ** i, store.max_backoff_s) for i in range(store.retries))
    return (store.retries + 1) * (store.connect_timeout_s + store.read_timeout_s) + backoff


# -- 1. storage that stalls or lies ----------------------------------------------------------------------
# A store with 1 s timeouts and one retry: each bad answer must end in one line naming the object, in
# no more than the store's stated worst case, without reading more than the range asked for.
MISBEHAVIOURS = [
    ("stall", "still failing after 2 tries"),  # headers and half the body, then silence: the read timeout
    ("lying-length", "says Content-Length 10000000000000, more than the"),  # refused before the body
    ("endless", "sends more bytes, more than the"),  # no length: cut at the range's size
]


@pytest.mark.parametrize("mode,says", MISBEHAVIOURS, ids=[m for m, _ in MISBEHAVIOURS])
def test_misbehaving_server_is_one_line_in_bounded_time_and_memory(tiny_data, small_shards, http_server, mode,
                                                                     says):
    server = http_server(small_shards)
    server.misbehave(mode, shard_stems(small_shards))
    store = ShardStore(server.url, retries=1, backoff_s=0.05, connect_timeout_s=1.0, read_timeout_s=1.0)
    loader = PretrainingLoader(store, Tokenizer.load(tiny_data[0]), micro_batch_size=4, shuffle_shards=1)
    tracemalloc.start()
    started = time.monotonic()
    try:
        with pytest.raises(StorageError) as error:
            next(iter(loader))
        elapsed = time.monotonic() - started
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        loader.close()
    message = str(error.value)
    assert "\n" not in message and says in message, message
    assert re.match(rf"{re.escape(server.url)}/shard-\d+\.tar", message), message
    assert elapsed <= worst_case_s(store) + 2.0, (elapsed, worst_case_s(store))
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB held reading a {SMALL}-sample shard"
    assert server.misbehaved >= 1


def test_the_documented_worst_case_is_the_defaults():
    """docs/data.md states the time to the one-line error for a store that stops answering; it is the
    default config's (retries, both timeouts, the backoffs)."""
    d = Config().data
    store = ShardStore("http://x", retries=d.read_retries, connect_timeout_s=d.read_connect_timeout_s,
                       read_timeout_s=d.read_timeout_s)
    docs = (REPO / "docs" / "data.md").read_text()
    stated = re.search(r"at most (\d+) s \(about (\d+) minutes\) to the one-line error", docs)
    assert stated, "docs/data.md no longer states the worst case"
    assert int(stated.group(1)) == round(worst_case_s(store)), worst_case_s(store)
    assert int(stated.group(2)) == round(worst_case_s(store) / 60)


def _http_run(tiny_data, shards_url: str, run: Path, **extra) -> list[str]:
    return ["-c", str(CONFIG), *tiny_overrides((tiny_data[0], shards_url), run, **{
        "train.max_steps": 8, "run.save_every": 100, "run.export_hf": "false", "data.shuffle_shards": 1,
        "data.num_workers": 0, "data.read_timeout_s": 120, **extra})]


def _steps_logged(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.is_file() else 0


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_during_a_stalled_fetch_saves_and_exits_within_seconds(tiny_data, small_shards, http_server,
                                                                       tmp_path, workers):
    """A run whose store stalls mid-body (a 120 s read timeout, 8 retries: 18 minutes before the
    error) gets SIGTERM once its steps stopped for want of data: it saves the step it reached and
    exits 0 within seconds, and `--resume auto` finishes the run once the store answers again. In
    process (0 workers) the signal ends the read; with DataLoader workers the loop's poll ends the wait."""
    server = http_server(small_shards)
    server.misbehave("stall", shard_stems(small_shards), after=3)
    run = tmp_path / "run"
    args = _http_run(tiny_data, server.url, run, **{"data.num_workers": workers})
    proc = subprocess.Popen([sys.executable, "-m", "megakd.cli", "pretrain", *args],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline, logged, since = time.monotonic() + 180, -1, time.monotonic()
    while server.misbehaved == 0 or time.monotonic() - since < 4.0:  # stalled, and no step for 4 s (steps: < 1 s)
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.monotonic() < deadline, "the run never stalled"
        if (now := _steps_logged(run)) != logged:
            logged, since = now, time.monotonic()
        time.sleep(0.05)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    took = time.monotonic() - signalled
    stderr = proc.stderr.read()
    assert code == 0, stderr[-2000:]
    assert took < 10, f"{took:.1f} s from SIGTERM to exit"
    assert "stop signal ended the wait for a batch" in stderr, stderr[-2000:]
    saved = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert len(saved) == 1 and saved[0] != "step_00000008", saved
    server.release()
    out = megakd("pretrain", "--resume", "auto", *args)
    assert out.code == 0, out.stderr[-2000:]
    assert (run / "checkpoints" / "step_00000008").is_dir()


# -- 2. a manifest with absurd but self-consistent counts -------------------------------------------------
def _absurd_manifest(shards: Path, out: Path) -> Path:
    """A copy of ``shards`` whose first shard claims 9 x 10**11 samples (bytes and index sized to match)."""
    shutil.copytree(shards, out)
    manifest = json.loads((out / MANIFEST).read_text())
    entry, claimed = manifest["shards"][0], 9 * 10**11
    manifest["num_samples"] += claimed - entry["samples"]
    for later in manifest["shards"][1:]:
        later["first_index"] += claimed - entry["samples"]
    entry["samples"], entry["bytes"] = claimed, claimed * 1024 + 1024
    entry["index"]["bytes"] = claimed * INDEX_DTYPE.itemsize
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


@pytest.mark.parametrize("where", ["local", "http"])
def test_absurd_manifest_counts_are_one_line_before_anything_is_written(tiny_data, small_shards, http_server,
                                                                          tmp_path, capsys, where):
    shards = _absurd_manifest(small_shards, tmp_path / "absurd")
    spec = str(shards) if where == "local" else http_server(shards).url
    run = tmp_path / "run"
    code = main(["pretrain", *_http_run(tiny_data, spec, run)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("megakd: error: ") and MANIFEST in line, line
    assert "expected at most 16777216 samples" in line, line
    assert not run.exists()


# -- 3. run directories that are not runs ---------------------------------------------------------------
# A refusal leaves the directory exactly as it was: no `.lock` created, a foreign `.lock` never written,
# and `--resume auto` never takes a directory of someone else's files for a run to start in.
def _users_files(root: Path) -> Path:
    (root / "notes").mkdir(parents=True)
    (root / "notes" / "todo.txt").write_text("buy milk\n")
    (root / "config.yaml").write_text("my: own config\n")
    return root


def _users_lock(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / ".lock").write_text("my own lock file, keep out\n")
    return root


RUN_DIR_ROWS = [  # (id, make the directory, run it as cwd, flags, fragment of the one line)
    ("a user's directory", _users_files, False, (), "already holds a run (config.yaml, notes)"),
    ("the current directory", _users_files, True, (), "already holds a run (config.yaml, notes)"),
    ("only a user's .lock", _users_lock, False, (), "not a megakd run lock"),
    ("only a user's .lock, --resume auto", _users_lock, False, ("--resume", "auto"), "not a megakd run lock"),
    ("--resume auto on a user's directory", _users_files, False, ("--resume", "auto"), "but no megakd run"),
]


@pytest.mark.parametrize("make,as_cwd,flags,says", [r[1:] for r in RUN_DIR_ROWS], ids=[r[0] for r in RUN_DIR_ROWS])
def test_a_refused_run_dir_is_left_exactly_as_it_was(tiny_data, tmp_path, monkeypatch, capsys, make, as_cwd, flags,
                                                     says):
    run = make(tmp_path / "dir")
    before = snapshot(run)
    if as_cwd:
        monkeypatch.chdir(run)
    code = main(["pretrain", *flags, *_http_run(tiny_data, str(tiny_data[1]), Path(".") if as_cwd else run)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and says in line, line
    assert snapshot(run) == before


def test_a_refused_new_run_dir_is_not_left_behind(tiny_data, tmp_path, capsys):
    """A run refused after it locked a directory it created (here: every checkpoint of the `--resume`
    path is another run's) removes that directory again."""
    other = tmp_path / "other"
    (other / "checkpoints" / "step_00000002").mkdir(parents=True)
    run = tmp_path / "new" / "run"
    code = main(["pretrain", "--resume", str(other / "checkpoints" / "step_00000002"),
                 *_http_run(tiny_data, str(tiny_data[1]), run)])
    assert code == 2, capsys.readouterr().err
    assert not (tmp_path / "new").exists()


# -- 4. credentials in URLs -------------------------------------------------------------------------------
@pytest.mark.slow
def test_credentials_in_a_url_are_in_no_file_a_run_writes_nor_in_its_log(tiny_data, small_shards, http_server,
                                                                         tmp_path):
    """A run reads shards from ``http://user:s3cr3t-t0ken@host/``, saves, resumes with a changed key (so
    config_history/ is written) and then meets its server gone (a storage error line): the password is
    in no file under the run directory and in none of the output, while the resume accepts the same URL."""
    server = http_server(small_shards)
    url = server.url.replace("http://", "http://alice:s3cr3t-t0ken@")
    run = tmp_path / "run"
    first = megakd("pretrain", *_http_run(tiny_data, url, run, **{"train.max_steps": 2}), "--log-level", "DEBUG")
    assert first.code == 0, first.stderr[-2000:]
    second = megakd("pretrain", "--resume", "auto", "--allow-change", "optim.discriminator.lr",
                    *_http_run(tiny_data, url, run, **{"train.max_steps": 4, "optim.discriminator.lr": 1e-3}))
    assert second.code == 0, second.stderr[-2000:]
    assert list((run / "config_history").iterdir())
    server.stop()
    # the resume is decided (and its config checked) before the data is read: only the retries change
    third = megakd("pretrain", "--resume", "auto", "--allow-change", "data.read_retries",
                   *_http_run(tiny_data, url, run, **{"train.max_steps": 6, "data.read_retries": 0,
                                                      "optim.discriminator.lr": 1e-3}))
    assert third.code == 2 and "alice:***@127.0.0.1" in third.error_line(), third.stderr[-2000:]
    for out in (first, second, third):
        assert "s3cr3t" not in out.stdout + out.stderr
    leaks = [p for p in run.rglob("*") if p.is_file() and b"s3cr3t" in p.read_bytes()]
    assert not leaks, leaks
    assert "alice:***@" in (run / "config.yaml").read_text()


# -- 5. config values that meant nothing ----------------------------------------------------------------
BAD_VALUES = [
    ("run.save_every", "-5", "expected an integer >= 0 (0 = only at the end)"),
    ("run.keep_last", "-3", "expected an integer >= 0 (0 = keep every checkpoint)"),
    ("data.read_timeout_s", "0", "expected seconds in (0, 3600]"),
    ("data.read_connect_timeout_s", "-1", "expected seconds in (0, 3600]"),
]


@pytest.mark.parametrize("key,value,says", BAD_VALUES, ids=[f"{k}={v}" for k, v, _ in BAD_VALUES])
def test_meaningless_values_are_refused_before_the_run_dir(tiny_data, tmp_path, capsys, key, value, says):
    run = tmp_path / "run"
    code = main(["pretrain", *_http_run(tiny_data, str(tiny_data[1]), run, **{key: value})])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and f"{key}: {says}" in line, line
    assert not run.exists()


# -- 6. model configs with absurd sizes -----------------------------------------------------------------
# A model's config is checked against bounds, then against its weights file's header, before any
# module is built: a config saying 10**6 layers (or 1,000 over a 3-layer file) ends in one line at once.
def _hf_with_layers(run: Path, root: Path, layers: int) -> Path:
    out = root / "hf"
    shutil.copytree(run / "hf" / "discriminator", out)
    config = json.loads((out / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config))
    return out


def _checkpoint_with_layers(run: Path, root: Path, layers: int) -> Path:
    from megakd.store.checkpoint import write_manifest

    step = sorted((run / "checkpoints").iterdir())[-1]
    out = root / step.name
    shutil.copytree(step, out)
    config = yaml.safe_load((out / "config.yaml").read_text())
    config["model"]["discriminator"]["num_layers"] = layers
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    (out / MANIFEST).unlink()
    write_manifest(out, int(step.name.split("_")[1]))
    return out


MODEL_SIZE_ROWS = [  # (id, the source, the conversion that reads it, its layers, fragment of the one line)
    ("HF dir, 10**6 layers", _hf_with_layers, "from-hf", 10**6, "num_layers: expected a positive integer up to 1024"),
    ("HF dir, 1000 layers over 2", _hf_with_layers, "from-hf", 1000, "numbers but"),
    ("checkpoint, 10**6 layers", _checkpoint_with_layers, "to-hf", 10**6,
     "num_layers: expected a positive integer up to 1024"),
    ("checkpoint, 1000 layers over 2", _checkpoint_with_layers, "to-hf", 1000, "numbers but"),
]


@pytest.mark.parametrize("make,convert,layers,says", [r[1:] for r in MODEL_SIZE_ROWS],
                         ids=[r[0] for r in MODEL_SIZE_ROWS])
def test_absurd_model_sizes_are_refused_before_anything_is_built(tiny_electra_run, tmp_path, capsys, make, convert,
                                                                 layers, says):
    source = make(tiny_electra_run, tmp_path, layers)
    started = time.monotonic()
    code = main(["convert", convert, str(source), str(tmp_path / "out")])
    took = time.monotonic() - started
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2 and says in line, line
    assert took < 10, f"{took:.1f} s to refuse"
    assert not (tmp_path / "out").exists()


# -- 7. outputs that someone else writes into ------------------------------------------------------------
def test_an_output_is_claimed_and_never_published_over_someone_elses_files(tiny_data, tmp_path):
    """`data shards` A reads its corpus from a FIFO, so it is mid-run for as long as the test wants: a
    second `data shards` into the same --out is refused at its start (the claim), and a file someone
    writes into --out meanwhile survives A's publish, which keeps A's shards under the name it gives."""
    tokenizer_dir, _ = tiny_data
    fifo, out = tmp_path / "corpus.jsonl", tmp_path / "shards"
    os.mkfifo(fifo)
    args = ["data", "shards", "--tokenizer", str(tokenizer_dir), "--seq-len", "64", "--out", str(out)]
    first = subprocess.Popen([sys.executable, "-m", "megakd.cli", *args, "--input", str(fifo)], cwd=REPO,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        claim = tmp_path / ".shards.claim"
        deadline = time.monotonic() + 60
        while not (claim.is_file() and claim.read_text()):
            assert first.poll() is None and time.monotonic() < deadline, "the first command never claimed --out"
            time.sleep(0.05)
        second = megakd(*args, "--input", str(tokenizer_dir.parent / "slice.jsonl"))
        assert second.code == 2 and "being written by another megakd command" in second.error_line(), second.stderr
        out.mkdir()
        (out / "theirs.txt").write_text("someone else's\n")
        fifo.write_text((tokenizer_dir.parent / "slice.jsonl").read_text())
        code = first.wait(timeout=120)
    finally:
        first.kill()
    line = first.stderr.read().strip().splitlines()[-1]
    assert code == 2 and "changed while this command ran" in line, line
    kept = Path(line.rsplit("the finished output is ", 1)[1])
    assert (kept / MANIFEST).is_file() and kept.parent == tmp_path
    assert sorted(p.name for p in out.iterdir()) == ["theirs.txt"]
    assert not claim.exists() and not list(tmp_path.glob(".shards.partial-*"))


# -- 8. a full disk on every writer ----------------------------------------------------------------------
@pytest.fixture
def full_disk(tmp_path):
    """A fresh 96 KiB tmpfs under tmp_path (needs root), unmounted at the end."""
    path = tmp_path / "disk"
    path.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=96k tmpfs {path} 2>/dev/null") != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield path
    os.system(f"umount {path}")


WRITERS = {  # the command line of each writer, given the tiny data and an --out
    "data shards": lambda tok, out: ["data", "shards", "--input", str(tok.parent / "slice.jsonl"), "--tokenizer",
                                     str(tok), "--seq-len", "64", "--out", str(out)],
    "data tokenizer": lambda tok, out: ["data", "tokenizer", "--input", str(tok.parent / "slice.jsonl"),
                                        "--vocab-size", "512", "--out", str(out)],
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_full_disk_is_one_line_naming_the_output(tiny_data, full_disk, writer):
    out = full_disk / "out"
    result = megakd(*WRITERS[writer](tiny_data[0], out))
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.error_line() == f"megakd: error: {out}: no space left on device while writing it; the partial " \
                                  "output was removed, nothing else was changed", result.error_line()
    assert list(full_disk.iterdir()) == []


@pytest.mark.slow
def test_a_full_disk_while_building_the_bundled_corpus_is_one_line(full_disk, tmp_path):
    result = megakd("pretrain", "-c", str(CONFIG), f"data.cache_dir={full_disk}", f"run.dir={tmp_path / 'run'}")
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    line = result.error_line()
    said = r": no space left on device while building the bundled corpus's tokenizer and shards; the partial build " \
           r"was removed"
    assert re.fullmatch(rf"megakd: error: {re.escape(str(full_disk))}/default-\S+{said}", line), line
    assert list(full_disk.iterdir()) == []
