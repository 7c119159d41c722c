"""tf-idf + logistic regression on any fine-tuning task config: the floor of a downstream table.

    python tools/baseline_tfidf.py -c configs/finetune-rt.yaml
    python tools/baseline_tfidf.py -c configs/finetune-pairs.yaml --json runs/tfidf-pairs.json

Reads the task section (and `key=value` overrides such as task.max_train_examples=2000) of a
`megakd finetune` config, trains on its training split, prints the dev metrics. Deterministic (no
seeds); megakd/finetune/tfidf.py says how the features and the classifier are built.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megakd.config import load_config
from megakd.finetune.config import FinetuneConfig
from megakd.finetune.tfidf import tfidf_baseline


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True, help="a megakd finetune config (its task section is used)")
    parser.add_argument("--min-df", type=int, default=2, help="keep terms in at least this many train examples")
    parser.add_argument("--max-features", type=int, default=50_000)
    parser.add_argument("--json", type=Path, help="also write the result here")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides, cls=FinetuneConfig)
        result = tfidf_baseline(cfg.task, args.min_df, args.max_features)
    except (ValueError, FileNotFoundError) as err:
        print(f"baseline_tfidf: error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
