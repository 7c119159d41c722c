"""The one backend factory: pretraining and fine-tuning both name their backend in a `backend` section.

A module of its own because it imports every backend, and the DeepSpeed and pipeline backends
import `megakd.engine.backends` (which therefore cannot build them without a circle).
"""

from __future__ import annotations

from megakd.config import BackendConfig
from megakd.engine.backends import DDPBackend, TrainingBackend, require_launcher, single_process_backend
from megakd.launch import Launch


def build_backend(backend: BackendConfig, precision: str, micro_batch_size: int, launch: Launch, tf32: bool = True
                  ) -> TrainingBackend:
    """The backend `backend.name` names, `backend.pipeline_stages > 1` making deepspeed the pipeline, joined
    as `launch` (the command's, read at its entry) says.

    `backend` is a finished config's (`megakd.finish.finish_backend`: `auto` already made concrete); it is
    only read. `micro_batch_size` is what one rank's DeepSpeed engine takes per micro-batch; DeepSpeed is
    imported only when named. `tf32` (`train.tf32`, `finetune.tf32`): whether fp32 matmuls on a CUDA device
    run in TF32 while the backend is open (`TrainingBackend.use_device_settings`).
    """
    built = _build(backend, precision, micro_batch_size, launch)
    built.tf32 = tf32
    return built


def _build(backend: BackendConfig, precision: str, micro_batch_size: int, launch: Launch) -> TrainingBackend:
    if backend.name == "auto":
        raise ValueError("backend.name=auto: finish the config (megakd.finish) before building its backend")
    if backend.name == "single":
        return single_process_backend(precision, launch)
    require_launcher(backend.name, launch)
    if backend.name == "ddp":
        return DDPBackend(launch, precision, backend.dist_backend)
    from megakd.engine.deepspeed_backend import DeepSpeedBackend
    from megakd.engine.deepspeed_config import EngineConfigs

    engine_configs = EngineConfigs(backend, precision, micro_batch_size)
    if backend.pipeline_stages > 1:
        from megakd.engine.pipeline import PipelineBackend

        return PipelineBackend(engine_configs, launch)
    return DeepSpeedBackend(engine_configs, launch)
