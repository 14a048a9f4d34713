//! `this-cpu`: this host described for the simulator by measuring it, on the cpu backend, with
//! kernels that are not any model's step: a 1024x1024x1024 GEMM (f32, and bf16 for the bf16
//! matmuls' rate), a causal attention of 8 heads of 512 x 64 (f32, and bf16 for bf16-mixed's
//! attention), an elementwise sum over 8M elements (memory bandwidth), and a program of one
//! 64-element map (launch cost). The peak is the one MFU uses (`crate::peak`). Nothing here is
//! fitted to a step the simulator predicts: the step's own time is never an input.

use super::hardware::{Efficiency, Hardware, Kind, LinkSpec};
use graphtrain_ir::{text, HostTensor};
use graphtrain_lowering::Mode;
use graphtrain_passes::Pipeline;
use graphtrain_runtime::{compile, Backend, CompileOptions, Executor, SingleRank};
use std::time::Instant;

/// What each measurement gave, for the report.
#[derive(Clone, Debug)]
pub struct Calibration {
    pub hardware: Hardware,
    pub gemm_gflops: f64,
    pub bf16_gemm_gflops: f64,
    pub attention_gflops: f64,
    pub bf16_attention_gflops: f64,
    pub memory_gbps: f64,
    pub launch_us: f64,
    pub peak_source: String,
}

/// Loads `src` (a text-format graph) on cpu with inputs of ones, runs it `warmup` times, then
/// returns the median seconds of `reps` runs.
fn time_graph(src: &str, warmup: usize, reps: usize) -> Result<f64, String> {
    let g = text::parse(src).map_err(|e| e.to_string())?;
    let none = Pipeline::new(Vec::new());
    let compiled = compile(&g, Backend::Cpu, &CompileOptions::new(&none, Mode::Fused))
        .map_err(|e| e.to_string())?;
    let mut exec: Box<dyn Executor> = compiled
        .load(Box::new(SingleRank))
        .map_err(|e| e.to_string())?;
    let inputs: Vec<_> = exec.graph().inputs.iter().map(|i| i.value).collect();
    for v in inputs {
        let ty = exec.graph().ty(v).clone();
        let ones = vec![1.0; ty.numel()];
        let t = HostTensor::new(ty, ones).map_err(|e| e.to_string())?;
        exec.write(v, &t).map_err(|e| e.to_string())?;
    }
    for _ in 0..warmup {
        exec.run().map_err(|e| e.to_string())?;
    }
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            exec.run().map(|_| t.elapsed().as_secs_f64())
        })
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Measures this host (a few seconds, on every core).
pub fn this_cpu() -> Result<Calibration, String> {
    let peak = crate::peak::peak("cpu", None)
        .ok_or("this cpu's peak is unknown (its clock or FMA width could not be read)")?;
    let n = 1024;
    let gemm_s = time_graph(
        &format!(
            "graph gemm {{\n  input %a: f32[{n},{n}]\n  input %b: f32[{n},{n}]\n  %2: f32[{n},{n}] = matmul(%a, %b)\n  output o = %2\n}}"
        ),
        2,
        7,
    )?;
    let gemm_gflops = 2.0 * (n * n * n) as f64 / gemm_s / 1e9;
    // The bf16 GEMM (AMX tiles or `vdpbf16ps` where the cpu has them) is timed too: its rate
    // is not the f32 one's fraction of its own peak (AMX reaches a small part of its peak).
    // Graph inputs are f32 on the compiled backends: the casts fold into the matmul, as
    // bf16-mixed's do, and the widening cast after it is a view.
    let bf16_gemm_s = time_graph(
        &format!(
            "graph gemm {{\n  input %a: f32[{n},{n}]\n  input %b: f32[{n},{n}]\n  %2: bf16[{n},{n}] = cast(%a, dtype=bf16)\n  %3: bf16[{n},{n}] = cast(%b, dtype=bf16)\n  %4: bf16[{n},{n}] = matmul(%2, %3)\n  %5: f32[{n},{n}] = cast(%4, dtype=f32)\n  output o = %5\n}}"
        ),
        2,
        7,
    )?;
    let bf16_gemm_gflops = 2.0 * (n * n * n) as f64 / bf16_gemm_s / 1e9;

    let (h, s, d) = (8, 512, 64);
    let attention_s = time_graph(
        &format!(
            "graph attention {{\n  input %q: f32[1,{h},{s},{d}]\n  input %k: f32[1,{h},{s},{d}]\n  input %v: f32[1,{h},{s},{d}]\n  %3: f32[1,{h},{s},{d}] = attention(%q, %k, %v, causal=true, scale=0.125)\n  output o = %3\n}}"
        ),
        2,
        7,
    )?;
    let attention_gflops = 2.0 * (h * s * s * d) as f64 / attention_s / 1e9;
    // bf16-mixed's attention (its casts fold into it, as in the step), for the share of the bf16
    // peak it reaches: on AMX its products take a small part of the time, the softmax the rest.
    let bf16_attention_s = time_graph(
        &format!(
            "graph attention {{\n  input %q: f32[1,{h},{s},{d}]\n  input %k: f32[1,{h},{s},{d}]\n  input %v: f32[1,{h},{s},{d}]\n  %3: bf16[1,{h},{s},{d}] = cast(%q, dtype=bf16)\n  %4: bf16[1,{h},{s},{d}] = cast(%k, dtype=bf16)\n  %5: bf16[1,{h},{s},{d}] = cast(%v, dtype=bf16)\n  %6: bf16[1,{h},{s},{d}] = attention(%3, %4, %5, causal=true, scale=0.125)\n  %7: f32[1,{h},{s},{d}] = cast(%6, dtype=f32)\n  output o = %7\n}}"
        ),
        2,
        7,
    )?;
    let bf16_attention_gflops = 2.0 * (h * s * s * d) as f64 / bf16_attention_s / 1e9;

    let len = 8 << 20;
    let add_s = time_graph(
        &format!(
            "graph add {{\n  input %x: f32[{len}]\n  input %y: f32[{len}]\n  %2: f32[{len}] = add(%x, %y)\n  output o = %2\n}}"
        ),
        2,
        7,
    )?;
    let memory_gbps = (3 * len * 4) as f64 / add_s / 1e9;

    let launch_s = time_graph(
        "graph launch {\n  input %x: f32[64]\n  %1: f32[64] = exp(%x)\n  output o = %1\n}",
        20,
        51,
    )?;
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let bf16 = crate::peak::peak_in(
        "cpu",
        None,
        graphtrain_ir::autocast::Precision::Bf16Mixed,
        graphtrain_runtime::GemmKernel::Widest,
    )
    .map_or(peak.gflops, |p| p.gflops);
    let matmul_efficiency = (gemm_gflops / peak.gflops).min(1.0);
    // The simulator runs bf16 matmuls at this peak times the matmul efficiency (measured in
    // f32): the bf16 peak stands in as the one that gives back the bf16 GEMM's measured rate,
    // never above the unit's own.
    let bf16 = (bf16_gemm_gflops / matmul_efficiency).min(bf16);
    let hardware = Hardware {
        name: "this-cpu".into(),
        kind: Kind::Cpu,
        peak_gflops_f32: peak.gflops,
        peak_gflops_bf16: bf16,
        memory_gbps,
        memory_gib: host_memory_gib(),
        launch_us: launch_s * 1e6,
        efficiency: Efficiency {
            matmul: matmul_efficiency,
            attention: (attention_gflops / peak.gflops).min(1.0),
            attention_bf16: Some((bf16_attention_gflops / bf16).min(1.0)),
            memory: 1.0,
        },
        gpus_per_node: cores,
        // Ranks of one host exchange through shared memory: a copy at memory speed.
        intra_node: LinkSpec {
            gbps: memory_gbps,
            latency_us: 0.0,
        },
        inter_node: LinkSpec {
            gbps: memory_gbps,
            latency_us: 0.0,
        },
        host_link: LinkSpec {
            gbps: memory_gbps,
            latency_us: 0.0,
        },
    };
    Ok(Calibration {
        hardware,
        gemm_gflops,
        bf16_gemm_gflops,
        attention_gflops,
        bf16_attention_gflops,
        memory_gbps,
        launch_us: launch_s * 1e6,
        peak_source: peak.source,
    })
}

fn host_memory_gib() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(1.0, |kb| kb / (1024.0 * 1024.0))
}
