//! The burn op sequences that graphtrain has one composite for, found in a captured graph so
//! the import emits the composite (whose lowering has its own kernels and gradient rule)
//! instead of the primitives.
//!
//! Each pattern is matched at its last op (the root) by walking producers back; every
//! intermediate tensor must be read by the pattern alone (else the match is declined and the
//! ops translate one by one). The patterns are burn 0.22's decompositions:
//!
//! - RMSNorm (`burn-nn` `RmsNorm`): `x / sqrt(mean(x · x, last) + eps) · reshape(gamma)`
//!   → `rms_norm(x, gamma, eps)`.
//! - SiLU (`activation::silu`): `x · sigmoid(x)` → `silu(x)`.
//! - RoPE (`burn-nn` `RotaryEncoding`, interleaved pairs): `sum(reshape(reshape(x) @ sign) ·
//!   table[..S], last)` with the sign matrix `[[1,0,0,1],[0,-1,1,0]]` and the table of
//!   `(cos, sin)(p · θ^(-2i/D))` → `rope(x, θ, interleaved)`, `θ` read back from the table
//!   and every used entry checked against it.
//! - Cross-entropy (`burn-nn` `CrossEntropyLoss`, no padding, weights or smoothing):
//!   `-mean(gather(log_softmax(logits, 1), 1, reshape(targets)))` → `cross_entropy`.
//!
//! burn's attention is one op in the captured graph already (`Module/Attention`).

use crate::import::Index;
use burn_ir::{
    ActivationOperationIr, BaseOperationIr, FloatOperationIr, NumericOperationIr, OperationIr,
    ScalarIr, TensorIr,
};
use std::collections::{HashMap, HashSet};

#[derive(Clone, Debug)]
pub(crate) enum Composite {
    RmsNorm {
        x: TensorIr,
        gamma: TensorIr,
        eps: f64,
    },
    Silu {
        x: TensorIr,
    },
    Rope {
        x: TensorIr,
        theta: f64,
    },
    CrossEntropy {
        logits: TensorIr,
        targets: TensorIr,
    },
}

impl Composite {
    pub fn name(&self) -> &'static str {
        match self {
            Composite::RmsNorm { .. } => "rms_norm",
            Composite::Silu { .. } => "silu",
            Composite::Rope { .. } => "rope",
            Composite::CrossEntropy { .. } => "cross_entropy",
        }
    }
}

pub(crate) struct Match {
    pub composite: Composite,
    /// The parameter the pattern reads (its module names the composite's node).
    pub param: Option<String>,
}

#[derive(Default)]
pub(crate) struct Matches {
    /// Matched patterns by their root op.
    pub roots: HashMap<usize, Match>,
    /// Ops inside matched patterns, other than the roots: not translated.
    pub absorbed: HashSet<usize>,
}

/// Every pattern in `ix`'s graph.
pub(crate) fn find(ix: &Index<'_>) -> Matches {
    let mut found = Matches::default();
    // RoPE's table is one constant that every rotation reads: its theta is read and checked
    // once per length used, not once per rotation.
    let mut thetas: HashMap<(u64, usize), Option<f64>> = HashMap::new();
    for i in 0..ix.ops.len() {
        let mut inner = Vec::new();
        let hit = rms_norm(ix, i, &mut inner)
            .or_else(|| {
                inner.clear();
                silu(ix, i, &mut inner)
            })
            .or_else(|| {
                inner.clear();
                rope(ix, i, &mut inner, &mut thetas)
            })
            .or_else(|| {
                inner.clear();
                cross_entropy(ix, i, &mut inner)
            });
        if let Some(m) = hit {
            found.absorbed.extend(inner);
            found.roots.insert(i, m);
        }
    }
    found
}

/// The op producing intermediate `t`, which only the pattern may read; records it in `inner`.
fn inner<'a>(ix: &'a Index<'_>, t: &TensorIr, inner: &mut Vec<usize>) -> Option<&'a OperationIr> {
    if ix.reads_of(t) != 1 {
        return None;
    }
    let (i, op) = ix.producer_of(t)?;
    inner.push(i);
    Some(op)
}

fn float_scalar(s: &ScalarIr) -> Option<f64> {
    match s {
        ScalarIr::Float(x) => Some(*x),
        ScalarIr::Int(x) => Some(*x as f64),
        _ => None,
    }
}

fn same(a: &TensorIr, b: &TensorIr) -> bool {
    a.id == b.id
}

fn numeric(op: &OperationIr) -> Option<&NumericOperationIr> {
    match op {
        OperationIr::NumericFloat(_, n) => Some(n),
        _ => None,
    }
}

fn reshape_input(op: &OperationIr) -> Option<&TensorIr> {
    match op {
        OperationIr::BaseFloat(BaseOperationIr::Reshape(r))
        | OperationIr::BaseInt(BaseOperationIr::Reshape(r)) => Some(&r.input),
        _ => None,
    }
}

fn rms_norm(ix: &Index<'_>, root: usize, ins: &mut Vec<usize>) -> Option<Match> {
    let NumericOperationIr::Mul(m) = numeric(&ix.ops[root])? else {
        return None;
    };
    for (normed, scaled) in [(&m.lhs, &m.rhs), (&m.rhs, &m.lhs)] {
        let start = ins.len();
        let found = (|| {
            let gamma = reshape_input(inner(ix, scaled, ins)?)?;
            ix.param_name(gamma)?;
            let NumericOperationIr::Div(div) = numeric(inner(ix, normed, ins)?)? else {
                return None;
            };
            let x = &div.lhs;
            let OperationIr::Float(_, FloatOperationIr::Sqrt(sqrt)) = inner(ix, &div.rhs, ins)?
            else {
                return None;
            };
            let NumericOperationIr::AddScalar(add) = numeric(inner(ix, &sqrt.input, ins)?)? else {
                return None;
            };
            let eps = float_scalar(&add.rhs)?;
            let NumericOperationIr::MeanDim(mean) = numeric(inner(ix, &add.lhs, ins)?)? else {
                return None;
            };
            if mean.axis + 1 != x.shape.num_dims() {
                return None;
            }
            let NumericOperationIr::Mul(square) = numeric(inner(ix, &mean.input, ins)?)? else {
                return None;
            };
            let last = *x.shape.as_slice().last()?;
            let ok =
                same(&square.lhs, x) && same(&square.rhs, x) && gamma.shape.as_slice() == [last];
            ok.then(|| Match {
                param: ix.param_name(gamma).map(str::to_string),
                composite: Composite::RmsNorm {
                    x: x.clone(),
                    gamma: gamma.clone(),
                    eps,
                },
            })
        })();
        if found.is_some() {
            return found;
        }
        ins.truncate(start);
    }
    None
}

fn silu(ix: &Index<'_>, root: usize, ins: &mut Vec<usize>) -> Option<Match> {
    let NumericOperationIr::Mul(m) = numeric(&ix.ops[root])? else {
        return None;
    };
    for (x, gate) in [(&m.lhs, &m.rhs), (&m.rhs, &m.lhs)] {
        let start = ins.len();
        if let Some(OperationIr::Activation(ActivationOperationIr::Sigmoid(s))) =
            inner(ix, gate, ins)
        {
            if same(&s.input, x) {
                return Some(Match {
                    param: None,
                    composite: Composite::Silu { x: x.clone() },
                });
            }
        }
        ins.truncate(start);
    }
    None
}

fn cross_entropy(ix: &Index<'_>, root: usize, ins: &mut Vec<usize>) -> Option<Match> {
    let NumericOperationIr::Neg(neg) = numeric(&ix.ops[root])? else {
        return None;
    };
    let NumericOperationIr::Mean(mean) = numeric(inner(ix, &neg.input, ins)?)? else {
        return None;
    };
    let picked = reshape_input(inner(ix, &mean.input, ins)?)?;
    let OperationIr::BaseFloat(BaseOperationIr::Gather(gather)) = inner(ix, picked, ins)? else {
        return None;
    };
    let targets = reshape_input(inner(ix, &gather.indices, ins)?)?;
    let OperationIr::Activation(ActivationOperationIr::LogSoftmax(ls)) =
        inner(ix, &gather.tensor, ins)?
    else {
        return None;
    };
    let logits = &ls.input;
    let [n, _vocab] = logits.shape.as_slice() else {
        return None;
    };
    let ok = ls.axis == 1 && gather.dim == 1 && targets.shape.as_slice() == [*n];
    ok.then(|| Match {
        param: None,
        composite: Composite::CrossEntropy {
            logits: logits.clone(),
            targets: targets.clone(),
        },
    })
}

fn rope(
    ix: &Index<'_>,
    root: usize,
    ins: &mut Vec<usize>,
    thetas: &mut HashMap<(u64, usize), Option<f64>>,
) -> Option<Match> {
    let OperationIr::BaseFloat(BaseOperationIr::Reshape(back)) = &ix.ops[root] else {
        return None;
    };
    let out = back.out.shape.as_slice();
    let [b, h, s, d] = *out else {
        return None;
    };
    let NumericOperationIr::SumDim(sum) = numeric(inner(ix, &back.input, ins)?)? else {
        return None;
    };
    if sum.axis != 3 {
        return None;
    }
    let NumericOperationIr::Mul(mul) = numeric(inner(ix, &sum.input, ins)?)? else {
        return None;
    };
    let rotated = reshape_input(inner(ix, &mul.lhs, ins)?)?;
    let table = reshape_input(inner(ix, &mul.rhs, ins)?)?;
    let OperationIr::Float(_, FloatOperationIr::Matmul(mm)) = inner(ix, rotated, ins)? else {
        return None;
    };
    let x = reshape_input(inner(ix, &mm.lhs, ins)?)?;
    let sign = reshape_input(inner(ix, &mm.rhs, ins)?)?;
    let OperationIr::BaseFloat(BaseOperationIr::Slice(slice)) = inner(ix, table, ins)? else {
        return None;
    };
    if x.shape.as_slice() != out || mm.lhs.shape.as_slice() != [b * h, s, d / 2, 2] {
        return None;
    }
    if ix.constant(sign)? != [1.0, 0.0, 0.0, 1.0, 0.0, -1.0, 1.0, 0.0] {
        return None;
    }
    // Positions from 0: the first `s` rows of the table.
    let rows = slice.ranges.first()?;
    if rows.start != 0 || rows.step != 1 {
        return None;
    }
    let table = &slice.tensor;
    let theta = (*thetas
        .entry((table.id.value(), s))
        .or_insert_with(|| theta_of(&ix.constant(table)?, table.shape.as_slice(), s, d)))?;
    Some(Match {
        param: None,
        composite: Composite::Rope {
            x: x.clone(),
            theta,
        },
    })
}

/// RoPE's base read from burn's table `[max_seq, d, 2]` of `(cos, sin)(p · θ^(-2⌊j/2⌋/d))`,
/// from the slowest pair at position 1 (the angle f32 holds most precisely relative to
/// itself), then every entry of the first `s` positions checked against it.
fn theta_of(table: &[f32], shape: &[usize], s: usize, d: usize) -> Option<f64> {
    let [max_seq, width, 2] = *shape else {
        return None;
    };
    if width != d || s > max_seq || d < 4 || max_seq < 2 {
        return None;
    }
    let at = |p: usize, j: usize, k: usize| table[(p * d + j) * 2 + k] as f64;
    let pair = d / 2 - 1;
    let angle = at(1, 2 * pair + 1, 1).atan2(at(1, 2 * pair, 0));
    if angle <= 0.0 {
        return None;
    }
    let mut theta = angle.powf(-(d as f64) / (2.0 * pair as f64));
    if (theta - theta.round()).abs() < 1e-4 * theta {
        theta = theta.round();
    }
    for p in 0..s {
        for j in 0..d {
            let a = p as f64 * theta.powf(-2.0 * (j / 2) as f64 / d as f64);
            if (at(p, j, 0) - a.cos()).abs() > 1e-3 || (at(p, j, 1) - a.sin()).abs() > 1e-3 {
                return None;
            }
        }
    }
    Some(theta)
}
