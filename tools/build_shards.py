"""Tokenizer + shards in one go (what `megakd data tokenizer` then `megakd data shards` do).

    python tools/build_shards.py --input corpus/ --vocab-size 128000 --seq-len 512 --out data/
writes data/tokenizer/ (skipped with --tokenizer DIR) and data/shards/.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from megakd.data.shards import write_shards
from megakd.data.tokenizer import Tokenizer, train_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--input", nargs="+", required=True,
                        help=".txt/.txt.gz/.jsonl/.jsonl.gz, directories, HF datasets")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--tokenizer", type=Path, help="an existing tokenizer directory (else one is trained)")
    parser.add_argument("--vocab-size", type=int, help="needed when training a tokenizer")
    parser.add_argument("--input-sentence-size", type=int, default=2_000_000)
    parser.add_argument("--samples-per-shard", type=int, default=8192)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--text-field", default="text")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.tokenizer:
        tok = Tokenizer.load(args.tokenizer)
    elif args.vocab_size:
        tok = train_tokenizer(args.input, args.vocab_size, args.out / "tokenizer",
                              input_sentence_size=args.input_sentence_size)
    else:
        parser.error("give --tokenizer DIR or --vocab-size N")
    write_shards(args.input, tok, args.seq_len, args.out / "shards", samples_per_shard=args.samples_per_shard,
                 num_workers=args.workers, text_field=args.text_field)


if __name__ == "__main__":
    main()
