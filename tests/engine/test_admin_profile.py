"""Admin's profiling pass runs once per run (`megakd.engine.pretrain.admin_profile`): a resume from a checkpoint
skips it, a restart before the first checkpoint reads `run.dir/admin_profile.json` (`megakd.store.admin_profile`),
and a damaged or foreign file is refused in one line naming it, left as it is."""

from __future__ import annotations

import json
import os

import pytest
import torch

from megakd.config import load_config
from megakd.configio import save_config
from megakd.data.tokenizer import Tokenizer
from megakd.engine import pretrain
from megakd.engine.backends import SingleProcessBackend
from megakd.engine.hooks import Hook
from megakd.engine.run import Resume
from megakd.store import StoreError, checkpoint
from megakd.store.admin_profile import PROFILE_FILE, read_profile, write_profile
from megakd.store.rundir import RunDirLock
from tests.helpers import tiny_overrides, trained

TINY = "configs/electra-tiny.yaml"
ADMIN = {"model.generator.init": "admin", "model.discriminator.init": "admin"}


def _cfg(tiny_data, run, **extra):
    return load_config(TINY, tiny_overrides(tiny_data, run, **{**ADMIN, **extra}))


@pytest.fixture
def passes(monkeypatch) -> list[int]:
    """The encoders' sizes (layers) in every profiling pass run from here on."""
    seen: list[int] = []
    real = pretrain.admin_initialize

    def counted(encoder, *args, **kwargs):
        seen.append(encoder.config.num_layers)
        return real(encoder, *args, **kwargs)

    monkeypatch.setattr(pretrain, "admin_initialize", counted)
    return seen


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {f"{u.name}.{k}": v.detach().clone()
            for u in trainer.units.values() for k, v in u.model.state_dict().items()}


def _omegas(trainer) -> dict[str, list[float]]:
    return {name: [w.item() for layer in unit.model.encoder.layers
                   for w in (layer.attention_omega[0], layer.ffn_omega[0])] for name, unit in trainer.units.items()}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class _NodeLost(Hook):
    """Ends the run with an error after step `at`, before any checkpoint."""

    def __init__(self, at: int):
        self.at = at

    def after_step(self, end) -> None:
        if end.step == self.at:
            raise RuntimeError("node lost")


def _died_before_first_checkpoint(tiny_data, run) -> None:
    with pytest.raises(RuntimeError, match="node lost"):
        trained(_cfg(tiny_data, run, **{"train.max_steps": 2, "run.save_every": 0}),
                extend=lambda trainer: trainer.add_hook(_NodeLost(at=1)))
    assert checkpoint.list_checkpoints(run) == [] and (run / PROFILE_FILE).is_file()


def test_a_resume_from_a_checkpoint_does_not_profile_and_ends_as_the_uninterrupted_run(tiny_data, tmp_path, passes):
    steps = {"train.max_steps": 2, "run.save_every": 1}
    full = trained(_cfg(tiny_data, tmp_path / "full", **steps))
    assert passes == [1, 2]  # generator, discriminator
    run = tmp_path / "resumed"
    trained(_cfg(tiny_data, run, **{**steps, "train.max_steps": 1}))
    del passes[:]
    resumed = trained(_cfg(tiny_data, run, **steps), "auto")
    assert passes == [] and resumed.step == 2
    _assert_equal(_weights(full), _weights(resumed))


def test_a_restart_before_the_first_checkpoint_reads_the_saved_profile(tiny_data, tmp_path, passes):
    """The file holds the first start's ω; the restart reads them instead of profiling, starts from the same
    weights as a fresh run and trains to the same bits."""
    run = tmp_path / "run"
    _died_before_first_checkpoint(tiny_data, run)
    saved = json.loads((run / PROFILE_FILE).read_text())
    del passes[:]
    steps = {"train.max_steps": 1, "run.save_every": 0}
    start, end = {}, {}
    for name, resume in (("restarted", "auto"), ("fresh", None)):  # one after the other: dropout draws from
        trainer = pretrain.open_trainer(_cfg(tiny_data, tmp_path / "run" if resume else tmp_path / name, **steps),
                                        resume)  # the global generator, which a build seeds
        start[name], omegas = _weights(trainer), _omegas(trainer)
        try:
            trainer.train()
        finally:
            trainer.close()
        end[name] = _weights(trainer)
        assert passes == ([] if resume else [1, 2])
    assert omegas == {name: saved["models"][name]["omegas"] for name in ("generator", "discriminator")}
    assert omegas["discriminator"][-1] != 1.0  # the reference profile's first ω is 1 by definition
    _assert_equal(start["fresh"], start["restarted"])
    _assert_equal(end["fresh"], end["restarted"])
    assert (tmp_path / "fresh" / PROFILE_FILE).read_bytes() == (run / PROFILE_FILE).read_bytes()


def test_a_run_that_fails_in_its_first_step_still_saves_the_profile(tiny_data, tmp_path):
    """The loop saves it before its first step: the ω the run was built with, read back intact."""
    run = tmp_path / "run"
    trainer = pretrain.open_trainer(_cfg(tiny_data, run, **{"train.max_steps": 1}))
    built = _omegas(trainer)

    def out_of_memory(_):
        raise RuntimeError("out of memory")

    trainer.loop.step = out_of_memory
    with pytest.raises(RuntimeError, match="out of memory"):
        try:
            trainer.train()
        finally:
            trainer.close()
    models = {"generator": trainer.units["generator"].model.config,
              "discriminator": trainer.units["discriminator"].model.config}
    saved = read_profile(run / PROFILE_FILE, trainer.cfg.train.seed, models)["models"]
    assert {name: saved[name]["omegas"] for name in models} == built and checkpoint.list_checkpoints(run) == []


def _finished(tiny_data, run):
    """(config as `PretrainingJob` finishes it, tokenizer, shards): what `admin_profile` takes."""
    cfg = _cfg(tiny_data, run)
    tokenizer = Tokenizer.load(tiny_data[0])
    pretrain.finish_config(cfg, tokenizer)
    return cfg, tokenizer, pretrain.shard_store(cfg, tiny_data[1])


def _valid_profile(tiny_data, run) -> bytes:
    """run/admin_profile.json as a fresh pass saves it (no training); its bytes."""
    cfg, tokenizer, store = _finished(tiny_data, run)
    saver = pretrain.admin_profile(cfg, list(pretrain.build_models(cfg)), store, tokenizer, SingleProcessBackend())
    run.mkdir(parents=True)
    saver.save()
    return (run / PROFILE_FILE).read_bytes()


def _rewritten(raw: bytes, change) -> bytes:
    """`raw` with `change(record)` applied and a matching sha256: a file written on purpose, not damaged."""
    record = json.loads(raw)
    record.pop("sha256")
    change(record)
    return _with_digest(record)


def _with_digest(record: dict) -> bytes:
    from megakd.store import admin_profile

    return (json.dumps({**record, "sha256": admin_profile._digest(record)}) + "\n").encode()


def _flip_an_omega_digit(raw: bytes) -> bytes:
    at = raw.index(b'"omegas"')
    at = raw.index(b".", at) + 1  # the first fractional digit of the first ω
    return raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1:]


def _set(record: dict, keys: tuple, value) -> None:
    for key in keys[:-1]:
        record = record[key]
    record[keys[-1]] = value


DAMAGE = {
    "flipped-omega-digit": (_flip_an_omega_digit, "does not match its sha256"),
    "truncated": (lambda raw: raw[: len(raw) // 2], "not an Admin profile"),
    "empty": (lambda raw: b"", "not an Admin profile"),
    "other-seed": (lambda raw: _rewritten(raw, lambda r: _set(r, ("seed",), 7)), "profiled for seed 7"),
    "other-width": (lambda raw: _rewritten(raw, lambda r: _set(r, ("models", "discriminator", "config", "hidden_size"),
                                                                     64)),
                    "model.discriminator.hidden_size=64, this run has 48"),
    "one-omega-short": (lambda raw: _rewritten(raw, lambda r: r["models"]["generator"]["omegas"].pop()),
                        "model.generator: expected 2 finite positive"),
    "negative-omega": (lambda raw: _rewritten(raw, lambda r: _set(r, ("models", "generator", "omegas"), [1.0, -2.0])),
                       "model.generator: expected 2 finite positive"),
    "no-device": (lambda raw: _rewritten(raw, lambda r: r.pop("device")), "expected the device the profile ran on"),
    "newer-version": (lambda raw: _rewritten(raw, lambda r: _set(r, ("version",), 2)), "version 2, this megakd reads"),
    "huge": (lambda raw: b" " * (2 << 20), "over 1048576 bytes"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_or_foreign_profile_is_refused_in_one_line_and_left_as_it_is(tiny_data, tmp_path, passes, damage):
    make, expected = DAMAGE[damage]
    run = tmp_path / "run"
    path = run / PROFILE_FILE
    bad = make(_valid_profile(tiny_data, run))
    path.write_bytes(bad)
    with RunDirLock(run) as lock:  # the run that wrote it died before its first checkpoint
        lock.announce()
    save_config(_finished(tiny_data, run)[0], run / "config.yaml")
    del passes[:]
    with pytest.raises(StoreError) as refused:
        pretrain.open_trainer(_cfg(tiny_data, run), "auto")
    message = str(refused.value)
    assert message.startswith(f"{path}: ") and expected in message and "\n" not in message, message
    assert path.read_bytes() == bad and passes == []
    # a new run never reads it: it claims run.dir afresh (run.overwrite moves the old contents aside)
    pretrain.open_trainer(_cfg(tiny_data, run, **{"run.overwrite": True})).close()
    assert passes == [1, 2]


def test_every_flipped_byte_or_cut_is_refused_or_reads_as_the_same_profile(tiny_data, tmp_path):
    """Fault injection over the whole file: every cut, and two bit flips of every byte, either make the file
    unreadable (one line naming it) or change nothing it says; never other ω."""
    raw = _valid_profile(tiny_data, tmp_path / "run")
    cfg = _finished(tiny_data, tmp_path / "run")[0]
    configs = {"generator": cfg.model.generator, "discriminator": cfg.model.discriminator}
    path = tmp_path / "damaged.json"
    path.write_bytes(raw)
    good = read_profile(path, cfg.train.seed, configs)
    variants = [raw[:cut] for cut in range(len(raw))]
    variants += [raw[:i] + bytes([raw[i] ^ mask]) + raw[i + 1:] for i in range(len(raw)) for mask in (0x01, 0x10)]
    for damaged in variants:
        path.write_bytes(damaged)
        try:
            read = read_profile(path, cfg.train.seed, configs)
        except StoreError as err:
            assert str(err).startswith(f"{path}: ") and "\n" not in str(err)
            continue
        # accepted: the cut of the final newline, or a last digit that parses to the same float
        assert read == good and json.loads(damaged) == json.loads(raw)


def test_a_profile_that_is_not_a_regular_file_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / PROFILE_FILE
    os.mkfifo(fifo)  # opening it to read would wait for a writer forever
    with pytest.raises(StoreError, match=f"^{fifo}: expected a regular file"):
        read_profile(fifo, 0, {})


class _OtherRank(SingleProcessBackend):
    """Rank `rank` of 2, whose all-reduce adds `received` (what rank 0 put in) to its own tensor."""

    def __init__(self, rank: int, received: list[torch.Tensor]):
        super().__init__()
        self.rank, self.world_size, self.received = rank, 2, received

    def all_reduce_sum(self, tensor):
        if self.rank == 0:
            self.received.append(tensor.clone())
            return tensor
        return tensor + self.received[0]


def test_only_rank_0_profiles_and_every_rank_gets_its_omegas_or_its_failure(tiny_data, tmp_path, passes):
    cfg, tokenizer, store = _finished(tiny_data, tmp_path / "run")
    sent: list[torch.Tensor] = []
    ranks = [list(pretrain.build_models(cfg)) for _ in range(2)]
    savers = [pretrain.admin_profile(cfg, ranks[r], store, tokenizer, _OtherRank(r, sent)) for r in (0, 1)]
    assert passes == [1, 2] and savers[0] is not None and savers[1] is None
    for ours, theirs in zip(*ranks):
        assert torch.equal(ours.encoder.layers[-1].ffn_omega, theirs.encoder.layers[-1].ffn_omega)
        _assert_equal(ours.state_dict(), theirs.state_dict())

    run = tmp_path / "run"
    run.mkdir()
    (run / PROFILE_FILE).write_text("{}")
    failed: list[torch.Tensor] = []
    with pytest.raises(StoreError, match=f"^{run / PROFILE_FILE}: not an Admin profile"):
        pretrain.admin_profile(cfg, list(pretrain.build_models(cfg)), store, tokenizer, _OtherRank(0, failed),
                               Resume("auto"))
    with pytest.raises(StoreError, match="^Admin init: failed on rank 0"):
        pretrain.admin_profile(cfg, list(pretrain.build_models(cfg)), store, tokenizer, _OtherRank(1, failed),
                               Resume("auto"))
    assert passes == [1, 2]


def test_the_saver_leaves_an_existing_file_alone_and_a_failed_save_only_warns(tiny_data, tmp_path, caplog):
    raw = _valid_profile(tiny_data, tmp_path / "run")
    path = tmp_path / "run" / PROFILE_FILE
    path.write_bytes(b"someone's file")
    saver = pretrain.SaveAdminProfile(path, json.loads(raw))
    saver.save()
    assert path.read_bytes() == b"someone's file"
    gone = pretrain.SaveAdminProfile(tmp_path / "missing" / PROFILE_FILE, json.loads(raw))
    gone.save()
    assert "could not save the profile" in caplog.text and not (tmp_path / "missing").exists()
    write_profile(path, {k: v for k, v in json.loads(raw).items() if k != "sha256"})
    assert path.read_bytes() == raw  # the same bytes from the same record


def _tiny_encoders(profile: str):
    """Two identical small Admin encoders (weights, and ω still at 1)."""
    from megakd.models.encoder import Encoder, EncoderConfig

    config = EncoderConfig(vocab_size=512, hidden_size=64, num_layers=3, num_heads=2, intermediate_size=256,
                           max_position_embeddings=64, init="admin", admin_profile=profile)
    torch.manual_seed(0)
    a, b = Encoder(config), Encoder(config)
    b.load_state_dict(a.state_dict())
    return a, b


def test_profiling_on_another_device_runs_a_copy_and_changes_only_omega(monkeypatch):
    """`device` unlike the model's: the pass runs on a copy (here "cpu:0", which torch does not take for the
    parameters' "cpu", so the CPU checks the path CUDA takes) and gives the model the ω that profiling it in
    place gives, bit for bit (same arithmetic, same dropout masks), without touching another weight."""
    from megakd.models import admin

    copies = []
    real = admin.copy.deepcopy
    monkeypatch.setattr(admin.copy, "deepcopy", lambda x: copies.append(x) or real(x))
    elsewhere, in_place = _tiny_encoders("reference")  # dropout on in the pass
    before = {k: v.clone() for k, v in elsewhere.state_dict().items()}
    ids = torch.randint(5, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    omegas = admin.admin_initialize(elsewhere, ids, torch.ones_like(ids), seed=3, device="cpu:0")
    assert copies == [elsewhere]
    assert omegas == admin.admin_initialize(in_place, ids, torch.ones_like(ids), seed=3) and len(set(omegas)) > 1
    _assert_equal(elsewhere.state_dict(), in_place.state_dict())
    for k, v in elsewhere.state_dict().items():
        assert "omega" in k or torch.equal(v, before[k]), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profiling_on_cuda_leaves_the_cpu_weights_and_gives_the_cpu_omegas():
    """On a GPU only ω come back; the `bert` profile has no dropout, so its ω agree with the CPU's to the
    devices' rounding."""
    from megakd.models.admin import admin_initialize

    on_gpu, on_cpu = _tiny_encoders("bert")
    before = {k: v.clone() for k, v in on_gpu.state_dict().items()}
    ids = torch.randint(5, 512, (4, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    gpu = admin_initialize(on_gpu, ids, mask, device="cuda")
    cpu = admin_initialize(on_cpu, ids, mask)
    assert gpu == pytest.approx(cpu, rel=1e-4) and len(set(gpu)) > 1
    assert [w.item() for layer in on_gpu.layers for w in (layer.attention_omega[0], layer.ffn_omega[0])] == gpu
    for k, v in on_gpu.state_dict().items():
        assert v.device.type == "cpu" and ("omega" in k or torch.equal(v, before[k])), k
