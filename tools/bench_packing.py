"""Real (non-padding) tokens/s of ELECTRA pretraining on short documents: packed vs unpacked shards.

Corpus: the bundled Rotten Tomatoes sentences (megakd/data/corpus/rt_sentences.tsv.gz), one
sentence per document (~10K documents of ~30 tokens: a short-document corpus like Wikipedia
paragraphs or web snippets), tokenized with the demo's bundled-corpus 8K tokenizer, written as
seq-512 shards twice: one document per sample (`megakd data shards`), and packed
(`megakd data shards --pack`). Both runs use the same recipe (configs/electra-tiny.yaml with
512 positions, or --model small for ELECTRA-small sizes) and the same micro-batch of samples,
through the real trainer and loader (collation, masking, segment ids); steps alternate between the
two runs and the table reports medians.

    python tools/bench_packing.py [--batch 8] [--steps 10] [--model tiny|small]
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from megakd.config import load_config
from megakd.data.default_corpus import CORPUS_DIR
from megakd.data.shards import write_shards
from megakd.data.tokenizer import Tokenizer
from megakd.engine.pretrain import build_trainer, resolve_data

SEQ = 512
SMALL = {"generator": (12, 64, 1, 256), "discriminator": (12, 256, 4, 1024)}  # layers, hidden, heads, ffn


def rt_documents(path: Path) -> Path:
    """One JSON line per RT sentence."""
    with gzip.open(CORPUS_DIR / "rt_sentences.tsv.gz", "rt", encoding="utf-8") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    path.write_text("".join(json.dumps({"text": r["sentence"]}) + "\n" for r in rows), encoding="utf-8")
    return path


def overrides(tokenizer_dir: Path, shards: Path, run_dir: Path, batch: int, model: str, compile_: bool) -> list[str]:
    out = [f"data.tokenizer={tokenizer_dir}", f"data.shards={shards}", f"run.dir={run_dir}",
           "run.progress_bar=false", "run.tensorboard=false", "run.plots=false", "train.log_every=1000000",
           f"train.global_batch_size={batch}", f"train.micro_batch_size={batch}", f"train.compile={compile_}"]
    for name in ("generator", "discriminator"):
        out.append(f"model.{name}.max_position_embeddings={SEQ}")
        if model == "small":
            layers, hidden, heads, ffn = SMALL[name]
            out += [f"model.{name}.num_layers={layers}", f"model.{name}.hidden_size={hidden}",
                    f"model.{name}.num_heads={heads}", f"model.{name}.intermediate_size={ffn}",
                    f"model.{name}.embedding_size=128"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="samples per step (both runs)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--model", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--compile", action="store_true", help="train.compile=true on both runs")
    args = parser.parse_args()
    tokenizer_dir, _ = resolve_data(load_config("configs/electra-tiny.yaml", []))
    tokenizer = Tokenizer.load(tokenizer_dir)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        docs = rt_documents(root / "rt.jsonl")
        manifests, trainers = {}, {}
        for name, pack in (("unpacked", False), ("packed", True)):
            manifests[name] = write_shards([docs], tokenizer, SEQ, root / name, samples_per_shard=2048, pack=pack)
            cfg = load_config("configs/electra-tiny.yaml",
                              overrides(tokenizer_dir, root / name, root / f"run-{name}", args.batch, args.model,
                                        args.compile))
            trainers[name] = build_trainer(cfg)
        batches = {name: iter(t.loader) for name, t in trainers.items()}
        seconds: dict[str, list[float]] = {name: [] for name in trainers}
        tokens: dict[str, list[float]] = {name: [] for name in trainers}
        padded: dict[str, list[float]] = {name: [] for name in trainers}
        for i in range(args.warmup + args.steps):
            for name, trainer in trainers.items():
                before = float(trainer.loop.interval.sums["tokens"])
                start = time.perf_counter()
                trainer.train_step(batches[name])
                elapsed = time.perf_counter() - start
                if i >= args.warmup:
                    seconds[name].append(elapsed)
                    tokens[name].append(float(trainer.loop.interval.sums["tokens"]) - before)
        for name, trainer in trainers.items():  # padded width of the batches these loaders produce
            it = iter(trainer.loader)
            padded[name] = [next(it)["input_ids"].numel() for _ in range(args.steps)]
    rate = {name: statistics.median(t / s for t, s in zip(tokens[name], seconds[name])) for name in trainers}
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; model {args.model}"
          f"{' (compiled)' if args.compile else ''}, {args.batch} samples x seq {SEQ} per step, median of "
          f"{args.steps} steps after {args.warmup} warm-up, runs alternating")
    print(f"corpus: {manifests['unpacked']['documents']} RT sentences, one per document")
    print(f"{'shards':<9} {'samples':>8} {'docs/sample':>11} {'fill of seq':>11} {'fill of batch':>13} "
          f"{'real tok/step':>13} {'real tok/s':>10} {'ratio':>6}")
    for name in trainers:
        m = manifests[name]
        batch_fill = statistics.mean(tokens[name]) / statistics.mean(padded[name])
        print(f"{name:<9} {m['num_samples']:>8} {m['pieces'] / m['num_samples']:>11.1f} {m['mean_fill']:>11.3f} "
              f"{batch_fill:>13.3f} {statistics.mean(tokens[name]):>13.0f} {rate[name]:>10.0f} "
              f"{rate[name] / rate['unpacked']:>5.2f}x")
    print("targets: packed fill >= 0.95, packed real tokens/s >= 2x unpacked")


if __name__ == "__main__":
    main()
