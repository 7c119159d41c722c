"""`megakd doctor`: what this machine has against what megakd needs, and what will not work here.

A first step on a cluster node (or a laptop) before any run: versions of the stack against the
installed package's own requirements (its metadata, so the floors cannot drift from pyproject.toml),
the GPUs and their compute capability, NCCL, a compiler for DeepSpeed's JIT ops, the launcher
variables this process sees and the caches it will write, and what the first Triton launch builds
(a C compiler, Python.h, a writable Triton cache). Imports nothing heavy beyond torch
(DeepSpeed and Triton are read from their package metadata, not imported).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

# What each optional extra enables; "will not work" names these when the extra is missing.
EXTRAS = {
    "deepspeed": "backend.name=deepspeed (ZeRO 0-3, pipeline, universal checkpoints)",
    "triton": "the Triton kernels (kernels.backend=auto uses them on CUDA; else the chunked torch path)",
    "wandb": "run.wandb=true",
    "s3": "data.shards=s3://...",
    "datasets": "inputs saved with datasets' save_to_disk, and glue.data_dir in the save_to_disk or parquet layout",
}
# Variables the launchers set (torchrun, the deepspeed launcher, srun) and that megakd reads, plus the
# ones that steer NCCL and threads (docs/cluster.md says which matter).
LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES",
                    "OMP_NUM_THREADS")
CACHE_VARIABLES = ("MEGAKD_CACHE", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "HF_HOME", "HF_HUB_OFFLINE")
# Compute capabilities the Triton kernels are compiled and checked for ahead of time (docs/performance.md).
CHECKED_CAPABILITIES = ((8, 0), (9, 0))


@dataclass
class Check:
    what: str
    found: str
    needed: str
    ok: bool
    breaks: str = ""  # what will not work when `ok` is false


def requirement_check(requirement: str) -> Check:
    """One requirement string of megakd's metadata (`torch>=2.13.0`, `deepspeed>=0.19; extra == "deepspeed"`)
    against the installed distribution."""
    req = Requirement(requirement)
    extra = match.group(1) if (match := re.search(r'extra == "([\w-]+)"', str(req.marker or ""))) else ""
    needed = f"{req.name}{req.specifier}" + (f" (extra [{extra}])" if extra else "")
    try:
        found = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        return Check(req.name, "not installed", needed, False,
                     EXTRAS.get(extra, f"megakd itself: pip install -e . installs {req.name}") if extra else
                     f"megakd itself (pip install -e . installs {req.name})")
    ok = req.specifier.contains(found, prereleases=True)  # a local build (2.13.0+cpu) is its release
    return Check(req.name, found, needed, ok, "" if ok else f"{EXTRAS.get(extra, 'megakd')}: upgrade {req.name}")


def package_checks() -> list[Check]:
    """megakd's direct requirements and the extras users of a cluster install (each name once)."""
    try:
        requirements = metadata.requires("megakd") or []
    except metadata.PackageNotFoundError:
        return [Check("megakd", "not installed", "pip install -e .", False, "the megakd command's entry point")]
    wanted = [r for r in requirements if "extra ==" not in r
              or any(f'extra == "{e}"' in r for e in EXTRAS)]
    seen, checks = set(), []
    for r in wanted:
        name = Requirement(r).name
        if name not in seen:
            seen.add(name)
            checks.append(requirement_check(r))
    return checks


def device_checks() -> list[Check]:
    """torch's build, the GPUs, NCCL and gloo; on a machine without CUDA what that leaves out."""
    import torch
    import torch.distributed as dist

    cuda_build = torch.version.cuda
    build = f"CUDA {cuda_build}" if cuda_build else "none (CPU build)"
    checks = [Check("CUDA build", f"torch {torch.__version__}: {build}",
                    "a CUDA build on GPU nodes", cuda_build is not None,
                    "GPU training: this torch has no CUDA (install the CUDA wheel, docs/cluster.md)")]
    count = torch.cuda.device_count() if cuda_build else 0
    checks.append(Check("GPUs", str(count) if count else "none visible", ">= 1 on GPU nodes", count > 0,
                        "GPU training, NCCL, compiled Triton kernels (CPU runs: gloo, the torch kernels)"))
    for i in range(count):
        cap = torch.cuda.get_device_capability(i)
        props = torch.cuda.get_device_properties(i)
        unchecked = "" if cap in CHECKED_CAPABILITIES else "; Triton kernels not checked for it"
        checks.append(Check(f"GPU {i}", f"{props.name}, sm_{cap[0]}{cap[1]}, {props.total_memory / 2**30:.0f} GiB"
                            + unchecked, "sm_80+ for bf16 (kernels checked for sm_80, sm_90a)", cap >= (8, 0),
                            "bf16 (use train.precision=fp16)"))
    version = torch.cuda.nccl.version() if count and dist.is_nccl_available() else ""
    nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    checks.append(Check("NCCL", nccl or ("not in this torch" if not dist.is_nccl_available() else "no GPU"),
                        "on GPU nodes", bool(nccl), "multi-GPU training over nccl (gloo works, slowly)"))
    checks.append(Check("gloo", "available" if dist.is_gloo_available() else "missing", "available",
                        dist.is_gloo_available(), "CPU multi-process runs and the CPU tests"))
    return checks


def toolchain_checks() -> list[Check]:
    """DeepSpeed compiles its communication op (and CPU Adam for offload) on first use: a C++ compiler,
    ninja, and for GPU ops nvcc under CUDA_HOME."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    checks = [Check("C++ compiler", cxx or "none", "c++/g++ (DeepSpeed JIT ops)", bool(cxx),
                    "DeepSpeed's JIT-compiled ops (its communication op, CPU Adam for ZeRO-Offload)")]
    ninja = shutil.which("ninja")
    checks.append(Check("ninja", ninja or "none", "ninja (DeepSpeed, torch extensions)", bool(ninja),
                        "DeepSpeed's JIT-compiled ops (pip install ninja)"))
    return checks


TRITON_LAUNCH = "Triton kernels on the GPU: their first launch builds a small C launcher"


def python_include() -> Path:
    """Where Python.h is for Triton's build (triton/runtime/build.py: the default install scheme, Debian's
    `posix_local` read as `posix_prefix`)."""
    scheme = sysconfig.get_default_scheme()
    return Path(sysconfig.get_paths(scheme="posix_prefix" if scheme == "posix_local" else scheme)["include"])


def writable_dir(path: Path) -> str:
    """"" when `path` is, or can be made, a directory this process writes into; else why not. Triton
    creates its cache directory itself, so the nearest existing ancestor is what must be writable."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return ""


def triton_build_checks(environ: dict[str, str]) -> list[Check]:
    """What the first launch of a Triton kernel needs besides the GPU: it compiles a C module (the kernel
    launcher, CUDA utilities) with the host C compiler against Python.h and caches it, with the compiled
    kernels, in Triton's cache directory. Triton picks the compiler and the cache as triton/runtime/build.py
    and triton/knobs.py do: CC, else gcc, else clang on PATH; TRITON_CACHE_DIR, else
    $TRITON_HOME/.triton/cache, else ~/.triton/cache. Without one of them the first launch raises and
    nothing trains on the Triton path (kernels.backend=torch avoids it)."""
    path = environ.get("PATH", "")
    cc = environ.get("CC")
    if cc is not None:
        compiler = shutil.which(cc, path=path)
        found = f"CC={cc}" + ("" if compiler else " (no such program)")
    else:
        compiler = shutil.which("gcc", path=path) or shutil.which("clang", path=path)
        found = compiler or "no gcc or clang on PATH"
    checks = [Check("C compiler (Triton)", found, "CC, else gcc or clang on PATH", bool(compiler),
                    f"{TRITON_LAUNCH} with it (install gcc, or set CC)")]
    header = python_include() / "Python.h"
    checks.append(Check("Python.h", str(header) if header.is_file() else f"none in {header.parent}",
                        "Python's development headers", header.is_file(),
                        f"{TRITON_LAUNCH} against it (install python3-dev, python3.X-devel or a Python with headers)"))
    cache = Path(environ.get("TRITON_CACHE_DIR")
                 or Path(environ.get("TRITON_HOME") or Path.home()) / ".triton" / "cache")
    why = writable_dir(cache)
    checks.append(Check("Triton cache", f"{cache}" + (f" ({why})" if why else ""), "a writable directory",
                        not why, "Triton kernels on the GPU: the launcher their first launch builds and the compiled "
                                 "kernels are written there (set TRITON_CACHE_DIR to a writable node-local directory)"))
    return checks


def launcher_lines(environ: dict[str, str]) -> tuple[list[str], list[str]]:
    """(the launcher and cache variables set here, what they leave broken)."""
    seen = [f"{k}={environ[k]}" for k in (*LAUNCH_VARIABLES, *CACHE_VARIABLES) if k in environ]
    seen += sorted(f"{k}={v}" for k, v in environ.items() if k.startswith("NCCL_"))
    broken = []
    if "WORLD_SIZE" in environ and int(environ.get("WORLD_SIZE", "1") or 1) > 1:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in environ]
        if missing:
            broken.append(f"WORLD_SIZE={environ['WORLD_SIZE']} without {', '.join(missing)}: the process group "
                          "cannot form (start ranks with launch/torchrun.sh, launch/deepspeed.sh or srun)")
    if "SLURM_NTASKS" in environ and "SLURM_PROCID" not in environ:
        broken.append("SLURM_NTASKS without SLURM_PROCID: run under srun (launch/slurm.sbatch does)")
    if environ.get("CUDA_VISIBLE_DEVICES") == "":
        broken.append("CUDA_VISIBLE_DEVICES is empty: no GPU is visible to this process")
    return seen, broken


def doctor_report(environ: dict[str, str] | None = None) -> tuple[str, bool]:
    """The report as text, and whether the base install is complete (every non-optional check passed)."""
    environ = dict(os.environ if environ is None else environ)
    packages, devices = package_checks(), device_checks()
    tools = [*toolchain_checks(), *triton_build_checks(environ)]
    rows = [Check("python", sys.version.split()[0], ">=3.10", sys.version_info >= (3, 10), "megakd itself"),
            *packages, *devices, *tools]
    width = [max(len(getattr(c, f)) for c in rows) for f in ("what", "found", "needed")]
    lines = ["megakd doctor: this machine against what megakd needs", "",
             f"{'':4}{'what':<{width[0]}}  {'found':<{width[1]}}  needed"]
    lines += [f"{'ok' if c.ok else '--':<4}{c.what:<{width[0]}}  {c.found:<{width[1]}}  {c.needed}" for c in rows]
    seen, broken = launcher_lines(environ)
    lines += ["", "launcher, NCCL and cache variables: " + (" ".join(seen) if seen else "none set (one process)")]
    not_working = [f"{c.what}: {c.breaks}" for c in rows if not c.ok and c.breaks] + broken
    lines += ["", "will not work here:" if not_working else "nothing known to be missing"]
    lines += [f"  - {line}" for line in not_working]
    base_ok = all(c.ok for c in [rows[0], *packages] if "(extra" not in c.needed) and not broken
    return "\n".join(lines), base_ok
