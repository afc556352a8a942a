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

/// Font stack of the charts below: pages that embed DejaVu Sans (the training report) render
/// the same everywhere; elsewhere the system sans-serif is used.
pub const FONT_FAMILY: &str = "'DejaVu Sans', sans-serif";

/// Round axis bounds and step covering [lo, hi] with about five intervals.
pub fn nice_range(lo: f64, hi: f64) -> (f64, f64, f64) {
    let (lo, hi) = if lo.is_finite() && hi.is_finite() {
        (lo.min(hi), lo.max(hi))
    } else {
        (0.0, 1.0)
    };
    let span = if hi - lo > 0.0 {
        hi - lo
    } else {
        hi.abs().max(1.0)
    };
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let a = (lo / step).floor() * step;
    let mut b = (hi / step).ceil() * step;
    if b <= a {
        b = a + step;
    }
    (a, b, step)
}

/// A tick label: up to 3 significant decimals, thousands as k.
pub fn tick(v: f64) -> String {
    if v.abs() >= 10_000.0 {
        return format!("{}k", trim(v / 1000.0));
    }
    let s = format!("{v:.3}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".into()
    } else {
        s.to_string()
    }
}

/// One line of an [`xy_chart`].
#[derive(Debug, Clone, Default)]
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
    /// Plot against the right-hand axis.
    pub right: bool,
    /// Draw a marker at every point (sparse series: validation loss, measured samples).
    pub markers: bool,
    /// Omit the connecting line (markers only).
    pub no_line: bool,
    pub dashed: bool,
}

/// Axes of an [`xy_chart`]; `y2_label` set means a right-hand axis for `Series::right`.
#[derive(Debug, Clone, Default)]
pub struct XyAxes {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub y2_label: Option<String>,
    /// Categorical x labels at given x positions, instead of numeric ticks.
    pub x_ticks: Option<Vec<(f64, String)>>,
    /// Start the y axes at zero (memory) rather than at the data's minimum (loss).
    pub y_from_zero: bool,
}

/// Lines (and markers) over a numeric x axis, with an optional second y axis on the right.
pub fn xy_chart(ax: &XyAxes, series: &[Series]) -> String {
    let bottom = if ax.x_ticks.is_some() { 85.0 } else { 50.0 };
    let f = Frame {
        w: 900.0,
        h: 300.0 + bottom,
        left: 70.0,
        bottom,
        top: 40.0,
        // Room for the second axis, or for the last rotated category label.
        right: if ax.y2_label.is_some() || ax.x_ticks.is_some() {
            70.0
        } else {
            20.0
        },
    };
    let all = |right: bool| {
        series
            .iter()
            .filter(move |s| s.right == right)
            .flat_map(|s| s.points.iter().copied())
    };
    let bounds = |it: &mut dyn Iterator<Item = (f64, f64)>, zero: bool| {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for (_, y) in it.filter(|p| p.1.is_finite()) {
            lo = lo.min(y);
            hi = hi.max(y);
        }
        if zero {
            lo = lo.min(0.0);
        }
        nice_range(lo, hi)
    };
    let (y_lo, y_hi, y_step) = bounds(&mut all(false), ax.y_from_zero);
    let (y2_lo, y2_hi, y2_step) = bounds(&mut all(true), ax.y_from_zero);
    let (mut x_lo, mut x_hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for s in series {
        for &(x, _) in &s.points {
            x_lo = x_lo.min(x);
            x_hi = x_hi.max(x);
        }
    }
    let (x_lo, x_hi, x_step) = match &ax.x_ticks {
        Some(_) => (x_lo.min(x_hi), x_hi.max(x_lo + 1.0), 1.0),
        None => nice_range(x_lo.min(0.0), x_hi),
    };
    let px = |x: f64| f.left + f.plot_w() * (x - x_lo) / (x_hi - x_lo);
    let py = |y: f64, right: bool| {
        let (lo, hi) = if right { (y2_lo, y2_hi) } else { (y_lo, y_hi) };
        f.top + f.plot_h() * (1.0 - (y - lo) / (hi - lo))
    };
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" font-family="{FONT_FAMILY}" font-size="12">"#,
        w = f.w,
        h = f.h
    );
    let _ = write!(
        o,
        r#"<text x="{}" y="18" font-size="15" font-weight="bold">{}</text>"#,
        f.left,
        esc(&ax.title)
    );
    let mid = f.top + f.plot_h() / 2.0;
    let _ = write!(
        o,
        r#"<text x="14" y="{mid}" transform="rotate(-90 14 {mid})" text-anchor="middle">{}</text>"#,
        esc(&ax.y_label)
    );
    let mut v = y_lo;
    while v <= y_hi + y_step * 1e-9 {
        let y = py(v, false);
        let _ = write!(
            o,
            r##"<line x1="{}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="#e4e4e4"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
            f.left,
            f.w - f.right,
            f.left - 5.0,
            y + 4.0,
            tick(v)
        );
        v += y_step;
    }
    if let Some(l2) = &ax.y2_label {
        let x2 = f.w - 14.0;
        let _ = write!(
            o,
            r#"<text x="{x2}" y="{mid}" transform="rotate(90 {x2} {mid})" text-anchor="middle">{}</text>"#,
            esc(l2)
        );
        let mut v = y2_lo;
        while v <= y2_hi + y2_step * 1e-9 {
            let _ = write!(
                o,
                r#"<text x="{}" y="{:.1}">{}</text>"#,
                f.w - f.right + 5.0,
                py(v, true) + 4.0,
                tick(v)
            );
            v += y2_step;
        }
    }
    let base = f.top + f.plot_h();
    let _ = write!(
        o,
        r##"<rect x="{}" y="{}" width="{}" height="{}" fill="none" stroke="#999"/>"##,
        f.left,
        f.top,
        f.plot_w(),
        f.plot_h()
    );
    match &ax.x_ticks {
        Some(ticks) => {
            for (x, label) in ticks {
                let (cx, ly) = (px(*x), base + 8.0);
                let _ = write!(
                    o,
                    r##"<line x1="{cx:.1}" x2="{cx:.1}" y1="{}" y2="{base}" stroke="#f0f0f0"/><text x="{cx:.1}" y="{ly}" transform="rotate(55 {cx:.1} {ly})" font-size="10">{}</text>"##,
                    f.top,
                    esc(label)
                );
            }
        }
        None => {
            let mut v = x_lo;
            while v <= x_hi + x_step * 1e-9 {
                let _ = write!(
                    o,
                    r#"<text x="{:.1}" y="{}" text-anchor="middle">{}</text>"#,
                    px(v),
                    base + 16.0,
                    tick(v)
                );
                v += x_step;
            }
            let _ = write!(
                o,
                r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
                f.left + f.plot_w() / 2.0,
                f.h - 8.0,
                esc(&ax.x_label)
            );
        }
    }
    for (k, s) in series.iter().enumerate() {
        let color = PALETTE[k % PALETTE.len()];
        let pts: Vec<(f64, f64)> = s
            .points
            .iter()
            .filter(|p| p.0.is_finite() && p.1.is_finite())
            .map(|&(x, y)| (px(x), py(y, s.right)))
            .collect();
        if !s.no_line && pts.len() > 1 {
            let list: Vec<String> = pts.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let dash = if s.dashed {
                r#" stroke-dasharray="6 4""#
            } else {
                ""
            };
            let _ = write!(
                o,
                r#"<polyline fill="none" stroke="{color}" stroke-width="2"{dash} points="{}"><title>{}</title></polyline>"#,
                list.join(" "),
                esc(&s.label)
            );
        }
        if s.markers || pts.len() == 1 {
            for (x, y) in &pts {
                let _ = write!(
                    o,
                    r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{color}"/>"#
                );
            }
        }
        let (lx, ly) = (f.left + 10.0 + 190.0 * k as f64, 32.0);
        let _ = write!(
            o,
            r#"<rect x="{lx}" y="{}" width="14" height="4" fill="{color}"/><text x="{}" y="{ly}">{}</text>"#,
            ly - 6.0,
            lx + 18.0,
            esc(&s.label)
        );
    }
    o.push_str("</svg>");
    o
}

/// Horizontal bars, one per (label, value), values printed at the bar ends in `unit`.
pub fn hbars(title: &str, unit: &str, items: &[(String, f64)]) -> String {
    let row = 26.0;
    let (left, right, top) = (220.0, 110.0, 40.0);
    let w = 900.0;
    let h = top + row * items.len().max(1) as f64 + 30.0;
    let max = items.iter().map(|i| i.1).fold(0.0, f64::max);
    let max = if max > 0.0 { max } else { 1.0 };
    let mut o = String::new();
    let _ = write!(
        o,
        r#"<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {w} {h}" width="{w}" height="{h}" font-family="{FONT_FAMILY}" font-size="12"><text x="20" y="20" font-size="15" font-weight="bold">{}</text>"#,
        esc(title)
    );
    for (i, (label, v)) in items.iter().enumerate() {
        let y = top + row * i as f64;
        let bw = (w - left - right) * v / max;
        let _ = write!(
            o,
            r#"<text x="{}" y="{}" text-anchor="end">{}</text><rect x="{left}" y="{y}" width="{bw:.1}" height="{}" fill="{}"><title>{}: {v:.2} {unit}</title></rect><text x="{:.1}" y="{}">{v:.2} {unit}</text>"#,
            left - 8.0,
            y + row * 0.6,
            esc(label),
            row - 8.0,
            PALETTE[i % PALETTE.len()],
            esc(label),
            left + bw + 6.0,
            y + row * 0.6,
            unit = esc(unit)
        );
    }
    o.push_str("</svg>");
    o
}
