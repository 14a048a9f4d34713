//! Cast rules.

use super::Outcome::{self, Forward};
use graphtrain_ir::{Op, TensorType};

// cast(x, dtype(x)) → x
pub fn cast_identity<V>(op: &Op, x: V, xt: &TensorType) -> Option<Outcome<V>> {
    match op {
        Op::Cast { dtype } if *dtype == xt.dtype => Some(Forward(x)),
        _ => None,
    }
}
