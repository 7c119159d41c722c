"""DWT: the KD loss and one student step against float64 references, α_s schedules, the frozen teacher,
tokenizer checks, and short real teacher → student runs through the trainer and the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megakd.cli import main as cli_main
from megakd.config import ConfigError, load_config
from megakd.convert import from_hf, save_model_dir, to_hf
from megakd.data.tokenizer import Tokenizer, train_tokenizer
from megakd.engine.losses import GeneratorLoss, TeacherKD
from megakd.engine.pretrain import build_models, build_trainer, open_trainer, run_distill, run_pretraining
from megakd.finish import finish_config
from megakd.models.electra import MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.objectives.distill import alpha_schedule, kd_loss
from megakd.store import StoreError, check_same_tokenizer, load_model
from tests.helpers import mlm_logits, tiny_overrides

REPO = Path(__file__).parents[2]

V = 37


def _mlm(hidden: int, layers: int, embedding_size: int | None = None, seed: int = 0) -> MaskedLM:
    torch.manual_seed(seed)
    cfg = EncoderConfig(vocab_size=V, hidden_size=hidden, num_layers=layers, num_heads=2, intermediate_size=2 * hidden,
                        embedding_size=embedding_size, max_position_embeddings=16, dropout=0.0,
                        attention_dropout=0.0)
    model = MaskedLM(cfg).double()
    with torch.no_grad():  # larger weights than the 0.02 init, so the two distributions differ visibly
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def _kl_reference(s_logits: torch.Tensor, t_logits: torch.Tensor, tau: float) -> torch.Tensor:
    """τ²·mean_rows Σ_v p_t (log p_t − log p_s), written out on materialised float64 logits."""
    log_ps = torch.log_softmax(s_logits / tau, -1)
    log_pt = torch.log_softmax(t_logits / tau, -1)
    return tau**2 * (log_pt.exp() * (log_pt - log_ps)).sum(-1).mean()


@pytest.mark.parametrize("tau", [1.0, 2.5])
def test_kd_loss_matches_float64_reference(tau):
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(13, 6, dtype=torch.float64, generator=g, requires_grad=True)
    ws = torch.randn(V, 6, dtype=torch.float64, generator=g, requires_grad=True)
    bs = torch.randn(V, dtype=torch.float64, generator=g, requires_grad=True)
    ht, wt, bt = (torch.randn(*s, dtype=torch.float64, generator=g, requires_grad=True)
                  for s in ((13, 4), (V, 4), (V,)))
    loss = kd_loss(hs, ws, bs, ht, wt, bt, tau, backend="torch")
    ref = _kl_reference(hs @ ws.T + bs, (ht @ wt.T + bt).detach(), tau)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-14)
    grads = torch.autograd.grad(loss, (hs, ws, bs))
    ref_grads = torch.autograd.grad(ref, (hs, ws, bs))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert loss.requires_grad and not ht.grad and not wt.grad  # the teacher gets nothing
    empty = kd_loss(hs[:0], ws, bs, ht[:0], wt, bt, tau, backend="torch")
    assert empty.item() == 0.0  # a micro-batch without masked tokens contributes nothing


def test_alpha_schedules():
    T = 11  # steps 0..10; progress = step / 10
    assert [alpha_schedule("constant", 4, 1, s, T) for s in (0, 5, 10)] == [4, 4, 4]
    assert [alpha_schedule("linear", 4, 1, s, T) for s in (0, 2, 5, 10)] == pytest.approx([4, 3.4, 2.5, 1])
    cos = [alpha_schedule("cosine", 4, 1, s, T) for s in (0, 2, 5, 8, 10)]
    assert cos == pytest.approx([4, 1 + 1.5 * (1 + math.cos(0.2 * math.pi)), 2.5,
                                 1 + 1.5 * (1 + math.cos(0.8 * math.pi)), 1])
    assert [alpha_schedule("step", 4, 1, s, T) for s in (0, 4, 5, 10)] == [4, 4, 1, 1]
    assert [alpha_schedule("step", 4, 1, s, T, step_at=0.25) for s in (2, 3)] == [4, 1]
    assert alpha_schedule("linear", 4, 1, 0, 1) == 4  # a one-step run uses the start value
    assert alpha_schedule("linear", 1, 3, 5, T) == pytest.approx(2)  # increasing schedules work too
    with pytest.raises(ValueError, match="distill.alpha_schedule"):
        alpha_schedule("exponential", 4, 1, 0, T)


def test_one_dwt_step_equals_autograd_of_reference_loss():
    """Student gradient of α_h·CE + α_s·τ²·KL through GeneratorLoss == autograd of a dense float64 reference."""
    student, teacher = _mlm(16, 2, embedding_size=8), _mlm(12, 1, seed=1)
    teacher.eval().requires_grad_(False)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    tau, alpha_h = 2.0, 0.7
    kd = TeacherKD(teacher, tau, alpha_h, 4.0, 1.0, "linear", max_steps=5)
    task = GeneratorLoss(student, kernel_backend="torch", kd=kd)
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(5, V, (3, 16), generator=g)
    attn = torch.ones(3, 16, dtype=torch.bool)
    attn[1, 11:] = False  # padding: never masked, never a KD row
    mlm_mask = (torch.rand(3, 16, generator=g) < 0.3) & attn
    batch = {"input_ids": ids, "attention_mask": attn, "mlm_mask": mlm_mask,
             "masked_input_ids": torch.where(mlm_mask, 4, ids)}
    out = task(batch, torch.Generator().manual_seed(0), step=3)  # α_s = 4 + (1 - 4) * 3/4
    out["loss"].backward()
    got = {n: p.grad.clone() for n, p in student.named_parameters()}

    student.zero_grad()
    s_logits = mlm_logits(student, batch["masked_input_ids"], attn)[mlm_mask]
    with torch.no_grad():
        t_logits = mlm_logits(teacher, batch["masked_input_ids"], attn)[mlm_mask]
    alpha_s = 4 + (1 - 4) * 3 / 4
    ref = alpha_h * F.cross_entropy(s_logits, ids[mlm_mask]) + alpha_s * _kl_reference(s_logits, t_logits, tau)
    ref.backward()
    assert out["loss"].item() == pytest.approx(ref.item(), rel=1e-12)
    for name, p in student.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-9, atol=1e-12, msg=name)
    assert out["stats"]["alpha_soft_sum"].item() == pytest.approx(alpha_s)
    n = int(mlm_mask.sum())
    assert out["stats"]["kd_loss_sum"].item() == pytest.approx(_kl_reference(s_logits, t_logits, tau).item() * n)
    assert all(p.grad is None for p in teacher.parameters())
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())


def _teacher_dir(tiny_data, tmp_path, tokenizer_dir=None):
    model = MaskedLM(EncoderConfig(vocab_size=512, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                   max_position_embeddings=64))
    return save_model_dir(model, "masked_lm", tmp_path / "teacher", tokenizer_dir=tokenizer_dir)


def _student_cfg(tiny_data, run_dir, teacher, **extra):
    return load_config("configs/dwt-tiny.yaml", tiny_overrides(
        tiny_data, run_dir, **{"distill.teacher": str(teacher), "model.generator.num_layers": 2,
                               "model.generator.hidden_size": 48, "model.generator.intermediate_size": 96,
                               "model.generator.num_heads": 2, "model.generator.embedding_size": "null",
                               "run.export_hf": "false", **extra}))


def test_tokenizer_mismatch_names_both_hashes_and_paths(tiny_data, tmp_path):
    tokenizer_dir, _ = tiny_data
    other = train_tokenizer([tokenizer_dir.parent / "slice.jsonl"], 600, tmp_path / "other_tok")
    teacher = _teacher_dir(tiny_data, tmp_path, tokenizer_dir=other.path)
    cfg = _student_cfg(tiny_data, tmp_path / "run", teacher)
    student_hash = Tokenizer.load(tokenizer_dir).vocab_hash
    with pytest.raises(StoreError) as err:
        build_trainer(cfg)
    msg = str(err.value)
    assert "distill.teacher" in msg and other.vocab_hash in msg and student_hash in msg
    assert str(teacher / "tokenizer") in msg and str(tokenizer_dir) in msg and "\n" not in msg

    bare = _teacher_dir(tiny_data, tmp_path / "bare")  # no tokenizer at all: cannot be checked
    with pytest.raises(StoreError, match="carries no tokenizer"):
        build_trainer(_student_cfg(tiny_data, tmp_path / "run2", bare))


def test_distill_needs_a_teacher_and_a_masked_lm(tiny_data, tmp_path):
    cfg = load_config("configs/dwt-tiny.yaml", tiny_overrides(tiny_data, tmp_path / "run"))
    with pytest.raises(ConfigError, match="distill.teacher: expected a teacher"):
        run_distill(cfg)
    with pytest.raises(StoreError, match="distill.teacher=.*missing: no such directory"):
        build_trainer(_student_cfg(tiny_data, tmp_path / "run", tmp_path / "missing"))


def _metrics(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def teacher_run(tiny_data, tmp_path_factory):
    """A real 1-layer × 32 BERT-MLM teacher: 20 pretraining steps on the tiny data."""
    run = tmp_path_factory.mktemp("dwt") / "teacher"
    cfg = load_config("configs/dwt-tiny.yaml", tiny_overrides(
        tiny_data, run, **{"model.generator.num_layers": 1, "model.generator.hidden_size": 32,
                           "model.generator.num_heads": 2, "model.generator.intermediate_size": 64,
                           "model.generator.embedding_size": "null", "train.max_steps": 20,
                           "optim.generator.lr": 3e-3, "run.export_hf": "false", "train.log_every": 10}))
    run_pretraining(cfg)
    return run


@pytest.mark.slow
def test_dwt_run_kd_loss_falls_teacher_frozen(tiny_data, tmp_path, teacher_run):
    steps = 20
    cfg = _student_cfg(tiny_data, tmp_path / "student", teacher_run, **{"train.max_steps": steps,
                                                                         "optim.generator.lr": 3e-3})
    trainer = open_trainer(cfg)
    teacher = trainer.units["generator"].loss_module.kd.teacher
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = _metrics(tmp_path / "student")
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert {"kd_loss", "alpha_soft", "gen_loss", "gen_acc", "lr_generator"} <= set(r)
        assert math.isfinite(r["kd_loss"]) and r["kd_loss"] >= 0
    # step s logs the α_s of 0-based step s-1: linear 4 → 1 over the run
    assert [r["alpha_soft"] for r in rows] == pytest.approx([4 - 3 * i / (steps - 1) for i in range(steps)])
    first, last = sum(r["kd_loss"] for r in rows[:3]) / 3, sum(r["kd_loss"] for r in rows[-3:]) / 3
    assert last < 0.8 * first  # the student moves towards the teacher
    assert not teacher.training
    assert all(p.grad is None and not p.requires_grad for p in teacher.parameters())
    assert all(torch.equal(v, teacher.state_dict()[k]) for k, v in before.items())
    assert not any(k.startswith("teacher") for k in trainer.units["generator"].loss_module.state_dict())


def test_dwt_into_electra_generator_and_remap_via_cli(tiny_data, tmp_path, teacher_run):
    """`megakd distill` on an ELECTRA recipe: KD into the generator's MLM head, RTD metrics unchanged."""
    run = tmp_path / "electra"
    overrides = tiny_overrides(tiny_data, run, **{"train.max_steps": 3, "distill.teacher": str(teacher_run),
                                                  "distill.alpha_schedule": "constant", "run.export_hf": "false"})
    assert cli_main(["distill", "-c", "configs/dwt-electra-tiny.yaml", *overrides]) == 0
    rows = _metrics(run)
    assert all({"kd_loss", "alpha_soft", "gen_loss", "disc_loss", "rtd_f1"} <= set(r) for r in rows)
    assert [r["alpha_soft"] for r in rows] == [4.0, 4.0, 4.0]

    joint = tmp_path / "joint"  # original ELECTRA: one joint unit, the schedule still advances
    assert cli_main(["distill", "-c", "configs/dwt-electra-tiny.yaml", *tiny_overrides(
        tiny_data, joint, **{"train.max_steps": 3, "distill.teacher": str(teacher_run), "electra.decoupled": "false",
                             "run.export_hf": "false"})]) == 0
    assert [r["alpha_soft"] for r in _metrics(joint)] == pytest.approx([4.0, 2.5, 1.0])

    # remap: the student (2 layers x 64, from a 1 x 32 teacher) starts as the teacher's function
    cfg = _student_cfg(tiny_data, tmp_path / "remap", teacher_run, **{
        "distill.init": "remap", "model.generator.hidden_size": 64, "model.generator.intermediate_size": 128,
        "model.generator.num_heads": 4, "model.generator.num_layers": 1, "model.generator.dropout": 0.0})
    trainer = build_trainer(cfg)
    student, teacher = trainer.units["generator"].model.eval(), trainer.units["generator"].loss_module.kd.teacher
    ids = torch.randint(5, 512, (2, 20))
    torch.testing.assert_close(mlm_logits(student, ids), mlm_logits(teacher, ids), rtol=1e-4, atol=1e-4)

    bad = tmp_path / "bad"
    assert cli_main(["distill", "-c", "configs/dwt-weak.yaml",
                     *tiny_overrides(tiny_data, bad, **{"distill.teacher": str(tmp_path / "nope")})]) == 2
    assert not (bad / "metrics.jsonl").exists()


@pytest.mark.slow
def test_teacher_from_run_hf_dir_and_model_dir_is_the_same_model(tiny_data, tmp_path, teacher_run):
    """A teacher run exported to HF (BertForMaskedLM + spm.model) and re-imported loads, passes the tokenizer
    check and computes the same logits as the run's checkpoint."""
    tok = Tokenizer.load(tiny_data[0])
    to_hf(teacher_run, tmp_path / "hf")
    from_hf(tmp_path / "hf", tmp_path / "model_dir")
    ids = torch.randint(5, 512, (2, 20))
    reference = load_model(teacher_run, "distill.teacher").get("masked_lm")
    for src in (tmp_path / "hf", tmp_path / "model_dir"):
        loaded = load_model(src, "distill.teacher")
        model = loaded.get("masked_lm")
        check_same_tokenizer(tok, loaded.tokenizer_dir, "distill.teacher", model.config.vocab_size)
        assert not model.training
        torch.testing.assert_close(mlm_logits(model, ids), mlm_logits(reference, ids), rtol=1e-5, atol=1e-5)
    with pytest.raises(StoreError, match="holds a masked LM .*; expected an ELECTRA discriminator"):
        load_model(teacher_run, "distill.teacher").get("discriminator")


# The teacher run each recipe names, and the command that makes it (the 4-layer one is bert-mini.yaml).
TEACHER_RUNS = {4: ("runs/bert-mini", "bert-mini.yaml", ()),
                2: ("runs/dwt-teacher-mini-2l", "dwt-mini.yaml", ("model.generator.num_layers=2",)),
                1: ("runs/dwt-teacher-mini-1l", "dwt-mini.yaml", ("model.generator.num_layers=1",))}


@pytest.mark.parametrize("recipe,teacher_layers,alpha_soft", [
    ("dwt-weak", 4, (1.0, 1.0)),  # the paper's +1.44 / −1.37 / −2.76 came from constant α_h:α_s = 1:1
    ("dwt-very-weak", 2, (1.0, 1.0)),
    ("dwt-extremely-weak", 1, (1.0, 1.0)),
    ("dwt-weak-strong", 4, (4.0, 4.0)),  # "Strong" = constant 1:4
    ("dwt-weak-4to1", 4, (4.0, 1.0)),  # the recommended (never run) decay, its own recipe
])
def test_dwt_recipes_use_the_papers_loss_weights(recipe, teacher_layers, alpha_soft):
    cfg = load_config(f"configs/{recipe}.yaml")
    d, steps = cfg.distill, cfg.train.max_steps
    teacher_dir, teacher_recipe, teacher_overrides = TEACHER_RUNS[teacher_layers]
    assert d.alpha_hard == 1.0 and d.init == "random" and d.teacher == teacher_dir
    assert f"megakd pretrain -c configs/{teacher_recipe}" in (REPO / "configs" / f"{recipe}.yaml").read_text() \
        or recipe in ("dwt-weak-strong", "dwt-weak-4to1")  # these two reuse dwt-weak.yaml's teacher
    schedule = [alpha_schedule(d.alpha_schedule, d.alpha_soft_start, d.alpha_soft_end, s, steps, d.alpha_step_at)
                for s in range(steps)]
    assert (schedule[0], schedule[-1]) == alpha_soft
    assert schedule == sorted(schedule, reverse=True)  # constant or decaying, never rising
    # the 6-layer student at the mini setting; the teacher is the same recipe with fewer layers
    assert cfg.model.generator.num_layers == 6 and cfg.model.objective == "mlm"
    assert (cfg.data == load_config("configs/dwt-mini.yaml").data
            and cfg.optim == load_config("configs/bert-mini.yaml").optim)
    teacher = load_config(f"configs/{teacher_recipe}", list(teacher_overrides)).model.generator
    assert teacher == dataclasses.replace(cfg.model.generator, num_layers=teacher_layers)


def test_dwt_weak_long_is_dwt_weak_on_its_teachers_budget():
    """dwt-weak-long changes only the teacher (bert-mini-long) and the budget, to exactly the teacher's."""
    weak, long = load_config("configs/dwt-weak.yaml"), load_config("configs/dwt-weak-long.yaml")
    teacher = load_config("configs/bert-mini-long.yaml")
    assert long.distill == dataclasses.replace(weak.distill, teacher=teacher.run.dir)
    assert long.model == weak.model and long.optim == weak.optim and long.data == weak.data
    assert long.train == dataclasses.replace(weak.train, precision=teacher.train.precision,
                                             max_steps=teacher.train.max_steps)
    assert teacher.model.generator == dataclasses.replace(long.model.generator, num_layers=4)
    assert "megakd pretrain -c configs/bert-mini-long.yaml" in (REPO / "configs" / "dwt-weak-long.yaml").read_text()


def test_dwt_mini_teacher_ratios_are_the_ones_its_recipes_state():
    """The parameter ratios in the recipes' comments are those of the built models (0.77x / 0.54x / 0.43x)."""
    def parameters(layers: int) -> int:
        cfg = finish_config(load_config("configs/dwt-mini.yaml", [f"model.generator.num_layers={layers}"]))
        return sum(p.numel() for p in build_models(cfg)[0].parameters())

    student = parameters(6)
    comments = (REPO / "configs" / "dwt-mini.yaml").read_text()
    ratios = [f"{parameters(layers) / student:.2f}x" for layers in (4, 2, 1)]
    assert f"{ratios[0]}, {ratios[1]} and {ratios[2]} the student's parameters" in comments.replace("\n# ", " ")
    for recipe, ratio in zip(("dwt-weak", "dwt-very-weak", "dwt-extremely-weak"), ratios):
        assert f"teacher, {ratio} the student" in (REPO / "configs" / f"{recipe}.yaml").read_text()


def test_hf_teacher_with_another_tokenizer_is_named_in_one_line(tiny_data, wordpiece_data, tmp_path):
    from tests.helpers import save_tiny_hf_model

    teacher = tmp_path / "bert"
    save_tiny_hf_model("BertForMaskedLM", teacher, wordpiece_data[0])  # a stock HF BERT with its WordPiece vocab
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(
        tiny_data, tmp_path / "run", **{"model.objective": "mlm", "distill.teacher": str(teacher)}))
    with pytest.raises(StoreError) as err:
        build_trainer(cfg)
    msg = str(err.value)
    assert f"distill.teacher={teacher}: its hf tokenizer {teacher} (403 ids" in msg and "\n" not in msg
    assert f"is not the sentencepiece tokenizer {tiny_data[0]} (512 ids" in msg
