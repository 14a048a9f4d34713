//! `graphtrain bench`: trains for warm-up plus measured steps and reports what a speed comparison
//! needs: median and best tokens/s, cold compile time split by stage, predicted against measured
//! memory, and peak RSS. The shape follows ../shared/peers/torch/llama_step.py's summary so the
//! two can sit side by side.

use crate::peak::Peak;
use crate::trainer::Trainer;
use graphtrain_lowering::BufferPlan;
use serde::Serialize;
use std::time::Duration;

/// Wall time of each stage before the first step.
#[derive(Clone, Debug, Serialize)]
pub struct CompileTimes {
    pub trace_s: f64,
    pub autodiff_and_optimizer_s: f64,
    pub verify_s: f64,
    pub passes_s: f64,
    pub buffer_plan_s: f64,
    /// Kernel JIT: none on the reference interpreter.
    pub kernel_jit_s: Option<f64>,
    pub total_s: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchSummary {
    pub model: String,
    pub config: String,
    pub backend: String,
    pub passes: Vec<String>,
    pub params: usize,
    pub tokens_per_step: usize,
    pub warmup: u64,
    pub steps: u64,
    pub median_tps: f64,
    pub best_tps: f64,
    pub median_step_s: f64,
    pub first_step_s: f64,
    pub flops_per_token: f64,
    pub achieved_gflops: f64,
    /// MFU against `peak_gflops`; `None` where the backend has no known peak.
    pub mfu: Option<f64>,
    /// The peak MFU is measured against, and how it was derived (`crate::peak`).
    pub peak_gflops: Option<f64>,
    pub peak_source: Option<String>,
    pub compile: CompileTimes,
    /// The buffer plan's arena, before anything ran.
    pub predicted_peak_bytes: usize,
    /// The executor's own accounting of live tensor bytes, over all steps.
    pub measured_peak_bytes: usize,
    /// On a device: the bytes its allocator gave the arena (with the composites' tables and
    /// scratch), and after the measured steps the host memory holding offloaded values.
    pub device_bytes_in_use: Option<u64>,
    pub offloaded_host_bytes: Option<u64>,
    /// Resident memory gained from just before the step was loaded onto its backend to the end
    /// of the first step (arena pages touched, JIT code, runtime): measured by the OS, the
    /// independent check of `predicted_peak_bytes` on a compiled backend.
    pub load_rss_growth_bytes: Option<usize>,
    /// Peak resident set size of this process (Linux `VmHWM`), when the OS reports it.
    pub peak_rss_bytes: Option<usize>,
    pub step_times_s: Vec<f64>,
    pub losses: Vec<f64>,
    /// On a mesh: per rank, the median over the measured steps of the seconds blocked in
    /// collective waits, for other ranks or for the collective to finish (empty on one rank).
    pub median_wait_s: Vec<f64>,
    /// Per rank, the median of the part of those waits spent before every member had started
    /// the collective (waiting for peers, not for the data); the rest is exposed communication.
    pub median_peer_wait_s: Vec<f64>,
}

/// Per rank, the median over steps of `per_step[step][rank]`.
fn per_rank_medians(per_step: &[Vec<f64>]) -> Vec<f64> {
    (0..per_step.first().map_or(0, Vec::len))
        .map(|rank| median(&per_step.iter().map(|w| w[rank]).collect::<Vec<_>>()))
        .collect()
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

fn proc_status_bytes(key: &str) -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Peak RSS from /proc/self/status, `None` where unavailable.
pub fn peak_rss_bytes() -> Option<usize> {
    proc_status_bytes("VmHWM:")
}

/// Current RSS from /proc/self/status, `None` where unavailable.
pub fn current_rss_bytes() -> Option<usize> {
    proc_status_bytes("VmRSS:")
}

/// What loading the step onto its backend planned and cost.
pub struct LoadInfo<'a> {
    pub plan: &'a BufferPlan,
    /// Lowering and load time (the buffer plan included).
    pub plan_time: Duration,
    /// Resident memory just before the load.
    pub rss_before_load: Option<usize>,
}

/// Runs `warmup + steps` steps on `trainer`; only the last `steps` count for speed.
pub fn run(
    trainer: &mut Trainer,
    warmup: u64,
    steps: u64,
    load: LoadInfo<'_>,
    labels: (&str, &str, &str),
    peak: Option<Peak>,
    mut on_step: impl FnMut(&crate::trainer::StepMetrics),
) -> Result<BenchSummary, String> {
    let mut times = Vec::new();
    let mut losses = Vec::new();
    let mut measured_peak = 0;
    let mut load_rss_growth = None;
    let mut waits: Vec<Vec<f64>> = Vec::new();
    let mut peer_waits: Vec<Vec<f64>> = Vec::new();
    for i in 0..warmup + steps {
        let m = trainer.step().map_err(|e| e.to_string())?;
        if i == 0 {
            load_rss_growth = load
                .rss_before_load
                .zip(current_rss_bytes())
                .map(|(before, now)| now.saturating_sub(before));
        }
        on_step(&m);
        if i >= warmup {
            waits.push(m.wait_seconds.clone());
            peer_waits.push(m.peer_wait_seconds.clone());
        }
        times.push(m.seconds);
        losses.push(m.loss);
        measured_peak = measured_peak.max(m.peak_bytes);
    }
    let device_memory = trainer.measured_memory();
    let tokens = trainer.model.batch * trainer.model.seq_len;
    let measured = &times[warmup as usize..];
    let med = median(measured);
    let best = measured.iter().copied().fold(f64::INFINITY, f64::min);
    let flops_per_token = trainer.model.flops_per_token();
    let achieved_gflops = tokens as f64 / med * flops_per_token / 1e9;
    let t = &trainer.timings;
    let backend_is_compiled = labels.2 != "reference";
    let compile = CompileTimes {
        trace_s: t.trace.as_secs_f64(),
        autodiff_and_optimizer_s: t.autodiff_and_optimizer.as_secs_f64(),
        verify_s: t.verify.as_secs_f64(),
        passes_s: t.passes.as_secs_f64(),
        buffer_plan_s: load.plan_time.as_secs_f64(),
        // The first step compiles every kernel; what it took beyond a warm step is the JIT.
        kernel_jit_s: (backend_is_compiled && !times.is_empty()).then(|| (times[0] - med).max(0.0)),
        total_s: (t.trace + t.autodiff_and_optimizer + t.verify + t.passes + load.plan_time)
            .as_secs_f64(),
    };
    let (model, config, backend) = labels;
    Ok(BenchSummary {
        model: model.to_string(),
        config: config.to_string(),
        backend: backend.to_string(),
        passes: trainer.passes.iter().map(|p| p.pass.clone()).collect(),
        params: trainer.model.num_params(),
        tokens_per_step: tokens,
        warmup,
        steps,
        median_tps: tokens as f64 / med,
        best_tps: tokens as f64 / best,
        median_step_s: med,
        first_step_s: times.first().copied().unwrap_or(f64::NAN),
        flops_per_token,
        achieved_gflops,
        mfu: peak.as_ref().map(|p| achieved_gflops / p.gflops),
        peak_gflops: peak.as_ref().map(|p| p.gflops),
        peak_source: peak.map(|p| p.source),
        compile,
        predicted_peak_bytes: load.plan.arena_bytes,
        measured_peak_bytes: measured_peak,
        device_bytes_in_use: device_memory.map(|m| m.device_bytes),
        offloaded_host_bytes: device_memory.map(|m| m.host_bytes),
        load_rss_growth_bytes: load_rss_growth,
        peak_rss_bytes: peak_rss_bytes(),
        step_times_s: times,
        losses,
        median_wait_s: per_rank_medians(&waits),
        median_peer_wait_s: per_rank_medians(&peer_waits),
    })
}

/// `bench --against`: two step programs timed in alternation on one machine.
#[derive(Clone, Debug, Serialize)]
pub struct PairedSummary {
    pub model: String,
    pub config: String,
    pub backend: String,
    /// The pipelines as given: `--passes` (or `--pipeline`'s file), the baseline, and
    /// `--against`, the candidate.
    pub baseline_pipeline: String,
    pub candidate_pipeline: String,
    pub warmup: u64,
    pub pairs: u64,
    pub baseline_median_step_s: f64,
    pub candidate_median_step_s: f64,
    /// Candidate step time over the baseline step time run next to it, per pair: median and
    /// quartiles. Adjacent steps see the same machine, so this drifts far less than either
    /// median on a shared host.
    pub ratio_median: f64,
    pub ratio_q1: f64,
    pub ratio_q3: f64,
    pub baseline_step_times_s: Vec<f64>,
    pub candidate_step_times_s: Vec<f64>,
}

/// Element at fraction `q` of the sorted `xs` (nearest rank).
fn quantile(xs: &[f64], q: f64) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    v[((v.len() - 1) as f64 * q).round() as usize]
}

/// Warms both trainers up, then runs `pairs` pairs of steps, alternating which one goes first
/// (A B, B A, A B, ...) so a steady drift in machine speed favours neither.
pub fn paired(
    baseline: &mut Trainer,
    candidate: &mut Trainer,
    warmup: u64,
    pairs: u64,
    labels: (&str, &str, &str),
    pipelines: (&str, &str),
    mut on_pair: impl FnMut(u64, f64, f64),
) -> Result<PairedSummary, String> {
    let step = |t: &mut Trainer| t.step().map(|m| m.seconds).map_err(|e| e.to_string());
    for _ in 0..warmup {
        step(baseline)?;
        step(candidate)?;
    }
    let (mut tb, mut tc, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for i in 0..pairs {
        let (b, c) = if i % 2 == 0 {
            let b = step(baseline)?;
            (b, step(candidate)?)
        } else {
            let c = step(candidate)?;
            (step(baseline)?, c)
        };
        on_pair(i + 1, b, c);
        tb.push(b);
        tc.push(c);
        ratios.push(c / b);
    }
    let (model, config, backend) = labels;
    Ok(PairedSummary {
        model: model.to_string(),
        config: config.to_string(),
        backend: backend.to_string(),
        baseline_pipeline: pipelines.0.to_string(),
        candidate_pipeline: pipelines.1.to_string(),
        warmup,
        pairs,
        baseline_median_step_s: median(&tb),
        candidate_median_step_s: median(&tc),
        ratio_median: median(&ratios),
        ratio_q1: quantile(&ratios, 0.25),
        ratio_q3: quantile(&ratios, 0.75),
        baseline_step_times_s: tb,
        candidate_step_times_s: tc,
    })
}
