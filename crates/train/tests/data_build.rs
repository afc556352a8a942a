//! build_shards: documents and EOS, the validation split, shard naming, summary, errors.

mod common;
use common::TempDir;
use std::fs;
use std::path::{Path, PathBuf};

use ferrotron_train::data::{
    build_shards, build_shards_with, chunk_document, find_shards, split_documents, BuildOptions,
    Shard, Split, Summary, Tokenizer, SUMMARY_FILE,
};

#[test]
fn split_documents_rules() {
    assert_eq!(
        split_documents("one\n<|endoftext|>\ntwo\n\n<|endoftext|>three<|endoftext|>\n"),
        vec!["one", "two\n", "three"]
    );
    assert_eq!(split_documents(""), Vec::<&str>::new());
    assert_eq!(split_documents("plain text\n"), vec!["plain text"]);
}

#[test]
fn chunking_cuts_only_between_visible_characters() {
    let doc = "aaaa\nbbbb\n\ncccc\n dddd\neeee";
    let chunks = chunk_document(doc, 3);
    assert_eq!(chunks.concat(), doc);
    assert_eq!(chunks, vec!["aaaa\n", "bbbb\n\ncccc\n dddd\n", "eeee"]);
    assert_eq!(
        chunk_document("no newline at all", 2),
        vec!["no newline at all"]
    );
}

#[test]
fn documents_are_separated_by_eos_and_split_into_train_val() {
    let dir = TempDir::new("build-basic");
    let a = dir.path().join("a.txt");
    let b = dir.path().join("b.txt");
    fs::write(&a, "First play.\n<|endoftext|>\nSecond play.\n").unwrap();
    fs::write(&b, "Third play, in another file.\n").unwrap();
    let out = dir.path().join("out");
    let tok = Tokenizer::bundled().unwrap();
    let s = build_shards(&[&a, &b], &tok, &out, 0.25).unwrap();

    // Expected stream: each document's tokens followed by EOS (0).
    let mut want = Vec::new();
    for d in [
        "First play.",
        "Second play.",
        "Third play, in another file.",
    ] {
        want.extend(tok.encode(d).unwrap());
        want.push(0);
    }
    assert_eq!(s.documents, 3);
    assert_eq!(s.tokens, want.len() as u64);
    assert_eq!(s.vocab_size, 8192);
    assert_eq!(s.eos_id, Some(0));
    let n_val = ((want.len() as f64) * 0.25).round() as u64;
    assert_eq!(s.val_tokens, n_val);
    assert_eq!(s.train_tokens + s.val_tokens, s.tokens);
    assert_eq!(s.inputs, vec![a.clone(), b.clone()]);
    assert_eq!(
        s.input_bytes,
        fs::metadata(&a).unwrap().len() + fs::metadata(&b).unwrap().len()
    );

    let train = find_shards(&out, Split::Train).unwrap();
    let val = find_shards(&out, Split::Val).unwrap();
    assert_eq!(train, vec![out.join("train_0000.tok")]);
    assert_eq!(val, vec![out.join("val_0000.tok")]);
    let mut got = Shard::open(&train[0]).unwrap().to_vec();
    assert_eq!(got.len() as u64, s.train_tokens);
    got.extend(Shard::open(&val[0]).unwrap().to_vec());
    assert_eq!(got, want);
    assert_eq!(
        tok.decode(&got).unwrap(),
        "First play.<|endoftext|>Second play.<|endoftext|>Third play, in another file.<|endoftext|>"
    );

    // summary.json is the returned summary.
    let saved: Summary =
        serde_json::from_str(&fs::read_to_string(out.join(SUMMARY_FILE)).unwrap()).unwrap();
    assert_eq!(saved, s);
}

#[test]
fn directories_shard_limits_and_stale_cleanup() {
    let dir = TempDir::new("build-dir");
    let input = dir.path().join("texts");
    fs::create_dir_all(&input).unwrap();
    fs::write(input.join("b.txt"), "Bee.\n".repeat(200)).unwrap();
    fs::write(input.join("a.txt"), "Ay.\n".repeat(200)).unwrap();
    fs::write(input.join("ignored.md"), "# not text input").unwrap();
    let out = dir.path().join("out");
    let tok = Tokenizer::bundled().unwrap();

    let opts = BuildOptions {
        val_fraction: 0.0,
        max_shard_tokens: 100,
        chunk_bytes: 64,
        ..BuildOptions::default()
    };
    let s = build_shards_with(&[&input], &tok, &out, &opts).unwrap();
    assert_eq!(s.inputs, vec![input.join("a.txt"), input.join("b.txt")]);
    assert_eq!(s.val_tokens, 0);
    assert!(s.val_shards.is_empty());
    let n_shards = s.tokens.div_ceil(100) as usize;
    assert!(n_shards >= 3, "{}", s.tokens);
    assert_eq!(s.train_shards.len(), n_shards);
    assert!(s.train_shards.iter().all(|i| i.tokens <= 100));
    // Chunked encoding equals whole-file encoding.
    // (A file's final newline is dropped.)
    let mut want = tok.encode(&"Ay.\n".repeat(200)[..799]).unwrap();
    want.push(0);
    want.extend(tok.encode(&"Bee.\n".repeat(200)[..999]).unwrap());
    want.push(0);
    let got: Vec<u32> = find_shards(&out, Split::Train)
        .unwrap()
        .iter()
        .flat_map(|p| Shard::open(p).unwrap().to_vec())
        .collect();
    assert_eq!(got, want);

    // A rebuild into the same directory with bigger shards leaves no stale train_0003.tok.
    let s2 = build_shards(&[&input], &tok, &out, 0.1).unwrap();
    assert_eq!(s2.train_shards.len(), 1);
    assert_eq!(
        find_shards(&out, Split::Train).unwrap(),
        vec![out.join("train_0000.tok")]
    );
    assert_eq!(find_shards(&out, Split::Val).unwrap().len(), 1);
    // No temporary files left.
    for e in fs::read_dir(&out).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.ends_with(".tmp"), "{name}");
    }
}

#[test]
fn build_errors() {
    let dir = TempDir::new("build-err");
    let tok = Tokenizer::bundled().unwrap();
    let out = dir.path().join("out");
    let good = dir.path().join("good.txt");
    fs::write(&good, "Some words here.\n").unwrap();

    let e = build_shards(&[&good], &tok, &out, 1.0).unwrap_err();
    assert_eq!(
        e.to_string(),
        "val_fraction = 1 is out of range: use a value in [0, 1), e.g. 0.05"
    );
    let e = build_shards(&[&good], &tok, &out, f64::NAN).unwrap_err();
    assert!(e
        .to_string()
        .starts_with("val_fraction = NaN is out of range"));

    let latin1 = dir.path().join("latin1.txt");
    fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let e = build_shards(&[&latin1], &tok, &out, 0.1).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: not valid UTF-8 at byte 3 (input text files must be UTF-8)",
            latin1.display()
        )
    );

    let missing = dir.path().join("missing.txt");
    let e = build_shards(&[&missing], &tok, &out, 0.1).unwrap_err();
    assert!(
        e.to_string()
            .starts_with(&format!("{}: ", missing.display())),
        "{e}"
    );

    let tiny = dir.path().join("tiny.txt");
    fs::write(&tiny, "").unwrap();
    let e = build_shards(&[&tiny], &tok, &out, 0.1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "inputs give only 0 tokens: need at least 2; add text"
    );
    let e = build_shards(&[&good], &tok, &out, 0.9).unwrap_err();
    assert_eq!(
        e.to_string(),
        "val_fraction = 0.9 leaves only 0 of 5 tokens for training: need at least 2; \
         lower val_fraction or add text"
    );

    let none: [&Path; 0] = [];
    let e = build_shards(&none, &tok, &out, 0.1).unwrap_err();
    assert_eq!(
        e.to_string(),
        "no input text files given (pass at least one file or directory)"
    );
}

#[test]
fn bundled_corpus_builds() {
    let corpus =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../data/corpus/shakespeare.txt");
    let dir = TempDir::new("build-corpus");
    let tok = Tokenizer::bundled().unwrap();
    let s = build_shards(&[&corpus], &tok, dir.path(), 0.05).unwrap();
    assert_eq!(s.documents, 42);
    assert_eq!(s.tokens, 1_504_927); // = corpus_tokens_with_eos in data/tokenizer.golden.json
    assert!(s.bytes_per_token > 3.0 && s.bytes_per_token < 4.0);
    assert_eq!(s.val_tokens, (1_504_927f64 * 0.05).round() as u64);
    let report = s.to_string();
    assert!(
        report.contains("42 documents, 5052804 bytes (4.82 MiB)"),
        "{report}"
    );
    assert!(
        report.contains("1504927 tokens, 3.358 bytes/token"),
        "{report}"
    );
    eprintln!("{report}");
}
