//! A thin wrapper over the Hugging Face `tokenizers` crate: loads any HF `tokenizer.json`
//! (no network), encodes without adding template special tokens, decodes, and finds the
//! end/beginning-of-sequence ids when the tokenizer has them.
//!
//! The default tokenizer (byte-level BPE, vocab 8192, trained on the bundled Shakespeare corpus
//! by `tests/reference/train_tokenizer.py`) is compiled into the binary, so
//! [`Tokenizer::bundled`] works from any working directory.

use std::path::Path;

use super::error::{DataError, Result};

/// Bytes of the bundled default `data/tokenizer.json`.
pub const BUNDLED_TOKENIZER_JSON: &[u8] = include_bytes!(concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../data/tokenizer.json"
));

/// Name used for the bundled tokenizer in messages and summaries.
pub const BUNDLED_NAME: &str = "bundled:data/tokenizer.json";

/// Special tokens recognised as end-of-sequence, in order of preference.
const EOS_CANDIDATES: &[&str] = &[
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|eot_id|>",
    "<|im_end|>",
];

/// Special tokens recognised as beginning-of-sequence, in order of preference.
const BOS_CANDIDATES: &[&str] = &["<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"];

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    name: String,
    vocab_size: u32,
    eos: Option<u32>,
    bos: Option<u32>,
    newline_cuts_exact: bool,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("name", &self.name)
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .field("bos", &self.bos)
            .finish()
    }
}

impl Tokenizer {
    /// The bundled default tokenizer (embedded in the binary).
    pub fn bundled() -> Result<Self> {
        Self::from_bytes(BUNDLED_TOKENIZER_JSON, BUNDLED_NAME)
    }

    /// The tokenizer at `path`, or the bundled default when `path` is `None`.
    pub fn load(path: Option<&Path>) -> Result<Self> {
        match path {
            Some(p) => Self::from_file(p),
            None => Self::bundled(),
        }
    }

    /// Loads a HF `tokenizer.json` from disk.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| DataError::io(path, e))?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses HF `tokenizer.json` bytes; `name` appears in error messages.
    pub fn from_bytes(bytes: &[u8], name: &str) -> Result<Self> {
        let invalid = |e: &dyn std::fmt::Display| DataError::Tokenizer {
            source_name: name.to_string(),
            message: format!("not a valid HF tokenizer.json: {e}"),
        };
        // Parse the JSON first: `tokenizers` 0.23 panics (`expect("Helper")` in its decoder
        // deserializer) when the `decoder` value is malformed JSON, or holds a string the
        // parser rejects (a lone surrogate `\ud800`), instead of returning the error. A full
        // `Value` parse rejects everything that path can fail on (a syntax-only check, serde's
        // `IgnoredAny`, misses the string escapes), and keeps serde_json's nesting limit.
        let doc = serde_json::from_slice::<serde_json::Value>(bytes).map_err(|e| invalid(&e))?;
        check_bpe_merges(&doc["model"]).map_err(|e| invalid(&e))?;
        let inner = tokenizers::Tokenizer::from_bytes(bytes).map_err(|e| invalid(&e))?;
        Self::from_hf(inner, name)
    }

    /// Wraps an already-built `tokenizers::Tokenizer`. Fails when a token id leaves no room
    /// for the vocabulary size (one past the largest id) in a u32.
    pub fn from_hf(inner: tokenizers::Tokenizer, name: &str) -> Result<Self> {
        // The model's vocabulary size is one past the largest id (added tokens included),
        // which is what an embedding table must cover.
        let vocab = inner.get_vocab(true);
        let max_id = vocab.iter().max_by_key(|(_, id)| **id);
        let past_max = match max_id {
            None => 0,
            Some((token, &id)) => id.checked_add(1).ok_or_else(|| DataError::Tokenizer {
                source_name: name.to_string(),
                message: format!(
                    "token {token:?} has id {id}, too large: ids must be below {} (is the id a typo?)",
                    u32::MAX
                ),
            })?,
        };
        let vocab_size =
            past_max.max(u32::try_from(inner.get_vocab_size(true)).unwrap_or(u32::MAX));
        let special = |cands: &[&str]| {
            let added = inner.get_added_tokens_decoder();
            cands.iter().find_map(|c| {
                added
                    .iter()
                    .find(|(_, t)| t.special && t.content == *c)
                    .map(|(id, _)| *id)
            })
        };
        let eos = special(EOS_CANDIDATES);
        let bos = special(BOS_CANDIDATES);
        let mut t = Tokenizer {
            inner,
            name: name.to_string(),
            vocab_size,
            eos,
            bos,
            newline_cuts_exact: false,
        };
        t.newline_cuts_exact = t.probe_newline_cuts();
        Ok(t)
    }

    /// Whether encoding `a` and `b` separately gives the tokens of encoding `a + b` when `a`
    /// ends with a newline between two visible ASCII characters, on a few probe texts.
    fn probe_newline_cuts(&self) -> bool {
        const PROBES: &[(&str, &str)] = &[
            ("Hello world.\n", "The end, said he."),
            ("a\n", "b"),
            ("  indented line;\n", "Next: 42 items\n\n"),
            ("x = 1\n", "y = x+1\n"),
            ("caf\u{e9}!\n", "'Tis na\u{ef}ve\n"),
        ];
        PROBES.iter().all(|(a, b)| {
            let whole = self.encode(&format!("{a}{b}"));
            let (pa, pb) = (self.encode(a), self.encode(b));
            match (whole, pa, pb) {
                (Ok(w), Ok(mut x), Ok(y)) => {
                    x.extend(y);
                    w == x
                }
                _ => false,
            }
        })
    }

    /// Whether long documents may be cut after a newline between two visible ASCII characters
    /// and encoded piecewise with exactly the same tokens (true for GPT-2 style byte-level BPE).
    pub fn newline_cuts_are_exact(&self) -> bool {
        self.newline_cuts_exact
    }

    /// Overrides the end-of-sequence token (e.g. for a tokenizer whose EOS is not one of the
    /// well-known names). `None` disables it.
    pub fn with_eos(mut self, token: Option<&str>) -> Result<Self> {
        self.eos = match token {
            None => None,
            Some(t) => Some(self.require_id(t, "eos")?),
        };
        Ok(self)
    }

    /// Overrides the beginning-of-sequence token. `None` disables it.
    pub fn with_bos(mut self, token: Option<&str>) -> Result<Self> {
        self.bos = match token {
            None => None,
            Some(t) => Some(self.require_id(t, "bos")?),
        };
        Ok(self)
    }

    fn require_id(&self, token: &str, what: &str) -> Result<u32> {
        self.inner
            .token_to_id(token)
            .ok_or_else(|| DataError::Tokenizer {
                source_name: self.name.clone(),
                message: format!("{what} token {token:?} is not in the vocabulary"),
            })
    }

    /// Where it was loaded from (a path or [`BUNDLED_NAME`]).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Vocabulary size: one past the largest token id (added tokens included).
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// End-of-sequence id, if the tokenizer has one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Beginning-of-sequence id, if the tokenizer has one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// Id of a token string, if in the vocabulary.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Token string of an id, if in the vocabulary.
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The underlying HF tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    fn err(&self, e: impl std::fmt::Display) -> DataError {
        DataError::Tokenizer {
            source_name: self.name.clone(),
            message: e.to_string(),
        }
    }

    /// Encodes text. No template tokens (BOS/EOS) are added; special tokens written literally
    /// in the text (e.g. `<|endoftext|>`) still map to their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| self.err(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Encodes several texts in parallel (rayon), same rules as [`Tokenizer::encode`].
    pub fn encode_batch(&self, texts: &[&str]) -> Result<Vec<Vec<u32>>> {
        let encs = self
            .inner
            .encode_batch_fast(texts.to_vec(), false)
            .map_err(|e| self.err(e))?;
        Ok(encs.into_iter().map(|e| e.get_ids().to_vec()).collect())
    }

    /// Decodes ids to text, special tokens included (so `decode(encode(s)) == s` for
    /// byte-level tokenizers).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        // `tokenizers` 0.23's BPE decoder computes `tokens.len() - 1`: with no token to decode
        // (no ids, or none in the vocabulary) that underflows, a panic in builds with overflow
        // checks. The answer is the empty string, which is what the library gives otherwise.
        if ids.iter().all(|&id| self.inner.id_to_token(id).is_none()) {
            return Ok(String::new());
        }
        self.inner.decode(ids, false).map_err(|e| self.err(e))
    }
}

/// Checks what `tokenizers` 0.23 assumes of a BPE model's merges before it builds the model.
/// For a merge `a b` it copies `a` and `b` minus `continuing_subword_prefix`'s length into a
/// buffer as long as the longest vocabulary entry, then looks the result up: a `b` shorter than
/// the prefix underflows, one that does not start with it can cut a character in two (then
/// reads invalid UTF-8 as a string), and a merge longer than every entry overruns the buffer
/// — panics or worse instead of an error (found by `fuzz_readers::tokenizer_small_structured`).
/// Merges the library rejects by itself (unknown tokens, bad shapes) are left to it.
fn check_bpe_merges(model: &serde_json::Value) -> std::result::Result<(), String> {
    let (Some(vocab), Some(merges)) = (
        model.get("vocab").and_then(|v| v.as_object()),
        model.get("merges").and_then(|m| m.as_array()),
    ) else {
        return Ok(());
    };
    let prefix = model
        .get("continuing_subword_prefix")
        .and_then(|p| p.as_str())
        .unwrap_or("");
    for (i, m) in merges.iter().enumerate() {
        let pair: Option<(&str, &str)> = match m {
            serde_json::Value::String(s) => {
                let mut parts = s.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(a), Some(b), None) => Some((a, b)),
                    _ => None,
                }
            }
            serde_json::Value::Array(v) => match v.as_slice() {
                [serde_json::Value::String(a), serde_json::Value::String(b)] => Some((a, b)),
                _ => None,
            },
            _ => None,
        };
        let Some((a, b)) = pair else { continue };
        if !(vocab.contains_key(a) && vocab.contains_key(b)) {
            continue;
        }
        let Some(rest) = b.strip_prefix(prefix) else {
            return Err(format!(
                "merge {i} `{a} {b}`: `{b}` does not start with continuing_subword_prefix `{prefix}`"
            ));
        };
        let merged = format!("{a}{rest}");
        if !vocab.contains_key(&merged) {
            return Err(format!(
                "merge {i} `{a} {b}`: the merged token `{merged}` is not in the vocabulary"
            ));
        }
    }
    Ok(())
}
