"""`megakd glue` end to end on the HF export of a tiny ELECTRA run and stand-in GLUE files (every layout's
reader, the official metrics, the MNLI-checkpoint start, the submission, resume)."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from sklearn.metrics import accuracy_score, matthews_corrcoef

from megakd.cli import main
from megakd.glue.config import electra_lr
from megakd.glue.synthetic import write_glue_data
from megakd.glue.tasks import TASKS, read_split

CONFIG = Path(__file__).parents[2] / "configs" / "glue.yaml"
TASK_LIST = ["cola", "stsb", "mnli", "rte"]


def _command(run_dir: Path, model: Path, data: Path, *extra: str) -> list[str]:
    return ["glue", "-c", str(CONFIG), f"model.path={model}", f"glue.data_dir={data}", f"run.dir={run_dir}",
            f"glue.tasks=[{','.join(TASK_LIST)}]", "glue.from_mnli=[rte]", "finetune.seeds=[1,2]",
            "finetune.epochs=1", "glue.long_epochs=2", "finetune.batch_size=8", "finetune.max_seq_len=48",
            "run.progress_bar=false", "run.tensorboard=false", *extra]


@pytest.fixture(scope="module")
def glue_run(tiny_electra_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("glue")
    data = write_glue_data(root / "glue_data", "glue", TASK_LIST, train=16, dev=8, test=6)
    run_dir = root / "run"
    assert main(_command(run_dir, tiny_electra_run / "hf" / "discriminator", data)) == 0
    return run_dir, data, tiny_electra_run / "hf" / "discriminator"


@pytest.mark.slow
def test_results_hold_every_task_seed_and_official_metric(glue_run):
    run_dir, data, _ = glue_run
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
    run_dir, data, _ = glue_run
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
    run_dir, data, model = glue_run
    before = {t: (run_dir / t / "task.json").read_text() for t in TASK_LIST}
    assert main(_command(run_dir, model, data)) == 2  # a used run.dir needs --resume auto
    # CoLA's record and its second seed are gone (a job stopped there): only that seed trains again.
    (run_dir / "cola" / "task.json").unlink()
    shutil.rmtree(run_dir / "cola" / "seed_2")
    kept = {f: f.stat().st_mtime_ns for f in (run_dir / "cola" / "seed_1").rglob("*") if f.is_file()}
    assert main([*_command(run_dir, model, data), "--resume", "auto"]) == 0
    assert {t: (run_dir / t / "task.json").read_text() for t in TASK_LIST} == before  # bit-exact on CPU
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


def test_electra_lr_by_model_size():
    assert [electra_lr(h) for h in (128, 256, 768, 1024)] == [3e-4, 3e-4, 1e-4, 5e-5]
