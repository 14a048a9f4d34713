//! graphtrain's passes: the pass ABI (`Pass`), the pass manager (`Pipeline`), the registry,
//! the snapshot-test helper (`testing`), and every pass, one file each with its contract at the
//! top and its snapshot cases beside it.

pub mod pass;
pub mod pipeline;
mod rebuild;
pub mod registry;
pub mod rules;
pub mod substitute;
pub mod testing;

pub mod memory;

pub mod ac;
pub mod ac_policy;
pub mod async_tp;
pub mod attention_stats;
pub mod bucket;
pub mod canonicalize;
pub mod capture;
pub mod cse;
pub mod dce;
pub mod egraph;
pub mod gather_bf16;
pub mod keep_gathered;
pub mod merge_matmuls;
pub mod offload;
pub mod parallelize;
pub mod prefetch;
pub mod remat;
pub mod schedule;

pub use pass::{Decline, Pass, PassError, PassReport, Tier};
pub use pipeline::{PassRecord, PassSpec, Pipeline, PipelineError, PipelineSpec, DEFAULT_PIPELINE};
pub use registry::{PassInfo, Registry};

/// Registers every built-in pass.
pub(crate) fn register_builtin(r: &mut Registry) {
    ac::register(r);
    ac_policy::register(r);
    async_tp::register(r);
    attention_stats::register(r);
    bucket::register(r);
    canonicalize::register(r);
    capture::register(r);
    cse::register(r);
    dce::register(r);
    egraph::register(r);
    gather_bf16::register(r);
    keep_gathered::register(r);
    merge_matmuls::register(r);
    offload::register(r);
    prefetch::register(r);
    remat::register(r);
    schedule::register(r);
}
