//! What the cpu and device executors share: the cubecl kernels for map, copy and reduce steps
//! (`kernels.rs`), their launches computed from a step (`launches.rs`, `kernel_call.rs`), the
//! profile (`profile.rs`), and what every backend reads off a composite the same way
//! (`attention_shape.rs`, `rope_tables.rs`) plus the host-side values of iota and random steps.
//!
//! Architecture invariant: `cpu/` and `device/` depend on this module and never on each other.

pub mod attention_shape;
pub mod kernel_call;
pub mod kernels;
pub mod launches;
pub mod profile;
pub mod rope_tables;

use crate::RuntimeError;
use graphtrain_ir::{HostTensor, ValueId};
use graphtrain_lowering::Program;

/// Whether `t` may be written into value `v` of `p` on a compiled backend: the same type, and
/// integers that its f32 storage holds exactly.
pub fn check_input(p: &Program, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError> {
    let ty = p.graph.ty(v);
    if &t.ty != ty {
        return Err(RuntimeError::Input(format!(
            "value {v:?} expects {ty}, got {}",
            t.ty
        )));
    }
    if !ty.dtype.is_float() {
        let limit = graphtrain_lowering::program::MAX_EXACT_INT as f64;
        if let Some(bad) = t.data.iter().find(|x| x.abs() > limit) {
            return Err(RuntimeError::Input(format!(
                "integer {bad} is beyond 2^24, which the f32 storage of this backend cannot hold exactly"
            )));
        }
    }
    Ok(())
}

/// Element `i` of an iota step: its index along a dim of size `dim` with `inner` elements
/// below it. Computed on the host by every compiled backend.
pub fn iota_value(i: usize, inner: usize, dim: usize) -> f32 {
    ((i / inner.max(1)) % dim.max(1)) as f32
}

/// Element `i` of a random step's draw from `seed` (as the f32 the arena holds it).
pub fn random_value(seed: f32, stream: u64, normal: bool, i: usize) -> f32 {
    let seed = seed as i64 as u64;
    let x = if normal {
        graphtrain_ir::rng::normal(seed, stream, i as u64)
    } else {
        graphtrain_ir::rng::uniform(seed, stream, i as u64)
    };
    x as f32
}
