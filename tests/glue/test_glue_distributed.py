"""`megakd glue` on two processes (launch/torchrun.sh: DDP over gloo; launch/deepspeed.sh: ZeRO-2) against one
process: the same dev metrics and the same submission, with ELECTRA's layer-wise LR decay (one parameter
group per layer) under each backend. MNLI's mismatched dev and test predictions are split over the ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from make_glue_data import write_glue_data
from tests.finetune.test_distributed import LAUNCH, REPO, finish, start

pytestmark = pytest.mark.slow


def _glue(tokenizer: Path, data: Path, run_dir: Path, *extra: str) -> list[str]:
    """A random-init model (dropout off) over MNLI and STS-B, one seed, a global batch of 8 on 18 examples."""
    encoder = {"vocab_size": 512, "hidden_size": 16, "num_layers": 2, "intermediate_size": 32,
               "max_position_embeddings": 48, "attention_dropout": 0.0}
    return ["glue", "-c", str(REPO / "configs" / "glue.yaml"), f"run.dir={run_dir}", "model.path=",
            "model.init=random", f"model.tokenizer={tokenizer}", f"glue.data_dir={data}", "glue.tasks=[mnli,stsb]",
            *(f"model.encoder.{k}={v}" for k, v in encoder.items()), "finetune.max_seq_len=48",
            "finetune.batch_size=8", "finetune.eval_batch_size=6", "finetune.epochs=2", "glue.long_epochs=2",
            "finetune.dropout=0.0", "finetune.seeds=[3]", "run.progress_bar=false", "run.tensorboard=false",
            "kernels.backend=torch", *extra]


@pytest.fixture(scope="module")
def single(tiny_data, tmp_path_factory):
    root = tmp_path_factory.mktemp("glue_dist")
    data = write_glue_data(root / "data", "glue", ["mnli", "stsb"], train=18, dev=10, test=7)
    log = root / "single.log"
    finish(start([sys.executable, "-m", "megakd.cli", *_glue(tiny_data[0], data, root / "single")], log), log)
    return root, data


def _assert_same(got: Path, want: Path) -> None:
    a, b = (json.loads((d / "results.json").read_text())["tasks"] for d in (got, want))
    for task in ("mnli", "stsb"):  # float32 sums in another order: STS-B's correlations move by ~1e-5
        assert a[task]["per_seed"]["3"] == pytest.approx(b[task]["per_seed"]["3"], abs=1e-4), task
    for name in ("MNLI-m.tsv", "MNLI-mm.tsv", "AX.tsv", "STS-B.tsv"):
        rows_a = [r.split("\t") for r in (got / "submission" / name).read_text().splitlines()[1:]]
        rows_b = [r.split("\t") for r in (want / "submission" / name).read_text().splitlines()[1:]]
        assert [r[0] for r in rows_a] == [r[0] for r in rows_b] == [str(i) for i in range(7)]
        if name == "STS-B.tsv":
            assert [float(r[1]) for r in rows_a] == pytest.approx([float(r[1]) for r in rows_b], abs=2e-3)
        else:
            assert rows_a == rows_b, name


@pytest.mark.parametrize("launcher", ["ddp", "deepspeed"])
def test_two_processes_match_one(single, tiny_data, launcher):
    root, data = single
    run_dir = root / launcher
    args = _glue(tiny_data[0], data, run_dir)
    if launcher == "ddp":
        cmd = [str(LAUNCH / "torchrun.sh"), "2", *args, "backend.name=ddp"]
    else:
        cmd = [str(LAUNCH / "deepspeed.sh"), "--num_gpus", "2", *args, "backend.zero_stage=2"]
    log = root / f"{launcher}.log"
    finish(start(cmd, log), log)
    assert f"name: {launcher}" in (run_dir / "config.yaml").read_text()
    _assert_same(run_dir, root / "single")
