"""Reading raw text inputs as a deterministic stream of documents.

What counts as a document (shard packing never crosses one):

* ``.txt`` / ``.txt.gz``: blocks separated by two or more consecutive blank lines (a single blank
  line is a paragraph break inside a document). Lines are kept verbatim, joined with ``\\n``.
* ``.jsonl`` / ``.jsonl.gz``: one JSON object per line; its ``text_field`` is one document.
* a directory written by HF ``datasets`` ``Dataset.save_to_disk``: each row's ``text_field``.
* any other directory: every supported file below it, in sorted path order.

The order is fixed by the order of ``inputs`` and sorted paths, so the same inputs always give the
same documents in the same order (shard global indices depend on it).
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import zlib
from collections.abc import Iterator
from pathlib import Path

from megakd.errors import UserError

logger = logging.getLogger(__name__)

TEXT_SUFFIXES = (".txt", ".txt.gz")
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


def _is_hf_dataset_dir(path: Path) -> bool:
    return (path / "dataset_info.json").is_file() and (path / "state.json").is_file()


def expand_inputs(inputs: list[str | Path]) -> list[Path]:
    """Resolve files, plain directories and HF dataset directories into an ordered source list."""
    if not inputs:
        raise UserError("no input paths given")
    out: list[Path] = []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise FileNotFoundError(f"input {path}: no such file or directory")
        if path.is_dir():
            if (path / "dataset_dict.json").is_file():
                raise UserError(f"input {path}: is a DatasetDict; pass one split directory (e.g. {path}/train)")
            if _is_hf_dataset_dir(path):
                out.append(path)
                continue
            files = sorted(p for p in path.rglob("*") if p.is_file())
            supported = [p for p in files if p.name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES)]
            ignored = [p for p in files if p not in supported]
            if ignored:
                logger.warning("input %s: ignoring %d file(s) without a .txt/.txt.gz/.jsonl/.jsonl.gz suffix, "
                               "e.g. %s", path, len(ignored), ignored[0])
            if not supported:
                raise UserError(f"input {path}: directory holds no .txt/.txt.gz/.jsonl/.jsonl.gz files")
            out.extend(supported)
        elif path.name.endswith(TEXT_SUFFIXES + JSONL_SUFFIXES):
            out.append(path)
        else:
            raise UserError(f"input {path}: expected .txt, .txt.gz, .jsonl, .jsonl.gz or a directory")
    return out


def open_text(path: Path) -> io.TextIOBase:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _text_documents(path: Path) -> Iterator[str]:
    lines: list[str] = []
    blanks = 0
    with open_text(path) as f:
        for line in f:
            line = line.rstrip("\r\n")
            if not line.strip():
                blanks += 1
                continue
            if blanks >= 2 and lines:
                yield "\n".join(lines)
                lines = []
            elif blanks and lines:
                lines.extend([""] * blanks)
            blanks = 0
            lines.append(line)
    if lines:
        yield "\n".join(lines)


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(text_field), str):
                raise UserError(f"{path}:{lineno}: expected an object with a string field {text_field!r}")
            yield obj[text_field]


def _hf_documents(path: Path, text_field: str) -> Iterator[str]:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"input {path}: reading a saved HF dataset needs `pip install datasets`") from e
    ds = datasets.load_from_disk(str(path))
    if text_field not in ds.column_names:
        raise UserError(f"input {path}: dataset has no column {text_field!r} (columns: {ds.column_names})")
    for batch in ds.select_columns([text_field]).iter(batch_size=1000):
        yield from batch[text_field]


def iter_documents(source: Path, text_field: str = "text") -> Iterator[str]:
    """Documents of one source from :func:`expand_inputs`, in file order.

    A file that is not UTF-8 text (or not gzip despite its suffix) is a `UserError` naming it.
    """
    if source.is_dir():
        yield from _hf_documents(source, text_field)
        return
    try:
        if source.name.endswith(JSONL_SUFFIXES):
            yield from _jsonl_documents(source, text_field)
        else:
            yield from _text_documents(source)
    except UnicodeDecodeError as e:
        raise UserError(f"input {source}: not UTF-8 text ({e.reason} at byte {e.start} of a line)") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise UserError(f"input {source}: not a readable gzip file ({e})") from None
