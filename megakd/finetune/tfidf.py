"""The floor every downstream table needs: tf-idf features + logistic regression, no neural network.

Features (fitted on the training split only): lower-cased word unigrams and bigrams (`[a-z0-9']+`
tokens), kept when they occur in at least `min_df` training examples, at most `max_features` of
them (highest document frequency first, ties by the term); a pair task's second sentence gets its
own terms (prefixed `b:`). Weights: sublinear tf (1 + ln count) × smoothed idf
(ln((1 + n) / (1 + df)) + 1), each row L2-normalised, as scikit-learn's `TfidfVectorizer(
sublinear_tf=True)` computes them. The classifier: megakd.models.logreg with `l2` = 1/n on the
mean loss (scikit-learn's default C = 1 on the summed loss). Everything is deterministic: one
number per task, no seeds.
"""

from __future__ import annotations

import math
import re
from collections import Counter

import numpy as np
import torch

from megakd.config import ConfigError, TaskConfig
from megakd.data.tasks import Example, load_split
from megakd.finetune.scores import task_metrics
from megakd.models.logreg import fit_logistic_regression

_WORD = re.compile(r"[a-z0-9']+")


def terms(example: Example) -> list[str]:
    """Unigrams and bigrams of text_a, and of text_b prefixed with `b:`."""
    out = []
    for prefix, text in (("", example.text_a), ("b:", example.text_b)):
        if text is None:
            continue
        words = _WORD.findall(text.lower())
        out += [prefix + w for w in words] + [f"{prefix}{a} {b}" for a, b in zip(words, words[1:])]
    return out


class TfidfVectorizer:
    def __init__(self, min_df: int = 2, max_features: int = 50_000):
        self.min_df, self.max_features = min_df, max_features

    def fit(self, examples: list[Example]) -> TfidfVectorizer:
        df = Counter(t for e in examples for t in set(terms(e)))
        kept = sorted((t for t, c in df.items() if c >= self.min_df), key=lambda t: (-df[t], t))[: self.max_features]
        self.vocabulary = {t: i for i, t in enumerate(kept)}
        n = len(examples)
        self.idf = np.array([math.log((1 + n) / (1 + df[t])) + 1 for t in kept])
        return self

    def transform(self, examples: list[Example]) -> torch.Tensor:
        """Sparse COO [N, V] float64, rows L2-normalised."""
        rows, cols, values = [], [], []
        for r, e in enumerate(examples):
            counts = Counter(self.vocabulary[t] for t in terms(e) if t in self.vocabulary)
            if not counts:
                continue
            idx = np.fromiter(counts, dtype=np.int64)
            weights = (1 + np.log(np.fromiter(counts.values(), dtype=np.float64))) * self.idf[idx]
            rows += [r] * len(idx)
            cols += idx.tolist()
            values += (weights / np.linalg.norm(weights)).tolist()
        return torch.sparse_coo_tensor(torch.tensor([rows, cols], dtype=torch.long).reshape(2, -1),
                                       torch.tensor(values, dtype=torch.float64),
                                       (len(examples), len(self.vocabulary)), check_invariants=True).coalesce()


def tfidf_baseline(task: TaskConfig, min_df: int = 2, max_features: int = 50_000) -> dict:
    """Dev metrics of tf-idf + logistic regression trained on the task's training split."""
    if task.num_labels < 2:
        raise ConfigError("task.num_labels: the tf-idf baseline needs a classification task (>= 2 labels)")
    train, dev = load_split(task, "train"), load_split(task, "dev")
    vectorizer = TfidfVectorizer(min_df, max_features).fit(train)
    labels = torch.tensor([e.label for e in train])
    weight, bias = fit_logistic_regression(vectorizer.transform(train), labels, task.num_labels, l2=1 / len(train),
                                           max_iter=500)
    logits = (torch.sparse.mm(vectorizer.transform(dev), weight) + bias).numpy()
    metrics = task_metrics(logits, np.array([e.label for e in dev]), task.num_labels)
    return {"task": task.name, "train_examples": len(train), "dev_examples": len(dev),
            "features": len(vectorizer.vocabulary), "dev": metrics}
