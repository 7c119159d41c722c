"""The one backend factory: pretraining and fine-tuning both name their backend in a `backend` section.

A module of its own because it imports every backend, and the DeepSpeed and pipeline backends
import `megakd.engine.backends` (which therefore cannot build them without a circle).
"""

from __future__ import annotations

from megakd.config import BackendConfig
from megakd.engine.backends import DDPBackend, TrainingBackend, require_launcher, single_process_backend
from megakd.finish import finish_backend


def build_backend(backend: BackendConfig, precision: str, micro_batch_size: int, tf32: bool = True
                  ) -> TrainingBackend:
    """The backend `backend.name` names, `backend.pipeline_stages > 1` making deepspeed the pipeline.

    `auto` is replaced in `backend` first (`finish_backend`, as a finished config has it already), so
    the run's config records the choice. `micro_batch_size` is what one rank's DeepSpeed engine takes
    per micro-batch; DeepSpeed is imported only when named. `tf32` (`train.tf32`, `finetune.tf32`):
    whether fp32 matmuls on a CUDA device run in TF32 while the backend is open
    (`TrainingBackend.use_device_settings`).
    """
    built = _build(backend, precision, micro_batch_size)
    built.tf32 = tf32
    return built


def _build(backend: BackendConfig, precision: str, micro_batch_size: int) -> TrainingBackend:
    name = finish_backend(backend)
    if name == "single":
        return single_process_backend(precision)
    require_launcher(name)
    if name == "ddp":
        return DDPBackend(precision, backend.dist_backend)
    from megakd.engine.deepspeed_backend import DeepSpeedBackend
    from megakd.engine.deepspeed_config import EngineConfigs

    engine_configs = EngineConfigs(backend, precision, micro_batch_size)
    if backend.pipeline_stages > 1:
        from megakd.engine.pipeline import PipelineBackend

        return PipelineBackend(engine_configs)
    return DeepSpeedBackend(engine_configs)
