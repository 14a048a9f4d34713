//! The one driver (`graphtrain_runtime::compile`): the stages it exposes, its fingerprint, the
//! options it passes on, and what it declines.

use graphtrain::ir::optim::{build_train_step, OptimConfig};
use graphtrain::ir::{text, DType, Graph, HostTensor};
use graphtrain::models::Llama3Config;
use graphtrain::passes::{Pass, PassError, PassReport, Pipeline, PipelineSpec, Registry, Tier};
use graphtrain_lowering::{FusionLimits, Mode};
use graphtrain_runtime::{
    compile, Communicator, CompileOptions, RuntimeError, RuntimeOptions, SingleRank,
};
use graphtrain_runtime::{Backend, Fingerprint};

fn pipeline(list: &str) -> Pipeline {
    PipelineSpec::parse_list(list)
        .and_then(|s| s.build(&Registry::builtin()))
        .unwrap()
}

fn tiny_step() -> Graph {
    let traced = Llama3Config::builtin("tiny")
        .unwrap()
        .trace(DType::F32)
        .unwrap();
    build_train_step(traced, "loss", &OptimConfig::default())
        .unwrap()
        .graph
}

/// A small graph with a composite no backend keeps (`rms_norm` is decomposed by the driver).
const NORM: &str = "graph g {
  input %x: f32[4,16]
  param %w: f32[16]
  %1: f32[4,16] = rms_norm(%x, %w, eps=0.00001)
  %2: f32[4,16] = mul(%1, %1)
  output y = %2
}";

#[test]
fn equal_graphs_have_equal_fingerprints_and_a_pass_that_changes_the_graph_changes_it() {
    let g = tiny_step();
    let none = pipeline("none");
    let default = pipeline("default");
    let a = compile(
        &g,
        Backend::Reference,
        &CompileOptions::new(&none, Mode::Fused),
    )
    .unwrap();
    let b = compile(
        &g,
        Backend::Reference,
        &CompileOptions::new(&none, Mode::Fused),
    )
    .unwrap();
    let c = compile(
        &g,
        Backend::Reference,
        &CompileOptions::new(&default, Mode::Fused),
    )
    .unwrap();
    assert_eq!(a.fingerprint, b.fingerprint);
    assert_eq!(a.fingerprint, Fingerprint::of(&g));
    assert_ne!(
        a.fingerprint, c.fingerprint,
        "the default passes change the step"
    );
    // The optimized graph compiled again without passes is the same graph.
    let d = compile(
        &c.graph,
        Backend::Reference,
        &CompileOptions::new(&none, Mode::Fused),
    )
    .unwrap();
    assert_eq!(c.fingerprint, d.fingerprint);
}

#[test]
fn the_interpreter_has_no_program_and_a_compiled_backend_a_legalized_one() {
    let g = text::parse(NORM).unwrap();
    let none = pipeline("none");
    let options = CompileOptions::new(&none, Mode::Fused);
    let reference = compile(&g, Backend::Reference, &options).unwrap();
    assert!(reference.program.is_none());
    let cpu = compile(&g, Backend::Cpu, &options).unwrap();
    let program = cpu.program.as_ref().expect("a cpu Program");
    assert!(
        program.graph.nodes.iter().all(|n| !n.op.is_composite()),
        "rms_norm reaches the lowering decomposed"
    );
    // Both run the same step; the interpreter computes rms_norm as its own op.
    let x = HostTensor::from_fn(g.ty(g.inputs[0].value).clone(), |i| (i as f64).sin());
    let w = HostTensor::from_fn(g.ty(g.inputs[1].value).clone(), |i| 1.0 + 0.1 * i as f64);
    let run = |compiled: graphtrain_runtime::Compiled| {
        let mut exec = compiled.load(Box::new(SingleRank)).unwrap();
        let inputs: Vec<_> = exec.graph().inputs.iter().map(|i| i.value).collect();
        exec.write(inputs[0], &x).unwrap();
        exec.write(inputs[1], &w).unwrap();
        exec.run().unwrap();
        let out = exec.graph().outputs[0].value;
        exec.read(out).unwrap()
    };
    let want = run(reference);
    let got = run(cpu);
    let worst = want
        .data
        .iter()
        .zip(&got.data)
        .map(|(a, b)| (a - b).abs() / a.abs().max(1.0))
        .fold(
            0.0,
            |m: f64, e| if e.is_nan() { f64::NAN } else { m.max(e) },
        );
    assert!(worst <= 1e-6, "cpu against the interpreter: {worst:e}");
}

#[test]
fn every_executor_is_given_its_communicator() {
    let g = text::parse(NORM).unwrap();
    let none = pipeline("none");
    for backend in [Backend::Reference, Backend::Cpu] {
        let exec = compile(&g, backend, &CompileOptions::new(&none, Mode::Eager))
            .unwrap()
            .load(Box::new(SingleRank))
            .unwrap();
        let comm: &dyn Communicator = exec.communicator();
        assert_eq!((comm.rank(), comm.world_size()), (0, 1), "{backend}");
    }
}

#[test]
fn a_memory_limit_in_the_options_is_what_the_cpu_backend_is_held_to() {
    let g = tiny_step();
    let none = pipeline("none");
    let mut options = CompileOptions::new(&none, Mode::Fused);
    options.runtime = RuntimeOptions {
        memory_limit_bytes: Some(1 << 10),
        ..RuntimeOptions::default()
    };
    let err = compile(&g, Backend::Cpu, &options)
        .unwrap()
        .load(Box::new(SingleRank))
        .err()
        .expect("1 KiB cannot hold tiny's arena");
    assert!(matches!(err, RuntimeError::DoesNotFit(_)), "{err}");
}

#[test]
fn fusion_limits_reach_the_lowering_and_bad_ones_are_refused() {
    let g = tiny_step();
    let none = pipeline("none");
    let steps = |limits: FusionLimits| {
        let mut options = CompileOptions::new(&none, Mode::Fused);
        options.fusion = limits;
        compile(&g, Backend::Cpu, &options).map(|c| c.program.unwrap().steps.len())
    };
    let default = steps(FusionLimits::default()).unwrap();
    let narrow = steps(FusionLimits {
        max_map_inputs: 3,
        ..FusionLimits::default()
    })
    .unwrap();
    assert!(
        narrow > default,
        "{narrow} steps with 3 inputs per kernel, {default} with 6"
    );
    let err = steps(FusionLimits {
        max_map_inputs: 100,
        ..FusionLimits::default()
    })
    .unwrap_err();
    assert!(matches!(err, RuntimeError::Lower(_)), "{err}");
}

/// A pass that always fails, as a plugin's might.
struct Broken;

impl Pass for Broken {
    fn name(&self) -> &str {
        "broken"
    }
    fn tier(&self) -> Tier {
        Tier::Preserving
    }
    fn run(&self, _: &Graph) -> Result<(Graph, PassReport), PassError> {
        Err(PassError {
            pass: "broken".into(),
            message: "refuses every graph".into(),
        })
    }
}

#[test]
fn a_failing_pass_is_a_pipeline_error_and_an_unavailable_backend_is_said_first() {
    let g = text::parse(NORM).unwrap();
    let broken = Pipeline::new(vec![Box::new(Broken)]);
    match compile(
        &g,
        Backend::Reference,
        &CompileOptions::new(&broken, Mode::Fused),
    ) {
        Err(RuntimeError::Pipeline(m)) => assert!(m.contains("refuses every graph"), "{m}"),
        Err(e) => panic!("expected a pipeline error, got {e}"),
        Ok(_) => panic!("expected a pipeline error, got a compiled step"),
    }
    // Where `cuda` is not there, that is what the driver says, before any pass runs.
    if Backend::Cuda.unavailable().is_some() {
        let options = CompileOptions::new(&broken, Mode::Fused);
        assert!(matches!(
            compile(&g, Backend::Cuda, &options),
            Err(RuntimeError::Unavailable(_))
        ));
    }
}

#[test]
fn the_lowering_refuses_a_graph_that_was_not_legalized() {
    let g = text::parse(NORM).unwrap();
    let err = graphtrain_lowering::lower(&g, Mode::Eager).unwrap_err();
    assert!(err.to_string().contains("rms_norm"), "{err}");
    assert!(err.to_string().contains("legalize"), "{err}");
}

/// The cpu arena of `peer` at `batch` rows split into `micro_batches`, through the default
/// pipeline.
fn peer_arena(batch: usize, micro_batches: u32) -> usize {
    let model = Llama3Config {
        batch: batch / micro_batches as usize,
        ..Llama3Config::builtin("peer").unwrap()
    };
    let optim = OptimConfig {
        micro_batches,
        ..OptimConfig::default()
    };
    let step = build_train_step(model.trace(DType::F32).unwrap(), "loss", &optim).unwrap();
    let compiled = compile(
        &step.graph,
        Backend::Cpu,
        &CompileOptions::new(&pipeline("default"), Mode::Fused),
    )
    .unwrap();
    compiled.program.expect("a cpu program").plan.arena_bytes
}

/// A batch split into micro-batches holds one micro-batch's arena and the running sum of the
/// gradients, within 4 MiB (112.1 MiB against 94.7 + 17.0 today): nothing of a micro-batch is
/// computed in a later one (fusion once summed every micro-batch's gradients in one kernel at
/// the end, holding them all; `cse` once shared a weight's transposes across micro-batches).
#[test]
fn a_split_step_holds_one_micro_batchs_arena_and_the_gradient_sum() {
    let params: usize = Llama3Config::builtin("peer").unwrap().num_params() * 4;
    let (split, one) = (peer_arena(8, 4), peer_arena(2, 1));
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    println!(
        "peer: 8 rows in 4 micro-batches {:.1} MiB, 2 rows {:.1} MiB, the gradients {:.1} MiB",
        mib(split),
        mib(one),
        mib(params)
    );
    assert!(
        split <= one + params + (4 << 20),
        "{:.1} MiB split, {:.1} MiB for one micro-batch and {:.1} MiB of gradients",
        mib(split),
        mib(one),
        mib(params)
    );
}
