//! Layout rules: layout ops move elements and do no arithmetic, so each rule is exact.
//!
//! The chain rules (`transpose_pair`, `reshape_chain`) take `(op, inner, x)`: `inner` is the op
//! that produces `op`'s operand and `x` is `inner`'s operand. `concat_single` takes all of the
//! node's operands.

use super::Outcome::{self, Forward, Replace};
use graphtrain_ir::{Op, TensorType};

/// Whether `perm` keeps every axis in place.
pub fn is_identity(perm: &[usize]) -> bool {
    perm.iter().enumerate().all(|(i, &p)| i == p)
}

// transpose(x, identity) → x
pub fn transpose_identity<V>(op: &Op, x: V) -> Option<Outcome<V>> {
    match op {
        Op::Transpose { perm } if is_identity(perm) => Some(Forward(x)),
        _ => None,
    }
}

// transpose(transpose(x, p), q) → transpose(x, p∘q), where (p∘q)[j] = p[q[j]]; → x if identity
pub fn transpose_pair<V>(op: &Op, inner: &Op, x: V) -> Option<Outcome<V>> {
    match (op, inner) {
        (Op::Transpose { perm: q }, Op::Transpose { perm: p }) if p.len() == q.len() => {
            // y[i] = t[q[i]] and t[j] = x[p[j]], so y[i] = x[p[q[i]]].
            let composed: Vec<usize> = q.iter().map(|&j| p[j]).collect();
            Some(if is_identity(&composed) {
                Forward(x)
            } else {
                Replace(Op::Transpose { perm: composed }, x)
            })
        }
        _ => None,
    }
}

// reshape(x, shape(x)) → x
pub fn reshape_identity<V>(op: &Op, x: V, xt: &TensorType) -> Option<Outcome<V>> {
    match op {
        Op::Reshape { shape } if *shape == xt.shape => Some(Forward(x)),
        _ => None,
    }
}

// reshape(reshape(x, s1), s2) → reshape(x, s2)   (row-major order is kept by both)
pub fn reshape_chain<V>(op: &Op, inner: &Op, x: V) -> Option<Outcome<V>> {
    match (op, inner) {
        (Op::Reshape { shape }, Op::Reshape { .. }) => Some(Replace(
            Op::Reshape {
                shape: shape.clone(),
            },
            x,
        )),
        _ => None,
    }
}

// expand(x, shape(x)) → x
pub fn expand_identity<V>(op: &Op, x: V, xt: &TensorType) -> Option<Outcome<V>> {
    match op {
        Op::Expand { shape } if *shape == xt.shape => Some(Forward(x)),
        _ => None,
    }
}

// slice(x, a, 0, dim_a(x)) → x
pub fn slice_full<V>(op: &Op, x: V, xt: &TensorType) -> Option<Outcome<V>> {
    match op {
        Op::Slice {
            axis,
            start: 0,
            end,
        } if xt.shape.get(*axis) == Some(end) => Some(Forward(x)),
        _ => None,
    }
}

// concat(x) → x
pub fn concat_single<V: Copy>(op: &Op, xs: &[V]) -> Option<Outcome<V>> {
    match (op, xs) {
        (Op::Concat { .. }, [x]) => Some(Forward(*x)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphtrain_ir::DType;

    fn t(shape: &[usize]) -> TensorType {
        TensorType {
            dtype: DType::F32,
            shape: shape.to_vec(),
        }
    }

    #[test]
    fn transpose_pair_composes_and_cancels() {
        let tr = |perm: &[usize]| Op::Transpose {
            perm: perm.to_vec(),
        };
        // p = [2,0,1], q = [2,1,0]: (p∘q) = [p[2], p[1], p[0]] = [1,0,2].
        assert_eq!(
            transpose_pair(&tr(&[2, 1, 0]), &tr(&[2, 0, 1]), 7),
            Some(Replace(tr(&[1, 0, 2]), 7))
        );
        assert_eq!(
            transpose_pair(&tr(&[1, 2, 0]), &tr(&[2, 0, 1]), 7),
            Some(Forward(7))
        );
        assert_eq!(transpose_pair(&tr(&[1, 0]), &tr(&[2, 0, 1]), 7), None);
    }

    #[test]
    fn identities_need_the_operand_type() {
        let slice = |end| Op::Slice {
            axis: 1,
            start: 0,
            end,
        };
        assert_eq!(slice_full(&slice(3), 7, &t(&[2, 3])), Some(Forward(7)));
        assert_eq!(slice_full(&slice(2), 7, &t(&[2, 3])), None);
        assert_eq!(slice_full(&slice(3), 7, &t(&[3])), None);
        let reshape = Op::Reshape { shape: vec![6] };
        assert_eq!(reshape_identity(&reshape, 7, &t(&[6])), Some(Forward(7)));
        assert_eq!(reshape_identity(&reshape, 7, &t(&[2, 3])), None);
    }
}
