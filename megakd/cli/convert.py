"""`megakd convert`: HuggingFace export and import."""

from __future__ import annotations

import argparse

from megakd.cli.common import _Command, _examples, log


def cmd_convert(args: argparse.Namespace) -> int:
    from megakd.convert import from_hf, to_hf

    if args.convert_command == "to-hf":
        written = to_hf(args.src, args.out, force=args.force)
        log.info("wrote %s", ", ".join(f"{args.out}/{d} ({arch})" for d, arch in written.items()))
    else:
        kind, _ = from_hf(args.src, args.out, force=args.force)
        log.info("wrote megakd %s model directory %s", kind, args.out)
    return 0


def add_convert(sub, command: _Command) -> None:
    convert_examples = ("megakd convert to-hf runs/electra-tiny runs/electra-tiny-hf  # OUT/discriminator, "
                        "OUT/generator",
                        "megakd convert from-hf runs/electra-tiny-hf/discriminator models/electra-tiny-disc",
                        "megakd finetune -c configs/finetune-rt.yaml model.path=models/electra-tiny-disc")
    conv = command(sub, "convert", "HuggingFace export/import", _examples(*convert_examples))
    conv_sub = conv.add_subparsers(dest="convert_command", required=True)
    for name, help_text, src_help, examples in (
        ("to-hf", "run/checkpoint/model dir -> HF dirs (ELECTRA: OUT/discriminator, OUT/generator)",
         "run directory (newest checkpoint), checkpoint directory or megakd model directory",
         ("megakd convert to-hf runs/electra-tiny runs/electra-tiny-hf",
          "megakd convert to-hf runs/electra-tiny/checkpoints/step_00000400 runs/step400-hf --force")),
        ("from-hf", "local HF BERT/ELECTRA dir -> megakd model directory", "local HF model directory",
         convert_examples[1:]),
    ):
        c = command(conv_sub, name, help_text, _examples(*examples))
        c.add_argument("src", help=src_help)
        c.add_argument("out", help="output directory (written atomically)")
        c.add_argument("--force", action="store_true", help="replace a non-empty OUT")
        c.set_defaults(func=cmd_convert)
