//! The default pass pipeline is tier 1: training through it is bitwise identical to training the
//! unoptimized step, on `tiny` and on `peer`, after 5 AdamW steps.

use graphtrain::gate::check_pipeline;
use graphtrain::models::Llama3Config;
use graphtrain::passes::{PipelineSpec, Registry};

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

/// Activation checkpointing and offload are tier 1 too: recomputation is deterministic.
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
    }
}
