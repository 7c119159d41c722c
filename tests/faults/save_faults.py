"""`python -m tests.faults.save_faults ARGS` (one rank of a launch): `megakd ARGS` with one fault injected
into one rank's writes of one checkpoint, as tests/faults/test_save_across_ranks.py drives it.

Environment: `FAULT_RANK` (the rank that fails), `FAULT_STEP` (the checkpoint's step), `FAULT_AT`, one of
- `partition`: the rank's ZeRO optimizer partition, inside DeepSpeed's `save_checkpoint` (half written, ENOSPC);
- `config`: rank 0's `config.yaml` (half written, ENOSPC);
- `rank_state`: the rank's `trainer_state_rank*.pt` (half written, ENOSPC);
- `kill`: the rank is SIGKILLed while writing its partition;
- `hang`: the rank stops answering while writing its partition, until rank 0 has exited; then it is SIGKILLed
  (as a launcher ends what is left of a job);
and `FAULT_STOP=1`: every rank receives SIGUSR1 (what the launchers forward) as it writes its partition.
`FAULT_TIMEOUT_S` replaces `megakd.engine.session.SAVE_TIMEOUT_S`. Into the directory `FAULT_TIMES` the failing
rank writes `fault` (when its fault struck, `time.time()`), every rank `pid-<rank>` as it starts, and every rank
that returns from `megakd.cli.main` `exit-<rank>` (when, and its exit code).
"""

from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

RANK = int(os.environ.get("RANK", "0"))
STEP = int(os.environ["FAULT_STEP"])
AT = os.environ["FAULT_AT"]
FAILING = RANK == int(os.environ["FAULT_RANK"])


TIMES = Path(os.environ["FAULT_TIMES"])


def _now(name: str, *also) -> None:
    (TIMES / name).write_text(" ".join(map(repr, (time.time(), *also))))


def _in_fault_step(path) -> bool:
    return f".tmp-step_{STEP:08d}" in str(path)


def _half_then_full(path) -> None:
    """What a disk that fills up mid-write leaves: half the file, then ENOSPC."""
    size = Path(path).stat().st_size if Path(path).exists() else 0
    with open(path, "r+b" if size else "wb") as f:
        f.truncate(size // 2)
    raise OSError(errno.ENOSPC, "No space left on device", str(path))


def _install() -> None:
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    import megakd.engine.session as session
    import megakd.engine.trainer as trainer
    from megakd.store import checkpoint

    if "FAULT_TIMEOUT_S" in os.environ:
        session.SAVE_TIMEOUT_S = float(os.environ["FAULT_TIMEOUT_S"])
    real_save, real_config = TorchCheckpointEngine.save, trainer.save_config
    real_rank_state = checkpoint.save_rank_state

    def partition_save(self, state_dict, path):
        here = _in_fault_step(path) and str(path).endswith("_optim_states.pt")
        if here and os.environ.get("FAULT_STOP") == "1":
            os.kill(os.getpid(), signal.SIGUSR1)
        if here and FAILING and AT in ("kill", "hang", "partition"):
            _now("fault")
        if here and FAILING and AT == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if here and FAILING and AT == "hang":
            while not (TIMES / "exit-0").exists():
                time.sleep(0.05)
            os.kill(os.getpid(), signal.SIGKILL)
        real_save(self, state_dict, path)
        if here and FAILING and AT == "partition":
            _half_then_full(path)

    def config(cfg, path):
        real_config(cfg, path)
        if _in_fault_step(path) and FAILING and AT == "config":
            _now("fault")
            _half_then_full(path)

    def rank_state(directory, rank, state):
        real_rank_state(directory, rank, state)
        if _in_fault_step(directory) and FAILING and AT == "rank_state":
            _now("fault")
            _half_then_full(checkpoint.rank_state_path(directory, rank))

    TorchCheckpointEngine.save = partition_save
    trainer.save_config = config
    checkpoint.save_rank_state = rank_state


if __name__ == "__main__":
    from megakd.cli import main
    from megakd.engine.backends import exit_process

    (TIMES / f"pid-{RANK}").write_text(str(os.getpid()))
    _install()
    code = main()
    _now(f"exit-{RANK}", code)
    exit_process(code)
