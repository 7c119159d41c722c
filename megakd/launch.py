"""How this process was launched, read from the environment once, at a command's entry.

torchrun and the deepspeed launcher set RANK, WORLD_SIZE and LOCAL_RANK; srun sets SLURM_PROCID,
SLURM_NTASKS and SLURM_LOCALID (the batch shell of sbatch has SLURM_NTASKS alone, so a task of srun
is one with both of the first two). A command reads them here into a `Launch` and passes that value
on: finishing the config (`backend.name: auto`), the backend factory (joining the process group,
refusing a bare process on a CUDA machine), the logging setup (the rank in every line).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    """This process's place among the ranks a launcher started; `Launch()` is a process started alone."""

    rank: int = 0
    local_rank: int = 0  # the rank among this node's processes (the CUDA ordinal it asks for)
    world_size: int = 1  # the ranks the launcher started
    # A launcher set the variables a process group is joined by (RANK, or srun's SLURM_PROCID and
    # SLURM_NTASKS): torch.distributed's env:// rendezvous can run
    launched: bool = False
    srun: bool = False  # a task of srun whose RANK was not set by another launcher

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Launch:
        """The launch `environ` describes: RANK/WORLD_SIZE/LOCAL_RANK where set, else srun's variables."""
        srun_task = {"SLURM_PROCID", "SLURM_NTASKS"} <= environ.keys()
        world_size = int(environ.get("WORLD_SIZE", environ["SLURM_NTASKS"] if srun_task else "1"))
        if "RANK" in environ or not srun_task:
            return cls(rank=int(environ.get("RANK", "0")), local_rank=int(environ.get("LOCAL_RANK", "0")),
                       world_size=world_size, launched="RANK" in environ)
        return cls(rank=int(environ["SLURM_PROCID"]),
                   local_rank=int(environ.get("LOCAL_RANK", environ.get("SLURM_LOCALID", "0"))),
                   world_size=world_size, launched=True, srun=True)

    def torch_environ(self) -> dict[str, str]:
        """The variables torch.distributed's env:// rendezvous reads (srun sets none of them), for this launch."""
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank)}
