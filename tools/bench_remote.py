"""Reading shards from an S3 API against local disk, side by side, and what each rank fetches.

Starts moto's S3 server in its own process on a local socket (a dev dependency: `pip install -e ".[dev]"`), writes the
same seq-512 shards of the bundled corpus to local disk and to a bucket (each once in input order
and once `--shuffle`d for `data.read_block`), then times the loader on both, the paths taking turns
within each repeat so load on the machine falls on all alike. Prints steady samples/s per core (a
DataLoader worker is a core; after the first `--warmup` batches), its ratio to local disk at the
same settings and the ratio from the loader's start (which a run pays once: workers, storage
clients, first reads), the reads the loader asked for (GETs/s: to set beside each server's ceiling),
the CPU the server itself used meanwhile (it shares the machine's cores with the loader) and the
slowest close (the last batch until the workers are gone: what a pass pays when it ends). Then
runs 2 ranks x 2 workers through one epoch from the bucket and prints each rank's fetched bytes
against its share.

Where `nginx` is on PATH (Debian: `apt-get install nginx-light`), the same shards are also served
over HTTP by nginx and timed in the same turns: a server whose per-request cost is small, so that
row says what the loader itself reaches over a socket when the server is not the bound.

Local S3 is not S3: a request here costs a Python server's time on this machine's cores, not a
network round trip, so the ratio says how the loader copes with per-request cost, not what a
cluster will see.

    python tools/bench_remote.py [--workers 4] [--batches 1000] [--warmup 200] [--repeats 3] [--read-block 16 64]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from megakd.engine.backends import free_local_port  # noqa: E402 (after the environment is set)


def wait_listening(server: subprocess.Popen, port: int, name: str) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"{name} did not start on port {port}") from None
            time.sleep(0.2)


def start_s3() -> subprocess.Popen:
    """moto's S3 server in its own process (so it does not share this process's GIL with the loader);
    the AWS_* environment points every client (workers too) at it."""
    port = free_local_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    wait_listening(server, port, "moto's S3 server")
    import boto3

    boto3.client("s3").create_bucket(Bucket="bench")
    return server


def start_nginx(root: Path, work: Path) -> tuple[subprocess.Popen, str] | None:
    """nginx serving `root` on a local port (ranged GETs, keep-alive), in the foreground under a
    config of its own in `work`; None where nginx is not installed."""
    if shutil.which("nginx") is None:
        return None
    port, conf = free_local_port(), work / "nginx.conf"
    temp = {k: work / f"nginx-{k}" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
    conf.write_text(
        # As root, nginx's workers would drop to `nobody`, who cannot read the bench's private temp dir.
        ("user root;\n" if os.geteuid() == 0 else "")
        + f"daemon off;\nworker_processes 1;\npid {work / 'nginx.pid'};\nerror_log {work / 'nginx-error.log'};\n"
        "events { worker_connections 1024; }\n"
        "http {\n  access_log off;\n  sendfile on;\n  keepalive_requests 1000000;\n"
        + "".join(f"  {k}_temp_path {v};\n" for k, v in temp.items())
        + f"  server {{ listen 127.0.0.1:{port}; root {root}; }}\n}}\n")
    server = subprocess.Popen(["nginx", "-c", str(conf), "-p", str(work)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_listening(server, port, "nginx")
    return server, f"http://127.0.0.1:{port}"


def server_requests_per_s(fs, path: str, seconds: float = 3.0) -> tuple[float, float]:
    """What a server answers: 2 KB ranged GETs of `path` per second, 16 at a time (its ceiling here);
    and the CPU each GET costs the client (this process: fsspec, its event loop, the storage library)."""
    starts = [i * 2048 for i in range(16)]
    done, start, cpu = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        fs.cat_ranges([path] * 16, starts, [s + 2048 for s in starts])
        done += 16
    return done / (time.perf_counter() - start), (time.process_time() - cpu) / done


@dataclass
class Timing:
    from_start: float  # samples/s from the loader's start (workers, clients, first reads) to the last batch
    steady: float  # samples/s after the first `warmup` batches: what a run sees once it is going
    gets: float  # GETs/s the loader asked of the storage, over the whole timing
    close_s: float  # seconds from the last batch until the iterator (its workers) has shut down


def time_loader(make_loader, batches: int, batch: int, warmup: int) -> Timing:
    """Time a fresh loader to its `batches`-th batch. Every shard-group read on the way is inside the
    timing, which is where local and remote storage differ; so is the start, which a run pays once.
    Closing it (which a pass pays when it ends) is timed apart."""
    start = warm = time.perf_counter()
    loader = make_loader()
    iterator = iter(loader)
    for i, _ in enumerate(itertools.islice(iterator, batches)):
        if i + 1 == warmup:
            warm = time.perf_counter()
    end = time.perf_counter()
    del iterator  # the DataLoader shuts its workers down
    closed = time.perf_counter()
    return Timing(batches * batch / (end - start), (batches - warmup) * batch / (end - warm),
                  loader.read_requests / (end - start), closed - end)


def cpu_seconds(pid: int) -> float:
    """CPU time a server process and its children (nginx's workers) have used so far."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    return sum(t.user + t.system for t in (proc.cpu_times() for proc in procs))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--warmup", type=int, default=200, help="batches before the steady rate is timed")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--read-block", type=int, nargs="+", default=[16, 64], help="data.read_block values to time "
                   "on the shuffled shards (besides 1 on the plain ones)")
    p.add_argument("--samples-per-shard", type=int, default=250)
    p.add_argument("--shuffle-shards", type=int, default=2, help="shards per group: a group is read every "
                   "samples-per-shard x shuffle-shards samples")
    p.add_argument("--cache", default=os.environ.get("MEGAKD_CACHE", str(Path.home() / ".cache" / "megakd")))
    args = p.parse_args()
    if not 0 <= args.warmup < args.batches:
        p.error(f"--warmup {args.warmup}: expected 0 <= warmup < --batches ({args.batches})")

    from megakd.data.default_corpus import bundled_corpus_files, prepare_default_data
    from megakd.data.loader import PretrainingLoader
    from megakd.data.shards import write_shards
    from megakd.data.tokenizer import Tokenizer

    server = start_s3()
    tok_dir, _ = prepare_default_data(args.cache, vocab_size=8000, seq_len=512)
    tok = Tokenizer.load(tok_dir)
    inputs = bundled_corpus_files("classic")
    work = Path(tempfile.mkdtemp(prefix="bench-remote-"))
    sets = {}
    for shuffled in (False, True):
        name = "shuffled" if shuffled else "plain"
        local = work / name
        write_shards(inputs, tok, 512, local, samples_per_shard=args.samples_per_shard, shuffle=shuffled)
        remote = f"s3://bench/{name}"
        write_shards(inputs, tok, 512, remote, samples_per_shard=args.samples_per_shard, shuffle=shuffled)
        sets[name] = {"local disk": str(local), "local S3": remote}
    nginx = start_nginx(work, work)
    servers = {"local S3": server.pid}
    if nginx is not None:
        servers["nginx HTTP"] = nginx[0].pid
        for name in sets:
            sets[name]["nginx HTTP"] = f"{nginx[1]}/{name}"

    rows = []
    for name, block in [("plain", 1)] + [("shuffled", b) for b in args.read_block]:
        makers = {where: (lambda src=src, block=block: PretrainingLoader(
            src, tok, micro_batch_size=args.batch, num_workers=args.workers, seed=0, read_block=block,
            shuffle_shards=args.shuffle_shards, index_cache=work / "index-cache"))
            for where, src in sets[name].items()}
        timings: dict[str, list[Timing]] = {where: [] for where in makers}
        server_cores: dict[str, list[float]] = {where: [] for where in servers}
        for _ in range(args.repeats):  # the paths take turns
            for where, make in makers.items():
                before = cpu_seconds(servers[where]) if where in servers else 0.0
                timings[where].append(time_loader(make, args.batches, args.batch, args.warmup))
                if where in servers:  # the server's CPU over the timing, in cores
                    wall = args.batches * args.batch / timings[where][-1].from_start
                    server_cores[where].append((cpu_seconds(servers[where]) - before) / wall)
        med = {where: Timing(*(statistics.median(getattr(t, f.name) for t in runs) for f in fields(Timing)))
               for where, runs in timings.items()}
        for where, m in med.items():
            cores = statistics.median(server_cores[where]) if where in servers else None
            base = med["local disk"]
            rows.append((where, block, m.steady / max(args.workers, 1), m.steady / base.steady,
                         m.from_start / base.from_start, m.gets, cores, max(t.close_s for t in timings[where])))

    print(f"seq 512, micro-batch {args.batch}, {args.workers} workers, groups of {args.shuffle_shards} x "
          f"{args.samples_per_shard} samples; median of {args.repeats} runs of {args.batches} batches from the start "
          f"(steady: after the first {args.warmup})")
    import boto3
    import fsspec

    boto3.client("s3").put_object(Bucket="bench", Key="probe", Body=os.urandom(1 << 20))
    (work / "probe").write_bytes(os.urandom(1 << 20))
    ceilings = {"local S3": (fsspec.filesystem("s3", skip_instance_cache=True), "bench/probe")}
    if nginx is not None:
        ceilings["nginx HTTP"] = (fsspec.filesystem("http", skip_instance_cache=True), f"{nginx[1]}/probe")
    for where, (fs, path) in ceilings.items():
        per_s, client_cpu = server_requests_per_s(fs, path)
        print(f"{where} server ceiling: {per_s:.0f} ranged GETs/s; each costs the client {client_cpu * 1e3:.2f} ms "
              "of CPU")
    if nginx is None:
        print("nginx is not installed: no HTTP row (Debian: apt-get install nginx-light)")
    print(f"{'source':<12} {'read_block':>10} {'steady samples/s/core':>22} {'vs local disk':>14} "
          f"{'from the start':>15} {'GETs/s':>7} {'server CPU (cores)':>19} {'slowest close (s)':>18}")
    for where, block, per_core, ratio, ratio_start, get_rate, cores, close_s in rows:
        server_cpu = "-" if cores is None else f"{cores:.2f}"
        print(f"{where:<12} {block:>10} {per_core:>22.0f} {ratio:>13.2f}x {ratio_start:>14.2f}x {get_rate:>7.0f} "
              f"{server_cpu:>19} {close_s:>18.1f}")

    local, remote = sets["plain"]["local disk"], sets["plain"]["local S3"]
    shard_bytes = sum(f.stat().st_size for f in Path(local).glob("shard-*.tar"))
    print("\n2 ranks x 2 workers, one epoch from local S3 (read_block 1):")
    for rank in range(2):
        loader = PretrainingLoader(remote, tok, micro_batch_size=args.batch, rank=rank, world_size=2, num_workers=2,
                                   seed=0, index_cache=work / f"index-cache-{rank}")
        for _ in loader:
            if loader.position >= loader.num_samples:
                break
        share = shard_bytes / 2
        print(f"  rank {rank}: fetched {loader.read_bytes / 1e6:.1f} MB, share {share / 1e6:.1f} MB "
              f"({loader.read_bytes / share:.3f}x; the whole-shard reader: {2 * shard_bytes / share:.0f}x)")
    server.terminate()
    if nginx is not None:
        nginx[0].terminate()


if __name__ == "__main__":
    main()
