"""Bytes each rank and node fetches from storage over one epoch, by the loader's own order and assignment code.

No training and no data: a synthetic manifest (``--samples`` samples of ``--member-bytes`` each, in
shards of ``--samples-per-shard``) goes through the real :class:`megakd.data.order.ReaderOrder`
(``wanted``: what each DataLoader worker of a rank asks for in each shard group) and the real
ranged-read planner (:func:`megakd.data.shard_reader.coalesce`); only the fetch itself is skipped. Every
world size from 1 to ``--max-world`` (powers of two) and worker count in ``--workers`` is run for
the first node's ranks (``--gpus-per-node``); every rank is alike, so the max over them stands for all.

Prints, per layout: the largest rank's bytes (shard members, plus its part of the member indexes
the node fetches once into its cache) against its share of the corpus (corpus / world size), the
node's, the same ratio without the index cache (every reader fetching every index it needs), and
what the unindexed whole-shard reader fetched (every worker of every rank read the whole corpus).
Writes a plot with ``--plot PATH``.

    python tools/sim_reads.py [--samples 2000000] [--max-world 1024] [--workers 0 1 2 4 8] \
        [--read-block 1] [--plot docs/img/reads_per_rank.png]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from megakd.data.masking import Masking
from megakd.data.order import ReaderOrder, ReadPlan
from megakd.data.shard_reader import coalesce
from megakd.data.shards import INDEX_DTYPE
from megakd.data.storage import ShardStore


def synthetic_plan(args: argparse.Namespace, rank: int, world: int) -> ReadPlan:
    counts = [args.samples_per_shard] * (args.samples // args.samples_per_shard)
    if rest := args.samples % args.samples_per_shard:
        counts.append(rest)
    firsts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    entries = tuple({"file": f"shard-{i:06d}.tar", "samples": c, "first_index": f}
                    for i, (c, f) in enumerate(zip(counts, firsts)))
    return ReadPlan(
        store=ShardStore("unused"), indexed=True, entries=entries, dtype="uint16", total=sum(counts), seed=0,
        rank=rank, world_size=world, micro_batch_size=args.micro_batch, masking=Masking(0, 0, (), 0.15),
        shuffle_shards=args.shuffle_shards, skip_bad_shards=False, known_bad=frozenset(), vocab_size=1, seq_len=1,
        verify=True, overfetch=args.overfetch, read_block=args.read_block, index_cache=None,
    )


def reader_fetch(plan: ReadPlan, worker: int, readers: int, member: int) -> tuple[int, set[int]]:
    """One reader over epoch 0: bytes of its members' coalesced ranges, and the shards whose index it needs."""
    reader = ReaderOrder(plan, every=readers)
    reader.at_batch = worker
    data, touched = 0, set()
    for index in range(len(reader.epoch_groups(0)[0])):
        group = reader.group_at(0, index)
        for shard, wanted in zip(group.shards.tolist(), reader.wanted(group)):
            if len(wanted):
                starts = wanted.astype(np.int64) * member
                data += sum(end - start for start, end in coalesce(starts, starts + member, plan.overfetch))
                touched.add(shard)
    return data, touched


def simulate(args: argparse.Namespace) -> list[dict]:
    """Per layout: the first node's ranks over epoch 0. Indexes go through the node's cache, so the
    node fetches each index it needs once (the first epoch; later epochs fetch none); that is
    shared out evenly over the node's ranks. Without the cache every reader fetches them."""
    corpus = args.samples * args.member_bytes
    rows = []
    world = 1
    while world <= args.max_world:
        for workers in args.workers:
            readers = max(1, workers)
            ranks = range(min(world, args.gpus_per_node))
            data, node_shards, uncached = [], set(), 0
            for r in ranks:
                plan = synthetic_plan(args, r, world)
                rank_data = 0
                for k in range(readers):
                    got, touched = reader_fetch(plan, k, readers, args.member_bytes)
                    rank_data += got
                    node_shards |= touched
                    uncached += sum(plan.counts[s] for s in touched) * INDEX_DTYPE.itemsize
                data.append(rank_data)
            index = sum(synthetic_plan(args, 0, world).counts[s] for s in node_shards) * INDEX_DTYPE.itemsize
            per_rank = [d + index / len(ranks) for d in data]
            share = corpus / world
            rows.append({"world": world, "workers": workers, "share": share, "rank_max": max(per_rank),
                         "ratio": max(per_rank) / share, "node": sum(per_rank), "node_share": share * len(ranks),
                         "uncached_ratio": (max(data) + uncached / len(ranks)) / share,
                         "old_rank": readers * corpus})
        world *= 2
    return rows


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.3g} {unit}"
        n /= 1000
    return ""


def parser() -> argparse.ArgumentParser:
    """The simulation's settings (tools/doc_figures.py runs it with the defaults)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2_000_000, help="samples in the synthetic corpus")
    p.add_argument("--member-bytes", type=int, default=2048, help="bytes per tar member (2048 = seq 512, uint16)")
    p.add_argument("--samples-per-shard", type=int, default=10_000)
    p.add_argument("--shuffle-shards", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=32)
    p.add_argument("--read-block", type=int, default=1)
    p.add_argument("--overfetch", type=float, default=0.2)
    p.add_argument("--max-world", type=int, default=1024)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--workers", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    p.add_argument("--plot", type=Path, help="write a plot of fetched / share per rank here")
    return p


def main() -> None:
    args = parser().parse_args()
    rows = simulate(args)
    group = args.samples_per_shard * args.shuffle_shards * args.member_bytes
    print(f"corpus {human(args.samples * args.member_bytes)} ({args.samples} samples x {args.member_bytes} B), "
          f"shard group {human(group)}, micro-batch {args.micro_batch}, read_block {args.read_block}, "
          f"overfetch {args.overfetch}")
    print(f"{'world':>6} {'workers':>7} {'share/rank':>11} {'rank max':>10} {'rank/share':>10} "
          f"{'node':>10} {'node/share':>10} {'no cache':>8} {'whole-shard/rank':>16} {'saved':>7}")
    for r in rows:
        print(f"{r['world']:>6} {r['workers']:>7} {human(r['share']):>11} {human(r['rank_max']):>10} "
              f"{r['ratio']:>10.3f} {human(r['node']):>10} {r['node'] / r['node_share']:>10.3f} "
              f"{r['uncached_ratio']:>8.2f} {human(r['old_rank']):>16} {r['old_rank'] / r['rank_max']:>6.0f}x")
    worst = max(rows, key=lambda r: (r["rank_max"] - group) / r["share"])
    print(f"largest rank / share: {max(r['ratio'] for r in rows):.3f}; bound 1.2 x share + one group holds: "
          f"{all(r['rank_max'] <= 1.2 * r['share'] + group for r in rows)} (tightest: world {worst['world']}, "
          f"{worst['workers']} workers)")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 3.8))
        for workers in args.workers:
            mine = [r for r in rows if r["workers"] == workers]
            ax.plot([r["world"] for r in mine], [r["ratio"] for r in mine], marker="o", label=f"{workers} workers")
            ax.plot([r["world"] for r in mine], [r["old_rank"] / r["share"] for r in mine], ls=":", color="grey")
            ax.plot([r["world"] for r in mine], [r["uncached_ratio"] for r in mine], ls="--", lw=0.8,
                    color=ax.lines[-2].get_color())
        ax.axhline(1.2, color="red", lw=0.8, ls="--", label="1.2 x share")
        ax.set(xscale="log", yscale="log", xlabel="world size (ranks)", ylabel="bytes fetched per rank / share")
        ax.set_title("Reads per rank, first epoch (dashed: no index cache, dotted: whole shards)", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
