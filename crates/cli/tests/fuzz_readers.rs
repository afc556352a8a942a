//! Fuzzed readers of the command line: the HTTP request reader of `ferrotron serve`
//! (`http::read_request`: request line, headers, Content-Length, body) and the planner's TOML
//! file (`ferrotron plan --config FILE`, run as the real binary since the CLI is not a
//! library). Random bytes and mutations of valid inputs: every call returns a request or a
//! 4xx rejection, within the case budget and without allocating for a length it has not
//! checked; the binary exits 0 or with one `error:` line, never a panic.
//!
//! CI runs a fixed number of cases per property (about a minute for all three fuzz binaries);
//! `FERROTRON_FUZZ_SCALE=10` runs ten times as many, `PROPTEST_CASES=N` exactly N.

#[path = "../src/http.rs"]
mod http;
#[path = "../../../tests/fuzz/mutate.rs"]
mod mutate;

use http::{read_request, Rejection, Request, MAX_BODY, MAX_HEAD};
use mutate::{bounded, config, mutate, mutations, EXTREME_NUMBERS};
use proptest::prelude::*;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// HTTP

fn request_samples() -> Vec<Vec<u8>> {
    let body = br#"{"model":"llama-3-8b","mbs":2,"dp":8}"#;
    let post = |path: &str| {
        let mut r = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    };
    vec![
        b"GET / HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: text/html\r\nConnection: close\r\n\r\n"
            .to_vec(),
        b"GET /api/presets HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        post("/api/plan"),
        post("/api/search"),
    ]
}

/// Reads one request from `reader`: a rejection is a 4xx with a one-line message; an accepted
/// request has a method, a path and a body within the limit.
fn check_request(reader: &mut impl BufRead) -> Result<Option<Request>, TestCaseError> {
    match bounded("read_request", || read_request(reader))? {
        Err(Rejection { status, message }) => {
            prop_assert!(
                [400, 411, 413, 431].contains(&status),
                "status {}: {}",
                status,
                message
            );
            prop_assert!(!message.chars().any(char::is_control), "{:?}", message);
            Ok(None)
        }
        Ok(r) => {
            prop_assert!(!r.method.is_empty() && !r.path.is_empty());
            prop_assert!(r.body.len() <= MAX_BODY);
            Ok(Some(r))
        }
    }
}

#[test]
fn request_samples_are_read() {
    for s in request_samples() {
        let r = check_request(&mut &s[..]).unwrap().unwrap();
        assert!(r.method == "GET" || r.body.starts_with(b"{\"model\""));
    }
}

/// Every extreme number as the Content-Length, with a short body: a huge length is refused
/// before any buffer is sized by it.
#[test]
fn content_length_with_extreme_numbers() {
    for n in EXTREME_NUMBERS {
        let req = format!("POST /api/plan HTTP/1.1\r\nContent-Length: {n}\r\n\r\n{{}}");
        let got = check_request(&mut req.as_bytes()).unwrap_or_else(|e| panic!("{n}: {e}"));
        if let Ok(v) = n.parse::<u64>() {
            if v > MAX_BODY as u64 {
                assert!(got.is_none(), "Content-Length {n} accepted");
            }
        }
    }
    let huge = format!(
        "POST / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
        MAX_BODY + 1
    );
    let e = read_request(&mut huge.as_bytes()).unwrap_err();
    assert_eq!(e.status, 413);
}

/// Endless input (one endless line, endless headers, an endless body) ends at the limits.
#[test]
fn endless_streams_stop_at_the_limits() {
    let endless_line = std::io::repeat(b'a');
    let endless_headers = b"GET / HTTP/1.1\r\n"
        .chain(std::io::repeat(b'x').take(10).chain(b": y\r\n".as_slice()))
        .chain(std::io::repeat(b'h'));
    let head = format!("POST /api/plan HTTP/1.1\r\nContent-Length: {MAX_BODY}\r\n\r\n");
    let endless_body = head.as_bytes().chain(std::io::repeat(b'{'));
    let readers: Vec<(Box<dyn Read>, u16)> = vec![
        (Box::new(endless_line), 431),
        (Box::new(endless_headers), 431),
        (Box::new(endless_body), 0),
    ];
    for (r, status) in readers {
        let got = check_request(&mut BufReader::new(r)).unwrap();
        match got {
            None => assert_ne!(status, 0),
            Some(req) => assert_eq!((status, req.body.len()), (0, MAX_BODY)),
        }
    }
}

/// A head of exactly `MAX_HEAD` bytes is read; one byte more is refused.
#[test]
fn head_limit_is_exact() {
    let request = |len: usize| {
        let mut r = b"GET / HTTP/1.1\r\nX: ".to_vec();
        let pad = len - r.len() - 4;
        r.extend(std::iter::repeat_n(b'a', pad));
        r.extend(b"\r\n\r\n");
        r
    };
    assert!(read_request(&mut &request(MAX_HEAD)[..]).is_ok());
    let e = read_request(&mut &request(MAX_HEAD + 1)[..]).unwrap_err();
    assert_eq!(
        (e.status, e.message.as_str()),
        (431, "request head too large")
    );
}

proptest! {
    #![proptest_config(config(75_000))]

    #[test]
    fn http_random_bytes(bytes in mutate::bytes(512)) {
        check_request(&mut &bytes[..])?;
    }

    #[test]
    fn http_mutated(i in 0..4usize, muts in mutations(4)) {
        let b = mutate(&request_samples()[i], &muts);
        check_request(&mut &b[..])?;
    }
}

// ---------------------------------------------------------------------------------------------
// `ferrotron plan --config FILE.toml`

fn root() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
}

fn plan_toml_sample() -> Vec<u8> {
    std::fs::read(root().join("configs/plan-llama3-8b.toml")).unwrap()
}

fn temp_file(bytes: &[u8]) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("fuzz-cli");
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(format!(
        "{}-{}.toml",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::write(&p, bytes).unwrap();
    p
}

/// A process per case: the binary's start-up is part of the time.
const PROCESS_BUDGET: Duration = Duration::from_secs(10);

/// Runs `ferrotron plan --config FILE --json`: exit 0, or exit 1 with one `error:` line.
/// Returns whether it succeeded.
fn check_plan_toml(bytes: &[u8]) -> Result<bool, TestCaseError> {
    let path = temp_file(bytes);
    let t = Instant::now();
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["plan", "--json", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    let dt = t.elapsed();
    std::fs::remove_file(&path).ok();
    prop_assert!(dt < PROCESS_BUDGET, "took {:?}", dt);
    let stderr = String::from_utf8_lossy(&out.stderr);
    match out.status.code() {
        Some(0) => Ok(true),
        Some(1) => {
            let e = stderr.trim_end();
            prop_assert!(
                e.starts_with("error: ") && !e.contains('\n'),
                "not one error line: {}",
                e
            );
            Ok(false)
        }
        other => Err(TestCaseError::fail(format!(
            "exit {other:?} (a panic is 101, a signal None): {stderr}"
        ))),
    }
}

#[test]
fn plan_toml_sample_is_valid() {
    assert!(check_plan_toml(&plan_toml_sample()).unwrap());
}

proptest! {
    // A process and a plan per case: few of them (800, about 15 s of CPU on 2 cores; 2,400
    // took a third of a minute more of CI's; FERROTRON_FUZZ_SCALE=10 for the long run).
    #![proptest_config(config(800))]

    #[test]
    fn plan_toml_mutated(muts in mutations(3)) {
        check_plan_toml(&mutate(&plan_toml_sample(), &muts))?;
    }
}

/// Regression (found by `train_toml_random_text` in the trainer, same reader here): a TOML
/// error was the `toml` crate's message, over several lines and without a position.
#[test]
fn regression_plan_toml_error_is_one_line_with_the_position() {
    let path = temp_file(b"model = \"llama-3-8b\"\nseq = \"4096\nmbs = 1\n");
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["plan", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        format!("error: {}:2:12: invalid basic string\n", path.display())
    );
}
