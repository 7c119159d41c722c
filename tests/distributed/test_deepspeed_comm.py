"""DeepSpeed's gradient communication on two gloo processes: the dtype the ranks' gradients are summed in
(`backend.grad_comm_dtype`) and ZeRO-2's overlapped, bucketed reduction (`overlapped_reduction`)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megakd.engine.backends import free_local_port
from tests.distributed.harness import CONFIG, child_env
from tests.helpers import tiny_overrides


def launch(tmp_path, script: str, spec: dict) -> dict:
    """`script` on two gloo ranks (torchrun), given `spec`; what rank 0 printed after RESULT."""
    path = tmp_path / "probe.py"
    path.write_text(script)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_local_port()}",
           str(path), json.dumps(spec)]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])


# One engine per (ZeRO stage, backend.grad_comm_dtype), its config from `EngineConfigs.for_engine`. The model's
# gradient is its input: micro-batch m of rank r feeds values with 8 significant bits (exact in bf16) and
# exponents in [-4, 3], so every partial sum of the 2 x 2 of them is exact in fp32. SGD at lr 1 from zero
# weights makes the fp32 master weight minus the step's averaged gradient, compared with float64.
GRADIENT_PROBE = """
import json, sys
import torch, torch.distributed as dist
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param
from megakd.config import BackendConfig
from megakd.engine.backends import exit_process, leave_process_group
from megakd.engine.deepspeed_backend import init_deepspeed
from megakd.engine.deepspeed_config import EngineConfigs
from megakd.launch import Launch

SIZES, ACCUMULATION = (3000, 700, 24, 1500), 2


def bf16_exact(generator, n):
    mantissa = torch.randint(128, 256, (n,), generator=generator).double() / 128
    sign = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
    return sign * mantissa * 2.0 ** torch.randint(-4, 4, (n,), generator=generator).double()


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ws = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in SIZES])

    def forward(self, xs):
        return sum((w * x.to(w.dtype)).sum() for w, x in zip(self.ws, xs))


rank, world, _ = init_deepspeed(Launch.from_environ(), "gloo")
generator = torch.Generator().manual_seed(0)
data = [[[bf16_exact(generator, n) for n in SIZES] for _ in range(ACCUMULATION)] for _ in range(world)]
terms = [[data[r][m][i] for r in range(world) for m in range(ACCUMULATION)] for i in range(len(SIZES))]
want = [-sum(t) / len(t) for t in terms]
scale = [sum(x.abs() for x in t) / len(t) for t in terms]  # the mean magnitude of the terms summed
out = {}
for stage, comm in json.loads(sys.argv[1])["cases"]:
    model = Probe()
    configs = EngineConfigs(BackendConfig(name="deepspeed", zero_stage=stage, grad_comm_dtype=comm), "bf16", 1)
    config = configs.for_engine(0.0, ACCUMULATION, world, sum(SIZES))
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                                      config=config, dist_init_required=False)
    for m in range(ACCUMULATION):
        engine.backward(engine(data[rank][m]))
        engine.step()
    got = [safe_get_full_fp32_param(w).double() for w in engine.module.ws]
    out[f"{stage} {comm}"] = {
        "exact": all(torch.equal(g, w) for g, w in zip(got, want)),
        "error": max(((g - w).abs() / s).max().item() for g, w, s in zip(got, want, scale)),
        "sent_as": str(engine.communication_data_type), "optimizer": type(engine.optimizer).__name__}
if rank == 0:
    print("RESULT", json.dumps(out))
dist.barrier()
leave_process_group()
exit_process(0)
"""


@pytest.mark.slow  # one two-rank launch: 12-17 s on 2 shared cores
def test_bf16_gradients_are_summed_across_ranks_in_fp32(tmp_path):
    """DeepSpeed's default sends bf16 gradients (its fp32-accumulated ones cast back); megakd's auto sends fp32.

    With fp32 the step equals the float64 average exactly (every partial sum is representable); the
    bf16 setting, which the test must be able to tell apart, rounds each cross-rank add to 8 bits.
    """
    cases = [(stage, comm) for stage in (1, 2) for comm in ("auto", "bf16")]
    result = launch(tmp_path, GRADIENT_PROBE, {"cases": cases})
    optimizers = {1: "BF16_Optimizer", 2: "DeepSpeedZeroOptimizer"}
    for stage, optimizer in optimizers.items():
        fp32, bf16 = result[f"{stage} auto"], result[f"{stage} bf16"]
        assert fp32 == {"exact": True, "error": 0.0, "sent_as": "torch.float32", "optimizer": optimizer}, stage
        assert bf16["sent_as"] == "torch.bfloat16" and not bf16["exact"], stage
        # measured 6.5e-3 (ZeRO-1: the accumulated fp32 sum cast to bf16, then the bf16 add) and 3.7e-3
        # (ZeRO-2: one bf16 add per micro-batch) of the terms' mean magnitude: bf16's 2^-8 spacing
        assert 2**-10 < bf16["error"] < 2**-6, (stage, bf16["error"])


# Two ELECTRA runs (two engines each) in one launch: megakd's ZeRO-2 settings, and the same run with a
# user file restoring DeepSpeed's blocking defaults. Each engine counts its bucket reductions
# (`average_tensor`: one per filled bucket or oversized parameter, called from the gradient hooks
# during backward, plus the last bucket's at the end of backward).
TRAIN_PROBE = """
import json, sys
from megakd.config import load_config
from megakd.engine.backends import exit_process
from megakd.engine.pretrain import open_trainer
from tests.distributed.worker import one_process_group


def train(overrides):
    trainer = open_trainer(load_config(spec["config"], overrides))
    out = {}
    for unit in trainer.units.values():
        engine, zero = unit.wrapped, unit.wrapped.optimizer
        calls = out[unit.name] = {
            "overlap_comm": [engine.zero_overlap_comm(), zero.overlap_comm],
            "contiguous_gradients": [engine.zero_contiguous_gradients(), zero.contiguous_gradients],
            "reduce_bucket_size": [engine.zero_reduce_bucket_size(), zero.reduce_bucket_size],
            "sent_as": str(zero.communication_data_type),
            "parameters": sum(p.numel() for p in unit.loss_module.parameters()), "reductions": 0}

        def counted(tensor, dtype, reduce=zero.average_tensor, calls=calls):
            calls["reductions"] += 1
            return reduce(tensor, dtype)

        zero.average_tensor = counted
    try:
        trainer.train()
    finally:
        trainer.close()
    return out, trainer.backend.is_main


spec = json.loads(sys.argv[1])
out = {}
with one_process_group():
    for name, overrides in spec["runs"].items():
        out[name], main = train(overrides)
if main:
    print("RESULT", json.dumps(out))
exit_process(0)
"""


@pytest.mark.slow  # one two-rank launch: 17-19 s on 2 shared cores
def test_zero2_overlapped_reduction_trains_exactly_like_the_blocking_one(tiny_data, tmp_path):
    blocking = tmp_path / "blocking.json"
    blocking.write_text(json.dumps({"zero_optimization": {"overlap_comm": False, "reduce_bucket_size": 500000000}}))
    common = {"backend.name": "deepspeed", "backend.zero_stage": 2, "train.precision": "bf16", "train.max_steps": 3,
              "train.global_batch_size": 16, "run.export_hf": "false", "kernels.backend": "torch"}
    runs = {"overlapped": tiny_overrides(tiny_data, tmp_path / "overlapped", **common),
            "blocking": tiny_overrides(tiny_data, tmp_path / "blocking", **common,
                                       **{"backend.deepspeed_config": str(blocking)})}
    result = launch(tmp_path, TRAIN_PROBE, {"config": str(CONFIG), "runs": runs})
    backwards = 3 * 2  # steps x micro-batches per rank
    for unit in ("generator", "discriminator"):
        overlapped, plain = result["overlapped"][unit], result["blocking"][unit]
        bucket = -(-overlapped["parameters"] // 8)
        # what the engine was configured with and what its ZeRO-2 optimizer runs with
        assert overlapped["overlap_comm"] == [True, True] and overlapped["contiguous_gradients"] == [True, True]
        assert overlapped["reduce_bucket_size"] == [bucket, bucket] and overlapped["sent_as"] == "torch.float32"
        assert plain["overlap_comm"] == [False, False] and plain["reduce_bucket_size"] == [500000000] * 2
        # DeepSpeed's default reduces each backward in one piece at its end; megakd's buckets fill during it
        # (measured: 7 reductions per backward for both models, each of at most a bucket or one larger parameter)
        assert plain["reductions"] == backwards
        assert overlapped["reductions"] >= 4 * backwards, overlapped["reductions"]
    # Two ranks: each element is the sum of the same two fp32 numbers however the buckets cut the
    # gradients, so bucketing and overlap change no bit of the losses and norms.
    rows = {name: [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
            for name in runs}
    assert [r["step"] for r in rows["overlapped"]] == [1, 2, 3]
    for got, want in zip(rows["overlapped"], rows["blocking"]):
        for key in ("gen_loss", "disc_loss", "grad_norm_generator", "grad_norm_discriminator"):
            assert got[key] == want[key], (key, got["step"])
