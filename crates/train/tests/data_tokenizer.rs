//! The bundled tokenizer: loads from the embedded bytes and from disk, matches the Python
//! `tokenizers` reference ids in data/tokenizer.golden.json, and round-trips text.

use std::path::PathBuf;

use ferrotron_train::data::{chunk_document, split_documents, Tokenizer, DOC_SEPARATOR};
use serde_json::Value;

fn repo_file(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn golden() -> Value {
    let raw = std::fs::read_to_string(repo_file("data/tokenizer.golden.json")).unwrap();
    serde_json::from_str(&raw).unwrap()
}

#[test]
fn bundled_tokenizer_basics() {
    let t = Tokenizer::bundled().unwrap();
    assert_eq!(t.vocab_size(), 8192);
    assert_eq!(t.eos_id(), Some(0));
    assert_eq!(t.bos_id(), None);
    assert_eq!(t.token_to_id("<|endoftext|>"), Some(0));
    assert_eq!(t.id_to_token(0).as_deref(), Some("<|endoftext|>"));
    assert!(t.newline_cuts_are_exact());
    // The file on disk is the same tokenizer as the embedded copy.
    let f = Tokenizer::from_file(repo_file("data/tokenizer.json")).unwrap();
    assert_eq!(f.vocab_size(), 8192);
    assert_eq!(f.encode("Hamlet").unwrap(), t.encode("Hamlet").unwrap());
}

#[test]
fn matches_python_reference_ids() {
    let g = golden();
    let t = Tokenizer::bundled().unwrap();
    assert_eq!(g["vocab_size"].as_u64().unwrap(), u64::from(t.vocab_size()));
    assert_eq!(g["eos_id"].as_u64(), t.eos_id().map(u64::from));
    for case in g["cases"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect();
        let got = t.encode(text).unwrap();
        assert_eq!(got, want, "ids of {text:?}");
        assert_eq!(t.decode(&got).unwrap(), text, "round trip of {text:?}");
    }
}

#[test]
fn round_trips_arbitrary_text() {
    let t = Tokenizer::bundled().unwrap();
    let texts = [
        "O Romeo, Romeo! wherefore art thou Romeo?",
        "\u{0}\u{1}\u{7f} control bytes\r\n and CRLF",
        "mixed: 日本語 / Ελληνικά / русский / emoji 🎭🗡️",
        "    code {\n\tlet x = 1;\n}\n",
        "",
    ];
    for s in texts {
        let ids = t.encode(s).unwrap();
        assert!(ids.iter().all(|&i| i < t.vocab_size()));
        assert_eq!(t.decode(&ids).unwrap(), s);
    }
    let batch = t.encode_batch(&texts).unwrap();
    for (s, ids) in texts.iter().zip(batch) {
        assert_eq!(ids, t.encode(s).unwrap());
    }
    // A literal separator maps to the EOS id.
    assert_eq!(t.encode(DOC_SEPARATOR).unwrap(), vec![0]);
}

#[test]
fn corpus_matches_python_token_count_and_chunking_is_exact() {
    let g = golden();
    let raw = std::fs::read(repo_file("data/corpus/shakespeare.txt")).unwrap();
    assert_eq!(raw.len() as u64, g["corpus_bytes"].as_u64().unwrap());
    let text = std::str::from_utf8(&raw).unwrap();
    let t = Tokenizer::bundled().unwrap();
    let docs = split_documents(text);
    assert_eq!(docs.len() as u64, g["corpus_documents"].as_u64().unwrap());

    // Whole-document encoding (what Python did) vs chunked encoding (what build_shards does).
    let mut total = 0u64;
    for (i, doc) in docs.iter().enumerate() {
        let whole = t.encode(doc).unwrap();
        total += whole.len() as u64 + 1; // + EOS
        if i < 3 {
            let chunks = chunk_document(doc, 4096);
            assert!(chunks.len() > 10);
            assert_eq!(chunks.concat(), *doc);
            let pieces: Vec<u32> = t.encode_batch(&chunks).unwrap().concat();
            assert_eq!(pieces, whole, "document {i}: chunked encoding differs");
        }
    }
    assert_eq!(total, g["corpus_tokens_with_eos"].as_u64().unwrap());
}

#[test]
fn loading_garbage_is_an_error_not_a_panic() {
    let e = Tokenizer::from_bytes(b"{\"not\": \"a tokenizer\"}", "junk.json").unwrap_err();
    assert!(
        e.to_string()
            .starts_with("tokenizer junk.json: not a valid HF tokenizer.json: "),
        "{e}"
    );
    let e = Tokenizer::from_file("/definitely/not/here/tokenizer.json").unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/definitely/not/here/tokenizer.json: "),
        "{e}"
    );
    let t = Tokenizer::bundled().unwrap();
    let e = t.with_eos(Some("</nope>")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "tokenizer bundled:data/tokenizer.json: eos token \"</nope>\" is not in the vocabulary"
    );
}
