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
