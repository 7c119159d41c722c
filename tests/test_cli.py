"""`megakd` end to end through its command line: data commands, pretrain, run directory, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megakd.cli import build_parser, main, parse_args
from megakd.data.default_corpus import CORPUS_DIR
from tests.helpers import tiny_overrides

REPO = Path(__file__).parents[1]


def test_pretrain_writes_the_documented_run_directory(tiny_data, tmp_path):
    run = tmp_path / "run"
    overrides = [o for o in tiny_overrides(tiny_data, run) if not o.startswith(("run.plots", "run.tensorboard"))]
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", *overrides, "train.max_steps=3"]) == 0
    assert (run / "config.yaml").is_file() and (run / "metrics.jsonl").is_file()
    assert sorted(p.name for p in (run / "plots").iterdir()) == ["loss.png", "rtd.png"]
    assert any((run / "tb").iterdir())
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000003"]
    for model, arch in (("discriminator", "ElectraForPreTraining"), ("generator", "ElectraForMaskedLM")):
        config = json.loads((run / "hf" / model / "config.json").read_text())
        assert config["architectures"] == [arch]
    # --resume auto on a finished run continues nothing and changes nothing
    before = (run / "metrics.jsonl").read_text()
    # (overrides after --resume are still overrides)
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", *overrides, "--resume", "auto",
                 "train.max_steps=3"]) == 0
    assert (run / "metrics.jsonl").read_text() == before


def test_data_commands_build_a_usable_dataset(tmp_path):
    tok, shards = tmp_path / "tok", tmp_path / "shards"
    kjv = CORPUS_DIR / "kjv.jsonl.gz"
    assert main(["data", "tokenizer", "--input", str(kjv), "--vocab-size", "400", "--out", str(tok)]) == 0
    assert main(["data", "shards", "--input", str(kjv), "--tokenizer", str(tok), "--seq-len", "64",
                 "--out", str(shards), "--samples-per-shard", "2000"]) == 0
    manifest = json.loads((shards / "manifest.json").read_text())
    assert manifest["seq_len"] == 64 and manifest["num_samples"] == sum(s["samples"] for s in manifest["shards"])


@pytest.mark.parametrize("args, message", [
    (["train.max_stpes=3"], "unknown config key 'train.max_stpes'; did you mean 'train.max_steps'?"),
    (["data.tokenizer=/nonexistent"], "data.tokenizer and data.shards: set both"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message, tmp_path, capsys):
    assert main(["pretrain", "-c", "configs/electra-tiny.yaml", f"run.dir={tmp_path}", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not any(tmp_path.iterdir())  # nothing written


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"megakd {version('megakd')}\n"


@pytest.mark.parametrize("argv, field, expected", [
    (["pretrain", "-c", "X", "run.dir=D", "--resume", "auto", "train.max_steps=8"], "overrides",
     ["run.dir=D", "train.max_steps=8"]),
    (["distill", "a.b=1", "-c", "X", "c=2", "--resume", "P", "d.e=[1, 2]"], "overrides",
     ["a.b=1", "c=2", "d.e=[1, 2]"]),
    (["finetune", "finetune.seeds=[1,2]", "-c", "X", "finetune.lr=auto"], "overrides",
     ["finetune.seeds=[1,2]", "finetune.lr=auto"]),
    (["plan", "C", "--gpus", "8", "model.x=1", "--gpu-mem", "40"], "overrides", ["model.x=1"]),
    (["bench", "--parts", "matmul", "train.seed=1", "--out", "o", "train.max_steps=2"], "rest",
     ["train.seed=1", "train.max_steps=2"]),
])
def test_overrides_are_accepted_anywhere(argv, field, expected):
    args = parse_args(build_parser(), argv)
    assert getattr(args, field) == expected


@pytest.mark.parametrize("argv", [["pretrain", "-c", "X", "a=1", "--bogus"],
                                  ["data", "tokenizer", "--input", "f", "--vocab-size", "8", "--out", "o", "a=b"]])
def test_unknown_arguments_exit_2_naming_them(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"unrecognized arguments: {argv[-1]}" in err


def test_printing_or_planning_a_config_imports_no_engine(tmp_path):
    """`--print-config` and `megakd plan` finish the config through `megakd.finish`, not the engine: a
    subprocess runs them and lists the `megakd.engine` modules they loaded (plan's report names the step
    phases of `megakd.engine.profiling`, a module of constants; it reads each DeepSpeed engine's config from
    `megakd.engine.deepspeed_config` and the parameter groups from `megakd.engine.optim`, leaves that import
    nothing else of the engine: it may load those three)."""
    script = """if True:
        import contextlib, io, json, sys
        from megakd.cli import main
        def engine():
            return sorted(m for m in sys.modules if m.startswith("megakd.engine"))
        seen = {}
        for argv in (["pretrain", "-c", "configs/electra-tiny.yaml", "--print-config"],
                     ["distill", "-c", "configs/dwt-tiny.yaml", "--print-config"],
                     ["finetune", "-c", "configs/finetune-rt.yaml", "--print-config"],
                     ["plan", "configs/electra-base.yaml", "--gpus", "8", "--gpu-mem", "80"]):
            with contextlib.redirect_stdout(io.StringIO()):
                assert main(argv) == 0, argv
            seen[argv[0]] = engine()
        print(json.dumps(seen))
    """
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True).stdout
    seen = json.loads(out.splitlines()[-1])
    assert seen["pretrain"] == seen["distill"] == seen["finetune"] == [], seen
    leaves = {"megakd.engine.profiling", "megakd.engine.deepspeed_config", "megakd.engine.optim"}
    assert set(seen["plan"]) <= {"megakd.engine", *leaves}, seen["plan"]
