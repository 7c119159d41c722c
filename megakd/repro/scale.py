"""The scale gap of each finding in numbers: the paper's regime beside the one `megakd repro` runs.

docs/REPRODUCTION.md carries this table between `<!-- scale -->` markers; a test checks that it is
the table this module computes from the findings' own settings, so it cannot drift from what runs.
The papers' figures are the papers' (docs/methods.md); parameter counts of the papers' ELECTRA are
computed from `configs/electra-base.yaml` (its 128K vocabulary), the others are the public models'.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from pathlib import Path

from megakd.bench.memory import parameter_counts
from megakd.config import load_config
from megakd.finetune.config import FinetuneConfig, auto_lr
from megakd.finish import finish_config
from megakd.repro.dwt import TEACHERS as DWT_TEACHERS
from megakd.repro.findings import FINDINGS, MODULES
from megakd.repro.gen_size import DEPTHS as GEN_SIZE_DEPTHS
from megakd.repro.gen_size import DISC_LR as GEN_SIZE_DISC_LR
from megakd.repro.gen_size import GENERATOR_LRS as GEN_SIZE_LRS
from megakd.repro.report import write_text_atomically
from megakd.repro.settings import FINETUNE_RT, FULL_FINETUNE, Settings, finetuned_model, student_overrides
from megakd.repro.soteacher import SOTEACHER_RT
from megakd.repro.tgt import TGT_RT

CONFIGS = Path(__file__).parents[2] / "configs"
START, END = "<!-- scale -->", "<!-- /scale -->"


@dataclass(frozen=True)
class PaperRegime:
    model: str  # the model the claim is about
    params: float | None  # its parameters (None: computed from `config`)
    teacher_ratio: str  # teacher (or labeler) parameters over the student's
    pretraining: str  # what it was pretrained on, as the paper says
    tokens: float | None  # token positions seen in pretraining (None: computed from `config`, or not stated)
    optimizer: str  # peak LR(s) and batch of the training the claim is about (pretraining or fine-tuning)
    uncertainty: str  # the paper's own: runs per configuration, error bars
    config: str | None = None  # a megakd recipe of the paper's model, to count from


PAPERS: dict[str, PaperRegime] = {
    "lambda": PaperRegime("original ELECTRA, base (generator + discriminator)", None, "-",
                          "125K steps × 2048 × 512", None, "one LR, 5e-4 (Fig. 1.3), batch 2048",
                          "curves; runs per point not stated", "electra-base.yaml"),
    "disc_lr": PaperRegime("DecoupledOptim ELECTRA, base (generator + discriminator)", None, "-",
                           "125K steps × 2048 × 512", None, "η_G 2e-4, η_D up to 1.5e-3 (7.5×), batch 2048",
                           "runs per point not stated; diverged runs omitted", "electra-base.yaml"),
    "dwt": PaperRegime("6 × 768 BERT student", 67e6, "0.78× (weak) to 0.46×",
                       "20 epochs of 30M sentences (length not stated)", None, "5e-4, batch 128",
                       "one run per configuration, no error bars"),
    "soteacher": PaperRegime("WRN40-2 teacher → WRN40-1 student (CIFAR-100 images)", 2.2e6, "3.9×",
                             "none (trained from scratch)", None, "SGD 0.05, batch 64, 240 epochs",
                             "mean ± std of 3 seeds"),
    "labelreg": PaperRegime("DistilRoBERTa student, RoBERTa-large teacher", 82e6, "4.3×",
                            "the public pretrained DistilRoBERTa", None, "2e-5, batch 32, 30 epochs",
                            "mean ± std of 5 runs; Wilcoxon over 8 seeds (SST-5)"),
    "gen_size": PaperRegime("original ELECTRA and DecoupledOptim, base discriminator beside 4- to 12-layer generators",
                            None, "generator ÷ discriminator 1/3 to 1 (layers)", "125K steps × 2048 × 512", None,
                            "(λ, lr) or (η_G, η_D) tuned per point; η_D up to 1.5e-3, batch 2048",
                            "runs per point not stated; diverged runs omitted", "electra-base.yaml"),
    "electra_vs_mlm": PaperRegime("ELECTRA-Small discriminator against a masked LM of its size (§3.4; the §3.5 "
                                  "ablation at base size)", 14e6, "-", "1M steps × 128 × 128 (ELECTRA-Small)",
                                  1e6 * 128 * 128, "5e-4, batch 128 (ELECTRA-Small pretraining)",
                                  "GLUE dev medians of 10 fine-tuning runs of one pretrained model"),
    "tgt": PaperRegime("DistilBERT student, RoBERTa-large labeler, BART-base generator", 66e6, "5.4×",
                       "the public pretrained DistilBERT", None, "Adam 3e-5, batch 128",
                       "its numeric tables are lost: qualitative only"),
}

# megakd's side: the parameter_counts entry the claim is about. soteacher, labelreg and tgt are
# judged by fine-tuning the shared student, with the recipe's own encoder (`finetuned_model`: an
# ELECTRA run's discriminator, a masked LM's own) fine-tuned as the teacher or labeler
# (megakd/repro/labelreg.py, soteacher.py, tgt.py): their model is the student, their LR the
# student's fine-tuning one.
MEASURED = {"lambda": "total", "disc_lr": "total", "dwt": "generator", "gen_size": "total"}
SHARED_ENCODER = {"soteacher": SOTEACHER_RT, "labelreg": FINETUNE_RT, "tgt": TGT_RT}  # -> their fine-tuning recipe


def _measured(name: str, cfg) -> str:
    return MEASURED.get(name) or finetuned_model(cfg)


def _training(name: str, cfg) -> str:
    """Peak LR(s) and batch here: the fine-tuning of a shared-encoder finding, else the pretraining."""
    if name == "gen_size":  # its LRs are its own, not the recipe's
        return (f"one LR {cfg.optim.discriminator.lr:g} (original); η_G {' / '.join(f'{lr:g}' for lr in GEN_SIZE_LRS)}"
                f", η_D {GEN_SIZE_DISC_LR:g}, batch {cfg.train.global_batch_size}")
    if name not in SHARED_ENCODER:
        lrs = {cfg.optim.generator.lr, cfg.optim.discriminator.lr} if cfg.model.objective == "electra" \
            else {cfg.optim.generator.lr}
        return f"{' / '.join(f'{lr:g}' for lr in sorted(lrs))}, batch {cfg.train.global_batch_size}"
    f = load_config(SHARED_ENCODER[name], list(FULL_FINETUNE), cls=FinetuneConfig)  # cfg: the student's
    lr = auto_lr(getattr(cfg.model, finetuned_model(cfg)).hidden_size) if f.finetune.lr == "auto" else f.finetune.lr
    return (f"AdaMax {lr:.3g}, batch {f.finetune.batch_size}, {f.finetune.epochs} epochs over "
            f"{f.task.max_train_examples:,} RT sentences")


def _full(name: str) -> Settings:
    """A finding's full-mode settings."""
    return importlib.import_module(f"megakd.repro.{MODULES[name]}").FULL


def _finding_config(name: str, extra: tuple[str, ...] = (), whole: bool = False):
    """The pretraining config a finding's full mode runs (its recipe, overrides and step count; `whole`:
    the recipe's own length instead of the step count)."""
    settings = _full(name)
    steps = [f"train.max_steps={settings.steps}"] if settings.steps and not whole else []
    overrides = [*settings.pretrain, *steps, *extra]
    return finish_config(load_config(settings.recipe, overrides))


def _tokens(cfg) -> float:
    return float(cfg.train.max_steps) * cfg.train.global_batch_size * cfg.data.seq_len


def _count(value: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


def _times(ratio: float) -> str:
    return f"{ratio:,.0f}×" if ratio >= 10 else f"{ratio:.2g}×"


def scale_rows() -> list[list[str]]:
    """One row per finding: model and parameters, teacher ratio, pretraining and LR, paper → here, with
    the paper's size over this report's, and the paper's own uncertainty."""
    rows = []
    for name in FINDINGS:
        paper = PAPERS[name]
        cfg = _finding_config(name, student_overrides() if name in SHARED_ENCODER else ())
        here = parameter_counts(cfg)[_measured(name, cfg)]
        paper_cfg = finish_config(load_config(CONFIGS / paper.config, [])) if paper.config else None
        paper_params = paper.params or parameter_counts(paper_cfg)["total"]
        paper_tokens = paper.tokens or (_tokens(paper_cfg) if paper_cfg else None)
        if name in SHARED_ENCODER:
            teacher = f"{parameter_counts(_finding_config(name))[finetuned_model(cfg)] / here:.2g}×"
        elif name == "dwt":
            ratios = [parameter_counts(_finding_config(name, (f"model.generator.num_layers={layers}",)))["generator"]
                      / here for layers in DWT_TEACHERS.values()]
            teacher = f"{max(ratios):.2f}× to {min(ratios):.2f}×"
        elif name == "gen_size":  # the generators' depths over the discriminator's (megakd/repro/gen_size.py)
            teacher = f"generator ÷ discriminator {GEN_SIZE_DEPTHS[0]}/{GEN_SIZE_DEPTHS[-1]} to 1 (layers)"
        else:
            teacher = "-"
        tokens_gap = f" ({_times(paper_tokens / _tokens(cfg))} fewer here)" if paper_tokens else ""
        if label := _full(name).whole_budget:  # those runs: the recipe's whole length, not the step count
            whole = _finding_config(name, whole=True)
            tokens_gap += (f"; {label}: {whole.train.max_steps:,} steps = {_count(_tokens(whole))} positions"
                           + (f" ({_times(paper_tokens / _tokens(whole))} fewer)" if paper_tokens else ""))
        rows.append([
            f"`{name}`",
            f"{paper.model} → {Path(_full(name).recipe).name} ({_encoder_shape(cfg, _measured(name, cfg))}"
            + (f" student, {_encoder_shape(_finding_config(name), finetuned_model(cfg))} teacher)"
               if name in SHARED_ENCODER
               else ")"),
            f"{_count(paper_params)} → {_count(here)} ({_times(paper_params / here)} fewer here)",
            f"{paper.teacher_ratio} → {teacher}",
            f"{paper.pretraining} → {cfg.train.max_steps:,} steps × {cfg.train.global_batch_size} × "
            f"{cfg.data.seq_len} = {_count(_tokens(cfg))} positions{tokens_gap}",
            f"{paper.optimizer} → {_training(name, cfg)}",
            paper.uncertainty,
        ])
    return rows


def _encoder_shape(cfg, which: str) -> str:
    model = cfg.model.discriminator if which == "discriminator" or (which == "total" and
                                                                  cfg.model.objective == "electra") \
        else cfg.model.generator
    return f"{model.num_layers} × {model.hidden_size}"


COLUMNS = ["finding", "model: paper → here", "parameters", "teacher ÷ student", "pretraining",
           "peak LR, batch", "the paper's own uncertainty"]


def scale_markdown() -> str:
    """The scale section of docs/REPRODUCTION.md, between its markers."""
    lines = [START, "## Scale: each paper's regime beside this report's", "",
             "Computed by `megakd/repro/scale.py` from the settings each finding runs (full mode). A verdict "
             "here is about this regime; where a gap is large the section says what cannot show at this size.",
             "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in scale_rows()]
    return "\n".join([*lines, END])


def write_scale(report: str | Path) -> None:
    """Insert or replace the scale section of `report` (before its first finding)."""
    path = Path(report)
    text = path.read_text()
    section = scale_markdown()
    if START in text:
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: section, text, flags=re.DOTALL)
    else:
        first = text.find("<!-- finding:")
        text = (text[:first] + section + "\n\n" + text[first:]) if first >= 0 else text.rstrip() + "\n\n" + section
    write_text_atomically(path, text)
