// Shared by the `fuzz_readers` tests of every crate (included with `#[path]`, since test
// helpers cannot be a dependency): proptest strategies for hostile inputs, the mutations of a
// valid sample, and the per-case budget: time, and the largest allocation (this module installs
// the test binary's global allocator to measure it).
//
// Why mutations as well as random bytes: random bytes almost never get past a reader's first
// check (the JSON tokenizer, the magic bytes), so they only test the door. A valid file with a
// few bytes flipped, cut, repeated or with a number swapped for an extreme one reaches the
// field checks and the code behind them, where the interesting failures are.
#![allow(dead_code)]

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, RngSeed};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::{Duration, Instant};

/// Cases of a property: `ci` in CI, times `FERROTRON_FUZZ_SCALE` for a longer run
/// (`FERROTRON_FUZZ_SCALE=10` is the recorded long run); proptest's own `PROPTEST_CASES`, when
/// set, is taken as is for every property instead.
pub fn cases(ci: u32) -> u32 {
    let env = |k: &str| std::env::var(k).ok().and_then(|s| s.parse::<u32>().ok());
    if let Some(n) = env("PROPTEST_CASES") {
        return n.max(1);
    }
    ci.saturating_mul(env("FERROTRON_FUZZ_SCALE").unwrap_or(1))
        .max(1)
}

/// The seed of every property: fixed unless `FERROTRON_FUZZ_SEED` says otherwise (a number,
/// or `random` for a fresh one each run). CI runs the fixed seed, so its verdict reproduces;
/// the longer runs recorded in the notes explore with `random`.
pub fn seed() -> RngSeed {
    match std::env::var("FERROTRON_FUZZ_SEED").ok().as_deref() {
        Some("random") => RngSeed::Random,
        Some(n) => n.parse().map_or(RngSeed::Random, RngSeed::Fixed),
        None => RngSeed::Fixed(0x5EED_F022),
    }
}

/// The proptest config of a fuzz property: `ci` cases (see [`cases`]), the seed of [`seed`], a
/// per-case timeout (a hang fails the case instead of stalling CI) and no failure-persistence
/// files in the source tree.
pub fn config(ci: u32) -> Config {
    Config {
        cases: cases(ci),
        rng_seed: seed(),
        timeout: CASE_BUDGET.as_millis() as u32 * 5,
        failure_persistence: None,
        max_shrink_iters: 256,
        ..Config::default()
    }
}

/// Every reader call must return within this (checked by [`bounded`]); proptest's `timeout`
/// above is the backstop for a call that never returns.
pub const CASE_BUDGET: Duration = Duration::from_secs(1);

/// No single allocation of a reader call may be larger than this: inputs are at most a few
/// hundred KiB, so a larger block means a length read from the input sized it.
pub const ALLOC_CAP: usize = 64 << 20;

/// Runs `f` and fails the case if it took longer than [`CASE_BUDGET`] or made an allocation
/// larger than [`ALLOC_CAP`] on this thread. The largest block, not the total, is what a
/// hostile length field drives (`Vec::with_capacity(n)`, or a vector grown to n by doubling).
/// Time is this thread's CPU time where Linux tells it (wall time elsewhere): a machine
/// loaded by other builds stretched the wall time of a 0.02 s case past the budget.
pub fn bounded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, TestCaseError> {
    LARGEST.with(|c| c.set(0));
    let (t, cpu) = (Instant::now(), thread_cpu());
    let out = f();
    let dt = match (cpu, thread_cpu()) {
        (Some(a), Some(b)) => b.saturating_sub(a),
        _ => t.elapsed(),
    };
    let largest = LARGEST.with(Cell::get);
    if dt > CASE_BUDGET {
        return Err(TestCaseError::fail(format!(
            "{what} took {dt:?}, over the {CASE_BUDGET:?} budget"
        )));
    }
    if largest > ALLOC_CAP {
        return Err(TestCaseError::fail(format!(
            "{what} allocated a block of {largest} bytes, over the {ALLOC_CAP}-byte cap"
        )));
    }
    Ok(out)
}

/// CPU time of the calling thread (user + system, in the kernel's 10 ms ticks), from
/// /proc/thread-self/stat: fields 14 and 15, counted after the command name's closing ')'.
fn thread_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/thread-self/stat").ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    // USER_HZ is 100 on every Linux ABI (sysconf(_SC_CLK_TCK)).
    Some(Duration::from_millis(ticks * 10))
}

thread_local! {
    /// Largest block allocated by this thread since [`bounded`] reset it.
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

/// The system allocator, noting the largest block each thread asks for.
struct LargestBlock;

fn note(size: usize) {
    // `try_with`: allocations during thread teardown, after the slot is gone, are not noted.
    let _ = LARGEST.try_with(|c| c.set(c.get().max(size)));
}

// SAFETY: every call forwards to the system allocator unchanged; only a thread-local `Cell`
// (const-initialised, so touching it never allocates) is updated.
unsafe impl GlobalAlloc for LargestBlock {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc(layout)
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        System.alloc_zeroed(layout)
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        System.realloc(ptr, layout, new_size)
    }
}

#[global_allocator]
static ALLOCATOR: LargestBlock = LargestBlock;

/// Numbers that break readers: type limits and one past them, negatives, zero, non-finite and
/// huge floats, a float that is not an integer, a 100-digit integer.
pub const EXTREME_NUMBERS: &[&str] = &[
    "0",
    "-1",
    "-0",
    "1",
    "2",
    "3",
    "65535",
    "65536",
    "2147483647",
    "2147483648",
    "4294967295",
    "4294967296",
    "4294967297",
    "9007199254740993",
    "9223372036854775807",
    "18446744073709551615",
    "18446744073709551616",
    "-9223372036854775808",
    "1e308",
    "-1e308",
    "1e-308",
    "5e-324",
    "1.5",
    "NaN",
    "nan",
    "inf",
    "-inf",
    "1e999",
    "0x10",
    "1000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000",
];

/// Integers at and around the type limits, for binary fields.
pub const EXTREME_U64: &[u64] = &[
    0,
    1,
    2,
    3,
    4,
    0xff,
    0xffff,
    0x1_0000,
    0x1_0001,
    0x7fff_ffff,
    0x8000_0000,
    0xffff_ffff,
    0x1_0000_0000,
    0x7fff_ffff_ffff_ffff,
    0x8000_0000_0000_0000,
    u64::MAX / 2 + 1,
    u64::MAX - 1,
    u64::MAX,
];

/// One edit of a byte string. Positions are proptest `Index`es, so they land anywhere in
/// inputs of any length.
#[derive(Debug, Clone)]
pub enum Mutation {
    /// Flip one bit.
    FlipBit(Index, u8),
    /// Overwrite one byte.
    SetByte(Index, u8),
    /// Insert bytes.
    Insert(Index, Vec<u8>),
    /// Delete up to `n` bytes.
    Delete(Index, usize),
    /// Cut the input here.
    Truncate(Index),
    /// Repeat a stretch of up to `n` bytes `times` times in place (long tokens, deep nesting).
    Repeat(Index, usize, usize),
    /// Replace the run of ASCII digits at or after this position (with its sign, fraction
    /// and exponent) by one of [`EXTREME_NUMBERS`]; a no-op in text without digits.
    SpliceNumber(Index, Index),
    /// Write a little-endian integer of `width` bytes (4 or 8) from [`EXTREME_U64`] here.
    PutLe(Index, u8, Index),
}

pub fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::FlipBit(i, b)),
        (any::<Index>(), any::<u8>()).prop_map(|(i, b)| Mutation::SetByte(i, b)),
        (
            any::<Index>(),
            prop_oneof![
                proptest::collection::vec(any::<u8>(), 1..16),
                // Structural characters of JSON and TOML, so that inserts make near-valid text.
                proptest::collection::vec(
                    proptest::sample::select(b"{}[]\":,=.-+eE0123456789 \n\\\0".to_vec()),
                    1..8
                ),
            ]
        )
            .prop_map(|(i, v)| Mutation::Insert(i, v)),
        (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Delete(i, n)),
        any::<Index>().prop_map(Mutation::Truncate),
        (any::<Index>(), 1usize..16, 2usize..200).prop_map(|(i, n, t)| Mutation::Repeat(i, n, t)),
        (any::<Index>(), any::<Index>()).prop_map(|(i, v)| Mutation::SpliceNumber(i, v)),
        (
            any::<Index>(),
            prop_oneof![Just(4u8), Just(8u8)],
            any::<Index>()
        )
            .prop_map(|(i, w, v)| Mutation::PutLe(i, w, v)),
    ]
}

/// One to `max` mutations, applied in order.
pub fn mutations(max: usize) -> impl Strategy<Value = Vec<Mutation>> {
    proptest::collection::vec(mutation(), 1..=max)
}

/// End of the number that starts at `start` (digits, then an optional fraction and exponent).
fn number_end(b: &[u8], start: usize) -> usize {
    let digits = |mut i: usize| {
        while i < b.len() && b[i].is_ascii_digit() {
            i += 1;
        }
        i
    };
    let mut i = digits(start);
    if i < b.len() && b[i] == b'.' {
        i = digits(i + 1);
    }
    if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
        let mut j = i + 1;
        if j < b.len() && (b[j] == b'+' || b[j] == b'-') {
            j += 1;
        }
        if j < b.len() && b[j].is_ascii_digit() {
            i = digits(j);
        }
    }
    i
}

impl Mutation {
    pub fn apply(&self, b: &mut Vec<u8>) {
        // An index into 0..=len (inserting at the end is allowed).
        let at = |i: &Index, len: usize| i.index(len + 1);
        match self {
            Mutation::FlipBit(i, bit) if !b.is_empty() => {
                let k = i.index(b.len());
                b[k] ^= 1 << bit;
            }
            Mutation::SetByte(i, v) if !b.is_empty() => {
                let k = i.index(b.len());
                b[k] = *v;
            }
            Mutation::Insert(i, v) => {
                let k = at(i, b.len());
                b.splice(k..k, v.iter().copied());
            }
            Mutation::Delete(i, n) if !b.is_empty() => {
                let k = i.index(b.len());
                let end = (k + n).min(b.len());
                b.drain(k..end);
            }
            Mutation::Truncate(i) => {
                let k = at(i, b.len());
                b.truncate(k);
            }
            Mutation::Repeat(i, n, times) if !b.is_empty() => {
                let k = i.index(b.len());
                let end = (k + n).min(b.len());
                let piece = b[k..end].to_vec();
                let copies: Vec<u8> = piece
                    .iter()
                    .copied()
                    .cycle()
                    .take(piece.len() * times)
                    .collect();
                b.splice(end..end, copies);
            }
            Mutation::SpliceNumber(i, v) if !b.is_empty() => {
                let from = i.index(b.len());
                let Some(d) = b[from..].iter().position(u8::is_ascii_digit) else {
                    return;
                };
                let mut start = from + d;
                // Back up over the digits before `from` and a sign, to replace the whole token.
                while start > 0 && b[start - 1].is_ascii_digit() {
                    start -= 1;
                }
                if start > 0 && b[start - 1] == b'-' {
                    start -= 1;
                }
                let end = number_end(b, from + d);
                let with = v.get(EXTREME_NUMBERS).as_bytes();
                b.splice(start..end, with.iter().copied());
            }
            Mutation::PutLe(i, width, v) => {
                let w = *width as usize;
                if b.len() < w {
                    return;
                }
                let k = i.index(b.len() - w + 1);
                let x = *v.get(EXTREME_U64);
                b[k..k + w].copy_from_slice(&x.to_le_bytes()[..w]);
            }
            // Edits that need a byte to act on, on an empty input.
            _ => {}
        }
    }
}

/// `sample` with `muts` applied in order.
pub fn mutate(sample: &[u8], muts: &[Mutation]) -> Vec<u8> {
    let mut b = sample.to_vec();
    for m in muts {
        m.apply(&mut b);
    }
    b
}

/// Arbitrary bytes, up to `max` long.
pub fn bytes(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..max)
}

/// Arbitrary text: mostly the structural characters of JSON and TOML (so that some of it gets
/// past the tokenizer), plus any Unicode.
pub fn text(max: usize) -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::string::string_regex(&format!(r#"[\[\]{{}}":,=.\-+0-9a-z_ \n\t'#]{{0,{max}}}"#))
            .expect("valid regex"),
        proptest::string::string_regex(&format!(".{{0,{max}}}")).expect("valid regex"),
    ]
}

/// JSON pointers (`/model/vocab/ab`, `/added_tokens/0/id`) of every number in `doc`, and of
/// every string that holds one (`"params": "7.5e9"`).
pub fn numeric_pointers(doc: &serde_json::Value) -> Vec<String> {
    use serde_json::Value;
    fn walk(v: &Value, at: &str, out: &mut Vec<String>) {
        match v {
            Value::Number(_) => out.push(at.to_string()),
            Value::String(s) if s.parse::<f64>().is_ok() => out.push(at.to_string()),
            Value::Array(a) => a
                .iter()
                .enumerate()
                .for_each(|(i, x)| walk(x, &format!("{at}/{i}"), out)),
            Value::Object(o) => o.iter().for_each(|(k, x)| {
                let k = k.replace('~', "~0").replace('/', "~1");
                walk(x, &format!("{at}/{k}"), out)
            }),
            _ => {}
        }
    }
    let mut out = vec![];
    walk(doc, "", &mut out);
    out
}

/// The JSON text of `doc` with the value at `pointer` replaced by `raw` verbatim, so that
/// numbers JSON values cannot hold (NaN, 1e999, 100 digits) go in too.
pub fn with_raw(doc: &serde_json::Value, pointer: &str, raw: &str) -> String {
    const MARK: &str = "@@fuzz@@";
    let mut d = doc.clone();
    *d.pointer_mut(pointer)
        .expect("pointer from numeric_pointers") = MARK.into();
    d.to_string().replace(&format!("\"{MARK}\""), raw)
}

/// Calls `check` with every number of `doc` replaced by every one of [`EXTREME_NUMBERS`];
/// a failure names the field and the number.
pub fn each_extreme_number(
    doc: &serde_json::Value,
    mut check: impl FnMut(&[u8]) -> Result<(), TestCaseError>,
) {
    for p in numeric_pointers(doc) {
        for n in EXTREME_NUMBERS {
            check(with_raw(doc, &p, n).as_bytes()).unwrap_or_else(|e| panic!("{p} = {n}: {e}"));
        }
    }
}

/// A JSON value a hostile writer would put in a field: extreme and ordinary numbers, every
/// JSON type, and strings from `words` (the names a reader looks for: model types, choices,
/// field names) or arbitrary ones.
pub fn json_value(words: &'static [&'static str]) -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{json, Value};
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        proptest::sample::select(EXTREME_U64).prop_map(Value::from),
        (0u64..5000).prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop_oneof![
            Just(0.5),
            Just(-1.5),
            Just(1e308),
            Just(-1e308),
            Just(5e-324),
            Just(1e-3)
        ]
        .prop_map(Value::from),
        proptest::sample::select(words).prop_map(Value::from),
        "[a-z0-9_\\-.]{0,12}".prop_map(Value::from),
    ];
    leaf.prop_recursive(2, 8, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::vec(("[a-z_]{1,8}", inner), 0..3)
                .prop_map(|kv| json!(kv.into_iter().collect::<serde_json::Map<_, _>>())),
        ]
    })
}

/// One edit of a JSON document: set the value at some place (any depth) to a hostile value,
/// remove a member, or add a member named from `words`.
#[derive(Debug, Clone)]
pub enum JsonMutation {
    Set(Index, serde_json::Value),
    Remove(Index),
    Add(Index, &'static str, serde_json::Value),
}

pub fn json_mutations(
    words: &'static [&'static str],
    max: usize,
) -> impl Strategy<Value = Vec<JsonMutation>> {
    let one = prop_oneof![
        3 => (any::<Index>(), json_value(words)).prop_map(|(i, v)| JsonMutation::Set(i, v)),
        1 => any::<Index>().prop_map(JsonMutation::Remove),
        2 => (any::<Index>(), proptest::sample::select(words), json_value(words))
            .prop_map(|(i, k, v)| JsonMutation::Add(i, k, v)),
    ];
    proptest::collection::vec(one, 1..=max)
}

/// Pointers of every value in `doc` (the root is "").
fn all_pointers(doc: &serde_json::Value) -> Vec<String> {
    use serde_json::Value;
    fn walk(v: &Value, at: String, out: &mut Vec<String>) {
        out.push(at.clone());
        match v {
            Value::Array(a) => a
                .iter()
                .enumerate()
                .for_each(|(i, x)| walk(x, format!("{at}/{i}"), out)),
            Value::Object(o) => o.iter().for_each(|(k, x)| {
                walk(
                    x,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    out,
                )
            }),
            _ => {}
        }
    }
    let mut out = vec![];
    walk(doc, String::new(), &mut out);
    out
}

/// `doc` with `muts` applied in order.
pub fn mutate_json(doc: &serde_json::Value, muts: &[JsonMutation]) -> serde_json::Value {
    let mut d = doc.clone();
    for m in muts {
        let ptrs = all_pointers(&d);
        match m {
            JsonMutation::Set(i, v) => {
                // Not the root: a document that is not an object is the random-bytes tests' job.
                let p = &ptrs[1.max(i.index(ptrs.len())).min(ptrs.len() - 1)];
                if !p.is_empty() {
                    *d.pointer_mut(p).expect("pointer of d") = v.clone();
                }
            }
            JsonMutation::Remove(i) => {
                let p = ptrs[i.index(ptrs.len())].clone();
                if let Some((parent, key)) = p.rsplit_once('/') {
                    let key = key.replace("~1", "/").replace("~0", "~");
                    match d.pointer_mut(parent) {
                        Some(serde_json::Value::Object(o)) => {
                            o.remove(&key);
                        }
                        Some(serde_json::Value::Array(a)) => {
                            if let Ok(k) = key.parse::<usize>() {
                                a.remove(k);
                            }
                        }
                        _ => {}
                    }
                }
            }
            JsonMutation::Add(i, k, v) => {
                let objects: Vec<&String> = ptrs
                    .iter()
                    .filter(|p| d.pointer(p).is_some_and(serde_json::Value::is_object))
                    .collect();
                if !objects.is_empty() {
                    let p = objects[i.index(objects.len())].clone();
                    if let Some(serde_json::Value::Object(o)) = d.pointer_mut(&p) {
                        o.insert(k.to_string(), v.clone());
                    }
                }
            }
        }
    }
    d
}
