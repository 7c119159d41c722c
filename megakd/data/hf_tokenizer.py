"""HuggingFace tokenizers in megakd, both ways.

`HFTokenizer` reads a user's HF tokenizer directory (a WordPiece `vocab.txt`, or any
`tokenizer.json`) so a released model keeps its own tokenizer; `build_hf_tokenizer` /
`write_hf_tokenizer` turn megakd's SentencePiece model into an HF fast tokenizer for exports.

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

import hashlib
import json
import logging
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2 as spm_pb2
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from megakd.data import tokenizer as megakd_tokenizer
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


# -- a user's HF tokenizer directory --------------------------------------------------------------

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                      "added_tokens.json")
ROLES = ("pad", "cls", "sep", "unk", "mask")
REQUIRED_ROLES = ("pad", "cls", "sep", "mask")
# Only for a bare tokenizer.json, whose format has no roles: the tokenizer's own special tokens are
# matched by these conventional names (BERT's and RoBERTa's).
CONVENTIONAL_NAMES = {"pad": ("[PAD]", "<pad>"), "cls": ("[CLS]", "<s>", "<cls>"), "sep": ("[SEP]", "</s>", "<sep>"),
                      "unk": ("[UNK]", "<unk>"), "mask": ("[MASK]", "<mask>")}


class HFTokenizer(megakd_tokenizer.Tokenizer):
    """An HF tokenizer directory, loaded locally by transformers (never the hub, never remote code).

    `tokenizer.json` is read with the generic fast-tokenizer class, a `vocab.txt` alone as BERT
    WordPiece (`tokenizer_config.json` may set `do_lower_case` and the special tokens). The special
    layout is the tokenizer's own: the roles named in `tokenizer_config.json` /
    `special_tokens_map.json`, or, for a bare `tokenizer.json`, its special tokens with the
    conventional names of `CONVENTIONAL_NAMES`. pad, cls, sep and mask are required (unk is not:
    byte-level BPE has none). Encoding treats literal special-token text ("[MASK]") as ordinary
    text, as megakd's SentencePiece model does, so a corpus can never inject a special id.
    """

    kind = "hf"
    FILES = HF_TOKENIZER_FILES

    @staticmethod
    def found_in(path: Path) -> bool:
        return (path / "tokenizer.json").is_file() or (path / "vocab.txt").is_file()

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.hf = _load_transformers_tokenizer(self.path)
        self._encoder = Tokenizer.from_str(self.hf.backend_tokenizer.to_str())
        self._encoder.no_truncation()
        self._encoder.no_padding()
        self._encoder.encode_special_tokens = True
        self.vocab_size = max(self._encoder.get_vocab(with_added_tokens=True).values()) + 1
        ids = self._special_ids(_file_vocabulary(self.path))
        self.pad_id, self.cls_id, self.sep_id, self.unk_id, self.mask_id = (ids[r] for r in ROLES)
        declared = {i for i, token in self.hf.added_tokens_decoder.items() if token.special}
        self.special_ids = frozenset({i for i in ids.values() if i is not None} | declared)
        self.vocab_hash = self._hash(ids)

    def _special_ids(self, vocab: dict[str, int]) -> dict[str, int | None]:
        """Role → id. `vocab` is the vocabulary as the files hold it: transformers appends a declared
        special token missing from it as a new id, which no model trained on the vocabulary has."""
        special_tokens = {t.content for t in self.hf.added_tokens_decoder.values() if t.special}
        ids: dict[str, int | None] = {}
        for role in ROLES:
            token = getattr(self.hf, f"{role}_token", None)
            if token is None:
                named = [n for n in CONVENTIONAL_NAMES[role] if n in special_tokens]
                token = named[0] if named else None
            if token is not None and str(token) not in vocab:
                raise UserError(f"tokenizer {self.path}: {role}_token {str(token)!r} is not in its vocabulary "
                                f"({_vocabulary_file(self.path)})")
            ids[role] = vocab[str(token)] if token is not None else None
        missing = [r for r in REQUIRED_ROLES if ids[r] is None]
        if missing:
            raise UserError(f"tokenizer {self.path}: no {', '.join(f'{r}_token' for r in missing)} (megakd needs "
                            f"pad, cls, sep and mask tokens; name them in tokenizer_config.json or "
                            f"special_tokens_map.json)")
        required = [ids[r] for r in REQUIRED_ROLES]
        if len(set(required)) < len(required):
            raise UserError(f"tokenizer {self.path}: pad, cls, sep and mask must be four different tokens, got ids "
                            f"{dict(zip(REQUIRED_ROLES, required))}")
        return ids

    def _hash(self, ids: dict[str, int | None]) -> str:
        """Everything that decides the ids of a text: model (vocab, merges), normalizer, pre-tokenizer,
        added tokens, and the special roles; not padding, truncation, post-processing or decoding."""
        spec = json.loads(self._encoder.to_str())
        identity = {key: spec.get(key) for key in ("model", "normalizer", "pre_tokenizer")}
        identity["added_tokens"] = sorted((t["id"], t["content"], t["special"]) for t in spec.get("added_tokens", []))
        identity["roles"] = ids
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._encoder.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode([int(i) for i in ids])

    def to_hf(self):
        return self.hf

    def save_hf(self, out_dir: str | Path, model_max_length: int) -> None:
        self.hf.model_max_length = model_max_length
        self.hf.save_pretrained(str(out_dir))


def _vocabulary_file(path: Path) -> str:
    return "tokenizer.json" if (path / "tokenizer.json").is_file() else "vocab.txt"


def _file_vocabulary(path: Path) -> dict[str, int]:
    """token → id as the tokenizer's own file defines it (tokenizer.json with its added tokens, or vocab.txt)."""
    if (path / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)
    with open(path / "vocab.txt", encoding="utf-8") as f:  # as transformers reads it: one token per "\n" line
        return {line.rstrip("\n"): i for i, line in enumerate(f)}


def _load_transformers_tokenizer(path: Path):
    from transformers import BertTokenizer, PreTrainedTokenizerFast

    cls = PreTrainedTokenizerFast if (path / "tokenizer.json").is_file() else BertTokenizer
    try:
        return cls.from_pretrained(str(path), local_files_only=True)
    except Exception as err:  # transformers raises many types (OSError, ValueError, JSON, Rust exceptions)
        text = str(err).strip().splitlines()
        raise UserError(f"tokenizer {path}: cannot load it as an HF tokenizer "
                        f"({text[0][:200] if text else type(err).__name__})") from None
