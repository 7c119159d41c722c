"""TGT — Teacher Guided Training (docs/methods.md § TGT) for sequence classification.

A frozen MLM (the ELECTRA generator of a pretraining run, or an imported HF MLM; same tokenizer as
student and labeler) generates x̃ from every training minibatch, and a frozen fine-tuned labeler h
soft-labels real and generated examples. The student f minimises (docs/methods.md § TGT, unit weights)

    CE(f(x), y) + H(h(x), f(x)) + H(h(x̃), f(x̃)),    H(q, p) = −Σ q log p,

with one x̃ per real example. Generation:

- ``random`` (zero-order, the mode the paper used for text): mask a fraction p of each example's
  non-special tokens (the exact-count hash masking of pretraining, keyed by seed, epoch and the
  stable example index), optionally add N(0, σ²) noise to the MLM's input embeddings of the masked
  sequence, and resample the masked positions from the MLM's softmax. Only masked positions can
  change.
- ``gradient`` (first-order): start from the same (noisy) input embeddings e of the MLM (its
  latent z) and take `steps` ascent steps, then decode x̃ by the argmax of the MLM head at the
  masked positions. `tgt.ascent` chooses the step:

  - ``paper`` (default; the TGT paper's eq. 5 and its extension to discrete data):
    e ← e + η·∇_e Σ_i ℓ_d(f(x̃_i), h(x̃_i)) with ℓ_d = H(h, f) = −Σ_y h_y log f_y, the soft-label CE
    the student is trained on, summed over the
    batch so each example's step is its own ℓ_d's gradient. The forward pass runs on the discrete
    decoding x̃ = argmax Dec(e) (student and labeler read exactly the embedding rows of x̃); the
    backward pass is straight-through: the one-hot of x̃ is given the gradient of π = softmax of
    the MLM head, as if the student's and labeler's input embeddings were π·W_emb (the paper ties
    the decoder's softmax to their input embeddings for this; here they share the vocabulary).
    Gradients reach e through both the student and the labeler, as in the paper.
  - ``normalized``: a variant the paper does not use, kept for comparison: ascend
    J(e) = mean KL(h ‖ f) with the normalized step e ← e + η·∇J/‖∇J‖ (norm per example), both
    models reading the soft mixture π·W_emb in the forward pass too.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from megakd.config import ConfigError
from megakd.data.masking import mlm_mask
from megakd.data.tasks import EncodedTask
from megakd.data.tokenizer import Tokenizer
from megakd.finetune.config import FinetuneConfig, TGTConfig
from megakd.finetune.runtime import Runtime
from megakd.finetune.trainer import run_seeds, summarize
from megakd.models.electra import MaskedLM, SequenceClassifier
from megakd.objectives.electra import corrupt, sample_replacements
from megakd.objectives.labelreg import kl_divergence, soft_cross_entropy
from megakd.store import check_same_tokenizer, freeze, load_model

log = logging.getLogger(__name__)


class TeacherGenerator:
    """Generates x̃ from a batch with a frozen MLM (random or gradient mode, see module docstring)."""

    def __init__(self, mlm: MaskedLM, tokenizer: Tokenizer, cfg: TGTConfig, seed: int, kernels_backend: str = "auto",
                 stream: int = 0):
        """`stream` (the data-parallel rank) gives each rank its own noise and sampling draws."""
        self.mlm, self.tokenizer, self.cfg, self.seed, self.backend = freeze(mlm), tokenizer, cfg, seed, kernels_backend
        device = next(mlm.parameters()).device
        self.rng = torch.Generator(device=device).manual_seed(seed + 1_000_003 * stream)

    def mask(self, batch: dict[str, Tensor], epoch: int) -> Tensor:
        """Boolean [B, L]: exactly round(p·n) of each example's n non-special tokens (at least 1)."""
        ids = batch["input_ids"].cpu().numpy()
        return torch.from_numpy(mlm_mask(
            ids, batch["attention_mask"].bool().cpu().numpy(), np.full(len(ids), epoch), batch["index"].cpu().numpy(),
            seed=self.seed, mask_prob=self.cfg.mask_prob, special_ids=sorted(self.tokenizer.special_ids)
        )).to(batch["input_ids"].device)

    def start_embeddings(self, batch: dict[str, Tensor], mask: Tensor) -> Tensor:
        """The MLM's input embeddings of the masked sequence, plus N(0, σ²) noise when σ > 0."""
        masked = torch.where(mask, self.tokenizer.mask_id, batch["input_ids"])
        e = self.mlm.encoder.embed(masked)
        if self.cfg.noise_std > 0:
            e = e + self.cfg.noise_std * torch.randn(e.shape, generator=self.rng, dtype=e.dtype, device=e.device)
        return e

    def _hidden(self, e: Tensor, batch: dict[str, Tensor], mask: Tensor) -> Tensor:
        hidden = self.mlm(attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"],
                          inputs_embeds=e)
        return self.mlm.masked_hidden(hidden, mask)

    def decoder_logits(self, e: Tensor, batch: dict[str, Tensor], mask: Tensor) -> Tensor:
        """Dec(e): the MLM head's logits [M, V] at the M masked positions."""
        head = self.mlm.head
        return F.linear(self._hidden(e, batch, mask), head.decoder_weight, head.bias)

    @torch.no_grad()
    def random(self, batch: dict[str, Tensor], epoch: int) -> tuple[Tensor, Tensor]:
        """(x̃ ids, mask): masked positions resampled from the MLM; everything else unchanged."""
        mask = self.mask(batch, epoch)
        head = self.mlm.head
        samples, _ = sample_replacements(self._hidden(self.start_embeddings(batch, mask), batch, mask),
                                         head.decoder_weight, head.bias, generator=self.rng,
                                         temperature=self.cfg.sampling_temperature, backend=self.backend)
        return corrupt(batch["input_ids"], mask, samples), mask

    def decode_straight_through(self, e: Tensor, batch: dict[str, Tensor], mask: Tensor) -> Tensor:
        """[M, V] one-hot of x̃ = argmax Dec(e) at the M masked positions, with the gradient of π = softmax Dec(e).

        `pi - pi.detach()` is exactly zero, so the forward value is exactly the one-hot.
        """
        pi = F.softmax(self.decoder_logits(e, batch, mask), dim=-1)
        one_hot = F.one_hot(pi.argmax(-1), pi.shape[-1]).to(pi.dtype)
        return one_hot + (pi - pi.detach())

    def disagreement(self, e: Tensor, batch: dict[str, Tensor], mask: Tensor, student: SequenceClassifier,
                     labeler: SequenceClassifier) -> Tensor:
        """What `tgt.ascent` ascends: Σ_i H(h(x̃_i), f(x̃_i)) on the straight-through decoding (paper), or
        mean KL(h ‖ f) on the soft decoding π·W_emb (normalized); real tokens outside the mask."""
        paper = self.cfg.ascent == "paper"
        if paper:
            tokens = self.decode_straight_through(e, batch, mask)
        else:
            tokens = F.softmax(self.decoder_logits(e, batch, mask), dim=-1)

        def logits(model: SequenceClassifier) -> Tensor:
            vectors = model.encoder.embed(batch["input_ids"])
            rows = tokens.to(vectors.dtype) @ model.encoder.embeddings.word_embeddings.weight
            vectors = vectors.masked_scatter(mask[..., None], rows)
            return model(attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"],
                         inputs_embeds=vectors)

        if paper:  # the batch mean times B: a sum of per-example losses
            return soft_cross_entropy(logits(student), F.softmax(logits(labeler), dim=-1)) * len(e)
        return kl_divergence(logits(labeler), logits(student))

    def ascend(self, e: Tensor, batch: dict[str, Tensor], mask: Tensor, student: SequenceClassifier,
               labeler: SequenceClassifier) -> Tensor:
        """One step: e + η·∇J (paper) or e + η·∇J/‖∇J‖ with the norm per example over its positions (normalized)."""
        e = e.detach().requires_grad_(True)
        (grad,) = torch.autograd.grad(self.disagreement(e, batch, mask, student, labeler), e)
        if self.cfg.ascent == "normalized":
            grad = grad / grad.flatten(1).norm(dim=1).clamp_min(1e-12)[:, None, None]
        return (e + self.cfg.step_size * grad).detach()

    def gradient(self, batch: dict[str, Tensor], epoch: int, student: SequenceClassifier,
                 labeler: SequenceClassifier) -> tuple[Tensor, Tensor]:
        """(x̃ ids, mask): ascend the disagreement in the MLM's embedding space, decode by argmax."""
        mask = self.mask(batch, epoch)
        was_training = student.training
        student.eval()  # a deterministic J: no dropout while searching
        try:
            e = self.start_embeddings(batch, mask)
            for _ in range(self.cfg.steps):
                e = self.ascend(e, batch, mask, student, labeler)
            with torch.no_grad():
                tokens = self.decoder_logits(e, batch, mask).argmax(-1)
        finally:
            student.train(was_training)
        return corrupt(batch["input_ids"], mask, tokens), mask


class TGTObjective:
    """CE(f(x), y) + H(h(x), f(x)) + H(h(x̃), f(x̃)) with x̃ generated online from each batch."""

    def __init__(self, generator: TeacherGenerator, labeler: SequenceClassifier):
        self.generator, self.labeler = generator, freeze(labeler)

    def state_dict(self) -> dict[str, Tensor]:
        return {"rng": self.generator.rng.get_state()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.generator.rng.set_state(state["rng"])

    def loss(self, model: SequenceClassifier, batch: dict[str, Tensor], epoch: int
             ) -> tuple[Tensor, Tensor, dict[str, float]]:
        if self.generator.cfg.mode == "random":
            generated, mask = self.generator.random(batch, epoch)
        else:
            generated, mask = self.generator.gradient(batch, epoch, model, self.labeler)
        am, tt = batch["attention_mask"], batch["token_type_ids"]
        with torch.no_grad():
            h_real = F.softmax(self.labeler(batch["input_ids"], am, tt), -1)
            h_gen = F.softmax(self.labeler(generated, am, tt), -1)
        logits = model(batch["input_ids"], am, tt)
        gen_logits = model(generated, am, tt)
        ce = F.cross_entropy(logits, batch["labels"])
        real_kd, gen_kd = soft_cross_entropy(logits, h_real), soft_cross_entropy(gen_logits, h_gen)
        changed = (generated != batch["input_ids"])[mask].float().mean().item()
        return ce + real_kd + gen_kd, logits, {"ce": ce.item(), "kd_real": real_kd.item(),
                                               "kd_generated": gen_kd.item(), "changed_frac": changed}


def run_tgt(cfg: FinetuneConfig, runtime: Runtime) -> dict:
    """`megakd finetune` with `tgt.enabled`: a TGT student for every seed."""
    run_dir = runtime.run_dir
    generator = load_model(cfg.tgt.generator, "tgt.generator")
    mlm, gen_tokenizer = freeze(generator.get("masked_lm")).to(runtime.device), generator.tokenizer()
    stored_labeler = load_model(cfg.tgt.labeler, "tgt.labeler")
    labeler, lab_tokenizer = stored_labeler.get("classifier").to(runtime.device), stored_labeler.tokenizer()
    if labeler.num_labels != cfg.task.num_labels:
        raise ConfigError(f"tgt.labeler: {cfg.tgt.labeler} has {labeler.num_labels} labels, the task "
                          f"{cfg.task.num_labels}")

    def make_objective(seed: int, model: SequenceClassifier, tokenizer: Tokenizer, train: EncodedTask,
                       out_dir: Path) -> TGTObjective:
        check_same_tokenizer(tokenizer, gen_tokenizer, "tgt.generator")
        check_same_tokenizer(tokenizer, lab_tokenizer, "tgt.labeler")
        return TGTObjective(TeacherGenerator(mlm, tokenizer, cfg.tgt, seed, cfg.kernels.backend, runtime.rank), labeler)

    results, _, _, lr_record = run_seeds(cfg, run_dir, cfg.model, make_objective, runtime)
    return summarize(results, run_dir, cfg.metric, lr_record=lr_record, write=runtime.is_main)
