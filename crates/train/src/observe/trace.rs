//! `--trace`: a Chrome trace (the JSON Trace Event Format that Perfetto and chrome://tracing
//! open) of every kernel call and every phase of the first steps. Recording is the engine's
//! `Tracing<K>` (an observed backend with an event log); this module writes the file. A
//! data-parallel rank's collectives are on a track of their own, from start to landing, so
//! the overlap with the backward shows.

use anyhow::{Context, Result};
pub use ferrotron_engine::kernels::{Event, Tracing, COMM_TRACK, DEVICE_TRACK};
use serde::Serialize;
use std::io::Write;
use std::path::Path;

#[derive(Serialize)]
struct ChromeEvent<'a> {
    name: &'a str,
    cat: &'a str,
    ph: &'a str,
    /// Microseconds (the format's unit), fractional to keep sub-µs kernels visible.
    ts: f64,
    dur: f64,
    pid: u32,
    tid: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    args: Option<serde_json::Value>,
}

/// Writes `{"traceEvents": [...], "displayTimeUnit": "ms"}` of one rank's events, with
/// thread-name metadata so the tracks are labelled.
pub fn write_chrome(path: &Path, events: &[Event]) -> Result<()> {
    write_merged(path, &[chrome_events(events, None)?])
}

/// Writes one file of every rank's events (from [`chrome_events`]): a process row per rank.
pub fn write_merged(path: &Path, ranks: &[serde_json::Value]) -> Result<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("trace = {}: cannot create", dir.display()))?;
    }
    let all: Vec<&serde_json::Value> = ranks
        .iter()
        .flat_map(|r| r.as_array().into_iter().flatten())
        .collect();
    let f = std::fs::File::create(path)
        .with_context(|| format!("trace = {}: cannot create", path.display()))?;
    let mut w = std::io::BufWriter::new(f);
    serde_json::to_writer(
        &mut w,
        &serde_json::json!({ "traceEvents": all, "displayTimeUnit": "ms" }),
    )?;
    w.flush()?;
    Ok(())
}

/// The Chrome events of one process's or one data-parallel rank's `events` (process row
/// `rank`, named after it; without a rank, this process's id).
pub fn chrome_events(events: &[Event], rank: Option<usize>) -> Result<serde_json::Value> {
    let pid = rank.map_or(std::process::id(), |r| r as u32);
    let mut out = Vec::with_capacity(events.len() + 4);
    if let Some(r) = rank {
        out.push(ChromeEvent {
            name: "process_name",
            cat: "__metadata",
            ph: "M",
            ts: 0.0,
            dur: 0.0,
            pid,
            tid: 0,
            args: Some(serde_json::json!({ "name": format!("rank {r}") })),
        });
    }
    let mut tids: Vec<u32> = events.iter().map(|e| e.tid).collect();
    tids.sort_unstable();
    tids.dedup();
    for t in tids {
        out.push(ChromeEvent {
            name: "thread_name",
            cat: "__metadata",
            ph: "M",
            ts: 0.0,
            dur: 0.0,
            pid,
            tid: t,
            args: Some(serde_json::json!({ "name": match t {
                COMM_TRACK => "collectives in flight".to_string(),
                DEVICE_TRACK => "the GPU's time per op (CUDA events)".to_string(),
                t => format!("ferrotron thread {t}"),
            } })),
        });
    }
    for e in events {
        let args = match e.cat {
            "phase" => Some(serde_json::json!({"step": e.step, "mb": e.mb})),
            "gpu" => Some(serde_json::json!({"step": e.step})),
            _ => None,
        };
        out.push(ChromeEvent {
            name: e.name,
            cat: e.cat,
            ph: "X",
            ts: e.start_ns as f64 / 1e3,
            dur: e.dur_ns as f64 / 1e3,
            pid,
            tid: e.tid,
            args,
        });
    }
    Ok(serde_json::to_value(out)?)
}

/// Where data-parallel rank `rank` leaves its events for rank 0 to merge into `path`.
pub fn rank_part(path: &Path, rank: usize) -> std::path::PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(format!(".rank{rank}"));
    p.into()
}
