//! Mixed precision as a transform of the forward graph, before autodiff (torch's autocast):
//! under `Precision::Bf16Mixed` every f32 matmul reads bf16 copies of its operands and its bf16
//! result is cast back to f32. Parameters (the master weights), optimizer state, norms,
//! attention, the loss and every reduction stay f32.
//!
//! Each matmul gets casts of its own, even where two matmuls read one value (`wq`, `wk`, `wv`
//! of one activation): autodiff then casts each matmul's bf16 operand gradient back to f32 on
//! its own and sums them in f32, as autocast does. A matmul's bf16 result is its operands'
//! products accumulated in f32 and rounded once to bf16 (the interpreter accumulates in f64; the
//! gate's tolerance covers the difference).
//!
//! Declines: nothing; a graph with no f32 matmul comes back unchanged.

use crate::graph::{Graph, Meta, Node};
use crate::{DType, Op, TypeError, ValueId};

/// The element types a train step computes in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Matmuls on bf16 operands (f32 accumulation, bf16 result); the rest in f32.
    Bf16Mixed,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16Mixed => "bf16-mixed",
        }
    }

    /// `f32` or `bf16-mixed`.
    pub fn parse(s: &str) -> Result<Precision, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16-mixed" => Ok(Precision::Bf16Mixed),
            _ => Err(format!(
                "unknown precision `{s}`; precisions: f32, bf16-mixed"
            )),
        }
    }

    /// The element type its matmuls read.
    pub fn matmul_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16Mixed => DType::BF16,
        }
    }
}

/// `forward` under `precision`: each f32 matmul `a @ b` becomes
/// `cast_f32(cast_low(a) @ cast_low(b))`. Value ids of `forward` keep their meaning (new values
/// are appended), so parameters and outputs still name what they named.
pub fn autocast(forward: &Graph, precision: Precision) -> Result<Graph, TypeError> {
    let low = precision.matmul_dtype();
    if low == DType::F32 {
        return Ok(forward.clone());
    }
    let mut out = Graph {
        nodes: Vec::with_capacity(forward.nodes.len()),
        ..forward.clone()
    };
    let mut map: Vec<ValueId> = (0..forward.values.len() as u32).map(ValueId).collect();
    for node in &forward.nodes {
        let inputs: Vec<ValueId> = node.inputs.iter().map(|v| map[v.index()]).collect();
        let f32_matmul =
            matches!(node.op, Op::Matmul) && inputs.iter().all(|v| out.ty(*v).dtype == DType::F32);
        if !f32_matmul {
            out.nodes.push(Node {
                inputs,
                ..node.clone()
            });
            continue;
        }
        let meta = |what: &str| Meta {
            tags: node.meta.tags.clone(),
            ..Meta::new(format!("{}.{what}", node.meta.module), node.meta.phase)
        };
        let a = out.push1(Op::Cast { dtype: low }, vec![inputs[0]], meta("cast_a"))?;
        let b = out.push1(Op::Cast { dtype: low }, vec![inputs[1]], meta("cast_b"))?;
        let product = out.push1(Op::Matmul, vec![a, b], node.meta.clone())?;
        let back = out.push1(
            Op::Cast { dtype: DType::F32 },
            vec![product],
            meta("cast_out"),
        )?;
        map[node.outputs[0].index()] = back;
    }
    for o in &mut out.outputs {
        o.value = map[o.value.index()];
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::Phase;
    use crate::{InputKind, TensorType};

    fn two_matmuls() -> Graph {
        let mut g = Graph::new("t");
        let x = g.add_input(
            "x",
            InputKind::Data,
            TensorType::new(DType::F32, vec![2, 3]),
        );
        let w = g.add_input(
            "w",
            InputKind::Param,
            TensorType::new(DType::F32, vec![3, 4]),
        );
        let v = g.add_input(
            "v",
            InputKind::Param,
            TensorType::new(DType::F32, vec![3, 4]),
        );
        let meta = || Meta::new("m", Phase::Forward);
        let y = g.push1(Op::Matmul, vec![x, w], meta()).unwrap();
        let z = g.push1(Op::Matmul, vec![x, v], meta()).unwrap();
        let s = g
            .push1(Op::Binary(crate::BinaryOp::Add), vec![y, z], meta())
            .unwrap();
        g.add_output("s", s, None);
        g
    }

    #[test]
    fn each_matmul_reads_its_own_bf16_casts_and_is_cast_back() {
        let g = two_matmuls();
        assert_eq!(autocast(&g, Precision::F32).unwrap(), g);
        let mixed = autocast(&g, Precision::Bf16Mixed).unwrap();
        crate::verify(&mixed).unwrap();
        let casts_to_bf16 = mixed
            .nodes
            .iter()
            .filter(|n| n.op == Op::Cast { dtype: DType::BF16 })
            .count();
        assert_eq!(casts_to_bf16, 4, "two operands of each of two matmuls");
        for n in mixed.nodes.iter().filter(|n| n.op == Op::Matmul) {
            assert_eq!(mixed.ty(n.outputs[0]).dtype, DType::BF16);
        }
        let out = mixed.outputs[0].value;
        assert_eq!(mixed.ty(out).dtype, DType::F32);
        assert_eq!(Precision::parse("bf16-mixed"), Ok(Precision::Bf16Mixed));
        assert!(Precision::parse("fp8")
            .unwrap_err()
            .contains("f32, bf16-mixed"));
    }
}
