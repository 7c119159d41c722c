"""Tokens/s and MFU of one ELECTRA training step: megakd against the HuggingFace reference, CPU or CUDA.

The HF side is written the way an HF user would: `ElectraForMaskedLM` generator (dense logits
over every position, CE with -100 labels), multinomial sampling at masked positions,
`ElectraForPreTraining` discriminator, and the same two AdamW optimizers (DecoupledOptim
settings) as megakd. Both sides see the same batch (random token ids through the loader's own
collation and 15% masking) and the same
model sizes; megakd runs its own GeneratorLoss / DiscriminatorLoss (sparse MLM head, fused
losses) and optimizer steps. Timings alternate between the two sides (and a dense fp32 matmul
that measures the machine's peak at the same thread count) to share machine noise.

The roofline columns: model FLOPs per token (`megakd.bench.flops`, the work the step must do:
sparse generator head, so the HF side's dense head counts as waste), the FLOP/s each side
achieves with that count, and MFU against the matmul peak. A short `torch.profiler` pass splits
megakd's step into data (collate + masking of the same batch, done by loader workers in training),
generator, sampling, discriminator and optimizer time.

    python tools/bench_electra_step.py                 # both shapes
    python tools/bench_electra_step.py --shape small --steps 10
    python tools/bench_electra_step.py --shape tiny --compile   # adds megakd with train.compile=true
    python tools/bench_electra_step.py --separate-qkv           # adds megakd with fused_qkv=false (ablation)
    python tools/bench_electra_step.py --torch-dropout          # adds megakd with torch's dropout masks (ablation)
    python tools/bench_electra_step.py --shape small --ops 12   # adds each side's 12 largest ops by time share
    python tools/bench_electra_step.py --precision bf16         # both sides' forwards under bf16 autocast
    python tools/bench_electra_step.py --device cuda            # the same table on a GPU
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import time
from unittest import mock

import numpy as np
import torch
from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

from device_audit import SIMULATED, SyncCounter, simulated_cuda
from megakd.bench.cluster import DTYPES
from megakd.bench.flops import step_flops
from megakd.bench.roofline import format_phases, matmul_seconds, op_shares, phase_seconds, roofline
from megakd.config import Config, OptimizerConfig
from megakd.data.masking import collate
from megakd.engine.backends import precision_autocast
from megakd.engine.losses import DiscriminatorLoss, GeneratorLoss
from megakd.engine.optim import build_optimizer
from megakd.engine.pretrain import compile_encoders
from megakd.engine.profiling import phase
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.models.hf_mapping import from_hf_state_dict
from megakd.objectives.electra import corrupt

# name: (generator (layers, hidden, heads, ffn), discriminator (layers, hidden, heads, ffn),
#        embedding, vocab, seq, batch)
SHAPES = {
    "tiny": ((2, 64, 2, 256), (3, 128, 4, 512), 64, 8_000, 128, 32),  # configs/electra-tiny.yaml
    "small": ((12, 64, 1, 256), (12, 256, 4, 1024), 128, 30_522, 128, 32),
    "vocab128k": ((4, 256, 4, 1024), (4, 256, 4, 1024), 256, 128_000, 128, 16),
}
TARGETS = {"tiny": 1.0, "small": 2.0, "vocab128k": 3.5}
LOSS_WEIGHT = 50.0


def encoder_config(dims, embedding, vocab, seq) -> EncoderConfig:
    layers, hidden, heads, ffn = dims
    return EncoderConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                         intermediate_size=ffn, embedding_size=embedding, max_position_embeddings=seq,
                         dropout=0.1, attention_dropout=0.1)


def make_samples(vocab: int, seq: int, batch: int, seed: int = 0) -> list[np.ndarray]:
    """`batch` full-length samples [CLS] ... [SEP] of random non-special ids."""
    ids = np.random.default_rng(seed).integers(5, vocab, (batch, seq))
    ids[:, 0], ids[:, -1] = 1, 2
    return list(ids)


def make_batch(samples: list[np.ndarray], seed: int = 0) -> dict[str, torch.Tensor]:
    """The loader's own collation and 15% masking ([PAD]=0, [CLS]=1, [SEP]=2, [MASK]=4 never masked)."""
    n = len(samples)
    return collate(samples, [0] * n, list(range(seed * n, (seed + 1) * n)), pad_id=0, mask_id=4,
                   special_ids=(0, 1, 2, 3, 4), seed=0, mask_prob=0.15)


class MegakdStep:
    def __init__(self, gen_cfg: EncoderConfig, disc_cfg: EncoderConfig, opt: OptimizerConfig, device: torch.device,
                 precision: str, compile_: bool = False):
        # "auto" kernels: Triton on CUDA, the chunked torch path on CPU (what training uses).
        self.gen = GeneratorLoss(MaskedLM(gen_cfg), kernel_backend="auto").to(device)
        self.disc = DiscriminatorLoss(Discriminator(disc_cfg), kernel_backend="auto").to(device)
        if compile_:
            compile_encoders([self.gen.model, self.disc.model])
        self.opt_g = build_optimizer(self.gen.named_parameters(), opt)
        self.opt_d = build_optimizer(self.disc.named_parameters(), opt)
        self.rng = torch.Generator(device).manual_seed(0)
        self.autocast = functools.partial(precision_autocast, precision, device)

    def __call__(self, batch) -> None:
        with phase("generator"):
            with self.autocast():
                g = self.gen(batch, self.rng)
            g["loss"].backward()
        with phase("discriminator"):
            corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], g["samples"], g["positions"])
            with self.autocast():
                d = self.disc(corrupted, batch["input_ids"], batch["attention_mask"])
            (LOSS_WEIGHT * d["loss"]).backward()
        with phase("optimizer"):
            for opt in (self.opt_g, self.opt_d):
                opt.step()
                opt.zero_grad(set_to_none=True)


class HFStep:
    def __init__(self, gen_cfg: EncoderConfig, disc_cfg: EncoderConfig, opt: OptimizerConfig, device: torch.device,
                 precision: str):
        def hf(cfg: EncoderConfig) -> ElectraConfig:
            return ElectraConfig(vocab_size=cfg.vocab_size, embedding_size=cfg.embed_dim, hidden_size=cfg.hidden_size,
                                 num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                                 intermediate_size=cfg.intermediate_size,
                                 max_position_embeddings=cfg.max_position_embeddings,
                                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)

        self.gen = ElectraForMaskedLM(hf(gen_cfg)).to(device)
        self.disc = ElectraForPreTraining(hf(disc_cfg)).to(device)
        self.opt_g = build_optimizer(self.gen.named_parameters(), opt)
        self.opt_d = build_optimizer(self.disc.named_parameters(), opt)
        self.autocast = functools.partial(precision_autocast, precision, device)

    def __call__(self, batch) -> None:
        labels = batch["input_ids"].masked_fill(~batch["mlm_mask"], -100)
        with self.autocast():
            out = self.gen(input_ids=batch["masked_input_ids"], attention_mask=batch["attention_mask"], labels=labels)
        out.loss.backward()
        with torch.no_grad():
            probs = torch.softmax(out.logits[batch["mlm_mask"]].float(), dim=-1)
            samples = torch.multinomial(probs, 1).squeeze(-1)
        corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], samples)
        rtd_labels = (corrupted != batch["input_ids"]).long()
        with self.autocast():
            d = self.disc(input_ids=corrupted, attention_mask=batch["attention_mask"], labels=rtd_labels)
        (LOSS_WEIGHT * d.loss).backward()
        for opt in (self.opt_g, self.opt_d):
            opt.step()
            opt.zero_grad(set_to_none=True)


class TorchDropoutStep:
    """A megakd step whose dropout draws torch's masks (`bernoulli_`, SDPA) instead of megakd's CPU lanes."""

    def __init__(self, step: MegakdStep):
        self.step = step

    def __call__(self, batch) -> None:
        with mock.patch("megakd.models.dropout.uses_cpu_mask", return_value=False):
            self.step(batch)


def check_same_model(gen_cfg: EncoderConfig, hf_step: HFStep) -> None:
    """The two sides must be the same architecture: HF's weights load strictly into megakd's model."""
    megakd_gen = MaskedLM(gen_cfg)
    sd = {k: v.cpu() for k, v in from_hf_state_dict(hf_step.gen.state_dict(), "electra_generator").items()}
    missing, unexpected = megakd_gen.load_state_dict(sd, strict=False)
    assert not unexpected and all("tied" in k for k in missing), (missing, unexpected)


def model_flops(gen_cfg: EncoderConfig, disc_cfg: EncoderConfig, batch: dict[str, torch.Tensor]) -> float:
    """Model FLOPs of one step on `batch` (the count `megakd plan` uses)."""
    cfg = Config()
    cfg.model.generator, cfg.model.discriminator = gen_cfg, disc_cfg
    sequences, seq = batch["input_ids"].shape
    return step_flops(cfg, sequences, seq, masked=int(batch["mlm_mask"].sum())).model


def count_syncs(gen_cfg: EncoderConfig, disc_cfg: EncoderConfig, opt: OptimizerConfig,
                batch: dict[str, torch.Tensor]) -> SyncCounter:
    """Host-device syncs of one megakd step (after a warm-up step) on the simulated cuda:0
    (tools/device_audit.py): fp32, torch kernels, the sampling generator on the CPU as in training."""
    step = MegakdStep(gen_cfg, disc_cfg, opt, torch.device("cpu"), "fp32")
    with simulated_cuda() as syncs:
        for task in (step.gen, step.disc):
            task.to(SIMULATED)
            task.kernel_backend = "torch"
        batch = {k: v.to(SIMULATED) for k, v in batch.items()}
        step(batch)
        syncs.sites.clear()
        step(batch)
    return syncs


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(shape: str, steps: int, warmup: int, matmul_n: int, compile_: bool, separate_qkv: bool,
          torch_dropout: bool, ops: int, device: torch.device, precision: str) -> dict:
    gen_dims, disc_dims, emb, vocab, seq, batch = SHAPES[shape]
    gen_cfg, disc_cfg = (encoder_config(d, emb, vocab, seq) for d in (gen_dims, disc_dims))
    opt = OptimizerConfig(lr=1e-4)
    torch.manual_seed(0)
    sides = {"megakd": MegakdStep(gen_cfg, disc_cfg, opt, device, precision),
             "hf": HFStep(gen_cfg, disc_cfg, opt, device, precision)}
    if compile_:
        sides["megakd_compiled"] = MegakdStep(gen_cfg, disc_cfg, opt, device, precision, compile_=True)
    if separate_qkv:
        sides["megakd_separate_qkv"] = MegakdStep(
            *(dataclasses.replace(c, fused_qkv=False) for c in (gen_cfg, disc_cfg)), opt, device, precision)
    if torch_dropout:
        sides["megakd_torch_dropout"] = TorchDropoutStep(MegakdStep(gen_cfg, disc_cfg, opt, device, precision))
    check_same_model(gen_cfg, sides["hf"])
    samples = [make_samples(vocab, seq, batch, seed=i) for i in range(4)]
    data = [{k: v.to(device) for k, v in make_batch(s, seed=i).items()} for i, s in enumerate(samples)]
    times: dict[str, list[float]] = {name: [] for name in [*sides, "matmul"]}
    for i in range(warmup + steps):
        for name, step in sides.items():
            _sync(device)
            t0 = time.perf_counter()
            step(data[i % len(data)])
            _sync(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
        if i >= warmup:
            times["matmul"].append(matmul_seconds(DTYPES[precision], device, matmul_n, iters=1))
    tokens = batch * seq
    flops = model_flops(gen_cfg, disc_cfg, data[0])
    peak = 2 * matmul_n**3 / statistics.median(times["matmul"])
    result = {"shape": shape, "precision": precision, "tokens_per_step": tokens, "flops_per_token": flops / tokens,
              "peak_flops": peak}
    for name in sides:
        step_s = statistics.median(times[name])
        result[f"{name}_tokens_per_s"] = tokens / step_s
        result[name] = roofline(flops, tokens, step_s, peak)
    result["ratio"] = result["megakd_tokens_per_s"] / result["hf_tokens_per_s"]
    if compile_:
        result["compile_ratio"] = result["megakd_compiled_tokens_per_s"] / result["megakd_tokens_per_s"]
    if separate_qkv:
        result["fused_qkv_ratio"] = result["megakd_tokens_per_s"] / result["megakd_separate_qkv_tokens_per_s"]
    if torch_dropout:
        result["dropout_ratio"] = result["megakd_tokens_per_s"] / result["megakd_torch_dropout_tokens_per_s"]
    megakd = sides["megakd"]

    def profiled_step() -> None:
        with phase("data"):
            batch_ = {k: v.to(device) for k, v in make_batch(samples[0]).items()}
        megakd(batch_)

    result["phases"] = phase_seconds(profiled_step, 2, device)
    result["syncs"] = count_syncs(gen_cfg, disc_cfg, opt, make_batch(samples[0]))
    if ops:
        result["ops"] = {name: dict(list(op_shares(functools.partial(step, data[0]), 2, device).items())[:ops])
                         for name, step in sides.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also time megakd with compiled encoders")
    parser.add_argument("--separate-qkv", action="store_true",
                        help="also time megakd with three q/k/v projections instead of one fused (the ablation)")
    parser.add_argument("--torch-dropout", action="store_true",
                        help="also time megakd with torch's dropout masks instead of its CPU lanes (the ablation)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda (on CUDA the megakd side uses the Triton kernels)")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="both sides' forwards at fp32, or under bf16 autocast "
                             "(MFU then against the bf16 matmul peak)")
    parser.add_argument("--ops", type=int, default=0,
                        help="also print each side's N largest operators by share of the step's self time (profiled)")
    parser.add_argument("--matmul-n", type=int, default=2048, help="size of the square matmul that measures the peak")
    args = parser.parse_args()
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    device = torch.device(args.device)
    rows = [bench(s, args.steps, args.warmup, args.matmul_n, args.compile, args.separate_qkv, args.torch_dropout,
                  args.ops, device, args.precision) for s in shapes]
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else f"{torch.get_num_threads()} threads, {os.cpu_count()} cores")
    print(f"torch {torch.__version__}, {where}; median of "
          f"{args.steps} steps after {args.warmup} warm-up, {args.precision}, sides alternating with a "
          f"{args.matmul_n}x{args.matmul_n} {args.precision} matmul (the peak)")
    print(f"{'shape':<10} {'tokens/step':>11} {'megakd tok/s':>13} {'HF tok/s':>10} {'ratio':>7} {'target':>7} "
          f"{'MFLOP/tok':>10} {'peak GFLOP/s':>13} {'megakd GFLOP/s':>15} {'MFU':>6} {'HF MFU':>7}")
    for r in rows:
        print(f"{r['shape']:<10} {r['tokens_per_step']:>11} {r['megakd_tokens_per_s']:>13.0f} "
              f"{r['hf_tokens_per_s']:>10.0f} {r['ratio']:>6.2f}x {TARGETS[r['shape']]:>6.1f}x "
              f"{r['flops_per_token'] / 1e6:>10.1f} {r['peak_flops'] / 1e9:>13.1f} "
              f"{r['megakd']['achieved_flops'] / 1e9:>15.1f} {r['megakd']['mfu']:>6.1%} {r['hf']['mfu']:>7.1%}")
    for r in rows:
        if "compile_ratio" in r:
            print(f"{r['shape']} megakd with train.compile=true: {r['megakd_compiled_tokens_per_s']:.0f} tokens/s = "
                  f"{r['compile_ratio']:.2f}x eager, MFU {r['megakd_compiled']['mfu']:.1%} (target 1.2x)")
    for r in rows:
        if "fused_qkv_ratio" in r:
            print(f"{r['shape']} megakd with separate q/k/v projections: {r['megakd_separate_qkv_tokens_per_s']:.0f} "
                  f"tokens/s; fused QKV = {r['fused_qkv_ratio']:.2f}x separate")
    for r in rows:
        if "dropout_ratio" in r:
            print(f"{r['shape']} megakd with torch's dropout masks: {r['megakd_torch_dropout_tokens_per_s']:.0f} "
                  f"tokens/s; megakd's CPU dropout = {r['dropout_ratio']:.2f}x torch's")
    for r in rows:
        print(f"{r['shape']} megakd step split (profiled): {format_phases(r['phases'])}")
    for r in rows:
        syncs = r["syncs"]
        print(f"{r['shape']} megakd host-device syncs per optimizer step (simulated cuda): {syncs.total} ("
              + ", ".join(f"{n} {kind} at {site.rsplit('/', 1)[-1]}" for kind, site, n in syncs.top(4)) + ")")
    for r in rows:
        for side, shares in r.get("ops", {}).items():
            print(f"{r['shape']} {side} largest ops (share of self time, profiled): "
                  + ", ".join(f"{name.removeprefix('aten::')} {share:.1%}" for name, share in shares.items()))


if __name__ == "__main__":
    main()
