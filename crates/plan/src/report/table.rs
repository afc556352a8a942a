//! The default human-readable table.

use super::Report;
use crate::verdict::{Suggestion, Verdict};
use std::fmt::Write;

pub fn gib(b: u64) -> String {
    format!("{:.2}", b as f64 / crate::GIB)
}

fn commas(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// The ranks shown as columns: all of them up to 6, else the first, the most loaded and the last.
fn shown(rep: &Report) -> Vec<usize> {
    let n = rep.ranks.len();
    if n <= 6 {
        return (0..n).collect();
    }
    let mut v = vec![0, rep.most_loaded, n - 1];
    v.sort_unstable();
    v.dedup();
    v
}

pub fn render(rep: &Report) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "ferrotron plan: {}", rep.model);
    let active = if rep.params_active != rep.params_total {
        format!(" (active per token: {})", commas(rep.params_active))
    } else {
        String::new()
    };
    let _ = writeln!(o, "  parameters  {}{active}", commas(rep.params_total));
    let _ = writeln!(o, "  convention  {}", rep.convention);
    for (k, v) in &rep.settings {
        let _ = writeln!(o, "  {k:<11} {v}");
    }
    let cols = shown(rep);
    let _ = writeln!(
        o,
        "\nMemory per rank, GiB (2^30 bytes), at each rank's peak:"
    );
    let _ = write!(o, "  {:<28}", "");
    for &i in &cols {
        let mark = if i == rep.most_loaded && rep.ranks.len() > 1 {
            " *"
        } else {
            ""
        };
        let _ = write!(o, "{:>22}", format!("{}{mark}", rep.ranks[i].name));
    }
    let _ = writeln!(o);
    type Get = fn(&super::RankSummary) -> u64;
    let rows: [(&str, Get); 13] = [
        ("parameters", |r| r.params),
        ("gradients", |r| r.grads),
        ("master weights (fp32)", |r| r.master),
        ("optimizer states", |r| r.optimizer),
        ("= model states", |r| r.model_states),
        ("activations", |r| r.activations),
        ("  of which layers", |r| r.activations_layers),
        ("workspace", |r| r.workspace),
        ("comm buffers", |r| r.comm_buffers),
        ("overhead", |r| r.overhead),
        ("= peak", |r| r.peak),
        ("offloaded to host", |r| r.host_offload),
        ("offloaded to disk", |r| r.disk_offload),
    ];
    for (label, get) in rows {
        let offload = label.starts_with("offloaded to");
        if offload && cols.iter().all(|&i| get(&rep.ranks[i]) == 0) {
            continue;
        }
        let _ = write!(o, "  {label:<28}");
        for &i in &cols {
            let _ = write!(o, "{:>22}", gib(get(&rep.ranks[i])));
        }
        let _ = writeln!(o);
    }
    let w = rep.worst();
    let _ = writeln!(o, "  peak reached at: {} ({})", w.peak_at, w.name);
    let _ = writeln!(o, "  {}", rep.overhead_note);

    let _ = writeln!(
        o,
        "\nTimeline of {} over the first two steps (GiB):",
        w.name
    );
    let max = rep
        .timeline
        .iter()
        .map(|p| p.bytes)
        .max()
        .unwrap_or(1)
        .max(1);
    for p in &rep.timeline {
        let bar = "█".repeat(((p.bytes as f64 / max as f64) * 40.0).round() as usize);
        let _ = writeln!(o, "  {:<36}{:>9}  {bar}", p.phase, gib(p.bytes));
    }
    if !rep.step2_explanation.is_empty() {
        let _ = writeln!(o, "  {}", rep.step2_explanation);
    }
    if let Some(t) = &rep.time {
        o.push_str(&render_time(t));
    }
    if let Some(v) = &rep.verdict {
        o.push_str(&render_verdict(v, rep.time.as_ref()));
    }
    o
}

/// The fit verdict and, when it does not fit, the options: those on the same GPUs first, then
/// those that add GPUs, one line each with its peak, whether it fits, and its speed cost.
pub fn render_verdict(v: &Verdict, time: Option<&crate::time::TimeReport>) -> String {
    let mut o = String::new();
    let _ = writeln!(o);
    if v.fits {
        let _ = writeln!(
            o,
            "Verdict: fits on {} ({} GiB) with {} GiB free.",
            v.gpu,
            gib(v.capacity),
            gib(v.free as u64)
        );
        return o;
    }
    let _ = writeln!(
        o,
        "Verdict: does NOT fit on {} ({} GiB): peak {} GiB, {} GiB over.",
        v.gpu,
        gib(v.capacity),
        gib(v.peak),
        gib(v.free.unsigned_abs())
    );
    match &v.suggestion {
        Some(s) => {
            let _ = writeln!(
                o,
                "  recommended: {} ({}), peak {} GiB, {}",
                s.flags,
                s.why,
                gib(s.peak),
                cost(s)
            );
        }
        None => {
            let _ = writeln!(
                o,
                "  no option below fits (up to three changes combined); shorten seq or use a larger GPU"
            );
        }
    }
    let width = v.options.iter().map(|s| s.flags.len()).max().unwrap_or(0);
    let gpus = |n: u64| format!("{n} GPU{}", if n == 1 { "" } else { "s" });
    let same: Vec<&Suggestion> = v.options.iter().filter(|s| !s.adds_gpus).collect();
    let more: Vec<&Suggestion> = v.options.iter().filter(|s| s.adds_gpus).collect();
    for (title, list) in [
        (format!("On the same {}:", gpus(v.gpus)), same),
        ("Adding GPUs:".to_string(), more),
    ] {
        if list.is_empty() {
            continue;
        }
        let _ = writeln!(
            o,
            "  {title:<w$}{:>9}  {:<4}  {:<8}  speed cost",
            "peak GiB",
            "fits",
            "GPUs",
            w = width + 2
        );
        for s in list {
            let batch = if s.global_batch != v.global_batch {
                format!(
                    "; global batch {} → {} sequences",
                    v.global_batch, s.global_batch
                )
            } else {
                String::new()
            };
            let _ = writeln!(
                o,
                "    {:<width$}{:>9}  {:<4}  {:<8}  {}{batch}",
                s.flags,
                gib(s.peak),
                if s.fits { "yes" } else { "no" },
                gpus(s.gpus),
                cost(s)
            );
        }
    }
    if let Some(t) = time {
        let _ = writeln!(
            o,
            "  speed cost: time per token against this configuration's predicted {} step (as if it fitted)",
            secs(t.step_s)
        );
    }
    o
}

/// An option's speed cost: its predicted step time and time per token against the current
/// configuration, or in words without a time estimate.
fn cost(s: &Suggestion) -> String {
    match (s.step_s, s.slowdown) {
        (Some(step), Some(d)) => format!("{:+.1}% (step {})", d * 100.0, secs(step)),
        _ => s.cost.clone(),
    }
}

/// Seconds with a sensible number of digits.
pub fn secs(s: f64) -> String {
    if s >= 100.0 {
        format!("{s:.1} s")
    } else if s >= 1.0 {
        format!("{s:.3} s")
    } else {
        format!("{:.2} ms", s * 1e3)
    }
}

fn bytes_si(b: f64) -> String {
    if b >= 1e9 {
        format!("{:.2} GB", b / 1e9)
    } else {
        format!("{:.1} MB", b / 1e6)
    }
}

/// The step-time section: throughput, utilisation, the breakdown and communication per dimension.
pub fn render_time(t: &crate::time::TimeReport) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "\nStep time on {} × {} ({}):", t.gpus, t.gpu, t.cluster);
    let _ = writeln!(
        o,
        "  step {}, {} tokens/s ({} tokens per step)",
        secs(t.step_s),
        commas(t.tokens_per_s.round() as u64),
        commas(t.tokens_per_step)
    );
    let _ = writeln!(
        o,
        "  MFU {:.1}% ({} FLOPs convention), HFU {:.1}% (recomputation included), peak {:.0} TFLOP/s per GPU",
        t.mfu * 100.0,
        t.flops_convention,
        t.hfu * 100.0,
        t.efficiency.peak_flops / 1e12
    );
    let b = &t.breakdown;
    let parts = [
        ("compute (forward + backward)", b.compute_s),
        ("recompute", b.recompute_s),
        ("exposed communication", b.exposed_comm_s),
        ("pipeline bubble", b.bubble_s),
        ("optimizer step", b.optimizer_s),
    ];
    for (label, s) in parts {
        let pct = if t.step_s > 0.0 {
            s / t.step_s * 100.0
        } else {
            0.0
        };
        let bar = "█".repeat((pct / 2.5).round() as usize);
        let _ = writeln!(o, "  {label:<30}{:>12} {pct:>5.1}%  {bar}", secs(s));
    }
    if let Some(d) = &t.disk {
        let _ = writeln!(
            o,
            "    the optimizer's disk tier: {} GiB read + {} GiB written per step, {} of I/O overlapping the host's update, {} with it",
            gib(d.read_bytes),
            gib(d.written_bytes),
            secs(d.io_s),
            secs(d.optimizer_s)
        );
    }
    let d = &t.compute_detail;
    let _ = writeln!(
        o,
        "  compute by kernel: matmuls {}, attention {}, memory-bound {} (slowest stage: {})",
        secs(d.matmul_s),
        secs(d.attention_s),
        secs(d.memory_bound_s),
        t.slowest_stage
    );
    let _ = writeln!(
        o,
        "\n  Communication per rank per step:  {:<5}{:>6}{:>12}{:>12}{:>12}  where",
        "dim", "group", "bytes", "time", "exposed"
    );
    for (dim, c) in &t.comm {
        if c.group <= 1 && c.bytes == 0.0 {
            continue;
        }
        let _ = writeln!(
            o,
            "  {:<34}{:<5}{:>6}{:>12}{:>12}{:>12}  {}",
            "",
            dim.name(),
            c.group,
            bytes_si(c.bytes),
            secs(c.s),
            secs(c.exposed_s),
            if c.crosses_nodes {
                "crosses nodes"
            } else {
                "within a node"
            }
        );
    }
    let flops: Vec<String> = t
        .flops_per_token
        .iter()
        .map(|(c, f)| format!("{c} {:.3e}", f))
        .collect();
    let _ = writeln!(o, "  model FLOPs per token: {}", flops.join(", "));
    for n in &t.notes {
        let _ = writeln!(o, "  {n}");
    }
    o
}
