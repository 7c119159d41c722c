"""Fault injection on pretraining data: each damaged shard or manifest → exit code, one-line error
naming the shard (and sample), and no checkpoint written or changed.

Each row copies the tiny shards, damages the copy, and runs `megakd pretrain` in a fresh process
into a run dir that already holds a checkpoint (`--resume auto`), so "nothing lost" is checked on
real state: the run dir's checkpoints are byte-identical afterwards. (A row whose damage changes
the data fingerprint starts a fresh run instead, which must write no checkpoint.)
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from megakd.data.order import epoch_shard_order
from megakd.data.shards import MANIFEST, read_manifest
from tests.data.conftest import forge_member, member_spans, unindexed
from tests.faults.harness import megakd, snapshot
from tests.helpers import TINY_VOCAB, tiny_overrides

TAR_HEADER, NPY_HEADER = 512, 128  # bytes before a shard's first token: tar header, .npy header
SEED = 0


def first_shard(shards: Path) -> str:
    """The shard a one-rank, zero-worker run reads first (so the fault is met in the first step)."""
    m = read_manifest(shards)
    return m["shards"][int(epoch_shard_order(len(m["shards"]), SEED, 0)[0])]["file"]


def edit_manifest(shards: Path, edit) -> None:
    m = json.loads((shards / MANIFEST).read_text())
    edit(m)
    (shards / MANIFEST).write_text(json.dumps(m))


def patch_tokens(shards: Path, name: str, value: bytes, *, reseal: bool) -> None:
    """Overwrite the first sample's second token; `reseal` updates the manifest's sha256 to match
    (a shard written this way, e.g. with another tokenizer, rather than damaged afterwards)."""
    path = shards / name
    data = bytearray(path.read_bytes())
    at = TAR_HEADER + NPY_HEADER + 2
    data[at : at + len(value)] = value
    if reseal and (shards / name).with_suffix(".idx").exists():  # version 2: the index record and its sha256 too
        start, end = member_spans(shards, name)[0]
        forge_member(shards, name, 0, bytes(data[start:end]))
        return
    path.write_bytes(bytes(data))
    if reseal:
        digest = hashlib.sha256(bytes(data)).hexdigest()
        edit_manifest(shards, lambda m: next(s for s in m["shards"] if s["file"] == name).update(sha256=digest))


def reseal_with_id_outside_vocab(shards: Path, name: str) -> None:
    patch_tokens(shards, name, (TINY_VOCAB + 7).to_bytes(2, "little"), reseal=True)


def flip_bit(shards: Path, name: str) -> None:
    path = shards / name
    data = bytearray(path.read_bytes())
    data[TAR_HEADER + NPY_HEADER + 2] ^= 0x01  # a token id changes by one: still a valid id
    path.write_bytes(bytes(data))


def escape_by_symlink(shards: Path, name: str) -> None:
    outside = shards.parent / "elsewhere.tar"
    shutil.copy(shards / name, outside)
    (shards / name).unlink()
    (shards / name).symlink_to(outside)


def set_first_entry(**fields):
    return lambda shards, name: edit_manifest(shards, lambda m: m["shards"][0].update(fields))


def v1(damage):
    """`damage` applied to a version-1 copy (no member index: shards read and checked whole)."""
    def on_unindexed(shards: Path, name: str) -> None:
        damage(unindexed(shards), name)
    on_unindexed.__name__ = f"{damage.__name__}_v1"
    on_unindexed.v1 = True
    return on_unindexed


FIRST_MEMBER = r"sample FIRST \(bytes 0\.\.\d+\) differs from its index digest \(corrupted or replaced\)$"


# (id, damage(shards_dir, first_shard_name), error-line pattern with SHARD for that name). Every row: exit 2.
FAULTS = [
    ("flipped-bit", flip_bit, rf"shard \S+/SHARD: {FIRST_MEMBER}"),
    ("flipped-bit-v1", v1(flip_bit),
     r"shard \S+/SHARD: sha256 [0-9a-f]{64} differs from manifest.json's [0-9a-f]{64} \(corrupted or replaced\)$"),
    ("id-outside-vocab", reseal_with_id_outside_vocab,
     rf"shard \S+/SHARD: sample FIRST has token id {TINY_VOCAB + 7} outside the vocabulary \[0, {TINY_VOCAB}\)$"),
    ("id-outside-vocab-v1", v1(reseal_with_id_outside_vocab),
     rf"shard \S+/SHARD: sample FIRST has token id {TINY_VOCAB + 7} outside the vocabulary \[0, {TINY_VOCAB}\)$"),
    ("seq-len-too-small", lambda s, n: edit_manifest(s, lambda m: m.update(seq_len=16)),
     r"shard \S+/SHARD: sample \d{12} has \d+ tokens, more than manifest.json's seq_len=16$"),
    ("all-zero-sha256", set_first_entry(sha256="0" * 64),
     r"manifest.json: shard 'shard-000000.tar' has sha256='0{64}', expected 64 lowercase hex digits \(not all zero\)$"),
    ("malformed-sha256", set_first_entry(sha256="abc"),
     r"manifest.json: shard 'shard-000000.tar' has sha256='abc', expected 64 lowercase hex digits"),
    ("path-dotdot", set_first_entry(file="../shards/shard-000000.tar"),
     r"manifest.json: shard file '../shards/shard-000000.tar' must be a relative path inside \S+ \(no '..'\)$"),
    ("path-absolute", set_first_entry(file="/etc/hostname"),
     r"manifest.json: shard file '/etc/hostname' must be a relative path inside"),
    ("path-symlink-escape", escape_by_symlink,
     r"manifest.json: shard file 'SHARD' resolves to \S+/elsewhere.tar, outside \S+ \(a symlink leading out"),
    ("seq-len-malformed", lambda s, n: edit_manifest(s, lambda m: m.update(seq_len="64")),
     r"manifest.json: seq_len='64', expected an integer >= 3$"),
]


def damaged_copy(tiny_data, tmp_path: Path, damage) -> tuple[Path, str]:
    """(a copy of the tiny shards with `damage` applied to its first shard, that shard's name)."""
    shards = tmp_path / "shards"
    shutil.copytree(tiny_data[1], shards)
    name = first_shard(shards)
    damage(shards, name)
    return shards, name


def first_key(shards: Path, name: str) -> str:
    """The sample key of the first member of shard `name`."""
    m = read_manifest(shards)
    return f"{next(s for s in m['shards'] if s['file'] == name)['first_index']:012d}"


@pytest.mark.parametrize(("damage", "pattern"), [f[1:] for f in FAULTS], ids=[f[0] for f in FAULTS])
def test_damaged_data_stops_with_one_line_and_loses_nothing(tiny_data, request, tmp_path, damage, pattern):
    tokenizer = tiny_data[0]
    shards, name = damaged_copy(tiny_data, tmp_path, damage)
    run = tmp_path / "run"
    # A resealed shard changes the data fingerprint, which a resume refuses first: start fresh.
    resume = "reseal" not in damage.__name__
    if resume:
        base = "run_with_checkpoint_v1" if getattr(damage, "v1", False) else "run_with_checkpoint"
        shutil.copytree(request.getfixturevalue(base), run)
    before = snapshot(run / "checkpoints")
    # The damaged copy lives at another path: name that change, as a user moving shards would.
    resume_args = ["--resume", "auto", "--allow-change", "data.shards"] if resume else []
    out = megakd("pretrain", "-c", "configs/electra-tiny.yaml", *resume_args,
                 *tiny_overrides((tokenizer, shards), run, **{"train.max_steps": 6, "run.export_hf": "false"}))
    assert out.code == 2, out.stderr
    assert "Traceback" not in out.stderr
    line = out.error_line()
    assert line.startswith("megakd: error: "), out.stderr
    if "FIRST" in pattern:  # (rows that damage the manifest itself leave it unreadable)
        pattern = pattern.replace("FIRST", first_key(shards, name))
    assert re.search(pattern.replace("SHARD", re.escape(name)), line), line
    assert snapshot(run / "checkpoints") == before


@pytest.mark.parametrize("fmt", ["v2", "v1"])
def test_flipped_bit_with_skip_bad_shards_trains_on_and_counts_it(tiny_data, tmp_path, fmt):
    """`data.skip_bad_shards=true`: the mismatch is logged and the shard skipped (by this reader). Version 1:
    the shard is read completely and checked against its sha256 before any of its samples is used;
    version 2: each member is checked against its index digest before it is parsed. Either way none
    of the damaged bytes was trained on."""
    tokenizer = tiny_data[0]
    shards, name = damaged_copy(tiny_data, tmp_path, flip_bit if fmt == "v2" else v1(flip_bit))
    run = tmp_path / "run"
    out = megakd("pretrain", "-c", "configs/electra-tiny.yaml",
                 *tiny_overrides((tokenizer, shards), run, **{"train.max_steps": 2, "run.export_hf": "false",
                                                              "data.skip_bad_shards": "true"}))
    assert out.code == 0, out.stderr
    found = (rf"sample {first_key(shards, name)} \(bytes 0\.\.\d+\) differs from its index digest" if fmt == "v2"
             else r"sha256 .* differs")
    assert re.search(rf"skipping bad shard \(skip_bad_shards=True\): shard \S+/{re.escape(name)}: {found}",
                     out.stderr), out.stderr
    assert (run / "checkpoints" / "step_00000002").is_dir()
