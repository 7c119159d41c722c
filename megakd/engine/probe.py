"""A downstream probe while pretraining: does the encoder already know something a task needs?

Every `train.probe_every` steps, rank 0 encodes a fixed labelled slice of a task's *training*
split with the frozen encoder (eval mode, no grad: the discriminator's, or the BERT-MLM model's),
fits a float64 logistic regression (megakd.models.logreg, deterministic L-BFGS) on
[mean-pooled ‖ [CLS]] features of `train.probe_fit_examples` examples, standardised with their
statistics, and reports `probe_acc` on `train.probe_eval_examples` other examples of the same
split. Dev is never read. The rows come from a permutation seeded with 0, so every probe of a run,
and of every run, scores the same examples. The probe runs inside `torch.random.fork_rng`, so the
training RNG streams (and so exact resume) are untouched.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import Tensor

from megakd.config import Config
from megakd.data.tasks import EncodedTask, load_split
from megakd.data.tokenizer import Tokenizer
from megakd.engine.backends import to_device
from megakd.models.encoder import Encoder
from megakd.models.logreg import fit_logistic_regression, predict_logistic_regression

log = logging.getLogger(__name__)

PROBE_BATCH_SIZE = 64
PROBE_L2 = 1e-3  # on standardised features; the README gives the measured effect


def probe_rows(n: int, fit: int, held: int) -> tuple[list[int], list[int]]:
    """(fit rows, held-out rows): disjoint, from a fixed permutation (seed 0) of a split of `n` examples."""
    if fit + held > n:
        raise ValueError(f"train.probe_fit_examples + train.probe_eval_examples = {fit + held} exceeds the "
                         f"{n} training examples of the probe task")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    return order[held: held + fit], order[:held]


class Probe:
    """Logistic regression on frozen encoder features of a fixed slice of a task's training split."""

    def __init__(self, cfg: Config, tokenizer: Tokenizer, max_positions: int):
        t = cfg.train
        examples = load_split(t.probe_task, "train")
        fit_rows, held_rows = probe_rows(len(examples), t.probe_fit_examples, t.probe_eval_examples)
        max_len = min(t.probe_max_seq_len, max_positions)
        self.fit = EncodedTask([examples[r] for r in fit_rows], tokenizer, max_len, regression=False)
        self.held = EncodedTask([examples[r] for r in held_rows], tokenizer, max_len, regression=False)
        self.num_classes = t.probe_task.num_labels

    @torch.no_grad()
    def features(self, encoder: Encoder, data: EncodedTask) -> Tensor:
        """[N, 2H] float64: mean of the last hidden states over real tokens, then the [CLS] state."""
        out = []
        device = next(encoder.parameters()).device
        for start in range(0, len(data), PROBE_BATCH_SIZE):
            b = to_device(data.batch(range(start, min(start + PROBE_BATCH_SIZE, len(data)))), device)
            hidden = encoder(b["input_ids"], b["attention_mask"], b["token_type_ids"]).double()
            mask = b["attention_mask"].to(hidden.dtype)[..., None]
            mean = (hidden * mask).sum(1) / mask.sum(1)
            out.append(torch.cat([mean, hidden[:, 0]], dim=-1))
        return torch.cat(out)

    def __call__(self, encoder: Encoder) -> dict[str, float]:
        """{"probe_acc", "probe_seconds"}; the encoder's train/eval mode is restored afterwards."""
        start = time.perf_counter()
        was_training = encoder.training
        device = next(encoder.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            encoder.eval()
            try:
                fit_x, held_x = (self.features(encoder, d).cpu() for d in (self.fit, self.held))
            finally:
                encoder.train(was_training)
            mean, std = fit_x.mean(0), fit_x.std(0).clamp_min(1e-8)
            weight, bias = fit_logistic_regression((fit_x - mean) / std, self.fit.labels, self.num_classes, PROBE_L2)
            predicted = predict_logistic_regression((held_x - mean) / std, weight, bias)
        accuracy = (predicted == self.held.labels).double().mean().item()
        return {"probe_acc": accuracy, "probe_seconds": time.perf_counter() - start}
