"""Rebuild the bundled documents from the raw public-domain texts (see README.md).

Run once by hand: ``python make_corpus.py RAW_DIR``. Kept next to the data so the split is
reproducible, not imported by the library.
"""

import gzip
import json
import re
import sys
from pathlib import Path

CHAPTER = re.compile(r"^chapter\s+([ivxlc]+|\d+)\s*$", re.IGNORECASE)
KJV_VERSES_PER_PASSAGE = 40


def austen_chapters(lines: list[str]) -> list[str]:
    """One document per chapter; title and volume lines go with the chapter they sit next to."""
    docs: list[list[str]] = [[]]
    for line in lines:
        if CHAPTER.match(line) and any(CHAPTER.match(s) for s in docs[-1]):
            docs.append([])
        docs[-1].append(line)
    return ["\n".join(d).strip() for d in docs if "".join(d).strip()]


def kjv_passages(lines: list[str]) -> list[str]:
    """The source has no chapter markers, so fixed passages of consecutive verses stand in for chapters."""
    verses = [v for v in lines if v.strip()]
    n = KJV_VERSES_PER_PASSAGE
    return ["\n".join(verses[i : i + n]) for i in range(0, len(verses), n)]


def write_jsonl_gz(path: Path, docs: list[str]) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for d in docs:
            f.write((json.dumps({"text": d}, ensure_ascii=False) + "\n").encode())


def main(raw_dir: str) -> None:
    here = Path(__file__).parent
    raw = Path(raw_dir)
    austen = gzip.open(raw / "austen.txt.gz", "rt", encoding="utf-8").read().splitlines()
    kjv = gzip.open(raw / "kjv.txt.gz", "rt", encoding="utf-8").read().splitlines()
    write_jsonl_gz(here / "austen.jsonl.gz", austen_chapters(austen))
    write_jsonl_gz(here / "kjv.jsonl.gz", kjv_passages(kjv))


if __name__ == "__main__":
    main(sys.argv[1])
