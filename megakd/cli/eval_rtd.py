"""`megakd eval-rtd`: discriminators scored against one fixed generator on fixed masked data."""

from __future__ import annotations

import argparse
import sys

from megakd.cli.common import _Command, _examples


def cmd_eval_rtd(args: argparse.Namespace) -> int:
    import json

    from megakd.eval.rtd import evaluate_rtd

    report = evaluate_rtd(args.generator, args.discriminator, args.shards, args.tokenizer,
                          num_batches=args.batches, batch_size=args.batch_size, seed=args.seed,
                          mask_prob=args.mask_prob)
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


def add_eval_rtd(sub, command: _Command) -> None:
    p = command(sub, "eval-rtd", "score discriminators against one fixed generator on fixed masked data (RTD "
                "accuracy, precision, recall, F1 as JSON)", _examples(
                    "megakd eval-rtd --generator runs/rtd-generator-tiny --discriminator runs/electra-tiny "
                    "--shards data/shards",
                    "megakd eval-rtd --generator runs/rtd-generator-tiny --discriminator runs/electra-tiny "
                    "runs/dwt-electra-tiny --shards data/shards --batches 200 --out rtd.json",
                    note="Every model trained on one tokenizer, e.g. with data.tokenizer=data/tok "
                         "data.shards=data/shards (`megakd data --help`)."))
    p.add_argument("--generator", required=True, help="run, checkpoint, megakd model dir or HF ELECTRA generator")
    p.add_argument("--discriminator", required=True, nargs="+", help="one or more runs, checkpoints, megakd model "
                   "dirs or HF ElectraForPreTraining dirs")
    p.add_argument("--shards", required=True,
                   help="shard directory (or s3://, gs://, http(s):// URL) from `megakd data shards`")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the generator's own)")
    p.add_argument("--batches", type=int, default=50, help="batches scored")
    p.add_argument("--batch-size", type=int, default=32, help="samples per batch")
    p.add_argument("--seed", type=int, default=0, help="fixes the masks and the generator's samples")
    p.add_argument("--mask-prob", type=float, default=0.15, help="fraction of tokens masked and resampled")
    p.add_argument("--out", help="also write the JSON report to this file")
    p.set_defaults(func=cmd_eval_rtd)
