//! Scalar rules: `mul_scalar` and `add_scalar` by a neutral element, exact in IEEE arithmetic.
//! Only `canonicalize` calls these; the e-graph has the same two as pattern rules (`mul-one`,
//! `add-neg-zero` in `egraph/rules.rs`).

use super::Outcome::{self, Forward};
use graphtrain_ir::Op;

// mul_scalar(x, 1.0) → x      (x·1 = x exactly)
pub fn mul_one<V>(op: &Op, x: V) -> Option<Outcome<V>> {
    match op {
        Op::MulScalar { value } if *value == 1.0 => Some(Forward(x)),
        _ => None,
    }
}

// add_scalar(x, -0.0) → x     (x + -0 = x exactly; x + +0 is not: -0 + 0 = +0)
pub fn add_neg_zero<V>(op: &Op, x: V) -> Option<Outcome<V>> {
    match op {
        Op::AddScalar { value } if *value == 0.0 && value.is_sign_negative() => Some(Forward(x)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_negative_zero_is_neutral_for_addition() {
        assert_eq!(
            add_neg_zero(&Op::AddScalar { value: -0.0 }, 7),
            Some(Forward(7))
        );
        assert_eq!(add_neg_zero(&Op::AddScalar { value: 0.0 }, 7), None);
        assert_eq!(mul_one(&Op::MulScalar { value: 1.0 }, 7), Some(Forward(7)));
        assert_eq!(mul_one(&Op::MulScalar { value: -1.0 }, 7), None);
    }
}
