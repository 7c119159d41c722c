import itertools
import json
import shutil

import pytest

from megakd.data.shards import MANIFEST, read_manifest, write_shards
from megakd.data.stream import PretrainingLoader, ShardError
from megakd.data.tokenizer import train_tokenizer

from .conftest import corpus_docs, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture
def shards(small_shards, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(small_shards, copy)
    return copy


def shard_indices(manifest, name):
    entry = next(s for s in manifest["shards"] if s["file"] == name)
    return set(range(entry["first_index"], entry["first_index"] + entry["samples"]))


def test_truncated_shard(shards, tokenizer):
    path = shards / "shard-000003.tar"
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(ShardError, match=r"shard-000003\.tar: 5000 bytes, manifest.json says \d+ \(truncated"):
        PretrainingLoader(shards, tokenizer, micro_batch_size=4)


def test_missing_shard(shards, tokenizer):
    (shards / "shard-000005.tar").unlink()
    with pytest.raises(ShardError, match=r"shard-000005\.tar: missing"):
        PretrainingLoader(shards, tokenizer, micro_batch_size=4)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("offset", "message"), [
    (2048, r"sha256 [0-9a-f]{64} differs .*\(corrupted or replaced\)$"),  # third tar header: the tar ends early
    (1536, r"sha256 [0-9a-f]{64} differs .*; reading it: unreadable after 1 samples \(ValueError"),  # .npy header
])
def test_corrupt_shard_of_the_right_size(shards, tokenizer, workers, offset, message):
    path = shards / "shard-000002.tar"
    data = bytearray(path.read_bytes())
    data[offset : offset + 512] = b"\xff" * 512
    path.write_bytes(bytes(data))
    loader = PretrainingLoader(shards, tokenizer, micro_batch_size=4, num_workers=workers)
    with pytest.raises(ShardError, match=r"^shard \S+shard-000002\.tar: " + message) as err:
        list(itertools.islice(loader, 200))
    assert "\n" not in str(err.value)  # one line, also from a worker process


def test_shard_swapped_with_another(shards, tokenizer):
    a, b = shards / "shard-000001.tar", shards / "shard-000004.tar"
    assert a.stat().st_size == b.stat().st_size  # tar pads to 10 KiB records: the sizes agree
    tmp = shards / "x"
    a.rename(tmp), b.rename(a), tmp.rename(b)
    loader = PretrainingLoader(shards, tokenizer, micro_batch_size=4)
    with pytest.raises(ShardError, match=r"shard-00000[14]\.tar: sha256 .* \(corrupted or replaced\); reading it: "
                                         r"member 0 is '000000000\d+\.ids\.npy', expected"):
        list(itertools.islice(loader, 200))


def test_manifest_with_wrong_count(shards, tokenizer):
    m = json.loads((shards / MANIFEST).read_text())
    m["shards"][0]["samples"] += 1
    (shards / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"manifest.json: .*inconsistent first_index/samples|sum to"):
        read_manifest(shards)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m.pop("seq_len"), "missing key 'seq_len'"),
    (lambda m: m.update(version=99), "expected format 'megakd-shards' version 1"),
])
def test_manifest_format_errors(shards, tokenizer, edit, message):
    m = json.loads((shards / MANIFEST).read_text())
    edit(m)
    (shards / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=message):
        PretrainingLoader(shards, tokenizer, micro_batch_size=4)


def test_missing_manifest(shards, tokenizer):
    (shards / MANIFEST).unlink()
    with pytest.raises(FileNotFoundError, match="missing manifest.json"):
        PretrainingLoader(shards, tokenizer, micro_batch_size=4)


def test_tokenizer_mismatch(small_shards, tokenizer, corpus_jsonl, tmp_path):
    other = train_tokenizer([corpus_jsonl], 500, tmp_path / "other")
    with pytest.raises(ValueError, match=rf"manifest.json: .*vocab_hash {tokenizer.vocab_hash}, "
                                         rf"but tokenizer .*other has {other.vocab_hash}"):
        PretrainingLoader(small_shards, other, micro_batch_size=4)
    PretrainingLoader(small_shards, other, micro_batch_size=4, check_tokenizer=False)


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_bad_shards_counts_and_skips_only_them(shards, tokenizer, workers):
    manifest = read_manifest(shards)
    (shards / "shard-000005.tar").unlink()
    corrupt = shards / "shard-000002.tar"
    data = bytearray(corrupt.read_bytes())
    data[2048:2560] = b"\xff" * 512
    corrupt.write_bytes(bytes(data))
    loader = PretrainingLoader(shards, tokenizer, micro_batch_size=4, num_workers=workers, skip_bad_shards=True)
    assert loader.skipped_shards == 1  # the missing one is known up front, the corrupt one when read
    seen = []
    for b in loader:
        seen += [int(i) for i, e in zip(b["index"], b["epoch"]) if e == 0]
        if loader.position >= loader.num_samples:  # later batches start in epoch 1
            break
    lost = shard_indices(manifest, "shard-000002.tar") | shard_indices(manifest, "shard-000005.tar")
    assert sorted(seen) == sorted(set(range(manifest["num_samples"])) - lost)
    assert loader.skipped_shards == 2 and set(loader.bad_shards) == {"shard-000002.tar", "shard-000005.tar"}


def test_writer_refuses_non_empty_output(small_shards, tokenizer, corpus_jsonl):
    before = sorted(p.name for p in small_shards.iterdir())
    with pytest.raises(FileExistsError, match=f"{small_shards}: directory exists and is not empty"):
        write_shards([corpus_jsonl], tokenizer, 64, small_shards)
    assert sorted(p.name for p in small_shards.iterdir()) == before


def test_failed_write_leaves_nothing(tokenizer, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": corpus_docs(0, 1)[0]}) + "\n" + '{"txt": "oops"}\n')
    with pytest.raises(ValueError, match=rf"{bad}:2: expected an object with a string field 'text'"):
        write_shards([bad], tokenizer, 64, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_bad_jsonl_and_paths(tokenizer, tmp_path):
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(ValueError, match=r"broken.jsonl:2: invalid JSON"):
        write_shards([tmp_path / "broken.jsonl"], tokenizer, 64, tmp_path / "o1")
    with pytest.raises(FileNotFoundError, match=r"nope.txt: no such file"):
        write_shards([tmp_path / "nope.txt"], tokenizer, 64, tmp_path / "o2")
    (tmp_path / "data.parquet").write_bytes(b"")
    with pytest.raises(ValueError, match=r"data.parquet: expected .txt, .txt.gz, .jsonl, .jsonl.gz or a directory"):
        write_shards([tmp_path / "data.parquet"], tokenizer, 64, tmp_path / "o3")


def test_fewer_samples_than_ranks_still_deal_the_global_order(tokenizer, tmp_path):
    """One sample, two ranks: the global order is that sample once per epoch, dealt in turn."""
    src = write_jsonl(tmp_path / "tiny.jsonl", ["word " * 20])
    write_shards([src], tokenizer, 64, tmp_path / "s")
    for rank in (0, 1):
        loader = PretrainingLoader(tmp_path / "s", tokenizer, micro_batch_size=1, rank=rank, world_size=2)
        batches = [next(it) for it in [iter(loader)] for _ in range(2)]
        assert [(int(b["epoch"][0]), int(b["index"][0])) for b in batches] == [(rank, 0), (rank + 2, 0)]
