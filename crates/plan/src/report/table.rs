//! The default human-readable table.

use super::Report;
use std::fmt::Write;

pub fn gib(b: u64) -> String {
    format!("{:.2}", b as f64 / crate::GIB)
}

fn commas(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
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
    let rows: [(&str, Get); 12] = [
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
    ];
    for (label, get) in rows {
        if label == "offloaded to host" && cols.iter().all(|&i| rep.ranks[i].host_offload == 0) {
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
    if let Some(v) = &rep.verdict {
        let _ = writeln!(o);
        if v.fits {
            let _ = writeln!(
                o,
                "Verdict: fits on {} ({} GiB) with {} GiB free.",
                v.gpu,
                gib(v.capacity),
                gib(v.free as u64)
            );
        } else {
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
                        "  cheapest change that fits: {} ({}), peak {} GiB",
                        s.flags,
                        s.why,
                        gib(s.peak)
                    );
                }
                None => {
                    let _ = writeln!(o, "  no combination of up to three standard changes fits; add GPUs or shorten seq");
                }
            }
        }
    }
    o
}
