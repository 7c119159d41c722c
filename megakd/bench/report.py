"""Plain-text tables for `megakd bench` and `megakd plan` (the CLI prints them)."""

from __future__ import annotations

from megakd.bench.flops import StepFlops
from megakd.bench.hardware import Hardware
from megakd.bench.memory import GiB, mlm_head_bytes
from megakd.bench.planner import Plan, StorageIO
from megakd.bench.roofline import format_phases
from megakd.bench.step_time import matmul_class
from megakd.config import Config


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return ""


def _decimal(n: float) -> str:
    """Bytes in decimal units (1 GB = 1e9 bytes), as storage bandwidth is quoted."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1000
    return ""


def _duration(seconds: float) -> str:
    hours = seconds / 3600
    return f"{hours:.1f} h ({hours / 24:.1f} d)" if hours >= 1 else f"{seconds / 60:.1f} min"


def format_bench(res: dict) -> str:
    lines = [f"megakd bench: world size {res['world_size']}, device {res['device']}, "
             f"backend {res['dist_backend']}, {res['torch_threads']} threads per rank"]
    if "collectives" in res:
        lines += ["", f"{'collective':<15}{'size':>12}{'time (us)':>13}{'algbw (GB/s)':>14}{'busbw (GB/s)':>14}"]
        for op, rows in res["collectives"].items():
            for r in rows:
                lines.append(f"{op:<15}{_size(r['bytes']):>12}{r['time_us']:>13.1f}{r['algbw_GBps']:>14.3f}"
                             f"{r['busbw_GBps']:>14.3f}")
    if "matmul" in res:
        lines += ["", "matmul (per device): " + ", ".join(
            f"{p} {r['tflops'] * 1e3:.1f} GFLOP/s (n={r['n']})" for p, r in res["matmul"].items())]
    if "loader" in res:
        ld = res["loader"]
        lines += ["", f"data loader: {ld['samples_per_s']:.0f} samples/s in total, "
                      f"{ld['samples_per_s_per_rank']:.0f} per rank (micro-batch {ld['micro_batch_size']}, "
                      f"{ld['num_workers']} workers)"]
    if "train" in res:
        t = res["train"]
        phases = ", ".join(f"{k} {v * 1e3:.0f} ms" if v is not None else f"{k} n/a"
                           for k, v in t["phases_s"].items())
        mfu = f"MFU {t['mfu'] * 100:.1f}% of {t['peak_tflops'] * 1e3:.1f} GFLOP/s ({t['peak_source']})"
        lines += ["", f"training ({t['backend']}, {t['precision']}, batch {t['global_batch_size']} x "
                      f"{t['seq_len']}, {t['world_size']} ranks, {t['steps']} steps):",
                  f"  {t['tokens_per_s']:.0f} tokens/s, {t['samples_per_s']:.1f} samples/s, "
                  f"step {t['step_s'] * 1e3:.0f} ms: {phases}",
                  f"  peak memory {_size(t['peak_memory_bytes'])} ({t['peak_memory_kind']}), "
                  f"{t['model_flops_per_step'] / 1e9:.2f} GFLOP/step ({t['model_flops_per_token'] / 1e6:.2f} "
                  f"MFLOP/token), {t['achieved_tflops_per_device'] * 1e3:.2f} GFLOP/s per device, {mfu}",
                  f"  step split (profiled): {format_phases(t['phase_split_s'])}"]
    return "\n".join(lines)


def _storage_header(cfg: Config, io: StorageIO) -> str:
    bandwidth = f"{io.storage_gbps:g} GB/s aggregate" if io.storage_gbps else "not bounded (--storage-gbps)"
    return (f"storage: {io.member_bytes} B per sample (tar member), {_decimal(io.step_bytes)} per step "
            f"(batch {cfg.train.global_batch_size}, ranged reads, up to {cfg.data.read_overfetch:g} overfetch), "
            f"{io.nodes} node(s), read bandwidth {bandwidth}; member indexes {_decimal(io.index_bytes_per_node)} "
            f"per node once a run ({io.corpus_samples} samples, {io.corpus_source})")


def _storage_lines(cfg: Config, gpus: int, io: StorageIO, step_s: float) -> list[str]:
    """What the planned step reads, the old loader's reads for comparison, and the storage-bound warning."""
    need = io.need_gbps(step_s)
    at = f"; at {io.storage_gbps:g} GB/s a step's reads take {io.storage_s:.3g} s" if io.storage_gbps else ""
    workers = max(cfg.data.num_workers, 1)
    lines = [f"  storage reads at this step: {need:.3g} GB/s job-wide, {need / io.nodes:.3g} GB/s per node"
             + at,
             f"  whole-shard loader (each of {workers} worker(s) x {gpus} ranks read the whole corpus each "
             f"epoch): {io.readers * io.member_bytes * cfg.train.global_batch_size / io.step_bytes:.3g}x this, "
             f"{_decimal(io.readers * io.corpus_bytes)} per epoch"]
    if io.storage_bound(step_s):
        lines.append(f"warning: storage-bound: {io.storage_s / step_s:.1f}x the compute step time "
                     f"({io.storage_s:.3g} s to read {_decimal(io.step_bytes)} at {io.storage_gbps:g} GB/s "
                     f"vs {step_s:.3g} s); the time to train uses the storage step")
    return lines


def format_plan(cfg: Config, hw: Hardware, gpus: int, gpu_mem_gib: float, counts: dict[str, int],
                flops: StepFlops, plans: list[Plan], top: int, efficiency: float,
                storage: StorageIO | None = None) -> str:
    steps = cfg.train.max_steps
    precision = cfg.train.precision
    matmul = matmul_class(precision, True, hw)
    fitting = [p for p in plans if p.fits]
    lines = [
        "model: " + " + ".join(f"{k} {v / 1e6:.1f}M" for k, v in counts.items() if k != "total")
        + f" = {counts['total'] / 1e6:.1f}M trainable parameters (real modules, meta device)",
        f"step: batch {cfg.train.global_batch_size} x seq {cfg.data.seq_len}, "
        f"{flops.model / 1e15:.3f} PFLOP model ({flops.per_token / 1e9:.3f} GFLOP/token), {steps} steps",
        f"hardware: {gpus} x {hw.name}, {gpu_mem_gib:g} GB, peak {hw.peak_tflops[matmul]:g} TFLOP/s "
        f"{matmul}, GEMMs at {efficiency:.0%}, {hw.hbm_gbps:g} GB/s memory, "
        f"all-reduce busbw {hw.busbw_intra:g} GB/s in a node / "
        f"{hw.busbw_inter:g} GB/s across ({hw.source})",
    ]
    if storage is not None:
        lines.append(_storage_header(cfg, storage))

    def bound(p: Plan) -> float:  # the step the run gets: compute, or storage where that is slower
        return storage.bound_step_s(p.step_s) if storage else p.step_s

    def storage_bound(p: Plan) -> bool:
        return storage is not None and storage.storage_bound(p.step_s)

    if fitting:
        best = fitting[0]
        m = best.memory
        enc = cfg.model.generator
        b = best.layout.micro_batch
        tokens = b * cfg.data.seq_len
        head = mlm_head_bytes(enc, cfg.data.mask_prob * tokens, tokens, 2 if precision != "fp32" else 4)
        lines += [
            "",
            f"best: ZeRO-{best.layout.zero_stage}, {best.layout.pipeline_stages} pipeline stage(s), micro-batch {b}, "
            f"checkpointing {'on' if best.layout.checkpointing else 'off'}, {best.dp} data-parallel x "
            f"{best.accumulation} accumulation: step {best.step_s:.2f} s "
            f"(compute {best.compute_s:.2f} s + communication {best.comm_s:.3f} s), "
            f"{steps} steps in {_duration(bound(best) * steps)}",
            f"  per device: params {m['params'] / GiB:.2f} GiB, gradients {m['grads'] / GiB:.2f} GiB, optimizer "
            f"states {m['optimizer'] / GiB:.2f} GiB (every engine), DeepSpeed buffers {m['buffers'] / GiB:.2f} GiB "
            f"+ {m['transient'] / GiB:.2f} GiB during forward/backward, activations {m['activations'] / GiB:.2f} GiB"
            f" = {m['total'] / GiB:.2f} GiB",
            f"  generator MLM head per micro-batch: dense logits {head['dense'] / GiB:.2f} GiB -> sparse "
            f"(masked only) {head['sparse'] / GiB:.2f} GiB -> sparse + fused loss {head['sparse_fused'] / GiB:.2f} GiB",
        ]
        if storage is not None:
            lines += _storage_lines(cfg, gpus, storage, best.step_s)
    else:
        lines += ["", f"nothing fits in {gpu_mem_gib:g} GB; smallest layouts:"]
    lines += ["", f"{'#':>3} {'ZeRO':>4} {'pp':>3} {'micro':>5} {'ckpt':>4} {'dp':>4} {'accum':>5} "
                  f"{'GiB/dev':>8} {'fits':>4} {'compute s':>9} {'comm s':>7} {'step s':>7}"
                  + (f" {'read GB/s':>9}" if storage else "") + f" {f'{steps} steps':>16}"]
    shown = fitting[:top] if fitting else sorted(plans, key=lambda p: p.memory["total"])[:top]
    for i, p in enumerate(shown, 1):
        L = p.layout
        lines.append(f"{i:>3} {L.zero_stage:>4} {L.pipeline_stages:>3} {L.micro_batch:>5} "
                     f"{'on' if L.checkpointing else 'off':>4} {p.dp:>4} {p.accumulation:>5} {p.total_gib:>8.1f} "
                     f"{'yes' if p.fits else 'no':>4} {p.compute_s:>9.2f} {p.comm_s:>7.3f} {p.step_s:>7.2f}"
                     + (f" {storage.need_gbps(p.step_s):>9.3g}" if storage else "")
                     + f" {_duration(bound(p) * steps):>16}" + ("*" if storage_bound(p) else ""))
    if any(storage_bound(p) for p in shown):
        lines.append(f"(*: storage-bound, timed at the storage step {storage.storage_s:.3g} s)")
    lines.append(f"({len(fitting)} of {len(plans)} layouts fit)")
    return "\n".join(lines)
