"""tf-idf + logistic regression on any fine-tuning task config: the floor of a downstream table.

    python tools/baseline_tfidf.py -c configs/finetune-rt.yaml
    python tools/baseline_tfidf.py -c configs/finetune-pairs.yaml --json runs/tfidf-pairs.json

Reads the task section (and `key=value` overrides such as task.max_train_examples=2000) of a
`megakd finetune` config, trains on its training split, prints the dev metrics. Deterministic (no
seeds); megakd/finetune/tfidf.py says how the features and the classifier are built. With the
default features the result is also recorded, and `megakd finetune` on the same task shows it
beside its score (megakd/finetune/baselines.py).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path

from megakd.config import load_config
from megakd.finetune.baselines import cache_tfidf_floor
from megakd.finetune.config import FinetuneConfig
from megakd.finetune.tfidf import tfidf_baseline

# tfidf_baseline's own defaults: only a floor with these is the one `megakd finetune` shows beside its score.
DEFAULTS = {name: p.default for name, p in inspect.signature(tfidf_baseline).parameters.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", required=True, help="a megakd finetune config (its task section is used)")
    parser.add_argument("--min-df", type=int, default=DEFAULTS["min_df"],
                        help="keep terms in at least this many train examples")
    parser.add_argument("--max-features", type=int, default=DEFAULTS["max_features"])
    parser.add_argument("--json", type=Path, help="also write the result here")
    args, overrides = parser.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides, cls=FinetuneConfig)
        result = tfidf_baseline(cfg.task, args.min_df, args.max_features)
    except (ValueError, FileNotFoundError) as err:
        print(f"baseline_tfidf: error: {err}", file=sys.stderr)
        return 2
    text = json.dumps(result, indent=2)
    if (args.min_df, args.max_features) == (DEFAULTS["min_df"], DEFAULTS["max_features"]):
        print(f"recorded in {cache_tfidf_floor(cfg.task, result)}: megakd finetune on this task shows it",
              file=sys.stderr)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
