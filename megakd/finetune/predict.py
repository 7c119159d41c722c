"""A classifier's logits on a whole split, the evaluation batches shared out over the data-parallel ranks."""

from __future__ import annotations

import numpy as np
import torch

from megakd.data.tasks import EncodedTask
from megakd.finetune.runtime import Runtime
from megakd.models.electra import SequenceClassifier


@torch.no_grad()
def predict(model: SequenceClassifier, data: EncodedTask, batch_size: int, runtime: Runtime) -> np.ndarray:
    """Logits [N, K] (eval mode, in order) for every example of `data`, on every rank.

    With several ranks each predicts every world-th batch (the same batches as one process, so the
    same values) and a sum over ranks assembles them.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    starts = range(0, len(data), batch_size)
    mine = [starts[i] for i in runtime.shard_batches(len(starts))]
    logits = torch.zeros(len(data), model.num_labels)
    for start in mine:
        rows = range(start, min(start + batch_size, len(data)))
        b = {k: v.to(device) for k, v in data.batch(rows).items()}
        with runtime.backend.autocast():
            logits[start: rows.stop] = model(b["input_ids"], b["attention_mask"], b["token_type_ids"]).float().cpu()
    model.train(was_training)
    if runtime.world_size > 1:
        logits = runtime.sum(logits)
    return logits.numpy()
