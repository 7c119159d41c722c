"""DeepSpeed ZeRO-2/3 checkpoints (real engines, CPU, gloo, one process) → consolidated → HF, exact."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from megakd.config import load_config
from megakd.configio import save_config
from megakd.convert import ConversionError, to_hf
from megakd.engine.backends import free_local_port, leave_process_group
from megakd.engine.deepspeed_backend import ProcessWideState
from megakd.models.electra import MaskedLM
from megakd.store.checkpoint import write_manifest
from tests.helpers import TINY_VOCAB, mlm_logits, tiny_overrides

CONFIG = Path(__file__).parents[2] / "configs" / "electra-tiny.yaml"


class _Loss(nn.Module):
    """Shaped like the DeepSpeed backend's loss modules: the model sits under `.model`."""

    def __init__(self, model: MaskedLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return mlm_logits(self.model, input_ids).logsumexp(-1).mean()


@pytest.fixture(scope="module", autouse=True)
def _single_process_world():
    """No process group, and none in DeepSpeed's caches (`leave_process_group`) before and after: the tests
    before and after this file in the same pytest process (a worker runs several files) must not meet
    this file's world, nor it theirs, nor the linear ZeRO-3 leaves in torch's place (`ProcessWideState`)."""
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_local_port())}
    saved = {k: os.environ.get(k) for k in env}
    found = ProcessWideState()
    leave_process_group()
    os.environ.update(env)
    yield
    leave_process_group()
    found.put_back()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _deepspeed_checkpoint(tiny_data, run: Path, stage: int) -> tuple[Path, torch.Tensor, torch.Tensor]:
    import deepspeed

    cfg = load_config(CONFIG, tiny_overrides(tiny_data, run, **{"model.objective": "mlm", "backend.name": "deepspeed",
                                                                 "backend.zero_stage": stage}))
    torch.manual_seed(0)
    model = MaskedLM(cfg.model.generator)
    loss_module = _Loss(model)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=loss_module, optimizer=torch.optim.AdamW(loss_module.parameters(), lr=1e-2),
                                      config=ds_config)
    ids = torch.randint(5, TINY_VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(ids))
    engine.step()  # the saved weights differ from the init
    step_dir = run / "checkpoints" / "step_00000001"
    step_dir.mkdir(parents=True)
    save_config(cfg, step_dir / "config.yaml")
    shutil.copytree(tiny_data[0], step_dir / "tokenizer")
    engine.save_checkpoint(str(step_dir / "generator"), tag="ds")
    write_manifest(step_dir, 1)  # sealed as the trainer's commit seals it
    model.eval()
    with deepspeed.zero.GatheredParameters(list(model.parameters())), torch.no_grad():
        reference = mlm_logits(model, ids)
    return step_dir, ids, reference


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_checkpoint_converts_exactly(tiny_data, tmp_path, stage):
    from transformers import BertForMaskedLM

    step_dir, ids, reference = _deepspeed_checkpoint(tiny_data, tmp_path / "run", stage)
    assert to_hf(tmp_path / "run", tmp_path / "hf") == {".": "BertForMaskedLM"}
    hf = BertForMaskedLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - reference).abs().max() <= 1e-5
    if stage == 0:  # no ZeRO: whole weights in mp_rank_00_model_states.pt, nothing to consolidate
        return
    shards = sorted((step_dir / "generator" / "ds").glob("*_optim_states.pt"))
    shards[0].unlink()
    write_manifest(step_dir, 1)  # consistently incomplete: the converter itself must notice
    with pytest.raises(ConversionError, match=r"generator: cannot consolidate the DeepSpeed ZeRO checkpoint"):
        to_hf(tmp_path / "run", tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()
