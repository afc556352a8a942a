#!/usr/bin/env python3
"""Train ferrotron's default tokenizer: byte-level BPE, vocab 8192, on data/corpus/shakespeare.txt.

Requires the `tokenizers` package from PyPI (trained with tokenizers==0.23.2, the same
version as the Rust crate that loads the file). Writes:

  data/tokenizer.json          HF tokenizer.json (GPT-2 style byte-level BPE)
  data/tokenizer.golden.json   a few (text, ids) pairs and whole-corpus statistics that
                               crates/train/tests/data_tokenizer.rs checks the Rust side against

Layout of the vocabulary: id 0 = `<|endoftext|>` (the only special token; used as EOS and
as the document separator), ids 1..=256 = the 256 byte symbols, then 7935 merges.

Usage: python3 tests/reference/train_tokenizer.py [--corpus data/corpus/shakespeare.txt] [--out-dir data]
"""

import argparse
import hashlib
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 8192
EOS = "<|endoftext|>"

GOLDEN_TEXTS = [
    "To be, or not to be,--that is the question:--",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;",
    "  leading spaces, trailing spaces  \n\n\ttabs\tand 1234567890 digits!",
    "Unicode: café, naïve, Ελληνικά, 日本語, emoji 🎭",
    "first document" + EOS + "second document",
    "",
]


def split_documents(text: str) -> list:
    """Same rule as ferrotron's `split_documents`: documents are separated by the literal
    separator; one newline directly before and one directly after it belong to the separator."""
    docs = []
    for piece in text.split(EOS):
        if piece.startswith("\n"):
            piece = piece[1:]
        if piece.endswith("\n"):
            piece = piece[:-1]
        docs.append(piece)
    return docs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="data/corpus/shakespeare.txt")
    ap.add_argument("--out-dir", default="data")
    args = ap.parse_args()

    with open(args.corpus, "r", encoding="utf-8") as f:
        corpus = f.read()
    docs = split_documents(corpus)

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert tok.token_to_id(EOS) == 0

    os.makedirs(args.out_dir, exist_ok=True)
    tok_path = os.path.join(args.out_dir, "tokenizer.json")
    tok.save(tok_path, pretty=False)

    # Whole-corpus statistics, encoded the way ferrotron's build_shards does it:
    # split on the separator, encode each document, append EOS after each one.
    n_tokens = 0
    for d in docs:
        if not d:
            continue
        n_tokens += len(tok.encode(d, add_special_tokens=False).ids) + 1
    n_bytes = len(corpus.encode("utf-8"))
    golden = {
        "tokenizers_version": __import__("tokenizers").__version__,
        "vocab_size": VOCAB_SIZE,
        "eos": EOS,
        "eos_id": 0,
        "corpus_bytes": n_bytes,
        "corpus_sha256": hashlib.sha256(corpus.encode("utf-8")).hexdigest(),
        "corpus_documents": len([d for d in docs if d]),
        "corpus_tokens_with_eos": n_tokens,
        "cases": [
            {"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in GOLDEN_TEXTS
        ],
    }
    with open(os.path.join(args.out_dir, "tokenizer.golden.json"), "w", encoding="utf-8") as f:
        json.dump(golden, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"vocab {tok.get_vocab_size()}, corpus {n_bytes} bytes -> {n_tokens} tokens "
          f"({n_bytes / n_tokens:.3f} bytes/token), tokenizer.json "
          f"{os.path.getsize(tok_path)} bytes, sha256 "
          f"{hashlib.sha256(open(tok_path, 'rb').read()).hexdigest()}")


if __name__ == "__main__":
    main()
