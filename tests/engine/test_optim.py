import math

import pytest
import torch

from megakd.config import OptimizerConfig, ScheduleConfig
from megakd.engine.optim import build_optimizer, build_scheduler, lr_multiplier


def test_linear_warmup_then_linear_decay_to_zero():
    s = ScheduleConfig(warmup_steps=10, decay="linear")
    assert lr_multiplier(0, s, 100) == pytest.approx(0.1)
    assert lr_multiplier(9, s, 100) == pytest.approx(1.0)
    assert lr_multiplier(10, s, 100) == pytest.approx(1.0)
    assert lr_multiplier(55, s, 100) == pytest.approx(0.5)
    assert lr_multiplier(100, s, 100) == pytest.approx(0.0)


def test_cosine_and_constant():
    assert lr_multiplier(50, ScheduleConfig(0, "cosine"), 100) == pytest.approx(0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_multiplier(77, ScheduleConfig(5, "constant"), 100) == 1.0


def test_two_optimizers_follow_their_own_peaks():
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    sched = ScheduleConfig(warmup_steps=4, decay="linear")
    opt_a = build_optimizer(a.named_parameters(), OptimizerConfig(lr=2e-4))
    opt_b = build_optimizer(b.named_parameters(), OptimizerConfig(lr=1.5e-3))
    sa, sb = build_scheduler(opt_a, sched, 20), build_scheduler(opt_b, sched, 20)
    for step in range(12):
        assert opt_a.param_groups[0]["lr"] == pytest.approx(2e-4 * lr_multiplier(step, sched, 20))
        assert opt_b.param_groups[0]["lr"] == pytest.approx(1.5e-3 * lr_multiplier(step, sched, 20))
        opt_a.step(), opt_b.step(), sa.step(), sb.step()


def test_no_weight_decay_on_biases_and_norms():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model.named_parameters(), OptimizerConfig(weight_decay=0.01))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.01 and [p.shape for p in decay["params"]] == [(4, 4)]
    assert no_decay["weight_decay"] == 0.0 and len(no_decay["params"]) == 3
    assert opt.defaults["betas"] == (0.9, 0.98) and opt.defaults["eps"] == 1e-6
