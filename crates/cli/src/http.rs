//! Reading one HTTP/1.1 request for `ferrotron serve`: request line, headers, a body of
//! `Content-Length` bytes. Std only and generic over `BufRead`, so the fuzz test
//! (crates/cli/tests/fuzz_readers.rs) drives it with bytes instead of a socket.
//!
//! Bounds: the head is read at most `MAX_HEAD` bytes in all, and the body buffer is allocated
//! only after its declared length is checked against `MAX_BODY`, so no input makes the server
//! allocate more than about `MAX_HEAD + MAX_BODY` per connection.

use std::io::{BufRead, Read};

/// Largest request body accepted (a pasted config.json is a few KiB).
pub const MAX_BODY: usize = 1 << 20;
/// Largest request head (request line and headers).
pub const MAX_HEAD: usize = 16 << 10;

/// A request as read off the connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub body: Vec<u8>,
}

/// Why a request was refused: the status to answer with and a one-line message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    pub status: u16,
    pub message: String,
}

fn reject(status: u16, message: impl Into<String>) -> Rejection {
    Rejection {
        status,
        message: message.into(),
    }
}

/// Reads one line of the head into `line`, counting it against `MAX_HEAD`.
fn read_head_line<R: BufRead>(
    reader: &mut R,
    line: &mut String,
    head_len: &mut usize,
) -> Result<usize, Rejection> {
    line.clear();
    // One byte more than what is left, so that a head of exactly MAX_HEAD still passes and
    // one byte over is seen.
    let n = reader
        .by_ref()
        .take((MAX_HEAD - (*head_len).min(MAX_HEAD)) as u64 + 1)
        .read_line(line)
        .map_err(|e| reject(400, format!("cannot read the request: {e}")))?;
    *head_len += n;
    if *head_len > MAX_HEAD {
        return Err(reject(431, "request head too large"));
    }
    Ok(n)
}

/// Reads one request; `Err` for a malformed or oversized one.
pub fn read_request<R: BufRead>(reader: &mut R) -> Result<Request, Rejection> {
    let mut head_len = 0;
    let mut line = String::new();
    if read_head_line(reader, &mut line, &mut head_len)? == 0 {
        return Err(reject(400, "empty request"));
    }
    let mut parts = line.split_whitespace();
    let (method, path) = match (parts.next(), parts.next()) {
        (Some(m), Some(p)) => (m.to_string(), p.to_string()),
        _ => return Err(reject(400, "malformed request line")),
    };
    let mut length: Option<usize> = None;
    loop {
        if read_head_line(reader, &mut line, &mut head_len)? == 0 {
            break;
        }
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            if k.trim().eq_ignore_ascii_case("content-length") {
                length = Some(
                    v.trim()
                        .parse()
                        .map_err(|_| reject(400, "Content-Length is not a number"))?,
                );
            } else if k.trim().eq_ignore_ascii_case("transfer-encoding") {
                return Err(reject(
                    411,
                    "send a Content-Length (chunked bodies are not accepted)",
                ));
            }
        }
    }
    let mut body = Vec::new();
    if let Some(n) = length {
        if n > MAX_BODY {
            return Err(reject(413, format!("request body over {MAX_BODY} bytes")));
        }
        body.resize(n, 0);
        reader.read_exact(&mut body).map_err(|e| {
            reject(
                400,
                format!("request body shorter than Content-Length: {e}"),
            )
        })?;
    } else if method == "POST" {
        return Err(reject(411, "POST needs a Content-Length"));
    }
    Ok(Request { method, path, body })
}
