"""Tokenizers: megakd's own SentencePiece BPE model, or a user's HuggingFace tokenizer directory.

`Tokenizer.load(DIR)` reads either kind; the rest of megakd (shards, masking, models, fine-tuning,
exports) sees only the interface below: token ids without specials, the special-token layout
(pad, cls, sep, unk, mask ids, every special id), `vocab_size` and `vocab_hash`, the identity that
shards, checkpoints, teachers and students are compared by.

megakd's own model (`megakd data tokenizer`) is cased SentencePiece BPE whose ids
``[PAD]=0, [CLS]=1, [SEP]=2, [UNK]=3, [MASK]=4`` match DeBERTa-v3's ``spm.model`` so that
HF ``DebertaV2Tokenizer(vocab_file=.../spm.model)`` reads our model with the same special ids.
``[MASK]`` is a control symbol: the literal text "[MASK]" in a corpus is tokenized as ordinary
characters, never as the mask id. An HF tokenizer directory (WordPiece `vocab.txt` or any
`tokenizer.json`) brings its own layout: see `HFTokenizer`.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import sentencepiece as spm
from tokenizers import Tokenizer as FastTokenizer

from megakd.data.sources import expand_inputs, iter_documents
from megakd.errors import UserError
from megakd.fsutil import atomic_output_dir

logger = logging.getLogger(__name__)

MODEL_FILE = "spm.model"
VOCAB_FILE = "spm.vocab"
# Not "tokenizer.json": HF AutoTokenizer would take that name for a fast-tokenizer file.
META_FILE = "megakd_tokenizer.json"
META_FORMAT = "megakd-tokenizer/1"
SPECIALS = {"pad": "[PAD]", "cls": "[CLS]", "sep": "[SEP]", "unk": "[UNK]", "mask": "[MASK]"}
# SentencePiece skips training sentences longer than max_sentence_length bytes; cut long lines below it.
_MAX_LINE_CHARS = 2000


def _training_lines(inputs: list[str | Path]) -> Iterator[str]:
    for source in expand_inputs(inputs):
        for doc in iter_documents(source):
            for line in doc.split("\n"):
                line = line.strip()
                while len(line) > _MAX_LINE_CHARS:
                    cut = line.rfind(" ", 0, _MAX_LINE_CHARS)
                    cut = cut if cut > 0 else _MAX_LINE_CHARS
                    yield line[:cut]
                    line = line[cut:].lstrip()
                if line:
                    yield line


def _vocab_hash(sp: spm.SentencePieceProcessor) -> str:
    h = hashlib.sha256()
    for i in range(sp.get_piece_size()):
        h.update(f"{i}\t{sp.id_to_piece(i)}\t{sp.get_score(i)!r}\t{int(sp.is_control(i))}\n".encode())
    return h.hexdigest()[:16]


class Tokenizer:
    """What megakd relies on in a tokenizer; `Tokenizer.load(DIR)` returns the kind DIR holds."""

    kind: str  # "sentencepiece" | "hf"
    path: Path
    vocab_size: int  # every id is below it
    vocab_hash: str  # identity: equal hashes encode every text to the same ids with the same specials
    pad_id: int
    cls_id: int
    sep_id: int
    unk_id: int | None
    mask_id: int
    special_ids: frozenset[int]  # never masked, never a prediction target
    FILES: tuple[str, ...] = ()  # the files that make up the tokenizer (copied into checkpoints and exports)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        """The tokenizer in `path`: megakd's `spm.model`, else an HF `tokenizer.json` or WordPiece `vocab.txt`.

        A directory holding both an `spm.model` that is not megakd's layout and HF files (e.g. an HF
        DeBERTa-v3 export) is read as the HF tokenizer.
        """
        path = Path(path)
        if not path.is_dir():
            raise UserError(f"tokenizer {path}: no such directory (expected a megakd tokenizer with {MODEL_FILE}, "
                            "or an HF tokenizer with tokenizer.json or vocab.txt)")
        has_hf = HFTokenizer.found_in(path)
        if (path / MODEL_FILE).is_file():
            try:
                return SentencePieceTokenizer(path)
            except UserError:
                if not has_hf:
                    raise
        if has_hf:
            return HFTokenizer(path)
        raise UserError(f"tokenizer {path}: no {MODEL_FILE}, tokenizer.json or vocab.txt (expected a directory "
                        "from `megakd data tokenizer` or an HF tokenizer directory)")

    def encode(self, text: str) -> list[int]:
        """Token ids without [CLS]/[SEP]; literal special-token text is ordinary text."""
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def to_hf(self):
        """The same tokenizer as a transformers tokenizer (``save_pretrained`` it for AutoTokenizer)."""
        raise NotImplementedError

    def save_hf(self, out_dir: str | Path, model_max_length: int) -> None:
        """Write the files `AutoTokenizer.from_pretrained(out_dir)` loads this tokenizer from."""
        raise NotImplementedError

    def copy_to(self, out_dir: str | Path) -> Path:
        """Copy the tokenizer's own files (nothing else that shares its directory) into `out_dir`."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for name in self.FILES:
            if (self.path / name).is_file():
                shutil.copyfile(self.path / name, out / name)
        return out

    def describe(self) -> str:
        """One phrase naming the tokenizer for error messages: kind, place, size and hash."""
        return f"{self.kind} tokenizer {self.path} ({self.vocab_size} ids, vocab hash {self.vocab_hash})"

    def special_layout(self) -> dict[str, int | None]:
        return {"pad_id": self.pad_id, "cls_id": self.cls_id, "sep_id": self.sep_id, "unk_id": self.unk_id,
                "mask_id": self.mask_id}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({str(self.path)!r}, vocab_size={self.vocab_size}, "
                f"vocab_hash={self.vocab_hash!r})")


def copy_tokenizer(src_dir: str | Path, out_dir: str | Path) -> Path:
    """Copy the tokenizer files of `src_dir` (of either kind) into `out_dir`, e.g. into a checkpoint."""
    return Tokenizer.load(src_dir).copy_to(out_dir)


class SentencePieceTokenizer(Tokenizer):
    """A trained megakd SentencePiece model plus the ids the rest of megakd relies on."""

    kind = "sentencepiece"
    FILES = (MODEL_FILE, VOCAB_FILE, META_FILE)

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        model = self.path / MODEL_FILE
        if not model.is_file():
            raise FileNotFoundError(f"tokenizer {self.path}: missing {MODEL_FILE}")
        try:
            self.sp = spm.SentencePieceProcessor(model_file=str(model))
        except (RuntimeError, OSError) as err:
            raise UserError(f"tokenizer {model}: not a SentencePiece model ({_first_line(err)})") from None
        self.vocab_size: int = self.sp.get_piece_size()
        ids = {k: self.sp.piece_to_id(p) for k, p in SPECIALS.items()}
        expected = {"pad": 0, "cls": 1, "sep": 2, "unk": 3, "mask": 4}
        if ids != expected or self.sp.id_to_piece(4) != SPECIALS["mask"]:
            raise UserError(f"tokenizer {model}: special ids {ids}, expected {expected}")
        self.pad_id, self.cls_id, self.sep_id, self.unk_id, self.mask_id = (ids[k] for k in expected)
        self.special_ids: frozenset[int] = frozenset(ids.values())
        self.vocab_hash: str = _vocab_hash(self.sp)
        meta = self.path / META_FILE
        if meta.is_file():
            try:
                stored = json.loads(meta.read_text(encoding="utf-8")).get("vocab_hash")
            except (ValueError, AttributeError):  # invalid JSON or UTF-8, or not an object
                raise UserError(f"tokenizer {meta}: expected a JSON object with a vocab_hash") from None
            if stored != self.vocab_hash:
                raise UserError(f"tokenizer {meta}: vocab_hash {stored} does not match {model} ({self.vocab_hash})")

    def encode(self, text: str) -> list[int]:
        """Token ids without [CLS]/[SEP]."""
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int)

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def to_hf(self):
        """The same tokenizer as a HF ``PreTrainedTokenizerFast`` (``save_pretrained`` it for AutoTokenizer).

        Built offline from ``spm.model`` by :func:`megakd.data.hf_tokenizer.build_hf_tokenizer`,
        which reproduces SentencePiece step by step (see there for what was measured).
        """
        from transformers import PreTrainedTokenizerFast

        from megakd.data.hf_tokenizer import build_hf_tokenizer

        return PreTrainedTokenizerFast(
            tokenizer_object=build_hf_tokenizer(self.path / MODEL_FILE), pad_token=SPECIALS["pad"],
            cls_token=SPECIALS["cls"], sep_token=SPECIALS["sep"], unk_token=SPECIALS["unk"],
            mask_token=SPECIALS["mask"], model_max_length=1_000_000)

    def save_hf(self, out_dir: str | Path, model_max_length: int) -> None:
        from megakd.data.hf_tokenizer import write_hf_tokenizer

        write_hf_tokenizer(self.path / MODEL_FILE, out_dir, model_max_length)


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _train_spm(sources: list[str], vocab_size: int, **options) -> None:
    """`SentencePieceTrainer.train`, with its corpus errors (raised as RuntimeError "INTERNAL")
    turned into one-line errors naming the inputs."""
    try:
        spm.SentencePieceTrainer.train(vocab_size=vocab_size, **options)
    except RuntimeError as err:
        text = str(err)
        if "sentences_.empty()" in text:
            raise UserError(f"inputs {sources}: no text to train a tokenizer on (empty corpus)") from None
        if too_high := re.search(r"Vocabulary size too high \((\d+)\)\. Please set it to a value <= (\d+)", text):
            raise UserError(f"--vocab-size {too_high[1]}: too large for inputs {sources}, which support at most "
                            f"{too_high[2]} pieces (give more text or a smaller vocabulary)") from None
        raise


def train_tokenizer(
    inputs: list[str | Path],
    vocab_size: int,
    out_dir: str | Path,
    *,
    input_sentence_size: int = 2_000_000,
    seed: int = 0,
    num_threads: int = 2,
) -> Tokenizer:
    """Train a cased BPE model on lines sampled from ``inputs``.

    Text is streamed (sentencepiece keeps a reservoir sample of ``input_sentence_size`` lines), so
    the corpus never has to fit in memory. Same inputs and settings give the same vocab_hash.
    The directory is written under a temporary name and renamed, so it is complete or absent.
    """
    out = Path(out_dir)
    if vocab_size < 300:
        raise UserError(f"vocab_size={vocab_size}: expected at least 300 (256 byte-fallback pieces + specials)")
    sources = [str(p) for p in expand_inputs(inputs)]
    with atomic_output_dir(out) as tmp:
        spm.set_random_generator_seed(seed)
        # model_writer instead of model_prefix: the prefix (a temp path) would be stored in the
        # model and make identical trainings differ byte-wise.
        model = io.BytesIO()
        _train_spm(
            sources, vocab_size,
            sentence_iterator=_training_lines(inputs),
            model_writer=model,
            model_type="bpe",
            character_coverage=0.9999,
            byte_fallback=True,
            split_digits=True,
            input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True,
            num_threads=num_threads,
            pad_id=0, pad_piece=SPECIALS["pad"],
            bos_id=1, bos_piece=SPECIALS["cls"],
            eos_id=2, eos_piece=SPECIALS["sep"],
            unk_id=3, unk_piece=SPECIALS["unk"],
            control_symbols=[SPECIALS["mask"]],
            minloglevel=2,
        )
        (tmp / MODEL_FILE).write_bytes(model.getvalue())
        tok = SentencePieceTokenizer(tmp)
        (tmp / VOCAB_FILE).write_text(
            "".join(f"{tok.sp.id_to_piece(i)}\t{tok.sp.get_score(i):g}\n" for i in range(tok.vocab_size)),
            encoding="utf-8")
        meta = {
            "format": META_FORMAT,
            "model_type": "bpe",
            "cased": True,
            "vocab_size": tok.vocab_size,
            "vocab_hash": tok.vocab_hash,
            "special_ids": {k: tok.sp.piece_to_id(p) for k, p in SPECIALS.items()},
            "special_tokens": SPECIALS,
            "training": {"input_sentence_size": input_sentence_size, "seed": seed, "sources": sources},
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    logger.info("trained tokenizer %s: vocab %d, hash %s", out, tok.vocab_size, tok.vocab_hash)
    return SentencePieceTokenizer(out)

# -- a user's HF tokenizer directory --------------------------------------------------------------

HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt",
                      "added_tokens.json")
ROLES = ("pad", "cls", "sep", "unk", "mask")
REQUIRED_ROLES = ("pad", "cls", "sep", "mask")
# Only for a bare tokenizer.json, whose format has no roles: the tokenizer's own special tokens are
# matched by these conventional names (BERT's and RoBERTa's).
CONVENTIONAL_NAMES = {"pad": ("[PAD]", "<pad>"), "cls": ("[CLS]", "<s>", "<cls>"), "sep": ("[SEP]", "</s>", "<sep>"),
                      "unk": ("[UNK]", "<unk>"), "mask": ("[MASK]", "<mask>")}


class HFTokenizer(Tokenizer):
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
        self._encoder = FastTokenizer.from_str(self.hf.backend_tokenizer.to_str())
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
        return FastTokenizer.from_file(str(path / "tokenizer.json")).get_vocab(with_added_tokens=True)
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
