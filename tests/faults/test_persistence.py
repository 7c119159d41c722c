"""Fault injection for what megakd stores: run-dir ownership, checkpoints, resume, safe loading.

Every case runs the real CLI in a fresh process (tests/faults/harness.py) on the tiny data and
checks the exit code, that the error is one line naming the file or key, and (for refusals) that
the run directory is byte-identical afterwards. A shared 6-step run (checkpoints at steps 2, 4
and 6) is the uninterrupted reference: a run that falls back from a damaged checkpoint must end
with exactly its metrics and weights.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from megakd.cli import main
from megakd.config import load_config
from megakd.engine.optim import lr_multiplier
from megakd.store.checkpoint import write_manifest
from tests.faults.harness import REPO, megakd, snapshot
from tests.finetune.test_distributed import tiny_finetune
from tests.helpers import tiny_overrides

CONFIG = REPO / "configs" / "electra-tiny.yaml"
BASE = {"train.max_steps": 6, "run.save_every": 2, "run.keep_last": 3, "run.export_hf": "false"}
STEPS = ("step_00000002", "step_00000004", "step_00000006")


def _args(tiny_data, run: Path, **extra) -> list[str]:
    return ["-c", str(CONFIG), *tiny_overrides(tiny_data, run, **{**BASE, **extra})]


def pretrain(tiny_data, run: Path, *flags: str, **extra):
    return megakd("pretrain", *flags, *_args(tiny_data, run, **extra))


@pytest.fixture(scope="module")
def base_run(tiny_data, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("faults") / "base"
    assert main(["pretrain", *_args(tiny_data, run)]) == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == list(STEPS)
    return run


@pytest.fixture
def run_copy(base_run, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    return run


def metrics_without_speed(run: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    step = run / "checkpoints" / STEPS[-1]
    return {f"{f.name}:{k}": v for f in sorted(step.glob("*.safetensors")) for k, v in load_file(f).items()}


def assert_same_as_base(run: Path, base: Path) -> None:
    assert metrics_without_speed(run) == metrics_without_speed(base)
    a, b = final_weights(run), final_weights(base)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_one_line_error(out, *fragments: str) -> str:
    assert out.code == 2, out.stderr[-2000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("megakd: error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


# -- pickle payloads ------------------------------------------------------------------------------

class Payload:
    """Unpickling this creates `marker`: proof that a loader ran code from a file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write_payload(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"state": Payload(marker)}, path)


def _reseal(step_dir: Path) -> None:
    """An attacker who can write the files can write the manifest too: safety must not rest on it."""
    write_manifest(step_dir, int(step_dir.name.split("_")[1]))


# -- refusals: exit 2, one line, run dir untouched -------------------------------------------------

def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


REFUSALS = {
    # fault: (prepare(run, marker) -> extra CLI flags, overrides, fragments of the error line)
    "reused run dir without --resume": (
        lambda run, marker: [], {}, ["already holds a run", "--resume auto", "run.overwrite=true"]),
    "state-bearing keys changed at resume": (
        lambda run, marker: ["--resume", "auto"],
        {"optim.discriminator.lr": 1e-3, "train.global_batch_size": 16},
        ["optim.discriminator.lr: 0.003 -> 0.001", "train.global_batch_size: 8 -> 16",
         "--allow-change optim.discriminator.lr --allow-change train.global_batch_size"]),
    "model shape changed even when named": (
        lambda run, marker: ["--resume", "auto", "--allow-change", "model.discriminator.hidden_size"],
        {"model.discriminator.hidden_size": 64},
        ["cannot resume with a different model.discriminator.hidden_size: 48 -> 64"]),
    "--allow-change of a key that does not exist": (
        lambda run, marker: ["--resume", "auto", "--allow-change", "optim.discriminator.lrr"], {},
        ["--allow-change optim.discriminator.lrr: not a config key"]),
    "explicit checkpoint with a flipped byte": (
        lambda run, marker: (_flip_byte(run / "checkpoints" / STEPS[1] / "discriminator.safetensors"),
                             ["--resume", str(run / "checkpoints" / STEPS[1])])[1], {},
        ["discriminator.safetensors: sha256 differs from the manifest"]),
    "pickle payload in the trainer state (--resume PATH)": (
        lambda run, marker: (write_payload(run / "checkpoints" / STEPS[1] / "trainer_state_rank00000.pt", marker),
                             _reseal(run / "checkpoints" / STEPS[1]),
                             ["--resume", str(run / "checkpoints" / STEPS[1])])[2], {},
        ["trainer_state_rank00000.pt: cannot read as a weights-only torch file"]),
    "pickle payload in the optimizer state (--resume auto)": (
        lambda run, marker: (write_payload(run / "checkpoints" / STEPS[2] / "generator.optim.pt", marker),
                             _reseal(run / "checkpoints" / STEPS[2]), ["--resume", "auto"])[2], {},
        ["generator.optim.pt: cannot read as a weights-only torch file"]),
}


@pytest.mark.parametrize("fault", list(REFUSALS))
def test_refused_with_one_line_and_nothing_changed(fault, tiny_data, run_copy, tmp_path):
    prepare, overrides, fragments = REFUSALS[fault]
    marker = tmp_path / "marker"
    flags = prepare(run_copy, marker)
    before = snapshot(run_copy)
    out = pretrain(tiny_data, run_copy, *flags, **overrides)
    assert_one_line_error(out, *fragments)
    assert snapshot(run_copy) == before
    assert not marker.exists()
    assert not list(run_copy.parent.glob("run.old-*"))


# -- recoverable damage: fall back, say so, end exactly like the uninterrupted run --------------------

def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "flipped byte in weights": ("discriminator.safetensors", _flip_byte, "sha256 differs from the manifest"),
    "truncated trainer state": ("trainer_state_rank00000.pt", _truncate, "the manifest says"),
    "empty optimizer state": ("generator.optim.pt", lambda p: p.write_bytes(b""), "0 bytes, the manifest says"),
    "missing manifest": ("manifest.json", Path.unlink, "manifest.json: missing"),
}


@pytest.mark.slow
@pytest.mark.parametrize("fault", list(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_and_matches(fault, tiny_data, base_run, run_copy):
    name, damage, reason = DAMAGE[fault]
    damage(run_copy / "checkpoints" / STEPS[2] / name)
    out = pretrain(tiny_data, run_copy, "--resume", "auto")
    assert out.code == 0, out.stderr[-2000:]
    warning = next(ln for ln in out.stderr.splitlines() if "is damaged" in ln)
    assert STEPS[2] in warning and name in warning and reason in warning
    assert f"resumed from {run_copy / 'checkpoints' / STEPS[1]} at step 4" in out.stderr
    assert_same_as_base(run_copy, base_run)


@pytest.mark.slow
def test_every_checkpoint_damaged_is_refused(tiny_data, run_copy):
    for step in STEPS:
        _flip_byte(run_copy / "checkpoints" / step / "generator.safetensors")
    before = snapshot(run_copy)
    assert_one_line_error(pretrain(tiny_data, run_copy, "--resume", "auto"), "no intact checkpoint to resume from")
    assert snapshot(run_copy) == before


@pytest.mark.slow
def test_stale_temp_dir_and_torn_metrics_line_are_repaired(tiny_data, base_run, run_copy):
    stale = run_copy / "checkpoints" / ".tmp-step_00000008"
    stale.mkdir()
    (stale / "generator.safetensors").write_bytes(b"half a file")
    with (run_copy / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "gen_lo')
    out = pretrain(tiny_data, run_copy, "--resume", "auto")
    assert out.code == 0, out.stderr[-2000:]
    assert not stale.exists() and ".tmp-step_00000008" in out.stderr
    assert "torn last line" in out.stderr
    assert (run_copy / "metrics.jsonl").read_text() == (base_run / "metrics.jsonl").read_text()


# -- ownership ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_overwrite_moves_the_old_run_aside(tiny_data, base_run, run_copy):
    before = snapshot(run_copy)
    out = pretrain(tiny_data, run_copy, **{"run.overwrite": "true", "train.max_steps": 2})
    assert out.code == 0, out.stderr[-2000:]
    (aside,) = run_copy.parent.glob("run.old-*")
    moved = snapshot(aside)
    assert moved == {k: v for k, v in before.items() if k != ".lock"}  # every old file, byte for byte
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["step_00000002"]
    assert [r["step"] for r in metrics_without_speed(run_copy)] == [1, 2]


@pytest.mark.slow
def test_second_job_on_a_locked_run_dir_stops_at_once(tiny_data, tmp_path):
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "megakd.cli", "pretrain",
                              *_args(tiny_data, run, **{"train.max_steps": 100000, "run.save_every": 0})],
                             cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (run / "metrics.jsonl").exists():
            assert first.poll() is None and time.time() < deadline
            time.sleep(0.2)
        before = {k: v for k, v in snapshot(run / "checkpoints").items()}
        out = pretrain(tiny_data, run, "--resume", "auto")
        assert_one_line_error(out, f"{run}: in use by another megakd job", f"pid {first.pid}")
        assert snapshot(run / "checkpoints") == before
    finally:
        first.kill()
        first.wait()


# -- config changes that are named take effect ------------------------------------------------------

@pytest.mark.slow
def test_allowed_lr_change_takes_effect_and_is_recorded(tiny_data, base_run, run_copy):
    out = pretrain(tiny_data, run_copy, "--resume", "auto", "--allow-change", "optim.discriminator.lr",
                   **{"optim.discriminator.lr": 1e-3, "train.max_steps": 8})
    assert out.code == 0, out.stderr[-2000:]
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, run_copy, **{**BASE, "train.max_steps": 8}))
    rows = {r["step"]: r for r in metrics_without_speed(run_copy)}
    for step in (7, 8):  # the LR logged after step s is the schedule at step s, from the peak in force
        multiplier = lr_multiplier(step, cfg.optim.schedule, 8)
        assert rows[step]["lr_discriminator"] == pytest.approx(1e-3 * multiplier, rel=1e-12)
        assert rows[step]["lr_generator"] == pytest.approx(2e-3 * multiplier, rel=1e-12)
    assert metrics_without_speed(run_copy)[:6] == metrics_without_speed(base_run)
    history = (run_copy / "config_history" / "step_00000006.yaml").read_text()
    assert "applied_until_step: 6" in history and "lr: 0.003" in history
    assert "lr: 0.001" in (run_copy / "config.yaml").read_text()


@pytest.mark.slow
def test_steering_keys_change_freely(tiny_data, base_run, run_copy):
    out = pretrain(tiny_data, run_copy, "--resume", "auto",
                   **{"train.log_every": 3, "run.save_every": 0, "run.keep_last": 1})
    assert out.code == 0, out.stderr[-2000:]
    assert not (run_copy / "config_history").exists()
    assert yaml.safe_load((run_copy / "config.yaml").read_text())["train"]["log_every"] == 3


# -- pickle payloads at every other entry point ------------------------------------------------------

def _deepspeed_layout_with_payload(base_run: Path, tmp_path: Path, marker: Path) -> Path:
    """A checkpoint whose generator state is a DeepSpeed directory holding a pickle payload."""
    step = tmp_path / "step_00000006"
    shutil.copytree(base_run / "checkpoints" / STEPS[2], step)
    for name in ("generator.safetensors", "generator.optim.pt"):
        (step / name).unlink()
    write_payload(step / "generator" / "ds" / "mp_rank_00_model_states.pt", marker)
    _reseal(step)
    return step


def _model_dir_with_payload(base_run: Path, tmp_path: Path, marker: Path) -> Path:
    from megakd.store.checkpoint_models import load_checkpoint
    from megakd.store.model_dir import save_model_dir

    ckpt = load_checkpoint(base_run / "checkpoints" / STEPS[2])
    out = save_model_dir(ckpt.generator, "masked_lm", tmp_path / "mlm", tokenizer_dir=ckpt.tokenizer_dir)
    (out / "model.safetensors").write_bytes(pickle.dumps(Payload(marker)))
    return out


def _hf_dir_with_payload(base_run: Path, tmp_path: Path, marker: Path) -> Path:
    from megakd.convert import to_hf

    out = tmp_path / "hf"
    to_hf(base_run, out)
    (out / "generator" / "model.safetensors").unlink()
    write_payload(out / "generator" / "pytorch_model.bin", marker)
    return out / "generator"


def _classifier_with_payload(base_run: Path, tmp_path: Path, marker: Path) -> Path:
    from megakd.data.tokenizer import Tokenizer
    from megakd.models.electra import SequenceClassifier
    from megakd.store.checkpoint_models import load_checkpoint
    from megakd.store.model_dir import save_classifier

    ckpt = load_checkpoint(base_run / "checkpoints" / STEPS[2])
    out = save_classifier(SequenceClassifier(ckpt.discriminator.config, 2), Tokenizer.load(ckpt.tokenizer_dir),
                          tmp_path / "clf")
    (out / "model.safetensors").write_bytes(pickle.dumps(Payload(marker)))
    return out


ENTRY_POINTS = {
    # entry point: (build the poisoned source, command line, fragments of the error line)
    "convert to-hf (DeepSpeed state)": (
        _deepspeed_layout_with_payload,
        lambda src, tiny_data, tmp: ["convert", "to-hf", str(src), str(tmp / "out")],
        ["mp_rank_00_model_states.pt: cannot read as a weights-only torch file"]),
    "distill.teacher= (HF pytorch_model.bin)": (
        _hf_dir_with_payload,
        lambda src, tiny_data, tmp: ["distill", "-c", str(REPO / "configs" / "dwt-tiny.yaml"),
                                     *tiny_overrides(tiny_data, tmp / "dwt", **{"distill.teacher": str(src)})],
        ["distill.teacher", "cannot load the ElectraForMaskedLM weights"]),
    "eval-rtd --generator (model dir)": (
        _model_dir_with_payload,
        lambda src, tiny_data, tmp: ["eval-rtd", "--generator", str(src), "--discriminator", str(src),
                                     "--shards", str(tiny_data[1])],
        ["--generator", "model.safetensors"]),
    "finetune model.path= (classifier dir)": (
        _classifier_with_payload,
        lambda src, tiny_data, tmp: ["finetune", "-c", str(REPO / "configs" / "finetune-rt.yaml"),
                                     f"run.dir={tmp / 'ft'}", f"model.path={src}", "run.progress_bar=false"],
        ["model.path", "model.safetensors: cannot load"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_pickle_payload_never_runs(entry, tiny_data, base_run, tmp_path):
    build, command, fragments = ENTRY_POINTS[entry]
    marker = tmp_path / "marker"
    src = build(base_run, tmp_path, marker)
    assert not marker.exists()
    before = snapshot(src)
    out = megakd(*command(src, tiny_data, tmp_path))
    assert_one_line_error(out, *fragments)
    assert not marker.exists()
    assert snapshot(src) == before


# -- a full disk ------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    """mount(name, size) -> a fresh tmpfs of `size` under tmp_path (needs root), unmounted at the end."""
    mounted = []

    def mount(name: str = "disk", size: str = "160k") -> Path:
        path = tmp_path / name
        path.mkdir()
        if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size={size} tmpfs {path} 2>/dev/null") != 0:
            pytest.skip("mounting a tmpfs needs root")
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        os.system(f"umount {path}")


@pytest.fixture
def tiny_disk(small_disk):
    """A 160 KiB tmpfs: room for config and metrics, not for a checkpoint (needs root to mount)."""
    return small_disk()


@pytest.mark.slow
def test_disk_full_during_save_names_the_directory_and_cleans_up(tiny_data, tiny_disk):
    run = tiny_disk / "run"
    out = pretrain(tiny_data, run, **{"train.max_steps": 2, "run.save_every": 1})
    line = assert_one_line_error(out, f"{run / 'checkpoints'}: no space left on device while saving step 1",
                                 "written", "older checkpoints are intact")
    assert "KiB" in line or " B " in line
    assert not any((run / "checkpoints").iterdir())  # the partial checkpoint is gone
    assert (run / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_finetune_disk_full_during_save_is_the_same_one_line_and_cleans_up(tiny_data, small_disk):
    """Fine-tuning saves through the same run session as pretraining: a full disk while writing a
    seed's checkpoint ends the command with the same one line, and no partial checkpoint stays."""
    disk = small_disk(size="96k")
    run = disk / "run"
    out = megakd(*tiny_finetune(tiny_data[0], run, "finetune.lr=1e-3"))
    line = assert_one_line_error(out, f"{run / 'seed_0' / 'checkpoints'}: no space left on device while saving step",
                                 "the partial checkpoint was removed, older checkpoints are intact")
    assert "written" in line
    assert not list((run / "seed_0" / "checkpoints").glob(".tmp-*"))


def test_disk_full_at_the_locks_first_write_is_one_line_and_starts_nothing(tiny_data, tiny_disk):
    """The lock file is created empty (an inode, no page); recording the holder is the first byte
    the run writes. On a full disk that is one line, and the dir is left as it was (the lock the
    refused start created is removed)."""
    run = tiny_disk / "run"
    run.mkdir()
    _fill(tiny_disk, 0)
    out = pretrain(tiny_data, run, **{"train.max_steps": 2})
    assert_one_line_error(out, f"{run / '.lock'}: no space left on device while recording this job",
                          "nothing else was written")
    assert list(run.iterdir()) == []
    (tiny_disk / "filler").unlink()  # room again (and for a checkpoint): the same command runs
    assert os.system(f"mount -o remount,size=4m {tiny_disk}") == 0
    out = pretrain(tiny_data, run, **{"train.max_steps": 2})
    assert out.code == 0, out.stderr[-2000:]


# Where else a full disk can strike a run: each writes into the run directory on a 160 KiB tmpfs whose
# `checkpoints/` is a link to a roomy disk, so the write named here is the first to fail. A filler file
# sizes the free space (tmpfs counts whole 4 KiB pages: .lock and config.yaml take one each).

def _fill(disk: Path, leave: int) -> None:
    st = os.statvfs(disk)
    (disk / "filler").write_bytes(b"x" * max(0, st.f_bavail * st.f_frsize - leave))


def _run_two_steps_then_fill(tiny_data, run: Path, disk: Path, **extra) -> None:
    assert pretrain(tiny_data, run, "--resume", "auto", **{"train.max_steps": 2, "run.save_every": 2}).code == 0
    _fill(disk, 0)


DISK_FULL = {
    # case: (prepare(tiny_data, run, disk), flags, overrides, fragments of the error line after the path)
    "metrics.jsonl append": (
        lambda data, run, disk: _fill(disk, 3 * 4096), ["--resume", "auto"],
        {"train.max_steps": 16, "run.save_every": 4},
        ("metrics.jsonl", "no space left on device while appending the", "stopped without saving",
         "--resume auto")),
    "TensorBoard event file (on by default)": (
        lambda data, run, disk: _fill(disk, 4 * 4096), ["--resume", "auto"],
        {"train.max_steps": 16, "run.save_every": 4, "run.tensorboard": "true"},
        ("tb/events.out.tfevents.", "no space left on device while writing the events of step",
         "stopped without saving")),
    "config_history/ at a resume with a changed key": (
        _run_two_steps_then_fill, ["--resume", "auto", "--allow-change", "optim.discriminator.lr"],
        {"train.max_steps": 4, "optim.discriminator.lr": 1e-3},
        ("config_history/step_00000002.yaml", "no space left on device while keeping the config",
         "nothing was changed")),
    "end-of-run HF export": (
        lambda data, run, disk: _fill(disk, 3 * 4096), ["--resume", "auto"],
        {"train.max_steps": 2, "run.save_every": 2, "run.export_hf": "true"},
        ("/hf: no space left on device while writing the HuggingFace export", "needed",
         "the partial export was removed")),
}


def _steps(run: Path) -> list[int]:
    text = (run / "metrics.jsonl").read_text()
    assert text == "" or text.endswith("\n"), "a torn last metrics line"
    return [r["step"] for r in metrics_without_speed(run)]  # every line whole JSON


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DISK_FULL))
def test_disk_full_elsewhere_stops_with_one_line_and_resumes(case, tiny_data, small_disk, tmp_path):
    from megakd.store import checkpoint

    prepare, flags, overrides, fragments = DISK_FULL[case]
    disk, roomy = small_disk(), tmp_path / "checkpoints"
    run = disk / "run"
    roomy.mkdir()
    run.mkdir()
    (run / "checkpoints").symlink_to(roomy)
    prepare(tiny_data, run, disk)
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"}
    saved_before = {p.name: snapshot(p) for p in roomy.iterdir()}

    out = pretrain(tiny_data, run, *flags, **overrides)
    line = assert_one_line_error(out, str(run), *fragments)
    leftovers = [p.name for p in run.rglob("*") if ".partial-" in p.name or p.name.endswith(".tmp")]
    assert not leftovers, leftovers
    assert not (run / "hf").exists() and not (run / "config_history").exists()
    steps = _steps(run)
    assert steps == list(range(1, len(steps) + 1)), steps  # earlier lines intact, none torn or repeated
    for name, files in saved_before.items():  # checkpoints saved before this command are untouched
        assert snapshot(roomy / name) == files
    for ckpt in checkpoint.list_checkpoints(run):
        checkpoint.verify(ckpt)
    if "config_history" in case:  # refused before anything was written
        assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".lock"} == before
    elif "metrics" in case or "TensorBoard" in case:
        newest = checkpoint.step_of(checkpoint.list_checkpoints(run)[-1])
        assert len(steps) >= newest and f"step {steps[-1] + ('metrics' in case)}" in line

    (disk / "filler").unlink()  # space freed (and the disk grown, for the export): the same command continues
    assert os.system(f"mount -o remount,size=4m {disk}") == 0
    out = pretrain(tiny_data, run, *flags, **overrides)
    assert out.code == 0, out.stderr[-2000:]
    assert _steps(run) == list(range(1, overrides["train.max_steps"] + 1))
    if "export" in case:
        assert (run / "hf" / "discriminator" / "config.json").is_file()
    if "config_history" in case:
        assert "applied_until_step: 2" in (run / "config_history" / "step_00000002.yaml").read_text()
