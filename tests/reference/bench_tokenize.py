"""The Python side of `ferrotron data`'s side-by-side benchmark (docs/BENCHMARKS.md,
"Tokenizing"): Hugging Face `tokenizers`' own batch encoding of the same JSON Lines file, and
a check that ferrotron's shards hold exactly the same ids.

    python -m venv /tmp/venv-tok && /tmp/venv-tok/bin/pip install tokenizers
    PY=/tmp/venv-tok/bin/python
    $PY tests/reference/bench_tokenize.py make-jsonl /tmp/docs.jsonl --mb 64
    $PY tests/reference/bench_tokenize.py encode /tmp/docs.jsonl --ids /tmp/docs.ids
    ferrotron data --input /tmp/docs.jsonl --out /tmp/docs-shards --val-fraction 0.05
    $PY tests/reference/bench_tokenize.py compare /tmp/docs.ids /tmp/docs-shards

`encode` does what `ferrotron data` does up to the shards: reads the file line by line, takes
each object's `text`, encodes batches of documents with `encode_batch_fast` (rayon, every core;
no special tokens added) and appends the tokenizer's EOS after every document. It times
everything from opening the file to the last id, and writes the ids (u32, little-endian) only
after the clock stops.
"""

import argparse
import array
import json
import pathlib
import struct
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOKENIZER = ROOT / "data" / "tokenizer.json"
CORPUS = ROOT / "data" / "corpus" / "shakespeare.txt"
HEADER = 48  # ferrotron token shard header (crates/train/src/data/shard.rs)


def make_jsonl(out, mb):
    """Documents of 1-8 KiB (web-page sized) cut from the bundled corpus at paragraph breaks,
    repeated until the file has `mb` MiB."""
    text = CORPUS.read_text(encoding="utf-8")
    plays = [p.strip("\n") for p in text.split("<|endoftext|>")]
    docs = []
    for play in plays:
        cur = ""
        for para in play.split("\n\n"):
            cur = f"{cur}\n\n{para}" if cur else para
            if len(cur) >= 1024 << (len(docs) % 4):
                docs.append(cur)
                cur = ""
        if cur.strip():
            docs.append(cur)
    target = mb << 20
    written = 0
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        while written < target:
            for d in docs:
                line = json.dumps({"id": n, "text": d, "source": "shakespeare"}, ensure_ascii=False) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                n += 1
                if written >= target:
                    break
    print(f"{out}: {written} bytes, {n} documents")


def encode(path, ids_out, batch):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER))
    eos = tok.token_to_id("<|endoftext|>")
    fast = getattr(tok, "encode_batch_fast", tok.encode_batch)
    ids = array.array("I")
    t0 = time.perf_counter()
    docs = 0
    with open(path, encoding="utf-8") as f:
        pending = []
        for line in f:
            if not line.strip():
                continue
            t = json.loads(line)["text"]
            if t:
                pending.append(t)
            if len(pending) == batch:
                for e in fast(pending, add_special_tokens=False):
                    ids.extend(e.ids)
                    ids.append(eos)
                docs += len(pending)
                pending = []
        if pending:
            for e in fast(pending, add_special_tokens=False):
                ids.extend(e.ids)
                ids.append(eos)
            docs += len(pending)
    secs = time.perf_counter() - t0
    size = pathlib.Path(path).stat().st_size
    print(
        f"tokenizers {sys.modules['tokenizers'].__version__}: {docs} documents, {len(ids)} tokens "
        f"in {secs:.2f} s: {len(ids) / secs:,.0f} tok/s, {size / secs / 2**20:.2f} MiB/s"
    )
    if ids_out:
        with open(ids_out, "wb") as f:
            ids.tofile(f)


def read_shards(d):
    out = array.array("I")
    for split in ("train", "val"):
        for p in sorted(pathlib.Path(d).glob(f"{split}_*.tok")):
            b = p.read_bytes()
            width = struct.unpack_from("<I", b, 16)[0]
            count = struct.unpack_from("<Q", b, 24)[0]
            a = array.array("H" if width == 2 else "I")
            a.frombytes(b[HEADER : HEADER + count * width])
            out.extend(array.array("I", a))
    return out


def compare(ids_path, shard_dir):
    want = array.array("I")
    with open(ids_path, "rb") as f:
        want.frombytes(f.read())
    got = read_shards(shard_dir)
    if got == want:
        print(f"identical: {len(got)} ids")
        return 0
    n = min(len(got), len(want))
    first = next((i for i in range(n) if got[i] != want[i]), n)
    print(f"DIFFERENT: {len(got)} ids in the shards, {len(want)} from tokenizers; first difference at {first}")
    return 1


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-jsonl")
    m.add_argument("out")
    m.add_argument("--mb", type=int, default=64)
    e = sub.add_parser("encode")
    e.add_argument("jsonl")
    e.add_argument("--ids")
    e.add_argument("--batch", type=int, default=1000)
    c = sub.add_parser("compare")
    c.add_argument("ids")
    c.add_argument("shards")
    a = ap.parse_args()
    if a.cmd == "make-jsonl":
        make_jsonl(a.out, a.mb)
    elif a.cmd == "encode":
        encode(a.jsonl, a.ids, a.batch)
    else:
        sys.exit(compare(a.ids, a.shards))


if __name__ == "__main__":
    main()
