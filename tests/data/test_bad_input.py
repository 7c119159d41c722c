import itertools
import json
import re
import shutil

import pytest

from megakd.data.loader import PretrainingLoader
from megakd.data.shard_reader import ShardError, read_whole_shard
from megakd.data.shards import MANIFEST, read_manifest, write_shards
from megakd.data.storage import ShardStore
from megakd.data.tokenizer import train_tokenizer

from .conftest import corpus_docs, member_spans, unindexed, write_jsonl

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


@pytest.fixture
def shards(small_shards, tmp_path):
    copy = tmp_path / "shards"
    shutil.copytree(small_shards, copy)
    return copy


@pytest.fixture
def v1_shards(shards):
    """The same shards as a version-1 data set (no member index): read whole shard by whole shard."""
    return unindexed(shards)


def damaged_member(shards, name, offset):
    """(sample key, start, end) of the member of shard `name` holding byte `offset` (version 2)."""
    entry = json.loads((shards / MANIFEST).read_text())
    entry = next(s for s in entry["shards"] if s["file"] == name)
    j, (start, end) = next((j, span) for j, span in enumerate(member_spans(shards, name))
                           if span[0] <= offset < span[1])
    return f"{entry['first_index'] + j:012d}", start, end


def read_until_error(loader, limit=200):
    """(indices of the samples yielded before the loader raised, the ShardError)."""
    seen = []
    with pytest.raises(ShardError) as err:
        for b in itertools.islice(loader, limit):
            seen += [int(i) for i in b["index"]]
    return seen, err


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
def test_corrupt_shard_of_the_right_size(v1_shards, tokenizer, workers, offset, message):
    """Version 1: the whole shard's sha256 is named first, then what parsing it found."""
    path = v1_shards / "shard-000002.tar"
    data = bytearray(path.read_bytes())
    data[offset : offset + 512] = b"\xff" * 512
    path.write_bytes(bytes(data))
    loader = PretrainingLoader(v1_shards, tokenizer, micro_batch_size=4, num_workers=workers)
    with pytest.raises(ShardError, match=r"^shard \S+shard-000002\.tar: " + message) as err:
        list(itertools.islice(loader, 200))
    assert "\n" not in str(err.value)  # one line, also from a worker process


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("offset", [2048, 1536])  # a tar header, a .npy header
def test_corrupt_member_of_the_right_size(shards, tokenizer, workers, offset):
    """Version 2: the damaged member is named by its sample and byte range, before it is parsed."""
    path = shards / "shard-000002.tar"
    key, start, end = damaged_member(shards, path.name, offset)
    data = bytearray(path.read_bytes())
    data[offset : offset + 512] = b"\xff" * 512
    path.write_bytes(bytes(data))
    loader = PretrainingLoader(shards, tokenizer, micro_batch_size=4, num_workers=workers)
    seen, err = read_until_error(loader)
    assert re.fullmatch(rf"shard \S+shard-000002\.tar: sample {key} \(bytes {start}\.\.{end}\) differs from its "
                        r"index digest \(corrupted or replaced\)", str(err.value)), str(err.value)
    assert int(key) not in seen  # nothing was made of the damaged bytes


def swap(a, b):
    tmp = a.with_name("x")
    a.rename(tmp), b.rename(a), tmp.rename(b)


def test_shard_swapped_with_another(v1_shards, tokenizer):
    shards = v1_shards
    a, b = shards / "shard-000001.tar", shards / "shard-000004.tar"
    assert a.stat().st_size == b.stat().st_size  # tar pads to 10 KiB records: the sizes agree
    swap(a, b)
    loader = PretrainingLoader(shards, tokenizer, micro_batch_size=4)
    with pytest.raises(ShardError, match=r"shard-00000[14]\.tar: sha256 .* \(corrupted or replaced\); reading it: "
                                         r"member 0 is '000000000\d+\.ids\.npy', expected"):
        list(itertools.islice(loader, 200))


@pytest.mark.parametrize("with_index", [False, True], ids=["tar", "tar-and-index"])
def test_indexed_shard_swapped_with_another(shards, tokenizer, with_index):
    """Version 2: swapped alone, a shard's members differ from its index digests; swapped with its
    index, the index differs from the manifest's sha256. Either way no sample of it is yielded."""
    a, b = shards / "shard-000001.tar", shards / "shard-000004.tar"
    assert a.stat().st_size == b.stat().st_size
    swap(a, b)
    if with_index:
        swap(a.with_suffix(".idx"), b.with_suffix(".idx"))
        pattern = (r"index \S+shard-00000[14]\.idx: \d+ bytes with sha256 [0-9a-f]{64}, manifest.json says \d+ "
                   r"bytes with [0-9a-f]{64} \(corrupted or replaced\)")
    else:
        pattern = (r"shard \S+shard-00000[14]\.tar: sample 000000000\d+ \(bytes \d+\.\.\d+\) differs from its "
                   r"index digest \(corrupted or replaced\)")
    manifest = read_manifest(shards)
    loader = PretrainingLoader(shards, tokenizer, micro_batch_size=4)
    seen, err = read_until_error(loader)
    assert re.fullmatch(pattern, str(err.value)), str(err.value)
    swapped = shard_indices(manifest, "shard-000001.tar") | shard_indices(manifest, "shard-000004.tar")
    assert not swapped & set(seen)


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


def skipping_loader_over_two_bad_shards(shards, tokenizer, workers: int) -> PretrainingLoader:
    """shard-000005 deleted, bytes 2048..2560 of shard-000002 overwritten; a loader with skip_bad_shards."""
    (shards / "shard-000005.tar").unlink()
    corrupt = shards / "shard-000002.tar"
    data = bytearray(corrupt.read_bytes())
    data[2048:2560] = b"\xff" * 512
    corrupt.write_bytes(bytes(data))
    loader = PretrainingLoader(shards, tokenizer, micro_batch_size=4, num_workers=workers, skip_bad_shards=True)
    assert len(loader.bad_shards) == 1  # the missing one is known up front, the corrupt one when read
    return loader


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_bad_shards_counts_and_skips_only_them(v1_shards, tokenizer, workers):
    shards = v1_shards
    manifest = read_manifest(shards)
    loader = skipping_loader_over_two_bad_shards(shards, tokenizer, workers)
    seen = []
    for b in loader:
        seen += [int(i) for i, e in zip(b["index"], b["epoch"]) if e == 0]
        if loader.position >= loader.num_samples:  # later batches start in epoch 1
            break
    lost = shard_indices(manifest, "shard-000002.tar") | shard_indices(manifest, "shard-000005.tar")
    assert sorted(seen) == sorted(set(range(manifest["num_samples"])) - lost)
    assert set(loader.bad_shards) == {"shard-000002.tar", "shard-000005.tar"}


@pytest.mark.parametrize("workers", [0, 2])
def test_skip_bad_shards_with_index_skips_only_damaged_members(shards, small_shards, tokenizer, workers):
    """Version 2: a reader that meets a damaged member skips its share of that shard; another reader
    (worker) whose members of it are intact still uses them. Every sample used is the intact one."""
    manifest = read_manifest(shards)
    clean = [s for e in manifest["shards"] for s in read_whole_shard(ShardStore(small_shards), e, manifest["dtype"])]
    key, _, _ = damaged_member(shards, "shard-000002.tar", 2048)
    loader = skipping_loader_over_two_bad_shards(shards, tokenizer, workers)
    seen = []
    for b in loader:
        for i, e, ids, attn in zip(b["index"], b["epoch"], b["input_ids"], b["attention_mask"]):
            if e == 0:
                seen.append(int(i))
                assert ids[attn.bool()].tolist() == clean[int(i)].tolist(), f"sample {int(i)} differs"
        if loader.position >= loader.num_samples:  # later batches start in epoch 1
            break
    assert len(seen) == len(set(seen))
    missing = shard_indices(manifest, "shard-000005.tar")
    damaged = shard_indices(manifest, "shard-000002.tar")
    assert int(key) in damaged and int(key) not in seen and not missing & set(seen)
    assert set(range(manifest["num_samples"])) - damaged - missing <= set(seen)  # intact shards: all of them
    if workers == 0:  # one reader: it met the damaged member, so it used none of that shard
        assert not damaged & set(seen)
    assert set(loader.bad_shards) == {"shard-000002.tar", "shard-000005.tar"}
    assert re.fullmatch(rf"shard \S+shard-000002\.tar: sample {key} \(bytes 2048\.\.\d+\) differs from its index "
                        r"digest \(corrupted or replaced\)", loader.bad_shards["shard-000002.tar"])


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
