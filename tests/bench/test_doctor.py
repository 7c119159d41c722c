"""`megakd doctor` reports this machine as it is: versions from the installed packages, the GPU verdict from
torch itself, requirement floors from megakd's own metadata, and launcher variables that cannot work."""

from __future__ import annotations

import os
import sysconfig
from importlib import metadata
from unittest import mock

import pytest
import torch
from megakd.kernels.dispatch import triton_available

from megakd.bench import doctor
from megakd.bench.doctor import Check, doctor_report, launcher_lines, requirement_check, triton_build_checks
from megakd.cli import main

# A C extension module with one function, `answer()` -> 42: what Triton's build compiles, minus the CUDA driver.
PROBE_SOURCE = """#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "megakd_doctor_probe", NULL, -1, methods};
PyMODINIT_FUNC PyInit_megakd_doctor_probe(void) { return PyModule_Create(&module); }
"""


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


def _verdicts(environ: dict[str, str]) -> dict[str, Check]:
    return {c.what: c for c in triton_build_checks(environ)}


def test_what_the_first_triton_launch_builds_with_is_here(tmp_path):
    """This machine (and CI) has what Triton's launcher build needs: the compiler Triton itself picks
    (triton/runtime/build.py), Python.h where that build looks for it, a cache directory it can create."""
    import triton.runtime.build as triton_build

    environ = {"PATH": os.environ["PATH"], "TRITON_CACHE_DIR": str(tmp_path / "new" / "cache")}
    checks = _verdicts(environ)
    assert all(c.ok for c in checks.values()), checks
    triton_build._find_compiler.cache_clear()  # lru-cached: read CC and PATH as they are now
    with mock.patch.dict(os.environ, {"PATH": environ["PATH"]}):
        os.environ.pop("CC", None)
        assert checks["C compiler (Triton)"].found == triton_build._find_compiler("c")
    triton_build._find_compiler.cache_clear()
    assert checks["Python.h"].found == os.path.join(sysconfig.get_paths()["include"], "Python.h")
    assert checks["Triton cache"].found == environ["TRITON_CACHE_DIR"]


@pytest.mark.skipif(not triton_available(), reason="needs triton")
def test_triton_builds_and_loads_a_c_module_with_what_the_doctor_found(tmp_path, monkeypatch):
    """The GPU launcher cannot be built here (it links libcuda.so.1, the driver's library: triton/backends/
    nvidia/driver.py), but the rest of its build can: a C module compiled by Triton's own build (its compiler
    choice, the Python.h include, its cache) that loads and answers."""
    from triton.runtime.build import compile_module_from_src

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    mod = compile_module_from_src(PROBE_SOURCE, "megakd_doctor_probe")
    assert mod.answer() == 42
    assert list((tmp_path / "cache").rglob("megakd_doctor_probe*.so"))


def test_each_missing_piece_of_the_triton_build_is_one_line(tmp_path, monkeypatch):
    """A PATH without compilers, CC naming a missing file, a file where the cache directory should be, a
    Python without headers: each fails its own check and says in one line what will not work."""
    no_compilers = tmp_path / "bin"
    no_compilers.mkdir()
    in_the_way = tmp_path / "cache-file"
    in_the_way.write_text("")
    checks = _verdicts({"PATH": str(no_compilers), "TRITON_CACHE_DIR": str(in_the_way / "cache")})
    assert [c.what for c in checks.values() if not c.ok] == ["C compiler (Triton)", "Triton cache"]
    assert checks["C compiler (Triton)"].found == "no gcc or clang on PATH"
    assert checks["Triton cache"].found == f"{in_the_way / 'cache'} ({in_the_way} is not a directory)"
    missing_cc = _verdicts({"PATH": os.environ["PATH"], "CC": str(tmp_path / "no-cc"), "TRITON_HOME": str(tmp_path)})
    assert missing_cc["C compiler (Triton)"].found == f"CC={tmp_path / 'no-cc'} (no such program)"
    assert missing_cc["Triton cache"].ok and missing_cc["Triton cache"].found == str(tmp_path / ".triton" / "cache")

    monkeypatch.setattr(doctor, "python_include", lambda: tmp_path / "include")
    monkeypatch.setenv("PATH", str(no_compilers))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(in_the_way))
    text, _ = doctor_report()
    broken = [line for line in text.splitlines() if line.startswith("  - ")]
    for what in ("C compiler (Triton)", "Python.h", "Triton cache"):
        line, = [x for x in broken if x.startswith(f"  - {what}: ")]
        assert "Triton kernels on the GPU" in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
def test_an_unwritable_triton_cache(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        check = _verdicts({"PATH": os.environ["PATH"], "TRITON_CACHE_DIR": str(locked / "cache")})["Triton cache"]
    finally:
        locked.chmod(0o700)
    assert not check.ok and check.found.endswith(f"({locked} is not writable)")
