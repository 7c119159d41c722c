"""Planner memory against references: the bytes real DeepSpeed engines hold and the collectives they run,
docs/methods.md § Pretraining recipes parameter counts, and the bytes autograd really saves for an encoder layer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from megakd.bench.memory import (
    DEEPSPEED_ZERO_DEFAULTS,
    DTYPE_BYTES,
    EngineShape,
    ZeroSettings,
    engine_state_bytes,
    layer_activation_bytes,
    model_blocks,
    parameter_counts,
)
from megakd.bench.planner import collective_bytes
from megakd.config import load_config
from megakd.engine.backends import free_local_port
from megakd.finish import finish_config
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import Encoder, EncoderConfig
from tests.distributed.harness import child_env

ds_stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")


@pytest.fixture(scope="module")
def base_models():
    """The real electra-base generator and discriminator (370M parameters, on CPU)."""
    cfg = finish_config(load_config("configs/electra-base.yaml"))
    return cfg, {"generator": MaskedLM(cfg.model.generator), "discriminator": Discriminator(cfg.model.discriminator)}


def test_meta_parameter_counts_are_deepspeeds(base_models):
    """The meta-device blocks count what DeepSpeed counts on the real models, largest module included."""
    cfg, models = base_models
    for name, model in models.items():
        total, largest = ds_stage3.model_to_params(model)
        shape = EngineShape.of([b for b in model_blocks(cfg) if b.model == name])
        assert parameter_counts(cfg)[name] == shape.params == total and shape.largest_module == largest
        assert shape.sizes == tuple(p.numel() for p in model.parameters())
        assert shape.groups == (sum(p.numel() for p in model.parameters() if p.ndim >= 2),
                                sum(p.numel() for p in model.parameters() if p.ndim < 2))


def test_zero_defaults_are_deepspeeds():
    """What ZeroSettings assumes where a config is silent is DeepSpeed's own default, stage by stage."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for stage in range(4):
        resolved = DeepSpeedZeroConfig(stage=stage)
        assert {key: getattr(resolved, key) for key in DEEPSPEED_ZERO_DEFAULTS} == DEEPSPEED_ZERO_DEFAULTS
        mine = ZeroSettings.from_config({"zero_optimization": {"stage": stage}}, "bf16")
        assert mine.overlap_comm == resolved.overlap_comm and mine.comm_bytes == 2
    with pytest.raises(ValueError, match="communication_data_type: expected one of fp32, bf16, fp16, got 'int8'"):
        ZeroSettings.from_config({"communication_data_type": "int8"}, "bf16")


def test_bf16_zero1_keeps_the_whole_fp32_gradient_buffer():
    """By hand, 1000 parameters in groups of 990 and 10 over 4 ranks: BF16_Optimizer pads each group to a
    multiple of 8 (992 + 16 = 1008 elements) and keeps all of them as fp32 gradients."""
    shape = EngineShape((990, 10), (900, 90, 10), 900)
    zero = ZeroSettings.from_config({"zero_optimization": {"stage": 1}, "communication_data_type": "fp32"}, "bf16")
    got = engine_state_bytes(shape, 1, 4, "bf16", zero)
    assert got == {"params": 2 * 1008, "grads": 2 * 1000 + 4 * 1008, "optimizer": 12 * 252 + 4 * 2, "buffers": 0,
                   "transient": 0}
    fp16 = engine_state_bytes(shape, 1, 4, "fp16", zero)  # DeepSpeedZeroOptimizer: partition + fp32 accumulators
    assert fp16["grads"] == 4 * 252 + 4 * 1000
    with pytest.raises(ValueError, match="zero_stage"):
        engine_state_bytes(shape, 4, 4, "bf16", zero)


# Run in a child launch of 2 gloo ranks: one DeepSpeed engine per case on a small megakd Discriminator (the
# config megakd derives, plus the case's zero_optimization keys), two optimizer steps of 2 micro-batches. It
# reports the bytes of every distinct storage the module's parameters (data, grad, ZeRO-3 partition) and the
# optimizer wrapper and its torch optimizer reach, after the last backward (before its step) and at the end of
# a forward; the largest ZeRO-2 bucket staging seen at a collective; and the bytes of every collective of
# the last step (DeepSpeed's comm layer, wrapped).
ENGINE_PROBE = """
import json, sys
import torch
from torch import nn
from megakd.config import BackendConfig
from megakd.engine.deepspeed_backend import ProcessWideState, init_deepspeed
from megakd.engine.deepspeed_config import EngineConfigs
from megakd.engine.optim import param_groups
from megakd.launch import Launch
from megakd.models.electra import Discriminator
from megakd.models.encoder import EncoderConfig

rank, world, _ = init_deepspeed(Launch.from_environ(), "gloo")
import deepspeed
import deepspeed.comm as dcomm

KINDS = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "allgather_fn": "all_gather",
         "all_gather": "all_gather", "reduce_scatter_fn": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}
SIZE = {"all_reduce": lambda t, *a, **k: [t], "all_gather_into_tensor": lambda o, i, *a, **k: [o],
        "allgather_fn": lambda o, i, *a, **k: [o], "all_gather": lambda ts, t, *a, **k: ts,
        "reduce_scatter_fn": lambda o, i, *a, **k: [i], "reduce_scatter_tensor": lambda o, i, *a, **k: [i]}
state = {"on": False, "ops": {}, "staging": 0, "optimizer": None}


def staging():  # ZeRO-2's bucket staging buffers (a list per bucket; ZeRO-3's one tensor is counted as held)
    if type(state["optimizer"]).__name__ != "DeepSpeedZeroOptimizer":
        return 0
    buckets = state["optimizer"].ipg_buckets.values()
    return sum(b.untyped_storage().nbytes() for bucket in buckets for b in bucket.buffer)


def wrap(name):
    inner = getattr(dcomm, name)
    def call(*args, **kwargs):
        nbytes = sum(t.numel() * t.element_size() for t in SIZE[name](*args, **kwargs))
        if state["on"] and (name != "all_reduce" or nbytes > 64):  # not the norms and overflow flags
            state["ops"][KINDS[name]] = state["ops"].get(KINDS[name], 0) + nbytes
            state["staging"] = max(state["staging"], staging())
        return inner(*args, **kwargs)
    setattr(dcomm, name, call)


for name in KINDS:
    wrap(name)


def held(module, optimizer, torch_optimizer):
    found, seen = {}, set()
    def walk(obj, depth=0):
        if depth > 5 or id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            for t in (obj, obj.grad, getattr(obj, "ds_tensor", None)):
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel():
                    found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        elif isinstance(obj, (list, tuple, set)):
            for x in obj:
                walk(x, depth + 1)
        elif isinstance(obj, dict):
            for x in obj.values():
                walk(x, depth + 1)
        elif hasattr(obj, "__dict__") and type(obj).__module__.startswith(("deepspeed", "torch.optim")):
            for x in vars(obj).values():
                walk(x, depth + 1)
    walk(list(module.parameters()))
    walk(optimizer)
    walk(torch_optimizer)
    return sum(found.values())


class Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = Discriminator(EncoderConfig(vocab_size=512, hidden_size=48, num_layers=2, num_heads=2,
                                                 intermediate_size=192, max_position_embeddings=64,
                                                 embedding_size=32))

    def forward(self, ids):
        return self.model.rtd_logits(self.model(ids)).float().square().mean()


for case in json.loads(sys.argv[1]):
    found = ProcessWideState()
    torch.manual_seed(0)
    module = Loss()
    sizes = [p.numel() for p in module.parameters()]
    groups = [sum(p.numel() for p in g["params"]) for g in param_groups(module.named_parameters(), 0.01)]
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    torch_optimizer = torch.optim.AdamW(param_groups(module.named_parameters(), 0.01), lr=1e-3)
    configs = EngineConfigs(BackendConfig(name="deepspeed", zero_stage=case["stage"]), case["precision"], 2)
    ds = configs.for_engine(1.0, 2, world, sum(sizes))
    ds["zero_optimization"].update(case.get("zero", {}))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=torch_optimizer, config=ds,
                                           dist_init_required=False)
    state.update(on=False, ops={}, staging=0, optimizer=engine.optimizer)
    ids = torch.randint(5, 500, (2, 64), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):  # one whole step first: Adam's states exist from then on
        engine.backward(engine(ids))
        engine.step()
    before_forward = held(module, engine.optimizer, torch_optimizer)
    state["on"] = True
    loss = engine(ids)
    forward = held(module, engine.optimizer, torch_optimizer) - before_forward
    engine.backward(loss)
    engine.step()
    engine.backward(engine(ids))
    backward = held(module, engine.optimizer, torch_optimizer)
    engine.step()
    state["on"] = False
    if rank == 0:
        print("RESULT", json.dumps({**case, "optimizer": type(engine.optimizer).__name__, "ds": ds, "sizes": sizes,
                                    "groups": groups, "largest": largest, "backward": backward,
                                    "forward": forward, "staging": state["staging"], "ops": state["ops"]}))
    engine.destroy()
    found.put_back()
"""

ENGINE_CASES = [{"precision": precision, "stage": stage} for precision in ("bf16", "fp32") for stage in range(4)] + [
    # ZeRO-3 with every parameter partitioned: the gathered weights, kept from forward into backward by
    # DeepSpeed's defaults, or gathered again for backward when nothing may stay live
    {"precision": "bf16", "stage": 3, "zero": {"param_persistence_threshold": 0, "reduce_bucket_size": 20000}},
    {"precision": "bf16", "stage": 3, "zero": {"param_persistence_threshold": 0, "reduce_bucket_size": 20000,
                                               "max_live_parameters": 0, "max_reuse_distance": 0,
                                               "prefetch_bucket_size": 0}},
]
WRAPPERS = {(0, "bf16"): "FP16_UnfusedOptimizer", (0, "fp32"): "AdamW", (1, "bf16"): "BF16_Optimizer",
            (1, "fp32"): "DeepSpeedZeroOptimizer", (2, "bf16"): "DeepSpeedZeroOptimizer",
            (2, "fp32"): "DeepSpeedZeroOptimizer", (3, "bf16"): "DeepSpeedZeroOptimizer_Stage3",
            (3, "fp32"): "DeepSpeedZeroOptimizer_Stage3"}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    script = tmp_path_factory.mktemp("probe") / "engine_probe.py"
    script.write_text(ENGINE_PROBE)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_local_port()}",
           str(script), json.dumps(ENGINE_CASES)]
    proc = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line.split("RESULT ", 1)[1]) for line in proc.stdout.splitlines() if "RESULT " in line]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(ENGINE_CASES)))
def test_engine_states_and_collectives_are_deepspeeds(engines, index):
    """engine_state_bytes and collective_bytes against what a real DeepSpeed 0.19 engine holds and sends, on 2
    ranks. Held bytes are exact but for the gradient-norm and overflow scalars (at most 16 B); fp32 at ZeRO-1/2
    keeps the gradients of every parameter its partition touches, up to one more parameter per group than the
    partition (DeepSpeedZeroOptimizer's `grads_in_partition`)."""
    got = engines[index]
    assert {k: got[k] for k in ("precision", "stage")} == {k: ENGINE_CASES[index][k] for k in ("precision", "stage")}
    stage, precision = got["stage"], got["precision"]
    assert got["optimizer"] == WRAPPERS[stage, precision]
    shape = EngineShape(tuple(g for g in got["groups"] if g), tuple(got["sizes"]), got["largest"])
    zero = ZeroSettings.from_config(got["ds"], precision)
    model = engine_state_bytes(shape, stage, 2, precision, zero)
    whole_step = model["params"] + model["grads"] + model["optimizer"] + model["buffers"]
    slack = 4 * max(shape.sizes) * len(shape.groups) if precision == "fp32" and stage in (1, 2) else 0
    assert whole_step <= got["backward"] <= whole_step + 16 + slack
    if stage == 2:  # the staging buckets (the communication-dtype copy of one bucket is a local in DeepSpeed)
        assert got["staging"] == (2 if zero.overlap_comm else 1) * zero.reduce_bucket_size * DTYPE_BYTES[precision]
    if stage == 3:  # what forward gathers and keeps: everything partitioned, or nothing when it may keep nothing
        partitioned = shape.params - shape.persistent(2, zero.param_persistence_threshold)[0]
        kept = zero.keeps_gathered(partitioned)
        assert got["forward"] == (DTYPE_BYTES[precision] * partitioned if kept else 0)
        # (while a module computes, its weights; in backward, the largest module's 16-bit gradients)
        live = partitioned if kept else shape.largest_module
        assert model["transient"] == DTYPE_BYTES[precision] * (live + shape.largest_module)
    else:
        assert got["forward"] == 0
    volumes = {k: v for k, v in collective_bytes(shape, stage, 2, precision, zero, 2).items() if v}
    assert got["ops"] == volumes


@pytest.mark.parametrize("size,expected", [("base", 370e6), ("large", 665e6)])
def test_parameter_counts_match_spec(size, expected):
    # docs/methods.md § Pretraining recipes: two 128K x hidden embedding tables (DecoupledOptim), ≈370M / ≈665M.
    counts = parameter_counts(finish_config(load_config(f"configs/electra-{size}.yaml")))
    assert counts["total"] == pytest.approx(expected, rel=0.01)
    assert counts["total"] == counts["generator"] + counts["discriminator"]


def _saved_bytes(encoder, x, key_mask, bias) -> int:
    """Bytes of every distinct storage autograd saves for the encoder's first layer, its parameters aside."""
    params = {p.untyped_storage().data_ptr() for p in encoder.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        encoder.layers[0](x, key_mask, bias)
    return sum(saved.values())


@pytest.mark.parametrize("zero3", [False, True], ids=["torch_linear", "zero3_linear"])
@pytest.mark.parametrize("fused_qkv", [True, False])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_layer_activations_match_saved_tensors(dropout, fused_qkv, zero3, monkeypatch):
    """Every tensor autograd saves for one layer (parameters excluded, shared storage once), with torch's
    linear and with the linear DeepSpeed's ZeRO-3 puts in its place (which keeps the bias too)."""
    if zero3:
        from deepspeed.runtime.zero.linear import zero3_linear_wrap

        monkeypatch.setattr(torch.nn.functional, "linear", zero3_linear_wrap)
    cfg = EncoderConfig(vocab_size=512, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=256,
                        dropout=dropout, attention_dropout=0.0, max_position_embeddings=128, fused_qkv=fused_qkv)
    encoder = Encoder(cfg).train()
    ids = torch.randint(5, 500, (4, 128))
    x, key_mask, bias = encoder.prepare(ids, torch.ones_like(ids))
    x = x.detach().requires_grad_()
    saved = _saved_bytes(encoder, x, key_mask, bias)
    # CPU dropout keeps its mask as float32 (CUDA keeps bool: mask_bytes=1).
    assert saved == layer_activation_bytes(cfg, 128, 4, elem=4, mask_bytes=4, zero3=zero3)


@pytest.mark.parametrize("seq_len", [128, 100])  # 100: the bias and masks padded to flex's 128 blocks
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_flex_layer_activations_match_saved_tensors(dropout, seq_len, monkeypatch):
    """The flex path for T5 relative positions (what `auto` runs on CUDA with attention dropout off): every
    tensor the compiled flex_attention's autograd saves for one layer, counted as in the test above. On CPU
    it is compiled with the aot_eager backend: AOTAutograd's partition (what a compiled backward gets
    saved) with eager kernels, since torch 2.13's inductor has no CPU flex backward; eager flex_attention
    keeps its row maxima and lengths too, which the compiled backward does not read."""
    import torch.nn.attention.flex_attention as flex_module

    from megakd.models import encoder as encoder_module
    from megakd.models.encoder import flex_bias, flex_block_mask

    compiled = torch.compile(flex_module.flex_attention, backend="aot_eager")
    monkeypatch.setattr(encoder_module, "compiled_flex_attention", lambda: compiled)
    monkeypatch.setattr(flex_module, "_validate_device", lambda *tensors: None)  # its CPU no-backward check
    cfg = EncoderConfig(vocab_size=512, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=256,
                        dropout=dropout, attention_dropout=0.0, max_position_embeddings=128,
                        position_encoding="t5_relative")
    encoder = Encoder(cfg).train()
    ids = torch.randint(5, 500, (4, seq_len))
    mask = torch.ones_like(ids)
    mask[1, seq_len // 2:] = 0
    x, key_mask, bias = encoder.prepare(ids, mask)
    x = x.detach().requires_grad_()
    key_mask, bias = flex_block_mask(key_mask), flex_bias(bias, x.dtype)  # as Encoder.forward makes them
    saved = _saved_bytes(encoder, x, key_mask, bias)
    assert saved == layer_activation_bytes(cfg, seq_len, 4, elem=4, mask_bytes=4)


@pytest.mark.parametrize("position_encoding", ["t5_relative", "absolute"])
def test_triton_layer_activations_match_saved_tensors(position_encoding, monkeypatch):
    """megakd's Triton attention (what `auto` runs on CUDA for T5 relative positions with attention dropout on),
    under the interpreter with one tile per (batch, head): every tensor one layer saves, counted as above."""
    from megakd.kernels import attention_triton
    from megakd.kernels.launch import LaunchConfig

    monkeypatch.setattr(attention_triton, "INTERPRETER_CONFIG", LaunchConfig.of(BLOCK_M=128, BLOCK_N=128))
    cfg = EncoderConfig(vocab_size=512, hidden_size=64, num_layers=1, num_heads=4, intermediate_size=256,
                        dropout=0.1, attention_dropout=0.1, max_position_embeddings=128,
                        position_encoding=position_encoding, attention_kernel="triton")
    encoder = Encoder(cfg).train()
    ids = torch.randint(5, 500, (4, 100))
    mask = torch.ones_like(ids)
    mask[1, 50:] = 0
    x, key_mask, bias = encoder.prepare(ids, mask)
    x = x.detach().requires_grad_()
    saved = _saved_bytes(encoder, x, key_mask, bias)
    assert saved == layer_activation_bytes(cfg, 100, 4, elem=4, mask_bytes=4)
