//! graphtrain's lowering: from an optimized graph toward a program a backend runs. Today it holds
//! the buffer planner (`buffer_plan`); the kernel library and program construction arrive with the
//! cubecl backends (see docs/cubecl-notes.md).

pub mod buffer_plan;

pub use buffer_plan::{plan_buffers, BufferPlan, Placement};
