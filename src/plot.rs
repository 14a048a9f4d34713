//! Charts of a run that can be looked at without a browser (`graphtrain plot`): the metrics log
//! as panels against step (loss and validation loss, tokens/s, memory, a scheduled lr), a step's
//! timeline as lanes (a Gantt chart of what ran when), and searches' best-so-far speed against
//! the pairs they timed.
//!
//! The file's extension picks the format: `.svg` (text as SVG `<text>`, rendered by the viewer)
//! or `.png` (text rasterized with the Hack font bundled in `epaint_default_fonts`, so no system
//! font is needed). Anything else is refused, as is a log with no step to draw.

use crate::metrics::MetricsLog;
use crate::timeline::TraceFile;
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

const FONT: &str = "sans-serif";

/// The output format an `--out` path asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Svg,
    Png,
}

fn format_of(out: &Path) -> Result<Format, String> {
    match out.extension().and_then(|e| e.to_str()) {
        Some(e) if e.eq_ignore_ascii_case("svg") => Ok(Format::Svg),
        Some(e) if e.eq_ignore_ascii_case("png") => Ok(Format::Png),
        _ => Err(format!(
            "`{}`: the chart is written as .svg or .png; name the file with one of those",
            out.display()
        )),
    }
}

/// Text layout (both formats) and PNG glyphs come from the bundled font: registered once, before
/// anything is drawn.
fn register_font() -> Result<(), String> {
    static LOADED: OnceLock<bool> = OnceLock::new();
    let loaded = *LOADED.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, epaint_default_fonts::HACK_REGULAR)
            .is_ok()
    });
    if loaded {
        Ok(())
    } else {
        Err("the bundled chart font could not be loaded".into())
    }
}

/// Draws `draw` on an SVG or PNG of `size` at `out`.
fn render(
    out: &Path,
    size: (u32, u32),
    draw: impl Fn(&DrawingArea<SVGBackend, Shift>) -> Result<(), String>,
    draw_png: impl Fn(&DrawingArea<BitMapBackend, Shift>) -> Result<(), String>,
) -> Result<(), String> {
    register_font()?;
    let at = |e: String| format!("cannot draw `{}`: {e}", out.display());
    match format_of(out)? {
        Format::Svg => {
            let root = SVGBackend::new(out, size).into_drawing_area();
            root.fill(&WHITE).map_err(|e| at(e.to_string()))?;
            draw(&root).map_err(at)?;
            root.present().map_err(|e| at(e.to_string()))
        }
        Format::Png => {
            let root = BitMapBackend::new(out, size).into_drawing_area();
            root.fill(&WHITE).map_err(|e| at(e.to_string()))?;
            draw_png(&root).map_err(at)?;
            root.present().map_err(|e| at(e.to_string()))
        }
    }
}

/// Loss (with validation loss where logged), tokens/s, memory and, where it varies, the learning
/// rate against step, one panel each.
pub fn plot_metrics(log: &MetricsLog, source: &Path, out: &Path) -> Result<(), String> {
    if log.steps.is_empty() {
        return Err(format!(
            "{}: no `step` record to draw (the run wrote its header only)",
            source.display()
        ));
    }
    format_of(out)?;
    render(
        out,
        (1000, 1000),
        |root| metrics_panels(root, log),
        |root| metrics_panels(root, log),
    )
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// `lo..hi` widened so a flat or single-point series still gets a visible axis.
fn padded(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let span = hi - lo;
    let pad = if span > 0.0 {
        span * 0.05
    } else {
        lo.abs().max(1.0) * 0.05
    };
    (lo - pad)..(hi + pad)
}

fn bounds(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    })
}

fn metrics_panels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    log: &MetricsLog,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    // A scheduled lr (`run --lr-warmup`, `--lr-decay`) gets a panel of its own.
    let lr_varies = log.steps.iter().any(|s| s.lr != log.steps[0].lr);
    let panels = root.split_evenly((if lr_varies { 4 } else { 3 }, 1));
    let steps: Vec<f64> = log.steps.iter().map(|s| s.step as f64).collect();
    let first = steps[0].min(log.vals.first().map_or(f64::MAX, |v| v.step as f64));
    let last = steps[steps.len() - 1].max(log.vals.last().map_or(f64::MIN, |v| v.step as f64));
    let x = padded(first, last);

    let loss: Vec<(f64, f64)> = log.steps.iter().map(|s| (s.step as f64, s.loss)).collect();
    let val: Vec<(f64, f64)> = log
        .vals
        .iter()
        .map(|v| (v.step as f64, v.val_loss))
        .collect();
    let (lo, hi) = bounds(loss.iter().chain(&val).map(|p| p.1));
    let mut chart = ChartBuilder::on(&panels[0])
        .caption("loss", (FONT, 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(x.clone(), padded(lo, hi))
        .map_err(err)?;
    chart.configure_mesh().x_desc("step").draw().map_err(err)?;
    chart
        .draw_series(LineSeries::new(loss, &BLUE))
        .map_err(err)?
        .label("train loss")
        .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], BLUE));
    if !val.is_empty() {
        chart
            .draw_series(LineSeries::new(val.clone(), &RED))
            .map_err(err)?
            .label("validation loss")
            .legend(|(x, y)| PathElement::new([(x, y), (x + 20, y)], RED));
        chart
            .draw_series(val.iter().map(|&p| Circle::new(p, 3, RED.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;

    series_panel(
        &panels[1],
        "tokens/s",
        x.clone(),
        log.steps
            .iter()
            .map(|s| (s.step as f64, s.tokens_per_s))
            .collect(),
        GREEN.mix(0.9),
    )?;
    series_panel(
        &panels[2],
        "memory (MiB, executor peak of live tensors)",
        x.clone(),
        log.steps
            .iter()
            .map(|s| (s.step as f64, s.memory_bytes as f64 / (1024.0 * 1024.0)))
            .collect(),
        MAGENTA.mix(0.9),
    )?;
    if lr_varies {
        series_panel(
            &panels[3],
            "learning rate",
            x,
            log.steps.iter().map(|s| (s.step as f64, s.lr)).collect(),
            CYAN.mix(0.9),
        )?;
    }
    Ok(())
}

fn series_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    caption: &str,
    x: std::ops::Range<f64>,
    points: Vec<(f64, f64)>,
    color: RGBAColor,
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let (lo, hi) = bounds(points.iter().map(|p| p.1));
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 20))
        .margin(10)
        .x_label_area_size(30)
        .y_label_area_size(60)
        .build_cartesian_2d(x, padded(lo, hi))
        .map_err(err)?;
    chart.configure_mesh().x_desc("step").draw().map_err(err)?;
    chart
        .draw_series(LineSeries::new(points.iter().copied(), color))
        .map_err(err)?;
    chart
        .draw_series(
            points
                .into_iter()
                .map(|p| Circle::new(p, 2, color.filled())),
        )
        .map_err(err)?;
    Ok(())
}

/// The lanes of a timeline: one row per lane, one bar per event from its start to its end,
/// coloured by the event's category (phase), each labelled with as much of its name as fits.
pub fn plot_trace(trace: &TraceFile, source: &Path, out: &Path) -> Result<(), String> {
    if trace.events.is_empty() {
        return Err(format!(
            "{}: no complete (`X`) event to draw",
            source.display()
        ));
    }
    format_of(out)?;
    let lanes = trace.lanes();
    let height = 120 + 40 * lanes.len() as u32;
    render(
        out,
        (1400, height.min(4000)),
        |root| lane_chart(root, trace, &lanes),
        |root| lane_chart(root, trace, &lanes),
    )
}

/// Width of one character of the 11-pixel monospace label font, in pixels.
const LABEL_CHAR_PX: f64 = 7.0;
/// Fewer characters than this say nothing: such bars stay unlabelled.
const MIN_LABEL_CHARS: usize = 5;

fn lane_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    trace: &TraceFile,
    lanes: &[u64],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let start = trace
        .events
        .iter()
        .map(|e| e.ts)
        .fold(f64::INFINITY, f64::min);
    let end = trace
        .events
        .iter()
        .map(|e| e.ts + e.dur)
        .fold(f64::NEG_INFINITY, f64::max);
    let span = (end - start).max(1e-3);
    let mut chart = ChartBuilder::on(root)
        .caption(
            format!(
                "timeline: {} events over {:.3} ms",
                trace.events.len(),
                span / 1e3
            ),
            (FONT, 20),
        )
        .margin(15)
        .x_label_area_size(35)
        .y_label_area_size(105)
        .build_cartesian_2d(0.0..span / 1e3, 0.0..lanes.len() as f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("ms since the step began")
        .disable_y_mesh()
        .y_labels(0)
        .draw()
        .map_err(err)?;
    // Lane names go beside their rows, in the label area, where the axis would put numbers.
    for (i, lane) in lanes.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(0.0, i as f64 + 0.5));
        let name = trace.lane_names.get(lane).cloned().unwrap_or_default();
        for (dy, line) in [(-8, format!("lane {lane}")), (6, name)] {
            root.draw(&Text::new(
                line,
                (px - 100, py + dy),
                (FONT, 12).into_font().color(&BLACK),
            ))
            .map_err(err)?;
        }
    }
    let row = |tid: u64| lanes.iter().position(|&l| l == tid).unwrap_or(0) as f64;
    let mut categories: Vec<&str> = trace.events.iter().map(|e| e.cat.as_str()).collect();
    categories.sort_unstable();
    categories.dedup();
    let color = |cat: &str| {
        let i = categories.iter().position(|c| *c == cat).unwrap_or(0);
        Palette99::pick(i).to_rgba()
    };
    chart
        .draw_series(trace.events.iter().map(|e| {
            let x0 = (e.ts - start) / 1e3;
            // A bar at least a pixel-ish wide, so microsecond steps stay visible.
            let x1 = x0 + (e.dur / 1e3).max(span / 1e3 / 1400.0);
            let y = row(e.tid);
            Rectangle::new([(x0, y + 0.1), (x1, y + 0.9)], color(&e.cat).filled())
        }))
        .map_err(err)?;
    // A name is written on its bar only as far as it fits there, so names never overlap.
    let plot_px = chart.plotting_area().dim_in_pixel().0 as f64;
    chart
        .draw_series(trace.events.iter().filter_map(|e| {
            let fits = (e.dur / span * plot_px / LABEL_CHAR_PX) as usize;
            if fits < MIN_LABEL_CHARS {
                return None;
            }
            let name: String = e.name.chars().take(fits - 1).collect();
            Some(Text::new(
                name,
                ((e.ts - start) / 1e3, row(e.tid) + 0.45),
                (FONT, 11).into_font().color(&BLACK),
            ))
        }))
        .map_err(err)?;
    Ok(())
}

/// Each search log's best-so-far speed (the kept ratios multiplied up, relative to its start)
/// against the pairs of steps it had timed, one line per log, labelled by proposer and folder.
pub fn plot_search(dirs: &[std::path::PathBuf], out: &Path) -> Result<(), String> {
    format_of(out)?;
    let mut series = Vec::new();
    for dir in dirs {
        let lines = graphtrain_autoresearch::journal::read(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?;
        let Some(first) = lines.first() else {
            return Err(format!("{}: no experiment logged yet", dir.display()));
        };
        let name = dir
            .file_name()
            .map_or(String::new(), |n| n.to_string_lossy().into_owned());
        let label = format!("{} ({name})", first.proposer);
        let (mut pairs, mut speed) = (0usize, 1.0f64);
        let mut points = vec![(0.0, 1.0)];
        for l in &lines {
            pairs += l.pairs;
            if l.status == "keep" && l.ratio.is_finite() {
                speed *= l.ratio;
            }
            points.push((pairs as f64, speed));
        }
        series.push((label, points));
    }
    let draw = |root: &DrawingArea<SVGBackend, Shift>| search_chart(root, &series);
    let draw_png = |root: &DrawingArea<BitMapBackend, Shift>| search_chart(root, &series);
    render(out, (900, 500), draw, draw_png)
}

fn search_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    series: &[(String, Vec<(f64, f64)>)],
) -> Result<(), String>
where
    DB::ErrorType: 'static,
{
    let all = || series.iter().flat_map(|s| s.1.iter());
    let (_, x_hi) = bounds(all().map(|p| p.0));
    let (lo, hi) = bounds(all().map(|p| p.1));
    let mut chart = ChartBuilder::on(root)
        .caption("best-so-far speed (relative to the start)", (FONT, 20))
        .margin(10)
        .x_label_area_size(35)
        .y_label_area_size(60)
        .build_cartesian_2d(padded(0.0, x_hi), padded(lo, hi))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("pairs of steps timed")
        .draw()
        .map_err(err)?;
    let colors = [BLUE, RED, GREEN, MAGENTA, CYAN, BLACK];
    for (i, (label, points)) in series.iter().enumerate() {
        let color = colors[i % colors.len()];
        // A step line: the best so far holds until the next keep.
        let mut steps = Vec::new();
        for w in points.windows(2) {
            steps.push(w[0]);
            steps.push((w[1].0, w[0].1));
        }
        steps.extend(points.last());
        chart
            .draw_series(LineSeries::new(steps, &color))
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    Ok(())
}
