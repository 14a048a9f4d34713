//! graphtrain's intermediate representation: one dataflow graph for the whole train step.
//!
//! See ARCHITECTURE.md at the repository root for the code map and the invariants.

pub mod autocast;
pub mod autodiff;
pub mod decompose;
pub mod dtype;
pub mod graph;
pub mod host_tensor;
pub mod infer;
pub mod interp;
pub mod mesh;
pub mod micro_batches;
pub mod op;
pub mod optim;
pub mod rng;
pub mod ron_io;
pub mod spmd;
pub mod stats;
pub mod text;
pub mod trace;
pub mod verify;

pub use dtype::{DType, TensorType};
pub use graph::{
    Graph, Input, InputKind, Meta, Node, Output, Phase, Remat, Tags, TypeError, ValueId,
};
pub use host_tensor::HostTensor;
pub use interp::{InterpError, RunOutput};
pub use mesh::{Mesh, MeshDim, Placement, Placements, Reduce};
pub use op::{Attr, BinaryOp, Collective, CompareOp, Op, RopeLayout, UnaryOp};
pub use trace::{Init, ParamSpec, Scope, Tensor, Traced, Tracer};
pub use verify::{verify, VerifyError};
