import filecmp
import gzip
import hashlib
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from megakd.data.shard_reader import read_whole_shard
from megakd.data.shards import MANIFEST, read_manifest, write_shards
from megakd.data.sources import expand_inputs, iter_documents
from megakd.data.storage import ShardStore

from .conftest import corpus_docs, write_jsonl


def all_samples(shards_dir) -> list[np.ndarray]:
    m = read_manifest(shards_dir)
    out = []
    for entry in m["shards"]:
        out.extend(read_whole_shard(ShardStore(shards_dir), entry, m["dtype"]))
    return out


@pytest.fixture(scope="module")
def packed(tokenizer, corpus_jsonl, tmp_path_factory):
    out = tmp_path_factory.mktemp("packed") / "s1"
    manifest = write_shards([corpus_jsonl], tokenizer, 48, out, samples_per_shard=100, min_tokens=5)
    return out, manifest


def test_samples_reassemble_documents_without_crossing_boundaries(packed, tokenizer, corpus_jsonl):
    out, manifest = packed
    samples = all_samples(out)
    assert len(samples) == manifest["num_samples"]
    specials = np.array(sorted(tokenizer.special_ids))
    for s in samples:
        assert 3 <= len(s) <= 48 and s[0] == tokenizer.cls_id and s[-1] == tokenizer.sep_id
        assert not np.isin(s[1:-1], specials).any()
    # Walk documents in order: each one must be exactly its run of consecutive samples' bodies,
    # missing at most a final chunk shorter than min_tokens. So no sample spans two documents.
    k = dropped = 0
    for doc in iter_documents(corpus_jsonl):
        ids = tokenizer.encode(doc)
        pos = 0
        while pos < len(ids) and k < len(samples) and len(ids) - pos >= 5:
            body = samples[k][1:-1].tolist()
            assert body == ids[pos : pos + len(body)], f"sample {k} does not continue its document"
            assert len(body) == 46 or pos + len(body) == len(ids)
            pos += len(body)
            k += 1
        if pos < len(ids):
            assert len(ids) - pos < 5
            dropped += 1
    assert k == len(samples) and dropped == manifest["dropped_chunks"]
    assert manifest["num_samples"] == k and manifest["documents"] == 52
    assert manifest["mean_fill"] == round(sum(map(len, samples)) / (48 * k), 6)


def test_manifest_contents(packed, tokenizer):
    out, m = packed
    assert m == json.loads((out / MANIFEST).read_text())
    assert m["seq_len"] == 48 and m["dtype"] == "uint16"
    assert m["tokenizer"]["vocab_hash"] == tokenizer.vocab_hash and m["tokenizer"]["vocab_size"] == 600
    assert [s["file"] for s in m["shards"]] == [f"shard-{i:06d}.tar" for i in range(len(m["shards"]))]
    assert all(s["samples"] == 100 for s in m["shards"][:-1]) and 0 < m["shards"][-1]["samples"] <= 100
    assert m["version"] == 2 and [s["index"]["file"] for s in m["shards"]] == [
        f"shard-{i:06d}.idx" for i in range(len(m["shards"]))]
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST] + [s["file"] for s in m["shards"]] + [s["index"]["file"] for s in m["shards"]])
    for entry in m["shards"]:  # size and sha256 match the manifest (read_whole_shard checks both)
        read_whole_shard(ShardStore(out), entry, m["dtype"])
        # The index, checked independently of the reader: one 12-byte record per member, in order.
        raw = (out / entry["index"]["file"]).read_bytes()
        assert entry["index"]["bytes"] == len(raw) == 12 * entry["samples"]
        assert entry["index"]["sha256"] == hashlib.sha256(raw).hexdigest()
        data = (out / entry["file"]).read_bytes()
        sizes = [int.from_bytes(raw[k : k + 4], "little") for k in range(0, len(raw), 12)]
        padding = 2 * tarfile.BLOCKSIZE + (-(sum(sizes) + 2 * tarfile.BLOCKSIZE) % tarfile.RECORDSIZE)
        assert sum(sizes) == len(data) - padding and not any(data[sum(sizes):])
        with tarfile.open(out / entry["file"]) as tar:
            infos = tar.getmembers()
        assert [info.offset for info in infos] == [sum(sizes[:k]) for k in range(len(sizes))]
        at = 0
        for k, size in enumerate(sizes):
            member = data[at : at + size]
            assert member[:tarfile.BLOCKSIZE] == infos[k].tobuf(tarfile.USTAR_FORMAT)  # this member's header
            assert size == tarfile.BLOCKSIZE + -(-infos[k].size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            assert raw[12 * k + 4 : 12 * k + 12] == hashlib.sha256(member).digest()[:8]
            at += size


@pytest.mark.parametrize("workers", [2, 3])
def test_parallel_writing_is_byte_identical(packed, tokenizer, corpus_jsonl, tmp_path, workers):
    out, _ = packed
    other = tmp_path / "par"
    write_shards([corpus_jsonl], tokenizer, 48, other, samples_per_shard=100, min_tokens=5, num_workers=workers)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in other.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(out, other, names, shallow=False)
    assert mismatch == [] and errors == [] and len(match) == len(names)


def test_text_documents_split_on_two_blank_lines(tmp_path):
    path = tmp_path / "a.txt.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n\nfirst line\nsame doc\n\nnew paragraph, same doc\n\n\nsecond doc\n \n\t\n\nthird doc\n")
    assert list(iter_documents(path)) == [
        "first line\nsame doc\n\nnew paragraph, same doc", "second doc", "third doc"]


def test_inputs_txt_jsonl_and_hf_dataset_agree(tokenizer, tmp_path):
    datasets = pytest.importorskip("datasets")
    docs = corpus_docs(0, 4)  # KJV passages: no blank lines inside, so the .txt rule keeps them whole
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("\n\n\n".join(docs))
    write_jsonl(tmp_path / "b.jsonl", docs)
    datasets.Dataset.from_dict({"body": docs}).save_to_disk(str(tmp_path / "hf"))
    assert expand_inputs([tmp_path / "hf"]) == [tmp_path / "hf"]
    m_txt = write_shards([tmp_path / "t"], tokenizer, 64, tmp_path / "o1")
    m_jsonl = write_shards([tmp_path / "b.jsonl"], tokenizer, 64, tmp_path / "o2")
    m_hf = write_shards([tmp_path / "hf"], tokenizer, 64, tmp_path / "o3", text_field="body")
    assert m_txt["documents"] == m_jsonl["documents"] == m_hf["documents"] == 4
    assert m_txt["shards"][0]["sha256"] == m_jsonl["shards"][0]["sha256"] == m_hf["shards"][0]["sha256"]


def test_uint32_tokens_for_large_vocabularies():
    from megakd.data.shards import token_dtype

    assert token_dtype(65536) == np.uint16 and token_dtype(128_000) == np.uint32


def test_the_docs_webdataset_example_reads_what_megakd_reads(tiny_data):
    """docs/data.md's example, run as written on real shards: a reader outside megakd gets every sample, keyed
    by its global index, as the uint16 array megakd's own reader returns, in the same order."""
    shards = tiny_data[1]
    section = (Path(__file__).parents[2] / "docs" / "data.md").read_text().split("### The shard layout")[1]
    example = section.split("```python\n")[1].split("```")[0]
    assert "data/shards512" in example
    printed = []
    exec(example.replace("data/shards512", str(shards)), {"print": lambda *args: printed.append(args)})
    want = all_samples(shards)
    assert len(read_manifest(shards)["shards"]) > 1 and read_manifest(shards)["dtype"] == "uint16"
    assert [key for key, _ in printed] == [f"{i:012d}" for i in range(len(want))]
    for (key, ids), ref in zip(printed, want):
        assert ids.dtype == np.uint16 and np.array_equal(ids, ref), key


def test_shards_are_standard_tar_files(packed):
    """Our hand-built headers must be exactly what Python's tarfile writes for the same members."""
    import io
    import tarfile

    out, m = packed
    path = out / m["shards"][1]["file"]
    with tarfile.open(path) as tar:
        members = [(info.name, tar.extractfile(info).read()) for info in tar.getmembers()]
    assert [name for name, _ in members] == [f"{i:012d}.ids.npy" for i in range(100, 200)]
    assert all(np.load(io.BytesIO(data)).dtype == np.uint16 for _, data in members)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    assert buf.getvalue() == path.read_bytes()
