//! Text files → token shards (`ferrotron data`).
//!
//! Rules:
//! - An input is a UTF-8 text file, or a directory whose `*.txt` files are taken in name order.
//! - Documents are the input files, further split on the separator [`DOC_SEPARATOR`]
//!   (`<|endoftext|>`, as in GPT-2 style corpora). One newline at each end of a document is
//!   dropped (the line breaks around a separator line, and a file's final newline). Empty
//!   documents are dropped.
//! - Each document is encoded on its own; the tokenizer's EOS (if any) follows every document,
//!   and its BOS (if any, and different from EOS) precedes it.
//! - The last `val_fraction` of the token stream (rounded, at least one token when the fraction
//!   is positive) goes to the validation split, the rest to the training split. Each split is
//!   written as shards of at most [`BuildOptions::max_shard_tokens`] tokens named
//!   `train_0000.tok`, `val_0000.tok`, ...; a `summary.json` describes the result. Old shards
//!   of the same naming pattern left in `out_dir` by an earlier run are removed afterwards.
//!
//! Long documents are encoded in chunks of about [`BuildOptions::chunk_bytes`] bytes, cut
//! right after a newline that sits between two visible ASCII characters. For GPT-2 style
//! byte-level pre-tokenization (whose pieces never span such a newline) this gives exactly
//! the tokens of encoding the whole document, and it lets chunks encode in parallel. It is
//! only done when [`Tokenizer::newline_cuts_are_exact`] holds for the tokenizer (checked on
//! probe texts at load; e.g. SentencePiece-style tokenizers that prepend a space marker to
//! each input fail it and get whole documents).
//!
//! The token stream is held in memory (4 bytes per token) before it is split and written.

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::error::{DataError, Result};
use super::shard::{write_atomic, ShardInfo, ShardWriter, SHARD_EXT};
use super::tokenizer::Tokenizer;

/// Separator between documents inside one text file.
pub const DOC_SEPARATOR: &str = "<|endoftext|>";

/// Name of the summary file written next to the shards.
pub const SUMMARY_FILE: &str = "summary.json";

/// Knobs of [`build_shards_with`].
#[derive(Debug, Clone, PartialEq)]
pub struct BuildOptions {
    /// Fraction of tokens (from the end of the stream) held out for validation, in [0, 1).
    pub val_fraction: f64,
    /// Largest number of tokens in one shard file.
    pub max_shard_tokens: u64,
    /// Target size of the text pieces encoded in parallel.
    pub chunk_bytes: usize,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            val_fraction: 0.05,
            max_shard_tokens: 1 << 28,
            chunk_bytes: 1 << 18,
        }
    }
}

/// What [`build_shards`] did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Text files read, in order.
    pub inputs: Vec<PathBuf>,
    pub tokenizer: String,
    pub vocab_size: u32,
    pub eos_id: Option<u32>,
    pub bos_id: Option<u32>,
    pub documents: u64,
    /// UTF-8 bytes of text read (separators included).
    pub input_bytes: u64,
    /// All tokens written (train + val, EOS/BOS included).
    pub tokens: u64,
    pub train_tokens: u64,
    pub val_tokens: u64,
    pub val_fraction: f64,
    /// `input_bytes / tokens`: how much text one token carries.
    pub bytes_per_token: f64,
    pub train_shards: Vec<ShardInfo>,
    pub val_shards: Vec<ShardInfo>,
}

impl std::fmt::Display for Summary {
    /// A short human-readable report (what `ferrotron data` prints).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = self.input_bytes as f64 / (1u64 << 20) as f64;
        writeln!(
            f,
            "read {} file(s), {} documents, {} bytes ({mib:.2} MiB)",
            self.inputs.len(),
            self.documents,
            self.input_bytes
        )?;
        let special = |id: Option<u32>| id.map_or("none".to_string(), |i| i.to_string());
        writeln!(
            f,
            "tokenizer {} (vocab {}, eos {}, bos {}): {} tokens, {:.3} bytes/token",
            self.tokenizer,
            self.vocab_size,
            special(self.eos_id),
            special(self.bos_id),
            self.tokens,
            self.bytes_per_token
        )?;
        for (name, n, shards) in [
            ("train", self.train_tokens, &self.train_shards),
            ("val", self.val_tokens, &self.val_shards),
        ] {
            let files: Vec<String> = shards
                .iter()
                .map(|s| s.path.display().to_string())
                .collect();
            writeln!(
                f,
                "{name}: {n} tokens in {} shard(s) {}",
                shards.len(),
                files.join(" ")
            )?;
        }
        Ok(())
    }
}

/// Which split a shard belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Split {
    Train,
    Val,
}

impl Split {
    /// File name prefix of the split's shards.
    pub fn prefix(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Val => "val",
        }
    }

    /// File name of shard `index` of this split.
    pub fn shard_name(self, index: usize) -> String {
        format!("{}_{index:04}.{SHARD_EXT}", self.prefix())
    }
}

fn is_shard_name(name: &str, split: Split) -> bool {
    let Some(rest) = name.strip_prefix(split.prefix()) else {
        return false;
    };
    let Some(rest) = rest.strip_prefix('_') else {
        return false;
    };
    let Some(num) = rest.strip_suffix(&format!(".{SHARD_EXT}")) else {
        return false;
    };
    !num.is_empty() && num.bytes().all(|b| b.is_ascii_digit())
}

/// The shards of one split in `dir` (`train_NNNN.tok` / `val_NNNN.tok`), sorted by name.
pub fn find_shards(dir: impl AsRef<Path>, split: Split) -> Result<Vec<PathBuf>> {
    let dir = dir.as_ref();
    let mut out = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        let entry = entry.map_err(|e| DataError::io(dir, e))?;
        let name = entry.file_name();
        if let Some(name) = name.to_str() {
            if is_shard_name(name, split) {
                out.push(entry.path());
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Splits text into documents on [`DOC_SEPARATOR`], dropping one newline at each end of
/// every document and then empty documents (see the module docs).
pub fn split_documents(text: &str) -> Vec<&str> {
    text.split(DOC_SEPARATOR)
        .map(|d| {
            let d = d.strip_prefix('\n').unwrap_or(d);
            d.strip_suffix('\n').unwrap_or(d)
        })
        .filter(|d| !d.is_empty())
        .collect()
}

/// Cuts `doc` into pieces of roughly `target` bytes, each cut right after a `\n` whose
/// neighbours are both visible ASCII characters (see the module docs). A document without
/// such a newline stays whole.
pub fn chunk_document(doc: &str, target: usize) -> Vec<&str> {
    let target = target.max(1);
    let b = doc.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    while b.len() - start > target {
        let mut cut = None;
        let mut i = start + target;
        while i < b.len() {
            if b[i] == b'\n'
                && i > start
                && i + 1 < b.len()
                && b[i - 1].is_ascii_graphic()
                && b[i + 1].is_ascii_graphic()
            {
                cut = Some(i + 1);
                break;
            }
            i += 1;
        }
        match cut {
            Some(c) => {
                out.push(&doc[start..c]);
                start = c;
            }
            None => break,
        }
    }
    out.push(&doc[start..]);
    out
}

fn expand_inputs<P: AsRef<Path>>(inputs: &[P]) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        let input = input.as_ref();
        let meta = fs::metadata(input).map_err(|e| DataError::io(input, e))?;
        if meta.is_dir() {
            let mut txt = Vec::new();
            for entry in fs::read_dir(input).map_err(|e| DataError::io(input, e))? {
                let p = entry.map_err(|e| DataError::io(input, e))?.path();
                if p.is_file() && p.extension().is_some_and(|e| e == "txt") {
                    txt.push(p);
                }
            }
            if txt.is_empty() {
                return Err(DataError::InvalidArgument(format!(
                    "{}: directory has no *.txt files to tokenize",
                    input.display()
                )));
            }
            txt.sort();
            files.extend(txt);
        } else {
            files.push(input.to_path_buf());
        }
    }
    if files.is_empty() {
        return Err(DataError::InvalidArgument(
            "no input text files given (pass at least one file or directory)".into(),
        ));
    }
    Ok(files)
}

/// Tokenizes every document of one text, appending to `out`; returns the document count.
fn encode_text(
    text: &str,
    tok: &Tokenizer,
    opts: &BuildOptions,
    out: &mut Vec<u32>,
) -> Result<u64> {
    let docs = split_documents(text);
    let bos = tok.bos_id().filter(|&b| Some(b) != tok.eos_id());
    // Encode a bounded group of chunks at a time: parallel, but memory stays bounded.
    const GROUP: usize = 64;
    for doc in &docs {
        if let Some(b) = bos {
            out.push(b);
        }
        let chunks = if tok.newline_cuts_are_exact() {
            chunk_document(doc, opts.chunk_bytes)
        } else {
            vec![*doc]
        };
        for group in chunks.chunks(GROUP) {
            for ids in tok.encode_batch(group)? {
                out.extend_from_slice(&ids);
            }
        }
        if let Some(e) = tok.eos_id() {
            out.push(e);
        }
    }
    Ok(docs.len() as u64)
}

fn write_split(
    out_dir: &Path,
    split: Split,
    tokens: &[u32],
    vocab_size: u32,
    max_shard_tokens: u64,
) -> Result<Vec<ShardInfo>> {
    let mut infos = Vec::new();
    for (i, chunk) in tokens.chunks(max_shard_tokens as usize).enumerate() {
        let mut w = ShardWriter::create(out_dir.join(split.shard_name(i)), vocab_size)?;
        w.push(chunk)?;
        infos.push(w.finish()?);
    }
    Ok(infos)
}

/// Removes shards of `split` in `dir` that are not in `keep` (left over by an earlier run).
fn remove_stale(dir: &Path, split: Split, keep: &[ShardInfo]) -> Result<()> {
    for p in find_shards(dir, split)? {
        if !keep.iter().any(|k| k.path == p) {
            fs::remove_file(&p).map_err(|e| DataError::io(&p, e))?;
        }
    }
    Ok(())
}

/// Tokenizes `inputs` into train/val shards in `out_dir` with default options and the given
/// validation fraction. See the module docs for the rules.
pub fn build_shards<P: AsRef<Path>>(
    inputs: &[P],
    tokenizer: &Tokenizer,
    out_dir: impl AsRef<Path>,
    val_fraction: f64,
) -> Result<Summary> {
    let opts = BuildOptions {
        val_fraction,
        ..BuildOptions::default()
    };
    build_shards_with(inputs, tokenizer, out_dir, &opts)
}

/// [`build_shards`] with every option.
pub fn build_shards_with<P: AsRef<Path>>(
    inputs: &[P],
    tokenizer: &Tokenizer,
    out_dir: impl AsRef<Path>,
    opts: &BuildOptions,
) -> Result<Summary> {
    let out_dir = out_dir.as_ref();
    let f = opts.val_fraction;
    if !(f.is_finite() && (0.0..1.0).contains(&f)) {
        return Err(DataError::InvalidArgument(format!(
            "val_fraction = {f} is out of range: use a value in [0, 1), e.g. 0.05"
        )));
    }
    if opts.max_shard_tokens == 0 {
        return Err(DataError::InvalidArgument(
            "max_shard_tokens = 0: use at least 1".into(),
        ));
    }
    let files = expand_inputs(inputs)?;
    fs::create_dir_all(out_dir).map_err(|e| DataError::io(out_dir, e))?;

    let mut tokens: Vec<u32> = Vec::new();
    let mut documents = 0u64;
    let mut input_bytes = 0u64;
    for path in &files {
        let bytes = fs::read(path).map_err(|e| DataError::io(path, e))?;
        input_bytes += bytes.len() as u64;
        let text = std::str::from_utf8(&bytes).map_err(|e| DataError::NotUtf8 {
            path: path.clone(),
            offset: e.valid_up_to() as u64,
        })?;
        documents += encode_text(text, tokenizer, opts, &mut tokens)?;
    }

    let n = tokens.len() as u64;
    let n_val = if f > 0.0 {
        ((n as f64 * f).round() as u64).max(1)
    } else {
        0
    };
    if n < 2 {
        return Err(DataError::InvalidArgument(format!(
            "inputs give only {n} tokens: need at least 2; add text"
        )));
    }
    if n_val > n - 2 {
        return Err(DataError::InvalidArgument(format!(
            "val_fraction = {f} leaves only {} of {n} tokens for training: need at least 2; \
             lower val_fraction or add text",
            n - n_val.min(n)
        )));
    }
    let n_train = n - n_val;
    let vocab = tokenizer.vocab_size();
    let (train, val) = tokens.split_at(n_train as usize);
    let train_shards = write_split(out_dir, Split::Train, train, vocab, opts.max_shard_tokens)?;
    let val_shards = write_split(out_dir, Split::Val, val, vocab, opts.max_shard_tokens)?;
    remove_stale(out_dir, Split::Train, &train_shards)?;
    remove_stale(out_dir, Split::Val, &val_shards)?;

    let summary = Summary {
        inputs: files,
        tokenizer: tokenizer.name().to_string(),
        vocab_size: vocab,
        eos_id: tokenizer.eos_id(),
        bos_id: tokenizer.bos_id(),
        documents,
        input_bytes,
        tokens: n,
        train_tokens: n_train,
        val_tokens: n_val,
        val_fraction: f,
        bytes_per_token: input_bytes as f64 / n as f64,
        train_shards,
        val_shards,
    };
    let json = serde_json::to_vec_pretty(&summary).expect("summary serializes");
    write_atomic(&out_dir.join(SUMMARY_FILE), &json)?;
    Ok(summary)
}
