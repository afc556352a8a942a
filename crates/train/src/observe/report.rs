//! `ferrotron report RUN_DIR`: one self-contained HTML page about a training run, from the files
//! `ferrotron train` leaves in its output directory: metrics.jsonl (loss, throughput), plan.json
//! (the memory plan) and memory_timeline.json (measured vs planned live bytes). Plots are inline
//! SVG; the font is embedded, so the page looks the same on a machine without fonts.

use crate::memory::timeline::TimelineFile;
use crate::observe::metrics::StepMetrics;
use anyhow::{bail, Context, Result};
use ferrotron_plan::report::svg::{esc, hbars, xy_chart, Series, XyAxes, FONT_FAMILY};
use std::fmt::Write;
use std::path::Path;

/// DejaVu Sans, subset to printable ASCII and a few symbols (° µ × · – — −) with fontTools'
/// pyftsubset (13 KiB). License: Bitstream Vera license, DejaVu changes public domain; the full
/// text is in crates/train/assets/DejaVuSans-LICENSE.txt.
const FONT: &[u8] = include_bytes!("../../assets/DejaVuSans-subset.ttf");

const MIB: f64 = (1u64 << 20) as f64;

/// The ids of the plots, in page order (tests check every one is present).
pub const PLOT_IDS: [&str; 4] = [
    "plot-loss",
    "plot-throughput",
    "plot-memory-timeline",
    "plot-memory-components",
];

fn base64(data: &[u8]) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut s = String::with_capacity(data.len().div_ceil(3) * 4);
    for c in data.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for i in 0..4 {
            if i <= c.len() {
                s.push(T[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                s.push('=');
            }
        }
    }
    s
}

/// What a run directory holds.
pub struct RunData {
    pub steps: Vec<StepMetrics>,
    pub plan: Option<serde_json::Value>,
    pub timeline: Option<TimelineFile>,
}

/// The run's metrics: RUN_DIR/metrics.jsonl, or where its plan.json says `--metrics` put them.
fn metrics_path(dir: &Path) -> std::path::PathBuf {
    let here = dir.join("metrics.jsonl");
    if here.is_file() {
        return here;
    }
    std::fs::read_to_string(dir.join("plan.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("metrics")?.as_str().map(std::path::PathBuf::from))
        .unwrap_or(here)
}

/// Reads RUN_DIR; a directory without metrics.jsonl is not a run.
pub fn load(dir: &Path) -> Result<RunData> {
    if !dir.is_dir() {
        bail!(
            "run_dir = {}: not a directory (pass the --out-dir of a `ferrotron train` run, e.g. runs/default)",
            dir.display()
        );
    }
    let mp = metrics_path(dir);
    let text = std::fs::read_to_string(&mp).map_err(|e| {
        anyhow::anyhow!(
            "run_dir = {}: cannot read metrics.jsonl ({e}); pass the --out-dir of a `ferrotron train` run",
            dir.display()
        )
    })?;
    let mut steps = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let m: StepMetrics = serde_json::from_str(line)
            .with_context(|| format!("{} line {}: not a metrics record", mp.display(), i + 1))?;
        steps.push(m);
    }
    if steps.is_empty() {
        bail!(
            "run_dir = {}: metrics.jsonl has no steps yet",
            dir.display()
        );
    }
    let read_json = |name: &str| -> Result<Option<String>> {
        let p = dir.join(name);
        match std::fs::read_to_string(&p) {
            Ok(t) => Ok(Some(t)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(anyhow::anyhow!("cannot read {}: {e}", p.display())),
        }
    };
    let plan = read_json("plan.json")?
        .map(|t| serde_json::from_str(&t))
        .transpose()
        .with_context(|| format!("{}: not valid JSON", dir.join("plan.json").display()))?;
    let timeline = read_json("memory_timeline.json")?
        .map(|t| serde_json::from_str(&t))
        .transpose()
        .with_context(|| {
            format!(
                "{}: not a memory timeline",
                dir.join("memory_timeline.json").display()
            )
        })?;
    Ok(RunData {
        steps,
        plan,
        timeline,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn series(label: &str, points: Vec<(f64, f64)>) -> Series {
    Series {
        label: label.into(),
        points,
        ..Series::default()
    }
}

fn loss_plot(steps: &[StepMetrics]) -> String {
    let train = series(
        "training loss",
        steps.iter().map(|m| (m.step as f64, m.loss)).collect(),
    );
    let val: Vec<(f64, f64)> = steps
        .iter()
        .filter_map(|m| m.val_loss.map(|v| (m.step as f64, v)))
        .collect();
    let mut s = vec![train];
    if !val.is_empty() {
        s.push(Series {
            markers: true,
            ..series("validation loss", val)
        });
    }
    xy_chart(
        &XyAxes {
            title: "Loss".into(),
            x_label: "step".into(),
            y_label: "cross-entropy (nats/token)".into(),
            ..XyAxes::default()
        },
        &s,
    )
}

fn throughput_plot(steps: &[StepMetrics]) -> String {
    let tps = series(
        "tokens/s",
        steps
            .iter()
            .map(|m| (m.step as f64, m.tokens_per_s))
            .collect(),
    );
    let mfu = Series {
        right: true,
        dashed: true,
        ..series(
            "MFU (%)",
            steps
                .iter()
                .map(|m| (m.step as f64, m.mfu * 100.0))
                .collect(),
        )
    };
    xy_chart(
        &XyAxes {
            title: "Throughput".into(),
            x_label: "step".into(),
            y_label: "tokens/s".into(),
            y2_label: Some("MFU (%)".into()),
            y_from_zero: true,
            ..XyAxes::default()
        },
        &[tps, mfu],
    )
}

/// Short x labels: "init", "grads", "s1 F0", "s1 loss", "s1 B5", "s1 opt" (with "mb" when
/// there are several micro-batches).
fn short_label(label: &str) -> String {
    let w: Vec<&str> = label.split(' ').collect();
    match w.as_slice() {
        ["model", "init"] => "init".into(),
        ["gradients", "allocated"] => "grads".into(),
        ["step", s, "optimizer"] => format!("s{s} opt"),
        ["step", s, "mb", m, "loss"] => format!("s{s} m{m} loss"),
        ["step", s, "mb", m, dir, "layer", i] => {
            format!("s{s} m{m} {}{i}", if *dir == "forward" { "F" } else { "B" })
        }
        _ => label.into(),
    }
}

fn timeline_plot(t: &TimelineFile) -> String {
    let planned = series(
        "planned (memory plan)",
        t.points
            .iter()
            .enumerate()
            .map(|(i, p)| (i as f64, p.planned as f64 / MIB))
            .collect(),
    );
    let measured = Series {
        markers: true,
        no_line: true,
        ..series(
            "measured (tracking allocator)",
            t.points
                .iter()
                .enumerate()
                .map(|(i, p)| (i as f64, p.measured as f64 / MIB))
                .collect(),
        )
    };
    let ticks = t
        .points
        .iter()
        .enumerate()
        .map(|(i, p)| (i as f64, short_label(&p.label)))
        .collect();
    xy_chart(
        &XyAxes {
            title: format!(
                "Memory timeline: live bytes at each phase boundary (max deviation {:.3}%)",
                t.max_abs_deviation * 100.0
            ),
            x_label: String::new(),
            y_label: "MiB over baseline".into(),
            x_ticks: Some(ticks),
            y_from_zero: true,
            ..XyAxes::default()
        },
        &[planned, measured],
    )
}

/// Planned bytes by component at the plan's peak, plus the kernel workspace (its overhead term).
fn components(plan: &serde_json::Value) -> Vec<(String, f64)> {
    let at = &plan["rank"]["at_peak"];
    let mut out: Vec<(String, f64)> = [
        ("parameters", "params"),
        ("gradients", "grads"),
        ("master weights", "master"),
        ("optimizer states", "optimizer"),
        ("layer activations", "layer_activations"),
        ("other activations", "other_activations"),
        ("workspace buffers", "workspace"),
        ("communication buffers", "comm_buffers"),
    ]
    .iter()
    .filter_map(|(label, key)| {
        let b = at[*key].as_u64()?;
        (b > 0).then(|| (label.to_string(), b as f64 / MIB))
    })
    .collect();
    if let Some(o) = plan["rank"]["overhead"].as_u64().filter(|&o| o > 0) {
        out.push(("kernel workspace (gemm)".into(), o as f64 / MIB));
    }
    out
}

fn figure(o: &mut String, id: &str, svg: &str, caption: &str) {
    let _ = write!(
        o,
        r#"<figure id="{id}">{svg}<figcaption>{}</figcaption></figure>"#,
        esc(caption)
    );
}

fn missing(o: &mut String, id: &str, what: &str) {
    let _ = write!(
        o,
        r#"<figure id="{id}" class="missing"><p>{}</p></figure>"#,
        esc(what)
    );
}

/// The page for a loaded run.
pub fn render(name: &str, d: &RunData) -> String {
    let steps = &d.steps;
    let last = steps.last().expect("load() rejects runs without steps");
    let timed: Vec<&StepMetrics> = steps.iter().skip(1).collect();
    let timed = if timed.is_empty() {
        steps.iter().collect()
    } else {
        timed
    };
    let val = steps.iter().rev().find_map(|m| m.val_loss);
    let model = d
        .plan
        .as_ref()
        .and_then(|p| p["model"].as_str().map(String::from))
        .unwrap_or_else(|| "?".into());
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<!doctype html><html lang="en"><head><meta charset="utf-8"><title>ferrotron run {title}</title>
<style>
/* DejaVu Sans (subset), Bitstream Vera license; DejaVu changes are public domain. */
@font-face {{ font-family: 'DejaVu Sans'; src: url(data:font/ttf;base64,{font}) format('truetype'); }}
body {{ font-family: {FONT_FAMILY}; margin: 24px; color: #222; max-width: 940px; }}
svg, svg text {{ font-family: {FONT_FAMILY}; }}
h1 {{ font-size: 22px; }} figure {{ margin: 18px 0; }} figcaption {{ font-size: 12px; color: #555; }}
table {{ border-collapse: collapse; font-size: 13px; }} td, th {{ padding: 2px 10px; text-align: right; border-bottom: 1px solid #eee; }}
th:first-child, td:first-child {{ text-align: left; }} .missing p {{ color: #a33; }}
</style></head><body>
<h1>ferrotron run: {title}</h1>"#,
        title = esc(name),
        font = base64(FONT),
    );
    let mfu = median(timed.iter().map(|m| m.mfu * 100.0).collect());
    let _ = write!(
        o,
        r#"<table id="summary"><tr><th>model</th><td>{}</td></tr><tr><th>steps</th><td>{}</td></tr><tr><th>final training loss</th><td>{:.4}</td></tr><tr><th>final validation loss</th><td>{}</td></tr><tr><th>median tokens/s (after step 1)</th><td>{:.0}</td></tr><tr><th>median MFU</th><td>{mfu:.1}%</td></tr><tr><th>peak memory planned / measured</th><td>{:.2} / {:.2} MiB</td></tr></table>"#,
        esc(&model),
        last.step,
        last.loss,
        val.map_or("–".into(), |v| format!("{v:.4}")),
        median(timed.iter().map(|m| m.tokens_per_s).collect()),
        steps.iter().map(|m| m.mem_peak_planned).max().unwrap_or(0) as f64 / MIB,
        steps.iter().map(|m| m.mem_peak_measured).max().unwrap_or(0) as f64 / MIB,
    );
    figure(
        &mut o,
        PLOT_IDS[0],
        &loss_plot(steps),
        "Mean training loss of each step; validation loss at each evaluation.",
    );
    figure(
        &mut o,
        PLOT_IDS[1],
        &throughput_plot(steps),
        "Tokens per second (left axis) and model FLOPs utilisation against the machine's measured matmul peak (right axis).",
    );
    match &d.timeline {
        Some(t) if !t.points.is_empty() => figure(
            &mut o,
            PLOT_IDS[2],
            &timeline_plot(t),
            "Live heap bytes over the baseline at every phase boundary of the first steps (F = a layer's forward done, B = its backward done), against the memory plan's prediction for the same point. Step 2 starts higher: the Adam states created by the first optimizer step.",
        ),
        _ => missing(
            &mut o,
            PLOT_IDS[2],
            "No memory_timeline.json in this run directory (train with --memory-timeline-steps > 0).",
        ),
    }
    match &d.plan {
        Some(p) => figure(
            &mut o,
            PLOT_IDS[3],
            &hbars(
                &format!(
                    "Planned memory by component at the peak ({})",
                    p["rank"]["sweep"]["peak_label"].as_str().unwrap_or("?")
                ),
                "MiB",
                &components(p),
            ),
            "From the run's memory plan (plan.json): what is live at the step's peak. The kernel workspace is transient, inside matmul calls.",
        ),
        None => missing(
            &mut o,
            PLOT_IDS[3],
            "No plan.json in this run directory (written by `ferrotron train` at start).",
        ),
    }
    o.push_str(r#"<details id="steps"><summary>Per-step metrics</summary><table><tr><th>step</th><th>loss</th><th>val loss</th><th>lr</th><th>grad norm</th><th>tokens/s</th><th>MFU %</th><th>peak MiB (measured / planned)</th></tr>"#);
    for m in steps {
        let _ = write!(
            o,
            "<tr><td>{}</td><td>{:.4}</td><td>{}</td><td>{:.2e}</td><td>{:.3}</td><td>{:.0}</td><td>{:.1}</td><td>{:.2} / {:.2}</td></tr>",
            m.step,
            m.loss,
            m.val_loss.map_or(String::new(), |v| format!("{v:.4}")),
            m.lr,
            m.grad_norm,
            m.tokens_per_s,
            m.mfu * 100.0,
            m.mem_peak_measured as f64 / MIB,
            m.mem_peak_planned as f64 / MIB
        );
    }
    o.push_str("</table></details></body></html>\n");
    o
}

/// Builds RUN_DIR's report and writes it to `out` (default RUN_DIR/report.html).
pub fn write(dir: &Path, out: Option<&Path>) -> Result<std::path::PathBuf> {
    let d = load(dir)?;
    let name = dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| dir.display().to_string());
    let html = render(&name, &d);
    let path = out.map_or_else(|| dir.join("report.html"), Path::to_path_buf);
    std::fs::write(&path, html).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_rfc4648_vectors() {
        for (i, o) in [
            ("", ""),
            ("f", "Zg=="),
            ("fo", "Zm8="),
            ("foo", "Zm9v"),
            ("foob", "Zm9vYg=="),
            ("fooba", "Zm9vYmE="),
            ("foobar", "Zm9vYmFy"),
        ] {
            assert_eq!(base64(i.as_bytes()), o);
        }
    }

    #[test]
    fn short_labels() {
        assert_eq!(short_label("step 2 mb 0 forward layer 5"), "s2 m0 F5");
        assert_eq!(short_label("step 1 optimizer"), "s1 opt");
        assert_eq!(short_label("model init"), "init");
    }
}
