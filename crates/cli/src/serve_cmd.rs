//! `ferrotron serve`: a small HTTP/1.1 server (std only, one thread per connection) with one
//! self-contained interactive page and a JSON API computed by the planner library:
//! `GET /` the page, `GET /api/presets`, `POST /api/plan`, `POST /api/search`.
//! Bad input gets a 4xx with `{"error": "..."}`; a handler panic gets a 500; the server goes on.

use crate::http::read_request;
use anyhow::{Context, Result};
use clap::Args;
use ferrotron_plan::api::{plan_json, presets_json, search_json};
use serde_json::{json, Value};
use std::io::{BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The page: HTML, CSS and vanilla JS in one file, no network access needed.
pub const PAGE: &str = include_str!("web/index.html");

/// Connections handled at once; more get a 503.
const MAX_CONNECTIONS: usize = 64;

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on; the default serves this machine only.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port (0 picks a free one; the address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
}

pub struct Response {
    pub status: u16,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Error",
    }
}

fn json_response(status: u16, v: &Value) -> Response {
    Response {
        status,
        content_type: "application/json",
        body: serde_json::to_vec(v).unwrap_or_else(|_| b"{}".to_vec()),
    }
}

fn error(status: u16, msg: impl Into<String>) -> Response {
    json_response(status, &json!({ "error": msg.into() }))
}

/// Routes one request. Pure: the same function the tests call without a socket.
pub fn route(method: &str, path: &str, body: &[u8]) -> Response {
    let path = path.split('?').next().unwrap_or(path);
    let api = |f: fn(Value) -> ferrotron_plan::Result<Value>| -> Response {
        if method != "POST" {
            return error(405, format!("{path} takes POST with a JSON body"));
        }
        let v: Value = match serde_json::from_slice(body) {
            Ok(v) => v,
            Err(e) => return error(400, format!("request body is not valid JSON: {e}")),
        };
        match f(v) {
            Ok(out) => json_response(200, &out),
            Err(e) => error(400, e.to_string()),
        }
    };
    match path {
        "/" | "/index.html" => {
            if method != "GET" {
                return error(405, "/ takes GET");
            }
            Response {
                status: 200,
                content_type: "text/html; charset=utf-8",
                body: PAGE.as_bytes().to_vec(),
            }
        }
        "/api/presets" => {
            if method != "GET" {
                return error(405, "/api/presets takes GET");
            }
            json_response(200, &presets_json())
        }
        "/api/plan" => api(plan_json),
        "/api/search" => api(search_json),
        _ => error(
            404,
            format!("not found: {path} (try /, /api/presets, /api/plan, /api/search)"),
        ),
    }
}

/// Routes with panics turned into a 500 (the connection thread survives, and so does the server).
fn route_guarded(method: &str, path: &str, body: &[u8]) -> Response {
    match std::panic::catch_unwind(|| route(method, path, body)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            error(500, format!("internal error: {msg}"))
        }
    }
}

fn write_response(stream: &mut TcpStream, r: &Response) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nCache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n",
        r.status,
        reason(r.status),
        r.content_type,
        r.body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(&r.body)?;
    stream.flush()
}

fn handle(mut stream: TcpStream) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(15)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(15)));
    let response = match read_request(&mut BufReader::new(&stream)) {
        Ok(r) => route_guarded(&r.method, &r.path, &r.body),
        Err(r) => error(r.status, r.message),
    };
    let _ = write_response(&mut stream, &response);
}

pub fn run(a: ServeArgs) -> Result<()> {
    let listener = TcpListener::bind((a.host.as_str(), a.port))
        .with_context(|| format!("cannot listen on {}:{}", a.host, a.port))?;
    let addr = listener.local_addr()?;
    if !addr.ip().is_loopback() {
        eprintln!(
            "warning: listening on {addr}, reachable from other machines; the API computes plans only, but use --host 127.0.0.1 unless you mean it"
        );
    }
    println!("ferrotron serve: listening on http://{addr}/ (Ctrl-C to stop)");
    std::io::stdout().flush()?;
    let active = Arc::new(AtomicUsize::new(0));
    for stream in listener.incoming() {
        let mut stream = match stream {
            Ok(s) => s,
            Err(e) => {
                eprintln!("warning: accept failed: {e}");
                continue;
            }
        };
        if active.load(Ordering::SeqCst) >= MAX_CONNECTIONS {
            let _ = write_response(&mut stream, &error(503, "too many connections"));
            continue;
        }
        active.fetch_add(1, Ordering::SeqCst);
        let mine = Arc::clone(&active);
        let spawned = std::thread::Builder::new()
            .name("ferrotron-serve".into())
            .spawn(move || {
                handle(stream);
                mine.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            active.fetch_sub(1, Ordering::SeqCst);
            eprintln!("warning: cannot start a connection thread: {e}");
        }
    }
    Ok(())
}
