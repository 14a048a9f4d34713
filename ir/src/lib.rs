//! graphtrain's intermediate representation: one dataflow graph for the whole train step.
//!
//! See ARCHITECTURE.md at the repository root for the code map and the invariants.

pub mod dtype;
pub mod graph;
pub mod infer;
pub mod op;
pub mod rng;

pub use dtype::{DType, TensorType};
pub use graph::{Graph, Input, InputKind, Meta, Node, Output, Phase, Remat, Tags, TypeError, ValueId};
pub use op::{Attr, BinaryOp, CompareOp, Op, RopeLayout, UnaryOp};
