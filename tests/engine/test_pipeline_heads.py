"""The pipeline backend's stages compute the layout's micro-step, exactly, in one process.

`build_stages(layout, 1)` puts every piece (embeddings, layers, both heads) on one stage; run on
a micro-batch, its loss and statistics must be bit-identical to what the layout's `micro_step`
computes from the same models, sampling stream and step (λ ≠ 1, so a dropped or doubled λ shows).
tests/distributed/test_pipeline.py compares whole multi-process runs, to 1e-5.
"""

from __future__ import annotations

import pytest
import torch

from megakd.config import load_config
from megakd.engine.layouts import build_layout
from megakd.engine.pipeline import DATA_KEYS, build_stages
from megakd.engine.units import StepContext
from megakd.models.electra import Discriminator, MaskedLM
from tests.helpers import RecordedRun, masked_batch, tiny_overrides

pytest.importorskip("deepspeed")

CONFIG = "configs/electra-tiny.yaml"
SETTINGS = {"electra.loss_weight": 7.0, "model.generator.dropout": 0.0, "model.discriminator.dropout": 0.0,
            "kernels.backend": "torch"}


@pytest.mark.parametrize("objective, rtd_positions", [("electra", "all"), ("mlm", "all"), ("electra", "masked")])
def test_one_stage_pipeline_computes_the_layouts_micro_step(tiny_data, tmp_path, objective, rtd_positions):
    """`rtd_positions=masked` (ELECTRA 15 %) too: the stage passes the mlm mask to the discriminator's loss."""
    cfg = load_config(CONFIG, tiny_overrides(tiny_data, tmp_path, **SETTINGS, **{
        "model.objective": objective, "electra.rtd_positions": rtd_positions}))
    torch.manual_seed(cfg.train.seed)
    generator = MaskedLM(cfg.model.generator)
    discriminator = Discriminator(cfg.model.discriminator) if objective == "electra" else None
    layout = build_layout(cfg, generator, discriminator)
    (stage,) = build_stages(layout, 1)
    batch = masked_batch(cfg.model.generator.vocab_size, 4)

    run = RecordedRun()
    want = layout.micro_step(run, batch, StepContext(index=2, rng=torch.Generator().manual_seed(5)))
    with stage.running(StepContext(index=2, rng=torch.Generator().manual_seed(5))):
        loss = stage(tuple(batch[k] for k in DATA_KEYS))
    got_stats = {k: v for head in stage.heads() for k, v in head.stats.items()}

    if objective == "electra":
        weight = layout.discriminator.loss_scale
        assert weight == 7.0
        assert torch.equal(loss, run.losses["generator"] + weight * run.losses["discriminator"])
    else:
        assert torch.equal(loss, run.losses["generator"])
    assert set(got_stats) == set(want.stats)
    assert all(torch.equal(got_stats[k], want.stats[k].double()) for k in want.stats), \
        {k: (float(got_stats[k]), float(want.stats[k])) for k in want.stats}
