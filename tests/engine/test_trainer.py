"""The pretraining loop on real tokenizer, shards and models (single process)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest
import torch

from megakd.config import ConfigError, load_config
from megakd.engine.pretrain import build_trainer, open_trainer
from megakd.engine.run import Stopped
from megakd.engine.session import TooManyBadSteps
from megakd.errors import UserError
from megakd.store import StoreError
from tests.helpers import tiny_overrides as tiny_overrides_for
from tests.helpers import trained


def _cfg(tiny_data, run_dir, **extra):
    return load_config("configs/electra-tiny.yaml", tiny_overrides_for(tiny_data, run_dir, **extra))


def _train(tiny_data, run_dir, resume=None, **extra):
    return trained(_cfg(tiny_data, run_dir, **extra), resume)


def _metrics(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("tokens_per_s", None)
    return rows


def _params(trainer):
    return {f"{u.name}.{k}": v.detach().clone()
            for u in trainer.units.values() for k, v in u.model.state_dict().items()}


CONTRACT_KEYS = {"step", "gen_loss", "gen_acc", "disc_loss", "disc_acc", "rtd_precision", "rtd_recall", "rtd_f1",
                 "replaced_frac", "lr_generator", "lr_discriminator", "grad_norm_generator",
                 "grad_norm_discriminator", "tokens_per_s", "read_retries"}


def test_metrics_contract_and_run_dir(tiny_data, tmp_path):
    run = tmp_path / "run"
    _train(tiny_data, run, **{"train.max_steps": 4, "run.save_every": 2, "run.keep_last": 1})
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert CONTRACT_KEYS <= set(r)
        assert 0 <= r["rtd_f1"] <= 1 and 0 <= r["gen_acc"] <= 1 and r["tokens_per_s"] > 0
    # warm-up 2 then linear decay to 0 at step 4, each optimizer from its own peak
    assert rows[0]["lr_generator"] == pytest.approx(2e-3 * 1.0)  # after step 1 the schedule is at step 1
    assert rows[-1]["lr_discriminator"] == pytest.approx(0.0)
    assert (run / "config.yaml").is_file()
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts == ["step_00000004"]  # keep_last=1 pruned step 2
    assert {p.name for p in (run / "checkpoints/step_00000004").iterdir()} >= {
        "config.yaml", "generator.safetensors", "generator.optim.pt", "discriminator.safetensors",
        "discriminator.optim.pt", "tokenizer", "trainer_state_rank00000.pt", "manifest.json"}


def _kill_when_logged(path, lines: int) -> threading.Thread:
    """SIGTERM this process once `path` has `lines` lines (a Slurm preemption in miniature)."""

    def watch():
        while not (path.exists() and len(path.read_text().splitlines()) >= lines):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


ANNEALED = {"electra.sampling_temperature": 3.0, "electra.sampling_temperature_end": 1.0,
            "electra.sampling_anneal_steps": 6}


@pytest.mark.parametrize("extra", [{}, ANNEALED], ids=["constant-temperature", "annealed-temperature"])
def test_sigterm_then_resume_is_bit_exact(tiny_data, tmp_path, extra):
    steps = {"train.max_steps": 8, "train.log_every": 1, "run.save_every": 0, **extra}
    full = _train(tiny_data, tmp_path / "full", **steps)
    run = tmp_path / "resumed"
    watcher = _kill_when_logged(run / "metrics.jsonl", 3)
    with pytest.raises(Stopped) as first:
        _train(tiny_data, run, **steps)
    watcher.join()
    assert 3 <= first.value.step < 8 and not first.value.interrupted  # stopped early, on the signal, with a checkpoint
    assert (run / f"checkpoints/step_{first.value.step:08d}").is_dir()
    resumed = _train(tiny_data, run, resume="auto", **steps)
    assert resumed.step == 8
    assert _metrics(run) == _metrics(tmp_path / "full")
    a, b = _params(full), _params(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_checkpoint_from_another_model_is_refused(tiny_data, tmp_path):
    run = tmp_path / "run"
    _train(tiny_data, run, **{"train.max_steps": 1})
    cfg = load_config("configs/electra-tiny.yaml",
                      tiny_overrides_for(tiny_data, run, **{"model.discriminator.hidden_size": 64}))
    with pytest.raises(StoreError, match=r"cannot resume with a different model.discriminator.hidden_size: 48 -> 64"):
        open_trainer(cfg, "auto")


def test_nonfinite_losses_skip_then_stop(tiny_data, tmp_path):
    trainer = open_trainer(_cfg(tiny_data, tmp_path / "run", **{"train.max_steps": 10, "train.max_bad_steps": 3}))
    disc = trainer.units["discriminator"].model
    with torch.no_grad():
        disc.head.prediction.bias.fill_(float("nan"))
    before = {k: v.clone() for k, v in trainer.units["generator"].model.state_dict().items()}
    with pytest.raises(TooManyBadSteps, match=r"train.max_bad_steps=3: 3 steps in a row .*non-finite loss"):
        try:
            trainer.train()
        finally:
            trainer.close()
    assert trainer.step == 0
    after = trainer.units["generator"].model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # skipped steps change nothing


def test_nonfinite_grad_norm_with_finite_loss_skips_every_unit(tiny_data, tmp_path):
    """λ = 1e300 is finite, but the λ-weighted fp32 loss overflows in backward: the loss the trainer
    checks is finite and only the gradient norm shows it. No unit may step (the generator's
    gradients are fine, yet its update is skipped too, so the two schedules stay together)."""
    trainer = open_trainer(_cfg(tiny_data, tmp_path / "run", **{
        "train.max_steps": 10, "train.max_bad_steps": 2, "electra.loss_weight": 1e300}))
    before = {name: {k: v.clone() for k, v in u.model.state_dict().items()} for name, u in trainer.units.items()}
    lrs = {name: u.lr for name, u in trainer.units.items()}
    with pytest.raises(TooManyBadSteps, match="non-finite gradient norm"):
        try:
            trainer.train()
        finally:
            trainer.close()
    assert trainer.step == 0 and trainer.loop.progress.bad_steps == 2
    for name, unit in trainer.units.items():
        assert all(torch.equal(before[name][k], v) for k, v in unit.model.state_dict().items()), name
        assert unit.lr == lrs[name] and unit.scheduler.last_epoch == 0, name
        assert not unit.optimizer.state, name  # Adam never stepped: no moments


def test_mlm_objective_trains_generator_only(tiny_data, tmp_path):
    trainer = _train(tiny_data, tmp_path / "run", **{"model.objective": "mlm", "train.max_steps": 3})
    assert list(trainer.units) == ["generator"]
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert "gen_loss" in rows[-1] and "disc_loss" not in rows[-1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_decoupled_electra_generator_is_the_mlm_run(tiny_data, tmp_path, precision):
    """Under DecoupledOptim the generator never sees the discriminator, so without dropout (as in the
    mini recipes) an ELECTRA run's generator is, bit for bit, the BERT-MLM run of the same config
    (configs/bert-mini-long.yaml relies on it). Dropout masks come from torch's global stream, which
    the discriminator's half of the step also advances, so with dropout the two runs differ."""
    runs = {objective: _train(tiny_data, tmp_path / objective, **{
        "model.objective": objective, "train.max_steps": 6, "train.precision": precision,
        "model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0})
        for objective in ("electra", "mlm")}
    electra, mlm = (runs[o].units["generator"].model.state_dict() for o in ("electra", "mlm"))
    assert electra.keys() == mlm.keys() and all(torch.equal(electra[k], mlm[k]) for k in electra)


def test_original_electra_shares_embeddings(tiny_data, tmp_path):
    trainer = _train(tiny_data, tmp_path / "run", **{"electra.decoupled": False, "train.max_steps": 2})
    pair = trainer.units["electra"].model
    g, d = pair.generator.encoder.embeddings, pair.discriminator.encoder.embeddings
    assert g.word_embeddings.weight is d.word_embeddings.weight


def test_world_size_must_divide_batch(tiny_data, tmp_path):
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides_for(tiny_data, tmp_path, **{
        "train.global_batch_size": 6, "train.micro_batch_size": 4}))
    with pytest.raises(ConfigError, match="not divisible"):
        build_trainer(cfg)


def test_admin_init_profiles_the_first_batch(tiny_data, tmp_path):
    from megakd.data.loader import PretrainingLoader
    from megakd.data.tokenizer import Tokenizer
    from megakd.engine.pretrain import build_models
    from megakd.models.admin import admin_initialize

    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides_for(tiny_data, tmp_path, **{
        "model.discriminator.init": "admin"}))
    disc = build_trainer(cfg).units["discriminator"].model
    _, reference = build_models(cfg)  # same seed → same weights; ω still at 1
    tokenizer_dir, shards_dir = tiny_data
    batch = next(iter(PretrainingLoader(shards_dir, Tokenizer.load(tokenizer_dir),
                                        micro_batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed)))
    admin_initialize(reference.encoder, batch["input_ids"], batch["attention_mask"], seed=cfg.train.seed)
    last = disc.encoder.layers[-1].ffn_omega  # the reference profile's first ω is 1 by definition
    assert not torch.allclose(last, torch.ones_like(last))
    for ours, ref in zip(disc.encoder.layers, reference.encoder.layers):
        assert torch.equal(ours.attention_omega, ref.attention_omega) and torch.equal(ours.ffn_omega, ref.ffn_omega)


def test_bf16_autocast_trains_close_to_fp32(tiny_data, tmp_path):
    rows = {}
    for precision in ("fp32", "bf16"):
        run = tmp_path / precision
        _train(tiny_data, run, **{"train.max_steps": 3, "train.precision": precision})
        rows[precision] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for a, b in zip(rows["fp32"], rows["bf16"]):
        assert b["gen_loss"] == pytest.approx(a["gen_loss"], rel=0.02)
        assert b["disc_loss"] == pytest.approx(a["disc_loss"], rel=0.05)
    assert rows["fp32"][-1]["gen_loss"] != rows["bf16"][-1]["gen_loss"]  # autocast really ran in bf16


def test_run_saved_before_fused_qkv_resumes_with_it(tiny_data, tmp_path):
    """A run of the version with three separate projections (no fused_qkv in its config) resumes
    with the fused default: same checkpoint keys, no config change to name, and steps that match
    the separate projections' to float32 rounding (the input gradient sums in another order)."""
    import shutil

    import yaml

    from megakd.store.checkpoint import write_manifest

    steps = {"train.max_steps": 3, "run.save_every": 2, "run.keep_last": 0}
    separate = {f"model.{m}.fused_qkv": False for m in ("generator", "discriminator")}
    full = _train(tiny_data, tmp_path / "full", **steps, **separate)
    old = tmp_path / "old"
    shutil.copytree(tmp_path / "full", old)
    shutil.rmtree(old / "checkpoints/step_00000003")
    for config in (old / "config.yaml", old / "checkpoints/step_00000002/config.yaml"):
        saved = yaml.safe_load(config.read_text())
        for model in ("generator", "discriminator"):
            del saved["model"][model]["fused_qkv"]
        config.write_text(yaml.safe_dump(saved, sort_keys=False))
    write_manifest(old / "checkpoints/step_00000002", 2)  # as the old version wrote it
    resumed = _train(tiny_data, old, resume="auto", **steps)
    assert resumed.step == 3 and all(layer.attention.fused_qkv for unit in resumed.units.values()
                                     for layer in unit.model.encoder.layers)
    want, got = _metrics(tmp_path / "full"), _metrics(old)
    assert [r["step"] for r in got] == [1, 2, 3] and got[:2] == want[:2]
    for key in ("gen_loss", "disc_loss", "grad_norm_generator", "grad_norm_discriminator"):
        assert got[2][key] == pytest.approx(want[2][key], rel=1e-5), key
    a, b = _params(full), _params(resumed)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
def test_single_backend_in_a_launched_rank_is_refused_naming_the_fix(command):
    """Under torchrun, backend.name=single would run the job once per rank, side by side."""
    from megakd.launch import Launch

    if command == "pretrain":
        from megakd.engine.pretrain import build_backend

        cfg = load_config("configs/electra-tiny.yaml", ["backend.name=single"])
    else:
        from megakd.finetune.config import FinetuneConfig
        from megakd.finetune.runtime import build_backend

        cfg = load_config("configs/finetune-rt.yaml", ["backend.name=single"], cls=FinetuneConfig)
    with pytest.raises(UserError, match=r"backend.name=single, but the launcher started 2 ranks.*backend.name=ddp"):
        build_backend(cfg, Launch(world_size=2, launched=True))
    assert build_backend(cfg, Launch()).world_size == 1


def test_added_hooks_run_when_due_and_write_their_lines(tiny_data, tmp_path):
    """`Trainer.add_hook`, as docs/architecture.md shows it: a hook joins the step's log line, one with
    `own_line` writes a line of its own, each only at the steps its period makes it due (a hook that
    returns None writes nothing), and the metrics of the run are those of a run without hooks."""
    from megakd.engine.hooks import StepHook

    trainer = open_trainer(_cfg(tiny_data, tmp_path / "hooked", **{"train.max_steps": 4, "train.log_every": 2}))
    seen = []
    trainer.add_hook(StepHook(2, lambda step: seen.append(step) or {"joined": step * 10}))
    trainer.add_hook(StepHook(3, lambda step: {"alone": step}, own_line=True))
    trainer.add_hook(StepHook(1, lambda step: None))
    try:
        trainer.train()
    finally:
        trainer.close()
    assert seen == [2, 4]
    rows = _metrics(tmp_path / "hooked")
    assert [(r["step"], r.get("joined"), r.get("alone")) for r in rows] == [(2, 20, None), (3, None, 3), (4, 40, None)]
    _train(tiny_data, tmp_path / "plain", **{"train.max_steps": 4, "train.log_every": 2})
    plain = _metrics(tmp_path / "plain")
    assert [{k: v for k, v in r.items() if k != "joined"} for r in rows if "alone" not in r] == plain


class _WeightEMA:
    """An exponential moving average of the discriminator's weights: run state added by a job, as
    docs/architecture.md § The training loop adds one (a hook with `state_dict`/`load_state_dict`)."""

    def __init__(self, model, decay=0.9):
        self.model, self.decay = model, decay
        self.shadow = {k: v.detach().double().clone() for k, v in model.state_dict().items()}

    def after_step(self, end):
        for k, v in self.model.state_dict().items():
            self.shadow[k].mul_(self.decay).add_(v.detach().double(), alpha=1 - self.decay)

    def end(self, step, finished):
        pass

    def state_dict(self):
        return {"shadow": {k: v.clone() for k, v in self.shadow.items()}}

    def load_state_dict(self, state):
        self.shadow = {k: v.clone() for k, v in state["shadow"].items()}


def test_a_stateful_part_added_by_a_job_is_checkpointed_and_resumes_bit_exactly(tiny_data, tmp_path):
    """One `add_hook(hook, state=...)` call: the EMA is saved with every checkpoint and, after a SIGTERM and
    `--resume auto`, ends equal to the uninterrupted run's (the resumed process starts from a fresh EMA, so
    only the restored state can make them equal). A checkpoint written without the part is refused in one line."""
    steps = {"train.max_steps": 6, "train.log_every": 1, "run.save_every": 0}

    def run(run_dir, resume=None, ema=True):
        parts = []

        def add_ema(trainer):  # before the checkpoint loads: the resume restores its state
            parts.append(_WeightEMA(trainer.units["discriminator"].model))
            trainer.add_hook(parts[0], state="weight_ema")

        trainer = trained(_cfg(tiny_data, run_dir, **steps), resume, extend=add_ema if ema else None)
        return trainer, parts[0] if ema else None

    _, full = run(tmp_path / "full")
    watcher = _kill_when_logged(tmp_path / "resumed" / "metrics.jsonl", 2)
    with pytest.raises(Stopped) as first:
        run(tmp_path / "resumed")
    watcher.join()
    assert 2 <= first.value.step < 6
    resumed, ema = run(tmp_path / "resumed", resume="auto")
    assert resumed.step == 6 and ema.shadow.keys() == full.shadow.keys()
    assert all(torch.equal(ema.shadow[k], full.shadow[k]) for k in full.shadow)

    run(tmp_path / "plain", ema=False)
    with pytest.raises(StoreError) as err:
        run(tmp_path / "plain", resume="auto")
    assert "\n" not in str(err.value) and "no saved state for weight_ema" in str(err.value)


def test_a_checkpoint_in_the_layout_before_named_parts_resumes_exactly(tiny_data, tmp_path):
    """A checkpoint whose rank state has the layout megakd wrote before the loop's parts had names
    (step, bad_steps, interval sums, data and rng side by side) resumes as the run it came from would
    have gone on. The old file is this run's own state rewritten in that layout."""
    import shutil

    from megakd.store import checkpoint

    steps = {"train.max_steps": 4, "train.log_every": 1, "run.save_every": 2, "run.keep_last": 0}
    full = _train(tiny_data, tmp_path / "full", **steps)
    run = tmp_path / "old"
    shutil.copytree(tmp_path / "full", run)
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    saved = run / "checkpoints" / "step_00000002"
    state = checkpoint.load_rank_state(saved, 0)
    checkpoint.save_rank_state(saved, 0, {**state["progress"], "interval": state["interval"]["sums"],
                                          "data": state["data"], "rng": state["rng"]})
    checkpoint.write_manifest(saved, 2)
    resumed = _train(tiny_data, run, resume="auto", **steps)
    assert resumed.step == 4 and _metrics(run) == _metrics(tmp_path / "full")
    a, b = _params(full), _params(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
