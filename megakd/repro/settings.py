"""What the findings share before any job is declared: the recipes and overrides they start from, the
shared student's sizes, a finding's settings in one mode, and how a recipe's value is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from megakd.config import Config, load_config

CONFIGS = Path(__file__).parents[2] / "configs"
PRETRAIN_RECIPE = CONFIGS / "electra-mini.yaml"  # the recipe meant to pay off downstream
FINETUNE_RT = CONFIGS / "finetune-rt.yaml"
FINETUNE_PAIRS = CONFIGS / "finetune-pairs.yaml"
# The downstream tasks of gen_size and electra_vs_mlm: RT, and sentence pairs (chance 0.5, and the tf-idf floor
# is chance too). A pair is 2.34× an RT sentence in tokens (78.9 against 33.7, mean over the 3,000 training
# examples FULL_FINETUNE keeps, with the recipe's 4K tokenizer), and the cost model counts examples as RT
# sentences: full mode fine-tunes on 1,500 pairs (about the tokens of its 3,000 RT sentences), and the plan
# prices a pair job's examples at PAIR_TOKENS RT sentences each.
TASKS = {"RT": FINETUNE_RT, "pairs": FINETUNE_PAIRS}
PAIR_TOKENS = 78.9 / 33.7
FULL_PAIRS = ("task.max_train_examples=1500",)
RT_TRAIN_SENTENCES = 9071  # the bundled RT task's training split
SILENT_RUN = ("run.export_hf=false", "run.plots=false", "run.tensorboard=false", "run.progress_bar=false",
              "run.save_every=0", "run.keep_last=1")

# --quick: 1-layer, 32-wide models for a few steps, fine-tuned on 400 RT sentences for one epoch.
QUICK_PRETRAIN = (
    "train.max_steps=12", "train.global_batch_size=8", "train.micro_batch_size=8", "optim.schedule.warmup_steps=2",
    "train.log_every=1", "train.probe_every=0",
    *(f"model.{m}.{k}={v}" for m in ("generator", "discriminator")
      for k, v in (("num_layers", 1), ("hidden_size", 32), ("intermediate_size", 64), ("embedding_size", 32),
                   ("num_heads", 2))),
)
# Full mode fine-tunes on 3,000 of RT's 9,071 training sentences (an even spread; dev whole), to keep the
# report's cost within hours on 2 cores (`megakd repro all --plan` states it).
FULL_FINETUNE = ("task.max_train_examples=3000",)
# The student of the findings whose teacher or labeler is the shared encoder (soteacher, labelreg, tgt):
# the recipe with both models at 2 x 64, 3.7x fewer parameters than its 4 x 128 discriminator (the
# papers' teachers are 3.9x to 5.4x their students; docs/REPRODUCTION.md's scale table).
STUDENT_SIZES = (("num_layers", 2), ("hidden_size", 64), ("intermediate_size", 256), ("embedding_size", 64),
                 ("num_heads", 2))
QUICK_STUDENT_SIZES = (("num_layers", 1), ("hidden_size", 16), ("intermediate_size", 32), ("embedding_size", 16),
                       ("num_heads", 2))


def student_overrides(quick: bool = False) -> tuple[str, ...]:
    """The overrides that make the recipe the shared student: both models at STUDENT_SIZES (quick: the
    QUICK_STUDENT_SIZES)."""
    sizes = QUICK_STUDENT_SIZES if quick else STUDENT_SIZES
    return tuple(f"model.{m}.{k}={v}" for m in ("generator", "discriminator") for k, v in sizes)


QUICK_FINETUNE = ("task.max_train_examples=400", "task.max_dev_examples=200", "finetune.epochs=1")
FULL_NOTE = " Fine-tuning used 3,000 of RT's training sentences (an even spread) and the whole dev split."
QUICK_NOTE = (" Quick mode: a 1-layer, 32-wide encoder pretrained for 12 steps, fine-tuned on 400 RT sentences "
              "(200 dev sentences) for one epoch: a structure check rather than a measurement.")


@dataclass(frozen=True)
class Settings:
    """A finding's settings in one mode (full or --quick)."""

    recipe: Path  # the pretraining recipe (`--recipe` replaces it)
    seeds: tuple[int, ...]
    steps: int = 0  # pretraining steps of each of its runs (0: the recipe's own)
    pretrain: tuple[str, ...] = ()  # overrides of every pretraining run
    finetune: tuple[str, ...] = ()  # overrides of every fine-tuning run
    # Pretraining draws per arm (train.seed of each): two runs of one recipe differ by more than most
    # measured effects, so a finding that pretrains its arms counts only what every draw agrees on.
    draws: tuple[int, ...] = (0,)
    whole_budget: str = ""  # what the runs that also go the recipe's whole length are (DWT: "remapping")


def recipe_value(recipe: str | Path, key: str, overrides: tuple[str, ...] = (), cls: type = Config) -> object:
    """A dotted key's value in a recipe (a `cls` config) after `overrides` (e.g. its discriminator LR)."""
    value: object = load_config(recipe, list(overrides), cls=cls)
    for part in key.split("."):
        value = getattr(value, part)
    return value


def finetuned_model(cfg: Config) -> str:
    """Which model of a pretraining config fine-tuning starts from: an ELECTRA run's discriminator, a
    masked LM's own (`generator`)."""
    return "discriminator" if cfg.model.objective == "electra" else "generator"


def finetuning_settings(recipe: Path, seeds: tuple[int, ...]) -> tuple[Settings, Settings]:
    """FULL and QUICK of a finding that fine-tunes the shared encoders as the recipe pretrains them
    (soteacher, labelreg, tgt): two pretraining draws; full mode on FULL_FINETUNE over `seeds`, quick mode
    on QUICK_FINETUNE over seeds 0 and 1."""
    return (Settings(recipe, seeds=seeds, finetune=FULL_FINETUNE, draws=(0, 1)),
            Settings(recipe, seeds=(0, 1), finetune=QUICK_FINETUNE, draws=(0, 1)))
