//! Line charts written as SVG, and the same rendered to PNG with resvg:
//! enough for latency CDFs, latency over time and sweeps, with no plotting
//! dependency and no system tools.

use std::fmt::Write;
use std::path::Path;

use anyhow::Context;

/// One named line of (x, y) points.
#[derive(Debug, Clone)]
pub(crate) struct Series {
    pub(crate) name: String,
    pub(crate) points: Vec<(f64, f64)>,
    /// Draw points only (for scatter-like time series).
    pub(crate) dots: bool,
}

#[derive(Debug, Clone)]
pub(crate) struct Chart {
    pub(crate) title: String,
    pub(crate) x_label: String,
    pub(crate) y_label: String,
    pub(crate) log_x: bool,
    pub(crate) log_y: bool,
    pub(crate) series: Vec<Series>,
}

const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b"];
const W: f64 = 900.0;
const H: f64 = 520.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;

fn scale(v: f64, log: bool) -> f64 {
    if log { v.max(1e-9).log10() } else { v }
}

/// "Nice" tick values covering [lo, hi] (in scaled space for log axes).
fn ticks(lo: f64, hi: f64, log: bool) -> Vec<f64> {
    if log {
        let (a, b) = (lo.floor() as i32, hi.ceil() as i32);
        // Over a few decades, 2× and 5× marks too.
        let steps: &[f64] = if b - a <= 2 { &[1.0, 2.0, 5.0] } else { &[1.0] };
        return (a..=b)
            .flat_map(|e| steps.iter().map(move |m| f64::from(e) + m.log10()))
            .filter(|v| *v <= hi + 1e-9)
            .collect();
    }
    let span = (hi - lo).max(1e-12);
    let raw = span / 6.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| span / s <= 8.0)
        .unwrap_or(10.0 * mag);
    let first = (lo / step).ceil() * step;
    (0..)
        .map(|i| first + f64::from(i) * step)
        .take_while(|v| *v <= hi + step * 1e-9)
        .collect()
}

/// A tick label: three significant digits at most, with k and M for
/// thousands and millions (1k, 20k, 1.5M), no trailing zeros.
fn label(v: f64, log: bool) -> String {
    let v = if log { 10f64.powf(v) } else { v };
    if v == 0.0 {
        return "0".into();
    }
    let digits = 10f64.powf(v.abs().log10().floor() - 2.0);
    let v = (v / digits).round() * digits;
    let (scaled, unit) = match v.abs() {
        a if a >= 1e6 => (v / 1e6, "M"),
        a if a >= 1e3 => (v / 1e3, "k"),
        _ => (v, ""),
    };
    let text = format!("{scaled:.3}");
    let text = text.trim_end_matches('0').trim_end_matches('.');
    format!("{text}{unit}")
}

impl Chart {
    pub(crate) fn svg(&self) -> String {
        let pts = self.series.iter().flat_map(|s| s.points.iter());
        let (mut x0, mut x1, mut y0, mut y1) = (f64::INFINITY, f64::NEG_INFINITY, f64::INFINITY, f64::NEG_INFINITY);
        for &(x, y) in pts {
            let (x, y) = (scale(x, self.log_x), scale(y, self.log_y));
            (x0, x1, y0, y1) = (x0.min(x), x1.max(x), y0.min(y), y1.max(y));
        }
        if !x0.is_finite() {
            (x0, x1, y0, y1) = (0.0, 1.0, 0.0, 1.0);
        }
        if self.log_x {
            (x0, x1) = (x0.floor(), x1.ceil());
        }
        if self.log_y {
            (y0, y1) = (y0.floor(), y1.ceil());
        } else {
            y0 = y0.min(0.0);
        }
        if x1 - x0 < 1e-12 {
            x1 = x0 + 1.0;
        }
        if y1 - y0 < 1e-12 {
            y1 = y0 + 1.0;
        }
        let (pw, ph) = (W - LEFT - RIGHT, H - TOP - BOTTOM);
        let px = |x: f64| LEFT + (scale(x, self.log_x) - x0) / (x1 - x0) * pw;
        let py = |y: f64| TOP + ph - (scale(y, self.log_y) - y0) / (y1 - y0) * ph;
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="DejaVu Sans, sans-serif" font-size="13">"#
        );
        let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="28" font-size="16" text-anchor="middle">{}</text>"#,
            W / 2.0,
            escape(&self.title)
        );
        for t in ticks(x0, x1, self.log_x) {
            let x = LEFT + (t - x0) / (x1 - x0) * pw;
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#e5e5e5"/>"##,
                TOP + ph
            );
            let _ = writeln!(
                s,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                TOP + ph + 18.0,
                label(t, self.log_x)
            );
        }
        for t in ticks(y0, y1, self.log_y) {
            let y = TOP + ph - (t - y0) / (y1 - y0) * ph;
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/>"##,
                LEFT + pw
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"#,
                LEFT - 6.0,
                y + 4.0,
                label(t, self.log_y)
            );
        }
        let _ = writeln!(
            s,
            r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 14.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate(20,{:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + ph / 2.0,
            escape(&self.y_label)
        );
        for (i, series) in self.series.iter().enumerate() {
            let color = COLORS[i % COLORS.len()];
            if series.dots {
                for &(x, y) in &series.points {
                    let _ = writeln!(
                        s,
                        r#"<circle cx="{:.1}" cy="{:.1}" r="1.6" fill="{color}"/>"#,
                        px(x),
                        py(y)
                    );
                }
            } else if !series.points.is_empty() {
                let path: Vec<String> = series
                    .points
                    .iter()
                    .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
                    .collect();
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{color}" stroke-width="2"/>"#,
                    path.join(" ")
                );
            }
            let ly = TOP + 14.0 + 20.0 * i as f64;
            let _ = writeln!(
                s,
                r#"<rect x="{:.1}" y="{:.1}" width="14" height="4" fill="{color}"/>"#,
                LEFT + pw + 12.0,
                ly - 6.0
            );
            let _ = writeln!(
                s,
                r#"<text x="{:.1}" y="{ly:.1}">{}</text>"#,
                LEFT + pw + 32.0,
                escape(&series.name)
            );
        }
        s.push_str("</svg>\n");
        s
    }

    /// Writes `<stem>.svg` and `<stem>.png`.
    pub(crate) fn write(&self, dir: &Path, stem: &str) -> anyhow::Result<()> {
        let svg = self.svg();
        std::fs::write(dir.join(format!("{stem}.svg")), &svg)?;
        render_png(&svg, &dir.join(format!("{stem}.png")))
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

fn render_png(svg: &str, path: &Path) -> anyhow::Result<()> {
    use resvg::{tiny_skia, usvg};
    let mut options = usvg::Options::default();
    options.fontdb_mut().load_system_fonts();
    let tree = usvg::Tree::from_str(svg, &options).context("parsing the SVG")?;
    let size = tree.size().to_int_size();
    let mut pixmap = tiny_skia::Pixmap::new(size.width(), size.height()).context("allocating the PNG")?;
    resvg::render(&tree, tiny_skia::Transform::default(), &mut pixmap.as_mut());
    pixmap
        .save_png(path)
        .with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn charts_render_to_svg_and_png() {
        let chart = Chart {
            title: "latency <CDF>".into(),
            x_label: "µs".into(),
            y_label: "fraction".into(),
            log_x: true,
            log_y: false,
            series: vec![
                Series {
                    name: "hot".into(),
                    points: vec![(10.0, 0.1), (100.0, 0.9), (1000.0, 1.0)],
                    dots: false,
                },
                Series {
                    name: "nvme".into(),
                    points: vec![(500.0, 0.5)],
                    dots: true,
                },
            ],
        };
        let svg = chart.svg();
        assert!(svg.contains("&lt;CDF&gt;") && svg.contains("polyline") && svg.contains("circle"));
        let dir = tempfile::tempdir().unwrap();
        chart.write(dir.path(), "c").unwrap();
        let png = std::fs::read(dir.path().join("c.png")).unwrap();
        assert_eq!(&png[1..4], b"PNG");
        assert_eq!(ticks(0.0, 10.0, false), [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
    }

    #[test]
    fn tick_labels_are_short_and_exact() {
        let log_labels: Vec<String> = ticks(3.0, 4.5, true).iter().map(|&v| label(v, true)).collect();
        assert_eq!(log_labels, ["1k", "2k", "5k", "10k", "20k"]);
        assert_eq!(label(0.25, false), "0.25");
        assert_eq!(label(1_500_000.0, false), "1.5M");
        assert_eq!(label(0.0, false), "0");
        assert_eq!(label(-40.0, false), "-40");
    }
}
