//! Errors of the data pipeline. Every message is one line that names the file (when there is
//! one), the problem and, where it helps, the fix.

use ferrotron_plan::error::one_line;
use std::path::{Path, PathBuf};

/// Result type of the data module.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

/// Everything that can go wrong while tokenizing, writing, reading or batching token data.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// An operating-system I/O error on `path`. The OS error is part of the message, not a
    /// `source` too, so a chain printed with `{:#}` says it once.
    #[error("{}: {error}", .path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },

    /// The file does not start with the shard magic bytes.
    #[error("{}: not a ferrotron token shard ({reason})", .path.display())]
    NotAShard { path: PathBuf, reason: String },

    /// The shard was written by a newer (or unknown) format version.
    #[error("{}: unsupported token shard version {version} (this build reads version {supported})", .path.display())]
    UnsupportedVersion {
        path: PathBuf,
        version: u32,
        supported: u32,
    },

    /// A header field holds a value that no valid shard has.
    #[error("{}: corrupt token shard header: {detail}", .path.display())]
    BadHeader { path: PathBuf, detail: String },

    /// The file is shorter than its header says.
    #[error("{}: truncated token shard: expected {expected} bytes ({what}), found {actual}", .path.display())]
    Truncated {
        path: PathBuf,
        what: String,
        expected: u64,
        actual: u64,
    },

    /// The file is longer than its header says.
    #[error("{}: token shard has {extra} unexpected trailing bytes after its {tokens} tokens", .path.display())]
    TrailingBytes {
        path: PathBuf,
        extra: u64,
        tokens: u64,
    },

    /// The token bytes do not hash to the checksum in the header.
    #[error("{}: checksum mismatch: header says {expected:#018x}, token bytes hash to {actual:#018x} (file is corrupt; rebuild it with `ferrotron data`)", .path.display())]
    ChecksumMismatch {
        path: PathBuf,
        expected: u64,
        actual: u64,
    },

    /// A token id is not below the shard's vocabulary size.
    #[error("{}: token {token} at index {index} is out of range for the shard's vocab size {vocab_size}", .path.display())]
    TokenOutOfRange {
        path: PathBuf,
        index: u64,
        token: u32,
        vocab_size: u32,
    },

    /// The shard was tokenized with a larger vocabulary than the model has.
    #[error("{}: shard vocab size {shard_vocab} is larger than the model's vocab size {model_vocab} (re-tokenize with the model's tokenizer, or set vocab_size >= {shard_vocab})", .path.display())]
    VocabTooLarge {
        path: PathBuf,
        shard_vocab: u32,
        model_vocab: u32,
    },

    /// An input text file is not valid UTF-8.
    #[error("{}: not valid UTF-8 at byte {offset} (input text files must be UTF-8)", .path.display())]
    NotUtf8 { path: PathBuf, offset: u64 },

    /// An input file holds something its reader cannot take; the message names the line or
    /// row and the fix.
    #[error("{}: {message}", .path.display())]
    BadInput { path: PathBuf, message: String },

    /// The tokenizer could not be loaded or failed to encode/decode.
    #[error("tokenizer {source_name}: {}", one_line(.message))]
    Tokenizer {
        source_name: String,
        message: String,
    },

    /// A loader state does not belong to this dataset or configuration.
    #[error("loader state does not match: {0}")]
    StateMismatch(String),

    /// A caller-supplied argument is out of range (message names the argument, value and fix).
    #[error("{0}")]
    InvalidArgument(String),
}

impl DataError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl AsRef<Path>, source: std::io::Error) -> Self {
        DataError::Io {
            path: path.as_ref().to_path_buf(),
            error: source,
        }
    }
}
