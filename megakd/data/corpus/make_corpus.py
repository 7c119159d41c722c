"""Rebuild the bundled documents from the raw texts (see README.md).

Run once by hand: ``python make_corpus.py RAW_DIR [HUTTO_DIR WORDNET_DIR]``. Kept next to the
data so the split is reproducible, not imported by the library. HUTTO_DIR is
``hutto_ICWSM_2014/`` unpacked from the vaderSentiment 3.3.2 sdist, WORDNET_DIR is
``usr/share/wordnet/`` unpacked from the Debian package wordnet-base 1:3.0-37.
"""

import gzip
import html
import json
import re
import sys
from pathlib import Path

CHAPTER = re.compile(r"^chapter\s+([ivxlc]+|\d+)\s*$", re.IGNORECASE)
KJV_VERSES_PER_PASSAGE = 40
SNIPPETS_PER_DOCUMENT = 20
GLOSSES_PER_DOCUMENT = 50
# Only these three: the fourth file of the collection, movieReviewSnippets, is the RT task itself.
HUTTO_FILES = ("amazonReviewSnippets_GroundTruth.txt", "nytEditorialSnippets_GroundTruth.txt",
               "tweets_GroundTruth.txt")
# Nouns (82K of the 117K synsets, mostly encyclopaedic names) are left out to keep the repo small.
WORDNET_FILES = ("data.adj", "data.adv", "data.verb")


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


def hutto_snippets(hutto_dir: Path) -> list[str]:
    """Amazon review, NYT editorial and tweet snippets (id, score, text per line); the score is dropped.

    Consecutive snippets of one file form a document (the files keep the source order, so a
    document is mostly one review or editorial).
    """
    docs = []
    for name in HUTTO_FILES:
        lines = (hutto_dir / name).read_text(encoding="utf-8", errors="replace").splitlines()
        texts = [html.unescape(ln.split("\t", 2)[2]).strip() for ln in lines if ln.count("\t") >= 2]
        texts = [t for t in texts if t]
        n = SNIPPETS_PER_DOCUMENT
        docs += ["\n".join(texts[i : i + n]) for i in range(0, len(texts), n)]
    return docs


def wordnet_glosses(wordnet_dir: Path) -> list[str]:
    """One line per synset, "lemma, lemma: gloss" (definition and quoted examples), in file order.

    Synsets that sit next to each other in a data file are related (adjective clusters,
    hyponym runs), so a document of consecutive glosses reads like a small thesaurus page.
    """
    docs = []
    for name in WORDNET_FILES:
        glosses = []
        for line in (wordnet_dir / name).read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue  # the licence header
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            n_words = int(parts[3], 16)
            lemmas = [re.sub(r"\(.*\)$", "", w).replace("_", " ") for w in parts[4 : 4 + 2 * n_words : 2]]
            glosses.append(f"{', '.join(lemmas)}: {gloss.strip()}")
        n = GLOSSES_PER_DOCUMENT
        docs += ["\n".join(glosses[i : i + n]) for i in range(0, len(glosses), n)]
    return docs


def write_jsonl_gz(path: Path, docs: list[str]) -> None:
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        for d in docs:
            f.write((json.dumps({"text": d}, ensure_ascii=False) + "\n").encode())


def main(raw_dir: str, hutto_dir: str | None = None, wordnet_dir: str | None = None) -> None:
    here = Path(__file__).parent
    raw = Path(raw_dir)
    austen = gzip.open(raw / "austen.txt.gz", "rt", encoding="utf-8").read().splitlines()
    kjv = gzip.open(raw / "kjv.txt.gz", "rt", encoding="utf-8").read().splitlines()
    write_jsonl_gz(here / "austen.jsonl.gz", austen_chapters(austen))
    write_jsonl_gz(here / "kjv.jsonl.gz", kjv_passages(kjv))
    if hutto_dir:
        write_jsonl_gz(here / "snippets.jsonl.gz", hutto_snippets(Path(hutto_dir)))
    if wordnet_dir:
        write_jsonl_gz(here / "wordnet.jsonl.gz", wordnet_glosses(Path(wordnet_dir)))


if __name__ == "__main__":
    main(*sys.argv[1:4])
