"""The headline recipe's HF export (T5-relative + Admin, remote code) used as HF users use a model.

Token classification and QA heads load through the Auto classes, hidden states and attention maps
come out, `resize_token_embeddings` and gradient checkpointing work, the tokenizer loads quietly the
ways docs/hf.md gives, and one HF `Trainer` step runs on each head. Models are built locally (no hub).
"""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch
from transformers import (
    AutoModel,
    AutoModelForMaskedLM,
    AutoModelForPreTraining,
    AutoModelForQuestionAnswering,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PreTrainedTokenizerFast,
    Trainer,
    TrainingArguments,
)

from megakd.convert import save_hf_model
from megakd.data.tokenizer import Tokenizer
from megakd.models.admin import admin_initialize
from megakd.models.electra import Discriminator, MaskedLM
from megakd.models.encoder import EncoderConfig
from tests.helpers import TINY_VOCAB, mlm_logits, padded_inputs

LOAD = {"trust_remote_code": True, "local_files_only": True}
OFFLINE = {"local_files_only": True}


def _config() -> EncoderConfig:
    return EncoderConfig(vocab_size=TINY_VOCAB, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64,
                         position_encoding="t5_relative", relative_buckets=8, relative_max_distance=20,
                         init="admin", dropout=0.0, attention_dropout=0.0, max_position_embeddings=64)


@pytest.fixture(scope="module")
def exported(tiny_data, tmp_path_factory):
    """(discriminator dir, generator dir, megakd discriminator, megakd generator) with trained-like ω."""
    root = tmp_path_factory.mktemp("remote_heads")
    torch.manual_seed(0)
    disc, gen = Discriminator(_config()).eval(), MaskedLM(_config()).eval()
    for model in (disc, gen):
        admin_initialize(model.encoder, padded_inputs()["input_ids"])
        with torch.no_grad():
            for layer in model.encoder.layers:
                layer.attention_omega.uniform_(0.5, 2.0)
    (root / "disc").mkdir()
    (root / "gen").mkdir()
    save_hf_model(disc, "electra_discriminator", root / "disc", tokenizer_dir=tiny_data[0])
    save_hf_model(gen, "electra_generator", root / "gen", tokenizer_dir=tiny_data[0])
    return root / "disc", root / "gen", disc, gen


def test_token_classification_and_qa_heads_load_on_the_exported_encoder(exported):
    disc_dir, _, disc, _ = exported
    x = padded_inputs()
    with torch.no_grad():
        want = disc.encoder(**x)
    tagger = AutoModelForTokenClassification.from_pretrained(disc_dir, num_labels=5, **LOAD).eval()
    qa = AutoModelForQuestionAnswering.from_pretrained(disc_dir, **LOAD).eval()
    for model in (tagger, qa):
        assert torch.equal(model.encoder.layers[1].attention_omega, disc.encoder.layers[1].attention_omega)
    with torch.no_grad():
        tags = tagger(**x)
        spans = qa(**x, start_positions=torch.tensor([3, 100]), end_positions=torch.tensor([5, 7]))
        hidden = tagger(**x, output_hidden_states=True).hidden_states
    assert tags.logits.shape == (2, 40, 5)
    torch.testing.assert_close(tags.logits, tagger.classifier(want), rtol=0, atol=1e-5)
    assert spans.start_logits.shape == spans.end_logits.shape == (2, 40)
    # QA loss as BertForQuestionAnswering: mean of start/end CE, out-of-range positions (100) ignored
    start = torch.nn.functional.cross_entropy(spans.start_logits[:1].double(), torch.tensor([3]))
    end = torch.nn.functional.cross_entropy(spans.end_logits.double(), torch.tensor([5, 7]))
    assert math.isclose(spans.loss.item(), (start.item() + end.item()) / 2, rel_tol=1e-5)
    assert len(hidden) == 3
    torch.testing.assert_close(hidden[-1], want, rtol=0, atol=1e-5)


def test_hidden_states_and_attentions_match_megakds_layers(exported):
    """Every hidden state is the megakd layer's input/output, and probs·V reproduces its attention."""
    disc_dir, _, disc, _ = exported
    x = padded_inputs()
    hf = AutoModel.from_pretrained(disc_dir, **LOAD).eval()
    with torch.no_grad():
        out = hf(**x, output_hidden_states=True, output_attentions=True)
        h, key_mask, bias = disc.encoder.prepare(**x)
        for i, layer in enumerate(disc.encoder.layers):
            torch.testing.assert_close(out.hidden_states[i], h, rtol=0, atol=1e-5)
            probs = out.attentions[i].double()
            assert probs.shape == (2, 2, 40, 40)
            torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 40, dtype=torch.float64))
            assert probs[0, :, :, 30:].abs().max() == 0  # padding keys get no weight
            att = layer.attention
            v = att.value(h).view(2, 40, 2, 16).transpose(1, 2).double()
            mixed = (probs @ v).transpose(1, 2).reshape(2, 40, 32)
            direct = att(h, key_mask, bias).double()
            torch.testing.assert_close(torch.nn.functional.linear(mixed, att.output.weight.double(),
                                                                  att.output.bias.double()), direct,
                                       rtol=0, atol=1e-5)
            h = layer(h, key_mask, bias)
        torch.testing.assert_close(out.last_hidden_state, h, rtol=0, atol=1e-5)


def test_resize_token_embeddings_keeps_the_tie_and_the_old_logits(exported, tmp_path):
    _, gen_dir, _, gen = exported
    x = padded_inputs()
    hf = AutoModelForMaskedLM.from_pretrained(gen_dir, **LOAD).eval()
    hf.resize_token_embeddings(TINY_VOCAB + 8)
    assert hf.head.decoder_weight.data_ptr() == hf.encoder.embeddings.word_embeddings.weight.data_ptr()
    with torch.no_grad():
        logits = hf(**x).logits
        want = mlm_logits(gen, **x)
    assert logits.shape == (2, 40, TINY_VOCAB + 8) and hf.config.vocab_size == TINY_VOCAB + 8
    torch.testing.assert_close(logits[..., :TINY_VOCAB], want, rtol=0, atol=1e-5)
    hf.save_pretrained(tmp_path)
    again = AutoModelForMaskedLM.from_pretrained(tmp_path, **LOAD).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(**x).logits, logits, rtol=0, atol=1e-6)


def test_gradient_checkpointing_recomputes_layers_and_keeps_gradients(exported):
    disc_dir, _, _, _ = exported
    x = padded_inputs()
    labels = torch.randint(0, 3, (2, 40), generator=torch.Generator().manual_seed(1))

    def grads(checkpointing: bool) -> tuple[dict, int]:
        torch.manual_seed(0)
        model = AutoModelForTokenClassification.from_pretrained(disc_dir, num_labels=3, **LOAD).train()
        if checkpointing:
            model.activation_checkpointing_enable()
            assert model.is_activation_checkpointing
        calls = []
        model.encoder.layers[0].register_forward_pre_hook(lambda *_: calls.append(1))
        for output_hidden_states in (False, True):
            model(**x, labels=labels, output_hidden_states=output_hidden_states).loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters()}, len(calls)

    plain, plain_calls = grads(False)
    ckpt, ckpt_calls = grads(True)
    assert (plain_calls, ckpt_calls) == (2, 4)  # the layer's forward ran again during backward
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=0, atol=1e-6, msg=k)


def test_tokenizers_load_quietly_the_documented_ways(tiny_electra_run, exported, tiny_data, capfd, caplog, recwarn,
                                                     monkeypatch):
    """docs/hf.md's loads, with stdin closed as in a script: a native export's tokenizer through plain AutoTokenizer,
    a remote-code export's through PreTrainedTokenizerFast or AutoTokenizer with trust_remote_code=True, say
    nothing (no prompt, no model-type warning) and give megakd's ids; the model loads with trust_remote_code=True.
    Plain AutoTokenizer on the remote-code export asks, as docs/hf.md says: transformers reads config.json first."""
    monkeypatch.setattr("sys.stdin", io.StringIO())
    # transformers' own handler writes to the stderr of import time, which capfd does not see: read its records.
    monkeypatch.setattr(logging.getLogger("transformers"), "handlers", [caplog.handler])

    def said() -> list[str]:
        out, err = capfd.readouterr()
        text = [out, err, *(r.getMessage() for r in caplog.records), *(str(w.message) for w in recwarn)]
        caplog.clear()
        recwarn.clear()
        return [line for line in text if line]

    text = "It is a truth universally acknowledged."
    want = [1, *Tokenizer.load(tiny_data[0]).encode(text), 2]
    native, remote = tiny_electra_run / "hf" / "discriminator", exported[0]
    said()
    for load in (lambda: AutoTokenizer.from_pretrained(native, **OFFLINE),
                 lambda: PreTrainedTokenizerFast.from_pretrained(remote, **OFFLINE),
                 lambda: AutoTokenizer.from_pretrained(remote, trust_remote_code=True, **OFFLINE)):
        assert load()(text)["input_ids"] == want
        assert said() == []
    assert type(AutoModelForPreTraining.from_pretrained(remote, **LOAD)).__name__ == "MegakdForPreTraining"
    said()
    assert AutoTokenizer.from_pretrained(remote, **OFFLINE)(text)["input_ids"] == want
    assert "Do you wish to run the custom code?" in said()[0]


class _Rows(torch.utils.data.Dataset):
    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


@pytest.mark.parametrize("head", ["token_classification", "question_answering"])
def test_one_hf_trainer_step_on_each_head(exported, tmp_path, head):
    """Trainer's logged loss is the head's loss on the batch, and the step moves the weights."""
    disc_dir, _, _, _ = exported
    x = padded_inputs()
    if head == "token_classification":
        model = AutoModelForTokenClassification.from_pretrained(disc_dir, num_labels=3, **LOAD)
        targets = {"labels": torch.randint(0, 3, (2, 40), generator=torch.Generator().manual_seed(2))}
        targets["labels"][0, 30:] = -100
        weight = model.classifier.weight
    else:
        model = AutoModelForQuestionAnswering.from_pretrained(disc_dir, **LOAD)
        targets = {"start_positions": torch.tensor([3, 9]), "end_positions": torch.tensor([6, 12])}
        weight = model.qa_outputs.weight
    rows = [{k: v[i] for k, v in {**x, **targets}.items()} for i in range(2)]
    with torch.no_grad():
        want = model(**x, **targets).loss.item()  # dropout is 0: train mode computes the same
    before = weight.detach().clone()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2,
                             learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                             logging_steps=1, disable_tqdm=True)
    result = Trainer(model=model, args=args, train_dataset=_Rows(rows)).train()
    assert math.isclose(result.training_loss, want, rel_tol=1e-5)
    assert not torch.equal(weight.detach(), before)
