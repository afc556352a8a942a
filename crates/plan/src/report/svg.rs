//! Minimal hand-written SVG charts (no dependencies): stacked bars, bars, lines.

use std::fmt::Write;

pub const PALETTE: [&str; 8] = [
    "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#9c755f",
];

pub fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn gib(b: f64) -> f64 {
    b / crate::GIB
}

/// A round axis maximum and step for values up to `max`.
fn axis(max: f64) -> (f64, f64) {
    let max = if max <= 0.0 { 1.0 } else { max };
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    ((max / step).ceil() * step, step)
}

struct Frame {
    w: f64,
    h: f64,
    left: f64,
    bottom: f64,
    top: f64,
    right: f64,
}

impl Frame {
    fn plot_h(&self) -> f64 {
        self.h - self.top - self.bottom
    }
    fn plot_w(&self) -> f64 {
        self.w - self.left - self.right
    }
    fn y(&self, v: f64, vmax: f64) -> f64 {
        self.top + self.plot_h() * (1.0 - v / vmax)
    }
    fn open(&self, o: &mut String, title: &str, ylabel: &str, vmax: f64, step: f64) {
        let _ = write!(
            o,
            r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#,
            w = self.w,
            h = self.h
        );
        let _ = write!(
            o,
            r#"<text x="{}" y="16" font-size="14" font-weight="bold">{}</text>"#,
            self.left,
            esc(title)
        );
        let _ = write!(
            o,
            r#"<text x="12" y="{}" transform="rotate(-90 12 {})" text-anchor="middle">{}</text>"#,
            self.top + self.plot_h() / 2.0,
            self.top + self.plot_h() / 2.0,
            esc(ylabel)
        );
        let mut v = 0.0;
        while v <= vmax + step * 1e-9 {
            let y = self.y(v, vmax);
            let _ = write!(
                o,
                r##"<line x1="{}" x2="{}" y1="{y}" y2="{y}" stroke="#ddd"/><text x="{}" y="{}" text-anchor="end">{}</text>"##,
                self.left,
                self.w - self.right,
                self.left - 4.0,
                y + 4.0,
                trim(v)
            );
            v += step;
        }
    }
}

fn trim(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// One stacked bar per group; `series` are (label, bytes per group).
pub fn stacked_bars(title: &str, groups: &[String], series: &[(&str, Vec<u64>)]) -> String {
    let f = Frame {
        w: 760.0,
        h: 360.0,
        left: 60.0,
        bottom: 60.0,
        top: 30.0,
        right: 190.0,
    };
    let totals: Vec<f64> = (0..groups.len())
        .map(|g| series.iter().map(|(_, v)| gib(v[g] as f64)).sum())
        .collect();
    let (vmax, step) = axis(totals.iter().cloned().fold(0.0, f64::max));
    let mut o = String::new();
    f.open(&mut o, title, "GiB", vmax, step);
    let slot = f.plot_w() / groups.len().max(1) as f64;
    let bw = (slot * 0.6).min(80.0);
    for (g, name) in groups.iter().enumerate() {
        let x = f.left + slot * g as f64 + (slot - bw) / 2.0;
        let mut acc = 0.0;
        for (k, (label, v)) in series.iter().enumerate() {
            let val = gib(v[g] as f64);
            if val <= 0.0 {
                continue;
            }
            let (y0, y1) = (f.y(acc, vmax), f.y(acc + val, vmax));
            let _ = write!(
                o,
                r#"<rect x="{x}" y="{y1}" width="{bw}" height="{}" fill="{}"><title>{}: {val:.2} GiB</title></rect>"#,
                (y0 - y1).max(0.0),
                PALETTE[k % PALETTE.len()],
                esc(label)
            );
            acc += val;
        }
        let _ = write!(
            o,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text><text x="{}" y="{}" text-anchor="middle">{:.2}</text>"#,
            x + bw / 2.0,
            f.h - f.bottom + 16.0,
            esc(name),
            x + bw / 2.0,
            f.y(acc, vmax) - 4.0,
            acc
        );
    }
    legend(&mut o, &f, series.iter().map(|(l, _)| *l));
    o.push_str("</svg>");
    o
}

fn legend<'a>(o: &mut String, f: &Frame, labels: impl Iterator<Item = &'a str>) {
    for (k, label) in labels.enumerate() {
        let y = f.top + 18.0 * k as f64;
        let x = f.w - f.right + 14.0;
        let _ = write!(
            o,
            r#"<rect x="{x}" y="{y}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
            PALETTE[k % PALETTE.len()],
            x + 18.0,
            y + 10.0,
            esc(label)
        );
    }
}

/// Vertical bars with a label under each, and an optional horizontal capacity line.
pub fn bars(title: &str, points: &[(String, u64)], line: Option<(&str, u64)>) -> String {
    let f = Frame {
        w: 760.0,
        h: 380.0,
        left: 60.0,
        bottom: 120.0,
        top: 30.0,
        right: 20.0,
    };
    let top = points
        .iter()
        .map(|p| p.1)
        .max()
        .unwrap_or(0)
        .max(line.map_or(0, |l| l.1));
    let (vmax, step) = axis(gib(top as f64));
    let mut o = String::new();
    f.open(&mut o, title, "GiB", vmax, step);
    let slot = f.plot_w() / points.len().max(1) as f64;
    let bw = slot * 0.7;
    for (i, (label, b)) in points.iter().enumerate() {
        let x = f.left + slot * i as f64 + (slot - bw) / 2.0;
        let v = gib(*b as f64);
        let y = f.y(v, vmax);
        let cx = x + bw / 2.0;
        let ly = f.h - f.bottom + 10.0;
        let _ = write!(
            o,
            r#"<rect x="{x}" y="{y}" width="{bw}" height="{}" fill="{}"><title>{}: {v:.2} GiB</title></rect><text x="{cx}" y="{}" text-anchor="middle" font-size="10">{v:.1}</text><text x="{cx}" y="{ly}" transform="rotate(40 {cx} {ly})" font-size="10">{}</text>"#,
            f.y(0.0, vmax) - y,
            PALETTE[0],
            esc(label),
            y - 3.0,
            esc(label)
        );
    }
    if let Some((label, b)) = line {
        let y = f.y(gib(b as f64), vmax);
        let _ = write!(
            o,
            r##"<line x1="{}" x2="{}" y1="{y}" y2="{y}" stroke="#e15759" stroke-dasharray="6 4"/><text x="{}" y="{}" fill="#e15759" text-anchor="end">{}</text>"##,
            f.left,
            f.w - f.right,
            f.w - f.right,
            y - 4.0,
            esc(label)
        );
    }
    o.push_str("</svg>");
    o
}

/// Lines over a shared x axis (x labels as given); `series` are (label, bytes per x).
pub fn lines(title: &str, xs: &[String], series: &[(&str, Vec<u64>)]) -> String {
    let f = Frame {
        w: 760.0,
        h: 360.0,
        left: 60.0,
        bottom: 50.0,
        top: 30.0,
        right: 150.0,
    };
    let top = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .max()
        .unwrap_or(0);
    let (vmax, step) = axis(gib(top as f64));
    let mut o = String::new();
    f.open(&mut o, title, "GiB", vmax, step);
    let n = xs.len().max(2) as f64 - 1.0;
    let x_at = |i: usize| f.left + f.plot_w() * i as f64 / n;
    for (i, x) in xs.iter().enumerate() {
        let _ = write!(
            o,
            r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
            x_at(i),
            f.h - f.bottom + 16.0,
            esc(x)
        );
    }
    for (k, (label, v)) in series.iter().enumerate() {
        let pts: Vec<String> = v
            .iter()
            .enumerate()
            .map(|(i, b)| format!("{:.1},{:.1}", x_at(i), f.y(gib(*b as f64), vmax)))
            .collect();
        let _ = write!(
            o,
            r#"<polyline fill="none" stroke="{}" stroke-width="2" points="{}"><title>{}</title></polyline>"#,
            PALETTE[k % PALETTE.len()],
            pts.join(" "),
            esc(label)
        );
    }
    legend(&mut o, &f, series.iter().map(|(l, _)| *l));
    o.push_str("</svg>");
    o
}
