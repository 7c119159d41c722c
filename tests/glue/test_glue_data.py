"""GLUE's files as distributed, as datasets saves them and as the hub lays them out: the same examples from
each, and one line naming the file and row (exit 2, run.dir untouched) for what is wrong in them."""

from __future__ import annotations

from pathlib import Path

import pytest

from make_glue_data import write_glue_data
from megakd.cli import main
from megakd.configio import ConfigError
from megakd.glue.tasks import AX, TASKS, read_split

CONFIG = Path(__file__).parents[2] / "configs" / "glue.yaml"


def _tsv(path: Path, *lines: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def test_glue_files_as_the_download_script_writes_them(tmp_path):
    """Rows in the distributed files' own layout (written here by hand, not by the generator)."""
    _tsv(tmp_path / "CoLA" / "train.tsv", "gj04\t1\t\tOur friends won't buy this analysis, let alone the next one.",
         "gj04\t0\t*\tThey drank the pub.")
    _tsv(tmp_path / "CoLA" / "test.tsv", "index\tsentence", "0\tBill whistled past the house.")
    _tsv(tmp_path / "MRPC" / "dev.tsv", "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String",
         "1\t1355540\t1355592\tHe said the foodservice pie business ...\tThe foodservice pie business ...")
    _tsv(tmp_path / "STS-B" / "dev.tsv",
         "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore",
         "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man with a hard hat is dancing.\t"
         "A man wearing a hard hat is dancing.\t5.000")
    header = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
              "sentence2_parse\tsentence1\tsentence2")
    _tsv(tmp_path / "MNLI" / "dev_mismatched.tsv",
         header + "\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label",
         "0\t63735\t63735n\tslate\t( ( The ...\t( ( The ...\t(ROOT ...\t(ROOT ...\tThe new rights are nice enough"
         "\tEveryone really likes the newest benefits\tneutral\tentailment\tneutral\tneutral\tneutral\tneutral")
    _tsv(tmp_path / "MNLI" / "test_matched.tsv", header, "7\t31493\t31493\ttravel\t( ...\t( ...\t(ROOT\t(ROOT\t"
         "Hierbas, ans seco, ans dulce, and frigola are just a few names worth keeping a look-out for.\t"
         "Hierbas is a name worth looking out for.")
    _tsv(tmp_path / "QQP" / "test.tsv", "id\tquestion1\tquestion2", "0\tWhy do rockets look white?\t"
         "Why are rockets and boosters painted white?")
    cola = read_split(tmp_path, TASKS["cola"], "train")
    assert [(e.index, e.text_b, e.label) for e in cola] == [(0, None, 1), (1, None, 0)]
    assert cola[1].text_a == "They drank the pub."
    assert read_split(tmp_path, TASKS["cola"], "test")[0].text_a == "Bill whistled past the house."
    mrpc = read_split(tmp_path, TASKS["mrpc"], "dev")[0]
    assert (mrpc.text_a, mrpc.label) == ("He said the foodservice pie business ...", 1)
    assert read_split(tmp_path, TASKS["stsb"], "dev")[0].label == 5.0
    mm = read_split(tmp_path, TASKS["mnli"], "dev_mismatched")[0]
    assert (mm.text_b, mm.label) == ("Everyone really likes the newest benefits", 1)  # neutral: HF's class 1
    assert read_split(tmp_path, TASKS["mnli"], "test_matched")[0].index == 7  # the submission's id
    assert read_split(tmp_path, TASKS["qqp"], "test")[0].text_b == "Why are rockets and boosters painted white?"


def test_every_layout_gives_the_same_examples(tmp_path):
    tasks = ["cola", "stsb", "mnli", "qnli"]
    roots = {layout: write_glue_data(tmp_path / layout, layout, tasks, train=6, dev=4, test=3)
             for layout in ("glue", "disk", "parquet")}
    for task in [*(TASKS[t] for t in tasks), AX]:
        splits = ["test"] if task is AX else ["train", *task.dev_splits, *task.test_splits]
        for split in splits:
            want = [(e.index, e.text_a, e.text_b, e.label) for e in read_split(roots["glue"], task, split)]
            assert len(want) == (3 if "test" in split else 4 if "dev" in split else 6)
            for layout in ("disk", "parquet"):
                got = [(e.index, e.text_a, e.text_b, pytest.approx(e.label, abs=1e-6))
                       for e in read_split(roots[layout], task, split)]
                assert got == want, (layout, task.name, split)


@pytest.mark.parametrize("broken, expected", [
    (lambda d: _tsv(d / "CoLA" / "train.tsv", "gj04\t1\t\tFine.", "gj04\t1\tMissing a column."),
     "CoLA/train.tsv: row 2: 3 tab-separated cells (line 2): expected CoLA's 4 headerless columns"),
    (lambda d: (d / "RTE" / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n"
                                                    "1\ta\tb\tcontradiction\n"),
     "RTE/train.tsv: row 2: label 'contradiction' (line 3, column 'label'): expected one of 'entailment', "
     "'not_entailment'"),
    (lambda d: (d / "STS-B" / "dev.tsv").unlink(), "STS-B/dev.tsv: no such file (the dev split of STS-B"),
    (lambda d: (d / "MNLI" / "test_mismatched.tsv").unlink(), "MNLI/test_mismatched.tsv: no such file"),
    (lambda d: (d / "QNLI" / "test.tsv").write_text("index\tquestion\tsentence\nx1\ta\tb\n"),
     "QNLI/test.tsv: row 1: id 'x1' (line 2, column 'index'): expected a non-negative integer"),
    (lambda d: (d / "MRPC" / "train.tsv").write_text("Quality\tA\tB\n1\ta\tb\n"),
     "MRPC/train.tsv: the header (line 1) has no column '#1 String'"),
])
def test_bad_glue_data_is_one_line_exit_2_before_run_dir_is_made(tmp_path, capsys, broken, expected):
    data = write_glue_data(tmp_path / "glue_data", "glue", ["cola", "rte", "stsb", "mnli", "qnli", "mrpc"],
                           train=4, dev=2, test=2)
    broken(data)
    run_dir = tmp_path / "run"
    code = main(["glue", "-c", str(CONFIG), f"glue.data_dir={data}", f"run.dir={run_dir}", "model.init=random",
                 f"model.tokenizer={tmp_path / 'no-tokenizer'}", "model.path=",
                 "glue.tasks=[cola,rte,stsb,mnli,qnli,mrpc]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert expected in err[-1] and str(data) in err[-1]
    assert not run_dir.exists()


def test_missing_task_and_missing_hf_split_name_what_was_looked_for(tmp_path):
    with pytest.raises(ConfigError, match=r"no wnli data in .*: expected .*/WNLI/ .*wnli/dataset_dict.json"):
        read_split(tmp_path, TASKS["wnli"], "train")
    data = write_glue_data(tmp_path / "hf", "parquet", ["sst2"], train=2, dev=2, test=2)
    (data / "sst2" / "validation-00000-of-00001.parquet").unlink()
    with pytest.raises(ConfigError, match=r"sst2: no validation-\*.parquet \(the dev split of sst2"):
        read_split(data, TASKS["sst2"], "dev")


@pytest.mark.parametrize("override, expected", [
    ("glue.tasks=[cola,colaa]", "glue.tasks: unknown GLUE task 'colaa'; expected some of cola, sst2"),
    ("glue.from_mnli=[rte]", "glue.from_mnli=['rte']: needs mnli in glue.tasks"),
    ("glue.lr=best", "glue.lr: expected electra, a rate or a list of rates, got 'best'"),
    ("finetune.lr=1e-4", "finetune.lr=0.0001: megakd glue takes its rate from glue.lr"),
    ("finetune.layer_lr_decay=0", "finetune.layer_lr_decay: expected a factor in (0, 1], got 0"),
    ("glue.data_dir=", "glue.data_dir: required"),
])
def test_bad_glue_settings_are_one_line_naming_the_key(tmp_path, capsys, override, expected):
    code = main(["glue", "-c", str(CONFIG), "glue.data_dir=somewhere", f"run.dir={tmp_path / 'run'}",
                 "glue.tasks=[cola,rte]", override])
    assert code == 2 and expected in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()
