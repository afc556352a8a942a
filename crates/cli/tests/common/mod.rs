// Shared by the `ferrotron serve` tests: start the server on a free port, talk HTTP to it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A running `ferrotron serve`; killed (by its own handle) when dropped.
pub struct Server {
    pub child: Child,
    pub addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start_server() -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(["serve", "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start ferrotron serve");
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    // "ferrotron serve: listening on http://127.0.0.1:PORT/ (Ctrl-C to stop)"
    let url = line
        .split_whitespace()
        .find(|w| w.starts_with("http://"))
        .unwrap_or_else(|| panic!("no address in {line:?}"));
    let addr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .to_string();
    Server { child, addr }
}

/// One HTTP/1.1 request; returns (status, body).
pub fn http(addr: &str, method: &str, path: &str, body: Option<&[u8]>) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if let Some(b) = body {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    if let Some(b) = body {
        // The server may answer (413) before reading everything; ignore a reset here.
        let _ = s.write_all(b);
    }
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |x| x.1.to_string());
    (status, body)
}

pub fn post_json(addr: &str, path: &str, v: &serde_json::Value) -> (u16, serde_json::Value) {
    let (status, body) = http(addr, "POST", path, Some(v.to_string().as_bytes()));
    let v = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    (status, v)
}

/// Runs the binary with `args`.
pub fn ferrotron(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotron"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs a command that must succeed; returns its stdout.
pub fn ok(args: &[&str]) -> String {
    let out = ferrotron(args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Runs a command that must fail with one clear error (no panic, at most two meaningful
/// lines: clap adds a usage line); returns its stderr.
pub fn fails(args: &[&str]) -> String {
    let out = ferrotron(args);
    assert!(!out.status.success(), "{args:?} should fail");
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(!err.contains("panicked"), "{err}");
    let lines = err
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("Usage") && !l.starts_with("For more"))
        .count();
    assert!(lines <= 2, "{args:?}: {err}");
    err
}

/// A 2-layer GQA Llama config.json in `dir` with the bundled tokenizer's vocabulary; its path.
pub fn tiny_model(dir: &std::path::Path) -> String {
    let p = dir.join("config.json");
    std::fs::write(
        &p,
        r#"{"model_type":"llama","hidden_size":64,"intermediate_size":160,"num_attention_heads":4,
            "num_key_value_heads":2,"num_hidden_layers":2,"vocab_size":8192,
            "max_position_embeddings":128,"tie_word_embeddings":true}"#,
    )
    .unwrap();
    p.to_string_lossy().into()
}
