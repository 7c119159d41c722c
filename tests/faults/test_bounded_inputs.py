"""Fault injection on inputs that claim more than they hold: shard members declaring gigabytes,
compressed shards, manifests with impossible counts or wrong types, model configs whose shapes
disagree with their weights, and files slipped into a verified checkpoint.

Each row runs the real CLI in a fresh process (tests/faults/harness.py) and checks exit code 2,
one error line naming the file and what was expected, no traceback, that nothing the command does
not own changed and, where the row is about memory, the command's peak resident memory.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import shutil
import tarfile
from pathlib import Path

import pytest
import yaml

from megakd.data.shards import MANIFEST
from megakd.models.electra import MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.store.model_dir import save_model_dir
from tests.data.conftest import forge_member, member_spans, unindexed
from tests.faults.harness import megakd, megakd_peak, snapshot
from tests.faults.test_data_faults import first_key, first_shard
from tests.helpers import TINY_SEQ_LEN, TINY_VOCAB, tiny_overrides

GIB = 1 << 30
MEMORY_BOUND = 1 * GIB  # a 2 GiB member or a 60M-row embedding would be far above it
CONFIG = "configs/electra-tiny.yaml"


def one_line_error(out, pattern: str) -> None:
    assert out.code == 2, out.stderr[-2000:]
    assert "Traceback" not in out.stderr, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("megakd: error:")]
    assert len(errors) == 1, out.stderr[-2000:]
    assert re.search(pattern, errors[0]), errors[0]


def edit_manifest(shards: Path, edit) -> None:
    m = json.loads((shards / MANIFEST).read_text())
    edit(m)
    (shards / MANIFEST).write_text(json.dumps(m))


def reseal(shards: Path, name: str) -> None:
    """Make the manifest entry describe the file as it now is (size and sha256)."""
    data = (shards / name).read_bytes()
    edit_manifest(shards, lambda m: next(s for s in m["shards"] if s["file"] == name).update(
        bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))


def sparse_member(name: str, declared: int) -> bytes:
    """A GNU sparse member holding one 512-byte block and declaring `declared` bytes of data."""
    info = tarfile.TarInfo(name)
    info.size, info.type, info.mtime = 512, tarfile.GNUTYPE_SPARSE, 0
    header = bytearray(info.tobuf(tarfile.GNU_FORMAT))
    header[386:398] = b"%011o\0" % (declared - 512)  # first sparse map entry: offset, then length
    header[398:410] = b"%011o\0" % 512
    header[483:495] = b"%011o\0" % declared  # realsize
    header[148:156] = b" " * 8
    header[148:155] = b"%06o\0" % sum(header)
    return bytes(header) + bytes(512)


def huge_regular_member(name: str, declared: int) -> bytes:
    """A plain member header declaring `declared` bytes, followed by one block of them."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime = declared, 0
    return info.tobuf(tarfile.USTAR_FORMAT) + bytes(512)


def same_size(member):
    """Damage: the shard replaced by `member(first sample's name)`, zero-padded to its original size."""
    def damage(shards: Path, name: str) -> None:
        size = (shards / name).stat().st_size
        (shards / name).write_bytes(member(f"{first_sample(shards, name)}.ids.npy").ljust(size, b"\0"))
    return damage


def first_sample(shards: Path, name: str) -> str:
    m = json.loads((shards / MANIFEST).read_text())
    return f"{next(s for s in m['shards'] if s['file'] == name)['first_index']:012d}"


def gzipped(shards: Path, name: str) -> None:
    path = shards / name
    path.write_bytes(gzip.compress(path.read_bytes(), mtime=0))


def gzipped_same_size(shards: Path, name: str) -> None:
    """The gzip-compressed shard zero-padded to the original size (so only its sha256 tells)."""
    path = shards / name
    size = path.stat().st_size
    path.write_bytes(gzip.compress(path.read_bytes(), mtime=0).ljust(size, b"\0"))


def resealed(damage):
    def both(shards: Path, name: str) -> None:
        damage(shards, name)
        reseal(shards, name)
    both.resealed = True
    return both


def forged_first_member(member):
    """Version 2: the shard's first member replaced by `member(its name)`, with its index record and the
    manifest's sizes and sha256s (shard and index) all made to agree: only the parse can refuse it."""
    def damage(shards: Path, name: str) -> None:
        forge_member(shards, name, 0, member(f"{first_sample(shards, name)}.ids.npy"))
    damage.resealed = True
    return damage


def forged_gzip_first_member(shards: Path, name: str) -> None:
    start, end = member_spans(shards, name)[0]
    forge_member(shards, name, 0, gzip.compress((shards / name).read_bytes()[start:end], mtime=0))


forged_gzip_first_member.resealed = True

SHA = r"sha256 [0-9a-f]{64} differs from manifest.json's [0-9a-f]{64} \(corrupted or replaced\)"
SPARSE = same_size(lambda member: sparse_member(member, 2 * GIB))
HUGE = same_size(lambda member: huge_regular_member(member, 2 * GIB))

# (id, damage(shards_dir, first shard's name), error-line pattern with SHARD for that name): version 1.
SHARD_FAULTS = [
    ("sparse-2gib-genuine-manifest", SPARSE,
     rf"shard \S+/SHARD: {SHA}; reading it: member '\d{{12}}.ids.npy' is sparse, expected a plain regular file$"),
    ("sparse-2gib-resealed", resealed(SPARSE),
     r"shard \S+/SHARD: member '\d{12}.ids.npy' is sparse, expected a plain regular file$"),
    ("regular-2gib-resealed", resealed(HUGE),
     r"shard \S+/SHARD: member '\d{12}.ids.npy' declares 2147483648 bytes, more than the shard's \d+ bytes$"),
    ("gzip-genuine-manifest", gzipped,
     r"shard \S+/SHARD: \d+ bytes, manifest.json says \d+ \(truncated or replaced\?\)$"),
    ("gzip-same-size-genuine-manifest", gzipped_same_size,
     rf"shard \S+/SHARD: {SHA}; reading it: unreadable after 0 samples \(ReadError: .*\); expected an "
     r"uncompressed tar$"),
    ("gzip-same-size-resealed", resealed(gzipped_same_size),
     r"shard \S+/SHARD: unreadable after 0 samples \(ReadError: .*\); expected an uncompressed tar$"),
    # Resealed at its compressed size, the manifest itself is refused: that many samples cannot fit.
    ("gzip-resealed", resealed(gzipped),
     r"manifest.json: shard 'SHARD' has samples=\d+, more than its bytes=\d+ can hold"),
]

# The same attacks on version-2 shards (FIRST: the first member's sample key). A damaged member with a
# genuine index fails its digest before it is parsed; with a forged, consistent index it must still be
# refused by the parse (one plain regular member of its own name, no larger than its bytes).
DIGEST = r"sample FIRST \(bytes 0\.\.\d+\) differs from its index digest \(corrupted or replaced\)$"
UNREADABLE = r"shard \S+/SHARD: sample FIRST unreadable \({}\); expected a plain tar member FIRST.ids.npy$"
FORGED_HUGE = forged_first_member(lambda member: huge_regular_member(member, 2 * GIB))
INDEXED_SHARD_FAULTS = [
    ("sparse-2gib-genuine-manifest", SPARSE, rf"shard \S+/SHARD: {DIGEST}"),
    ("sparse-2gib-forged-index", forged_first_member(lambda member: sparse_member(member, 2 * GIB)),
     UNREADABLE.format(r"ValueError: member 'FIRST.ids.npy' of type b'S', 512 bytes")),
    ("regular-2gib-forged-index", FORGED_HUGE,
     UNREADABLE.format(r"ValueError: member 'FIRST.ids.npy' of type b'0', 2147483648 bytes")),
    ("regular-wrong-name-forged-index", forged_first_member(lambda member: huge_regular_member("x" + member, 512)),
     UNREADABLE.format(r"ValueError: member 'xFIRST.ids.npy' of type b'0', 512 bytes")),
    ("gzip-genuine-manifest", gzipped,
     r"shard \S+/SHARD: \d+ bytes, manifest.json says \d+ \(truncated or replaced\?\)$"),
    ("gzip-same-size-genuine-manifest", gzipped_same_size, rf"shard \S+/SHARD: {DIGEST}"),
    ("gzip-member-forged-index", forged_gzip_first_member,
     UNREADABLE.format(r"TruncatedHeaderError: truncated header")),
    ("gzip-resealed", resealed(gzipped),
     r"manifest.json: shard 'SHARD' has samples=\d+, more than its bytes=\d+ can hold"),
]


@pytest.mark.parametrize(("fmt", "damage", "pattern"),
                         [("v1", *f[1:]) for f in SHARD_FAULTS] + [("v2", *f[1:]) for f in INDEXED_SHARD_FAULTS],
                         ids=[f"{f[0]}-v1" for f in SHARD_FAULTS] + [f"{f[0]}-v2" for f in INDEXED_SHARD_FAULTS])
def test_shard_members_are_plain_and_bounded(tiny_data, request, tmp_path, fmt, damage, pattern):
    tokenizer = tiny_data[0]
    shards = tmp_path / "shards"
    shutil.copytree(tiny_data[1], shards)
    if fmt == "v1":
        unindexed(shards)
    name = first_shard(shards)
    pattern = pattern.replace("FIRST", first_key(shards, name))
    damage(shards, name)
    shards_before = snapshot(shards)
    run = tmp_path / "run"
    # A resealed shard changes the data fingerprint, which a resume refuses first: start fresh.
    resume = not getattr(damage, "resealed", False)
    if resume:
        shutil.copytree(request.getfixturevalue("run_with_checkpoint" if fmt == "v2" else "run_with_checkpoint_v1"),
                        run)
    before = snapshot(run / "checkpoints")
    resume_args = ["--resume", "auto", "--allow-change", "data.shards"] if resume else []
    out, peak = megakd_peak("pretrain", "-c", CONFIG, *resume_args,
                            *tiny_overrides((tokenizer, shards), run, **{"train.max_steps": 6,
                                                                        "run.export_hf": "false"}))
    one_line_error(out, pattern.replace("SHARD", re.escape(name)))
    assert peak < MEMORY_BOUND, peak
    assert snapshot(run / "checkpoints") == before
    assert snapshot(shards) == shards_before


def set_first_entry(**fields):
    return lambda m: m["shards"][0].update(fields)


def impossible_count(m: dict) -> None:
    m["shards"][0]["samples"] = 10**12
    m["num_samples"] = sum(s["samples"] for s in m["shards"])
    for before, after in zip(m["shards"], m["shards"][1:]):
        after["first_index"] = before["first_index"] + before["samples"]


# (id, edit(manifest dict), error-line pattern after "<shards>/manifest.json: ", extra overrides).
MANIFEST_FAULTS = [
    ("shards-empty", lambda m: m.update(shards=[]), r"shards=\[\], expected a non-empty list of entries$", {}),
    ("tokenizer-not-a-mapping", lambda m: m.update(tokenizer="x"),
     r"tokenizer='x', expected a mapping with a 'vocab_hash' string$", {}),
    ("num-samples-float", lambda m: m.update(num_samples=float(m["num_samples"])),
     r"num_samples=\d+\.0, expected an integer >= 1$", {}),
    ("first-index-float", set_first_entry(first_index=0.0),
     r"shard entry 'shard-000000.tar' has inconsistent first_index/samples$", {}),
    ("count-beyond-bytes-skip-bad-shards", impossible_count,
     r"shard 'shard-000000.tar' has samples=1000000000000, more than its bytes=\d+ can hold",
     {"data.skip_bad_shards": "true"}),
]


@pytest.mark.parametrize(("edit", "pattern", "extra"), [f[1:] for f in MANIFEST_FAULTS],
                         ids=[f[0] for f in MANIFEST_FAULTS])
def test_bad_manifest_is_refused_before_the_run_dir_is_claimed(tiny_data, tmp_path, edit, pattern, extra):
    shards = tmp_path / "shards"
    shutil.copytree(tiny_data[1], shards)
    edit_manifest(shards, edit)
    shards_before = snapshot(shards)
    run = tmp_path / "run"
    out, peak = megakd_peak("pretrain", "-c", CONFIG,
                            *tiny_overrides((tiny_data[0], shards), run, **{"train.max_steps": 2,
                                                                           "run.export_hf": "false", **extra}))
    one_line_error(out, re.escape(str(shards / MANIFEST)) + ": " + pattern)
    assert peak < MEMORY_BOUND, peak
    assert not run.exists()
    assert snapshot(shards) == shards_before


def test_model_config_checked_against_weight_shapes_before_building(tiny_data, tmp_path):
    """A model.yaml asking for 60M vocabulary rows: refused before anything is built (above the size
    bounds; within them the weights header refuses it, tests/faults/test_edges.py), nothing allocated."""
    config = EncoderConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                           embedding_size=32, max_position_embeddings=TINY_SEQ_LEN).validate()
    src = save_model_dir(MaskedLM(config), "masked_lm", tmp_path / "model",
                         tokenizer_dir=tiny_data[0])
    info = yaml.safe_load((src / "model.yaml").read_text())
    info["encoder"]["vocab_size"] = 60_000_000
    (src / "model.yaml").write_text(yaml.safe_dump(info, sort_keys=False))
    before = snapshot(src)
    out, peak = megakd_peak("convert", "to-hf", str(src), str(tmp_path / "hf"))
    one_line_error(out, rf"{re.escape(str(src / 'model.yaml'))}: model.vocab_size: expected a positive integer up to "
                        r"16777216, got 60000000$")
    assert peak < MEMORY_BOUND, peak
    assert not (tmp_path / "hf").exists()
    assert snapshot(src) == before


def newest_step(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*"))[-1]


def test_unlisted_weights_in_a_checkpoint_are_refused_by_export(run_with_checkpoint, tmp_path):
    """A weights file its manifest does not list (here the joint unit's name, which the reader would
    prefer over the listed per-model files) is refused, never exported."""
    run = tmp_path / "run"
    shutil.copytree(run_with_checkpoint, run)
    step = newest_step(run)
    listed = sorted(step.glob("*.safetensors"))
    assert listed and not (step / "electra.safetensors").exists()
    shutil.copy(listed[0], step / "electra.safetensors")
    before = snapshot(run)
    out = megakd("convert", "to-hf", str(step), str(tmp_path / "hf"))
    one_line_error(out, rf"{re.escape(str(step / 'electra.safetensors'))}: not listed in "
                        rf"{re.escape(str(step / 'manifest.json'))} \(added after the save")
    assert not (tmp_path / "hf").exists()
    assert snapshot(run) == before


@pytest.mark.parametrize("resume", ["auto", "path"])
def test_unlisted_trainer_state_is_refused_on_resume(tiny_data, run_with_checkpoint, tmp_path, resume):
    """An extra trainer_state_rank file would change the world size counted from the checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(run_with_checkpoint, run)
    step = newest_step(run)
    assert len(list(run.glob("checkpoints/step_*"))) == 1
    shutil.copy(step / "trainer_state_rank00000.pt", step / "trainer_state_rank00001.pt")
    before = snapshot(run)
    out = megakd("pretrain", "-c", CONFIG, "--resume", "auto" if resume == "auto" else str(step),
                 *tiny_overrides(tiny_data, run, **{"train.max_steps": 4, "run.export_hf": "false"}))
    extra = re.escape(str(step / "trainer_state_rank00001.pt"))
    if resume == "auto":  # the newest checkpoint fails verification (a warning names the file); none is left
        one_line_error(out, r"checkpoints: no intact checkpoint to resume from")
        assert re.search(rf"{extra}: not listed in \S+manifest.json", out.stderr), out.stderr[-2000:]
    else:
        one_line_error(out, rf"{extra}: not listed in {re.escape(str(step / 'manifest.json'))}")
    assert snapshot(run) == before
