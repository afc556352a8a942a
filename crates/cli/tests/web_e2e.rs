//! End to end in headless Chromium: load the planner page from `ferrotron serve`, change the
//! micro-batch size the way a user does (set the slider, fire its input event), and check that
//! the peak the page displays is the API's peak for the page's settings.
//!
//! Driven over the Chrome DevTools Protocol with a minimal WebSocket client (std only). Skips,
//! saying so, only when no Chromium is installed (CI installs Debian's `chromium`).

mod common;
use common::{post_json, start_server};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn find_chromium() -> Option<String> {
    if let Ok(p) = std::env::var("FERROTRON_CHROMIUM") {
        return Some(p);
    }
    let path = std::env::var("PATH").unwrap_or_default();
    for name in [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ] {
        for dir in std::env::split_paths(&path).chain(["/usr/bin".into()]) {
            let p = dir.join(name);
            if p.is_file() {
                return Some(p.to_string_lossy().into_owned());
            }
        }
    }
    None
}

/// Chromium, killed by its own handle when dropped.
struct Browser {
    child: Child,
    _profile: tempfile::TempDir,
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts headless Chromium with remote debugging on a free port; returns it and the port.
fn launch(exe: &str) -> (Browser, u16) {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(exe)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
            "--remote-debugging-port=0",
            "--remote-debugging-address=127.0.0.1",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg("about:blank")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start chromium");
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
            if let Some(rest) = line.split("DevTools listening on ws://").nth(1) {
                let _ = tx.send(rest.to_string());
            }
        }
    });
    let browser = Browser {
        child,
        _profile: profile,
    };
    let rest = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("chromium printed no DevTools address within 60 s");
    let port = rest
        .split('/')
        .next()
        .and_then(|hp| hp.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .expect("DevTools port");
    (browser, port)
}

/// GET on the DevTools HTTP endpoint (it may keep the connection open: read Content-Length).
fn http_get(port: u16, path: &str) -> String {
    let s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    write!(
        &s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut r = BufReader::new(&s);
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            if k.eq_ignore_ascii_case("content-length") {
                len = v.trim().parse().unwrap();
            }
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).unwrap();
    String::from_utf8(body).unwrap()
}

/// The smallest WebSocket client CDP needs: masked text frames out, unmasked frames in.
struct Ws {
    s: TcpStream,
    next_id: u64,
}

impl Ws {
    fn connect(port: u16, path: &str) -> Ws {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Key: ZmVycm90cm9uLWUyZS10ZXN0\r\nSec-WebSocket-Version: 13\r\n\r\n"
        )
        .unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            s.read_exact(&mut b).unwrap();
            head.push(b[0]);
        }
        let head = String::from_utf8_lossy(&head);
        assert!(
            head.starts_with("HTTP/1.1 101"),
            "websocket upgrade refused: {head}"
        );
        Ws { s, next_id: 1 }
    }

    fn send(&mut self, text: &str) {
        let p = text.as_bytes();
        let mut f = vec![0x81u8];
        match p.len() {
            n if n < 126 => f.push(0x80 | n as u8),
            n if n < 65536 => {
                f.push(0x80 | 126);
                f.extend_from_slice(&(n as u16).to_be_bytes());
            }
            n => {
                f.push(0x80 | 127);
                f.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        let mask = [0x12u8, 0x34, 0x56, 0x78];
        f.extend_from_slice(&mask);
        f.extend(p.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.s.write_all(&f).unwrap();
    }

    fn recv(&mut self) -> String {
        let mut msg = Vec::new();
        loop {
            let mut h = [0u8; 2];
            self.s.read_exact(&mut h).unwrap();
            let fin = h[0] & 0x80 != 0;
            let opcode = h[0] & 0x0f;
            let mut len = (h[1] & 0x7f) as u64;
            if len == 126 {
                let mut e = [0u8; 2];
                self.s.read_exact(&mut e).unwrap();
                len = u16::from_be_bytes(e) as u64;
            } else if len == 127 {
                let mut e = [0u8; 8];
                self.s.read_exact(&mut e).unwrap();
                len = u64::from_be_bytes(e);
            }
            let mut payload = vec![0u8; len as usize];
            self.s.read_exact(&mut payload).unwrap();
            match opcode {
                0x8 => panic!("chromium closed the DevTools connection"),
                0x9 | 0xA => continue,
                _ => msg.extend_from_slice(&payload),
            }
            if fin {
                return String::from_utf8(msg).unwrap();
            }
        }
    }

    /// Sends a CDP command and waits for its answer (events in between are skipped).
    fn call(&mut self, method: &str, params: Value) -> Value {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({"id": id, "method": method, "params": params}).to_string());
        loop {
            let v: Value = serde_json::from_str(&self.recv()).unwrap();
            if v["id"] == id {
                assert!(v.get("error").is_none(), "{method}: {v}");
                return v["result"].clone();
            }
        }
    }

    fn eval(&mut self, expr: &str) -> Value {
        let r = self.call(
            "Runtime.evaluate",
            json!({"expression": expr, "returnByValue": true, "awaitPromise": true}),
        );
        assert!(r.get("exceptionDetails").is_none(), "{expr}: {r}");
        r["result"]["value"].clone()
    }

    /// Evaluates `expr` until it returns a non-empty string.
    fn wait_for(&mut self, expr: &str, what: &str) -> String {
        let t0 = Instant::now();
        loop {
            if let Value::String(s) = self.eval(expr) {
                if !s.is_empty() {
                    return s;
                }
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "timed out waiting for {what}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn changing_the_micro_batch_updates_the_peak_to_the_apis() {
    let Some(exe) = find_chromium() else {
        println!(
            "SKIPPED web e2e: no chromium found (install Debian's `chromium`: apt-get install -y chromium, or set FERROTRON_CHROMIUM)"
        );
        return;
    };
    let srv = start_server();
    let (_browser, port) = launch(&exe);
    let targets: Value = serde_json::from_str(&http_get(port, "/json/list")).unwrap();
    let ws_url = targets
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["type"] == "page")
        .and_then(|t| t["webSocketDebuggerUrl"].as_str())
        .expect("a page target")
        .to_string();
    let path = format!("/{}", ws_url.splitn(4, '/').nth(3).unwrap());
    let mut ws = Ws::connect(port, &path);
    ws.call(
        "Page.navigate",
        json!({"url": format!("http://{}/", srv.addr)}),
    );

    // The page loads the presets, posts its settings and shows the peak.
    let first = ws.wait_for(
        "(document.getElementById('peak') && document.getElementById('peak').dataset.bytes) || ''",
        "the first plan",
    );
    assert_eq!(ws.eval("document.getElementById('peak').dataset.mbs"), "1");

    // Change the micro-batch size as a user would: move the slider, which fires `input`.
    ws.eval(
        "(() => { const e = document.getElementById('mbs'); e.value = '4'; \
         e.dispatchEvent(new Event('input', {bubbles: true})); return e.value; })()",
    );
    ws.wait_for(
        "document.getElementById('peak').dataset.mbs === '4' ? 'yes' : ''",
        "the plan for mbs 4",
    );
    let shown: Value = serde_json::from_str(
        ws.eval(
            "JSON.stringify({bytes: document.getElementById('peak').dataset.bytes, \
             text: document.getElementById('peak').textContent, req: window.ferrotronLastRequest, \
             error: document.getElementById('error').textContent})",
        )
        .as_str()
        .unwrap(),
    )
    .unwrap();
    assert_eq!(shown["error"], "", "{shown}");
    assert_eq!(shown["req"]["mbs"], 4, "{shown}");

    // The API's answer for the very settings the page sent.
    let (status, api) = post_json(&srv.addr, "/api/plan", &shown["req"]);
    assert_eq!(status, 200, "{api}");
    let peak = api["per_rank"]["peak"].as_u64().unwrap();
    assert_eq!(shown["bytes"].as_str().unwrap(), peak.to_string());
    let gib = format!("{:.2} GiB", peak as f64 / (1u64 << 30) as f64);
    assert_eq!(shown["text"].as_str().unwrap(), gib);
    assert_ne!(
        first,
        peak.to_string(),
        "a 4× micro-batch must change the peak"
    );
    println!("page shows {gib} for mbs 4 (was {first} bytes for mbs 1); the API agrees");

    // The search panel: run it, get a ranked table, apply the winner to the form.
    ws.eval(
        "(() => { document.getElementById('s-gpus').value = '8'; \
         document.getElementById('s-gbs').value = '1048576'; \
         document.getElementById('search-btn').click(); return 1; })()",
    );
    let rows = ws.wait_for(
        "(() => { const t = document.getElementById('search-table'); \
         const e = document.getElementById('search-error'); \
         return e ? 'error: ' + e.textContent : (t ? String(t.rows.length - 1) : ''); })()",
        "the search results",
    );
    assert_eq!(rows, "5", "search table rows");
    // The winner's peak as the table shows it; applying the winner replans with its layout,
    // and the page's peak becomes the same.
    let winner_peak =
        ws.eval("document.getElementById('search-table').rows[1].cells[6].textContent");
    let winner_peak = winner_peak.as_str().unwrap().to_string();
    ws.eval("document.querySelector('#search-table button').click()");
    ws.wait_for(
        &format!(
            "document.getElementById('peak').textContent === '{winner_peak} GiB' ? 'applied' : ''"
        ),
        "the winner applied to the form",
    );
}
