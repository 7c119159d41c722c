"""tools/run_fingerprint.py on hand-made run directories: a changed result is a difference, a
wall-clock field or the runs' own location is not."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("run_fingerprint", ROOT / "tools" / "run_fingerprint.py")
fingerprint = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fingerprint)


def make_run(out: Path, *, weight: torch.Tensor, rate: float) -> None:
    """A run directory as a pretraining run leaves one: a checkpoint, metrics and a config naming its dir."""
    run_dir = out / "demo"
    (run_dir / "checkpoints").mkdir(parents=True)
    torch.save({"model": {"w": weight}, "progress": {"step": 2}}, run_dir / "checkpoints" / "state.pt")
    lines = [{"step": 1, "loss": 0.5, "tokens_per_s": rate}, {"step": 2, "probe_acc": 0.75, "probe_seconds": rate}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (run_dir / "config.yaml").write_text(f"run:\n  dir: {run_dir}\n")
    (run_dir / ".lock").write_text(f"pid {int(rate)}\n")


def fingerprint_of(out: Path) -> dict:
    fp = fingerprint.Fingerprinter(out, out / "data")
    return {"inputs": {}, "runs": {"demo": {"args": [fp.text(f"run.dir={out}/demo")], "files": fp.tree(out / "demo")}}}


def test_wall_clock_fields_and_the_runs_location_are_not_differences(tmp_path):
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    make_run(tmp_path / "a", weight=weight, rate=1000.0)
    make_run(tmp_path / "b", weight=weight.clone(), rate=2345.6)
    assert fingerprint.differences(fingerprint_of(tmp_path / "a"), fingerprint_of(tmp_path / "b")) == ([], [])


def test_a_flipped_tensor_element_and_a_new_file_are_differences(tmp_path):
    weight = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    flipped = weight.clone()
    flipped[1, 2] = torch.nextafter(flipped[1, 2], torch.tensor(float("inf")))
    make_run(tmp_path / "a", weight=weight, rate=1000.0)
    make_run(tmp_path / "b", weight=flipped, rate=1000.0)
    (tmp_path / "b" / "demo" / "summary.json").write_text("{}")
    lines, unseeded = fingerprint.differences(fingerprint_of(tmp_path / "a"), fingerprint_of(tmp_path / "b"))
    assert unseeded == []
    assert [line.split(":")[0] for line in lines] == ["demo/checkpoints/state.pt", "demo/summary.json"]
    assert "1 of 2 entries differ; model.w: float32 [2, 3]" in lines[0]
    assert lines[1] == "demo/summary.json: only in B"


def test_compare_exits_1_on_a_difference_and_0_without(tmp_path, capsys):
    weight = torch.zeros(3)
    for name, value in (("a", 0.0), ("b", 0.0), ("c", 1.0)):
        make_run(tmp_path / name, weight=weight + value, rate=1.0)
        header = {"megakd": "megakd/__init__.py", "commit": "0" * 40, "dirty": False, "seconds": 1.0}
        (tmp_path / f"{name}.json").write_text(json.dumps({**header, **fingerprint_of(tmp_path / name)}))
    assert fingerprint.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "identical: 1 runs, 4 files"
    assert fingerprint.main(["compare", str(tmp_path / "a.json"), str(tmp_path / "c.json")]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("demo/checkpoints/state.pt: tensors, 1 of 2")


def test_unseeded_random_streams_are_listed_apart_and_a_seeded_one_is_a_difference(tmp_path):
    for name, python_state, torch_state in (("a", 1, 1), ("b", 2, 1), ("c", 1, 2)):
        make_run(tmp_path / name, weight=torch.zeros(3), rate=1.0)
        torch.save({"rng": {"python": (3, (python_state,) * 625, None), "torch": torch.tensor([torch_state])}},
                   tmp_path / name / "demo" / "checkpoints" / "trainer_state_rank00000.pt")
    a, b, c = (fingerprint_of(tmp_path / name) for name in "abc")
    assert fingerprint.differences(a, b) == ([], ["demo/checkpoints/trainer_state_rank00000.pt"])
    lines, unseeded = fingerprint.differences(a, c)
    assert [line.split(" -> ")[0] for line in lines] == [
        "demo/checkpoints/trainer_state_rank00000.pt: tensors, 1 of 1 entries differ; rng.torch: int64 [1] "
        + fingerprint.digest(torch.tensor([1]).numpy().tobytes())]
    assert unseeded == []
