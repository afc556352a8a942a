//! `ferrotron data`'s input formats: the same documents as .txt, .jsonl, .jsonl.gz, .jsonl.zst
//! and .parquet (written here, and one written by pyarrow: tests/fixtures/docs.pyarrow.parquet)
//! give the same token ids; directory trees; u32 shards; bad input is one line naming the file,
//! the line or row and the fix.

mod common;
use common::TempDir;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use ferrotron_train::data::{
    build_shards, build_shards_with, find_shards, BuildOptions, Shard, Split, TokenDataset,
    TokenDtype, Tokenizer,
};

/// Documents with what text handling must keep: unicode, escapes JSON must undo, inner
/// newlines, a long document cut into pieces.
fn documents() -> Vec<String> {
    let mut docs = vec![
        "First document.\nIt has two lines.".to_string(),
        "Quotes \"inside\", a tab\there, a backslash \\ and caf\u{e9} \u{2014} na\u{ef}ve."
            .to_string(),
        "  Leading spaces, and a blank line:\n\nafter it.".to_string(),
    ];
    let long: String = (0..400)
        .map(|i| format!("Line {i} of a long play: exeunt omnes.\n"))
        .collect();
    docs.push(long.trim_end().to_string());
    docs.push("Last one.".to_string());
    docs
}

fn json_line(field: &str, text: &str) -> String {
    serde_json::json!({ "id": 7, field: text, "meta": {"text": 1} }).to_string()
}

fn jsonl(docs: &[String]) -> String {
    docs.iter().map(|d| json_line("text", d) + "\n").collect()
}

/// Every token of a build, train then val.
fn stream(out: &Path) -> Vec<u32> {
    let mut v = Vec::new();
    for split in [Split::Train, Split::Val] {
        for p in find_shards(out, split).unwrap() {
            v.extend(Shard::open(&p).unwrap().to_vec());
        }
    }
    v
}

fn small_opts() -> BuildOptions {
    // Small pieces and batches, so that documents are cut and batches span documents.
    BuildOptions {
        val_fraction: 0.1,
        chunk_bytes: 256,
        batch_bytes: 1024,
        ..BuildOptions::default()
    }
}

/// Writes `docs` as a Parquet file with pages of at most `page` bytes, `rows` rows a group.
fn write_parquet(path: &Path, column: &str, docs: &[String], rows: usize) {
    use parquet::basic::Compression;
    use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let schema = format!("message m {{ required int64 id; optional binary {column} (UTF8); }}");
    let schema = Arc::new(parse_message_type(&schema).unwrap());
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_data_page_size_limit(512)
        .build();
    let file = fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(file, schema, Arc::new(props)).unwrap();
    for (g, group) in docs.chunks(rows).enumerate() {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let ids: Vec<i64> = (0..group.len() as i64)
            .map(|i| g as i64 * 100 + i)
            .collect();
        col.typed::<Int64Type>()
            .write_batch(&ids, None, None)
            .unwrap();
        col.close().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = group.iter().map(|d| ByteArray::from(d.as_str())).collect();
        let defs = vec![1i16; group.len()];
        col.typed::<ByteArrayType>()
            .write_batch(&values, Some(&defs), None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    e.write_all(bytes).unwrap();
    e.finish().unwrap()
}

#[test]
fn every_format_gives_the_ids_of_the_text_file() {
    let dir = TempDir::new("formats");
    let tok = Tokenizer::bundled().unwrap();
    let docs = documents();
    let txt = dir.path().join("docs.txt");
    fs::write(&txt, docs.join("\n<|endoftext|>\n") + "\n").unwrap();
    let want_out = dir.path().join("out-txt");
    let want_summary = build_shards_with(&[&txt], &tok, &want_out, &small_opts()).unwrap();
    let want = stream(&want_out);

    // The stream is each document's own encoding followed by EOS.
    let mut direct = Vec::new();
    for d in &docs {
        direct.extend(tok.encode(d).unwrap());
        direct.push(tok.eos_id().unwrap());
    }
    assert_eq!(want, direct);
    assert_eq!(want_summary.documents, docs.len() as u64);

    let lines = jsonl(&docs);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("docs.jsonl", lines.clone().into_bytes()),
        ("docs.jsonl.gz", gzip(lines.as_bytes())),
        (
            "docs.jsonl.zst",
            zstd::encode_all(lines.as_bytes(), 3).unwrap(),
        ),
        ("docs.txt.gz", gzip(&fs::read(&txt).unwrap())),
    ];
    let mut inputs: Vec<PathBuf> = Vec::new();
    for (name, bytes) in cases {
        let p = dir.path().join(name);
        fs::write(&p, bytes).unwrap();
        inputs.push(p);
    }
    let pq = dir.path().join("docs.parquet");
    write_parquet(&pq, "text", &docs, 2);
    inputs.push(pq);
    for input in &inputs {
        let out = dir.path().join(format!(
            "out-{}",
            input.file_name().unwrap().to_string_lossy()
        ));
        let s = build_shards_with(&[input], &tok, &out, &small_opts()).unwrap();
        assert_eq!(stream(&out), want, "{}", input.display());
        assert_eq!(s.documents, docs.len() as u64, "{}", input.display());
        assert_eq!(s.train_tokens, want_summary.train_tokens);
    }
}

#[test]
fn a_parquet_file_written_by_pyarrow_reads() {
    // Written by tests/reference/make_parquet.py (pyarrow; zstd pages, a dictionary-encoded
    // string column, two row groups); its documents are listed next to it.
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let pq = fixtures.join("docs.pyarrow.parquet");
    let docs: Vec<String> =
        serde_json::from_str(&fs::read_to_string(fixtures.join("docs.pyarrow.json")).unwrap())
            .unwrap();
    let dir = TempDir::new("pyarrow");
    let tok = Tokenizer::bundled().unwrap();
    let opts = BuildOptions {
        text_field: "content".into(),
        ..small_opts()
    };
    let s = build_shards_with(&[&pq], &tok, dir.path(), &opts).unwrap();
    let mut want = Vec::new();
    for d in docs.iter().filter(|d| !d.is_empty()) {
        want.extend(tok.encode(d).unwrap());
        want.push(0);
    }
    assert_eq!(stream(dir.path()), want);
    assert_eq!(
        s.documents,
        docs.iter().filter(|d| !d.is_empty()).count() as u64
    );
}

#[test]
fn directory_trees_are_read_recursively_in_name_order() {
    let dir = TempDir::new("tree");
    let root = dir.path().join("data");
    fs::create_dir_all(root.join("b/inner")).unwrap();
    fs::create_dir_all(root.join("a")).unwrap();
    fs::write(
        root.join("b/inner/3.jsonl"),
        json_line("text", "three") + "\n",
    )
    .unwrap();
    fs::write(root.join("b/2.txt"), "two\n").unwrap();
    fs::write(
        root.join("a/1.jsonl.gz"),
        gzip(json_line("text", "one").as_bytes()),
    )
    .unwrap();
    fs::write(root.join("c.txt"), "four\n").unwrap();
    fs::write(root.join("notes.md"), "not an input").unwrap();
    let tok = Tokenizer::bundled().unwrap();
    let out = dir.path().join("out");
    let s = build_shards(&[&root], &tok, &out, 0.0).unwrap();
    assert_eq!(
        s.inputs,
        vec![
            root.join("a/1.jsonl.gz"),
            root.join("b/2.txt"),
            root.join("b/inner/3.jsonl"),
            root.join("c.txt")
        ]
    );
    let mut want = Vec::new();
    for d in ["one", "two", "three", "four"] {
        want.extend(tok.encode(d).unwrap());
        want.push(0);
    }
    assert_eq!(stream(&out), want);
}

/// A word-level tokenizer whose largest id is 70,000: more than u16 holds.
fn big_vocab_tokenizer() -> Tokenizer {
    let json = serde_json::json!({
        "version": "1.0",
        "added_tokens": [{"id": 70000, "content": "<|endoftext|>", "single_word": false,
            "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
        "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "unk_token": "[UNK]",
            "vocab": {"[UNK]": 0, "to": 1, "be": 2, "or": 3, "not": 4, "far": 69999,
                "<|endoftext|>": 70000}}
    });
    Tokenizer::from_bytes(json.to_string().as_bytes(), "big-vocab").unwrap()
}

#[test]
fn a_vocabulary_past_u16_writes_u32_tokens_that_the_loader_reads() {
    let dir = TempDir::new("u32");
    let tok = big_vocab_tokenizer();
    assert_eq!(tok.vocab_size(), 70001);
    let input = dir.path().join("words.jsonl");
    fs::write(
        &input,
        [
            json_line("text", "to be or not to be far"),
            json_line("text", "far far"),
        ]
        .join("\n"),
    )
    .unwrap();
    let out = dir.path().join("out");
    let s = build_shards(&[&input], &tok, &out, 0.2).unwrap();
    let want = vec![1, 2, 3, 4, 1, 2, 69999, 70000, 69999, 69999, 70000];
    assert_eq!(stream(&out), want);
    assert!(s
        .train_shards
        .iter()
        .chain(&s.val_shards)
        .all(|i| i.dtype == TokenDtype::U32));
    let paths = find_shards(&out, Split::Train).unwrap();
    let ds = TokenDataset::open_for_model(&paths, 70001).unwrap();
    assert_eq!(ds.tokens(), s.train_tokens);
    assert_eq!(ds.vocab_size(), 70001);
}

fn error_of(name: &str, bytes: &[u8], field: &str) -> (PathBuf, String) {
    let dir = TempDir::new("bad-input");
    let p = dir.path().join(name);
    fs::write(&p, bytes).unwrap();
    let opts = BuildOptions {
        text_field: field.into(),
        ..BuildOptions::default()
    };
    let e = build_shards_with(&[&p], &Tokenizer::bundled().unwrap(), dir.path(), &opts)
        .unwrap_err()
        .to_string();
    assert!(!e.contains('\n'), "{e}");
    // Nothing is published, and nothing temporary is left.
    let left: Vec<String> = fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != name)
        .collect();
    assert!(left.is_empty(), "{left:?}");
    (p, e)
}

#[test]
fn bad_input_is_one_line_naming_the_file_the_line_and_the_fix() {
    let good = json_line("text", "fine");
    let (p, e) = error_of(
        "a.jsonl",
        format!("{good}\n\n{{\"text\": \"unterminated\n").as_bytes(),
        "text",
    );
    assert_eq!(
        e,
        format!(
            "{}: line 3: not a JSON object (EOF while parsing a string at column 22): \
             each line must be one JSON object such as {{\"text\": \"...\"}}",
            p.display()
        )
    );
    let (p, e) = error_of("b.jsonl", format!("{good}\n{good}\n").as_bytes(), "body");
    assert_eq!(
        e,
        format!(
            "{}: line 1: no \"body\" field: pass --text-field with the name of the field that \
             holds the document text",
            p.display()
        )
    );
    let (p, e) = error_of(
        "c.jsonl",
        format!("{good}\n{{\"text\": [\"a\", \"b\"]}}\n").as_bytes(),
        "text",
    );
    assert_eq!(
        e,
        format!(
            "{}: line 2: field \"text\" is an array, not a string: pass --text-field with the \
             name of the field that holds the document text",
            p.display()
        )
    );
    let whole = gzip(jsonl(&documents()).as_bytes());
    let (p, e) = error_of("d.jsonl.gz", &whole[..whole.len() / 2], "text");
    assert_eq!(
        e,
        format!(
            "{}: line 4: the gzip stream is truncated or corrupt (incomplete deflate stream): \
             re-download or re-compress the file",
            p.display()
        )
    );
    let whole = zstd::encode_all(jsonl(&documents()).as_bytes(), 3).unwrap();
    let (p, e) = error_of("e.jsonl.zst", &whole[..whole.len() - 20], "text");
    assert_eq!(
        e,
        format!(
            "{}: line 1: the zstd stream is truncated or corrupt (incomplete frame): \
             re-download or re-compress the file",
            p.display()
        )
    );
    let mut damaged = whole.clone();
    damaged[20] ^= 0xff;
    let (p, e) = error_of("e2.jsonl.zst", &damaged, "text");
    assert_eq!(
        e,
        format!(
            "{}: line 1: the zstd stream is truncated or corrupt (Data corruption detected): \
             re-download or re-compress the file",
            p.display()
        )
    );

    let dir = TempDir::new("bad-parquet");
    let pq = dir.path().join("docs.parquet");
    write_parquet(&pq, "content", &documents(), 10);
    let bytes = fs::read(&pq).unwrap();
    let (p, e) = error_of("f.parquet", &bytes, "text");
    assert_eq!(
        e,
        format!(
            "{}: no column \"text\" (columns: id, content): pass --text-field with the column \
             that holds the document text",
            p.display()
        )
    );
    let (p, e) = error_of("g.parquet", &bytes, "id");
    assert_eq!(
        e,
        format!(
            "{}: column \"id\" holds INT64 values, not strings: pass --text-field with a \
             string column",
            p.display()
        )
    );
    let (p, e) = error_of("h.parquet", &bytes[..bytes.len() - 9], "content");
    assert!(
        e.starts_with(&format!("{}: not a readable Parquet file (", p.display()))
            && e.ends_with("): check that it was written completely"),
        "{e}"
    );
}

#[test]
fn a_null_parquet_value_names_its_row() {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    let dir = TempDir::new("null-row");
    let p = dir.path().join("n.parquet");
    let schema =
        Arc::new(parse_message_type("message m { optional binary text (UTF8); }").unwrap());
    let mut w = SerializedFileWriter::new(
        fs::File::create(&p).unwrap(),
        schema,
        Arc::new(WriterProperties::builder().build()),
    )
    .unwrap();
    let mut rg = w.next_row_group().unwrap();
    let mut col = rg.next_column().unwrap().unwrap();
    let values = vec![ByteArray::from("a"), ByteArray::from("b")];
    col.typed::<ByteArrayType>()
        .write_batch(&values, Some(&[1, 1, 0]), None)
        .unwrap();
    col.close().unwrap();
    rg.close().unwrap();
    w.close().unwrap();
    let e = build_shards(&[&p], &Tokenizer::bundled().unwrap(), dir.path(), 0.1)
        .unwrap_err()
        .to_string();
    assert_eq!(
        e,
        format!(
            "{}: row 2: column \"text\" is null: drop or fill the row, or pass --text-field \
             with the column that holds the document text",
            p.display()
        )
    );
}
