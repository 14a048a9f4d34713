//! What `graphtrain run` shows of each step: the metric line, the metrics log
//! (`--metrics`), the timeline of one step (`--trace-out`), and a progress bar when stdout is a
//! terminal.
//!
//! Guarantees: the metric line keeps the torchtitan format that tools parse
//! (`step: N loss: X grad_norm: Y memory: ZMiB tps: T tflops: F mfu: M`, then on a mesh
//! `wait_ms: W0,W1,...`, each rank's time blocked in collective waits) whether or not a bar
//! is shown; with a bar it is printed above the bar (`ProgressBar::println`), both on stdout, so
//! lines never interleave with the bar's redraws. Without a terminal (pipes, CI, tests) no bar
//! is drawn and nothing but the lines reaches stdout. Refused before the first step: a traced
//! step outside the steps this run will do, and a timeline on a backend that cannot record one.

use crate::metrics::{MetricsWriter, StepRates};
use crate::peak::Peak;
use crate::timeline::write_rank_traces;
use crate::trainer::{StepMetrics, Trainer};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::path::PathBuf;

const MIB: f64 = 1024.0 * 1024.0;

/// The step `--trace-out` records and where it goes.
pub struct TraceTarget {
    pub path: PathBuf,
    pub step: u64,
}

pub struct StepReport {
    flops_per_token: f64,
    /// Whether each step's line shows its lr (a schedule that varies it).
    show_lr: bool,
    peak: Option<Peak>,
    metrics: Option<MetricsWriter>,
    trace: Option<TraceTarget>,
    bar: Option<ProgressBar>,
}

impl StepReport {
    /// For a run that has done `trainer.steps_done()` steps and goes on until `last_step`.
    pub fn new(
        trainer: &mut Trainer,
        last_step: u64,
        (flops_per_token, show_lr, peak): (f64, bool, Option<Peak>),
        metrics: Option<MetricsWriter>,
        trace: Option<TraceTarget>,
    ) -> Result<Self, String> {
        let first = trainer.steps_done() + 1;
        if let Some(t) = &trace {
            if t.step < first || t.step > last_step {
                return Err(format!(
                    "--trace-step {}: this run does steps {first}..={last_step}",
                    t.step
                ));
            }
            if !trainer.record_timeline(false) {
                return Err(
                    "--trace-out: this backend records no timeline (the interpreter runs graph nodes, not Program steps); use a compiled backend such as cpu"
                        .into(),
                );
            }
        }
        let bar = (crate::cli::draws_progress()
            && std::io::stdout().is_terminal()
            && last_step >= first)
            .then(|| {
                let bar =
                    ProgressBar::with_draw_target(Some(last_step), ProgressDrawTarget::stdout());
                bar.set_style(
                    ProgressStyle::with_template(
                        "{bar:40} {pos}/{len} steps  {elapsed} elapsed, eta {eta}",
                    )
                    .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                bar.set_position(first - 1);
                bar
            });
        Ok(StepReport {
            flops_per_token,
            show_lr,
            peak,
            metrics,
            trace,
            bar,
        })
    }

    /// Call before the trainer runs step `step`.
    pub fn before(&mut self, trainer: &mut Trainer, step: u64) {
        if self.trace.as_ref().is_some_and(|t| t.step == step) {
            trainer.record_timeline(true);
        }
    }

    /// Reports step `m`, which the trainer just finished.
    pub fn after(&mut self, trainer: &mut Trainer, m: &StepMetrics) -> Result<(), String> {
        let tps = m.tokens as f64 / m.seconds;
        let gflops = tps * self.flops_per_token / 1e9;
        let mfu_fraction = self.peak.as_ref().map(|peak| gflops / peak.gflops);
        let mfu = match mfu_fraction {
            Some(f) => format!("{:.1}%", 100.0 * f),
            None => "n/a".to_string(),
        };
        if let Some(w) = &mut self.metrics {
            w.step(
                m,
                &StepRates {
                    tflops: gflops / 1e3,
                    mfu: mfu_fraction,
                },
            )?;
        }
        let mut line = format!(
            "step: {:>2} loss: {:.4} grad_norm: {:.4} memory: {:.2}MiB tps: {:.0} tflops: {:.4} mfu: {mfu}",
            m.step,
            m.loss,
            m.grad_norm,
            m.peak_bytes as f64 / MIB,
            tps,
            gflops / 1e3,
        );
        if self.show_lr {
            line += &format!(" lr: {:.3e}", m.lr);
        }
        if !m.wait_seconds.is_empty() {
            let per_rank: Vec<String> = m
                .wait_seconds
                .iter()
                .map(|s| format!("{:.1}", s * 1e3))
                .collect();
            line += &format!(" wait_ms: {}", per_rank.join(","));
        }
        match &self.bar {
            Some(bar) => {
                bar.println(line);
                bar.set_position(m.step);
            }
            None => crate::cli::write_stdout(format_args!("{line}\n")),
        }
        if let Some(t) = self.trace.as_ref().filter(|t| t.step == m.step) {
            let timelines = trainer.take_timelines();
            trainer.record_timeline(false);
            if timelines.is_empty() {
                return Err(format!("--trace-out: step {} recorded no timeline", m.step));
            }
            let files = write_rank_traces(&t.path, &timelines, m.step, trainer.timeline_ranks())?;
            let files: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
            self.say(&format!(
                "wrote the timeline of step {} ({} Program steps{}) to {}",
                m.step,
                timelines[0].events.len(),
                if files.len() > 1 { " per rank" } else { "" },
                files.join(", ")
            ));
        }
        Ok(())
    }

    /// Reports a validation after step `step`: a line (`val: step N loss: X ppl: Y`) and a
    /// record in the metrics log.
    pub fn validation(&mut self, step: u64, v: &crate::eval::Validation) -> Result<(), String> {
        if let Some(w) = &mut self.metrics {
            w.validation(step, v.loss)?;
        }
        self.say(&format!(
            "val: step {step} loss: {:.4} ppl: {:.2} ({} batches)",
            v.loss, v.perplexity, v.batches
        ));
        Ok(())
    }

    /// A line other than a step's, above the bar when there is one.
    pub fn say(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => crate::cli::write_stdout(format_args!("{line}\n")),
        }
    }

    /// Removes the bar, leaving the lines printed above it.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}
