"""`megakd doctor` reports this machine as it is: versions from the installed packages, the GPU verdict from
torch itself, requirement floors from megakd's own metadata, and launcher variables that cannot work."""

from __future__ import annotations

from importlib import metadata

import torch

from megakd.bench.doctor import doctor_report, launcher_lines, requirement_check
from megakd.cli import main


def test_doctor_reports_this_machine(capsys):
    assert main(["doctor"]) == 0  # the test environment has megakd's requirements
    out = capsys.readouterr().out
    rows = {line[4:].split()[0]: line for line in out.splitlines() if line[:4] in ("ok  ", "--  ")}
    assert metadata.version("torch") in rows["torch"] and rows["torch"].startswith("ok")
    assert rows["deepspeed"].startswith("ok") and metadata.version("deepspeed") in rows["deepspeed"]
    assert "torch>=2.13.0" in rows["torch"]  # the floor of pyproject.toml, read from the installed metadata
    for name in ("datasets", "pyarrow"):  # the save_to_disk and parquet GLUE layouts read through them
        assert rows[name].startswith("ok") and "(extra [datasets])" in rows[name]
    has_gpu = torch.cuda.is_available()
    assert rows["GPUs"].startswith("ok" if has_gpu else "--")
    assert ("GPUs: GPU training" in out) is not has_gpu


def test_a_requirement_not_met_names_what_breaks():
    low = requirement_check("torch>=99")
    assert not low.ok and low.found == metadata.version("torch")
    missing = requirement_check('megakd-no-such-package>=1; extra == "deepspeed"')
    assert not missing.ok and missing.found == "not installed" and "backend.name=deepspeed" in missing.breaks
    assert requirement_check("torch>=2.13.0").ok  # a local build (+cpu, +cu128) counts as its release


def test_launcher_variables_that_cannot_form_a_group():
    seen, broken = launcher_lines({"WORLD_SIZE": "2", "RANK": "1", "NCCL_SOCKET_IFNAME": "ib0", "HOME": "/x"})
    assert seen == ["RANK=1", "WORLD_SIZE=2", "NCCL_SOCKET_IFNAME=ib0"]
    assert len(broken) == 1 and "without MASTER_ADDR, MASTER_PORT" in broken[0]
    torchrun = {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert launcher_lines(torchrun)[1] == []
    assert "CUDA_VISIBLE_DEVICES is empty" in launcher_lines({"CUDA_VISIBLE_DEVICES": ""})[1][0]
    text, base_ok = doctor_report({"WORLD_SIZE": "4"})
    assert not base_ok and "without RANK, MASTER_ADDR, MASTER_PORT" in text
