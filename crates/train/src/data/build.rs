//! Input files → token shards (`ferrotron data`, and the trainer's first run on the bundled
//! corpus): one streaming pipeline with bounded memory.
//!
//! Rules:
//! - Inputs are `.txt`, `.jsonl`, `.jsonl.gz`, `.jsonl.zst` and `.parquet` files, or
//!   directories of them (recursive, name order); see [`super::input`] for how each is read.
//! - In text files, documents are separated by [`DOC_SEPARATOR`] (`<|endoftext|>`, as in
//!   GPT-2 style corpora); one newline at each end of a document is dropped (the line breaks
//!   around a separator line, and a file's final newline). In JSON Lines and Parquet every
//!   record's text field is a document. Empty documents are dropped.
//! - Each document is encoded on its own; the tokenizer's EOS (if any) follows every document,
//!   and its BOS (if any, and different from EOS) precedes it.
//! - The last `val_fraction` of the token stream (rounded, at least one token when the fraction
//!   is positive) goes to the validation split, the rest to the training split. Each split is
//!   written as shards of at most [`BuildOptions::max_shard_tokens`] tokens named
//!   `train_0000.tok`, `val_0000.tok`, ... (u16 tokens, u32 when the vocabulary has more than
//!   65,536 ids); a `summary.json` describes the result. Old shards of the same naming pattern
//!   left in `out_dir` by an earlier run are removed afterwards.
//!
//! Long documents are encoded in chunks of about [`BuildOptions::chunk_bytes`] bytes, cut
//! right after a newline that sits between two visible ASCII characters. For GPT-2 style
//! byte-level pre-tokenization (whose pieces never span such a newline) this gives exactly
//! the tokens of encoding the whole document, and it lets chunks encode in parallel. It is
//! only done when [`Tokenizer::newline_cuts_are_exact`] holds for the tokenizer (checked on
//! probe texts at load; e.g. SentencePiece-style tokenizers that prepend a space marker to
//! each input fail it and get whole documents).
//!
//! Streaming, and the memory bound: the readers hand documents on as they read them; about
//! [`BuildOptions::batch_bytes`] of text is gathered, encoded on every core at once
//! (`tokenizers`' batch encoding on the rayon pool), and its tokens appended to the on-disk
//! stream of [`super::spool`], which places the validation split when the input ends. Nothing
//! grows with the input: peak memory is the tokenizer, one batch of text with its encodings in
//! flight (the Hugging Face `Encoding`s cost tens of bytes per input byte, which is what the
//! batch size bounds), and fixed read and write buffers. Measured peak RSS of `ferrotron data`
//! stays under [`MEMORY_BOUND_MIB`] MiB with the defaults (docs/BENCHMARKS.md, "Tokenizing").
//! The bound assumes no single document larger than a batch that cannot be cut: a JSON Lines
//! line, a Parquet value, or a text document without the newlines above (or any text
//! document, for a tokenizer whose newline cuts are not exact) is held whole.

use std::cell::Cell;
use std::fs;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use serde::{Deserialize, Serialize};

use super::error::{DataError, Result};
use super::input::{self, Piece, ReadContext, Source};
use super::progress::Progress;
use super::shard::{remove_orphan_temps, write_atomic, ShardInfo, SHARD_EXT};
use super::spool::Spool;
use super::tokenizer::Tokenizer;

/// Peak RSS, in MiB, that a build stays under with the default [`BuildOptions`] and the
/// bundled tokenizer, whatever the input size: measured 52-63 MiB for `ferrotron data` on
/// inputs from 5 MiB to 2 GiB (docs/BENCHMARKS.md, "Tokenizing"); the margin covers a batch
/// whose chunks are all in flight at once on a machine with many cores (the `Encoding`s and
/// pre-tokenizer buffers of `tokenizers` take up to about 75 bytes per byte of text in flight,
/// 75 MiB for a 1 MiB batch).
pub const MEMORY_BOUND_MIB: u64 = 128;

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
    /// Text gathered before a batch is encoded (on every core at once); with the encodings in
    /// flight, this is what bounds the memory of a build.
    pub batch_bytes: usize,
    /// JSON Lines field / Parquet column that holds the document text.
    pub text_field: String,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            val_fraction: 0.05,
            max_shard_tokens: 1 << 28,
            chunk_bytes: 1 << 15,
            batch_bytes: 1 << 20,
            text_field: "text".into(),
            progress: false,
        }
    }
}

/// What [`build_shards`] did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    /// Files read, in order.
    pub inputs: Vec<PathBuf>,
    pub tokenizer: String,
    pub vocab_size: u32,
    pub eos_id: Option<u32>,
    pub bos_id: Option<u32>,
    pub documents: u64,
    /// UTF-8 bytes of text read: whole text files (separators included), the text fields of
    /// JSON Lines and Parquet records.
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

/// Gathers pieces of documents into batches, encodes each batch on every core, and appends
/// the tokens (with BOS/EOS around documents) to the stream.
struct Encoder<'t> {
    tok: &'t Tokenizer,
    /// Long pieces may be cut at newlines (see the module docs).
    cut: bool,
    chunk_bytes: usize,
    batch_bytes: usize,
    bos: Option<u32>,
    eos: Option<u32>,
    /// The batch's text, and each piece's byte range in it with its first/last flags.
    text: String,
    pieces: Vec<(usize, usize, bool, bool)>,
    ids: Vec<u32>,
    spool: Spool,
    progress: Progress,
    /// Stored bytes of the sources before the current one, and of the current one so far.
    bytes_before: u64,
    bytes_read: Rc<Cell<u64>>,
}

impl Encoder<'_> {
    fn add(&mut self, p: Piece<'_>) -> Result<()> {
        let start = self.text.len();
        self.text.push_str(p.text);
        self.pieces.push((start, self.text.len(), p.first, p.last));
        if self.text.len() >= self.batch_bytes {
            self.flush()?;
        }
        Ok(())
    }

    fn flush(&mut self) -> Result<()> {
        if self.pieces.is_empty() {
            return Ok(());
        }
        let mut chunks: Vec<&str> = Vec::new();
        let mut counts = Vec::with_capacity(self.pieces.len());
        for &(s, e, _, _) in &self.pieces {
            let t = &self.text[s..e];
            let before = chunks.len();
            if self.cut {
                chunks.extend(chunk_document(t, self.chunk_bytes));
            } else {
                chunks.push(t);
            }
            counts.push(chunks.len() - before);
        }
        let encoded = self.tok.encode_batch(&chunks)?;
        drop(chunks);
        let mut enc = encoded.iter();
        self.ids.clear();
        for (&(_, _, first, last), n) in self.pieces.iter().zip(counts) {
            if let (true, Some(b)) = (first, self.bos) {
                self.ids.push(b);
            }
            for ids in enc.by_ref().take(n) {
                self.ids.extend_from_slice(ids);
            }
            if let (true, Some(e)) = (last, self.eos) {
                self.ids.push(e);
            }
        }
        drop(encoded);
        self.spool.push(&self.ids)?;
        self.text.clear();
        self.pieces.clear();
        self.progress
            .update(self.bytes_before + self.bytes_read.get(), self.spool.len());
        Ok(())
    }
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
    check_options(opts)?;
    let sources = input::expand(inputs)?;
    build_shards_from(&sources, tokenizer, out_dir, opts)
}

fn check_options(opts: &BuildOptions) -> Result<()> {
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
    if opts.text_field.is_empty() {
        return Err(DataError::InvalidArgument(
            "text field is empty: name the JSON field or Parquet column that holds the text, \
             e.g. --text-field text"
                .into(),
        ));
    }
    Ok(())
}

/// [`build_shards_with`] over sources already listed (files, or text in memory such as the
/// bundled corpus): the one streaming path of every build.
pub fn build_shards_from(
    sources: &[Source],
    tokenizer: &Tokenizer,
    out_dir: impl AsRef<Path>,
    opts: &BuildOptions,
) -> Result<Summary> {
    check_options(opts)?;
    let out_dir = out_dir.as_ref();
    if sources.is_empty() {
        return Err(DataError::InvalidArgument(
            "no input text files given (pass at least one file or directory)".into(),
        ));
    }
    fs::create_dir_all(out_dir).map_err(|e| DataError::io(out_dir, e))?;
    remove_orphan_temps(out_dir)?;

    let vocab = tokenizer.vocab_size();
    let total: u64 = sources.iter().map(|s| s.size).sum();
    let bytes_read = Rc::new(Cell::new(0));
    let mut enc = Encoder {
        tok: tokenizer,
        cut: tokenizer.newline_cuts_are_exact(),
        chunk_bytes: opts.chunk_bytes.max(1),
        batch_bytes: opts.batch_bytes.max(1),
        bos: tokenizer
            .bos_id()
            .filter(|&b| Some(b) != tokenizer.eos_id()),
        eos: tokenizer.eos_id(),
        text: String::new(),
        pieces: Vec::new(),
        ids: Vec::new(),
        spool: Spool::new(out_dir, vocab, opts.max_shard_tokens),
        progress: Progress::new(total, opts.progress),
        bytes_before: 0,
        bytes_read: bytes_read.clone(),
    };
    let mut documents = 0u64;
    let mut input_bytes = 0u64;
    for src in sources {
        bytes_read.set(0);
        let mut sink = |p: Piece<'_>| enc.add(p);
        let mut cx = ReadContext {
            sink: &mut sink,
            max_piece: if tokenizer.newline_cuts_are_exact() {
                opts.chunk_bytes.max(1)
            } else {
                0
            },
            text_field: &opts.text_field,
            bytes_read: bytes_read.clone(),
        };
        let read = input::read_source(src, &mut cx)?;
        documents += read.documents;
        input_bytes += read.text_bytes;
        enc.bytes_before += src.size;
        bytes_read.set(0);
    }
    enc.flush()?;
    enc.progress.finish();

    let n = enc.spool.len();
    let f = opts.val_fraction;
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
    let (train_shards, val_shards) = enc.spool.finish(n_train)?;
    remove_stale(out_dir, Split::Train, &train_shards)?;
    remove_stale(out_dir, Split::Val, &val_shards)?;

    let summary = Summary {
        inputs: sources.iter().map(|s| s.path.clone()).collect(),
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
