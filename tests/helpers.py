"""Helpers shared by tests (importable as tests.helpers; conftest.py holds the fixtures)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from filelock import FileLock

TINY_VOCAB = 512
TINY_SEQ_LEN = 64


def built_once(tmp_path_factory, name: str, build) -> Path:
    """`build(root)` into a fresh `root` once per test run, shared by every xdist worker: the first
    worker to ask builds under a file lock while the others wait, then all read the same `root`."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's directory; each worker's basetemp is a child of it
    root, done = base / "shared" / name, base / "shared" / f"{name}.built"
    root.parent.mkdir(exist_ok=True)
    with FileLock(str(root.parent / f"{name}.lock")):
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            build(root)
            done.touch()
    return root


def tiny_overrides(tiny_data, run_dir, **extra) -> list[str]:
    """Overrides that turn any recipe into a seconds-long CPU run on the tiny data."""
    tokenizer_dir, shards_dir = tiny_data
    # Positions and sampling temperature are pinned too: the demo's relative positions and temperature
    # 2 would change what the tests compare (native HF classes, warm starts, float64 references).
    model = dict(vocab_size=TINY_VOCAB, max_position_embeddings=TINY_SEQ_LEN, dropout=0.1, attention_dropout=0.0,
                 position_encoding="absolute", relative_init="normal")
    out = [f"data.tokenizer={tokenizer_dir}", f"data.shards={shards_dir}", f"run.dir={run_dir}",
           "run.progress_bar=false", "run.tensorboard=false", "run.plots=false",
           "train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1",
           "optim.schedule.warmup_steps=2",
           # Pinned here, not taken from the demo recipe, so tuning the demo never moves the
           # thresholds that tests rely on (e.g. clipping that bites on some steps only).
           "optim.generator.lr=2e-3", "optim.discriminator.lr=3e-3", "electra.sampling_temperature=1.0"]
    for name, layers, hidden in (("generator", 1, 32), ("discriminator", 2, 48)):
        for k, v in {**model, "num_layers": layers, "hidden_size": hidden, "num_heads": 2,
                     "intermediate_size": 4 * hidden, "embedding_size": 32}.items():
            out.append(f"model.{name}.{k}={v}")
    out += [f"{k}={v}" for k, v in extra.items()]
    return out


def trained(cfg, resume: str | None = None, extend=None):
    """The trainer of the run `cfg` describes, trained in the run shell (`open_trainer`, `Trainer.train`) and
    closed however training ended; `extend(trainer)` adds hooks before a resumed checkpoint loads them."""
    from megakd.engine.pretrain import open_trainer

    trainer = open_trainer(cfg, resume, extend=extend)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def padded_inputs(length: int = 40) -> dict:
    """Two random id rows of `length` tokens (no special ids), the first padded after 30."""
    import torch

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, TINY_VOCAB, (2, length), generator=g)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[0, 30:] = 0
    return {"input_ids": ids, "attention_mask": mask}


# The tiny models of `tiny_overrides` as HF configs: (layers, hidden, embedding size) per model.
TINY_ARCH = {"generator": (1, 32, 32), "discriminator": (2, 48, 32)}


def auto_vocab_overrides(data, run_dir, **extra) -> list[str]:
    """`tiny_overrides` with `vocab_size: auto`, for data whose tokenizer is not the 512-piece one."""
    return [o for o in tiny_overrides(data, run_dir, **extra) if ".vocab_size=" not in o]


def save_tiny_hf_model(architecture: str, out, tokenizer_dir, seed: int = 0, model: str | None = None,
                  dropout: float = 0.1):
    """An HF ELECTRA/BERT model with `tiny_overrides`' shapes for `model` (generator or discriminator),
    its LayerNorms and biases moved off their init, saved with the tokenizer files of `tokenizer_dir`."""
    import torch
    import transformers

    from megakd.data.tokenizer import Tokenizer

    tokenizer = Tokenizer.load(tokenizer_dir)
    model = model or ("discriminator" if architecture == "ElectraForPreTraining" else "generator")
    layers, hidden, embedding = TINY_ARCH[model]
    common = dict(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                  intermediate_size=4 * hidden, max_position_embeddings=TINY_SEQ_LEN, hidden_dropout_prob=dropout,
                  attention_probs_dropout_prob=0.0, pad_token_id=tokenizer.pad_id)
    if architecture.startswith("Bert"):
        config = transformers.BertConfig(**common)
    else:
        config = transformers.ElectraConfig(embedding_size=embedding, **common)
    torch.manual_seed(seed)
    hf = getattr(transformers, architecture)(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    out = Path(out)
    hf.save_pretrained(out)
    for name in tokenizer.FILES:
        if (tokenizer.path / name).is_file():
            shutil.copyfile(tokenizer.path / name, out / name)
    return hf.eval()


def wordpiece_vocab(docs: list[str], vocab_size: int) -> list[str]:
    """A lowercase WordPiece vocabulary trained on `docs`, laid out like BERT's: [PAD] first, unused
    slots, then [UNK] [CLS] [SEP] [MASK] (ids 0, 4, 5, 6, 7: not megakd's SentencePiece layout)."""
    from tokenizers import BertWordPieceTokenizer

    trainer = BertWordPieceTokenizer(lowercase=True)
    trainer.train_from_iterator(docs, vocab_size=vocab_size, show_progress=False,
                                special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    tokens = [t for t, _ in sorted(trainer.get_vocab().items(), key=lambda kv: kv[1])]
    return ["[PAD]", "[unused0]", "[unused1]", "[unused2]", *tokens[1:]]


def mlm_logits(model, input_ids, attention_mask=None, token_type_ids=None):
    """Dense [B, L, V] logits of a megakd `MaskedLM`: what tests compare and inspect (training applies the
    head only at masked positions, or through the fused kernels)."""
    return model.head(model(input_ids, attention_mask, token_type_ids))


def masked_batch(vocab: int, mask_id: int, seed: int = 3) -> dict:
    """A micro-batch of four sequences, one padded, ~30 % of the non-padding tokens masked."""
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, vocab, (4, 24), generator=g)
    attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    attention_mask[1, 17:] = False
    mlm_mask = (torch.rand(input_ids.shape, generator=g) < 0.3) & attention_mask
    return {"input_ids": input_ids, "attention_mask": attention_mask, "mlm_mask": mlm_mask,
            "masked_input_ids": input_ids.masked_fill(mlm_mask, mask_id)}


class RecordedRun:
    """A micro-batch run for `Layout.micro_step` outside any backend: it calls each unit's loss module and
    keeps its outputs and the losses it would backward."""

    def __init__(self):
        self.losses: dict = {}
        self.outputs: dict = {}

    def unit(self, _unit):
        import torch

        return torch.enable_grad()

    def forward(self, unit, *args):
        self.outputs[unit.name] = out = unit.loss_module(*args)
        return out

    def backward(self, unit, loss):
        self.losses[unit.name] = loss

