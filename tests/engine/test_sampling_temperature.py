"""The annealed sampling temperature: the schedule against its formula, the generator's draws at a
step against a constant-temperature draw, and what a real run logs."""

from __future__ import annotations

import json

import pytest
import torch

from megakd.config import load_config
from megakd.engine.losses import GeneratorLoss
from megakd.models.electra import MaskedLM
from megakd.models.encoder import EncoderConfig
from megakd.objectives.electra import SamplingTemperature
from tests.helpers import tiny_overrides, trained


@pytest.mark.parametrize("start,end,steps", [(2.0, 1.0, 12), (0.5, 3.0, 7), (2.0, None, 5), (1.5, 1.5, 4)])
def test_schedule_is_linear_then_held(start, end, steps):
    schedule = SamplingTemperature(start, end, steps)
    for step in range(3 * steps):
        if end is None:
            expected = start
        else:
            expected = start + (end - start) * min(step, steps) / steps
        assert schedule.at(step) == pytest.approx(expected, rel=1e-15)
    assert schedule.annealed == (end is not None and end != start)


def test_generator_draws_at_a_step_what_a_constant_temperature_draws():
    torch.manual_seed(0)
    vocab = 53
    model = MaskedLM(EncoderConfig(vocab_size=vocab, hidden_size=16, num_layers=1, num_heads=2,
                                   intermediate_size=32, max_position_embeddings=24, dropout=0.0,
                                   attention_dropout=0.0)).eval()
    ids = torch.randint(5, vocab, (3, 24))
    mask = torch.rand(3, 24) < 0.4
    batch = {"input_ids": ids, "masked_input_ids": ids.masked_fill(mask, 4), "mlm_mask": mask,
             "attention_mask": torch.ones_like(ids)}
    annealed = GeneratorLoss(model, "torch", SamplingTemperature(4.0, 1.0, 6))
    samples = {}
    for step, temperature in ((0, 4.0), (2, 3.0), (6, 1.0), (50, 1.0)):
        constant = GeneratorLoss(model, "torch", temperature)
        a = annealed(batch, torch.Generator().manual_seed(7), step)
        b = constant(batch, torch.Generator().manual_seed(7), step)
        assert torch.equal(a["samples"], b["samples"]), step
        assert a["stats"]["temperature_sum"].item() == temperature
        samples[step] = a["samples"]
    # the temperature reaches the draws: the same uniforms give other tokens at 4 than at 1
    assert not torch.equal(samples[0], samples[6])


def test_run_logs_the_temperature_of_each_interval(tiny_data, tmp_path):
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path / "run", **{
        "train.max_steps": 6, "train.log_every": 2, "electra.sampling_temperature": 3.0,
        "electra.sampling_temperature_end": 1.0, "electra.sampling_anneal_steps": 4}))
    trained(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    # optimizer steps 0-1, 2-3, 4-5 run at 3, 2.5 | 2, 1.5 | 1, 1
    assert [r["sampling_temperature"] for r in rows] == pytest.approx([2.75, 1.75, 1.0], rel=1e-12)


def test_constant_temperature_logs_no_temperature(tiny_data, tmp_path):
    cfg = load_config("configs/electra-tiny.yaml", tiny_overrides(tiny_data, tmp_path / "run", **{
        "train.max_steps": 1, "electra.sampling_temperature": 2.0}))
    trained(cfg)
    row = json.loads((tmp_path / "run/metrics.jsonl").read_text().splitlines()[0])
    assert "sampling_temperature" not in row
