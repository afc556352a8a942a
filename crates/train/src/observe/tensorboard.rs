//! TensorBoard event files (`--tensorboard DIR`): every number of a step's `metrics.jsonl`
//! line as a scalar, for the dashboards that read TensorBoard (torchtitan, Megatron-LM,
//! nanotron and Lightning log there).
//!
//! The format, written by hand (about 100 lines, no protobuf code generator in the build):
//! - a file `events.out.tfevents.<seconds>.<host>.<pid>` (TensorBoard reads every file of a
//!   directory whose name holds "tfevents") of TFRecord records: the data's length as u64
//!   little-endian, the masked CRC-32C of those 8 bytes, the data, the masked CRC-32C of the data
//!   (tensorflow/core/lib/io/record_writer.cc; the mask is `crc32c.h`'s `Mask`);
//! - each record one `Event` protobuf (tensorflow/core/util/event.proto): `wall_time` = 1
//!   (double), `step` = 2 (int64), `file_version` = 3 (string, "brain.Event:2" in the first
//!   record), `summary` = 5; a `Summary` (summary.proto) holds repeated `value` = 1, each with
//!   `tag` = 1 (string) and `simple_value` = 2 (float), what `SummaryWriter.add_scalar` writes.
//!
//! The tags are the keys of `metrics.jsonl` ([`scalars`]), so the two agree by construction:
//! `rank_mem/1/mem_peak_measured` for a list of objects, `pp_bubble/0` for a list of numbers,
//! booleans as 0/1, text left out; plus `skipped` on every step (JSON lines only carry it when
//! true) and `skipped_steps`, the count so far. tests/reference/tensorboard_check.py reads the
//! files with TensorBoard's own `EventAccumulator` and compares them with `metrics.jsonl`.

use crate::observe::metrics::StepMetrics;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), byte-wise with a 256-entry table.
pub fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 {
                    (c >> 1) ^ 0x82F6_3B78
                } else {
                    c >> 1
                };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    let mut crc = !0u32;
    for &b in data {
        crc = TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
    }
    !crc
}

/// TFRecord's masked CRC: rotated right by 15 and offset, so that a CRC of data holding CRCs
/// is not itself trivial (crc32c.h).
pub fn masked_crc(data: &[u8]) -> u32 {
    let c = crc32c(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u64, data: &[u8]) {
    varint(out, field << 3 | 2);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// One `Event` protobuf: a step's scalars, or the file version when `values` is empty.
fn encode_event(
    wall_time: f64,
    step: u64,
    version: Option<&str>,
    values: &[(String, f64)],
) -> Vec<u8> {
    let mut e = vec![];
    varint(&mut e, 1 << 3 | 1);
    e.extend_from_slice(&wall_time.to_le_bytes());
    varint(&mut e, 2 << 3);
    varint(&mut e, step);
    if let Some(v) = version {
        bytes_field(&mut e, 3, v.as_bytes());
    }
    if !values.is_empty() {
        let mut summary = vec![];
        for (tag, x) in values {
            let mut value = vec![];
            bytes_field(&mut value, 1, tag.as_bytes());
            varint(&mut value, 2 << 3 | 5);
            value.extend_from_slice(&(*x as f32).to_le_bytes());
            bytes_field(&mut summary, 1, &value);
        }
        bytes_field(&mut e, 5, &summary);
    }
    e
}

/// One TFRecord: length, its masked CRC, data, the data's masked CRC.
fn record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut r = Vec::with_capacity(data.len() + 16);
    r.extend_from_slice(&len);
    r.extend_from_slice(&masked_crc(&len).to_le_bytes());
    r.extend_from_slice(data);
    r.extend_from_slice(&masked_crc(data).to_le_bytes());
    r
}

/// Every number of `m`'s JSON line as `(tag, value)`, in the line's key order; see the
/// module's documentation for the tags. `skipped_before` is the count of earlier skipped steps.
pub fn scalars(m: &StepMetrics, skipped_before: u64) -> Vec<(String, f64)> {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<(String, f64)>) {
        match v {
            Value::Number(n) => out.extend(n.as_f64().map(|x| (prefix.to_string(), x))),
            Value::Bool(b) => out.push((prefix.to_string(), f64::from(u8::from(*b)))),
            Value::Array(items) => {
                for (i, x) in items.iter().enumerate() {
                    walk(&format!("{prefix}/{i}"), x, out);
                }
            }
            Value::Object(map) => {
                for (k, x) in map {
                    let tag = if prefix.is_empty() {
                        k.clone()
                    } else {
                        format!("{prefix}/{k}")
                    };
                    walk(&tag, x, out);
                }
            }
            Value::String(_) | Value::Null => {}
        }
    }
    let mut out = vec![];
    if let Ok(line) = serde_json::to_value(m) {
        walk("", &line, &mut out);
    }
    // The step is the event's own field, not a series.
    out.retain(|(t, _)| t != "step" && t != "skipped");
    out.push(("skipped".into(), f64::from(u8::from(m.skipped))));
    out.push((
        "skipped_steps".into(),
        (skipped_before + u64::from(m.skipped)) as f64,
    ));
    out
}

/// An event file being written; one event per step, flushed as written.
pub struct TensorBoardWriter {
    path: PathBuf,
    file: std::io::BufWriter<std::fs::File>,
    skipped: u64,
}

fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl TensorBoardWriter {
    /// A new event file in `dir` (created), starting with the file-version event.
    pub fn create(dir: &Path) -> Result<Self> {
        std::fs::create_dir_all(dir).with_context(|| {
            format!(
                "tensorboard = {}: cannot create the directory",
                dir.display()
            )
        })?;
        let host = std::fs::read_to_string("/etc/hostname")
            .ok()
            .map(|h| h.trim().to_string())
            .filter(|h| !h.is_empty() && !h.contains('/'))
            .unwrap_or_else(|| "localhost".into());
        let wall = now();
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            wall as u64,
            std::process::id()
        ));
        let file = std::fs::File::create(&path).with_context(|| {
            format!(
                "tensorboard = {}: cannot create {}",
                dir.display(),
                path.display()
            )
        })?;
        let mut w = TensorBoardWriter {
            path,
            file: std::io::BufWriter::new(file),
            skipped: 0,
        };
        w.append(&encode_event(wall, 0, Some("brain.Event:2"), &[]))?;
        Ok(w)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn append(&mut self, event: &[u8]) -> Result<()> {
        self.file.write_all(&record(event))?;
        self.file.flush()?;
        Ok(())
    }

    /// The step's scalars as one event.
    pub fn write(&mut self, m: &StepMetrics) -> Result<()> {
        let values = scalars(m, self.skipped);
        self.skipped += u64::from(m.skipped);
        self.append(&encode_event(now(), m.step, None, &values))
    }
}

/// An event as read back: its step, file version (the first event) and scalars.
#[derive(Debug, Clone, PartialEq)]
pub struct Event {
    pub wall_time: f64,
    pub step: u64,
    pub file_version: Option<String>,
    pub values: Vec<(String, f32)>,
}

/// One protobuf field as read: a varint's value in `varint`, other payloads in `bytes`
/// (fixed widths little-endian).
struct Field {
    number: u64,
    wire: u8,
    bytes: Vec<u8>,
    varint: u64,
}

/// Reads the fields of one protobuf message.
fn fields(mut b: &[u8]) -> Result<Vec<Field>> {
    fn read_varint(b: &mut &[u8]) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some((&byte, rest)) = b.split_first() else {
                bail!("truncated varint")
            };
            *b = rest;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!("varint longer than 10 bytes")
    }
    let mut out = vec![];
    while !b.is_empty() {
        let key = read_varint(&mut b)?;
        let (field, wire) = (key >> 3, (key & 7) as u8);
        let field_of = |bytes, varint| Field {
            number: field,
            wire,
            bytes,
            varint,
        };
        let take = |b: &mut &[u8], n: usize| -> Result<Vec<u8>> {
            if b.len() < n {
                bail!("field {field}: {n} bytes announced, {} left", b.len());
            }
            let (x, rest) = b.split_at(n);
            *b = rest;
            Ok(x.to_vec())
        };
        match wire {
            0 => {
                let v = read_varint(&mut b)?;
                out.push(field_of(vec![], v));
            }
            1 => out.push(field_of(take(&mut b, 8)?, 0)),
            2 => {
                let n = read_varint(&mut b)? as usize;
                out.push(field_of(take(&mut b, n)?, 0));
            }
            5 => out.push(field_of(take(&mut b, 4)?, 0)),
            w => bail!("field {field}: wire type {w} is not used by event files"),
        }
    }
    Ok(out)
}

fn decode_event(data: &[u8]) -> Result<Event> {
    let mut e = Event {
        wall_time: 0.0,
        step: 0,
        file_version: None,
        values: vec![],
    };
    for Field {
        number,
        wire,
        bytes,
        varint: v,
    } in fields(data)?
    {
        match (number, wire) {
            (1, 1) => e.wall_time = f64::from_le_bytes(bytes.try_into().unwrap_or_default()),
            (2, 0) => e.step = v,
            (3, 2) => e.file_version = Some(String::from_utf8(bytes)?),
            (5, 2) => {
                for value in fields(&bytes)? {
                    if (value.number, value.wire) != (1, 2) {
                        continue;
                    }
                    let (mut tag, mut x) = (String::new(), None);
                    for Field {
                        number,
                        wire,
                        bytes: b,
                        ..
                    } in fields(&value.bytes)?
                    {
                        match (number, wire) {
                            (1, 2) => tag = String::from_utf8(b)?,
                            (2, 5) => {
                                x = Some(f32::from_le_bytes(b.try_into().unwrap_or_default()))
                            }
                            _ => {}
                        }
                    }
                    let Some(x) = x else {
                        bail!("summary value {tag} has no simple_value")
                    };
                    e.values.push((tag, x));
                }
            }
            _ => {}
        }
    }
    Ok(e)
}

/// Every event of an event file, each record's two CRCs checked.
pub fn read_events(path: &Path) -> Result<Vec<Event>> {
    let data = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut b = &data[..];
    let mut events = vec![];
    while !b.is_empty() {
        let at = data.len() - b.len();
        if b.len() < 12 {
            bail!("{}: truncated record header at byte {at}", path.display());
        }
        let (len, crc) = (&b[..8], u32::from_le_bytes(b[8..12].try_into()?));
        if masked_crc(len) != crc {
            bail!("{}: length CRC mismatch at byte {at}", path.display());
        }
        let n = u64::from_le_bytes(len.try_into()?) as usize;
        if b.len() < 12 + n + 4 {
            bail!("{}: truncated record at byte {at}", path.display());
        }
        let body = &b[12..12 + n];
        let crc = u32::from_le_bytes(b[12 + n..16 + n].try_into()?);
        if masked_crc(body) != crc {
            bail!("{}: data CRC mismatch at byte {at}", path.display());
        }
        events.push(
            decode_event(body)
                .with_context(|| format!("{}: record at byte {at}", path.display()))?,
        );
        b = &b[16 + n..];
    }
    Ok(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(step: u64, skipped: bool) -> StepMetrics {
        StepMetrics {
            step,
            loss: 9.0 - step as f64,
            lr: 3e-3,
            grad_norm: 1.25,
            tokens_per_s: 12345.5,
            mfu: 0.125,
            hfu: 0.25,
            step_ms: 80.0,
            mem_peak_measured: 1 << 20,
            mem_peak_planned: (1 << 20) + 4096,
            mem_device_driver: None,
            device_ops: None,
            val_loss: (step == 2).then_some(8.5),
            loss_scale: None,
            skipped,
            rank_mem: vec![
                crate::observe::metrics::RankMem {
                    rank: 0,
                    mem_peak_planned: 100,
                    mem_peak_measured: 90,
                    kernel_workspace: 0,
                },
                crate::observe::metrics::RankMem {
                    rank: 1,
                    mem_peak_planned: 101,
                    mem_peak_measured: 91,
                    kernel_workspace: 0,
                },
            ],
            comm: {
                let mut c = crate::observe::metrics::CommByDim::default();
                let dp = crate::observe::metrics::CommBytes {
                    sent: 4096,
                    planned: 4096,
                };
                c.insert(ferrotron_plan::cluster::Dim::Dp, dp);
                c
            },
            comm_exposed_ms: None,
            host_transfer: None,
            pp_bubble: vec![0.5, 0.25],
            pp_bubble_planned: Some(0.5),
            gemm: "portable".into(),
        }
    }

    #[test]
    fn crc32c_of_the_standard_check_string() {
        // RFC 3720 (iSCSI) B.4 and every CRC catalogue: CRC-32C("123456789") = 0xE3069283.
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(b""), 0);
        // 32 bytes of zeros, RFC 3720 B.4's first vector.
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn written_events_read_back_with_their_crcs() {
        let dir = std::env::temp_dir().join(format!("ferrotron-tb-unit-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut w = TensorBoardWriter::create(&dir).unwrap();
        let steps = [metrics(1, false), metrics(2, true), metrics(3, false)];
        for m in &steps {
            w.write(m).unwrap();
        }
        let path = w.path().to_path_buf();
        drop(w);
        assert!(path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .starts_with("events.out.tfevents."));
        let events = read_events(&path).unwrap();
        assert_eq!(events.len(), 4);
        assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
        assert!(events[0].values.is_empty());
        for (e, m) in events[1..].iter().zip(&steps) {
            assert_eq!(e.step, m.step);
            assert!(e.wall_time > 1.6e9, "seconds since 1970: {}", e.wall_time);
            let tags: Vec<&str> = e.values.iter().map(|(t, _)| t.as_str()).collect();
            for t in [
                "loss",
                "lr",
                "grad_norm",
                "tokens_per_s",
                "mfu",
                "mem_peak_planned",
                "mem_peak_measured",
                "rank_mem/1/mem_peak_measured",
                "comm/dp/sent",
                "pp_bubble/1",
                "skipped",
                "skipped_steps",
            ] {
                assert!(tags.contains(&t), "step {}: no {t} in {tags:?}", m.step);
            }
            assert!(!tags.contains(&"gemm") && !tags.contains(&"step"));
            let get = |t: &str| e.values.iter().find(|(x, _)| x == t).map(|(_, v)| *v);
            assert_eq!(get("loss"), Some(m.loss as f32));
            assert_eq!(get("rank_mem/1/mem_peak_measured"), Some(91.0));
            assert_eq!(get("val_loss"), m.val_loss.map(|v| v as f32));
            assert_eq!(get("skipped"), Some(if m.skipped { 1.0 } else { 0.0 }));
            // Step 2 skipped: the count is 0, 1, 1.
            assert_eq!(
                get("skipped_steps"),
                Some(if m.step == 1 { 0.0 } else { 1.0 })
            );
            let want: Vec<(String, f32)> = scalars(m, u64::from(m.step > 2))
                .into_iter()
                .map(|(t, x)| (t, x as f32))
                .collect();
            assert_eq!(e.values, want);
        }
        // One flipped bit in a value is caught by the data CRC; one in a length by its own.
        let mut bytes = std::fs::read(&path).unwrap();
        let last = bytes.len() - 10;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = read_events(&path).unwrap_err().to_string();
        assert!(e.contains("data CRC mismatch"), "{e}");
        bytes[last] ^= 1;
        bytes[0] ^= 4;
        std::fs::write(&path, &bytes).unwrap();
        let e = read_events(&path).unwrap_err().to_string();
        assert!(e.contains("length CRC mismatch at byte 0"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn an_unwritable_directory_is_named() {
        let e = TensorBoardWriter::create(Path::new("/proc/ferrotron-no/tb"))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.starts_with("tensorboard = /proc/ferrotron-no/tb: cannot create"),
            "{e}"
        );
    }
}
