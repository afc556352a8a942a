//! Token shards: a small fixed little-endian header followed by the tokens.
//!
//! ```text
//! offset size field
//!      0    8 magic        b"FTRNTOK1"
//!      8    4 version      u32 = 1
//!     12    4 vocab_size   u32, every token is < vocab_size
//!     16    4 token_width  u32, bytes per token: 2 (u16, vocab_size <= 65536) or 4 (u32)
//!     20    4 reserved     u32 = 0
//!     24    8 token_count  u64
//!     32    8 checksum     u64, FNV-1a 64 of the token bytes exactly as stored
//!     40    8 reserved     u64 = 0
//!     48      tokens       token_count little-endian u16 or u32
//! ```
//!
//! The writer never leaves a half-written shard behind: it writes to a temporary file in the
//! destination directory, fsyncs it and renames it into place on [`ShardWriter::finish`]; a
//! writer dropped before that (an error, a panic) deletes its temporary file.
//!
//! The reader memory-maps the file and validates magic, version, header fields, exact size,
//! checksum and token range before handing out a single token, so a bad file is a one-line
//! error naming the file and the problem, never a panic.

use std::fs::{self, File};
use std::io::{BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use super::error::{DataError, Result};

/// The 8 magic bytes every shard starts with.
pub const MAGIC: &[u8; 8] = b"FTRNTOK1";
/// The format version this build writes and reads.
pub const VERSION: u32 = 1;
/// Size of the fixed header in bytes; tokens start here (aligned for u16 and u32).
pub const HEADER_LEN: usize = 48;
/// File extension of token shards.
pub const SHARD_EXT: &str = "tok";

/// FNV-1a 64-bit hash (<http://www.isthe.com/chongo/tech/comp/fnv/>), used as the shard
/// checksum. Streaming: feed bytes with [`Fnv1a64::update`].
#[derive(Debug, Clone, Copy)]
pub struct Fnv1a64(u64);

impl Fnv1a64 {
    const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;

    /// A hasher in its initial state.
    pub fn new() -> Self {
        Fnv1a64(Self::OFFSET_BASIS)
    }

    /// Feeds `bytes` into the hash.
    pub fn update(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        for &b in bytes {
            h ^= u64::from(b);
            h = h.wrapping_mul(Self::PRIME);
        }
        self.0 = h;
    }

    /// The hash of everything fed so far.
    pub fn finish(&self) -> u64 {
        self.0
    }

    /// One-shot hash of `bytes`.
    pub fn hash(bytes: &[u8]) -> u64 {
        let mut h = Self::new();
        h.update(bytes);
        h.finish()
    }
}

impl Default for Fnv1a64 {
    fn default() -> Self {
        Self::new()
    }
}

/// How tokens are stored on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// 2 bytes per token; used when the vocab size is at most 65536.
    U16,
    /// 4 bytes per token.
    U32,
}

impl TokenDtype {
    /// The narrowest dtype that holds every token of a `vocab_size` vocabulary.
    pub fn for_vocab(vocab_size: u32) -> Self {
        if vocab_size <= 1 << 16 {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }
}

/// What a shard holds, as written by [`ShardWriter`] or read by [`Shard::open`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub path: PathBuf,
    pub vocab_size: u32,
    pub dtype: TokenDtype,
    pub tokens: u64,
    pub checksum: u64,
    /// File size in bytes (header included).
    pub bytes: u64,
}

fn encode_header(
    vocab_size: u32,
    dtype: TokenDtype,
    tokens: u64,
    checksum: u64,
) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[0..8].copy_from_slice(MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&vocab_size.to_le_bytes());
    h[16..20].copy_from_slice(&(dtype.width() as u32).to_le_bytes());
    h[24..32].copy_from_slice(&tokens.to_le_bytes());
    h[32..40].copy_from_slice(&checksum.to_le_bytes());
    h
}

static TMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary sibling of `path` (same directory, so the final rename is atomic).
pub(crate) fn temp_path_for(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "shard".into());
    let n = TMP_COUNTER.fetch_add(1, Ordering::Relaxed);
    path.with_file_name(format!(".{name}.{}.{n}.tmp", std::process::id()))
}

/// Writes `bytes` to `path` atomically (temporary file, fsync, rename).
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path_for(path);
    let res = (|| {
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if let Err(e) = res {
        let _ = fs::remove_file(&tmp);
        return Err(DataError::io(path, e));
    }
    Ok(())
}

/// Streams tokens into a new shard. Nothing appears at `path` until [`ShardWriter::finish`]
/// succeeds; dropping the writer earlier removes its temporary file.
pub struct ShardWriter {
    path: PathBuf,
    tmp: PathBuf,
    file: Option<BufWriter<File>>,
    vocab_size: u32,
    dtype: TokenDtype,
    tokens: u64,
    hasher: Fnv1a64,
    scratch: Vec<u8>,
}

impl ShardWriter {
    /// Starts a shard at `path` for tokens of a `vocab_size` vocabulary (the dtype follows
    /// from it: u16 up to 65536, u32 above).
    pub fn create(path: impl AsRef<Path>, vocab_size: u32) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if vocab_size == 0 {
            return Err(DataError::InvalidArgument(format!(
                "{}: vocab_size must be at least 1",
                path.display()
            )));
        }
        let tmp = temp_path_for(&path);
        let file = File::create(&tmp).map_err(|e| DataError::io(&tmp, e))?;
        let mut file = BufWriter::with_capacity(1 << 20, file);
        let dtype = TokenDtype::for_vocab(vocab_size);
        // Placeholder header; the real one is written by `finish`.
        let res = file.write_all(&[0u8; HEADER_LEN]);
        let mut w = ShardWriter {
            path,
            tmp,
            file: Some(file),
            vocab_size,
            dtype,
            tokens: 0,
            hasher: Fnv1a64::new(),
            scratch: Vec::new(),
        };
        res.map_err(|e| DataError::io(&w.tmp, e))?;
        w.scratch.reserve(1 << 16);
        Ok(w)
    }

    /// The final path of the shard.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Number of tokens pushed so far.
    pub fn len(&self) -> u64 {
        self.tokens
    }

    /// True when no token has been pushed yet.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// Appends tokens. Every token must be below the vocab size.
    pub fn push(&mut self, tokens: &[u32]) -> Result<()> {
        self.scratch.clear();
        for (i, &t) in tokens.iter().enumerate() {
            if t >= self.vocab_size {
                return Err(DataError::TokenOutOfRange {
                    path: self.path.clone(),
                    index: self.tokens + i as u64,
                    token: t,
                    vocab_size: self.vocab_size,
                });
            }
            match self.dtype {
                TokenDtype::U16 => self.scratch.extend_from_slice(&(t as u16).to_le_bytes()),
                TokenDtype::U32 => self.scratch.extend_from_slice(&t.to_le_bytes()),
            }
        }
        self.hasher.update(&self.scratch);
        let file = self.file.as_mut().expect("writer is open until finish");
        file.write_all(&self.scratch)
            .map_err(|e| DataError::io(&self.tmp, e))?;
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    /// Writes the header, syncs and renames the shard into place.
    pub fn finish(mut self) -> Result<ShardInfo> {
        let checksum = self.hasher.finish();
        let header = encode_header(self.vocab_size, self.dtype, self.tokens, checksum);
        let file = self.file.take().expect("writer is open until finish");
        let tmp = self.tmp.clone();
        let res = (|| -> std::io::Result<()> {
            let mut f = file.into_inner().map_err(|e| e.into_error())?;
            f.seek(SeekFrom::Start(0))?;
            f.write_all(&header)?;
            f.sync_all()?;
            Ok(())
        })();
        res.map_err(|e| DataError::io(&tmp, e))?;
        fs::rename(&tmp, &self.path).map_err(|e| DataError::io(&self.path, e))?;
        Ok(ShardInfo {
            path: self.path.clone(),
            vocab_size: self.vocab_size,
            dtype: self.dtype,
            tokens: self.tokens,
            checksum,
            bytes: HEADER_LEN as u64 + self.tokens * self.dtype.width() as u64,
        })
        // Drop runs next: the temporary file is already renamed, so removing it is a no-op.
    }

    /// Flushes and closes the temporary file without publishing it: the shard waits, holding no
    /// buffer, until [`SealedShard::finish_split`] decides how many of its tokens it keeps
    /// (the streaming build seals each full shard before it knows where validation starts).
    pub(crate) fn seal(mut self) -> Result<SealedShard> {
        let file = self.file.take().expect("writer is open until finish");
        let res = file
            .into_inner()
            .map_err(|e| e.into_error())
            .and_then(|f| f.sync_all());
        res.map_err(|e| DataError::io(&self.tmp, e))?;
        Ok(SealedShard {
            path: self.path.clone(),
            tmp: std::mem::take(&mut self.tmp),
            vocab_size: self.vocab_size,
            dtype: self.dtype,
            tokens: self.tokens,
            checksum: self.hasher.finish(),
        })
        // Drop of `self` removes `self.tmp`, now an empty path: a no-op.
    }
}

/// A complete but unpublished shard: its tokens are in a temporary file next to `path`, with a
/// placeholder header. Dropping it removes the file.
pub(crate) struct SealedShard {
    path: PathBuf,
    tmp: PathBuf,
    vocab_size: u32,
    dtype: TokenDtype,
    tokens: u64,
    checksum: u64,
}

/// Tokens read back from a temporary shard at a time (256 KiB of u16).
const READ_BACK_TOKENS: usize = 1 << 17;

impl SealedShard {
    /// Number of tokens in the file.
    pub(crate) fn len(&self) -> u64 {
        self.tokens
    }

    /// Publishes the first `keep` tokens as the shard at its path and hands the tokens after
    /// them, in order, to `tail` (read back from the file in blocks of [`READ_BACK_TOKENS`]).
    /// `keep == 0` publishes nothing and returns `None`. A shorter shard is truncated in place
    /// and its checksum recomputed over what it keeps.
    pub(crate) fn finish_split(
        mut self,
        keep: u64,
        tail: &mut dyn FnMut(&[u32]) -> Result<()>,
    ) -> Result<Option<ShardInfo>> {
        let keep = keep.min(self.tokens);
        let w = self.dtype.width() as u64;
        let io = |e| DataError::io(&self.tmp, e);
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&self.tmp)
            .map_err(io)?;
        if keep < self.tokens {
            file.seek(SeekFrom::Start(HEADER_LEN as u64 + keep * w))
                .map_err(io)?;
            let mut r = BufReader::with_capacity(1 << 16, &mut file);
            let mut bytes = vec![0u8; READ_BACK_TOKENS * w as usize];
            let mut ids = Vec::with_capacity(READ_BACK_TOKENS);
            let mut left = self.tokens - keep;
            while left > 0 {
                let n = left.min(READ_BACK_TOKENS as u64) as usize;
                let b = &mut bytes[..n * w as usize];
                r.read_exact(b).map_err(io)?;
                ids.clear();
                decode_tokens(self.dtype, b, &mut ids);
                tail(&ids)?;
                left -= n as u64;
            }
        }
        if keep == 0 {
            return Ok(None);
        }
        let checksum = if keep == self.tokens {
            self.checksum
        } else {
            file.set_len(HEADER_LEN as u64 + keep * w).map_err(io)?;
            file.seek(SeekFrom::Start(HEADER_LEN as u64)).map_err(io)?;
            let mut h = Fnv1a64::new();
            let mut r = BufReader::with_capacity(1 << 16, &mut file);
            let mut block = vec![0u8; 1 << 16];
            let mut left = keep * w;
            while left > 0 {
                let n = left.min(block.len() as u64) as usize;
                r.read_exact(&mut block[..n]).map_err(io)?;
                h.update(&block[..n]);
                left -= n as u64;
            }
            h.finish()
        };
        let header = encode_header(self.vocab_size, self.dtype, keep, checksum);
        file.seek(SeekFrom::Start(0)).map_err(io)?;
        file.write_all(&header).map_err(io)?;
        file.sync_all().map_err(io)?;
        drop(file);
        fs::rename(&self.tmp, &self.path).map_err(|e| DataError::io(&self.path, e))?;
        self.tmp = PathBuf::new();
        Ok(Some(ShardInfo {
            path: self.path.clone(),
            vocab_size: self.vocab_size,
            dtype: self.dtype,
            tokens: keep,
            checksum,
            bytes: HEADER_LEN as u64 + keep * w,
        }))
    }
}

impl Drop for SealedShard {
    fn drop(&mut self) {
        if !self.tmp.as_os_str().is_empty() {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Appends the little-endian tokens of `bytes` to `out`.
fn decode_tokens(dtype: TokenDtype, bytes: &[u8], out: &mut Vec<u32>) {
    match dtype {
        TokenDtype::U16 => out.extend(
            bytes
                .chunks_exact(2)
                .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))),
        ),
        TokenDtype::U32 => out.extend(
            bytes
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        ),
    }
}

/// Removes temporary shard and summary files (`.NAME.PID.N.tmp`) that a process which no
/// longer runs left in `dir` (it was killed before it could publish or delete them). Files of
/// a live process are left alone, so two builds never delete each other's work. Liveness is
/// read from `/proc`; where there is none, nothing is removed.
pub(crate) fn remove_orphan_temps(dir: &Path) -> Result<()> {
    if !Path::new("/proc/self").exists() {
        return Ok(());
    }
    let Ok(entries) = fs::read_dir(dir) else {
        return Ok(());
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(pid) = temp_owner(name) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let p = entry.path();
            fs::remove_file(&p).map_err(|e| DataError::io(&p, e))?;
        }
    }
    Ok(())
}

/// The process id in a temporary name made by [`temp_path_for`] (`.NAME.PID.N.tmp`).
fn temp_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix('.')?.strip_suffix(".tmp")?;
    let mut parts = rest.rsplitn(3, '.');
    let n = parts.next()?;
    let pid = parts.next()?;
    let _base = parts.next()?;
    (n.bytes().all(|b| b.is_ascii_digit()) && !n.is_empty()).then_some(())?;
    pid.parse().ok()
}

impl Drop for ShardWriter {
    fn drop(&mut self) {
        // Unfinished (error or early drop): leave nothing behind.
        drop(self.file.take());
        let _ = fs::remove_file(&self.tmp);
    }
}

/// Writes `tokens` as one shard at `path` (atomically).
pub fn write_shard(path: impl AsRef<Path>, vocab_size: u32, tokens: &[u32]) -> Result<ShardInfo> {
    let mut w = ShardWriter::create(path, vocab_size)?;
    for chunk in tokens.chunks(1 << 16) {
        w.push(chunk)?;
    }
    w.finish()
}

/// A validated, memory-mapped token shard.
pub struct Shard {
    info: ShardInfo,
    map: Mmap,
}

impl std::fmt::Debug for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shard").field("info", &self.info).finish()
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

impl Shard {
    /// Opens and fully validates a shard (magic, version, header fields, size, checksum,
    /// token range). The whole file is read once for the checksum.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let p = || path.to_path_buf();
        let file = File::open(path).map_err(|e| DataError::io(path, e))?;
        let meta = file.metadata().map_err(|e| DataError::io(path, e))?;
        if !meta.is_file() {
            return Err(DataError::NotAShard {
                path: p(),
                reason: "not a regular file".into(),
            });
        }
        let actual = meta.len();
        if actual == 0 {
            return Err(DataError::NotAShard {
                path: p(),
                reason: "empty file".into(),
            });
        }
        // SAFETY: the map is read-only; like every mmap reader we assume the file is not
        // truncated or rewritten by another process while mapped (shards are written once,
        // atomically, and never modified in place).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| DataError::io(path, e))?;
        let b: &[u8] = &map;
        let m = b.len().min(MAGIC.len());
        if b[..m] != MAGIC[..m] {
            return Err(DataError::NotAShard {
                path: p(),
                reason: format!(
                    "bad magic bytes \"{}\", expected \"FTRNTOK1\"",
                    b[..m].escape_ascii()
                ),
            });
        }
        if b.len() < HEADER_LEN {
            return Err(DataError::Truncated {
                path: p(),
                what: "the header".into(),
                expected: HEADER_LEN as u64,
                actual,
            });
        }
        let version = u32_at(b, 8);
        if version != VERSION {
            return Err(DataError::UnsupportedVersion {
                path: p(),
                version,
                supported: VERSION,
            });
        }
        let vocab_size = u32_at(b, 12);
        let width = u32_at(b, 16);
        let tokens = u64_at(b, 24);
        let checksum = u64_at(b, 32);
        let bad = |detail: String| DataError::BadHeader { path: p(), detail };
        if vocab_size == 0 {
            return Err(bad("vocab size is 0".into()));
        }
        let dtype = match width {
            2 => TokenDtype::U16,
            4 => TokenDtype::U32,
            w => return Err(bad(format!("token width {w} bytes (expected 2 or 4)"))),
        };
        if dtype == TokenDtype::U16 && vocab_size > 1 << 16 {
            return Err(bad(format!(
                "vocab size {vocab_size} does not fit u16 tokens"
            )));
        }
        let expected = tokens
            .checked_mul(width as u64)
            .and_then(|n| n.checked_add(HEADER_LEN as u64))
            .ok_or_else(|| bad(format!("token count {tokens} overflows the file size")))?;
        if actual < expected {
            return Err(DataError::Truncated {
                path: p(),
                what: format!("header + {tokens} tokens of {width} bytes"),
                expected,
                actual,
            });
        }
        if actual > expected {
            return Err(DataError::TrailingBytes {
                path: p(),
                extra: actual - expected,
                tokens,
            });
        }
        let body = &b[HEADER_LEN..];
        let got = Fnv1a64::hash(body);
        if got != checksum {
            return Err(DataError::ChecksumMismatch {
                path: p(),
                expected: checksum,
                actual: got,
            });
        }
        if let Some((i, token)) = out_of_range(body, dtype, vocab_size) {
            return Err(DataError::TokenOutOfRange {
                path: p(),
                index: i as u64,
                token,
                vocab_size,
            });
        }
        Ok(Shard {
            info: ShardInfo {
                path: p(),
                vocab_size,
                dtype,
                tokens,
                checksum,
                bytes: actual,
            },
            map,
        })
    }

    /// Opens a shard and checks that its vocabulary fits a model with `model_vocab` entries.
    pub fn open_for_model(path: impl AsRef<Path>, model_vocab: u32) -> Result<Self> {
        let s = Self::open(path)?;
        s.check_vocab(model_vocab)?;
        Ok(s)
    }

    /// Errors unless the shard's vocab size is at most `model_vocab`.
    pub fn check_vocab(&self, model_vocab: u32) -> Result<()> {
        if self.info.vocab_size > model_vocab {
            return Err(DataError::VocabTooLarge {
                path: self.info.path.clone(),
                shard_vocab: self.info.vocab_size,
                model_vocab,
            });
        }
        Ok(())
    }

    /// Header facts of this shard.
    pub fn info(&self) -> &ShardInfo {
        &self.info
    }

    /// The path it was opened from.
    pub fn path(&self) -> &Path {
        &self.info.path
    }

    /// Number of tokens.
    pub fn len(&self) -> u64 {
        self.info.tokens
    }

    /// True when the shard holds no token.
    pub fn is_empty(&self) -> bool {
        self.info.tokens == 0
    }

    /// Vocab size recorded in the header (every token is below it).
    pub fn vocab_size(&self) -> u32 {
        self.info.vocab_size
    }

    /// Token at index `i`. Panics if `i >= len()` (a caller bug, not a file problem).
    pub fn get(&self, i: u64) -> u32 {
        let mut out = [0u32];
        self.read_into(i, &mut out);
        out[0]
    }

    /// Copies `out.len()` tokens starting at `start` into `out`.
    /// Panics if the range is out of bounds (a caller bug, not a file problem).
    pub fn read_into(&self, start: u64, out: &mut [u32]) {
        let end = start
            .checked_add(out.len() as u64)
            .filter(|&e| e <= self.info.tokens)
            .unwrap_or_else(|| {
                panic!(
                    "token range {start}+{} out of bounds for {} ({} tokens)",
                    out.len(),
                    self.info.path.display(),
                    self.info.tokens
                )
            });
        let w = self.info.dtype.width();
        let bytes = &self.map[HEADER_LEN + start as usize * w..HEADER_LEN + end as usize * w];
        match self.info.dtype {
            TokenDtype::U16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = u32::from(u16::from_le_bytes([c[0], c[1]]));
                }
            }
            TokenDtype::U32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
    }

    /// All tokens as a vector (convenient for small shards and tests).
    pub fn to_vec(&self) -> Vec<u32> {
        let mut v = vec![0u32; self.info.tokens as usize];
        self.read_into(0, &mut v);
        v
    }
}

/// The first token of `body` (tokens of `dtype`) at or above `vocab_size`, with its index.
fn out_of_range(body: &[u8], dtype: TokenDtype, vocab_size: u32) -> Option<(usize, u32)> {
    let i = match dtype {
        TokenDtype::U16 => body
            .chunks_exact(2)
            .map(|c| u32::from(u16::from_le_bytes([c[0], c[1]])))
            .position(|t| t >= vocab_size),
        TokenDtype::U32 => body
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .position(|t| t >= vocab_size),
    }?;
    let token = match dtype {
        TokenDtype::U16 => u32::from(u16::from_le_bytes([body[2 * i], body[2 * i + 1]])),
        TokenDtype::U32 => u32_at(body, 4 * i),
    };
    Some((i, token))
}
