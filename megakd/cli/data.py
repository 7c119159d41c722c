"""`megakd data`: tokenizer training and shard writing."""

from __future__ import annotations

import argparse

from megakd.cli.common import _Command, _examples, log
from megakd.config import ConfigError


def cmd_data_tokenizer(args: argparse.Namespace) -> int:
    from megakd.data.tokenizer import train_tokenizer

    tok = train_tokenizer(args.input, args.vocab_size, args.out, input_sentence_size=args.input_sentence_size,
                          seed=args.seed)
    log.info("tokenizer with %d pieces (vocab hash %s) in %s", tok.vocab_size, tok.vocab_hash, args.out)
    return 0


def cmd_data_shards(args: argparse.Namespace) -> int:
    import functools

    from megakd.data.shards import in_valid_split, write_shards
    from megakd.data.storage import ShardStore
    from megakd.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(args.tokenizer)
    options = {"samples_per_shard": args.samples_per_shard, "num_workers": args.workers,
               "min_tokens": args.min_tokens, "pack": args.pack, "shuffle": args.shuffle}
    fraction = args.valid_fraction
    if fraction and not 0.0 < fraction < 1.0:
        raise ConfigError(f"--valid-fraction: expected a fraction in (0, 1), got {fraction}")
    in_valid = functools.partial(in_valid_split, fraction=fraction)
    keep_train = (lambda text: not in_valid(text)) if fraction else None
    manifest = write_shards(args.input, tokenizer, args.seq_len, args.out, keep=keep_train, **options)
    log.info("%d samples in %d shards in %s", manifest["num_samples"], len(manifest["shards"]), args.out)
    if fraction:
        valid = ShardStore(args.out).url("valid")
        manifest = write_shards(args.input, tokenizer, args.seq_len, valid, keep=in_valid, **options)
        log.info("held out %d samples in %d shards in %s", manifest["num_samples"], len(manifest["shards"]), valid)
    return 0


def add_data(sub, command: _Command) -> None:
    corpus = "megakd/data/corpus/austen.jsonl.gz megakd/data/corpus/kjv.jsonl.gz"
    data_examples = (f"megakd data tokenizer --input {corpus} --vocab-size 8000 --out data/tok",
                     f"megakd data shards --input {corpus} --tokenizer data/tok --seq-len 128 "
                     "--out data/shards --valid-fraction 0.01",
                     "megakd pretrain -c configs/electra-tiny.yaml data.tokenizer=data/tok "
                     "data.shards=data/shards")
    data = command(sub, "data", "tokenizer training and WebDataset shard writing", _examples(*data_examples))
    data_sub = data.add_subparsers(dest="data_command", required=True)
    t = command(data_sub, "tokenizer", "train a cased SentencePiece BPE tokenizer",
                _examples(*data_examples[::2]))
    t.add_argument("--input", nargs="+", required=True, help="text/.gz/.jsonl files or directories")
    t.add_argument("--vocab-size", type=int, required=True, help="pieces in the vocabulary")
    t.add_argument("--out", required=True, help="the tokenizer directory")
    t.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sentences sampled for training (bounds memory on large corpora)")
    t.add_argument("--seed", type=int, default=0, help="the sentence sample's seed")
    t.set_defaults(func=cmd_data_tokenizer)
    s = command(data_sub, "shards", "tokenize and pack documents into WebDataset shards",
                _examples(*data_examples[1:]))
    s.add_argument("--input", nargs="+", required=True, help="text/.gz/.jsonl files, directories or HF datasets")
    s.add_argument("--tokenizer", required=True,
                   help="a megakd tokenizer dir, or an HF tokenizer/model dir (WordPiece vocab.txt or tokenizer.json)")
    s.add_argument("--seq-len", type=int, required=True, help="tokens per sample")
    s.add_argument("--out", required=True,
                   help="the shard directory, or an s3:// or gs:// prefix (uploaded, manifest last)")
    s.add_argument("--samples-per-shard", type=int, default=10_000, help="samples in each shard file")
    s.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    s.add_argument("--valid-fraction", type=float, default=0.0,
                   help="hold out this fraction of documents (by a hash of their text) as OUT/valid/, "
                        "which pretraining finds by itself for train.eval_every")
    s.add_argument("--min-tokens", type=int, default=8, help="drop document pieces with fewer tokens")
    s.add_argument("--pack", action="store_true",
                   help="pack several short documents into one sample (per-document positions and attention)")
    s.add_argument("--shuffle", action="store_true",
                   help="write each shard's samples in a seeded random order (for data.read_block > 1)")
    s.set_defaults(func=cmd_data_shards)
