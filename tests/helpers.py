"""Helpers shared by tests (importable as tests.helpers; conftest.py holds the fixtures)."""

from __future__ import annotations

TINY_VOCAB = 512
TINY_SEQ_LEN = 64


def tiny_overrides(tiny_data, run_dir, **extra) -> list[str]:
    """Overrides that turn any recipe into a seconds-long CPU run on the tiny data."""
    tokenizer_dir, shards_dir = tiny_data
    model = dict(vocab_size=TINY_VOCAB, max_position_embeddings=TINY_SEQ_LEN, dropout=0.1, attention_dropout=0.0)
    out = [f"data.tokenizer={tokenizer_dir}", f"data.shards={shards_dir}", f"run.dir={run_dir}",
           "run.progress_bar=false", "run.tensorboard=false", "run.plots=false",
           "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1",
           "optim.schedule.warmup_steps=2",
           # Pinned here, not taken from the demo recipe, so tuning the demo never moves the
           # thresholds that tests rely on (e.g. clipping that bites on some steps only).
           "optim.generator.lr=2e-3", "optim.discriminator.lr=3e-3"]
    for name, layers, hidden in (("generator", 1, 32), ("discriminator", 2, 48)):
        for k, v in {**model, "num_layers": layers, "hidden_size": hidden, "num_heads": 2,
                     "intermediate_size": 4 * hidden, "embedding_size": 32}.items():
            out.append(f"model.{name}.{k}={v}")
    out += [f"{k}={v}" for k, v in extra.items()]
    return out


def padded_inputs(length: int = 40) -> dict:
    """Two random id rows of `length` tokens (no special ids), the first padded after 30."""
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, TINY_VOCAB, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, 30:] = 0
    return {"input_ids": ids, "attention_mask": mask}
