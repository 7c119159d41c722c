"""Shards in Google Cloud Storage (gs://), against a real GCS JSON-API server in a child process
(gcp-storage-emulator, tests/remote_servers.py GCSProcess): gcsfs does the I/O, nothing is mocked.

The same promises as for s3:// (tests/data/test_remote.py): a gs:// prefix gives the local disk's
batches, a server that goes away for a moment is waited for, one that stays away ends in one line
naming the object. One difference, measured here and said in docs/data.md: gcsfs retries a failed
request itself (6 tries, about 30 s of backoff) before megakd sees the error, so a short outage never
reaches `read_retries`, and storage that stays away is declared failed only after gcsfs's retries
times megakd's.
"""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other test modules are test arguments)
import time
import types

import pytest

from megakd.data.shards import read_manifest, write_shards
from megakd.data.storage import ShardStore, StorageError
from tests.data.test_remote import OUTAGE_S, SPS, assert_same_batches, loader, local, restarted_mid_epoch, source, take  # noqa: F401
from tests.remote_servers import gcs_process  # noqa: F401 (fixture)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.mark.parametrize("workers,read_block", [(0, 1), (2, 4)])
def test_gs_gives_the_local_batches(local, gcs_process, tokenizer, workers, read_block):
    gcs_process.upload(local, "gs://corpus/shards")
    kw = dict(num_workers=workers, read_block=read_block, shuffle_shards=4)
    assert read_manifest("gs://corpus/shards") == read_manifest(local)
    got = loader("gs://corpus/shards", tokenizer, **kw)
    assert_same_batches(take(got, 30), take(loader(local, tokenizer, **kw), 30))
    assert got.read_retries == 0


def test_write_shards_to_gs_then_read_back(source, local, gcs_process, tokenizer):
    """Shards written straight to gs:// (as `megakd data shards --out gs://...` does) read back as the local ones."""
    gcs_process.make_bucket("written")
    write_shards([source], tokenizer, 64, "gs://written/shards", samples_per_shard=SPS, shuffle=True)
    assert read_manifest("gs://written/shards") == read_manifest(local) | {
        "sources": read_manifest("gs://written/shards")["sources"]}
    assert_same_batches(take(loader("gs://written/shards", tokenizer), 12), take(loader(local, tokenizer), 12))


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_gcs_server_killed_and_restarted_mid_epoch_gives_the_same_batches(local, gcs_process, tokenizer, workers):
    gcs_process.upload(local, "gs://restarted/x")
    restarted_mid_epoch(gcs_process, "gs://restarted/x", local, tokenizer, workers)


def test_a_read_during_an_outage_waits_inside_gcsfs(local, gcs_process):
    """What the loader test above cannot see: the read that meets the outage is held by gcsfs's own
    retries until the server is back (at least the outage long), and megakd counts no retry."""
    gcs_process.upload(local, "gs://held/x")
    store = ShardStore("gs://held/x", retries=0)
    name = read_manifest("gs://held/x")["shards"][0]["file"]
    want = store.read(name)
    restarted = gcs_process.restart_after(OUTAGE_S)
    started = time.monotonic()
    assert store.read(name) == want
    assert time.monotonic() - started >= OUTAGE_S - 0.1 and store.retried == 0
    restarted.join()


async def _no_backoff(delay, result=None):
    return result


@pytest.mark.slow
def test_gcs_server_down_for_good_is_one_line_naming_the_object(local, gcs_process, tokenizer, monkeypatch):
    """The line megakd says once gcsfs gives up. gcsfs's own backoff between its six tries (1 + 2 + 4 + 8
    + 16 s and jitter, for each request) is not megakd's and is skipped: it was a minute of this test."""
    import gcsfs.retry

    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(sleep=_no_backoff))
    gcs_process.upload(local, "gs://gone/x")
    got = loader(ShardStore("gs://gone/x", retries=0), tokenizer)
    gcs_process.stop()
    with pytest.raises(StorageError) as e:
        next(iter(got))
    message = str(e.value)
    assert "\n" not in message and "still failing after 1 tries" in message, message
    url = message.split(": ", 1)[0]
    assert url.startswith("gs://gone/x/") and url.endswith((".tar", ".idx")), message
