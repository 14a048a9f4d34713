//! graphtrain's lowering: from an optimized graph to a `Program` a backend runs — the kernel
//! launches in order (`program`) over one planned arena (`buffer_plan`). Backend-neutral: the
//! kernels themselves live in `graphtrain-runtime`.

pub mod buffer_plan;
pub mod program;

pub use buffer_plan::{plan_buffers, plan_slots, BufferPlan, Placement};
pub use program::{
    kept_composite, lower, lower_with, Access, AdamWUpdate, Expr, LowerError, MapInput, Mode,
    Program, ReduceKind, ReduceOver, Step, View,
};
