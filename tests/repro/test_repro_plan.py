"""The report's budget and how its jobs are scheduled: the plan (`megakd repro NAME --plan`), the scheduler
it simulates, and the pretraining cache's lock under several processes."""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from pathlib import Path

import pytest

from megakd.cli import main
from megakd.repro import FINDINGS, plan_findings
from megakd.repro.costs import Costs, plan
from megakd.repro.jobs import Job
from megakd.repro.labelreg import FULL as FULL_LABELREG
from megakd.repro.runner import execute
from megakd.repro.settings import FULL_FINETUNE, PRETRAIN_RECIPE, QUICK_PRETRAIN, RT_TRAIN_SENTENCES
from megakd.repro.training import _locked, cached_run_dir, pretrain

# The whole report on 2 cores (docs/recipes.md, Budget): 532 min planned at --jobs 2 once gen_size and
# electra_vs_mlm (issue 63, each planned under two hours alone) joined the six findings of 342 min.
BUDGET_MINUTES = 540


def test_full_report_fits_the_budget_on_two_cores(tmp_path):
    """`megakd repro all` (full mode, 2 jobs at a time) at the default unit costs: raising a finding's steps,
    seeds or sentences past the budget fails here."""
    full = plan_findings(list(FINDINGS), tmp_path / "work", workers=2)
    assert full.minutes <= BUDGET_MINUTES
    one_at_a_time = plan_findings(list(FINDINGS), tmp_path / "work", workers=1)
    work = sum(job.seconds for job in one_at_a_time.jobs.values()) / 60
    assert one_at_a_time.minutes == pytest.approx(work)  # one worker: the plan is the sum of the jobs
    assert full.minutes >= work / 2  # two workers at best halve it
    assert not (tmp_path / "work").exists()  # planning runs and writes nothing


def test_plan_counts_a_finding_from_its_steps_seeds_and_sentences(tmp_path):
    """disc_lr: 4 ratios x 2 draws = 8 pretraining runs of 1,200 electra-mini steps, 8 fine-tuning runs of 3
    seeds x 3 epochs on 3,000 sentences, each job plus its start-up."""
    costs = Costs(electra_mini_step=0.5, rt_epoch=60.0, job_start=7.0)
    work, _ = plan_findings(["disc_lr"], tmp_path, workers=1, costs=costs).finding_minutes("disc_lr")
    assert "task.max_train_examples=3000" in FULL_FINETUNE
    expected = 8 * (7.0 + 1200 * 0.5) + 8 * (7.0 + 60.0 * 3000 / RT_TRAIN_SENTENCES * 3 * 3)
    assert work * 60 == pytest.approx(expected)
    # the shared encoders are one job each when two findings use them: two draws of the teacher's encoder
    # (the recipe as it stands) and the smaller student's architecture (draw 0); labelreg pretrains its own
    # masked LMs, teacher and student in two draws each
    shared = plan_findings(["soteacher", "labelreg", "tgt"], tmp_path, workers=1, costs=costs)
    encoder = f"pretrain:{cached_run_dir(PRETRAIN_RECIPE, [], tmp_path).name}"
    assert encoder in shared.jobs and shared.jobs[encoder].seconds == pytest.approx(7.0 + 5000 * 0.5)
    pretraining = [job for key, job in shared.jobs.items() if key.startswith("pretrain:")]
    electra = [job for job in pretraining if "electra-mini.yaml" in job.label]
    assert len(electra) == 3 and sum("model.discriminator.hidden_size=64" in job.label for job in electra) == 1
    masked_lm = [job for job in pretraining if "bert-mini-long.yaml" in job.label]
    assert len(pretraining) == 7 and len(masked_lm) == 4 and {job.finding for job in masked_lm} == {"labelreg"}
    assert sum("train.seed=1" in job.label for job in masked_lm) == 2


def test_a_teachers_forward_is_priced_at_the_teachers_size(tmp_path):
    """labelreg's KD student costs its plain fine-tuning plus the teacher's forward pass (1/3 of a training
    step) on every seed, at the teacher's size: the larger shared encoder, whose own one-seed fine-tuning
    is in the plan too."""
    costs = Costs(electra_mini_step=0.5, rt_epoch=60.0, job_start=7.0)
    jobs = plan_findings(["labelreg"], tmp_path, workers=1, costs=costs).jobs
    pretrained = [job for job in jobs.values() if "model.init=pretrained" in job.label]
    kd = [job for job in pretrained if "labelreg.target=kd" in job.label]
    assert len(kd) == 2  # one per draw
    for job in kd:
        student, teacher = job.after
        [plain] = [j for j in pretrained if j.after == (student,) and "labelreg.target=onehot" in j.label]
        seeds = len(FULL_LABELREG.seeds)
        assert job.seconds - plain.seconds == pytest.approx(seeds * (jobs[teacher].seconds - costs.job_start) / 3)
        assert jobs[teacher].seconds > (plain.seconds - costs.job_start) / seeds + costs.job_start  # a larger model


def _job(key: str, seconds: float, after: tuple[str, ...] = (), fn=None) -> Job:
    return Job(key, "test", key, fn, (), seconds, after)


def test_schedule_takes_the_critical_path_first_and_respects_dependencies():
    jobs = {j.key: j for j in (_job("a", 10), _job("b", 5, ("a",)), _job("c", 8), _job("d", 7))}
    two = plan(jobs, workers=2)
    # a (path 15) and c (8) start; d when c ends at 8; b when a ends at 10
    assert two.start == {"a": 0, "c": 0, "d": 8, "b": 10} and two.minutes * 60 == 15
    one = plan(jobs, workers=1)
    assert one.start == {"a": 0, "c": 10, "d": 18, "b": 25} and one.minutes * 60 == 30
    ran: list[str] = []
    runnable = {k: _job(k, j.seconds, j.after, fn=lambda k=k: ran.append(k) or k.upper()) for k, j in jobs.items()}
    results: dict[str, object] = {}
    execute(runnable, results, workers=1)
    assert ran == sorted(one.start, key=one.start.get) and results == {k: k.upper() for k in jobs}


@pytest.mark.slow  # plans every finding through the CLI: ~15 s
def test_plan_command_prints_the_table_and_runs_nothing(tmp_path, capsys):
    work = tmp_path / "work"
    report = Path(__file__).parents[2] / "docs" / "REPRODUCTION.md"
    assert main(["repro", "all", "--plan", "--work", str(work), "--unit-seconds", "electra_mini_step=0.92",
                 "--out", str(report)]) == 0
    out = capsys.readouterr().out
    lines, sections = out.split("\n\n")[0].splitlines(), out.split("\n\n")[1].splitlines()
    # then which code measured each section of the report (the table above plans a re-run)
    assert sections[0] == f"{report}, section by section:"
    assert sorted(line.split(":")[0].strip() for line in sections[1:]) == sorted(FINDINGS)
    assert "electra_mini_step 0.92 s" in lines[0] and "2 job(s) at a time" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == [*FINDINGS, "total"]
    total = float(lines[-1].split()[-1])
    assert total > BUDGET_MINUTES  # twice the step time no longer fits
    assert not work.exists()
    assert main(["repro", "all", "--plan", "--unit-seconds", "step=1"]) == 2
    assert "--unit-seconds step=1" in capsys.readouterr().err
    assert main(["repro", "all", "--plan", "--jobs", "0"]) == 2


def test_several_findings_share_the_cores_in_one_plan(tmp_path, capsys):
    def done_at(*names: str) -> dict[str, float]:
        # --out: a report with no sections, so the plan is not followed by the staleness of docs/REPRODUCTION.md's
        # sections (git history, ~7 s a call; test_plan_command_prints_the_table_and_runs_nothing checks it)
        assert main(["repro", *names, "--plan", "--work", str(tmp_path), "--out", str(tmp_path / "R.md")]) == 0
        rows = [line.split() for line in capsys.readouterr().out.split("\n\n")[0].splitlines()[2:]]
        return {row[0]: float(row[-1]) for row in rows}

    together = done_at("tgt", "dwt", "tgt")  # a repeated name is one finding
    assert list(together) == ["tgt", "dwt", "total"]
    alone = [done_at(name)["total"] for name in ("tgt", "dwt")]
    assert max(alone) <= together["total"] < sum(alone)


def _pretrain_quietly(work: str) -> None:
    pretrain(PRETRAIN_RECIPE, list(QUICK_PRETRAIN), Path(work))


def _waiting_for_lock(pid: int) -> bool:
    """Whether process `pid` is blocked on a file lock: /proc/locks lists waiters as
    `N: -> FLOCK ADVISORY WRITE <pid> <device:inode> <start> <end>`."""
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "->" in fields and fields[fields.index("->") + 4] == str(pid):
            return True
    return False


@pytest.mark.slow
def test_a_second_process_waits_for_the_run_another_is_training(tmp_path):
    """While one process holds a run's lock (training it), another asking for the same run waits, then
    returns the finished run without training it again."""
    work = tmp_path / "work"
    run_dir = cached_run_dir(PRETRAIN_RECIPE, list(QUICK_PRETRAIN), work)
    with _locked(run_dir.with_name(run_dir.name + ".lock")):  # this process "trains" the run
        other = multiprocessing.get_context("spawn").Process(target=_pretrain_quietly, args=(str(work),))
        other.start()
        deadline = time.monotonic() + 300
        while not _waiting_for_lock(other.pid):
            assert other.is_alive() and time.monotonic() < deadline, "the second process did not wait for the lock"
            time.sleep(0.2)
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
        (run_dir / "repro-done").write_text("{}\n")
    other.join(300)
    assert other.exitcode == 0
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n'  # not trained again
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl", "repro-done"]
    assert sorted(os.listdir(work / "pretrained")) == sorted([run_dir.name, run_dir.name + ".lock"])


@pytest.mark.slow
def test_calibrated_plan_is_this_machines_step_time_times_the_plan(tmp_path, capsys):
    """`--plan --calibrate` times electra-mini here and scales every unit by one ratio, so the whole plan is
    the default plan times (measured step / default step)."""
    def plan_minutes(*extra: str) -> tuple[float, list[str]]:
        assert main(["repro", "all", "--plan", "--work", str(tmp_path / "work"), "--out", str(tmp_path / "r.md"),
                     *extra]) == 0
        lines = capsys.readouterr().out.split("\n\n")[0].splitlines()
        return float(lines[-1].split()[-1]), lines

    default, _ = plan_minutes()
    calibrated, lines = plan_minutes("--calibrate")
    measured = float(re.search(r"electra_mini_step (\S+) s", lines[1]).group(1))  # the plan's unit
    assert float(re.search(r"took (\S+) s", lines[0]).group(1)) == pytest.approx(measured, rel=0.01)
    assert calibrated / default == pytest.approx(measured / Costs().electra_mini_step, rel=0.01)
    assert main(["repro", "all", "--calibrate"]) == 2  # only with --plan
