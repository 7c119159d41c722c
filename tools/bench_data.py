"""Data-pipeline throughput: megakd shard streaming + masking + collation vs HF datasets + collator.

Both paths read the same pre-tokenized samples (bundled corpus, seq_len 512) and produce padded,
masked micro-batches on one CPU core (in-process, torch threads = 1). Prints a table with the
ratio and how many CPU cores per GPU keep BERT-base fed at an assumed GPU rate, and the cost of
megakd's shard verification (sha256 while reading, token-id and length checks): the same loader
with ``verify=False``, a switch that exists only for this measurement, timed in the same run.

    python tools/bench_data.py [--seq-len 512] [--batch 32] [--batches 300] [--gpu-tokens-per-s 200000]
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# BERT-base training cost per token at seq 512: 6 * 110M params + attention (12 layers *
# 3 * 4 * 512 * 768) ≈ 0.66 + 0.057 ≈ 0.72 GFLOP. An A100 at 312 TFLOP/s bf16 peak and ~45% MFU
# gives ≈ 1.4e14 / 7.2e8 ≈ 195K tokens/s; we round to 200K. Override with --gpu-tokens-per-s.
DEFAULT_GPU_TOKENS_PER_S = 200_000


def time_paths(makers: list, batches: int, repeats: int) -> list[tuple[float, float]]:
    """Per path: median seconds per batch over ``repeats`` runs (each after one warm-up batch) and
    tokens per batch. The paths take turns within each repeat, so load from other processes on a
    shared machine falls on all of them alike."""
    runs: list[list[float]] = [[] for _ in makers]
    tokens = [0] * len(makers)
    for _ in range(repeats):
        for i, make_iter in enumerate(makers):
            it = make_iter()
            next(it)
            start = time.perf_counter()
            for b in itertools.islice(it, batches):
                tokens[i] += int(b["attention_mask"].sum())
            runs[i].append((time.perf_counter() - start) / batches)
            it.close()  # stop this path's DataLoader workers before the next path is timed
    return [(statistics.median(r), t / (batches * repeats)) for r, t in zip(runs, tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-tokens-per-s", type=float, default=DEFAULT_GPU_TOKENS_PER_S)
    parser.add_argument("--cache", default=os.path.join(tempfile.gettempdir(), "megakd-bench-data"))
    args = parser.parse_args()
    torch.set_num_threads(1)

    import datasets
    from torch.utils.data import DataLoader
    from transformers import DataCollatorForLanguageModeling

    from megakd.data.default_corpus import prepare_default_data
    from megakd.data.loader import PretrainingLoader
    from megakd.data.shard_reader import read_whole_shard
    from megakd.data.shards import read_manifest
    from megakd.data.storage import ShardStore
    from megakd.data.tokenizer import Tokenizer

    tok_dir, shards_dir = prepare_default_data(args.cache, vocab_size=args.vocab_size, seq_len=args.seq_len)
    tok = Tokenizer.load(tok_dir)
    manifest = read_manifest(shards_dir)

    def ours(workers: int, verify: bool = True):
        return lambda: iter(PretrainingLoader(shards_dir, tok, micro_batch_size=args.batch, num_workers=workers,
                                              verify=verify))

    # The HF path gets the very same samples, as an Arrow dataset on disk (memory-mapped on load).
    hf_dir = Path(args.cache) / f"hf-{shards_dir.parent.name}"
    if not hf_dir.exists():
        samples = [s.tolist() for e in manifest["shards"]
                   for s in read_whole_shard(ShardStore(shards_dir), e, manifest["dtype"])]
        datasets.Dataset.from_dict({"input_ids": samples}).save_to_disk(str(hf_dir))
    hf_ds = datasets.load_from_disk(str(hf_dir))
    collator = DataCollatorForLanguageModeling(tok.to_hf(), mlm_probability=0.15)

    def hf():
        def forever():
            while True:
                yield from DataLoader(hf_ds, batch_size=args.batch, shuffle=True, collate_fn=collator)
        return forever()

    rows = []
    paths = [("megakd PretrainingLoader, in-process", ours(0), 1),
             ("HF datasets + DataCollatorForLanguageModeling", hf, 1),
             ("megakd PretrainingLoader, 2 workers + main", ours(2), 2),
             ("megakd PretrainingLoader, in-process, no verify", ours(0, verify=False), 1)]
    timings = time_paths([make for _, make, _ in paths], args.batches, args.repeats)
    for (name, _, cores), (sec, tokens) in zip(paths, timings):
        rows.append((name, cores, args.batch / sec, tokens / sec))

    print(f"\nseq_len {args.seq_len}, micro-batch {args.batch}, {manifest['num_samples']} samples "
          f"(mean fill {manifest['mean_fill']:.3f}), {args.batches} batches x {args.repeats} runs, median\n")
    print(f"| {'path':48} | cores | samples/s | samples/s/core | tokens/s/core |")
    print(f"|{'-' * 50}|-------|-----------|----------------|---------------|")
    for name, cores, sps, tps in rows:
        print(f"| {name:48} | {cores:5} | {sps:9.0f} | {sps / cores:14.0f} | {tps / cores:13.0f} |")
    ours_core, hf_core = rows[0][2], rows[1][2]
    print(f"\nratio megakd / HF, samples/s per core: {ours_core / hf_core:.2f}x")
    verified, unverified = rows[0][2], rows[3][2]
    print(f"shard verification (sha256 + id/length checks): verified / unverified samples/s = "
          f"{verified / unverified:.3f} ({(1 - verified / unverified) * 100:+.1f} % cost)")

    need = args.gpu_tokens_per_s / args.seq_len
    print(f"\nGPU demand (assumed BERT-base on one A100, seq {args.seq_len}): {args.gpu_tokens_per_s:,.0f} tokens/s "
          f"= {args.gpu_tokens_per_s:,.0f} / {args.seq_len} = {need:.0f} samples/s")
    for name, _, _, _ in rows[:2]:
        per_core = next(r[2] / r[1] for r in rows if r[0] == name)
        print(f"  {name}: {need:.0f} / {per_core:.0f} = {need / per_core:.2f} CPU cores per GPU")


if __name__ == "__main__":
    main()
