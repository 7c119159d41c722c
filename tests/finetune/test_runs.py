"""One-process fine-tuning runs as a cluster job: run-dir ownership, `--resume auto` of a finished run,
bf16 autocast, TensorBoard and wandb, and the backend settings fine-tuning refuses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megakd.cli import main
from megakd.config import ConfigError, load_config
from megakd.finetune.config import FinetuneConfig
from tests.finetune.test_distributed import REPO, tiny_finetune

CONFIG = REPO / "configs" / "finetune-rt.yaml"
SHORT = ("finetune.epochs=2", "finetune.lr=3e-3")


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("ft_runs") / "run"
    assert main(tiny_finetune(tiny_data[0], run, *SHORT)) == 0
    return run


def _snapshot(run):
    return {p.relative_to(run).as_posix(): p.read_bytes() for p in sorted(run.rglob("*"))
            if p.is_file() and p.name not in (".lock", "config.yaml")}


def test_resume_auto_of_a_finished_run_retrains_nothing(finished, tiny_data):
    before = _snapshot(finished)
    assert "seed_0/result.json" in before and not (finished / "seed_0" / "checkpoints").exists()
    args = tiny_finetune(tiny_data[0], finished, *SHORT)
    assert main([args[0], "--resume", "auto", *args[1:]]) == 0
    assert _snapshot(finished) == before  # metrics, logits, model and summary untouched


def test_a_new_run_into_a_used_run_dir_is_refused(finished, tiny_data, capsys):
    before = _snapshot(finished)
    assert main(tiny_finetune(tiny_data[0], finished, *SHORT)) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume auto" in err
    assert _snapshot(finished) == before


def test_resume_with_another_setting_is_refused(finished, tiny_data, capsys):
    args = tiny_finetune(tiny_data[0], finished, *SHORT, "finetune.epochs=3")
    assert main([args[0], "--resume", "auto", *args[1:]]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("megakd: error:")]
    assert len(err) == 1 and "finetune.epochs: 2 -> 3" in err[0]


def test_bf16_autocast_changes_the_numbers_a_little(finished, tiny_data, tmp_path):
    run = tmp_path / "bf16"
    assert main(tiny_finetune(tiny_data[0], run, *SHORT, "finetune.precision=bf16")) == 0
    fp32, bf16 = (np.load(d / "seed_0" / "dev_logits.npy") for d in (finished, run))
    assert bf16.dtype == np.float32 and np.isfinite(bf16).all()
    assert not np.array_equal(fp32, bf16)  # the matmuls ran in bf16 ...
    np.testing.assert_allclose(bf16, fp32, atol=0.05)  # ... on the same training trajectory


def test_tensorboard_and_wandb_keep_one_run_per_seed_dir(tiny_data, tmp_path, wandb_torn_down):
    run = tmp_path / "logged"
    args = tiny_finetune(tiny_data[0], run, "finetune.epochs=1", "finetune.lr=3e-3", "run.tensorboard=true",
                         "run.wandb=true", "run.wandb_mode=offline")
    assert main(args) == 0
    seed = run / "seed_0"
    assert list((seed / "tb").glob("events.out.tfevents.*"))
    run_id = (seed / "wandb_run_id").read_text().strip()
    assert [p.name.endswith(run_id) for p in (seed / "wandb").glob("offline-run-*")] == [True]
    logged = [json.loads(x) for x in (seed / "metrics.jsonl").read_text().splitlines()]
    assert all(r["samples_per_s"] > 0 for r in logged if "loss" in r)


@pytest.mark.parametrize("overrides,message", [
    (["backend.name=deepspeed", "backend.zero_stage=3"],
     "backend.zero_stage: fine-tuning supports DeepSpeed ZeRO 0, 1 or 2"),
    (["backend.zero_stage=1"], "need backend.name=deepspeed"),
    (["backend.name=deepspeed", "soteacher.enabled=true", "soteacher.student.path=x"], "SoTeacher and TGT"),
    (["backend.name=deepspeed", "finetune.precision=bf16"], "finetune.precision=bf16 with backend.name=deepspeed"),
    (["backend.name=deepspeed", "backend.deepspeed_config=ds.json"], "backend.deepspeed_config: not supported"),
    (["backend.pipeline_stages=2"], "no pipeline parallelism"),
    (["finetune.precision=fp16"], "finetune.precision"),
])
def test_backend_settings_fine_tuning_cannot_honour_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load_config(CONFIG, overrides, cls=FinetuneConfig)
