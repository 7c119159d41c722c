"""A fine-tuning optimizer: AdaMax or AdamW, with layer-wise learning-rate decay."""

from __future__ import annotations

import torch

from megakd.engine.optim import param_groups
from megakd.finetune.config import FinetuneSettings
from megakd.models.electra import SequenceClassifier


def layerwise_param_groups(model: SequenceClassifier, weight_decay: float, lr: float, decay: float) -> list[dict]:
    """Parameter groups whose rate falls by `decay` per layer below the head: the head at `lr`, encoder layer
    i of L at lr·decay^(L+1−i), the embeddings (and the shared relative-position table) at lr·decay^(L+2);
    weight decay on matrices only, as `param_groups`."""
    top = model.config.num_layers + 2
    groups: dict[tuple[int, bool], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        parts = name.split(".")
        depth = (int(parts[2]) + 1 if parts[1] == "layers" else 0) if parts[0] == "encoder" else top
        matrix = p.ndim >= 2
        group = groups.setdefault((depth, matrix), {"params": [], "weight_decay": weight_decay if matrix else 0.0,
                                                    "lr": lr * decay ** (top - depth)})
        group["params"].append(p)
    return [groups[k] for k in sorted(groups)]


def build_optimizer(model: SequenceClassifier, f: FinetuneSettings, lr: float) -> torch.optim.Optimizer:
    """AdaMax (the dissertation's setting) or AdamW (ELECTRA's GLUE setting) at peak rate `lr`, with
    layer-wise decay when `finetune.layer_lr_decay` < 1 (two groups otherwise, as before it existed)."""
    groups = (param_groups(model.named_parameters(), f.weight_decay) if f.layer_lr_decay == 1.0 else
              layerwise_param_groups(model, f.weight_decay, lr, f.layer_lr_decay))
    kind = torch.optim.Adamax if f.optimizer == "adamax" else torch.optim.AdamW
    return kind(groups, lr=lr, betas=tuple(f.betas), eps=f.eps)
