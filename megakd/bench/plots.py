"""PNG plots of `megakd bench` results: bandwidth vs message size, throughput vs world size."""

from __future__ import annotations

from pathlib import Path

from megakd.bench.cluster import COLLECTIVES


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_bandwidth(results: list[dict], labels: list[str], out: Path) -> Path:
    """Bus bandwidth against message size, one panel per collective, one line per result."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(COLLECTIVES), figsize=(5 * len(COLLECTIVES), 4), squeeze=False)
    for ax, op in zip(axes[0], COLLECTIVES):
        for res, label in zip(results, labels):
            rows = res.get("collectives", {}).get(op, [])
            if rows:
                ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_title(op)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_scaling(results: list[dict], out: Path) -> Path | None:
    """Training tokens/s (total and per device) against world size; None without training results."""
    rows = sorted((r["train"]["world_size"], r["train"]["tokens_per_s"]) for r in results if "train" in r)
    if not rows:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    worlds = [w for w, _ in rows]
    ax.plot(worlds, [t for _, t in rows], marker="o", label="total")
    ax.plot(worlds, [t / w for w, t in rows], marker="s", label="per device")
    ax.set_xlabel("world size")
    ax.set_ylabel("tokens/s")
    ax.set_xticks(worlds)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
