//! Token shard format: round trips, atomic writes, and one test per bad-file case, each
//! asserting its one-line message.

mod common;
use common::TempDir;
use std::fs;
use std::path::Path;

use ferrotron_train::data::shard::HEADER_LEN;
use ferrotron_train::data::{write_shard, DataError, Fnv1a64, Shard, ShardWriter, TokenDtype};

fn err_msg(path: &Path) -> String {
    match Shard::open(path) {
        Ok(_) => panic!("{} opened but should have failed", path.display()),
        Err(e) => e.to_string(),
    }
}

fn tokens(n: u32, vocab: u32) -> Vec<u32> {
    (0..n)
        .map(|i| (i.wrapping_mul(2654435761)) % vocab)
        .collect()
}

#[test]
fn fnv1a_matches_reference_vectors() {
    // Published FNV-1a 64 test vectors.
    assert_eq!(Fnv1a64::hash(b""), 0xcbf29ce484222325);
    assert_eq!(Fnv1a64::hash(b"a"), 0xaf63dc4c8601ec8c);
    assert_eq!(Fnv1a64::hash(b"foobar"), 0x85944171f73967e8);
}

#[test]
fn round_trip_u16() {
    let dir = TempDir::new("shard-u16");
    let path = dir.path().join("a.tok");
    let toks = tokens(10_000, 8192);
    let info = write_shard(&path, 8192, &toks).unwrap();
    assert_eq!(info.dtype, TokenDtype::U16);
    assert_eq!(info.tokens, 10_000);
    assert_eq!(info.bytes, HEADER_LEN as u64 + 20_000);
    assert_eq!(fs::metadata(&path).unwrap().len(), info.bytes);
    let s = Shard::open(&path).unwrap();
    assert_eq!(s.info(), &info);
    assert_eq!(s.to_vec(), toks);
    assert_eq!(s.get(1234), toks[1234]);
    let mut part = vec![0; 7];
    s.read_into(9_993, &mut part);
    assert_eq!(part, &toks[9_993..]);
    // Header layout is little-endian as documented.
    let raw = fs::read(&path).unwrap();
    assert_eq!(&raw[0..8], b"FTRNTOK1");
    assert_eq!(u32::from_le_bytes(raw[8..12].try_into().unwrap()), 1);
    assert_eq!(u32::from_le_bytes(raw[12..16].try_into().unwrap()), 8192);
    assert_eq!(u32::from_le_bytes(raw[16..20].try_into().unwrap()), 2);
    assert_eq!(u64::from_le_bytes(raw[24..32].try_into().unwrap()), 10_000);
    assert_eq!(
        u64::from_le_bytes(raw[32..40].try_into().unwrap()),
        Fnv1a64::hash(&raw[HEADER_LEN..])
    );
}

#[test]
fn round_trip_u32_for_large_vocab() {
    let dir = TempDir::new("shard-u32");
    let path = dir.path().join("big.tok");
    let vocab = 128_256; // Llama 3
    let mut toks = tokens(5_000, vocab);
    toks.push(vocab - 1);
    let info = write_shard(&path, vocab, &toks).unwrap();
    assert_eq!(info.dtype, TokenDtype::U32);
    let s = Shard::open(&path).unwrap();
    assert_eq!(s.to_vec(), toks);
    assert_eq!(s.vocab_size(), vocab);
}

#[test]
fn vocab_65536_still_fits_u16_and_empty_shard_is_valid() {
    let dir = TempDir::new("shard-edge");
    let p = dir.path().join("edge.tok");
    write_shard(&p, 65_536, &[0, 65_535]).unwrap();
    let s = Shard::open(&p).unwrap();
    assert_eq!(s.info().dtype, TokenDtype::U16);
    assert_eq!(s.to_vec(), vec![0, 65_535]);

    let e = dir.path().join("empty.tok");
    write_shard(&e, 10, &[]).unwrap();
    let s = Shard::open(&e).unwrap();
    assert!(s.is_empty());
}

#[test]
fn streaming_writer_equals_one_shot() {
    let dir = TempDir::new("shard-stream");
    let toks = tokens(3_000, 50_000);
    let a = dir.path().join("a.tok");
    let b = dir.path().join("b.tok");
    write_shard(&a, 50_000, &toks).unwrap();
    let mut w = ShardWriter::create(&b, 50_000).unwrap();
    for c in toks.chunks(7) {
        w.push(c).unwrap();
    }
    assert_eq!(w.len(), 3_000);
    w.finish().unwrap();
    assert_eq!(fs::read(&a).unwrap(), fs::read(&b).unwrap());
}

fn dir_entries(p: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(p)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

#[test]
fn unfinished_writer_leaves_nothing_behind() {
    let dir = TempDir::new("shard-atomic");
    let path = dir.path().join("x.tok");
    {
        let mut w = ShardWriter::create(&path, 100).unwrap();
        w.push(&[1, 2, 3]).unwrap();
        // Dropped without finish (as on an error path).
    }
    assert!(
        dir_entries(dir.path()).is_empty(),
        "{:?}",
        dir_entries(dir.path())
    );

    // A token out of range is an error, and nothing is written either.
    let mut w = ShardWriter::create(&path, 100).unwrap();
    let e = w.push(&[5, 100]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: token 100 at index 1 is out of range for the shard's vocab size 100",
            path.display()
        )
    );
    drop(w);
    assert!(dir_entries(dir.path()).is_empty());

    // Overwriting an existing shard replaces it whole.
    write_shard(&path, 100, &[1, 2]).unwrap();
    write_shard(&path, 100, &[3, 4, 5]).unwrap();
    assert_eq!(Shard::open(&path).unwrap().to_vec(), vec![3, 4, 5]);
    assert_eq!(dir_entries(dir.path()), vec!["x.tok".to_string()]);
}

#[test]
fn truncated_shard() {
    let dir = TempDir::new("shard-trunc");
    let p = dir.path().join("t.tok");
    write_shard(&p, 1000, &tokens(100, 1000)).unwrap();
    let raw = fs::read(&p).unwrap();
    fs::write(&p, &raw[..raw.len() - 3]).unwrap();
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: truncated token shard: expected 248 bytes (header + 100 tokens of 2 bytes), found 245",
            p.display()
        )
    );
    // Cut inside the header.
    fs::write(&p, &raw[..20]).unwrap();
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: truncated token shard: expected 48 bytes (the header), found 20",
            p.display()
        )
    );
    assert!(matches!(Shard::open(&p), Err(DataError::Truncated { .. })));
}

#[test]
fn trailing_bytes() {
    let dir = TempDir::new("shard-trail");
    let p = dir.path().join("t.tok");
    write_shard(&p, 1000, &tokens(10, 1000)).unwrap();
    let mut raw = fs::read(&p).unwrap();
    raw.extend_from_slice(&[0, 0, 0]);
    fs::write(&p, &raw).unwrap();
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: token shard has 3 unexpected trailing bytes after its 10 tokens",
            p.display()
        )
    );
}

#[test]
fn foreign_files() {
    let dir = TempDir::new("shard-foreign");
    let p = dir.path().join("notes.txt");
    fs::write(&p, "To be, or not to be, that is the question.\n").unwrap();
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: not a ferrotron token shard (bad magic bytes \"To be, o\", expected \"FTRNTOK1\")",
            p.display()
        )
    );
    let e = dir.path().join("empty.tok");
    fs::write(&e, b"").unwrap();
    assert_eq!(
        err_msg(&e),
        format!("{}: not a ferrotron token shard (empty file)", e.display())
    );
    let b = dir.path().join("bin.tok");
    fs::write(&b, [0x7fu8, b'E', b'L', b'F', 2, 1, 1, 0, 0, 0]).unwrap();
    assert!(err_msg(&b).contains("not a ferrotron token shard"));
    assert_eq!(
        err_msg(dir.path()),
        format!(
            "{}: not a ferrotron token shard (not a regular file)",
            dir.path().display()
        )
    );
    let missing = dir.path().join("missing.tok");
    let m = err_msg(&missing);
    assert!(m.starts_with(&format!("{}: ", missing.display())), "{m}");
    assert!(matches!(Shard::open(&missing), Err(DataError::Io { .. })));
}

#[test]
fn checksum_mismatch() {
    let dir = TempDir::new("shard-sum");
    let p = dir.path().join("c.tok");
    write_shard(&p, 1000, &tokens(100, 1000)).unwrap();
    let mut raw = fs::read(&p).unwrap();
    let good = u64::from_le_bytes(raw[32..40].try_into().unwrap());
    raw[HEADER_LEN + 10] ^= 0x01; // flip one bit of one token
    let bad = Fnv1a64::hash(&raw[HEADER_LEN..]);
    fs::write(&p, &raw).unwrap();
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: checksum mismatch: header says {good:#018x}, token bytes hash to {bad:#018x} \
             (file is corrupt; rebuild it with `ferrotron data`)",
            p.display()
        )
    );
}

#[test]
fn vocab_larger_than_model() {
    let dir = TempDir::new("shard-vocab");
    let p = dir.path().join("gpt2.tok");
    write_shard(&p, 50_257, &[50_256, 1, 2]).unwrap();
    let e = Shard::open_for_model(&p, 8192).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "{}: shard vocab size 50257 is larger than the model's vocab size 8192 \
             (re-tokenize with the model's tokenizer, or set vocab_size >= 50257)",
            p.display()
        )
    );
    // Equal or smaller is fine.
    Shard::open_for_model(&p, 50_257).unwrap();
    Shard::open_for_model(&p, 50_304).unwrap();
}

/// Rewrites header bytes and fixes nothing else.
fn patch(p: &Path, at: usize, bytes: &[u8]) {
    let mut raw = fs::read(p).unwrap();
    raw[at..at + bytes.len()].copy_from_slice(bytes);
    fs::write(p, raw).unwrap();
}

#[test]
fn bad_header_fields() {
    let dir = TempDir::new("shard-header");
    let p = dir.path().join("h.tok");
    let fresh = || write_shard(&p, 1000, &tokens(10, 1000)).unwrap();

    fresh();
    patch(&p, 8, &7u32.to_le_bytes());
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: unsupported token shard version 7 (this build reads version 1)",
            p.display()
        )
    );

    fresh();
    patch(&p, 16, &3u32.to_le_bytes());
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: corrupt token shard header: token width 3 bytes (expected 2 or 4)",
            p.display()
        )
    );

    fresh();
    patch(&p, 12, &0u32.to_le_bytes());
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: corrupt token shard header: vocab size is 0",
            p.display()
        )
    );

    fresh();
    patch(&p, 12, &100_000u32.to_le_bytes());
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: corrupt token shard header: vocab size 100000 does not fit u16 tokens",
            p.display()
        )
    );

    fresh();
    patch(&p, 24, &u64::MAX.to_le_bytes());
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: corrupt token shard header: token count 18446744073709551615 overflows the file size",
            p.display()
        )
    );

    // Shrinking the header's vocab below a stored token (checksum still matches the tokens).
    write_shard(&p, 1000, &[1, 2, 999]).unwrap();
    patch(&p, 12, &500u32.to_le_bytes());
    assert_eq!(
        err_msg(&p),
        format!(
            "{}: token 999 at index 2 is out of range for the shard's vocab size 500",
            p.display()
        )
    );
}

#[test]
fn random_garbage_never_panics() {
    // Deterministic pseudo-random corruptions of a valid shard: each must open or error.
    let dir = TempDir::new("shard-fuzz");
    let p = dir.path().join("f.tok");
    write_shard(&p, 300, &tokens(64, 300)).unwrap();
    let good = fs::read(&p).unwrap();
    let mut x = 0x1234_5678_9abc_def0u64;
    for _ in 0..300 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut raw = good.clone();
        let cut = (x as usize) % (raw.len() + 1);
        if x & 1 == 0 {
            raw.truncate(cut);
        } else if cut < raw.len() {
            raw[cut] ^= (x >> 8) as u8 | 1;
        }
        fs::write(&p, &raw).unwrap();
        let _ = Shard::open(&p);
    }
}
