//! graphtrain: traces a model's whole train step into one dataflow graph and runs it.
//!
//! The root package holds the CLI (`cli`), run configuration (`config`), data feeding (`data`),
//! the training loop (`trainer`) and forward-only runs for validation and sampling (`eval`), and re-exports the crates below it. See ARCHITECTURE.md.

pub mod autoshard;
pub mod bench;
pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod dot;
pub mod eval;
pub mod gate;
pub mod hf;
pub mod init_weights;
pub mod lr_schedule;
pub mod metrics;
pub mod peak;
pub mod plot;
pub mod replay;
pub mod search;
pub mod sharded;
pub mod sim;
pub mod step_report;
pub mod timeline;
pub mod trainer;
pub mod tuning;

pub use graphtrain_ir as ir;
pub use graphtrain_models as models;
pub use graphtrain_passes as passes;
