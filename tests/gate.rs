//! The default pass pipeline is tier 1: training through it is bitwise identical to training the
//! unoptimized step, on `tiny` and on `peer`, after 5 AdamW steps. And the gate itself fails a
//! pass that changes numerics.

use graphtrain::gate::{check_pipeline, check_pipeline_on, check_pipeline_tuned};
use graphtrain::ir::{Graph, Op};
use graphtrain::models::Llama3Config;
use graphtrain::passes::{Pass, PassError, PassReport, Pipeline, PipelineSpec, Registry, Tier};
use graphtrain_runtime::Backend;

fn default_pipeline() -> graphtrain::passes::Pipeline {
    let mut p = PipelineSpec::default_pipeline()
        .build(&Registry::builtin())
        .unwrap();
    p.verify_each = true;
    p
}

#[test]
fn default_pipeline_is_bitwise_identical_on_tiny() {
    check_pipeline(
        &Llama3Config::builtin("tiny").unwrap(),
        &default_pipeline(),
        5,
    )
    .unwrap();
}

#[test]
fn default_pipeline_is_bitwise_identical_on_peer() {
    check_pipeline(
        &Llama3Config::builtin("peer").unwrap(),
        &default_pipeline(),
        5,
    )
    .unwrap();
}

/// The same gate on the cpu backend: the unoptimized step lowered eagerly (one kernel per op)
/// against the default pipeline lowered with layout views, CSE over the primitives and the GEMM
/// reading transposed operands in place.
#[test]
fn default_pipeline_is_bitwise_identical_on_cpu_tiny_and_peer() {
    for config in ["tiny", "peer"] {
        check_pipeline_on(
            &Llama3Config::builtin(config).unwrap(),
            &default_pipeline(),
            5,
            Backend::Cpu,
        )
        .unwrap_or_else(|e| panic!("{config}: {e}"));
    }
}

/// The same gate on wgpu (lavapipe here), `tiny` only (`peer` does not fit lavapipe's largest
/// buffer): the default pipeline, and full activation checkpointing in front of it.
#[test]
fn default_pipeline_and_ac_are_bitwise_identical_on_wgpu_tiny() {
    let tiny = Llama3Config::builtin("tiny").unwrap();
    for backend in graphtrain::gate::device_backends_for_tests() {
        check_pipeline_on(&tiny, &default_pipeline(), 5, backend)
            .unwrap_or_else(|e| panic!("default on {backend}: {e}"));
        let mut ac = PipelineSpec::parse_list("ac=full,default")
            .unwrap()
            .build(&Registry::builtin())
            .unwrap();
        ac.verify_each = true;
        check_pipeline_on(&tiny, &ac, 5, backend)
            .unwrap_or_else(|e| panic!("ac=full,default on {backend}: {e}"));
    }
}

/// bf16-mixed, fused against eager, bit for bit: fusion folds the casts to bf16 that only
/// matmuls read into those matmuls (which round the f32 operand as they read it), lowers
/// widening casts as views and writes bf16 weight gradients transposed; each must round exactly
/// as the cast kernels it replaces. On cpu (the bf16 GEMM, on AMX tiles or `vdpbf16ps`, where
/// the cpu has AVX512_BF16, else the f32 GEMM on rounded copies) and the device backends, with `ac=full` in front as well (the
/// recomputed forward's casts fold too); on cpu also with heads of 32 (attention on AMX's tile
/// blocks).
#[test]
fn bf16_mixed_fused_is_bitwise_eager_on_tiny() {
    use graphtrain::ir::autocast::Precision;
    use graphtrain::tuning::Tuning;
    let tiny = Llama3Config::builtin("tiny").unwrap();
    let mut backends = vec![Backend::Cpu];
    backends.extend(graphtrain::gate::device_backends_for_tests());
    for list in ["default", "ac=full,default"] {
        let mut p = PipelineSpec::parse_list(list)
            .unwrap()
            .build(&Registry::builtin())
            .unwrap();
        p.verify_each = true;
        for &backend in &backends {
            check_pipeline_tuned(
                &tiny,
                &p,
                3,
                backend,
                None,
                &Tuning::default(),
                Precision::Bf16Mixed,
            )
            .unwrap_or_else(|e| panic!("{list} on {backend}, bf16-mixed: {e}"));
        }
        // A GEMM kernel chosen by a setting runs on both sides: the f32 GEMM and `vdpbf16ps`
        // round bf16-mixed's products differently from AMX tiles and from each other, and the
        // gate judges the pipeline, not that.
        for gemm in ["gemm=avx2", "gemm=avx512"] {
            check_pipeline_tuned(
                &tiny,
                &p,
                3,
                Backend::Cpu,
                None,
                &Tuning::parse(gemm).unwrap(),
                Precision::Bf16Mixed,
            )
            .unwrap_or_else(|e| panic!("{list} with {gemm}, bf16-mixed: {e}"));
        }
        // Heads of 32 (two, sharing one kv head): attention on AMX runs as tile blocks
        // (`attention_amx.rs`) where the head dim is whole blocks, which `tiny`'s 8 is not.
        let wide_heads = Llama3Config {
            dim: 64,
            n_heads: 2,
            n_kv_heads: 1,
            ..tiny.clone()
        };
        check_pipeline_tuned(
            &wide_heads,
            &p,
            3,
            Backend::Cpu,
            None,
            &Tuning::default(),
            Precision::Bf16Mixed,
        )
        .unwrap_or_else(|e| panic!("{list} on cpu, heads of 32, bf16-mixed: {e}"));
    }
}

/// Device graphs (on wgpu, cubecl's software graphs: each capture region's launches resolved
/// once and replayed) give the bits of dispatching every launch: `tiny` through the default
/// pipeline, graphs on (the default) and off, each bitwise the eager step after 5 AdamW steps;
/// and with them on, regions were recorded and replayed.
#[test]
fn device_graphs_replay_bitwise_on_tiny() {
    use graphtrain::data::DataSource;
    use graphtrain::ir::optim::OptimConfig;
    use graphtrain::lr_schedule::LrSchedule;
    use graphtrain::trainer::{TrainConfig, Trainer};
    use graphtrain::tuning::Tuning;
    use graphtrain_lowering::Mode;
    use graphtrain_runtime::CompileOptions;
    let tiny = Llama3Config::builtin("tiny").unwrap();
    for backend in graphtrain::gate::device_backends_for_tests() {
        for graphs in ["on", "off"] {
            check_pipeline_tuned(
                &tiny,
                &default_pipeline(),
                5,
                backend,
                None,
                &Tuning::parse(&format!("device_graphs={graphs}")).unwrap(),
                graphtrain::ir::autocast::Precision::F32,
            )
            .unwrap_or_else(|e| panic!("device_graphs={graphs} on {backend}: {e}"));
        }
        let pipeline = default_pipeline();
        let cfg = TrainConfig {
            data: DataSource::Fixed,
            seed: 0,
            lr: LrSchedule::constant(1e-3),
            optim: OptimConfig::default(),
        };
        let options = CompileOptions::new(&pipeline, Mode::Fused);
        let mut t = Trainer::build(&tiny, cfg, backend, &options).unwrap();
        for _ in 0..3 {
            t.step().unwrap();
        }
        let (graphs, steps) = t.device_graphs().unwrap();
        assert!(
            graphs > 0 && steps > 2 * graphs,
            "{backend}: {graphs} graphs over {steps} steps"
        );
    }
}

/// A device arena split across buffers (`RuntimeOptions::device_buffer_bytes` below the
/// arena: every operand bound from the window that holds it) trains `tiny` bit for bit as one
/// buffer does: losses, gradient norms and parameters after 5 AdamW steps, eager and fused,
/// with device graphs recording the split launches.
#[test]
fn a_device_arena_split_across_buffers_trains_bitwise_as_one() {
    use graphtrain::data::DataSource;
    use graphtrain::ir::optim::OptimConfig;
    use graphtrain::lr_schedule::LrSchedule;
    use graphtrain::trainer::{TrainConfig, Trainer};
    use graphtrain_lowering::Mode;
    use graphtrain_runtime::CompileOptions;
    let tiny = Llama3Config::builtin("tiny").unwrap();
    let pipeline = default_pipeline();
    for backend in graphtrain::gate::device_backends_for_tests() {
        for mode in [Mode::Eager, Mode::Fused] {
            let train = |buffer: Option<usize>| {
                let cfg = TrainConfig {
                    data: DataSource::Fixed,
                    seed: 0,
                    lr: LrSchedule::constant(1e-3),
                    optim: OptimConfig::default(),
                };
                let mut options = CompileOptions::new(&pipeline, mode);
                options.runtime.device_buffer_bytes = buffer;
                let mut t = Trainer::build(&tiny, cfg, backend, &options).unwrap();
                let metrics: Vec<(u64, u64)> = (0..5)
                    .map(|_| t.step().unwrap())
                    .map(|m| (m.loss.to_bits(), m.grad_norm.to_bits()))
                    .collect();
                let plan = t.program().unwrap().plan.clone();
                (metrics, t.parameters().unwrap(), plan)
            };
            let (whole, whole_params, whole_plan) = train(None);
            assert_eq!(whole_plan.window, None, "{backend} {mode:?}: {whole_plan}");
            // A quarter of the arena per buffer, in whole 256-byte blocks.
            let quarter = (whole_plan.arena_bytes / 4).next_multiple_of(256);
            let (split, split_params, split_plan) = train(Some(quarter));
            let window = split_plan.window.expect("the arena was not split");
            assert!(
                split_plan.arena_bytes > 3 * window,
                "{backend} {mode:?}: {split_plan}"
            );
            assert_eq!(
                split, whole,
                "{backend} {mode:?}: losses and gradient norms"
            );
            for ((name, a), (_, b)) in split_params.iter().zip(&whole_params) {
                let bits = |t: &graphtrain::ir::HostTensor| -> Vec<u64> {
                    t.data.iter().map(|x| x.to_bits()).collect()
                };
                assert!(
                    bits(a) == bits(b),
                    "{backend} {mode:?}: parameter {name} differs"
                );
            }
        }
    }
}

/// Activation checkpointing and offload are tier 1 too: recomputation is deterministic, on the
/// interpreter and on the cpu backend, and offload's round trip through host memory on a device.
#[test]
fn memory_passes_are_bitwise_identical_on_tiny() {
    let tiny = Llama3Config::builtin("tiny").unwrap();
    for list in [
        "ac=full,default",
        "ac=selective,default",
        "ac=budget:0.5,default",
        "ac=budget:0.25",
        "offload=min_bytes:1024;prefetch:2",
    ] {
        let mut p = PipelineSpec::parse_list(list)
            .unwrap()
            .build(&Registry::builtin())
            .unwrap();
        p.verify_each = true;
        check_pipeline(&tiny, &p, 5).unwrap_or_else(|e| panic!("{list}: {e}"));
        check_pipeline_on(&tiny, &p, 5, Backend::Cpu)
            .unwrap_or_else(|e| panic!("{list} on cpu: {e}"));
        // On a device, offload moves values to host memory and back: still tier 1.
        if list.starts_with("offload") {
            for backend in graphtrain::gate::device_backends_for_tests() {
                check_pipeline_on(&tiny, &p, 5, backend)
                    .unwrap_or_else(|e| panic!("{list} on {backend}: {e}"));
            }
        }
    }
}

/// The default pipeline's `attention_stats` acts on `tiny` in both precisions (each of its two
/// blocks' backward reads its forward's row statistics), so the default pipeline's gates above
/// (interpreter, cpu, wgpu) and `merged_sibling_matmuls_are_bitwise_identical` (bf16-mixed on
/// every GEMM kernel) hold it to tier 1. Under activation checkpointing: after `ac=full` the
/// backward pairs with the recomputed forward; after `ac=selective` its q and k are recomputed
/// ropes and it declines, so the pass runs before `ac` (and is held bitwise there too).
#[test]
fn attention_statistics_reach_every_backward_of_tiny() {
    use graphtrain::ir::autocast::Precision;
    let tiny = Llama3Config::builtin("tiny").unwrap();
    let optim = graphtrain::ir::optim::OptimConfig::default();
    for (pipeline, pairs) in [
        ("default", 2.0),
        ("ac=full,default", 2.0),
        ("ac=selective,default", 0.0),
        ("default,ac=selective", 2.0),
    ] {
        let mut p = PipelineSpec::parse_list(pipeline)
            .unwrap()
            .build(&Registry::builtin())
            .unwrap();
        p.verify_each = true;
        if pipeline == "default,ac=selective" {
            check_pipeline(&tiny, &p, 3).unwrap();
            check_pipeline_on(&tiny, &p, 3, Backend::Cpu).unwrap();
        }
        for precision in [Precision::F32, Precision::Bf16Mixed] {
            let step = graphtrain::trainer::build_step_in(&tiny, precision, &optim).unwrap();
            let (out, records) = p.run(&step.step.graph).unwrap();
            let record = records
                .iter()
                .find(|r| r.pass == "attention_stats")
                .expect("the pass ran");
            let got = record
                .report
                .metrics
                .iter()
                .find(|(name, _)| name == "attention_stats.pairs")
                .map_or(0.0, |m| m.1);
            assert_eq!(got, pairs, "{pipeline}, {precision:?}: {}", record.report);
            let with_stats = out
                .nodes
                .iter()
                .filter(|n| matches!(n.op, Op::AttentionBackward { stats: true, .. }))
                .count();
            assert_eq!(with_stats as f64, pairs, "{pipeline}, {precision:?}");
        }
    }
}

/// `merge_matmuls` is tier 1: each block's `wq`/`wk`/`wv` and `w1`/`w3` as one matmul over
/// their weights side by side (read in place by the fused lowering) trains bitwise as the
/// separate matmuls, on the interpreter, on cpu (f32 on `tiny` and `peer`; bf16-mixed on `tiny`
/// with every GEMM kernel, AMX tiles included where the cpu has them) and on the device
/// backends.
#[test]
fn merged_sibling_matmuls_are_bitwise_identical() {
    use graphtrain::ir::autocast::Precision;
    use graphtrain::tuning::Tuning;
    let tiny = Llama3Config::builtin("tiny").unwrap();
    let mut p = PipelineSpec::parse_list("default,merge_matmuls")
        .unwrap()
        .build(&Registry::builtin())
        .unwrap();
    p.verify_each = true;
    // The pass merges in both precisions (a gate over a pass that declined would prove nothing):
    // `wq` and `wk` in each of `tiny`'s two blocks.
    for precision in [Precision::F32, Precision::Bf16Mixed] {
        let optim = graphtrain::ir::optim::OptimConfig::default();
        let step = graphtrain::trainer::build_step_in(&tiny, precision, &optim).unwrap();
        let (_, records) = p.run(&step.step.graph).unwrap();
        let merge = &records.last().unwrap().report;
        assert!(
            merge
                .metrics
                .contains(&("merge_matmuls.groups".to_string(), 2.0)),
            "{precision:?}: {merge}"
        );
    }
    check_pipeline(&tiny, &p, 5).unwrap();
    for config in ["tiny", "peer"] {
        check_pipeline_on(&Llama3Config::builtin(config).unwrap(), &p, 3, Backend::Cpu)
            .unwrap_or_else(|e| panic!("{config} on cpu: {e}"));
    }
    for backend in graphtrain::gate::device_backends_for_tests() {
        check_pipeline_on(&tiny, &p, 5, backend).unwrap_or_else(|e| panic!("on {backend}: {e}"));
    }
    for tuning in ["", "gemm=avx2", "gemm=avx512"] {
        let tuning = if tuning.is_empty() {
            Tuning::default()
        } else {
            Tuning::parse(tuning).unwrap()
        };
        check_pipeline_tuned(
            &tiny,
            &p,
            3,
            Backend::Cpu,
            None,
            &tuning,
            Precision::Bf16Mixed,
        )
        .unwrap_or_else(|e| panic!("bf16-mixed with {tuning:?}: {e}"));
    }
}

/// The gate's own checks: it holds the default pipeline to tier 1, and it fails a pass that
/// changes numerics, whatever tier the pass claims.
#[test]
fn the_default_pipeline_is_tier_1() {
    assert_eq!(default_pipeline().tier(), Tier::Preserving);
}

/// Changes the first AdamW update's `beta1` to `beta1`: a wrong rewrite, claiming `tier`.
struct WrongBeta1 {
    beta1: f64,
    tier: Tier,
}

impl Pass for WrongBeta1 {
    fn name(&self) -> &str {
        "wrong-beta1"
    }
    fn tier(&self) -> Tier {
        self.tier
    }
    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut out = g.clone();
        let node = out
            .nodes
            .iter_mut()
            .find(|n| matches!(n.op, Op::AdamW { .. }))
            .expect("the train step has AdamW updates");
        if let Op::AdamW { beta1, .. } = &mut node.op {
            *beta1 = self.beta1;
        }
        Ok((out, PassReport::default()))
    }
}

#[test]
fn the_gate_fails_a_pass_that_changes_numerics() {
    let tiny = Llama3Config::builtin("tiny").unwrap();
    // Claimed tier 1, off in the last bits of one parameter's moments: the bitwise check fails.
    let subtle = Pipeline::new(vec![Box::new(WrongBeta1 {
        beta1: 0.9 + 1e-7,
        tier: Tier::Preserving,
    })]);
    let err = check_pipeline(&tiny, &subtle, 3).expect_err("a tier-1 claim that changes bits");
    assert!(err.contains("tier 1"), "{err}");
    let err = check_pipeline_on(&tiny, &subtle, 3, Backend::Cpu)
        .expect_err("the same on the cpu backend");
    assert!(err.contains("tier 1"), "{err}");
    // Claimed tier 2, far off: beyond the tolerance.
    let coarse = Pipeline::new(vec![Box::new(WrongBeta1 {
        beta1: 0.5,
        tier: Tier::Changing,
    })]);
    let err = check_pipeline(&tiny, &coarse, 3).expect_err("beta1 0.5 is not 0.9");
    assert!(err.contains("tier 2"), "{err}");
}
