//! graphtrain's lowering: from an optimized graph to a `Program` a backend runs — the kernel
//! launches in order over one planned arena (`buffer_plan`). Backend-neutral: the kernels
//! themselves live in `graphtrain-runtime`.
//!
//! `program` is the data model; `lower` drives the lowering through constant folding (`fold`),
//! eager (`eager`) or fused (`fusion`) step emission over the view algebra (`views`); `storage`
//! stores bf16 values in 2 bytes where every step touching them takes halves (a backend asks
//! for it); `packs` reads a concat of parameters in place, stored side by side; `text` prints
//! a Program for snapshots and dumps.

pub mod buffer_plan;
mod eager;
mod fold;
mod fusion;
mod lower;
mod packs;
pub mod program;
mod storage;
mod text;
mod views;

pub use buffer_plan::{
    plan_buffers, plan_sized, plan_slots, plan_slots_in_windows, BufferPlan, Placement,
};
pub use fusion::FusionLimits;
pub use lower::{lower, lower_with, lower_with_limits};
pub use packs::Pack;
pub use program::{
    kept_composite, Access, AdamWUpdate, Bf16Rounding, Expr, LowerError, MapInput, Mode, Program,
    ReduceKind, ReduceOver, Step, View,
};
pub use storage::BF16_BYTES;
