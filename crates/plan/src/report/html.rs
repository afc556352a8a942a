//! `--html FILE`: a self-contained page (inline SVG and CSS, no scripts or network).

use super::svg::{bars, esc, lines, stacked_bars};
use super::table::{gib, render};
use super::Report;
use std::fmt::Write;

pub fn to_html(rep: &Report) -> String {
    let mut o = String::new();
    let _ = write!(
        o,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>ferrotron plan: {}</title>\
         <style>body{{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}}\
         pre{{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}}\
         figure{{margin:1.5em 0}}figcaption{{color:#555;font-size:13px}}</style></head><body>",
        esc(&rep.model)
    );
    let _ = write!(o, "<h1>ferrotron plan: {}</h1>", esc(&rep.model));
    let w = rep.worst();
    if let Some(v) = &rep.verdict {
        let msg = if v.fits {
            format!(
                "Fits on {} with {} GiB free (peak {} GiB).",
                v.gpu,
                gib(v.free as u64),
                gib(v.peak)
            )
        } else {
            let fix = v
                .suggestion
                .as_ref()
                .map_or("none found".to_string(), |s| s.flags.clone());
            format!(
                "Does not fit on {}: peak {} GiB over {} GiB. Recommended fix: {}",
                v.gpu,
                gib(v.peak),
                gib(v.capacity),
                fix
            )
        };
        let _ = write!(o, "<p id=\"verdict\"><b>{}</b></p>", esc(&msg));
    }

    let groups: Vec<String> = rep.ranks.iter().map(|r| r.name.clone()).collect();
    type Get = fn(&super::RankSummary) -> u64;
    let comps: [(&str, Get); 8] = [
        ("parameters", |r| r.params),
        ("gradients", |r| r.grads),
        ("master weights", |r| r.master),
        ("optimizer states", |r| r.optimizer),
        ("activations", |r| r.activations),
        ("workspace", |r| r.workspace),
        ("comm buffers", |r| r.comm_buffers),
        ("overhead", |r| r.overhead),
    ];
    let series: Vec<(&str, Vec<u64>)> = comps
        .iter()
        .map(|(l, g)| (*l, rep.ranks.iter().map(g).collect()))
        .collect();
    let _ = write!(
        o,
        "<figure id=\"components\">{}<figcaption>Peak memory per rank kind, by component.</figcaption></figure>",
        stacked_bars("Memory per rank at peak", &groups, &series)
    );

    let points: Vec<(String, u64)> = rep
        .timeline
        .iter()
        .map(|p| (p.phase.clone(), p.bytes))
        .collect();
    let cap = rep.verdict.as_ref().map(|v| (v.gpu.as_str(), v.capacity));
    let _ = write!(
        o,
        "<figure id=\"timeline\">{}<figcaption>Memory of {} over the first two steps. {}</figcaption></figure>",
        bars("Timeline (first two steps)", &points, cap),
        esc(&w.name),
        esc(&rep.step2_explanation)
    );

    if !rep.activations_vs_seq.is_empty() {
        let xs: Vec<String> = rep
            .activations_vs_seq
            .iter()
            .map(|p| p.seq.to_string())
            .collect();
        let s = &rep.activations_vs_seq;
        let series = [
            ("no recompute", s.iter().map(|p| p.none).collect()),
            ("selective", s.iter().map(|p| p.selective).collect()),
            ("full", s.iter().map(|p| p.full).collect()),
        ];
        let _ = write!(
            o,
            "<figure id=\"activations-vs-seq\">{}<figcaption>Activation memory of the most loaded rank vs sequence length, per recompute policy.</figcaption></figure>",
            lines("Activations vs sequence length", &xs, &series)
        );
    }
    if let Some(t) = &rep.time {
        o.push_str(&time_section(t));
    }
    let _ = write!(
        o,
        "<h2>Details</h2><pre>{}</pre></body></html>",
        esc(&render(rep))
    );
    o
}

/// The step-time breakdown as an HTML table with CSS bars (no SVG, no scripts).
fn time_section(t: &crate::time::TimeReport) -> String {
    use super::table::secs;
    let mut o = String::new();
    let _ = write!(
        o,
        "<section id=\"time\"><h2>Step time</h2><p><b>{}</b> per step on {} × {}: <b>{:.0}</b> tokens/s, MFU <b>{:.1}%</b> ({} FLOPs), HFU {:.1}%.</p><table>",
        esc(&secs(t.step_s)),
        t.gpus,
        esc(&t.gpu),
        t.tokens_per_s,
        t.mfu * 100.0,
        esc(t.flops_convention.name()),
        t.hfu * 100.0
    );
    let b = &t.breakdown;
    for (i, (label, s)) in [
        ("compute", b.compute_s),
        ("recompute", b.recompute_s),
        ("exposed communication", b.exposed_comm_s),
        ("pipeline bubble", b.bubble_s),
        ("optimizer step", b.optimizer_s),
    ]
    .into_iter()
    .enumerate()
    {
        let pct = if t.step_s > 0.0 {
            s / t.step_s * 100.0
        } else {
            0.0
        };
        let _ = write!(
            o,
            "<tr><td>{}</td><td style=\"text-align:right\">{}</td><td style=\"width:400px\"><div style=\"background:{};width:{:.1}%;height:12px\"></div></td><td>{:.1}%</td></tr>",
            label,
            esc(&secs(s)),
            super::svg::PALETTE[i],
            pct,
            pct
        );
    }
    o.push_str("</table><table><tr><th>dim</th><th>group</th><th>bytes/step</th><th>time</th><th>exposed</th><th>what</th></tr>");
    for (d, c) in &t.comm {
        let _ = write!(
            o,
            "<tr><td>{}</td><td>{}</td><td>{:.3} GB</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            d.name(),
            c.group,
            c.bytes / 1e9,
            esc(&secs(c.s)),
            esc(&secs(c.exposed_s)),
            esc(&c.what)
        );
    }
    o.push_str("</table></section>");
    o
}
