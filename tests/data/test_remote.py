"""Shards in object storage, against real servers over a socket: a moto S3 server and a small HTTP
server with Range support (tests/remote_servers.py). No fsspec mocks: s3fs and aiohttp do the I/O.

Reading a prefix must give the same batches as the same shards on local disk, survive a server
that goes away for a moment (counted retries), fail in one line naming the object when it stays
away or when an object was tampered with, and never take a half-uploaded prefix for a data set.
"""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from tests.remote_servers are test arguments)
import gc
import itertools
import multiprocessing
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from megakd.data.loader import PretrainingLoader
from megakd.data.order import ReaderOrder
from megakd.data.prefetch import SampleReader, _Prefetch
from megakd.data.shard_reader import ShardError, coalesce
from megakd.data.shards import INDEX_DTYPE, MANIFEST, read_manifest, sample_key, write_shards
from megakd.data.storage import ReadCancelled, ShardStore, StorageError, cancel_on
from megakd.engine.backends import free_local_port
from megakd.errors import UserError
from tests.data.conftest import corpus_docs, member_spans, write_jsonl
from tests.remote_servers import (  # noqa: F401, F811 (fixtures)
    http_process,
    http_server,
    s3,
    s3_env,
    s3_process,
    s3_server,
)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

KEYS = ("input_ids", "masked_input_ids", "attention_mask", "mlm_mask", "index", "epoch")
SPS = 37  # samples per shard: 395 samples in 11 shards


def take(loader, n: int) -> list[dict]:
    return list(itertools.islice(iter(loader), n))


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        for k in KEYS:
            assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), (i, k)


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("remote_src") / "small.jsonl", corpus_docs(2, 6))


@pytest.fixture(scope="module")
def local(source, tokenizer, tmp_path_factory) -> Path:
    """Shuffled shards on local disk (shuffled so that read_block > 1 reads mixed samples)."""
    out = tmp_path_factory.mktemp("remote_local") / "shards"
    write_shards([source], tokenizer, 64, out, samples_per_shard=SPS, shuffle=True)
    return out


@pytest.fixture(scope="module")
def s3_copy(source, tokenizer, s3_server, s3_env) -> str:
    """The same shards written by write_shards to an s3:// prefix (one bucket for the module's readers)."""
    s3_server.client().create_bucket(Bucket="remote-same")
    url = "s3://remote-same/shards"
    write_shards([source], tokenizer, 64, url, samples_per_shard=SPS, shuffle=True)
    return url


@pytest.fixture
def served(local, http_server):
    """The local shards behind the HTTP server (a copy: tests may tamper with what is served)."""
    return http_server(local)


def loader(spec, tokenizer, **kw) -> PretrainingLoader:
    return PretrainingLoader(spec, tokenizer, **{"micro_batch_size": 8, "seed": 3, **kw})


# -- a. the same batches from every store ------------------------------------------------------------
@pytest.mark.parametrize("world,rank,workers,read_block", [
    (1, 0, 0, 1), (1, 0, 0, 4), (2, 0, 0, 1), (2, 1, 0, 4), (2, 0, 2, 4), (2, 1, 2, 1)])
def test_s3_and_http_give_the_local_batches(local, s3_copy, served, tokenizer, world, rank, workers, read_block):
    kw = dict(rank=rank, world_size=world, num_workers=workers, read_block=read_block, shuffle_shards=4)
    n = 30  # 240 samples per rank: across shard groups, and into epoch 1 for world 2
    want = take(loader(local, tokenizer, **kw), n)
    assert read_manifest(s3_copy) == read_manifest(local) | {"sources": read_manifest(s3_copy)["sources"]}
    for spec in (s3_copy, served.url):
        got = loader(spec, tokenizer, **kw)
        assert_same_batches(take(got, n), want)
        assert got.read_retries == 0
    assert served.ranged > 0  # members were fetched by ranged reads, not whole shards


@pytest.mark.parametrize("rank", [0, 1])
def test_workers_reading_together_give_the_local_batches(local, served, tokenizer, tmp_path, rank):
    """With an index cache, a rank's DataLoader workers read what they want of a shard together
    (SharedRead): the local batches, and nothing left in the shared-reads directory when the pass ends.

    How many requests they make here depends on how their reads happen to overlap in time (see
    ``test_a_ranks_readers_fetch_each_shared_read_once_between_them``), so it is not asserted here; the
    same loader without an index cache is ``test_s3_and_http_give_the_local_batches[2-0-2-4]``."""
    kw = dict(rank=rank, world_size=2, num_workers=2, read_block=4, shuffle_shards=4)
    n = 30
    want = take(loader(local, tokenizer, **kw), n)
    got = loader(served.url, tokenizer, index_cache=tmp_path / "cache", **kw)
    assert got.plan.shared_reads is not None
    assert_same_batches(take(got, n), want)
    assert not any(Path(got.plan.shared_reads).glob("*"))


# The rank's two DataLoader workers as two readers in this process: reader k builds batches k, k + 2, ...
# (what worker k of 2 builds), each reading ahead as a worker does, but in a fixed order: every read of a
# batch, its read-ahead included, is over before the next batch is built. Which reader fetches a shared
# read and which finds it in the cache is then decided by the order alone, not by the scheduler (with
# real workers it is: two reads of one shard a moment apart can both fetch it; a worker whose pass
# ends first gives up the group it read ahead, which the other may still be reading).
SHARED_KW = dict(world_size=2, read_block=4, shuffle_shards=4)
SHARED_BATCHES = 40  # 640 positions of the order: epoch 0's 3 groups and 2 groups of epoch 1


def read_in_order(plan, order: list[int]) -> dict[int, list]:
    """The samples of each batch in ``order``, built by reader ``batch % 2`` of 2 (``every=2``)."""
    readers = [SampleReader(plan, [], every=2) for _ in range(2)]
    before = set(read_aheads())
    got = {}
    for batch in order:
        reader = readers[batch % 2]
        reader.at_batch = batch
        got[batch] = [reader.sample(position) for position in plan.batch_positions(batch)]
        for ahead in read_aheads(before):  # this batch's read-ahead, over before the next batch
            ahead.join()
    assert all(reader.close() and reader.bad == [] for reader in readers)
    return got


def assert_same_samples(got: dict[int, list], local_plan) -> None:
    expected = SampleReader(local_plan, [], prefetch=False)
    for batch, samples in got.items():
        for position, a in zip(local_plan.batch_positions(batch), samples):
            b = expected.sample(position)
            assert a[:2] == b[:2] and np.array_equal(a[2], b[2]), (batch, position)


def next_group(layout: ReaderOrder, key: tuple[int, int]) -> tuple[int, int]:
    epoch, index = key
    return (epoch, index + 1) if index + 1 < len(layout.epoch_groups(epoch)[0]) else (epoch + 1, 0)


def planned_reads(plan, local: Path, batches: int):
    """What readers 0 and 1 of the rank read over its first ``batches`` batches, worked out from the
    order alone (nothing is fetched): for each reader, the groups it reads in turn (each one it enters,
    then the one it reads ahead after the last); for each (group, shard), the in-shard positions each
    reader wants there (its batches' samples: from the first one in the group on, all of them); and
    ``requests(shard, positions)``, the ranged GETs one read of those members makes."""
    layout = ReaderOrder(plan)  # the order's groups: nothing is read
    groups, wants, entered = {}, {}, ([], [])
    for batch in range(batches + 40):  # 40 more: past the end of the last group read ahead
        k = batch % 2
        for position in plan.batch_positions(batch):
            epoch, offset = divmod(position, plan.total)
            key = (epoch, int(np.searchsorted(layout.epoch_groups(epoch)[1], offset, side="right")))
            group = groups.setdefault(key, layout.group_at(*key))
            j = int(group.perm[offset - group.first])
            i = int(np.searchsorted(group.shard_ends, j, side="right"))
            shard = int(group.shards[i])
            wants.setdefault((key, shard), (set(), set()))[k].add(j - int(group.shard_ends[i]) + plan.counts[shard])
            if batch < batches and entered[k][-1:] != [key]:
                entered[k].append(key)
    reads = [keys + [next_group(layout, keys[-1])] for keys in entered]

    def requests(shard: int, positions) -> int:
        spans = np.asarray(member_spans(local, plan.files[shard]))
        wanted = np.asarray(sorted(positions), np.int64)
        return len(coalesce(spans[wanted, 0], spans[wanted, 1], plan.overfetch)) if len(wanted) else 0

    return reads, wants, requests


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_readers_fetch_each_shared_read_once_between_them(local, served, tokenizer, tmp_path, rank):
    """Without an index cache each of the rank's two readers fetches its own members of every shard it
    reads; with one (SharedRead), the first reader to reach a shard of a group fetches the members of
    both, once, and the other takes its own out of the cache: exactly the ranged GETs the order plans
    for each, the local samples both ways, and fewer than 3/4 of the requests."""
    kw = dict(rank=rank, **SHARED_KW)
    own = loader(served.url, tokenizer, num_workers=2, **kw).plan
    shared = loader(served.url, tokenizer, num_workers=2, index_cache=tmp_path / "cache", **kw).plan
    assert own.shared_reads is None and shared.shared_reads is not None
    reads, wants, requests = planned_reads(own, local, SHARED_BATCHES)
    assert len(reads[0]) >= 5 and reads[0][-1][0] == 1  # through epoch 0 into epoch 1
    alone = sum(requests(shard, wants[key, shard][k]) for k in (0, 1) for key, shard in wants if key in reads[k])
    together = sum(requests(shard, wants[key, shard][0] | wants[key, shard][1]) for key, shard in wants
                   if any(key in reads[k] and wants[key, shard][k] for k in (0, 1)))
    local_plan = loader(local, tokenizer, **kw).plan
    ranged = []
    for plan in (own, shared):
        before = served.ranged
        assert_same_samples(read_in_order(plan, list(range(SHARED_BATCHES))), local_plan)
        ranged.append(served.ranged - before)
    assert ranged == [alone, together]
    assert together < 0.75 * alone, (together, alone)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_reader_more_than_two_groups_behind_fetches_again_and_reads_the_local_samples(local, served, tokenizer,
                                                                                       tmp_path, rank):
    """Reader 0 builds all its batches before reader 1 starts: groups ahead of it. The shared reads of a
    group are discarded two groups later, so reader 1 finds only those of reader 0's last two groups and
    of the one it read ahead, and fetches the others again (once each); its samples are the local ones."""
    kw = dict(rank=rank, **SHARED_KW)
    plan = loader(served.url, tokenizer, num_workers=2, index_cache=tmp_path / "cache", **kw).plan
    reads, wants, requests = planned_reads(plan, local, SHARED_BATCHES)
    kept = reads[0][-3:]  # still in the cache when reader 1 starts

    def fetched(k: int, skip=()) -> int:
        return sum(requests(shard, wants[key, shard][0] | wants[key, shard][1]) for key, shard in wants
                   if key in reads[k] and wants[key, shard][k] and (key, shard) not in skip)

    in_cache = {(key, shard) for key, shard in wants if key in kept and wants[key, shard][0]}
    expected = fetched(0) + fetched(1, skip=in_cache)
    assert fetched(1, skip=in_cache) > 0 and len(reads[0]) - len(kept) >= 2  # it does fetch groups again
    before = served.ranged
    order = list(range(0, SHARED_BATCHES, 2)) + list(range(1, SHARED_BATCHES, 2))
    assert_same_samples(read_in_order(plan, order), loader(local, tokenizer, **kw).plan)
    assert served.ranged - before == expected


def test_a_damaged_shared_read_is_fetched_again(local, served, tokenizer, tmp_path):
    """A shared read's cache file is used only if every member in it matches its index digest: a
    flipped byte, or a file planted under its name, is fetched again, and the samples are the local ones."""
    got = loader(served.url, tokenizer, num_workers=2, index_cache=tmp_path / "cache")
    expected = SampleReader(loader(local, tokenizer, num_workers=2).plan, [], prefetch=False)
    first = SampleReader(got.plan, [], every=2, prefetch=False)
    first.at_batch = 0
    first.sample(0)  # group 0, read for both readers into the cache
    shared = Path(got.plan.shared_reads)
    files = sorted(shared.iterdir())
    assert files
    damaged = bytearray(files[0].read_bytes())
    damaged[len(damaged) // 2] ^= 1
    files[0].write_bytes(bytes(damaged))
    for planted in files[1:]:
        planted.write_bytes(b"\0" * planted.stat().st_size)
    before = served.ranged
    second = SampleReader(got.plan, [], every=2, prefetch=False)
    second.at_batch = 1
    for position in got.plan.batch_positions(1):
        a, b = second.sample(position), expected.sample(position)
        assert a[:2] == b[:2] and np.array_equal(a[2], b[2])
    assert served.ranged - before == len(files)  # each fetched again, once
    assert second.bad == []


# -- b. kill -9 during a run reading s3://, then --resume auto ---------------------------------------
@pytest.mark.slow
def test_kill_then_resume_auto_on_s3_matches_the_uninterrupted_run(tiny_data, s3, tmp_path):
    from tests.faults.harness import REPO, megakd
    from tests.faults.test_persistence import _args, assert_same_as_base

    tokenizer_dir, shards_dir = tiny_data
    from megakd.data.tokenizer import Tokenizer

    url = s3.url("tiny")
    write_shards([tokenizer_dir.parent / "slice.jsonl"], Tokenizer.load(tokenizer_dir), 64, url,
                 samples_per_shard=256)
    reference, run = tmp_path / "reference", tmp_path / "run"
    out = megakd("pretrain", *_args(tiny_data, reference))  # uninterrupted, from local disk
    assert out.code == 0, out.stderr[-2000:]
    remote = (tokenizer_dir, url)
    proc = subprocess.Popen([sys.executable, "-m", "megakd.cli", "pretrain", *_args(remote, run)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = run / "checkpoints" / "step_00000002"
    deadline = time.time() + 300
    while not first.is_dir() and proc.poll() is None:
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (run / "checkpoints" / "step_00000006").exists()
    out = megakd("pretrain", "--resume", "auto", *_args(remote, run))
    assert out.code == 0, out.stderr[-2000:]
    assert_same_as_base(run, reference)


# -- c. a server that goes away for a moment ----------------------------------------------------------
# The server runs in a child process and is killed (every connection drops, none is answered again),
# then started again on the same port with the same objects, while the loader (DataLoader workers
# too) asks for batches. Killing the process also means no forked worker holds its listening socket.
OUTAGE_S = 1.5  # refused for this long (the new server is readied first): inside the backoff, 0.25+0.5+1 s


def restarted_mid_epoch(server, spec, local, tokenizer, workers: int) -> PretrainingLoader:
    """30 batches from ``spec`` with the server killed after the 3rd and back ``OUTAGE_S`` later, while
    the batches are being asked for; the same batches as from local disk."""
    kw = dict(num_workers=workers, shuffle_shards=1)  # one shard read at a time, all through the epoch
    want = take(loader(local, tokenizer, **kw), 30)
    got = loader(spec, tokenizer, **kw)
    batches = iter(got)
    first = take(batches, 3)
    restarted = server.restart_after(OUTAGE_S)  # down now
    rest = take(batches, 27)
    restarted.join()
    assert_same_batches(first + rest, want)
    assert len(server.outages) == 1 and server.outages[0] >= OUTAGE_S
    return got


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_s3_server_killed_and_restarted_mid_epoch_is_retried(local, s3_process, tokenizer, workers):
    s3_process.upload(local, "s3://restarted/x")
    got = restarted_mid_epoch(s3_process, "s3://restarted/x", local, tokenizer, workers)
    assert got.read_retries > 0


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_http_server_killed_and_restarted_mid_epoch_is_retried(local, http_process, tokenizer, workers):
    server = http_process(local)
    got = restarted_mid_epoch(server, server.url, local, tokenizer, workers)
    assert got.read_retries > 0


@pytest.mark.parametrize("workers", [0, 2])
def test_http_503_answers_are_retried(local, served, tokenizer, workers):
    kw = dict(num_workers=workers, shuffle_shards=1)
    want = take(loader(local, tokenizer, **kw), 30)
    got = loader(served.url, tokenizer, **kw)
    batches = iter(got)
    first = take(batches, 3)
    served.fail(3, 503)
    rest = take(batches, 27)
    assert_same_batches(first + rest, want)
    # with workers, retries made for prefetched batches not yet handed out are not counted yet
    assert served.failed == 3 and (got.read_retries == 3 if workers == 0 else 1 <= got.read_retries <= 3)


# -- d. a server that stays away -----------------------------------------------------------------------
def test_http_server_down_for_good_is_one_line_naming_the_object(served, tokenizer):
    got = loader(ShardStore(served.url, retries=2, backoff_s=0.05), tokenizer)
    served.stop()
    started = time.monotonic()
    with pytest.raises(StorageError) as e:
        next(iter(got))
    message = str(e.value)
    assert "\n" not in message and "still failing after 3 tries" in message, message
    url = message.split(": ", 1)[0]
    assert url.startswith(served.url + "/") and url.endswith((".tar", ".idx")), message
    assert time.monotonic() - started < 60  # a hang's bound (a client's 300 s), not a loaded machine's slowness


def test_s3_server_down_for_good_is_one_line_naming_the_object(local, source, s3, tokenizer):
    write_shards([source], tokenizer, 64, s3.url("x"), samples_per_shard=SPS)
    got = loader(ShardStore(s3.url("x"), retries=2, backoff_s=0.05), tokenizer)
    s3.server.stop()
    with pytest.raises(StorageError) as e:
        next(iter(got))
    message = str(e.value)
    assert "\n" not in message and "still failing after 3 tries" in message, message
    url = message.split(": ", 1)[0]
    assert url.startswith(s3.url("x") + "/") and url.endswith((".tar", ".idx")), message


# -- d2. a read-ahead given up ------------------------------------------------------------------------
# A reader reads the next shard group in a thread. When the loader is given up (closed, dropped) or
# the position moves past that group, the thread must stop at once, not go on retrying a dead store
# for the minute of the default backoff (0.25 s doubling to 30 s, 8 retries), and what it was reading
# must count neither as data nor as a bad shard.
def read_aheads(before: set | frozenset = frozenset()) -> list[_Prefetch]:
    return [t for t in threading.enumerate() if isinstance(t, _Prefetch) and t.is_alive() and t not in before]


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.mark.parametrize("abandon", ["close", "drop", "reposition"])
def test_read_ahead_against_a_stopped_server_ends_when_the_loader_is_given_up(local, http_process, tokenizer,
                                                                              caplog, abandon):
    server = http_process(local)
    before = set(read_aheads())
    # The default retry policy, under which the read-ahead retried the dead server for ~62 s; shuffle_shards=1:
    # a group is one shard of 37 samples, so batch 5 (positions 32..39) enters group 1.
    got = loader(ShardStore(server.url), tokenizer, shuffle_shards=1, skip_bad_shards=True)
    batches = iter(got)
    next(batches)  # group 0 read, group 1 read ahead
    wait_for(lambda: not read_aheads(before))
    server.stop()  # killed: every connection refused from now on
    take(batches, 4)  # into group 1 (already read); group 2 is read ahead from nothing
    [ahead] = read_aheads(before)
    wait_for(lambda: got.plan.store.retried > 0)  # it failed and waits to retry
    assert ahead.is_alive()
    started = time.monotonic()
    if abandon == "close":
        got.close()
    elif abandon == "drop":
        del batches
        gc.collect()
    else:  # a position set anew (the trainer rewinds a step that storage failed): the old iterator is done
        got.load_state_dict(got.state_dict())
    ahead.join(2.0)
    assert not ahead.is_alive(), f"read-ahead still running {time.monotonic() - started:.1f} s after {abandon}"
    assert isinstance(ahead.error, ReadCancelled)  # not a StorageError
    assert ahead.group.bad == [] and got.bad_shards == {}
    assert "skipping bad shard" not in caplog.text


def test_read_ahead_passed_over_is_cancelled(local, served, tokenizer):
    """A reader whose positions skip the group it read ahead (a DataLoader worker whose batches miss
    it, a reposition) gives that read up, and the group it does read is the local one."""
    got = loader(ShardStore(served.url, backoff_s=3600.0, max_backoff_s=3600.0), tokenizer, shuffle_shards=1)
    want = loader(local, tokenizer, shuffle_shards=1)
    reader, expected = SampleReader(got.plan, []), SampleReader(want.plan, [], prefetch=False)
    before = set(read_aheads())
    assert reader.sample(0)[1] == expected.sample(0)[1]  # group 0; group 1 read ahead
    wait_for(lambda: not read_aheads(before))
    served.fail(10**6)  # 503 from now on
    assert reader.sample(40)[1] == expected.sample(40)[1]  # group 1; group 2 read ahead, into an hour's backoff
    [ahead] = read_aheads(before)
    wait_for(lambda: served.failed > 0)
    served.fail(0)
    far = 6 * SPS + 3  # group 6: the read-ahead of group 2 is dropped
    a, b = reader.sample(far), expected.sample(far)
    assert a[:2] == b[:2] and np.array_equal(a[2], b[2])
    ahead.join(60)  # only the cancel ends the backoff before its hour
    assert not ahead.is_alive() and isinstance(ahead.error, ReadCancelled)
    assert reader.close() and not read_aheads(before)


def _read_ahead_then_close(reader: SampleReader, go, closed) -> None:
    reader.sample(0)  # group 0 read; group 1 read ahead, by one thread per shard
    go.wait()
    reader.close(timeout=0)  # what a DataLoader worker does when its pass ends
    closed.set()


def test_a_worker_exits_without_waiting_for_a_request_its_cancelled_read_ahead_has_in_flight(served, tokenizer):
    """A worker's read-ahead is given up with its requests in flight when a pass ends. The process
    must end at once all the same: before its shard reads ran in daemon threads, it joined them at
    exit and waited for the request (and the HTTP client's retries at shutdown), 10 s and more."""
    got = loader(served.url, tokenizer, shuffle_shards=2)
    reader = SampleReader(got.plan, [])
    served.hold(Path(got.plan.files[shard]).stem for shard in reader.group_at(0, 1).shards)
    context = multiprocessing.get_context("fork")
    go, closed = context.Event(), context.Event()
    child = context.Process(target=_read_ahead_then_close, args=(reader, go, closed))
    child.start()
    try:
        wait_for(lambda: served.held > 0, timeout=30)  # the read-ahead of group 1 waits for an answer
        go.set()
        assert closed.wait(10)
        child.join(5)
        assert not child.is_alive(), "the worker waited at exit for its cancelled read-ahead's request"
        assert child.exitcode == 0 and served.held > 0  # and the request was still unanswered
    finally:
        served.release()
        child.join(10)


def test_cancel_during_backoff_returns_promptly():
    """A read retrying a dead endpoint (connections refused) inside `cancel_on` gives up out of its backoff
    wait as soon as the event is set: ReadCancelled, not StorageError, and no further try."""
    store = ShardStore(f"http://127.0.0.1:{free_local_port()}", retries=8, backoff_s=3600.0, max_backoff_s=3600.0)
    cancel, outcome = threading.Event(), {}

    def read() -> None:
        with cancel_on(cancel):
            try:
                store.read("shard-000000.tar")
            except BaseException as error:
                outcome["error"] = error

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    wait_for(lambda: store.retried == 1)  # the first try failed: in an hour's backoff now
    cancel.set()
    thread.join(60)
    assert not thread.is_alive(), "the backoff did not end on cancel"
    assert isinstance(outcome["error"], ReadCancelled) and store.retried == 1
    with cancel_on(cancel), pytest.raises(ReadCancelled):  # a cancelled scope does not even try
        store.read("shard-000000.tar")
    assert store.retried == 1


def test_requests_are_counted_as_the_server_sees_them(local, served, source, s3, tokenizer):
    """`ShardStore.requested` (summed into the loader's `read_requests`) counts the GETs the server
    answered: one per object read and one per byte range, over HTTP and S3 alike, and nothing else (no
    HEAD before a whole object: megakd's own GET bounds it by its budget instead)."""
    name = read_manifest(local)["shards"][0]["file"]
    ranges = [(0, 512), (1024, 2048), (4096, 4608)]
    store = ShardStore(served.url)
    before = (served.requests, served.ranged)
    store.read(MANIFEST)
    store.read_ranges(name, ranges)
    assert store.requested == 4 == served.requests - before[0]
    assert served.ranged - before[1] == len(ranges)

    write_shards([source], tokenizer, 64, s3.url("c"), samples_per_shard=SPS)
    store = ShardStore(s3.url("c"))
    with s3.server.recording() as seen:
        store.read(MANIFEST)
        store.read_ranges(name, ranges)
    gets = [key for method, key in seen if method == "GET"]
    assert store.requested == len(gets) == 4 == len(seen)


# -- e. tampered objects --------------------------------------------------------------------------------
def test_tampered_s3_shard_names_the_url_and_the_sample(source, s3, tokenizer):
    url = s3.url("x")
    manifest = write_shards([source], tokenizer, 64, url, samples_per_shard=SPS)
    entry = manifest["shards"][4]
    index = np.frombuffer(s3.get(f"x/{entry['index']['file']}"), INDEX_DTYPE)
    j = 5
    at = int(index["size"][:j].astype(np.int64).sum()) + 512 + 130  # inside member j's npy payload
    data = bytearray(s3.get(f"x/{entry['file']}"))
    data[at] ^= 0x01
    s3.put(f"x/{entry['file']}", bytes(data))
    with pytest.raises(ShardError) as e:
        take(loader(url, tokenizer), 60)
    message = str(e.value)
    assert "\n" not in message, message
    assert f"shard {url}/{entry['file']}: sample {sample_key(entry['first_index'] + j)}" in message, message
    assert "differs from its index digest" in message, message


def test_replaced_s3_index_fails_its_sha256(source, s3, tokenizer):
    url = s3.url("x")
    manifest = write_shards([source], tokenizer, 64, url, samples_per_shard=SPS)
    a, b = manifest["shards"][2]["index"]["file"], manifest["shards"][3]["index"]["file"]
    s3.put(f"x/{a}", s3.get(f"x/{b}"))  # another shard's (valid-looking) index
    with pytest.raises(ShardError) as e:
        take(loader(url, tokenizer), 60)
    message = str(e.value)
    assert "\n" not in message, message
    assert message.startswith(f"index {url}/{a}: ") and "(corrupted or replaced)" in message, message


# -- f. uploads -----------------------------------------------------------------------------------------
def test_upload_refuses_a_non_empty_prefix_and_changes_nothing(source, s3, tokenizer):
    url = s3.url("x")
    write_shards([source], tokenizer, 64, url, samples_per_shard=SPS)
    before = {k: s3.get(k) for k in s3.keys()}
    with pytest.raises(UserError, match="holds objects already") as e:
        write_shards([source], tokenizer, 64, url, samples_per_shard=50, shuffle=True)
    assert url in str(e.value) and "\n" not in str(e.value)
    s3.put("y/notes.txt", b"not shards")  # a single foreign object is enough
    with pytest.raises(UserError, match="holds objects already"):
        write_shards([source], tokenizer, 64, s3.url("y"), samples_per_shard=SPS)
    assert {k: s3.get(k) for k in s3.keys() if k.startswith("x/")} == before
    assert s3.keys("y/") == ["y/notes.txt"]


def test_manifest_is_the_last_put_and_a_prefix_without_it_is_no_data_set(source, s3, tokenizer):
    url = s3.url("x")
    with s3.server.recording() as requests:
        write_shards([source], tokenizer, 64, url, samples_per_shard=SPS, keep=lambda text: True)
    puts = [key for method, key in requests if method == "PUT" and key.startswith(f"{s3.name}/x/")]
    assert sorted(puts) == sorted(f"{s3.name}/{k}" for k in s3.keys("x/"))
    assert puts[-1] == f"{s3.name}/x/{MANIFEST}" and puts.count(puts[-1]) == 1
    # an upload interrupted just before its manifest: every other object, copied as it was
    for key in s3.keys("x/"):
        if not key.endswith(MANIFEST):
            s3.put("partial/" + key[2:], s3.get(key))
    with pytest.raises(FileNotFoundError, match=f"missing {MANIFEST}"):
        loader(s3.url("partial"), tokenizer)


# -- g. the CLI ----------------------------------------------------------------------------------------
def test_cli_data_shards_to_s3_then_read_back(local, source, s3, tokenizer, tmp_path):
    from tests.faults.harness import megakd

    url = s3.url("cli")
    out = megakd("data", "shards", "--input", str(source), "--tokenizer", str(tokenizer.path), "--seq-len", "64",
                 "--out", url, "--samples-per-shard", str(SPS), "--shuffle")
    assert out.code == 0, out.stderr[-2000:]
    assert f"cli/{MANIFEST}" in s3.keys("cli/")
    assert read_manifest(url)["shards"] == read_manifest(local)["shards"]
    assert_same_batches(take(loader(url, tokenizer, read_block=4), 20),
                        take(loader(local, tokenizer, read_block=4), 20))
    again = megakd("data", "shards", "--input", str(source), "--tokenizer", str(tokenizer.path), "--seq-len", "64",
                   "--out", url)
    assert again.code == 2 and again.error_line().endswith("nothing is overwritten)"), again.stderr[-2000:]
    shutil.rmtree(tmp_path, ignore_errors=True)
