"""`megakd <command>`: the single entry point (pretrain, data, and the commands built on them).

Each command is a small function that parses its arguments and calls the library; errors in
user input (config keys, files) end the process with a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from megakd.config import ConfigError, load_config

log = logging.getLogger("megakd")


def setup_logging(level: str = "INFO") -> None:
    """One log format for every process; non-zero ranks only log warnings and errors."""
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    logging.basicConfig(
        level=getattr(logging, level) if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("matplotlib", "PIL", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def cmd_pretrain(args: argparse.Namespace) -> int:
    from megakd.engine.pretrain import run_pretraining

    return _train(args, run_pretraining)


def cmd_distill(args: argparse.Namespace) -> int:
    from megakd.distill.dwt import run_distill

    return _train(args, run_distill)


def _train(args: argparse.Namespace, run) -> int:
    cfg = load_config(args.config, args.overrides)
    result = run(cfg, resume=args.resume)
    if result.preempted:
        log.warning("preempted at step %d; run the same command with --resume auto to continue", result.step)
    else:
        log.info("finished %d steps; run directory %s", result.step, result.run_dir)
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from megakd.finetune.config import FinetuneConfig

    cfg = load_config(args.config, args.overrides, cls=FinetuneConfig)
    if cfg.soteacher.enabled:
        from megakd.distill.soteacher import run_soteacher as run
    elif cfg.tgt.enabled:
        from megakd.distill.tgt import run_tgt as run
    else:
        from megakd.finetune.trainer import run_finetune as run
    run(cfg)
    log.info("fine-tuning finished; summary in %s/summary.json", cfg.run.dir)
    return 0


def cmd_eval_rtd(args: argparse.Namespace) -> int:
    import json

    from megakd.distill.rtd_eval import evaluate_rtd

    try:
        report = evaluate_rtd(args.generator, args.discriminator, args.shards, args.tokenizer,
                              num_batches=args.batches, batch_size=args.batch_size, seed=args.seed,
                              mask_prob=args.mask_prob)
    except ValueError as err:  # shards, tokenizer or model files that do not fit
        print(f"megakd: error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


def cmd_data_tokenizer(args: argparse.Namespace) -> int:
    from megakd.data.tokenizer import train_tokenizer

    tok = train_tokenizer(args.input, args.vocab_size, args.out, input_sentence_size=args.input_sentence_size,
                          seed=args.seed)
    log.info("tokenizer with %d pieces (vocab hash %s) in %s", tok.vocab_size, tok.vocab_hash, args.out)
    return 0


def cmd_data_shards(args: argparse.Namespace) -> int:
    from megakd.data.shards import write_shards
    from megakd.data.tokenizer import Tokenizer

    manifest = write_shards(args.input, Tokenizer.load(args.tokenizer), args.seq_len, args.out,
                            samples_per_shard=args.samples_per_shard, num_workers=args.workers)
    log.info("%d samples in %d shards in %s", manifest["num_samples"], len(manifest["shards"]), args.out)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from megakd.convert import ConversionError, from_hf, to_hf

    try:
        if args.convert_command == "to-hf":
            written = to_hf(args.src, args.out, force=args.force)
            log.info("wrote %s", ", ".join(f"{args.out}/{d} ({arch})" for d, arch in written.items()))
        else:
            kind, _ = from_hf(args.src, args.out, force=args.force)
            log.info("wrote megakd %s model directory %s", kind, args.out)
    except ConversionError as err:
        print(f"megakd: error: {err}", file=sys.stderr)
        return 2
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megakd", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("pretrain", help="ELECTRA (DecoupledOptim or original) or BERT-MLM pretraining")
    p.add_argument("-c", "--config", required=True, help="YAML recipe, e.g. configs/electra-tiny.yaml")
    p.add_argument("--resume", help="'auto' (newest checkpoint in run.dir, if any) or a checkpoint directory")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. train.max_steps=100")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("finetune", help="sequence (pair) classification/regression: fine-tuning, label "
                       "regularisation, SoTeacher, TGT")
    p.add_argument("-c", "--config", required=True, help="YAML recipe, e.g. configs/finetune-rt.yaml")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. finetune.seeds=[1,2,3]")
    p.set_defaults(func=cmd_finetune)

    p = sub.add_parser("distill", help="DWT: pretraining with a frozen teacher MLM (distill.teacher) on the "
                       "student's MLM loss")
    p.add_argument("-c", "--config", required=True, help="YAML recipe, e.g. configs/dwt-weak.yaml")
    p.add_argument("--resume", help="'auto' (newest checkpoint in run.dir, if any) or a checkpoint directory")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. distill.teacher=runs/teacher")
    p.set_defaults(func=cmd_distill)

    p = sub.add_parser("eval-rtd", help="score discriminators against one fixed generator on fixed masked data "
                       "(RTD accuracy, precision, recall, F1 as JSON)")
    p.add_argument("--generator", required=True, help="run, checkpoint, megakd model dir or HF ELECTRA generator")
    p.add_argument("--discriminator", required=True, nargs="+", help="one or more runs, checkpoints, megakd model "
                   "dirs or HF ElectraForPreTraining dirs")
    p.add_argument("--shards", required=True, help="shard directory from `megakd data shards`")
    p.add_argument("--tokenizer", help="tokenizer directory (default: the generator's own)")
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0, help="fixes the masks and the generator's samples")
    p.add_argument("--mask-prob", type=float, default=0.15)
    p.add_argument("--out", help="also write the JSON report to this file")
    p.set_defaults(func=cmd_eval_rtd)

    data = sub.add_parser("data", help="tokenizer training and WebDataset shard writing")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    t = data_sub.add_parser("tokenizer", help="train a cased SentencePiece BPE tokenizer")
    t.add_argument("--input", nargs="+", required=True, help="text/.gz/.jsonl files or directories")
    t.add_argument("--vocab-size", type=int, required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--input-sentence-size", type=int, default=2_000_000,
                   help="sentences sampled for training (bounds memory on large corpora)")
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_data_tokenizer)
    s = data_sub.add_parser("shards", help="tokenize and pack documents into WebDataset shards")
    s.add_argument("--input", nargs="+", required=True, help="text/.gz/.jsonl files, directories or HF datasets")
    s.add_argument("--tokenizer", required=True)
    s.add_argument("--seq-len", type=int, required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--samples-per-shard", type=int, default=10_000)
    s.add_argument("--workers", type=int, default=1)
    s.set_defaults(func=cmd_data_shards)

    conv = sub.add_parser("convert", help="HuggingFace export/import")
    conv_sub = conv.add_subparsers(dest="convert_command", required=True)
    for name, help_text, src_help in (
        ("to-hf", "run/checkpoint/model dir -> HF dirs (ELECTRA: OUT/discriminator, OUT/generator)",
         "run directory (newest checkpoint), checkpoint directory or megakd model directory"),
        ("from-hf", "local HF BERT/ELECTRA dir -> megakd model directory", "local HF model directory"),
    ):
        c = conv_sub.add_parser(name, help=help_text)
        c.add_argument("src", help=src_help)
        c.add_argument("out", help="output directory (written atomically)")
        c.add_argument("--force", action="store_true", help="replace a non-empty OUT")
        c.set_defaults(func=cmd_convert)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as err:
        print(f"megakd: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
