"""One AdamW step over ELECTRA-small's discriminator parameters: torch's foreach path against the
fused kernel that `megakd.engine.optim.build_optimizer` uses (on CPU and CUDA), sides alternating.

    python tools/bench_optimizer.py [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from megakd.config import OptimizerConfig
from megakd.engine.optim import param_groups
from megakd.models.electra import Discriminator
from megakd.models.encoder import EncoderConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Discriminator(EncoderConfig(vocab_size=30_522, hidden_size=256, num_layers=12, num_heads=4,
                                        intermediate_size=1024, embedding_size=128)).to(device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    cfg = OptimizerConfig(lr=1e-4)
    sides = {name: torch.optim.AdamW(param_groups(model.named_parameters(), cfg.weight_decay), lr=cfg.lr,
                                     betas=tuple(cfg.betas), eps=cfg.eps, **kwargs)
             for name, kwargs in (("foreach", {"foreach": True}), ("fused", {"fused": True}))}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(args.steps + 1):
        for name, opt in sides.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first step allocates the state
                times[name].append(time.perf_counter() - start)
    params = sum(p.numel() for p in model.parameters())
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"{params / 1e6:.1f}M parameters, median of {args.steps} steps, sides alternating")
    foreach, fused = (statistics.median(times[n]) for n in ("foreach", "fused"))
    print(f"AdamW step: foreach {foreach * 1e3:.0f} ms, fused {fused * 1e3:.0f} ms, {foreach / fused:.1f}x")


if __name__ == "__main__":
    main()
