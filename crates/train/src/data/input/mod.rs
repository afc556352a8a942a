//! The documents of `ferrotron data`'s inputs, read as a stream.
//!
//! Formats, by file name:
//! - `.txt` (also `.txt.gz`, `.txt.zst`, and any explicitly named file of another name): UTF-8
//!   text, documents separated by [`DOC_SEPARATOR`](super::build::DOC_SEPARATOR) ([`text`]);
//! - `.jsonl` / `.jsonl.gz` / `.jsonl.zst`: one JSON object per line, the document in its text
//!   field ([`jsonl`]);
//! - `.parquet`: the text column of every row, row group by row group ([`parquet`]).
//!
//! A directory stands for every file of these formats under it, recursively, in name order
//! (each directory's entries sorted by name, as `find | sort` would list them).
//!
//! Every reader hands the documents to a sink as [`Piece`]s, in order, holding at most one
//! document (or, for text files and tokenizers whose newline cuts are exact, one piece of
//! about `max_piece` bytes) besides its read buffers. Bad input is an error of one line naming
//! the file, the line or row, and the fix.

pub mod jsonl;
pub mod parquet;
pub mod text;

use std::cell::Cell;
use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use super::error::{DataError, Result};

/// How a file is read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Text,
    JsonLines,
    Parquet,
}

/// How a file's bytes are compressed (text and JSON Lines only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    Gzip,
    Zstd,
}

impl Compression {
    /// The name used in messages.
    pub fn name(self) -> &'static str {
        match self {
            Compression::None => "plain",
            Compression::Gzip => "gzip",
            Compression::Zstd => "zstd",
        }
    }
}

/// The format and compression a file name says, or `None` for a name no reader claims.
pub fn format_of(path: &Path) -> Option<(Format, Compression)> {
    let name = path.file_name()?.to_str()?.to_ascii_lowercase();
    let (stem, comp) = if let Some(s) = name.strip_suffix(".gz") {
        (s, Compression::Gzip)
    } else if let Some(s) = name.strip_suffix(".zst") {
        (s, Compression::Zstd)
    } else {
        (name.as_str(), Compression::None)
    };
    if stem.ends_with(".txt") {
        Some((Format::Text, comp))
    } else if stem.ends_with(".jsonl") {
        Some((Format::JsonLines, comp))
    } else if stem.ends_with(".parquet") && comp == Compression::None {
        Some((Format::Parquet, comp))
    } else {
        None
    }
}

/// One input of a build: a file on disk or bytes already in memory (the bundled corpus).
#[derive(Debug, Clone)]
pub struct Source {
    /// The path in messages and in the summary.
    pub path: PathBuf,
    pub format: Format,
    pub compression: Compression,
    /// Bytes to read instead of the file at `path`.
    pub bytes: Option<&'static [u8]>,
    /// Size in bytes as stored (compressed when compressed), for the progress bar.
    pub size: u64,
}

impl Source {
    /// In-memory UTF-8 text named `name` (read as a `.txt` file).
    pub fn text(name: &str, bytes: &'static [u8]) -> Self {
        Source {
            path: PathBuf::from(name),
            format: Format::Text,
            compression: Compression::None,
            bytes: Some(bytes),
            size: bytes.len() as u64,
        }
    }
}

fn source_of(path: PathBuf, explicit: bool) -> Result<Option<Source>> {
    let (format, compression) = match format_of(&path) {
        Some(f) => f,
        // A file named on the command line is text whatever its name (as before formats).
        None if explicit => (Format::Text, Compression::None),
        None => return Ok(None),
    };
    let size = fs::metadata(&path)
        .map_err(|e| DataError::io(&path, e))?
        .len();
    Ok(Some(Source {
        path,
        format,
        compression,
        bytes: None,
        size,
    }))
}

fn walk(dir: &Path, out: &mut Vec<Source>) -> Result<()> {
    let mut entries = Vec::new();
    for entry in fs::read_dir(dir).map_err(|e| DataError::io(dir, e))? {
        entries.push(entry.map_err(|e| DataError::io(dir, e))?.path());
    }
    entries.sort();
    for p in entries {
        let meta = fs::metadata(&p).map_err(|e| DataError::io(&p, e))?;
        if meta.is_dir() {
            walk(&p, out)?;
        } else if let Some(s) = source_of(p, false)? {
            out.push(s);
        }
    }
    Ok(())
}

/// The sources of `inputs`: files as given, directories expanded recursively in name order.
pub fn expand<P: AsRef<Path>>(inputs: &[P]) -> Result<Vec<Source>> {
    let mut out = Vec::new();
    for input in inputs {
        let input = input.as_ref();
        let meta = fs::metadata(input).map_err(|e| DataError::io(input, e))?;
        if meta.is_dir() {
            let before = out.len();
            walk(input, &mut out)?;
            if out.len() == before {
                return Err(DataError::InvalidArgument(format!(
                    "{}: directory has no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet files \
                     to tokenize",
                    input.display()
                )));
            }
        } else if let Some(s) = source_of(input.to_path_buf(), true)? {
            out.push(s);
        }
    }
    if out.is_empty() {
        return Err(DataError::InvalidArgument(
            "no input text files given (pass at least one file or directory)".into(),
        ));
    }
    Ok(out)
}

/// A part of a document, in stream order. A document is one or more pieces: the first has
/// `first`, the last has `last` (a whole document has both).
#[derive(Debug, Clone, Copy)]
pub struct Piece<'a> {
    pub text: &'a str,
    pub first: bool,
    pub last: bool,
}

/// What every reader needs: where pieces go, and the reading options.
pub struct ReadContext<'s> {
    /// Receives the pieces in order.
    pub sink: &'s mut dyn FnMut(Piece<'_>) -> Result<()>,
    /// Cut text documents into pieces of about this many bytes (0: never cut).
    pub max_piece: usize,
    /// JSON Lines field / Parquet column holding the text.
    pub text_field: &'s str,
    /// Stored bytes of the current source read so far (for the progress bar).
    pub bytes_read: Rc<Cell<u64>>,
}

/// Counts the bytes read through it into a shared cell.
pub struct Counting<R> {
    inner: R,
    count: Rc<Cell<u64>>,
}

impl<R: io::Read> io::Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.count.set(self.count.get() + n as u64);
        Ok(n)
    }
}

/// The decompressed byte stream of a text or JSON Lines source.
pub fn open_stream(src: &Source, count: Rc<Cell<u64>>) -> Result<Box<dyn io::Read>> {
    let raw: Box<dyn io::Read> = match src.bytes {
        Some(b) => Box::new(b),
        None => Box::new(File::open(&src.path).map_err(|e| DataError::io(&src.path, e))?),
    };
    let counted = Counting { inner: raw, count };
    Ok(match src.compression {
        Compression::None => Box::new(counted),
        // Multi-member: `cat a.gz b.gz` and bgzip files are one stream (RFC 1952 §2.2).
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(io::BufReader::new(
            counted,
        ))),
        Compression::Zstd => Box::new(
            zstd::stream::read::Decoder::new(counted).map_err(|e| DataError::io(&src.path, e))?,
        ),
    })
}

/// The error for an I/O failure while reading `src` at `at` (e.g. "line 7"): a truncated or
/// corrupt compressed stream gets its own message with the fix.
pub fn read_error(src: &Source, at: &str, e: io::Error) -> DataError {
    let corrupt = matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::InvalidData
            | io::ErrorKind::InvalidInput
            // zstd reports a damaged frame as `Other` ("Data corruption detected").
            | io::ErrorKind::Other
    );
    if src.compression != Compression::None && corrupt {
        return DataError::BadInput {
            path: src.path.clone(),
            message: format!(
                "{at}: the {} stream is truncated or corrupt ({e}): re-download or re-compress the file",
                src.compression.name()
            ),
        };
    }
    DataError::io(&src.path, e)
}

/// What reading one source gave.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Read {
    /// Documents handed on (empty ones are not).
    pub documents: u64,
    /// UTF-8 bytes of text: a text file's whole content (separators included, uncompressed),
    /// the text fields of JSON Lines and Parquet records.
    pub text_bytes: u64,
}

/// Reads every document of `src` into `cx.sink`.
pub fn read_source(src: &Source, cx: &mut ReadContext<'_>) -> Result<Read> {
    match src.format {
        Format::Text => text::read(src, cx),
        Format::JsonLines => jsonl::read(src, cx),
        Format::Parquet => parquet::read(src, cx),
    }
}
