//! Models written against graphtrain's tracing API, and their configurations.

pub mod llama3;

pub use llama3::{Llama3Config, LLAMA3_CONFIGS};

/// Models the CLI knows, by name.
pub const MODELS: &[&str] = &["llama3"];
