"""Tokens/s of one ELECTRA training step: megakd against the HuggingFace reference, on CPU.

The HF side is written the way an HF user would: `ElectraForMaskedLM` generator (dense logits
over every position, CE with -100 labels), multinomial sampling at masked positions,
`ElectraForPreTraining` discriminator, and the same two AdamW optimizers (DecoupledOptim
settings) as megakd. Both sides see the same batch (real corpus text, 15% masked) and the same
model sizes; megakd runs its own GeneratorTask / DiscriminatorTask (sparse MLM head, fused
losses) and optimizer steps. Timings alternate between the two sides to share machine noise.

    python tools/bench_electra_step.py                 # both shapes
    python tools/bench_electra_step.py --shape small --steps 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import ElectraConfig, ElectraForMaskedLM, ElectraForPreTraining

from megakd.config import OptimizerConfig
from megakd.engine.optim import build_optimizer
from megakd.engine.tasks import DiscriminatorTask, GeneratorTask
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.models.hf_mapping import from_hf_state_dict
from megakd.objectives.electra import corrupt

# name: (generator (layers, hidden, heads, ffn), discriminator (layers, hidden, heads, ffn), embedding, vocab, seq, batch)
SHAPES = {
    "small": ((12, 64, 1, 256), (12, 256, 4, 1024), 128, 30_522, 128, 32),
    "vocab128k": ((4, 256, 4, 1024), (4, 256, 4, 1024), 256, 128_000, 128, 16),
}
TARGETS = {"small": 1.3, "vocab128k": 2.0}
LOSS_WEIGHT = 50.0


def encoder_config(dims, embedding, vocab, seq) -> EncoderConfig:
    layers, hidden, heads, ffn = dims
    return EncoderConfig(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads,
                         intermediate_size=ffn, embedding_size=embedding, max_position_embeddings=seq,
                         dropout=0.1, attention_dropout=0.1)


def make_batch(vocab: int, seq: int, batch: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (batch, seq), generator=g)
    ids[:, 0], ids[:, -1] = 1, 2
    scores = torch.rand(batch, seq, generator=g)
    scores[:, 0] = scores[:, -1] = 2.0  # never mask [CLS]/[SEP]
    k = round(0.15 * (seq - 2))
    mask = torch.zeros(batch, seq, dtype=torch.bool)
    mask.scatter_(1, scores.argsort(dim=1)[:, :k], True)
    masked = ids.masked_fill(mask, 4)
    return {"input_ids": ids, "masked_input_ids": masked, "mlm_mask": mask,
            "attention_mask": torch.ones(batch, seq, dtype=torch.bool)}


class MegakdStep:
    def __init__(self, gen_cfg: EncoderConfig, disc_cfg: EncoderConfig, opt: OptimizerConfig):
        self.gen = GeneratorTask(MaskedLM(gen_cfg), kernel_backend="torch")
        self.disc = DiscriminatorTask(Discriminator(disc_cfg), kernel_backend="torch")
        self.opt_g = build_optimizer(self.gen.named_parameters(), opt)
        self.opt_d = build_optimizer(self.disc.named_parameters(), opt)
        self.rng = torch.Generator().manual_seed(0)

    def __call__(self, batch) -> None:
        g = self.gen(batch, self.rng)
        g["loss"].backward()
        corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], g["samples"])
        d = self.disc(corrupted, batch["input_ids"], batch["attention_mask"])
        (LOSS_WEIGHT * d["loss"]).backward()
        for opt in (self.opt_g, self.opt_d):
            opt.step()
            opt.zero_grad(set_to_none=True)


class HFStep:
    def __init__(self, gen_cfg: EncoderConfig, disc_cfg: EncoderConfig, opt: OptimizerConfig):
        def hf(cfg: EncoderConfig) -> ElectraConfig:
            return ElectraConfig(vocab_size=cfg.vocab_size, embedding_size=cfg.embed_dim, hidden_size=cfg.hidden_size,
                                 num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                                 intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
                                 hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)

        self.gen = ElectraForMaskedLM(hf(gen_cfg))
        self.disc = ElectraForPreTraining(hf(disc_cfg))
        self.opt_g = build_optimizer(self.gen.named_parameters(), opt)
        self.opt_d = build_optimizer(self.disc.named_parameters(), opt)

    def __call__(self, batch) -> None:
        labels = batch["input_ids"].masked_fill(~batch["mlm_mask"], -100)
        out = self.gen(input_ids=batch["masked_input_ids"], attention_mask=batch["attention_mask"], labels=labels)
        out.loss.backward()
        with torch.no_grad():
            probs = torch.softmax(out.logits[batch["mlm_mask"]], dim=-1)
            samples = torch.multinomial(probs, 1).squeeze(-1)
        corrupted = corrupt(batch["input_ids"], batch["mlm_mask"], samples)
        rtd_labels = (corrupted != batch["input_ids"]).long()
        d = self.disc(input_ids=corrupted, attention_mask=batch["attention_mask"], labels=rtd_labels)
        (LOSS_WEIGHT * d.loss).backward()
        for opt in (self.opt_g, self.opt_d):
            opt.step()
            opt.zero_grad(set_to_none=True)


def check_same_model(gen_cfg: EncoderConfig, hf_step: HFStep) -> None:
    """The two sides must be the same architecture: HF's weights load strictly into megakd's model."""
    megakd_gen = MaskedLM(gen_cfg)
    sd = from_hf_state_dict(hf_step.gen.state_dict(), "electra_generator")
    missing, unexpected = megakd_gen.load_state_dict(sd, strict=False)
    assert not unexpected and all("tied" in k for k in missing), (missing, unexpected)


def bench(shape: str, steps: int, warmup: int) -> dict:
    gen_dims, disc_dims, emb, vocab, seq, batch = SHAPES[shape]
    gen_cfg, disc_cfg = (encoder_config(d, emb, vocab, seq) for d in (gen_dims, disc_dims))
    opt = OptimizerConfig(lr=1e-4)
    torch.manual_seed(0)
    sides = {"megakd": MegakdStep(gen_cfg, disc_cfg, opt), "hf": HFStep(gen_cfg, disc_cfg, opt)}
    check_same_model(gen_cfg, sides["hf"])
    data = [make_batch(vocab, seq, batch, seed=i) for i in range(4)]
    times: dict[str, list[float]] = {name: [] for name in sides}
    for i in range(warmup + steps):
        for name, step in sides.items():
            t0 = time.perf_counter()
            step(data[i % len(data)])
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    tokens = batch * seq
    result = {"shape": shape, "tokens_per_step": tokens}
    for name, ts in times.items():
        result[f"{name}_tokens_per_s"] = tokens / statistics.median(ts)
    result["ratio"] = result["megakd_tokens_per_s"] / result["hf_tokens_per_s"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=[*SHAPES, "all"], default="all")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    shapes = list(SHAPES) if args.shape == "all" else [args.shape]
    rows = [bench(s, args.steps, args.warmup) for s in shapes]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; median of "
          f"{args.steps} steps after {args.warmup} warm-up, sides alternating")
    print(f"{'shape':<10} {'tokens/step':>11} {'megakd tok/s':>13} {'HF tok/s':>10} {'ratio':>7} {'target':>7}")
    for r in rows:
        print(f"{r['shape']:<10} {r['tokens_per_step']:>11} {r['megakd_tokens_per_s']:>13.0f} "
              f"{r['hf_tokens_per_s']:>10.0f} {r['ratio']:>6.2f}x {TARGETS[r['shape']]:>6.1f}x")


if __name__ == "__main__":
    main()
