"""The tf-idf + logistic-regression floor: features against hand-computed values, and a learnable task."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from megakd.data.tasks import Example
from megakd.finetune.tfidf import TfidfVectorizer, terms
from tests.finetune.test_defaults import write_keyword_task

ROOT = Path(__file__).parents[2]


def test_features_match_the_formula():
    train = [Example(0, "Good good film.", None, 1), Example(1, "bad film", None, 0),
             Example(2, "good plot", "A film", 1)]
    assert terms(train[2]) == ["good", "plot", "good plot", "b:a", "b:film", "b:a film"]
    vec = TfidfVectorizer(min_df=2).fit(train)
    assert list(vec.vocabulary) == ["film", "good"]  # df 2 each, then by the term
    x = vec.transform(train).to_dense().numpy()
    idf = math.log(4 / 3) + 1  # both terms: ln((1 + n) / (1 + df)) + 1
    row0 = np.array([idf, (1 + math.log(2)) * idf])
    assert np.allclose(x[0], row0 / np.linalg.norm(row0), atol=1e-12)
    assert np.allclose(x[1], [1, 0]) and np.allclose(x[2], [0, 1])  # "b:film" is not "film"


def test_baseline_tool_learns_a_keyword_task(tmp_path):
    data = write_keyword_task(tmp_path / "task", train_size=300, dev_size=100)
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "baseline_tfidf.py"), "-c",
                           str(ROOT / "configs" / "finetune-rt.yaml"), "task.name=files",
                           f"task.train={data / 'train.tsv'}", f"task.dev={data / 'dev.tsv'}", "--json", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["train_examples"] == 300 and result["dev"]["accuracy"] >= 0.95
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "baseline_tfidf.py"), "-c",
                          str(ROOT / "configs" / "finetune-rt.yaml"), "task.name=files",
                          f"task.train={tmp_path / 'missing.tsv'}", f"task.dev={data / 'dev.tsv'}"],
                         capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "missing.tsv: no such file" in bad.stderr
