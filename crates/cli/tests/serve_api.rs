//! `ferrotron serve` over real sockets: the page, the JSON API, and 4xx (never a crash) for bad
//! requests.

mod common;
use common::{http, post_json, start_server};
use serde_json::json;

#[test]
fn page_and_api_answer_and_bad_requests_get_4xx() {
    let srv = start_server();
    let a = srv.addr.as_str();

    let (status, page) = http(a, "GET", "/", None);
    assert_eq!(status, 200);
    assert!(
        page.contains("<script>") && page.contains("id=\"mbs\"") && page.contains("id=\"peak\"")
    );
    // Self-contained: no external scripts, styles or fonts.
    for external in ["src=\"http", "href=\"http", "@import", "//cdn", "src=\"//"] {
        assert!(!page.contains(external), "page references {external}");
    }

    let (status, presets) = http(a, "GET", "/api/presets", None);
    assert_eq!(status, 200);
    assert!(presets.contains("\"llama-3-8b\""));

    let (status, v) = post_json(
        a,
        "/api/plan",
        &json!({"model": "llama-3-8b", "mbs": 2, "dp": 8}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["per_rank"]["peak"].as_u64().unwrap() > 0);
    assert!(v["time"]["step_s"].as_f64().unwrap() > 0.0);

    let (status, v) = post_json(
        a,
        "/api/search",
        &json!({"model": "llama-3.2-1b", "gpus": 8, "seq": 2048, "gbs_tokens": 1 << 20}),
    );
    assert_eq!(status, 200, "{v}");
    assert!(!v["top"].as_array().unwrap().is_empty());

    // (method, path, body, status, message)
    type Case<'a> = (&'a str, &'a str, Option<&'a [u8]>, u16, &'a str);
    let bad: Vec<Case> = vec![
        (
            "POST",
            "/api/plan",
            Some(b"{not json"),
            400,
            "not valid JSON",
        ),
        (
            "POST",
            "/api/plan",
            Some(br#"{"model":"llama-3-8b","tp":3}"#),
            400,
            "tp = 3: must divide",
        ),
        (
            "POST",
            "/api/plan",
            Some(br#"{"model":"llama-3-8b","mbz":1}"#),
            400,
            "unknown field `mbz`",
        ),
        (
            "POST",
            "/api/plan",
            Some(br#"{"model":"llama-3-8b","mbs":1099511627776}"#),
            400,
            "limit",
        ),
        (
            "POST",
            "/api/search",
            Some(br#"{"model":"llama-3-8b"}"#),
            400,
            "gpus = (none)",
        ),
        ("GET", "/api/plan", None, 405, "takes POST"),
        ("DELETE", "/", None, 405, "takes GET"),
        ("POST", "/api/presets", Some(b"{}"), 405, "takes GET"),
        ("GET", "/etc/passwd", None, 404, "not found"),
        ("POST", "/api/plan", None, 411, "Content-Length"),
    ];
    for (method, path, body, want, msg) in bad {
        let (status, text) = http(a, method, path, body);
        assert_eq!(status, want, "{method} {path}: {text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert!(
            v["error"].as_str().unwrap().contains(msg),
            "{method} {path}: {text}"
        );
    }
    // Oversized body: refused before it is read.
    let huge = vec![b' '; (1 << 20) + 1];
    let (status, _) = http(a, "POST", "/api/plan", Some(&huge));
    assert_eq!(status, 413);
    // Garbage on the wire.
    {
        use std::io::{Read, Write};
        let mut s = std::net::TcpStream::connect(a).unwrap();
        s.write_all(b"\x00\x01garbage\r\n\r\n").unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        assert!(out.starts_with("HTTP/1.1 400"), "{out}");
    }
    // Still serving.
    let (status, _) = http(a, "GET", "/api/presets", None);
    assert_eq!(status, 200);
}
