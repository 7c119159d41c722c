"""A distributed process ends with its own exit code, never with an abort at interpreter teardown.

The hazard (megakd.engine.backends.exit_process): a gloo process group that outlives
`destroy_process_group` (DeepSpeed keeps references to its groups) still has worker threads that
release the last collective's tensors, which needs the GIL; during interpreter finalization that
aborts the process ("terminate called without an active exception", SIGABRT). The script below
has exactly that shape. Ended by a plain return it aborted in 3 of 6 launches on the 2-core
machine; `exit_process` must end every launch with the code it is given. Three launches per exit
code: a plain return would pass all six at about 0.5**6, under 2 %.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from megakd.engine.backends import free_local_port
from tests.distributed.harness import REPO, child_env

pytestmark = pytest.mark.slow

SCRIPT = """
import sys
import torch
import torch.distributed as dist
from megakd.engine.backends import exit_process, init_distributed
from megakd.launch import Launch

init_distributed(Launch.from_environ(), "gloo")
group = dist.new_group([0, 1])
kept = [dist.group.WORLD, group]  # as DeepSpeed keeps its groups
tensor = torch.ones(3)
dist.all_reduce(tensor)
dist.all_reduce(tensor, group=group)
dist.destroy_process_group()
exit_process(int(sys.argv[1]))
"""


@pytest.mark.parametrize("code", [0, 3])
def test_exit_process_ends_every_launch_with_its_code(tmp_path, code):
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    for launch in range(3):
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                               f"--master_port={free_local_port()}", str(script), str(code)],
                              env=child_env(), capture_output=True, text=True, timeout=120, cwd=REPO)
        assert "terminate called" not in proc.stderr, f"launch {launch}:\n{proc.stderr[-3000:]}"
        assert proc.returncode == (1 if code else 0), f"launch {launch}:\n{proc.stderr[-3000:]}"
        if code:
            assert f"exitcode  : {code}" in proc.stderr
