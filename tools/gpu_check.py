"""The first hour on one GPU: does megakd's GPU path compute what its CPU path computes?

Each step runs as a subprocess with its own timeout (one failure never stops the rest), logs to
``--out/<step>.log``, and prints PASS/FAIL (or SKIP and why) with its time beside its --quick budget;
the end is a markdown table (also written to ``--out/summary.md``) to paste into the README. Exit
status 1 when any step failed.

    python tools/gpu_check.py --out /tmp/gpu-check            # everything, < 1 hour on one H100
    python tools/gpu_check.py --quick --out "$OUT/check"      # ~8 minutes: fewer shapes, steps, dtypes
    TRITON_INTERPRET=1 python tools/gpu_check.py --device cpu --only parity,bench --small   # the CPU rehearsal

Steps: env (versions, device); parity (every kernel vs its fp64 reference in fp32/bf16/fp16/bf16
activations with fp32 weights, up to N=2458 H=768 V=128000: megakd/bench/kernel_parity.py); bench
(tools/bench_kernels_cuda.py, each row checked, then the head's chunked and atomic backwards side by side,
measured beside tools/compile_kernels.py's computed time; on --device cpu that head section alone at tiny
shapes under the interpreter); tiny (electra-tiny on the GPU vs the CPU: with
dropout 0 the generator never sees the sampled replacements, so its loss must agree although the
GPU samples by Gumbel-max and the CPU by inverse CDF); zero3 (ZeRO-3 vs ZeRO-1, then a resume from
the middle checkpoint that must reach the same metrics); base (electra-base's model shape, 20
steps, fp32 and bf16, bundled 8K vocabulary: the 128K head is covered by parity and timed by bench, both
backwards at N=2458, H=768, V=128000); syncs (host-device syncs in one bf16 optimizer step under ZeRO-1,
as a cluster run trains, counted by torch.cuda.set_sync_debug_mode("warn")); profile (a torch.profiler
trace of one bf16 ZeRO-1 optimizer step of electra-base's shape: ``--out/profile-bf16.json``, for
chrome://tracing or Perfetto, and the top kernels in its log); nccl (with two GPUs or more: `megakd
bench`'s collectives and electra-tiny under ZeRO-1 on two ranks; skipped with one GPU).

The --quick budget on one H100, planned, not yet timed (the table prints each step's time beside it):
env 15 s, parity 90 s, bench 60 s, tiny 75 s, zero3 90 s, base-bf16 60 s, syncs 40 s, profile 50 s:
480 s; nccl (two GPUs) 90 s more. Each step's timeout is several times its budget.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMON = ["train.probe_every=0", "run.export_hf=false", "run.plots=false", "run.progress_bar=false",
          "run.tensorboard=false", "run.overwrite=true"]
STEPS = ("env", "parity", "bench", "tiny", "zero3", "base", "syncs", "profile", "nccl")


class Failure(Exception):
    """A step's check did not hold (the message is its table cell)."""


@dataclass
class Step:
    name: str
    commands: list[list[str]]  # run in order; the first non-zero exit fails the step
    timeout: float  # seconds for all of the step's commands together
    check: Callable[[], str] | None = None  # after the commands: the detail, or raises Failure
    budget: float = 0.0  # its planned seconds under --quick on one H100 (the module docstring)
    skip: str = ""  # why it cannot run on this machine (its commands are not run)


def summary_line(log: Path) -> str:
    """The last `SUMMARY:` line a command printed, else its last line that looks like an error."""
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    for line in reversed(lines):
        if line.startswith("SUMMARY:"):
            return line.removeprefix("SUMMARY:").strip()
    errors = [x for x in lines if "Error" in x or "error:" in x or x.startswith("FAIL")]
    return (errors or lines or [""])[-1].strip()[:200]


def run_step(step: Step, out: Path) -> tuple[str, float, str]:
    """(PASS|FAIL|SKIP, seconds, detail) of one step; its commands' output goes to out/<name>.log."""
    if step.skip:
        return "SKIP", 0.0, step.skip
    log = out / f"{step.name}.log"
    start = time.monotonic()
    with log.open("w") as sink:
        for cmd in step.commands:
            left = step.timeout - (time.monotonic() - start)
            sink.write(f"+ {' '.join(cmd)}\n")
            sink.flush()
            # its own session, so a timeout also ends the launcher's ranks (they hold the GPU)
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=max(left, 1))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return "FAIL", time.monotonic() - start, f"timed out after {step.timeout:.0f}s ({cmd[-1]})"
            if rc:
                sink.flush()
                return "FAIL", time.monotonic() - start, f"exit {rc}: {summary_line(log)}"
    try:
        detail = step.check() if step.check else summary_line(log)
    except Failure as err:
        return "FAIL", time.monotonic() - start, str(err)
    return "PASS", time.monotonic() - start, detail


def read_metrics(run: Path) -> dict[int, dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise Failure(f"no {path}")
    rows = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return {r["step"]: r for r in rows if "gen_loss" in r}


def compare_runs(got: Path, want: Path, rtol: float, key: str = "gen_loss") -> Callable[[], str]:
    """A check: `key` of run `got` within `rtol` of run `want` at every step both logged."""
    def check() -> str:
        a, b = read_metrics(got), read_metrics(want)
        steps = sorted(set(a) & set(b))
        if not steps:
            raise Failure(f"no common logged steps in {got.name} and {want.name}")
        worst = max(abs(a[s][key] - b[s][key]) / abs(b[s][key]) for s in steps)
        speed = a[steps[-1]].get("tokens_per_s", 0.0)
        detail = (f"max {key} rel diff {worst:.1e} over {len(steps)} logged steps (tol {rtol:.0e}); "
                  f"{speed:,.0f} tokens/s")
        if not worst < rtol:
            raise Failure(detail)
        return detail
    return check


def computed_step(run: Path, tokens_per_s: float) -> str:
    """The run's step measured (its positions per step over `tokens_per_s`, which counts the non-padding
    ones: the bundled shards' rows are full) beside the step docs/performance.md computes for the same
    config on this GPU's datasheet preset (megakd/bench/step_time.py); "" off a known GPU."""
    import torch

    from megakd.bench.hardware import GPUS
    from megakd.bench.memory import parameter_counts
    from megakd.bench.step_time import predict_step
    from megakd.config import load_config

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    preset = "h100" if any(g in name for g in ("H100", "H200", "H800")) else "a100" if "A100" in name else None
    if preset is None or not tokens_per_s:
        return ""
    cfg = load_config(run / "config.yaml", [])
    t = cfg.train
    predicted = predict_step(cfg, GPUS[preset], t.micro_batch_size, t.global_batch_size // t.micro_batch_size,
                             parameter_counts(cfg)["total"], tf32=t.tf32)
    measured = t.global_batch_size * cfg.data.seq_len / tokens_per_s
    return (f"; step {measured * 1e3:,.0f} ms measured, {predicted.step_s * 1e3:,.0f} ms computed for "
            f"{GPUS[preset].name} (MFU {predicted.mfu:.0%} computed, "
            f"{predicted.mfu * predicted.step_s / measured:.0%} measured)")


def finite_run(run: Path, steps: int, computed: bool = False) -> Callable[[], str]:
    """A check: the run logged up to `steps` with finite losses; reports speed and peak memory (and with
    `computed`, the measured step beside the computed one)."""
    def check() -> str:
        rows = read_metrics(run)
        last = rows.get(steps)
        if last is None:
            raise Failure(f"{run.name}: no metrics at step {steps} (logged {sorted(rows)})")
        bad = [s for s, r in rows.items() if not all(abs(r[k]) < float("inf") for k in ("gen_loss", "disc_loss"))]
        if bad:
            raise Failure(f"{run.name}: non-finite loss at steps {bad}")
        speed = last.get("tokens_per_s", 0.0)
        return (f"gen_loss {rows[min(rows)]['gen_loss']:.3f} -> {last['gen_loss']:.3f}, {speed:,.0f} tokens/s, "
                f"{summary_line(run.parent / (run.name + '.mem'))}" + (computed_step(run, speed) if computed else ""))
    return check


def build_steps(args: argparse.Namespace) -> list[Step]:
    out, py, quick = args.out, sys.executable, args.quick

    def torchrun(ranks: int = 1) -> list[str]:
        """launch/torchrun.sh's command, with this interpreter (the GPU image may have python3 only)."""
        return [py, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}", "--rdzv-backend=c10d",
                "--rdzv-endpoint=localhost:0"]

    pretrain = [*torchrun(), "-m", "megakd.cli", "pretrain"]
    zero1 = ["backend.name=deepspeed", "backend.zero_stage=1"]
    steps = [Step("env", [[py, __file__, "--internal", "env", args.device]], 120, budget=15)]

    dtypes = args.dtypes or ("fp32,bf16" if quick else "fp32,bf16,fp16,bf16-w32")
    parity = [py, "-m", "megakd.bench.kernel_parity", "--device", args.device, "--dtypes", dtypes,
              "--tol-scale", str(args.tol_scale)]
    steps.append(Step("parity", [parity + (["--small"] if args.small else [])], 300 if quick else 1200, budget=90))

    if args.device == "cpu":  # the head backwards' section alone, interpreted: shapes that take seconds
        steps.append(Step("bench", [[py, "tools/bench_kernels_cuda.py", "--device", "cpu", "--tokens", "40",
                                     "--hidden", "24", "--vocab", "300", "--dtype", "float32", "--repeat", "1"]], 300,
                          budget=60))
    else:
        bench = [py, "tools/bench_kernels_cuda.py", "--tokens", "2458", "--repeat", "3" if quick else "10"]
        bench_dtypes = ["bfloat16"] if quick else ["bfloat16", "float32", "float16"]
        steps.append(Step("bench", [[*bench, "--dtype", d] for d in bench_dtypes], 180 if quick else 900, budget=60))

    n = 30 if quick else 60
    tiny = ["-c", "configs/electra-tiny.yaml", "train.log_every=10", f"train.max_steps={n}", *COMMON]
    cpu, gpu = out / "tiny-cpu", out / "tiny-gpu"
    steps.append(Step("tiny", [
        # the reference hides the GPU, so nothing in it can reach CUDA
        ["env", "CUDA_VISIBLE_DEVICES=", py, "-m", "megakd.cli", "pretrain", *tiny, f"run.dir={cpu}"],
        [*pretrain, *tiny, *zero1, f"run.dir={gpu}"],
    ], 420 if quick else 900, compare_runs(gpu, cpu, 1e-3), budget=75))

    z3, resumed = out / "tiny-zero3", out / "tiny-zero3-resumed"
    zero3 = [*pretrain, *tiny, "backend.name=deepspeed", "backend.zero_stage=3"]
    steps.append(Step("zero3", [
        [*zero3, f"run.save_every={n // 2}", f"run.dir={z3}"],
        [*zero3, f"run.dir={resumed}", "--resume", f"{z3}/checkpoints/step_{n // 2:08d}"],
    ], 420 if quick else 900, lambda: "; ".join([
        "vs ZeRO-1: " + compare_runs(z3, gpu, 1e-3)(), "resumed: " + compare_runs(resumed, z3, 1e-4)()]), budget=90))

    base_steps = 10 if quick else 20
    base_shape = ["configs/electra-base.yaml", "data.vocab_size=8000", "train.global_batch_size=64",
                  "train.micro_batch_size=32", *COMMON]
    base = [*pretrain, "-c", *base_shape, f"train.max_steps={base_steps}", "train.log_every=5"]
    for precision in ["bf16"] if quick else ["fp32", "bf16"]:
        run = out / f"base-{precision}"
        steps.append(Step(f"base-{precision}", [
            [py, __file__, "--internal", "peak-memory", f"{run}.mem", *base, f"train.precision={precision}",
             f"run.dir={run}"],
        ], 360 if quick else 900, finite_run(run, base_steps, computed=True), budget=60))

    steps.append(Step("syncs", [[*torchrun(), __file__, "--internal", "syncs", "configs/electra-tiny.yaml", *zero1,
                                 "train.precision=bf16", f"run.dir={out / 'syncs-run'}", *COMMON]], 300, budget=40))
    steps.append(Step("profile", [[*torchrun(), __file__, "--internal", "profile", str(out / "profile-bf16.json"),
                                   *base_shape, *zero1, "train.precision=bf16", f"run.dir={out / 'profile-run'}"]],
                      300, budget=50))

    two = out / "tiny-2gpu"
    steps.append(Step("nccl", [
        [*torchrun(2), "-m", "megakd.cli", "bench", "-c",
         "configs/electra-tiny.yaml", "--parts", "collectives", "--out", str(out / "nccl-bench")],
        [*torchrun(2), "-m", "megakd.cli", "pretrain", *tiny, *zero1, "train.micro_batch_size=16",
         f"run.dir={two}"],
    ], 600, lambda: f"{all_reduce_bandwidth(out / 'nccl-bench' / 'bench_w2.json')}; {finite_run(two, n)()}",
        budget=90, skip="" if args.gpus >= 2 else f"two ranks over NCCL need two GPUs ({args.gpus} visible)"))
    return [s for s in steps if s.name.split("-")[0] in args.only]


def all_reduce_bandwidth(report: Path) -> str:
    """The largest all-reduce's bus bandwidth in a `megakd bench` report."""
    if not report.is_file():
        raise Failure(f"no {report}")
    largest = max(json.loads(report.read_text())["collectives"]["all_reduce"], key=lambda row: row["bytes"])
    return f"all-reduce {largest['bytes'] / 2**20:.0f} MiB: bus {largest['busbw_GBps']:.0f} GB/s"


# -- the parts that run inside a step's subprocess -----------------------------------------------
def internal_env(device: str) -> int:
    import torch

    versions = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "deepspeed", "transformers", "webdataset", "pydantic", "megakd"):
        try:  # installed and importable (the GPU image lacks some; they come as carried wheels)
            importlib.import_module(name)
            versions[name] = importlib.metadata.version(name)
        except Exception as err:  # noqa: BLE001 - a missing package is this step's finding
            versions[name] = f"missing ({type(err).__name__})"
    print(json.dumps(versions))
    if device == "cuda":
        if not torch.cuda.is_available():
            print("SUMMARY: torch.cuda.is_available() is False")
            return 1
        props = torch.cuda.get_device_properties(0)
        device_name = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, sm_{props.major}{props.minor}"
    else:
        device_name = "cpu"
    missing = [k for k, v in versions.items() if str(v).startswith("missing")]
    print(f"SUMMARY: {device_name}; " + ", ".join(f"{k} {v}" for k, v in versions.items() if k not in missing)
          + (f"; MISSING {', '.join(missing)}" if missing else ""))
    return 1 if missing else 0


def internal_peak_memory(report: str, cmd: list[str]) -> int:
    """Run `cmd` while sampling the GPU's used memory (nvidia-smi); write the peak to `report`."""
    proc = subprocess.Popen(cmd, cwd=REPO)
    peak = 0
    while proc.poll() is None:
        try:
            used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=10).stdout.split()
            peak = max([peak, *map(int, used)])
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
        time.sleep(1)
    Path(report).write_text(f"SUMMARY: peak GPU memory {peak / 1024:.1f} GiB\n")
    return proc.returncode


@contextlib.contextmanager
def warm_trainer(config: str, overrides: list[str]) -> Iterator[tuple]:
    """(trainer, its batches) after two optimizer steps (the Triton kernels compiled, the allocator warm),
    with the device idle; the backend is closed after."""
    import torch

    from megakd.config import load_config
    from megakd.engine.pretrain import build_trainer

    trainer = build_trainer(load_config(REPO / config, overrides))
    try:
        trainer.layout.train()
        batches = iter(trainer.loader)
        for _ in range(2):
            trainer.train_step(batches)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        yield trainer, batches
    finally:
        trainer.backend.close()


def step_label(trainer) -> str:
    """What the step trained with, e.g. "ZeRO-1, bf16"."""
    backend = trainer.cfg.backend
    layout = f"ZeRO-{backend.zero_stage}" if backend.name == "deepspeed" else backend.name
    return f"{layout}, {trainer.cfg.train.precision}"


def internal_syncs(config: str, overrides: list[str]) -> int:
    """Host-device syncs of one optimizer step on the GPU, after two warm-up steps."""
    import collections
    import warnings

    import torch

    with warm_trainer(config, overrides) as (trainer, batches):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            trainer.train_step(batches)
            torch.cuda.set_sync_debug_mode("default")
        where = collections.Counter(f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
        for key, count in where.most_common():
            print(f"{count:4d}  {key}")
        print(f"SUMMARY: {sum(where.values())} host-device syncs in one optimizer step ({step_label(trainer)}, "
              f"{len(where)} call sites)")
    return 0


def internal_profile(trace: str, config: str, overrides: list[str]) -> int:
    """A torch.profiler trace of one optimizer step after two warm-up steps (chrome trace JSON at `trace`),
    and its ten most expensive ops by their own time on the device (the CPU's without a GPU)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with warm_trainer(config, overrides) as (trainer, batches):
        with profile(activities=activities) as prof:
            trainer.train_step(batches)
            if cuda:
                torch.cuda.synchronize()
        prof.export_chrome_trace(trace)
        key = "self_device_time_total" if cuda else "self_cpu_time_total"
        ops = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)
        print(prof.key_averages().table(sort_by=key, row_limit=10))
        top = ", ".join(f"{e.key} {getattr(e, key) / 1e3:.1f} ms" for e in ops[:3])
        print(f"SUMMARY: {Path(trace).name}: one optimizer step ({step_label(trainer)}), {len(prof.events())} "
              f"events; most {'device' if cuda else 'CPU'} time: {top}")
    return 0


def table(rows: list[tuple[str, str, float, float, str]], device: str) -> str:
    lines = [f"GPU check ({device}, {time.strftime('%Y-%m-%d')})", "",
             "| step | result | time | --quick budget | detail |", "|---|---|---|---|---|"]
    lines += [f"| {name} | {status} | {seconds:.0f} s | {budget:.0f} s | {detail.replace('|', '/')} |"
              for name, status, seconds, budget, detail in rows]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/gpu-check"), help="logs, runs and summary.md")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--only", default=",".join(STEPS), help=f"comma-separated steps of {', '.join(STEPS)}")
    p.add_argument("--quick", action="store_true", help="fewer shapes, steps and dtypes: ~8 minutes on one H100")
    p.add_argument("--small", action="store_true", help="parity at small shapes (the Triton interpreter on CPU)")
    p.add_argument("--dtypes", help="parity dtypes (default: all four; --quick: fp32,bf16)")
    p.add_argument("--tol-scale", type=float, default=1.0, help="parity tolerances x this (0 plants a failure)")
    p.add_argument("--gpus", type=int, help="GPUs to use (default: all visible on --device cuda; nccl needs two)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--internal"]:
        # a step's subprocess: env DEVICE | peak-memory FILE CMD... | syncs CONFIG KEY=VALUE...
        # | profile TRACE CONFIG KEY=VALUE...
        what, rest = argv[1], argv[2:]
        if what == "env":
            return internal_env(rest[0])
        if what == "peak-memory":
            return internal_peak_memory(rest[0], rest[1:])
        if what == "profile":
            return internal_profile(rest[0], rest[1], rest[2:])
        return internal_syncs(rest[0], rest[1:])
    args = p.parse_args(argv)
    args.only = [s for s in args.only.split(",") if s]
    unknown = sorted(set(args.only) - set(STEPS))
    if unknown:
        p.error(f"--only: unknown steps {unknown}, expected some of {list(STEPS)}")
    if args.gpus is None and args.device == "cpu":
        args.gpus = 0
    elif args.gpus is None:
        import torch

        args.gpus = torch.cuda.device_count()
    args.out.mkdir(parents=True, exist_ok=True)
    args.out = args.out.resolve()
    os.environ.setdefault("MEGAKD_CACHE", str(args.out / "cache"))  # the bundled corpus, built once
    os.environ.update(HF_HUB_OFFLINE="1", WANDB_MODE="offline")
    os.environ.setdefault("OMP_NUM_THREADS", "4")
    rows = []
    for step in build_steps(args):
        print(f"=== {step.name}: {' && '.join(' '.join(c) for c in step.commands)}", flush=True)
        status, seconds, detail = run_step(step, args.out)
        rows.append((step.name, status, seconds, step.budget, detail))
        print(f"{status} {step.name} ({seconds:.0f} s, budget {step.budget:.0f} s) {detail}", flush=True)
        summary = table(rows, args.device)
        (args.out / "summary.md").write_text(summary)  # after every step: a killed run keeps its table
    print("\n" + summary, flush=True)
    return 1 if any(row[1] == "FAIL" for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
