"""Draw docs/img/downstream_rt.png: RT accuracy gain over random init per pretraining draw, with the tf-idf floor.

    python tools/plot_downstream.py            # reads docs/img/downstream_rt.csv, writes the PNG beside it

The numbers are the measured ones of docs/recipes.md ("Does pretraining pay off here?"); the CSV holds
them so that the picture can be redrawn, not re-measured.
"""

from __future__ import annotations

import argparse
import csv
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TFIDF_RT = 0.822  # tools/baseline_tfidf.py on the same split
RANDOM_INIT_RT = 0.757  # 4 x 128 from random init, fine-tuned with the same defaults


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--csv", type=Path, default=ROOT / "docs/img/downstream_rt.csv")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/img/downstream_rt.png")
    args = parser.parse_args()
    rows = defaultdict(list)
    with args.csv.open() as f:
        for row in csv.DictReader(line for line in f if not line.startswith("#")):
            rows[row["recipe"]].append(row)
    fig, ax = plt.subplots(figsize=(8.4, 3.2), dpi=110)
    for y, draws in enumerate(reversed(list(rows.values()))):
        for i, d in enumerate(draws):
            gain = 100 * (float(d["accuracy"]) - float(d["random_init"]))
            ax.errorbar(gain, y + (i - (len(draws) - 1) / 2) * 0.18, xerr=100 * float(d["std"]), fmt="o",
                        color="tab:blue", capsize=3, ms=5)
    ax.set_yticks(range(len(rows)), list(reversed(list(rows))))
    ax.axvline(0, color="grey", lw=1)
    ax.axvline(3, color="tab:green", ls=":", lw=1)
    ax.axvline(100 * (TFIDF_RT - RANDOM_INIT_RT), color="tab:red", ls="--", lw=1)
    ax.text(0.1, len(rows) - 0.45, "random init", color="grey", fontsize=8)
    ax.text(3.1, len(rows) - 0.45, "+3 target", color="tab:green", fontsize=8)
    ax.text(100 * (TFIDF_RT - RANDOM_INIT_RT) - 1.6, len(rows) - 0.45, "tf-idf floor", color="tab:red", fontsize=8)
    ax.set_xlim(-0.5, 7.5)
    ax.set_ylim(-0.6, len(rows) - 0.2)
    ax.set_xlabel("RT dev accuracy over the same architecture from random init, points (± std, 5 seeds)", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
