"""`megakd glue` end to end on the HF export of a tiny ELECTRA run and stand-in GLUE files (every layout's
reader, the official metrics, the MNLI-checkpoint start, the submission, resume, what its log says)."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import shutil
import types
import zipfile
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, matthews_corrcoef

from make_glue_data import write_glue_data
from megakd.cli import main
from megakd.finetune import progress
from megakd.glue.config import electra_lr
from megakd.glue.tasks import TASKS, read_split

CONFIG = Path(__file__).parents[2] / "configs" / "glue.yaml"
TASK_LIST = ["cola", "stsb", "mnli", "rte"]


def _command(run_dir: Path, model: Path, data: Path, *extra: str) -> list[str]:
    return ["glue", "-c", str(CONFIG), f"model.path={model}", f"glue.data_dir={data}", f"run.dir={run_dir}",
            f"glue.tasks=[{','.join(TASK_LIST)}]", "glue.from_mnli=[rte]", "finetune.seeds=[1,2]",
            "finetune.epochs=1", "glue.long_epochs=2", "finetune.batch_size=8", "finetune.max_seq_len=48",
            "run.progress_bar=true", "run.tensorboard=false", *extra]


@contextlib.contextmanager
def _megakd_log():
    """The messages megakd logs at INFO and above while the block runs (a module fixture has no caplog)."""
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger, level = logging.getLogger("megakd"), logging.getLogger("megakd").level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _run_lines(said: list[str]) -> list[tuple[str, ...]]:
    """(label, run, runs, task, tasks, steps) of each run's first line."""
    found = [re.fullmatch(r"(.+): run (\d+) of (\d+) \(task (\d+) of (\d+)\), (\d+) steps; .*", m) for m in said]
    return [m.groups() for m in found if m]


@pytest.fixture(scope="module")
def glue_run(tiny_electra_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("glue")
    data = write_glue_data(root / "glue_data", "glue", TASK_LIST, train=16, dev=8, test=6)
    run_dir = root / "run"
    with _megakd_log() as said:
        assert main(_command(run_dir, tiny_electra_run / "hf" / "discriminator", data)) == 0
    return run_dir, data, tiny_electra_run / "hf" / "discriminator", said


@pytest.mark.slow
def test_results_hold_every_task_seed_and_official_metric(glue_run):
    run_dir, data, _, _ = glue_run
    results = json.loads((run_dir / "results.json").read_text())
    assert list(results["tasks"]) == ["mnli", "cola", "stsb", "rte"]  # MNLI first: RTE starts from it
    expected = {"cola": ["mcc"], "stsb": ["pearson", "spearman"], "mnli": ["accuracy_m", "accuracy_mm"],
                "rte": ["accuracy"]}
    for name, record in results["tasks"].items():
        assert list(record["metrics"]) == expected[name]
        assert record["seeds"] == [1, 2] and set(record["per_seed"]) == {"1", "2"}
        for metric, stats in record["metrics"].items():
            values = [record["per_seed"][s][metric] for s in ("1", "2")]
            assert stats["values"] == values and stats["median"] == pytest.approx(np.median(values))
    # Dev metrics against scikit-learn on the saved dev logits of each seed.
    for seed in (1, 2):
        logits = np.load(run_dir / "cola" / f"seed_{seed}" / "dev_logits.npy")
        labels = [e.label for e in read_split(data, TASKS["cola"], "dev")]
        assert results["tasks"]["cola"]["per_seed"][str(seed)]["mcc"] == pytest.approx(
            matthews_corrcoef(labels, logits.argmax(-1)), abs=1e-12)
        logits = np.load(run_dir / "mnli" / f"seed_{seed}" / "dev_logits.npy")
        labels = [e.label for e in read_split(data, TASKS["mnli"], "dev_matched")]
        assert results["tasks"]["mnli"]["per_seed"][str(seed)]["accuracy_m"] == pytest.approx(
            accuracy_score(labels, logits.argmax(-1)))
    assert results["tasks"]["rte"]["init"] == results["tasks"]["mnli"]["submission_model"]
    assert results["tasks"]["rte"]["epochs"] == 2 and results["tasks"]["cola"]["epochs"] == 1
    scores = {t: r["score"]["median"] for t, r in results["tasks"].items()}
    assert results["averages"]["median"]["glue_score"] == pytest.approx(np.mean(list(scores.values())))
    assert not results["complete"] and "not the GLUE score" in (run_dir / "results.md").read_text()


@pytest.mark.slow
def test_submission_is_what_the_server_takes(glue_run):
    run_dir, data, _, _ = glue_run
    with zipfile.ZipFile(run_dir / "submission.zip") as z:
        files = {name: z.read(name).decode().splitlines() for name in z.namelist()}
    assert sorted(files) == ["AX.tsv", "CoLA.tsv", "MNLI-m.tsv", "MNLI-mm.tsv", "RTE.tsv", "STS-B.tsv"]
    for lines in files.values():
        assert lines[0] == "index\tprediction"
        assert [line.split("\t")[0] for line in lines[1:]] == [str(i) for i in range(6)]
    mnli = TASKS["mnli"].labels
    assert all(line.split("\t")[1] in mnli for name in ("MNLI-m.tsv", "MNLI-mm.tsv", "AX.tsv")
               for line in files[name][1:])
    assert all(line.split("\t")[1] in ("entailment", "not_entailment") for line in files["RTE.tsv"][1:])
    assert all(line.split("\t")[1] in ("0", "1") for line in files["CoLA.tsv"][1:])
    assert all(0.0 <= float(line.split("\t")[1]) <= 5.0 for line in files["STS-B.tsv"][1:])


@pytest.mark.slow
def test_resume_reuses_finished_tasks_and_seeds_and_a_used_run_dir_is_refused(glue_run):
    run_dir, data, model, _ = glue_run
    before = {t: (run_dir / t / "task.json").read_text() for t in TASK_LIST}
    assert main(_command(run_dir, model, data)) == 2  # a used run.dir needs --resume auto
    # CoLA's record and its second seed are gone (a job stopped there): only that seed trains again.
    (run_dir / "cola" / "task.json").unlink()
    shutil.rmtree(run_dir / "cola" / "seed_2")
    kept = {f: f.stat().st_mtime_ns for f in (run_dir / "cola" / "seed_1").rglob("*") if f.is_file()}
    with _megakd_log() as said:
        assert main([*_command(run_dir, model, data), "--resume", "auto"]) == 0
    assert {t: (run_dir / t / "task.json").read_text() for t in TASK_LIST} == before  # bit-exact on CPU
    # MNLI's two seeds and CoLA's first count as runs done: the one run trained is the fourth of eight.
    assert _run_lines(said) == [("cola seed 2", "4", "8", "2", "4", "2")]
    assert {f: f.stat().st_mtime_ns for f in (run_dir / "cola" / "seed_1").rglob("*") if f.is_file()} == kept


@pytest.mark.slow
def test_a_list_of_rates_is_chosen_on_a_slice_of_train(tiny_electra_run, tmp_path):
    data = write_glue_data(tmp_path / "glue_data", "glue", ["rte", "cola"], train=16, dev=8, test=6)
    model = tiny_electra_run / "hf" / "discriminator"
    args = [a for a in _command(tmp_path / "run", model, data) if not a.startswith(("glue.tasks", "glue.from_mnli",
                                                                                     "finetune.seeds"))]
    assert main([*args, "glue.tasks=[rte]", "finetune.seeds=[1]", "glue.lr=[3e-4,1e-3]",
                 "finetune.lr_select_frac=0.25", "glue.submission=false"]) == 0
    record = json.loads((tmp_path / "run" / "rte" / "task.json").read_text())
    assert record["lr"]["candidates"] == [3e-4, 1e-3] and record["lr"]["lr"] in (3e-4, 1e-3)
    assert record["lr"]["selection"]["slice_examples"] == 4  # a quarter of the 16 train examples; dev unread
    assert not (tmp_path / "run" / "submission.zip").exists()
    # A task added on --resume auto trains; the finished one is reused; other changes are refused.
    assert main([*args, "glue.tasks=[rte,cola]", "finetune.seeds=[1]", "glue.lr=[3e-4,1e-3]",
                 "finetune.lr_select_frac=0.25", "glue.submission=false", "--resume", "auto"]) == 0
    assert (tmp_path / "run" / "rte" / "task.json").read_text() == json.dumps(record, indent=2) + "\n"
    assert list(json.loads((tmp_path / "run" / "results.json").read_text())["tasks"]) == ["rte", "cola"]
    assert main([*args, "glue.tasks=[rte,cola]", "finetune.seeds=[1]", "glue.lr=[3e-4,1e-3]",
                 "finetune.lr_select_frac=0.5", "glue.submission=false", "--resume", "auto"]) == 2


@pytest.mark.slow
def test_the_log_names_task_and_seed_and_says_the_runs_ahead(glue_run):
    """A GLUE job's log, read as it grows: the plan first, then at each run's start its task and run of how
    many, then progress lines that each name the task and seed (not "task files", not "seed 2" alone)."""
    *_, said = glue_run
    # 16 train examples in batches of 8: 2 steps an epoch; 1 epoch (mnli, cola) or 2 (stsb, rte); 2 seeds each.
    assert "GLUE: 4 tasks (mnli, cola, stsb, rte), 8 fine-tuning runs, 24 optimizer steps in all" in said
    runs = _run_lines(said)
    assert [(label, run, task) for label, run, _, task, *_ in runs] == [
        (f"{name} seed {seed}", str(2 * t + seed), str(t + 1))
        for t, name in enumerate(["mnli", "cola", "stsb", "rte"]) for seed in (1, 2)]
    assert {r[2] for r in runs} == {"8"} and {r[4] for r in runs} == {"4"} and sum(int(r[5]) for r in runs) == 24
    assert all(re.search(r"; about \d+:\d\d:\d\d for it and the \d+ after it", m) for m in said
               if re.search(r": run [2-8] of 8", m))
    progress = [m for m in said if re.search(r": step \d+/\d+ ", m)]
    assert {m.split(": step")[0] for m in progress} == {label for label, *_ in runs}
    assert "task mnli: 16 train examples" in "\n".join(said) and "task files" not in "\n".join(said)


def test_the_time_left_is_the_plan_s_steps_at_the_seconds_per_step_so_far(monkeypatch, caplog):
    """`megakd glue`'s estimate, on a fake clock: the runs before this one trained 30 steps in 60 s (their
    evaluations included), so the 10 + 40 steps left (a resumed run's trained steps not among them) take
    100 s; runs finished before the process count as runs, not as time."""
    now = {"t": 0.0}
    monkeypatch.setattr(progress, "time", types.SimpleNamespace(perf_counter=lambda: now["t"]))
    caplog.set_level(logging.INFO, logger=progress.__name__)
    runs = progress.Trainings([10, 10, 20, 20, 40])
    runs.where = "task 1 of 2"
    runs.reused(10)
    runs.start("cola seed 2", 10)
    now["t"] = 20.0
    runs.start("sst2 seed 1", 20)
    runs.where = "task 2 of 2"
    now["t"] = 60.0
    runs.start("sst2 seed 2", 20, done=10)
    assert [r.getMessage() for r in caplog.records] == [
        "cola seed 2: run 2 of 5 (task 1 of 2), 10 steps; the time left is estimated from the end of the first run on",
        "sst2 seed 1: run 3 of 5 (task 1 of 2), 20 steps; about 0:02:40 for it and the 2 after it (2 s per step so "
        "far)",
        "sst2 seed 2: run 4 of 5 (task 2 of 2), 10 steps (resumed at step 10); about 0:01:40 for it and the 1 after "
        "it (2 s per step so far)"]


def test_electra_lr_by_model_size():
    assert [electra_lr(h) for h in (128, 256, 768, 1024)] == [3e-4, 3e-4, 1e-4, 5e-5]
