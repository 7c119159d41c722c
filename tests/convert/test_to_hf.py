"""Checkpoints from real (tiny) training runs → HF directories: logits, tokenizer, fine-tuning, CLI."""

from __future__ import annotations

import csv
import gzip
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import (
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertForMaskedLM,
    ElectraForMaskedLM,
    ElectraForPreTraining,
)

from megakd.cli import main
from megakd.convert import ConversionError, export_run, to_hf
from megakd.data.default_corpus import CORPUS_DIR
from megakd.data.tokenizer import Tokenizer
from megakd.store.checkpoint import write_manifest
from megakd.store.checkpoint_models import load_checkpoint, resolve_checkpoint
from tests.helpers import TINY_SEQ_LEN, TINY_VOCAB, mlm_logits, tiny_overrides

CONFIG = Path(__file__).parents[2] / "configs" / "electra-tiny.yaml"
ATOL = 1e-5


def _train(tiny_data, run_dir: Path, **extra) -> Path:
    assert main(["pretrain", "-c", str(CONFIG), *tiny_overrides(tiny_data, run_dir, **{"train.max_steps": 2},
                                                                **extra)]) == 0
    return run_dir


@pytest.fixture(scope="module")
def electra_run(tiny_data, tmp_path_factory):
    return _train(tiny_data, tmp_path_factory.mktemp("runs") / "electra")


@pytest.fixture(scope="module")
def mlm_run(tiny_data, tmp_path_factory):
    return _train(tiny_data, tmp_path_factory.mktemp("runs") / "mlm", **{"model.objective": "mlm"})


def _inputs(seed: int = 0, batch: int = 3, length: int = 24) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, TINY_VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[1, length // 2:] = 0  # padded row: masked keys must not change the real tokens' outputs
    ids[1, length // 2:] = 0
    types = torch.zeros(batch, length, dtype=torch.long)
    types[:, length // 3:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _close(hf_logits: torch.Tensor, ours: torch.Tensor, mask: torch.Tensor) -> float:
    diff = (hf_logits - ours)[mask.bool()].abs().max().item()
    assert diff <= ATOL, diff
    return diff


def test_electra_run_exports_native_classes_with_equal_logits(electra_run, tmp_path):
    out = tmp_path / "hf"
    assert to_hf(electra_run, out) == {"discriminator": "ElectraForPreTraining", "generator": "ElectraForMaskedLM"}
    ckpt = load_checkpoint(resolve_checkpoint(electra_run))
    x = _inputs()
    disc = AutoModelForPreTraining.from_pretrained(out / "discriminator", local_files_only=True).eval()
    gen = AutoModelForMaskedLM.from_pretrained(out / "generator", local_files_only=True).eval()
    assert isinstance(disc, ElectraForPreTraining) and isinstance(gen, ElectraForMaskedLM)
    with torch.no_grad():
        _close(disc(**x).logits, ckpt.discriminator.rtd_logits(ckpt.discriminator(**x)), x["attention_mask"])
        _close(gen(**x).logits, mlm_logits(ckpt.generator, **x), x["attention_mask"])
    # the weights really are the trained ones (2 steps moved them away from the seeded init)
    trained = load_file(resolve_checkpoint(electra_run) / "discriminator.safetensors")
    assert torch.equal(disc.discriminator_predictions.dense.weight, trained["head.dense.weight"])


def test_mlm_run_exports_bert_into_out_itself(mlm_run, tmp_path):
    out = tmp_path / "hf"
    assert main(["convert", "to-hf", str(mlm_run), str(out)]) == 0
    assert (out / "config.json").is_file() and not (out / "generator").exists()
    ckpt = load_checkpoint(resolve_checkpoint(mlm_run))
    bert = AutoModelForMaskedLM.from_pretrained(out, local_files_only=True).eval()
    assert isinstance(bert, BertForMaskedLM)
    x = _inputs(seed=1)
    with torch.no_grad():
        _close(bert(**x).logits, mlm_logits(ckpt.generator, **x), x["attention_mask"])


def _corpus_sentences() -> list[str]:
    lines: list[str] = []
    for name in ("austen.jsonl.gz", "kjv.jsonl.gz"):
        with gzip.open(CORPUS_DIR / name, "rt", encoding="utf-8") as f:
            for i, row in enumerate(f):
                if i % 7 == 0:  # every 7th document keeps the test fast and still covers both books
                    lines += json.loads(row)["text"].split("\n")
    with gzip.open(CORPUS_DIR / "rt_sentences.tsv.gz", "rt", encoding="utf-8") as f:
        lines += [row["sentence"] for row in csv.DictReader(f, delimiter="\t")]
    return lines


EDGE_CASES = [
    "", " ", "  leading and   inner  spaces\t\ttabs\nnewlines\r\n ", "Digits 0123456789, 3.14159 and 1,000,000!",
    "Ça va? Naïve café — “quotes” ‘single’ … «guillemets»", "ﬁligree ½ Ⅻ ㎏ ²", "日本語のテキスト and 中文",
    "emoji 😀 👨\u200d👩\u200d👧 🏳️\u200d🌈", "decomposed e\u0301 and precomposed é", "nbsp\u00a0and\u3000ideographic",
    "zero\u200bwidth", "ctrl\x00\x01\x7f bytes", "next-line\u0085kept", "`~!@#$%^&*()_+-=[]{}|;':\",./<>?",
]


def test_exported_tokenizer_encodes_like_megakd(electra_run, tmp_path):
    out = tmp_path / "hf"
    to_hf(electra_run, out)
    ours = Tokenizer.load(resolve_checkpoint(electra_run) / "tokenizer")
    hf = AutoTokenizer.from_pretrained(out / "discriminator", local_files_only=True)
    assert hf("The")["input_ids"] != hf("the")["input_ids"]  # cased, as megakd's tokenizer
    assert (hf.pad_token_id, hf.cls_token_id, hf.sep_token_id, hf.unk_token_id, hf.mask_token_id) == (0, 1, 2, 3, 4)
    sentences = _corpus_sentences() + EDGE_CASES
    assert len(sentences) > 10_000
    ids = hf(sentences)["input_ids"]
    mismatches = [s for s, got in zip(sentences, ids) if got != [1, *ours.encode(s), 2]]
    assert not mismatches, mismatches[:3]
    pair = hf("First part.", "Second part.")
    assert pair["input_ids"] == [1, *ours.encode("First part."), 2, *ours.encode("Second part."), 2]
    assert pair["token_type_ids"] == [0] * (len(ours.encode("First part.")) + 2) + [1] * (
        len(ours.encode("Second part.")) + 1)
    assert hf.decode(hf("It is a truth universally acknowledged.")["input_ids"], skip_special_tokens=True) == \
        "It is a truth universally acknowledged."


def test_exported_discriminator_fine_tunes(electra_run, tmp_path):
    out = tmp_path / "hf"
    to_hf(electra_run, out)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(out / "discriminator", num_labels=2,
                                                               local_files_only=True)
    tok = AutoTokenizer.from_pretrained(out / "discriminator", local_files_only=True)
    with gzip.open(CORPUS_DIR / "rt_sentences.tsv.gz", "rt", encoding="utf-8") as f:
        rows = [r for _, r in zip(range(8), csv.DictReader(f, delimiter="\t"))]
    batch = tok([r["sentence"] for r in rows], padding=True, truncation=True, max_length=TINY_SEQ_LEN,
                return_tensors="pt")
    labels = torch.tensor([int(r["label"]) for r in rows])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    losses = []
    for _ in range(12):
        loss = model(**batch, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.85 * losses[0], losses  # 0.70 → 0.52 measured


def test_cli_refuses_non_empty_out_unless_forced(electra_run, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["convert", "to-hf", str(electra_run), str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "not empty" in err and "--force" in err and len(err.splitlines()) == 1
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["convert", "to-hf", str(electra_run), str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "discriminator" / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]  # no temp dirs left behind


def test_export_run_writes_run_dir_hf_and_replaces_it(electra_run):
    assert export_run(electra_run) == electra_run / "hf"
    first = (electra_run / "hf" / "generator" / "model.safetensors").stat().st_mtime_ns
    export_run(electra_run)  # a resumed run exports again over its previous export
    assert (electra_run / "hf" / "generator" / "model.safetensors").stat().st_mtime_ns >= first
    shutil.rmtree(electra_run / "hf")


def test_checkpoint_config_that_does_not_match_weights(electra_run, tmp_path):
    step = tmp_path / "step_00000002"
    shutil.copytree(resolve_checkpoint(electra_run), step)
    text = (step / "config.yaml").read_text()
    import yaml

    cfg = yaml.safe_load(text)
    cfg["model"]["discriminator"]["intermediate_size"] *= 2
    (step / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    write_manifest(step, 2)  # a consistent checkpoint whose config does not describe its weights
    with pytest.raises(ConversionError, match=r"discriminator\.safetensors: "
                                              r"'encoder\.layers\.0\.ffn\.fc_in\.weight' has "
                                              r"shape \[192, 48\] but .*config\.yaml \(model\.discriminator\) "
                                              r"expects \[384, 48\]"):
        to_hf(step, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_unit_corrupt_unit_and_not_a_checkpoint(electra_run, tmp_path):
    step = tmp_path / "step_00000002"
    shutil.copytree(resolve_checkpoint(electra_run), step)
    (step / "discriminator.safetensors").unlink()
    with pytest.raises(ConversionError, match=r"discriminator\.safetensors: missing \(listed in .*manifest\.json\)"):
        to_hf(step, tmp_path / "out")
    write_manifest(step, 2)
    with pytest.raises(ConversionError,
                       match=r"no state for unit 'discriminator' \(expected discriminator\.safetensors"):
        to_hf(step, tmp_path / "out")
    (step / "discriminator.safetensors").write_bytes(b"not a safetensors file")
    write_manifest(step, 2)
    with pytest.raises(ConversionError, match=r"discriminator\.safetensors: cannot read as safetensors"):
        to_hf(step, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="not a megakd run directory"):
        to_hf(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConversionError, match="no complete checkpoint"):
        to_hf(tmp_path / "run", tmp_path / "out")
    assert not (tmp_path / "out").exists()
