import copy
from dataclasses import asdict

import pytest

from megakd.config import Config, ConfigError, load_config
from megakd.configio import config_to_dict, parse_override, save_config, upgrade_saved
from megakd.finetune.config import FinetuneConfig
from megakd.finish import finish_config
from megakd.glue.config import GlueConfig
from megakd.store.rundir import flatten, state_changes

CONFIGS = ["configs/electra-tiny.yaml", "configs/electra-base.yaml", "configs/electra-large.yaml"]


@pytest.mark.parametrize("path", CONFIGS)
def test_recipes_load_and_roundtrip(path, tmp_path):
    cfg = load_config(path)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_table_a1_values():
    base, large = (finish_config(load_config(f"configs/electra-{size}.yaml")) for size in ("base", "large"))
    for cfg in (base, large):
        assert cfg.train.max_steps == 125_000 and cfg.train.global_batch_size == 2048
        assert cfg.optim.generator.lr == 2e-4 and cfg.optim.discriminator.lr == 1.5e-3
        assert cfg.optim.schedule.warmup_steps == 10_000
        for opt in (cfg.optim.generator, cfg.optim.discriminator):
            assert opt.betas == (0.9, 0.98) and opt.eps == 1e-6 and opt.clip_norm == 2.0
            assert opt.weight_decay == 0.01
        assert cfg.model.generator.vocab_size == 128_000 and cfg.electra.decoupled
        for model in (cfg.model.generator, cfg.model.discriminator):  # Admin as its authors' code runs it
            assert (model.init, model.admin_profile) == ("admin", "reference")
    g, d = base.model.generator, base.model.discriminator
    assert (g.num_layers, g.hidden_size, d.num_layers, d.hidden_size) == (12, 768, 12, 768)
    assert (d.relative_buckets, d.relative_max_distance, d.init) == (32, 128, "admin")
    g, d = large.model.generator, large.model.discriminator
    assert (g.num_layers, g.hidden_size, d.num_layers, d.hidden_size) == (8, 1024, 24, 1024)
    assert (d.relative_buckets, d.relative_max_distance, d.num_heads) == (128, 256, 16)


def test_electra_mini_long_differs_from_electra_mini_only_where_the_readme_says():
    """The README's "Does pretraining pay off here?" compares the two recipes: they differ in these keys only."""
    mini, long = (flatten(asdict(load_config(f"configs/{name}.yaml")))
                  for name in ("electra-mini", "electra-mini-long"))
    changed = {key: (mini[key], long[key]) for key in mini if mini[key] != long[key]}
    assert changed == {
        "run.dir": ("runs/electra-mini", "runs/electra-mini-long"),
        "backend.name": (mini["backend.name"], "ddp"),
        "optim.discriminator.lr": (1e-3, 5e-4),
        "train.max_steps": (5000, 15000),
        "train.micro_batch_size": (32, 16),
    }
    assert long["train.global_batch_size"] == 32  # two ranks x 16, or one process accumulating twice


def test_electra_mini_from_mlm_is_electra_mini_long_started_from_bert_mini_long():
    """Stage 2 of the two-stage recipe reads stage 1's run dir, whose model has both of its models' shape;
    it halves the discriminator's LR and runs electra-mini-long's global batch as one micro-batch in one
    process, as stage 1 does."""
    long, staged = (flatten(asdict(load_config(f"configs/{name}.yaml")))
                    for name in ("electra-mini-long", "electra-mini-from-mlm"))
    changed = {key: (long[key], staged[key]) for key in long if long[key] != staged[key]}
    stage1 = load_config("configs/bert-mini-long.yaml")
    assert changed == {
        "run.dir": ("runs/electra-mini-long", "runs/electra-mini-from-mlm"),
        "init.from_": ("", stage1.run.dir),
        "init.discriminator": ("", stage1.run.dir),
        "train.precision": ("fp32", "bf16"),
        "train.max_steps": (15000, 8000),
        "optim.discriminator.lr": (5e-4, 2.5e-4),
        "backend.name": ("ddp", "single"),  # the process layout, not the recipe: the global batch is the same
        "train.micro_batch_size": (16, 32),
    }
    assert staged["train.global_batch_size"] == long["train.global_batch_size"] == staged["train.micro_batch_size"]
    cfg = load_config("configs/electra-mini-from-mlm.yaml")
    assert asdict(cfg.model.generator) == asdict(cfg.model.discriminator) == asdict(stage1.model.generator)


def test_override_keeps_section_defaults():
    cfg = load_config(None, ["optim.generator.clip_norm=0", "train.max_steps=7"])
    assert cfg.optim.generator.clip_norm == 0.0
    assert cfg.optim.generator.lr == Config().optim.generator.lr  # untouched key keeps its default
    assert cfg.train.max_steps == 7


def test_override_parsing():
    assert parse_override("a.b.c=[1, 2]") == {"a": {"b": {"c": [1, 2]}}}
    assert parse_override("x=true") == {"x": True}
    assert load_config(None, ["optim.generator.lr=1e-4"]).optim.generator.lr == 1e-4


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.max_stpes=3", "unknown config key 'train.max_stpes'; did you mean 'train.max_steps'?"),
        ("model.generator.hidden_size=abc", "model.generator.hidden_size: expected an integer"),
        ("model.generator.num_heads=3", "model.generator.hidden_size: expected a multiple of num_heads=3"),
        ("electra.decoupled=maybe", "electra.decoupled: expected true or false"),
        ("backend.name=horovod", "backend.name: expected one of auto, single, ddp, deepspeed"),
        ("backend.zero_stage=4", "backend.zero_stage"),
        ("optim.discriminator.betas=[0.9]", "optim.discriminator.betas: expected a list of 2 values"),
        ("trainn.seed=1", "unknown config key 'trainn'"),
        ("electra.sampling_temperature=0", "electra.sampling_temperature: expected > 0, got 0.0"),
        ("electra.sampling_temperature_end=-1", "electra.sampling_temperature_end: expected > 0, got -1.0"),
        ("electra.sampling_anneal_steps=-5", "electra.sampling_anneal_steps: expected >= 0"),
        ("train.max_steps", "expected key=value"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config("configs/electra-tiny.yaml", [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: {max_steps: 3\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    child = tmp_path / "child.yaml"
    child.write_text("inherit: child.yaml\n")
    with pytest.raises(ConfigError, match="circular"):
        load_config(child)


def test_batch_layout():
    cfg = load_config(None, ["train.global_batch_size=64", "train.micro_batch_size=8"])
    assert cfg.batch_layout(2) == (8, 4)
    with pytest.raises(ConfigError, match="not divisible"):
        cfg.batch_layout(3)


def test_shared_embeddings_need_equal_widths():
    with pytest.raises(ConfigError, match="same embedding size"):
        load_config(None, ["electra.decoupled=false", "model.generator.embedding_size=32"])


# -- renamed keys: old recipes, parents, overrides and saved configs keep loading ----------------------


def _renamed_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "is now called" in r.getMessage()]


def test_a_renamed_key_in_a_recipe_its_parent_or_an_override_loads_with_one_warning(tmp_path, caplog):
    parent = tmp_path / "parent.yaml"
    parent.write_text("train: {save_every: 7, max_steps: 20}\n")
    child = tmp_path / "child.yaml"
    child.write_text("inherit: parent.yaml\ntrain: {log_every: 2}\n")
    caplog.set_level("WARNING", logger="megakd.configio")
    assert load_config(child).run.save_every == 7
    assert _renamed_warnings(caplog) == [f"train.save_every is now called run.save_every (in {parent})"]
    caplog.clear()
    assert load_config(child, ["train.save_every=3"]).run.save_every == 3  # the command line wins, as any override
    assert _renamed_warnings(caplog) == [f"train.save_every is now called run.save_every (in {parent})",
                                         "train.save_every is now called run.save_every (on the command line)"]
    caplog.clear()
    child.write_text("inherit: parent.yaml\nrun: {save_every: 5}\n")  # the child's new key overrides its parent's old
    assert load_config(child).run.save_every == 5


@pytest.mark.parametrize("recipe, overrides", [
    ("train: {save_every: 7}\nrun: {save_every: 5}\n", []),
    ("", ["train.save_every=7", "run.save_every=5"]),
])
def test_both_names_given_is_one_line_error(tmp_path, recipe, overrides):
    path = tmp_path / "both.yaml"
    path.write_text(recipe)
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    assert str(err.value).startswith("train.save_every and run.save_every both given (")
    assert "\n" not in str(err.value)


def test_a_saved_config_of_an_older_version_compares_in_todays_names():
    """A checkpoint's config.yaml with `train.save_every`: upgraded, it differs from today's config in nothing."""
    current = config_to_dict(load_config("configs/electra-tiny.yaml", ["run.save_every=4"]))
    saved = copy.deepcopy(current)
    saved["train"]["save_every"] = saved["run"].pop("save_every")
    upgraded = upgrade_saved(Config, saved)
    assert upgraded == current and "save_every" in saved["train"]  # the caller's dict is left as it was
    assert flatten(upgraded) == flatten(current) and state_changes(upgraded, current) == {}
    assert "train.save_every" in state_changes(saved, current)  # without the upgrade the old key would differ


def test_every_renamed_key_is_one_the_tree_has_now():
    new = set(flatten(config_to_dict(Config())))
    assert all(new_key in new and old_key not in new for old_key, new_key in Config.RENAMES.items())


@pytest.mark.parametrize("cls, recipe, extra", [(Config, "configs/electra-tiny.yaml", []),
                                               (FinetuneConfig, "configs/finetune-rt.yaml", []),
                                               (GlueConfig, "configs/glue.yaml", ["glue.data_dir=glue_data"])])
def test_the_run_keys_mean_the_same_in_every_tree(cls, recipe, extra):
    """`run.keep_last: 0` keeps every checkpoint and `run.save_every: 0` saves only at the end, in every command."""
    run = load_config(recipe, [*extra, "run.keep_last=0", "run.save_every=5"], cls=cls).run
    assert (run.keep_last, run.save_every) == (0, 5)
    for key in ("run.keep_last", "run.save_every"):
        with pytest.raises(ConfigError, match=rf"^{key}: expected an integer >= 0 \(0 = "):
            load_config(recipe, [*extra, f"{key}=-1"], cls=cls)
