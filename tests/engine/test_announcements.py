"""Every wait longer than a few seconds is announced in the log before it starts, naming what it is and about
how long it takes, and only where it will happen: a user watching a machine's first run must not take it for
a hang. The waits: DeepSpeed's C++ op builds (`shm_comm` in every engine, `cpu_adam` under ZeRO-Offload), the
bundled corpus build, Admin's profiling pass, `train.compile`'s first step, the first shard group read from an
object store, and saving a large checkpoint.
"""

from __future__ import annotations

# ruff: noqa: F811  (the pytest fixture imported from tests.remote_servers is a test argument)
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megakd.config import load_config
from megakd.data import default_corpus
from megakd.data.loader import PretrainingLoader
from megakd.data.shards import read_manifest
from megakd.data.tokenizer import Tokenizer
from megakd.engine import deepspeed_backend, loop, pretrain
from megakd.engine.loop import Checkpointer, checkpoint_bytes
from megakd.engine.units import Unit
from megakd.launch import Launch
from megakd.store.files import tree_bytes
from tests.helpers import tiny_overrides
from tests.remote_servers import http_server  # noqa: F401 (fixture)

TINY = "configs/electra-tiny.yaml"


def lines(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


# -- DeepSpeed's C++ ops -----------------------------------------------------------------------------------

@pytest.fixture
def no_op_loaded(monkeypatch, tmp_path):
    """No DeepSpeed op loaded in this process yet, and an empty extensions directory."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    return tmp_path / "extensions"


def test_an_op_build_is_announced_only_where_ninja_would_compile(no_op_loaded, caplog):
    """Missing or older than a source: compiled (announced). Built and newer: loaded as it is (no line), and
    so is an op this process loaded already."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.builder import OpBuilder

    def announced() -> list[str]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="megakd.engine.deepspeed_backend"):
            deepspeed_backend.announce_op_build("CPUAdamBuilder", "ZeRO-Offload's CPU Adam")
        return lines(caplog, "compiling DeepSpeed's cpu_adam op")

    [line] = announced()
    assert str(no_op_loaded / "cpu_adam") in line and "about a minute" in line
    library = no_op_loaded / "cpu_adam" / "cpu_adam.so"
    library.write_bytes(b"")
    assert announced() == []
    builder = get_accelerator().create_op_builder("CPUAdamBuilder")
    newest = max(os.path.getmtime(builder.deepspeed_src_path(s)) for s in builder.sources())
    os.utime(library, (newest - 10, newest - 10))  # DeepSpeed upgraded since the build: ninja rebuilds
    assert len(announced()) == 1
    library.unlink()
    OpBuilder._loaded_ops["cpu_adam"] = object()
    assert announced() == []


def test_cpu_adam_build_is_announced_before_deepspeed_compiles_it(no_op_loaded, monkeypatch, caplog):
    """ZeRO-Offload's optimizer: the line is in the log when DeepSpeed's JIT build starts."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    seen = []

    def jit_load(builder, verbose=True):
        seen.append((builder.name, lines(caplog, "compiling DeepSpeed's cpu_adam op")))
        raise RuntimeError("not built in a test")

    monkeypatch.setattr(OpBuilder, "jit_load", jit_load)
    with caplog.at_level(logging.INFO, logger="megakd.engine.deepspeed_backend"), pytest.raises(RuntimeError):
        deepspeed_backend.cpu_adam_like(torch.optim.AdamW(torch.nn.Linear(2, 2).parameters()))
    [(name, announced)] = seen
    assert name == "cpu_adam" and len(announced) == 1


def test_shm_comm_build_is_announced_before_deepspeed_joins_the_group(no_op_loaded, monkeypatch, caplog):
    """Every DeepSpeed engine on a CPU machine: DeepSpeed's comm layer builds its shared-memory op when it first
    joins (on CUDA it has none, and no line)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    seen = []
    monkeypatch.setattr(deepspeed_backend, "init_distributed", lambda launch, backend: (0, 1, 0))
    monkeypatch.setattr(deepspeed_backend, "create_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(deepspeed_backend.dist, "get_backend", lambda: "gloo")
    monkeypatch.setattr(deepspeed, "init_distributed",
                        lambda **kwargs: seen.append(lines(caplog, "compiling DeepSpeed's deepspeed_shm_comm op")))
    monkeypatch.setenv("LOCAL_RANK", "0")
    with caplog.at_level(logging.INFO, logger="megakd.engine.deepspeed_backend"):
        deepspeed_backend.init_deepspeed(Launch(), "gloo")
    [announced] = seen
    assert len(announced) == (get_accelerator()._name == "cpu")
    assert all(str(no_op_loaded / "deepspeed_shm_comm") in line for line in announced)


# -- the bundled corpus ----------------------------------------------------------------------------------

def test_the_bundled_corpus_build_is_announced_once(tmp_path, monkeypatch, caplog):
    """Announced before the tokenizer is trained; a cache that holds the build gets no line."""
    seen = []

    def train_tokenizer(files, vocab_size, out, seed):
        seen.append(lines(caplog, "building the bundled classic corpus"))
        (out / default_corpus.META_FILE).parent.mkdir(parents=True)
        (out / default_corpus.META_FILE).write_text("{}")

    def write_shards(files, tok, seq_len, out, **options):
        out.mkdir()
        (out / default_corpus.MANIFEST).write_text("{}")

    monkeypatch.setattr(default_corpus, "train_tokenizer", train_tokenizer)
    monkeypatch.setattr(default_corpus, "write_shards", write_shards)
    with caplog.at_level(logging.INFO, logger="megakd.data.default_corpus"):
        tokenizer_dir, _ = default_corpus.prepare_default_data(tmp_path, vocab_size=8000, seq_len=128)
        [announced] = seen
        assert len(announced) == 1 and str(tokenizer_dir.parent) in announced[0]
        caplog.clear()
        default_corpus.prepare_default_data(tmp_path, vocab_size=8000, seq_len=128)
    assert len(seen) == 1 and lines(caplog, "building the bundled") == []


# -- Admin's profiling pass ------------------------------------------------------------------------------

def test_admin_profiling_is_announced_with_its_work(tiny_data, tmp_path, monkeypatch, caplog):
    """Announced before the pass, with its matmul FLOPs (against torch's own count of the pass); a run without
    `init: admin` has no pass and no line."""
    from torch.utils.flop_counter import FlopCounterMode

    from megakd.engine.backends import SingleProcessBackend

    tokenizer_dir, shards_dir = tiny_data
    tokenizer = Tokenizer.load(tokenizer_dir)
    store = pretrain.shard_store(load_config(TINY, tiny_overrides(tiny_data, tmp_path)), shards_dir)
    counted, seen = [], []
    real = pretrain.admin_initialize

    def admin_initialize(encoder, *args, **kwargs):
        seen.append(lines(caplog, "Admin init: profiling"))
        with FlopCounterMode(display=False) as counter:
            omegas = real(encoder, *args, **kwargs)
        counted.append(counter.get_total_flops())
        return omegas

    monkeypatch.setattr(pretrain, "admin_initialize", admin_initialize)
    cfg = load_config(TINY, tiny_overrides(tiny_data, tmp_path, **{"model.discriminator.init": "admin"}))
    with caplog.at_level(logging.INFO, logger="megakd.engine.pretrain"):
        pretrain.admin_profile(cfg, list(pretrain.build_models(cfg)), store, tokenizer, SingleProcessBackend())
    [announced] = seen
    assert len(announced) == 1
    line = announced[0]
    assert "the 2 x 48 encoder(s)" in line and "4 x 64 tokens" in line and "on the CPU" in line
    said = float(line.split("(~")[1].split(" TFLOP")[0]) * 1e12
    assert 0.7 < said / counted[0] < 1.3, (line, counted)

    caplog.clear()
    plain = load_config(TINY, tiny_overrides(tiny_data, tmp_path))
    with caplog.at_level(logging.INFO, logger="megakd.engine.pretrain"):
        pretrain.admin_profile(plain, list(pretrain.build_models(plain)), store, tokenizer, SingleProcessBackend())
    assert len(seen) == 1 and lines(caplog, "Admin init") == []


def test_compiling_the_encoders_is_announced_before_the_first_step(tiny_data, tmp_path, caplog):
    """`train.compile`: compiling waits for the first forward; the line comes when the layers are marked."""
    cfg = load_config(TINY, tiny_overrides(tiny_data, tmp_path))
    models = list(pretrain.build_models(cfg))
    with caplog.at_level(logging.INFO, logger="megakd.engine.pretrain"):
        pretrain.compile_encoders(models)
    [line] = lines(caplog, "train.compile")
    assert "compiles the 3 encoder layers" in line and "about a minute" in line  # 1 + 2 layers


# -- the first shard group from an object store ------------------------------------------------------------

def test_the_first_shard_group_from_an_object_store_is_announced_before_it_is_read(tiny_data, http_server, caplog):
    """The line comes before any request for a shard or index, names the store and this rank's part of the
    group (about the group's bytes alone, half of them as one of two ranks); local shards get no line."""
    tokenizer_dir, shards_dir = tiny_data
    tokenizer = Tokenizer.load(tokenizer_dir)
    server = http_server(shards_dir)
    shards = read_manifest(shards_dir)["shards"]
    assert len(shards) <= 16  # one shard group holds the corpus
    total = sum(e["bytes"] for e in shards)

    class Snapshot(logging.Handler):
        def emit(self, record):
            seen.append((record.getMessage(), server.requests))

    for world, share in ((1, 1.0), (2, 0.5)):
        seen = []
        loader = PretrainingLoader(server.url, tokenizer, micro_batch_size=4, world_size=world)
        asked_before = server.requests  # the manifest
        handler = Snapshot(logging.INFO)
        logging.getLogger("megakd.data.loader").addHandler(handler)
        try:
            with caplog.at_level(logging.INFO, logger="megakd.data.loader"):
                batches = iter(loader)
                next(batches)
        finally:
            logging.getLogger("megakd.data.loader").removeHandler(handler)
            loader.close()
        [(line, asked)] = [(m, n) for m, n in seen if "reading shard group" in m]
        assert asked == asked_before < server.requests
        assert server.url in line and f"{len(shards)} shards" in line
        said = float(line.split(", ~")[1].split(" MB")[0]) * 1e6
        assert 0.8 < said / (share * total) < 1.1, (line, total)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megakd.data.loader"):
        local = PretrainingLoader(shards_dir, tokenizer, micro_batch_size=4)
        next(iter(local))
        local.close()
    assert lines(caplog, "reading shard group") == []


# -- checkpoints ---------------------------------------------------------------------------------------------

@pytest.fixture
def saving(tmp_path, caplog):
    """A Checkpointer over one stepped AdamW unit whose session writes the real files and records what the
    log said when the save began."""
    from megakd.engine.backends import SingleProcessBackend

    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    unit = Unit("model", model, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0), 0.0)
    said_at_start: list[list[str]] = []

    def save(root, step, write, keep_last, expected_s):
        said_at_start.append(lines(caplog, "saving checkpoint"))
        tmp = Path(root) / f"tmp-{step}"
        tmp.mkdir()
        write(tmp)
        return tmp

    session = SimpleNamespace(backend=SingleProcessBackend(), save=save)
    checkpointer = Checkpointer(session, tmp_path, [unit], {}, keep_last=0)
    return checkpointer, said_at_start


def test_a_long_save_is_announced_before_it_starts_with_its_size(saving, caplog):
    """At a speed that makes it long: the line precedes the writes, names the step, its directory and a size
    within 10 % of the files written."""
    checkpointer, said_at_start = saving
    checkpointer.bytes_per_s = 1e3
    with caplog.at_level(logging.INFO, logger="megakd.engine.loop"):
        written = checkpointer.save(7)
    [announced] = said_at_start
    assert len(announced) == 1
    assert "saving checkpoint step 7" in announced[0] and "step_00000007" in announced[0]
    estimate = checkpoint_bytes(checkpointer.units)  # 65,792 parameters x 12 bytes: 771 KiB, 13 min at 1 kB/s
    assert 0.9 < estimate / tree_bytes(written) < 1.1
    assert "(~771.0 KiB)" in announced[0] and "about 13 min" in announced[0]


def test_a_short_save_is_not_announced_and_the_next_one_uses_the_measured_speed(saving, monkeypatch, caplog):
    """A small checkpoint at the first guess's speed: no line. One that took 100 s (a clock that says so)
    announces the next save of the same size at about 100 s."""
    checkpointer, said_at_start = saving
    clock = iter([0.0, 100.0])
    monkeypatch.setattr(loop, "monotonic", lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="megakd.engine.loop"):
        checkpointer.save(1)
        monkeypatch.setattr(loop, "monotonic", lambda: 0.0)
        checkpointer.save(2)
    assert said_at_start[0] == []
    assert len(said_at_start[1]) == 1 and "about 100 s" in said_at_start[1][0]


def test_verifying_a_large_checkpoint_is_announced_before_it_is_read(tmp_path, monkeypatch, caplog):
    """A resume reads every byte of the checkpoint back for its sha256 first: a checkpoint that takes
    `LONG_WAIT_S` or more at the hashing speed gets a line naming it, its size and the time, before the
    first file is read; a quick one gets none."""
    from megakd.store import checkpoint

    step = tmp_path / "step_00000003"
    step.mkdir()
    (step / "weights.bin").write_bytes(os.urandom(4096))
    checkpoint.write_manifest(step, 3)
    read_before_the_line = []
    hashed = checkpoint.sha256_file

    def sha256_file(path):
        read_before_the_line.append(not lines(caplog, "verifying checkpoint"))
        return hashed(path)

    monkeypatch.setattr(checkpoint, "sha256_file", sha256_file)
    with caplog.at_level(logging.INFO, logger="megakd.store.checkpoint"):
        checkpoint.verify(step)  # 4 KiB at 300 MB/s: no line
        assert lines(caplog, "verifying checkpoint") == [] and read_before_the_line == [True]
        read_before_the_line.clear()
        monkeypatch.setattr(checkpoint, "HASH_BYTES_PER_S", 100.0)  # 4 KiB: 41 s
        checkpoint.verify(step)
    [line] = lines(caplog, "verifying checkpoint")
    assert str(step) in line and "(~4.0 KiB" in line and "about 41 s" in line
    assert read_before_the_line == [False]


def test_joining_the_launchers_process_group_is_announced_before_the_wait(monkeypatch, caplog):
    """Rank 0 waits in the rendezvous until every rank has joined (forever, if a node never started): the
    line names the group's size and address before it."""
    from megakd.engine import backends

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(backends.free_local_port()))
    said = []
    monkeypatch.setattr(backends, "create_process_group", lambda *_: said.extend(lines(caplog, "joining")))
    with caplog.at_level(logging.INFO, logger="megakd.engine.backends"):
        assert backends.init_distributed(Launch.from_environ(), "gloo") == (0, 1, 0)
    assert len(said) == 1 and "gloo process group of 1 ranks at 127.0.0.1:" in said[0]
