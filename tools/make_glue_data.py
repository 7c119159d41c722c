"""Small GLUE-format directories from the bundled sentences (megakd/glue/synthetic.py), for the CPU example.

    python tools/make_glue_data.py --out glue_data                   # the GLUE download script's layout
    python tools/make_glue_data.py --out glue_hf --layout parquet    # the hub's parquet files per task

Every task's files and columns as distributed, with stand-in content: the scores a model gets on
them are not GLUE's (docs/glue.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megakd.glue.synthetic import write_glue_data
from megakd.glue.tasks import TASKS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="the directory to write (glue.data_dir)")
    parser.add_argument("--layout", choices=["glue", "disk", "parquet"], default="glue",
                        help="glue: glue_data/CoLA/train.tsv ...; disk: datasets' save_to_disk; parquet: the hub's")
    parser.add_argument("--tasks", default=",".join(TASKS), help="comma-separated GLUE tasks")
    parser.add_argument("--train", type=int, default=512, help="train examples per task")
    parser.add_argument("--dev", type=int, default=256, help="examples per dev split")
    parser.add_argument("--test", type=int, default=128, help="examples per test split")
    args = parser.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    if unknown := [t for t in tasks if t not in TASKS]:
        parser.error(f"--tasks: unknown {unknown[0]!r}; expected some of {', '.join(TASKS)}")
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"--out {args.out}: not empty; choose a new directory")
    write_glue_data(args.out, args.layout, tasks, args.train, args.dev, args.test)
    print(f"wrote {', '.join(tasks)} to {args.out} ({args.layout} layout)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
