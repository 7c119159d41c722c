"""Standalone-generator RTD evaluation (docs/methods.md § Standalone-generator RTD evaluation): score
discriminators on one fixed corruption.

Each discriminator's own jointly-trained generator makes RTD accuracy/F1 incomparable across
runs (a weaker generator is easier to detect). Here one fixed generator corrupts fixed data: the
masks come from the loader (a pure function of seed and sample index) and the replacements from a
generator RNG seeded with `seed`, and every discriminator scores exactly those corrupted batches
— the same ones in one call or across calls with the same arguments.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from megakd.data.loader import PretrainingLoader
from megakd.data.tokenizer import Tokenizer
from megakd.models.electra import Discriminator, MaskedLM
from megakd.objectives.electra import (
    corrupt,
    precision_recall_f1,
    rtd_counts,
    rtd_labels,
    sample_replacements,
)
from megakd.store import check_same_tokenizer, freeze, load_model


@torch.no_grad()
def corrupted_batches(
    generator: MaskedLM, loader: PretrainingLoader, num_batches: int, seed: int, backend: str = "auto"
) -> Iterator[dict[str, torch.Tensor]]:
    """`num_batches` batches of {corrupted, original, attention_mask, mlm_mask}: the generator's samples at masks."""
    rng = torch.Generator().manual_seed(seed)
    batches = iter(loader)
    for _ in range(num_batches):
        batch = next(batches)
        mlm_mask = batch["mlm_mask"]
        hidden = generator.masked_hidden(generator(batch["masked_input_ids"], batch["attention_mask"]), mlm_mask)
        samples, _ = sample_replacements(hidden, generator.head.decoder_weight, generator.head.bias, rng,
                                         backend=backend)
        yield {"corrupted": corrupt(batch["input_ids"], mlm_mask, samples), "original": batch["input_ids"],
               "attention_mask": batch["attention_mask"], "mlm_mask": mlm_mask}


@torch.no_grad()
def score_rtd(
    generator: MaskedLM, discriminators: list[Discriminator], loader: PretrainingLoader, num_batches: int,
    seed: int, backend: str = "auto",
) -> list[dict[str, float]]:
    """RTD accuracy/precision/recall/F1 over non-padding tokens, per discriminator, on the same corruption."""
    totals = [dict.fromkeys(("tokens", "correct", "tp", "fp", "fn"), 0) for _ in discriminators]
    masked = replaced = 0
    for batch in corrupted_batches(generator, loader, num_batches, seed, backend):
        labels = rtd_labels(batch["corrupted"], batch["original"])
        masked += int(batch["mlm_mask"].sum())
        replaced += int(labels.sum())
        for disc, total in zip(discriminators, totals):
            logits = disc.rtd_logits(disc(batch["corrupted"], batch["attention_mask"]))
            for key, value in rtd_counts(logits, labels, batch["attention_mask"]).items():
                total[key] += int(value)
    results = []
    for total in totals:
        precision, recall, f1 = precision_recall_f1(total["tp"], total["fp"], total["fn"])
        results.append({"accuracy": total["correct"] / max(total["tokens"], 1), "precision": precision,
                        "recall": recall, "f1": f1, "tokens": total["tokens"], "masked": masked, "replaced": replaced})
    return results


def evaluate_rtd(
    generator: str | Path, discriminators: list[str | Path], shards: str | Path, tokenizer: str | Path | None = None,
    *, num_batches: int = 50, batch_size: int = 32, seed: int = 0, mask_prob: float = 0.15, backend: str = "auto",
) -> dict:
    """`megakd eval-rtd`: load the models (run, checkpoint, model dir or HF dir), check tokenizers, score.

    `tokenizer` defaults to the generator's own; every model must share it, and so must the shards.
    """
    gen = load_model(generator, "--generator")
    gen_model = freeze(gen.get("masked_lm"))
    if tokenizer is None and gen.tokenizer_dir is None:
        raise FileNotFoundError(f"--generator {generator}: carries no megakd tokenizer; pass --tokenizer DIR")
    tok = Tokenizer.load(tokenizer if tokenizer is not None else gen.tokenizer_dir)
    check_same_tokenizer(tok, gen.tokenizer_dir, f"--generator {generator}", gen_model.config.vocab_size)
    discs = []
    for path in discriminators:
        disc = load_model(path, "--discriminator")
        model = freeze(disc.get("discriminator"))
        check_same_tokenizer(tok, disc.tokenizer_dir, f"--discriminator {path}", model.config.vocab_size)
        discs.append(model)
    loader = PretrainingLoader(shards, tok, micro_batch_size=batch_size, seed=seed, mask_prob=mask_prob)
    scores = score_rtd(gen_model, discs, loader, num_batches, seed, backend)
    return {
        "generator": str(generator), "shards": str(shards), "tokenizer": str(tok.path), "vocab_hash": tok.vocab_hash,
        "seed": seed, "batches": num_batches, "batch_size": batch_size, "mask_prob": mask_prob,
        "discriminators": [{"path": str(path), **score} for path, score in zip(discriminators, scores)],
    }
