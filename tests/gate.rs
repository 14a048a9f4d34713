//! The default pass pipeline is tier 1: training through it is bitwise identical to training the
//! unoptimized step, on `tiny` and on `peer`, after 5 AdamW steps.

use graphtrain::gate::{check_pipeline, check_pipeline_on};
use graphtrain::models::Llama3Config;
use graphtrain::passes::{PipelineSpec, Registry};
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

/// Activation checkpointing and offload are tier 1 too: recomputation is deterministic, on the
/// interpreter and on the cpu backend.
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
    }
}
