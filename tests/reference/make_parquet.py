"""Writes tests/fixtures/docs.pyarrow.parquet: a Parquet file made by another library than the
one ferrotron reads with (pyarrow, i.e. Arrow C++), and tests/fixtures/docs.pyarrow.json, its
documents in order, which `crates/train/tests/data_formats.rs` tokenizes and compares.

What the file exercises: the text in a column named `content` (not the default `text`) next to
other columns, zstd-compressed pages, a dictionary-encoded string column (pyarrow's default),
two row groups, unicode, an empty document (dropped by the reader) and a long one spanning pages.

    python -m venv /tmp/venv-pq && /tmp/venv-pq/bin/pip install pyarrow
    /tmp/venv-pq/bin/python tests/reference/make_parquet.py
"""

import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


def documents():
    docs = [
        "First document, written by pyarrow.",
        "Unicode: caf\u00e9, na\u00efve, \u2014 and \u65e5\u672c\u8a9e.",
        "",
        "Two lines\nof text.",
        "First document, written by pyarrow.",  # a repeat, so the dictionary is used
    ]
    docs.append("".join(f"Line {i}: the quality of mercy is not strained.\n" for i in range(300)))
    docs.append("The end.")
    return docs


def main():
    docs = documents()
    table = pa.table(
        {
            "id": pa.array(range(len(docs)), type=pa.int64()),
            "content": pa.array(docs, type=pa.string()),
            "lang": pa.array(["en"] * len(docs), type=pa.string()),
        }
    )
    FIXTURES.mkdir(parents=True, exist_ok=True)
    out = FIXTURES / "docs.pyarrow.parquet"
    pq.write_table(
        table,
        out,
        compression="zstd",
        row_group_size=4,
        data_page_size=4096,
        use_dictionary=True,
    )
    (FIXTURES / "docs.pyarrow.json").write_text(json.dumps(docs, ensure_ascii=False, indent=0) + "\n")
    print(f"{out}: {out.stat().st_size} bytes, {len(docs)} rows, pyarrow {pa.__version__}")


if __name__ == "__main__":
    main()
