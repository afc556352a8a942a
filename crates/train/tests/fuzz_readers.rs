//! Fuzzed readers of the trainer: token shards (`Shard::open`, then the loader over them),
//! HF `tokenizer.json` (`Tokenizer::from_file`, then encode/decode), the `--config` TOML
//! (`TrainArgs::merged` + `resolve`) and the model config as the trainer reads it
//! (`presets::resolve` + `setup::llama_config`). Random bytes and mutations of valid files:
//! every call returns `Ok` or a one-line error naming the file, within the case budget.
//!
//! CI runs a fixed number of cases per property (about a minute for all three fuzz binaries);
//! `FERROTRON_FUZZ_SCALE=10` runs ten times as many, `PROPTEST_CASES=N` exactly N.

#[path = "../../../tests/fuzz/mutate.rs"]
mod mutate;

use ferrotron_plan::presets::resolve;
use ferrotron_train::config::TrainArgs;
use ferrotron_train::data::shard::HEADER_LEN;
use ferrotron_train::data::{
    write_shard, Fnv1a64, Loader, LoaderConfig, Shard, TokenDataset, Tokenizer,
    BUNDLED_TOKENIZER_JSON,
};
use ferrotron_train::setup::llama_config;
use mutate::{
    bounded, config, each_extreme_number, json_mutations, mutate, mutate_json, mutations,
    EXTREME_NUMBERS, EXTREME_U64,
};
use proptest::prelude::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = Path::new(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("fuzz-train-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    })
}

/// A fresh file in the test's temp dir holding `bytes`.
fn temp_file(ext: &str, bytes: &[u8]) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let p = dir().join(format!("f{}.{ext}", N.fetch_add(1, Ordering::Relaxed)));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A rejection is one line that starts with the file's name.
fn assert_names_file(msg: &str, name: &str) -> Result<(), TestCaseError> {
    prop_assert!(msg.contains(name), "error does not name {}: {}", name, msg);
    prop_assert!(
        !msg.chars().any(char::is_control),
        "error is not one clean line: {:?}",
        msg
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Token shards

/// Shards written by the project's own writer: u16 tokens, u32 tokens, and an empty shard.
fn shard_samples() -> &'static [Vec<u8>] {
    static S: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    S.get_or_init(|| {
        let u16_tokens: Vec<u32> = (0..40).map(|i| (i * 37) % 1000).collect();
        let u32_tokens: Vec<u32> = (0..24).map(|i| 70_000 + i * 11).collect();
        [(1000, u16_tokens), (100_000, u32_tokens), (50, vec![])]
            .iter()
            .enumerate()
            .map(|(i, (vocab, toks))| {
                let p = dir().join(format!("sample{i}.tok"));
                write_shard(&p, *vocab, toks).unwrap();
                std::fs::read(p).unwrap()
            })
            .collect()
    })
}

/// Rewrites the header checksum to match the body, so that a mutant gets past the checksum
/// check to the token-range check and the reads behind it.
fn reseal(b: &mut [u8]) {
    if b.len() >= HEADER_LEN {
        let sum = Fnv1a64::hash(&b[HEADER_LEN..]);
        b[32..40].copy_from_slice(&sum.to_le_bytes());
    }
}

/// Opens `bytes` as a shard; an accepted shard must be exactly what its header says, every
/// token below the vocab size, and batches must be readable from it.
fn check_shard(bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = temp_file("tok", bytes);
    let name = path.display().to_string();
    let got = bounded("Shard::open", || Shard::open(&path))?;
    match got {
        Err(e) => assert_names_file(&e.to_string(), &name)?,
        Ok(s) => {
            let width = s.info().dtype.width() as u64;
            prop_assert_eq!(s.info().bytes, bytes.len() as u64);
            prop_assert_eq!(HEADER_LEN as u64 + s.len() * width, bytes.len() as u64);
            let toks = s.to_vec();
            prop_assert!(toks.iter().all(|&t| t < s.vocab_size()));
            if s.len() >= 3 {
                let data = TokenDataset::open(&[&path]).unwrap();
                let mut l = Loader::new(data, LoaderConfig::new(1, 2, 7)).unwrap();
                for _ in 0..3 {
                    let b = l.next_batch();
                    prop_assert!(b.inputs.iter().all(|&t| t < s.vocab_size()));
                }
            }
        }
    }
    std::fs::remove_file(&path).ok();
    Ok(())
}

/// Every header field of every sample set to every extreme value, with the checksum left
/// alone and resealed; a header length can never cause a read past the file or a large
/// allocation (the test would crash or take too long).
#[test]
fn shard_header_fields_with_extreme_values() {
    const FIELDS: &[(&str, usize, usize)] = &[
        ("magic", 0, 8),
        ("version", 8, 4),
        ("vocab_size", 12, 4),
        ("token_width", 16, 4),
        ("reserved", 20, 4),
        ("token_count", 24, 8),
        ("checksum", 32, 8),
        ("reserved", 40, 8),
    ];
    for sample in shard_samples() {
        for &(field, at, width) in FIELDS {
            for &v in EXTREME_U64 {
                for seal in [false, true] {
                    let mut b = sample.clone();
                    b[at..at + width].copy_from_slice(&v.to_le_bytes()[..width]);
                    if seal {
                        reseal(&mut b);
                    }
                    check_shard(&b).unwrap_or_else(|e| panic!("{field} = {v}: {e}"));
                }
            }
        }
    }
}

#[test]
fn shard_samples_are_valid() {
    for s in shard_samples() {
        let path = temp_file("tok", s);
        Shard::open(&path).unwrap();
    }
}

// ---------------------------------------------------------------------------------------------
// tokenizer.json

/// Valid tokenizer.json texts: a small one of each HF model kind (BPE, WordPiece, WordLevel,
/// Unigram), with added special tokens, and the bundled 8192-token BPE.
fn tokenizer_samples() -> &'static [Vec<u8>] {
    static S: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    S.get_or_init(|| {
        let words = [
            "<unk>", "<s>", "</s>", "a", "b", "ab", "ba", "aa", "abc", "c", "##b",
        ];
        let vocab: serde_json::Map<String, Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), json!(i)))
            .collect();
        let scores: Vec<Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| json!([w, -(i as f64) - 1.0]))
            .collect();
        let models = [
            json!({"type": "BPE", "dropout": null, "unk_token": "<unk>", "fuse_unk": false,
                   "byte_fallback": false, "vocab": vocab, "merges": ["a b", "b a", "ab c"]}),
            json!({"type": "WordPiece", "unk_token": "<unk>", "continuing_subword_prefix": "##",
                   "max_input_chars_per_word": 100, "vocab": vocab}),
            json!({"type": "WordLevel", "unk_token": "<unk>", "vocab": vocab}),
            json!({"type": "Unigram", "unk_id": 0, "vocab": scores, "byte_fallback": false}),
        ];
        let mut v: Vec<Vec<u8>> = models
            .into_iter()
            .map(|model| {
                let special = |id: usize, content: &str| {
                    json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
                };
                json!({"version": "1.0", "truncation": null, "padding": null,
                       "added_tokens": [special(2, "</s>"), special(11, "<|endoftext|>")],
                       "normalizer": {"type": "Lowercase"},
                       "pre_tokenizer": {"type": "Whitespace"},
                       "post_processor": null, "decoder": null, "model": model})
                .to_string()
                .into_bytes()
            })
            .collect();
        v.push(BUNDLED_TOKENIZER_JSON.to_vec());
        v
    })
}

/// Names in tokenizer.json files: component types and their fields.
const TOKENIZER_WORDS: &[&str] = &[
    "type",
    "BPE",
    "WordPiece",
    "WordLevel",
    "Unigram",
    "vocab",
    "merges",
    "unk_token",
    "unk_id",
    "dropout",
    "fuse_unk",
    "byte_fallback",
    "continuing_subword_prefix",
    "end_of_word_suffix",
    "max_input_chars_per_word",
    "ignore_merges",
    "added_tokens",
    "id",
    "content",
    "special",
    "normalizer",
    "pre_tokenizer",
    "post_processor",
    "decoder",
    "model",
    "Sequence",
    "normalizers",
    "pretokenizers",
    "decoders",
    "processors",
    "ByteLevel",
    "Whitespace",
    "WhitespaceSplit",
    "Metaspace",
    "BertPreTokenizer",
    "Split",
    "Punctuation",
    "Digits",
    "CharDelimiterSplit",
    "UnicodeScripts",
    "Lowercase",
    "NFC",
    "NFKD",
    "Strip",
    "Replace",
    "Prepend",
    "Precompiled",
    "BPEDecoder",
    "CTC",
    "Fuse",
    "ByteFallback",
    "TemplateProcessing",
    "RobertaProcessing",
    "BertProcessing",
    "pattern",
    "behavior",
    "invert",
    "replacement",
    "prepend_scheme",
    "add_prefix_space",
    "trim_offsets",
    "use_regex",
    "delimiter",
    "individual_digits",
    "single",
    "pair",
    "special_tokens",
    "<unk>",
    "</s>",
    "##",
    "a",
    "ab",
];

/// Loads `bytes` as `--tokenizer FILE`; an accepted tokenizer must encode and decode text
/// (including ids it does not have) without a panic.
fn check_tokenizer(bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = temp_file("json", bytes);
    let name = path.display().to_string();
    let got = bounded("Tokenizer::from_file", || Tokenizer::from_file(&path))?;
    std::fs::remove_file(&path).ok();
    match got {
        Err(e) => assert_names_file(&e.to_string(), &name)?,
        Ok(t) => bounded("encode/decode", || -> Result<(), TestCaseError> {
            for text in [
                "ab ba abc",
                "</s> a<|endoftext|>b",
                "caf\u{e9} \u{1f600}\n\n",
                "",
            ] {
                if let Ok(ids) = t.encode(text) {
                    let _ = t.decode(&ids);
                }
            }
            let _ = t.encode_batch(&["a b", "c"]);
            let v = t.vocab_size();
            let _ = t.decode(&[0, 1, v.saturating_sub(1), v, v.saturating_add(1), u32::MAX]);
            Ok(())
        })??,
    }
    Ok(())
}

/// Every number of the small tokenizers (ids, scores, limits) replaced by every extreme number.
#[test]
fn tokenizer_fields_with_extreme_numbers() {
    for sample in &tokenizer_samples()[..4] {
        each_extreme_number(&serde_json::from_slice(sample).unwrap(), check_tokenizer);
    }
}

#[test]
fn tokenizer_samples_are_valid() {
    for s in tokenizer_samples() {
        let t = Tokenizer::from_bytes(s, "sample").unwrap();
        assert!(!t.encode("ab ba").unwrap().is_empty());
    }
}

// ---------------------------------------------------------------------------------------------
// TOML `--config` and the model config as the trainer reads it

fn train_toml_sample() -> Vec<u8> {
    std::fs::read(root().join("configs/train-default.toml")).unwrap()
}

/// Reads `bytes` as `ferrotron train --config FILE`, then resolves the settings.
fn check_train_toml(bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = temp_file("toml", bytes);
    let name = path.display().to_string();
    let args = TrainArgs {
        config: Some(path.clone()),
        ..TrainArgs::default()
    };
    let got = bounded("TrainArgs::merged", || args.merged())?;
    std::fs::remove_file(&path).ok();
    match got {
        Err(e) => assert_names_file(&e, &name)?,
        Ok(a) => {
            if let Err(e) = bounded("TrainArgs::resolve", || a.resolve())? {
                let msg = e.to_string();
                prop_assert!(!msg.chars().any(char::is_control), "{:?}", msg);
            }
        }
    }
    Ok(())
}

fn model_config_samples() -> Vec<Vec<u8>> {
    ["tiny-gqa", "tiny-qwen2", "tiny-tied"]
        .iter()
        .map(|d| std::fs::read(root().join("tests/fixtures").join(d).join("config.json")).unwrap())
        .collect()
}

/// Reads `bytes` as `--model config.json` and turns it into the engine's config.
fn check_model_config(bytes: &[u8]) -> Result<(), TestCaseError> {
    let path = temp_file("json", bytes);
    let name = path.display().to_string();
    let got = bounded("resolve", || resolve(&name))?;
    std::fs::remove_file(&path).ok();
    match got {
        Err(e) => assert_names_file(&e.to_string(), &name)?,
        Ok(spec) => {
            if let Err(e) = bounded("llama_config", || llama_config(&spec))? {
                let msg = e.to_string();
                prop_assert!(!msg.chars().any(char::is_control), "{:?}", msg);
            }
        }
    }
    Ok(())
}

#[test]
fn train_samples_are_valid() {
    let path = temp_file("toml", &train_toml_sample());
    let a = TrainArgs {
        config: Some(path),
        ..TrainArgs::default()
    };
    a.merged().unwrap().resolve().unwrap();
    for s in model_config_samples() {
        let path = temp_file("json", &s);
        llama_config(&resolve(path.to_str().unwrap()).unwrap()).unwrap();
    }
}

/// Every number of the fixture configs replaced by every extreme number.
#[test]
fn model_config_fields_with_extreme_numbers() {
    for sample in model_config_samples() {
        each_extreme_number(
            &serde_json::from_slice(&sample).unwrap(),
            check_model_config,
        );
    }
}

/// Every value of the train TOML sample replaced by every extreme number.
#[test]
fn train_toml_values_with_extreme_numbers() {
    let sample = String::from_utf8(train_toml_sample()).unwrap();
    let lines: Vec<&str> = sample.lines().collect();
    for (i, line) in lines.iter().enumerate() {
        let Some((key, _)) = line.split_once(" = ") else {
            continue;
        };
        for n in EXTREME_NUMBERS {
            let mut l = lines.clone();
            let edited = format!("{key} = {n}");
            l[i] = &edited;
            check_train_toml(l.join("\n").as_bytes()).unwrap_or_else(|e| panic!("{edited}: {e}"));
        }
    }
}

proptest! {
    #![proptest_config(config(40_000))]

    #[test]
    fn shard_random_bytes(bytes in mutate::bytes(256)) {
        check_shard(&bytes)?;
    }

    #[test]
    fn shard_mutated(i in 0..3usize, muts in mutations(4), seal in any::<bool>()) {
        let mut b = mutate(&shard_samples()[i], &muts);
        if seal {
            reseal(&mut b);
        }
        check_shard(&b)?;
    }

    #[test]
    fn tokenizer_random_bytes(bytes in mutate::bytes(512)) {
        check_tokenizer(&bytes)?;
    }

    #[test]
    fn tokenizer_small_mutated(i in 0..4usize, muts in mutations(4)) {
        check_tokenizer(&mutate(&tokenizer_samples()[i], &muts))?;
    }

    #[test]
    fn train_toml_random_text(text in mutate::text(256)) {
        check_train_toml(text.as_bytes())?;
    }

    #[test]
    fn train_toml_mutated(muts in mutations(4)) {
        check_train_toml(&mutate(&train_toml_sample(), &muts))?;
    }

    #[test]
    fn model_config_mutated(i in 0..3usize, muts in mutations(4)) {
        check_model_config(&mutate(&model_config_samples()[i], &muts))?;
    }
}

proptest! {
    #![proptest_config(config(40_000))]

    /// Structured edits keep the JSON valid, so they reach the components' own checks (and
    /// the encode/decode paths of odd combinations) instead of the JSON parser.
    #[test]
    fn tokenizer_small_structured(i in 0..4usize, muts in json_mutations(TOKENIZER_WORDS, 4)) {
        let doc = mutate_json(&serde_json::from_slice(&tokenizer_samples()[i]).unwrap(), &muts);
        check_tokenizer(doc.to_string().as_bytes())?;
    }
}

proptest! {
    // The bundled tokenizer is 220 KB: each case parses all of it.
    #![proptest_config(config(2_500))]

    #[test]
    fn tokenizer_bundled_mutated(muts in mutations(4)) {
        check_tokenizer(&mutate(&tokenizer_samples()[4], &muts))?;
    }
}

// ---------------------------------------------------------------------------------------------
// Regressions: what the properties above found, each pinned with its message.

/// `train_toml_random_text`: the `toml` crate's message spans lines and has no position;
/// `--config` errors are now `FILE:LINE:COLUMN: message` on one line.
#[test]
fn regression_toml_errors_are_one_line_with_the_position() {
    let path = temp_file("toml", b"seq = 256\n[0a\n");
    let args = TrainArgs {
        config: Some(path.clone()),
        ..TrainArgs::default()
    };
    assert_eq!(
        args.merged().unwrap_err(),
        format!(
            "{}:2:4: invalid table header; expected `.`, `]`",
            path.display()
        )
    );
}

/// `train_toml_mutated`: a setting's value went into the message verbatim (a tab, a newline).
#[test]
fn regression_control_characters_in_setting_errors_are_escaped() {
    let args = TrainArgs {
        recompute: Some("\tone\n".into()),
        ..TrainArgs::default()
    };
    assert_eq!(
        args.resolve().unwrap_err().to_string(),
        "recompute = \\tone\\n: expected one of none, selective, full"
    );
}

/// `tokenizer_small_mutated`: a `decoder` that is not valid JSON made the `tokenizers` crate
/// panic (`expect("Helper")`) instead of failing; the syntax is now checked first.
#[test]
fn regression_malformed_decoder_is_an_error_not_a_panic() {
    let doc: Value = serde_json::from_slice(&tokenizer_samples()[1]).unwrap();
    let text = mutate::with_raw(&doc, "/decoder", "\u{0}");
    let column = text.find('\0').unwrap() + 1;
    let e = Tokenizer::from_bytes(text.as_bytes(), "tok.json").unwrap_err();
    assert_eq!(
        e.to_string(),
        format!("tokenizer tok.json: not a valid HF tokenizer.json: expected value at line 1 column {column}")
    );
    // The same panic from a well-formed document with a lone surrogate in the decoder (found
    // by the 10x run of `tokenizer_bundled_mutated`).
    let text2 = mutate::with_raw(&doc, "/decoder", r#"{"type": "\ud800"}"#);
    let e = Tokenizer::from_bytes(text2.as_bytes(), "tok.json").unwrap_err();
    assert!(
        e.to_string().starts_with(
            "tokenizer tok.json: not a valid HF tokenizer.json: unexpected end of hex escape"
        ),
        "{e}"
    );
    // Why the check is there: the library itself still panics on this input. When this fails,
    // `tokenizers` has fixed it and the syntax check in `Tokenizer::from_bytes` can go.
    let upstream = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(text.as_bytes()));
    assert!(upstream.is_err(), "tokenizers no longer panics here");
}

/// `tokenizer_small_structured`: a BPE merge whose second token is shorter than (or does not
/// start with) the `continuing_subword_prefix` made `tokenizers` underflow while building the
/// model; a merge longer than every vocabulary entry overran its buffer.
#[test]
fn regression_bpe_merges_that_break_the_library_are_errors() {
    let doc: Value = serde_json::from_slice(&tokenizer_samples()[0]).unwrap();
    let mut with_prefix = doc.clone();
    with_prefix["model"]["continuing_subword_prefix"] = json!("##");
    let text = with_prefix.to_string();
    let e = Tokenizer::from_bytes(text.as_bytes(), "tok.json").unwrap_err();
    assert_eq!(
        e.to_string(),
        "tokenizer tok.json: not a valid HF tokenizer.json: merge 0 `a b`: `b` does not start with continuing_subword_prefix `##`"
    );
    // Why: the library itself panics on it.
    let upstream = std::panic::catch_unwind(|| tokenizers::Tokenizer::from_bytes(text.as_bytes()));
    assert!(upstream.is_err(), "tokenizers no longer panics here");
    // A merge whose result is not a token.
    let mut unknown = doc.clone();
    unknown["model"]["merges"] = json!(["abc abc"]);
    let e = Tokenizer::from_bytes(unknown.to_string().as_bytes(), "tok.json").unwrap_err();
    assert!(
        e.to_string()
            .ends_with("merge 0 `abc abc`: the merged token `abcabc` is not in the vocabulary"),
        "{e}"
    );
    // A prefix the merges do use is fine.
    let mut fine = doc;
    fine["model"]["continuing_subword_prefix"] = json!("##");
    fine["model"]["merges"] = json!(["a ##b"]);
    fine["model"]["vocab"]["ab"] = json!(5);
    assert!(Tokenizer::from_bytes(fine.to_string().as_bytes(), "tok.json").is_ok());
}

/// `tokenizer_fields_with_extreme_numbers`: a token id of u32::MAX overflowed the vocabulary
/// size (one past the largest id).
#[test]
fn regression_token_id_at_u32_max_is_an_error() {
    let doc: Value = serde_json::from_slice(&tokenizer_samples()[2]).unwrap();
    let text = mutate::with_raw(&doc, "/model/vocab/c", "4294967295");
    let e = Tokenizer::from_bytes(text.as_bytes(), "tok.json").unwrap_err();
    assert_eq!(
        e.to_string(),
        "tokenizer tok.json: token \"c\" has id 4294967295, too large: ids must be below 4294967295 (is the id a typo?)"
    );
}

/// `tokenizer_bundled_mutated`: the library's message quotes the file (`Token `\x7funds` out
/// of vocabulary`), control characters and all.
#[test]
fn regression_control_characters_in_tokenizer_errors_are_escaped() {
    let doc: Value = serde_json::from_slice(&tokenizer_samples()[0]).unwrap();
    let text = mutate::with_raw(&doc, "/model/merges/0", "\"\\u007fa b\"");
    let e = Tokenizer::from_bytes(text.as_bytes(), "tok.json").unwrap_err();
    assert!(
        e.to_string().starts_with(
            "tokenizer tok.json: not a valid HF tokenizer.json: Token `\\u{7f}a` out of vocabulary"
        ),
        "{e}"
    );
}

/// `tokenizer_small_structured`: with a BPE decoder, decoding nothing (no ids, or only ids
/// the vocabulary does not have) panicked inside `tokenizers` (`tokens.len() - 1`).
#[test]
fn regression_decoding_nothing_with_a_bpe_decoder() {
    let doc: Value = serde_json::from_slice(&tokenizer_samples()[0]).unwrap();
    let text = mutate::with_raw(
        &doc,
        "/decoder",
        r#"{"type": "BPEDecoder", "suffix": "</w>"}"#,
    );
    let t = Tokenizer::from_bytes(text.as_bytes(), "tok.json").unwrap();
    assert_eq!(t.decode(&[]).unwrap(), "");
    assert_eq!(t.decode(&[u32::MAX]).unwrap(), "");
    assert_eq!(t.decode(&[3, 4]).unwrap(), "ab");
}
