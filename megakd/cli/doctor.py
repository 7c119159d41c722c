"""`megakd doctor`: what this machine has against what megakd needs."""

from __future__ import annotations

import argparse

from megakd.cli.common import _Command, _examples, emit


def cmd_doctor(args: argparse.Namespace) -> int:
    """Exit 0 when megakd's own requirements are met (GPU, NCCL and extras are reported, not required), else 1."""
    from megakd.bench.doctor import doctor_report

    text, base_ok = doctor_report()
    emit(text)
    return 0 if base_ok else 1


def add_doctor(sub, command: _Command) -> None:
    d = command(sub, "doctor", "what this machine has (torch, CUDA, NCCL, Triton, DeepSpeed, GPUs, launcher "
                "variables) against what megakd needs, and what will not work here", _examples(
                    "megakd doctor  # on a login node, then on a GPU node (srun megakd doctor)",
                    "megakd doctor > doctor.txt  # beside a bug report"))
    d.set_defaults(func=cmd_doctor)
