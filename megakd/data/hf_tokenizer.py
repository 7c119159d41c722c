"""HuggingFace tokenizers from megakd's: `build_hf_tokenizer` / `write_hf_tokenizer` turn megakd's
SentencePiece model into an HF fast tokenizer for exports. (Reading a user's HF tokenizer directory
is `megakd.data.tokenizer.HFTokenizer`, beside the other kind; this module imports nothing of it.)

megakd's SentencePiece BPE model → a HuggingFace fast tokenizer that encodes exactly like it.

Why not `DebertaV2Tokenizer(vocab_file=spm.model)`: in transformers 5 that class always rebuilds a
*Unigram* model without byte fallback from the vocabulary, whatever the `.model` file says, so our
BPE model with byte fallback would tokenize differently (different segmentation, [UNK] where
megakd emits byte pieces). Instead `tokenizer.json` is built here with `tokenizers`, reproducing
SentencePiece step by step, and `tokenizer_config.json` names the generic fast tokenizer class so
`AutoTokenizer` loads that file as is (transformers 4 and 5 alike):

- normalizer: the model's own precompiled `nmt_nfkc` charsmap, then SentencePiece's
  `remove_extra_whitespaces` (strip both ends, collapse runs of spaces);
- pre-tokenizer: Metaspace with a dummy prefix (spaces become ▁, words are split at ▁, as
  SentencePiece never merges across whitespace);
- model: BPE over the same ids, merges ranked by the merged piece's score (SentencePiece BPE
  merges the adjacent pair whose result scores highest), byte fallback to `<0xNN>` pieces;
- post-processor: `[CLS] A [SEP]` and `[CLS] A [SEP] B [SEP]` (token types 0/1).

Measured: identical ids on every line of the bundled corpus (Austen, KJV, review sentences) and
on 20,000 random strings over Latin, general-punctuation, CJK-space and control characters except
~0.3% of them, all holding a zero-width joiner/non-joiner or combining mark right after a
character the charsmap rewrites (e.g. "ǆ\u200d"): HF's Precompiled normalizer works on whole
grapheme clusters where SentencePiece works on characters. Emoji ZWJ sequences and decomposed
accents ("e\u0301") match.

One intended difference: HF matches the special tokens ("[MASK]", "[CLS]", ...) in raw text, so the
fill-mask pipeline works; megakd treats such literal text as ordinary characters.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2 as spm_pb2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from megakd.errors import UserError

log = logging.getLogger(__name__)

SPECIAL_TOKENS = {"pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]",
                  "mask_token": "[MASK]"}
_NORMAL, _UNKNOWN, _CONTROL, _BYTE = 1, 2, 3, 6  # sentencepiece ModelProto.SentencePiece.Type


def _read_proto(spm_model: Path) -> spm_pb2.ModelProto:
    proto = spm_pb2.ModelProto()
    try:
        proto.ParseFromString(spm_model.read_bytes())
    except Exception as err:  # protobuf raises DecodeError with no file name
        raise UserError(f"{spm_model}: not a SentencePiece model ({err})") from None
    return proto


def _check_supported(proto: spm_pb2.ModelProto, spm_model: Path) -> None:
    """Refuse SentencePiece options this conversion does not reproduce, rather than differ silently."""
    ns, ts = proto.normalizer_spec, proto.trainer_spec
    expected = {
        "trainer_spec.model_type": (ts.model_type, 2),  # BPE
        "normalizer_spec.add_dummy_prefix": (ns.add_dummy_prefix, True),
        "normalizer_spec.remove_extra_whitespaces": (ns.remove_extra_whitespaces, True),
        "normalizer_spec.escape_whitespaces": (ns.escape_whitespaces, True),
        "trainer_spec.treat_whitespace_as_suffix": (ts.treat_whitespace_as_suffix, False),
    }
    for key, (value, want) in expected.items():
        if value != want:
            raise UserError(f"{spm_model}: {key}={value!r}, expected {want!r} (megakd's tokenizer layout)")
    pieces = [p.piece for p in proto.pieces[:5]]
    if pieces != list(SPECIAL_TOKENS.values())[:3] + ["[UNK]", "[MASK]"]:
        raise UserError(f"{spm_model}: first pieces {pieces}, expected [PAD] [CLS] [SEP] [UNK] [MASK]")


def _bpe_merges(proto: spm_pb2.ModelProto) -> list[tuple[str, str]]:
    """Every split of every normal piece into two vocabulary pieces, ranked by the piece's score.

    SentencePiece BPE scores are strictly decreasing with the piece id, so the id is the rank.
    """
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges: list[tuple[int, int, int, str, str]] = []
    for i, piece in enumerate(proto.pieces):
        if piece.type != _NORMAL or len(piece.piece) < 2:
            continue
        text = piece.piece
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                merges.append((i, vocab[left], vocab[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


def build_hf_tokenizer(spm_model: str | Path) -> Tokenizer:
    """A `tokenizers.Tokenizer` whose ids equal SentencePiece's for any text (see the module docstring)."""
    spm_model = Path(spm_model)
    proto = _read_proto(spm_model)
    _check_supported(proto, spm_model)
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tok = Tokenizer(BPE(vocab=vocab, merges=_bpe_merges(proto), unk_token="[UNK]", fuse_unk=True,
                        byte_fallback=proto.trainer_spec.byte_fallback))
    steps = []
    if proto.normalizer_spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    # SentencePiece strips and collapses only U+0020 (after the charsmap turned other spaces into it);
    # normalizers.Strip would also remove e.g. U+0085, which SentencePiece keeps as byte pieces.
    steps += [normalizers.Replace(Regex("^ +| +$"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.add_special_tokens([AddedToken(p.piece, special=True, normalized=False)
                            for p in proto.pieces if p.type in (_CONTROL, _UNKNOWN)])
    cls, sep = vocab["[CLS]"], vocab["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)],
    )
    return tok


def write_hf_tokenizer(spm_model: str | Path, out_dir: str | Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (plus spm.model) into out_dir.

    `spm.model` is kept beside them so `megakd convert from-hf` can restore a megakd tokenizer dir.
    """
    spm_model, out = Path(spm_model), Path(out_dir)
    build_hf_tokenizer(spm_model).save(str(out / "tokenizer.json"))
    (out / "spm.model").write_bytes(spm_model.read_bytes())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "do_lower_case": False,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "token_type_ids", "attention_mask"],
        **SPECIAL_TOKENS,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(SPECIAL_TOKENS, indent=2) + "\n")
