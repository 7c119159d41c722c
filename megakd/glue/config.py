"""The `megakd glue` config tree: fine-tuning's sections (run, model, finetune, backend, kernels) plus `glue`.

Loaded with `megakd.config.load_config(path, overrides, cls=GlueConfig)`: unknown keys and bad values
stop with one line naming the key. Each task trains as a fine-tuning config (`task_config`), so
everything `finetune.*` means for `megakd finetune` it means here, task by task.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from megakd.config import BackendConfig, KernelsConfig, TaskConfig
from megakd.configio import ConfigError, check_literals, shown
from megakd.finetune.config import (
    FinetuneConfig,
    FinetuneRunConfig,
    FinetuneSettings,
    ModelInitConfig,
    finish_settings,
)
from megakd.glue.tasks import TASKS, GlueTask, task_named
from megakd.launch import Launch

# ELECTRA's fine-tuning rate by model size (hidden width up to: rate): Small, Base, Large.
ELECTRA_LRS = ((256, 3e-4), (768, 1e-4), (1 << 30, 5e-5))


def electra_lr(hidden_size: int) -> float:
    """`glue.lr: electra`: ELECTRA's GLUE rate for a model of this width (3e-4 up to Small's 256, 1e-4 up to
    Base's 768, 5e-5 above)."""
    return next(lr for width, lr in ELECTRA_LRS if hidden_size <= width)


@dataclass
class GlueSection:
    data_dir: str = ""  # glue_data/ as the GLUE download script writes it, or datasets' save_to_disk / hub parquet
    tasks: list[str] = field(default_factory=lambda: list(TASKS))  # some of cola sst2 mrpc stsb qqp mnli qnli rte wnli
    # electra: ELECTRA's rate by model width (3e-4 Small, 1e-4 Base, 5e-5 Large); a rate; or a list of rates, the
    # one that scores best on a held-out slice of each task's train split (finetune.lr_select_frac), never dev
    lr: float | list[float] | str = "electra"
    long_tasks: list[str] = field(default_factory=lambda: ["rte", "stsb"])  # trained glue.long_epochs epochs
    long_epochs: int = 10  # epochs of the long tasks (the others: finetune.epochs)
    from_mnli: list[str] = field(default_factory=list)  # tasks that start from MNLI's fine-tuned encoder (rte...)
    submission: bool = True  # predict every test split and write submission/*.tsv and submission.zip
    max_train_examples: int = 0  # 0 = all; else a fixed subset spread over each task's train split (CPU scale)
    max_dev_examples: int = 0  # 0 = all; else a fixed subset of each dev split (its scores then are not GLUE's)


@dataclass
class GlueConfig:
    run: FinetuneRunConfig = field(default_factory=lambda: FinetuneRunConfig(dir="runs/glue"))
    model: ModelInitConfig = field(default_factory=ModelInitConfig)
    # the settings of every task (configs/glue.yaml)
    finetune: FinetuneSettings = field(default_factory=FinetuneSettings)
    glue: GlueSection = field(default_factory=GlueSection)
    backend: BackendConfig = field(default_factory=BackendConfig)  # single, ddp or deepspeed (ZeRO 0-2)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)

    @property
    def task_list(self) -> list[GlueTask]:
        """The tasks in the order they run: MNLI first when a task starts from its checkpoint."""
        tasks = [task_named(t) for t in self.glue.tasks]
        return sorted(tasks, key=lambda t: t.name != "mnli") if self.glue.from_mnli else tasks

    def finish(self, launch: Launch) -> GlueConfig:
        """This config finished in place, as fine-tuning's (`finish_settings`): every task's config copies it."""
        finish_settings(self.finetune, self.backend, launch)
        return self

    def validate(self) -> GlueConfig:
        g = self.glue
        check_literals(self)
        if not g.data_dir:
            raise ConfigError("glue.data_dir: required (a glue_data/ directory, or datasets' save_to_disk / parquet)")
        if not g.tasks or len(set(g.tasks)) != len(g.tasks):
            raise ConfigError(f"glue.tasks: expected distinct GLUE tasks (a non-empty list), got {g.tasks}")
        for key, names in (("glue.tasks", g.tasks), ("glue.long_tasks", g.long_tasks),
                           ("glue.from_mnli", g.from_mnli)):
            for name in names:
                task_named(name, key)
        if g.from_mnli and ("mnli" not in g.tasks or "mnli" in g.from_mnli):
            raise ConfigError(f"glue.from_mnli={g.from_mnli}: needs mnli in glue.tasks (it trains first) and "
                              "cannot name mnli itself")
        if missing := [t for t in g.from_mnli if t not in g.tasks]:
            raise ConfigError(f"glue.from_mnli: {missing[0]} is not in glue.tasks {g.tasks}")
        if g.long_epochs < 1 or g.max_train_examples < 0 or g.max_dev_examples < 0:
            raise ConfigError("glue.long_epochs: expected >= 1; glue.max_train_examples and glue.max_dev_examples: "
                              "expected >= 0 (0 = all)")
        if self.finetune.lr != "auto":
            raise ConfigError(f"finetune.lr={self.finetune.lr}: megakd glue takes its rate from glue.lr (electra, a "
                              "rate or a list of rates); set that instead")
        if isinstance(g.lr, str) and g.lr != "electra":
            raise ConfigError(f"glue.lr: expected electra, a rate or a list of rates, got {shown(g.lr)}")
        # Every finetune.*, model.* and backend.* check of `megakd finetune`, on the first task.
        self.task_config(self.task_list[0], self.model, 1e-4).validate()
        return self

    def task_config(self, task: GlueTask, init: ModelInitConfig, lr: float | list[float]) -> FinetuneConfig:
        """The fine-tuning config of one task: its labels, epochs and rate, this run's other settings."""
        epochs = self.glue.long_epochs if task.name in self.glue.long_tasks else self.finetune.epochs
        metric = {"cola": "mcc", "stsb": "spearman"}.get(task.name, "accuracy")  # what an LR list is chosen by
        where = f"{self.glue.data_dir} ({task.name}"  # for the record: megakd/glue/tasks.py reads the files
        spec = TaskConfig(name="files", train=f"{where} train)", dev=f"{where} {task.dev_splits[0]})",
                          num_labels=task.num_labels, metric=metric, labels=list(task.labels))
        return FinetuneConfig(run=dataclasses.replace(self.run), task=spec, model=init,
                              finetune=dataclasses.replace(self.finetune, lr=lr, epochs=epochs),
                              backend=self.backend, kernels=self.kernels)
