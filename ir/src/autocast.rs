//! Mixed precision as a transform of the forward graph, before autodiff (torch's autocast):
//! under `Precision::Bf16Mixed` every f32 matmul and every f32 attention reads bf16 copies of
//! its operands and its bf16 result is cast back to f32. Parameters (the master weights),
//! optimizer state, norms, rope, the loss and every reduction stay f32.
//!
//! Each matmul gets casts of its own, even where two matmuls read one value (`wq`, `wk`, `wv`
//! of one activation): autodiff then casts each matmul's bf16 operand gradient back to f32 on
//! its own and sums them in f32, as autocast does. A matmul's bf16 result is its operands'
//! products accumulated in f32 and rounded once to bf16 (the interpreter accumulates in f64; the
//! gate's tolerance covers the difference).
//!
//! Attention in bf16 is torch's autocast policy for `scaled_dot_product_attention` too: its
//! gradient (`attention_backward`) then reads bf16 q, k, v and output gradient and gives bf16
//! gradients, cast back to f32 by the casts' own gradients. What bf16 attention computes is
//! `Step::Attention`'s contract (graphtrain-lowering), torch's cpu kernel's: its products read
//! bf16 operands, probabilities and score gradients and sum in f32; the interpreter computes the
//! same in f64.
//!
//! Declines: nothing; a graph with no f32 matmul or attention comes back unchanged.

use crate::graph::{Graph, Meta, Node};
use crate::{DType, Op, TypeError, ValueId};

/// The element types a train step computes in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// Everything in f32.
    #[default]
    F32,
    /// Matmuls and attention on bf16 operands (f32 accumulation, bf16 results); the rest in
    /// f32.
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

    /// The element type its matmuls and attention read.
    pub fn matmul_dtype(self) -> DType {
        match self {
            Precision::F32 => DType::F32,
            Precision::Bf16Mixed => DType::BF16,
        }
    }
}

/// `forward` under `precision`: each f32 matmul `a @ b` becomes
/// `cast_f32(cast_low(a) @ cast_low(b))`, and each f32 `attention(q, k, v)` becomes
/// `cast_f32(attention(cast_low(q), cast_low(k), cast_low(v)))`. Value ids of `forward` keep
/// their meaning (new values are appended), so parameters and outputs still name what they
/// named.
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
        let lowered = matches!(node.op, Op::Matmul | Op::Attention { .. })
            && inputs.iter().all(|v| out.ty(*v).dtype == DType::F32);
        if !lowered {
            out.nodes.push(Node {
                inputs,
                ..node.clone()
            });
            continue;
        }
        let meta = |what: &str| Meta {
            tags: node.meta.tags.clone(),
            micro_batch: node.meta.micro_batch,
            ..Meta::new(format!("{}.{what}", node.meta.module), node.meta.phase)
        };
        let operands: &[&str] = match node.op {
            Op::Matmul => &["cast_a", "cast_b"],
            _ => &["cast_q", "cast_k", "cast_v"],
        };
        let low_inputs = inputs
            .iter()
            .zip(operands)
            .map(|(&v, what)| out.push1(Op::Cast { dtype: low }, vec![v], meta(what)))
            .collect::<Result<Vec<_>, _>>()?;
        let result = out.push1(node.op.clone(), low_inputs, node.meta.clone())?;
        let back = out.push1(
            Op::Cast { dtype: DType::F32 },
            vec![result],
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

    /// Attention reads bf16 casts of q, k and v and is cast back; its gradient, through the
    /// casts' gradients, is a bf16 `attention_backward` whose results are cast back to f32.
    #[test]
    fn attention_runs_in_bf16_and_so_does_its_gradient() {
        let mut g = Graph::new("t");
        let ty = || TensorType::new(DType::F32, vec![1, 2, 3, 4]);
        let q = g.add_input("q", InputKind::Param, ty());
        let k = g.add_input("k", InputKind::Param, ty());
        let v = g.add_input("v", InputKind::Param, ty());
        let meta = || Meta::new("attn", Phase::Forward);
        let attention = Op::Attention {
            causal: true,
            scale: 0.5,
            stats: false,
        };
        let o = g.push1(attention.clone(), vec![q, k, v], meta()).unwrap();
        let loss = g
            .push1(
                Op::ReduceSum {
                    axes: vec![0, 1, 2, 3],
                    keepdim: false,
                },
                vec![o],
                meta(),
            )
            .unwrap();
        g.add_output("loss", loss, None);
        let mut mixed = autocast(&g, Precision::Bf16Mixed).unwrap();
        crate::verify(&mixed).unwrap();
        let node = mixed.nodes.iter().find(|n| n.op == attention).unwrap();
        let producers = mixed.producers();
        for i in &node.inputs {
            let cast = producers[i.index()].expect("a cast");
            assert_eq!(mixed.nodes[cast].op, Op::Cast { dtype: DType::BF16 });
            assert_eq!(mixed.ty(*i).dtype, DType::BF16);
        }
        assert_eq!(mixed.ty(node.outputs[0]).dtype, DType::BF16);
        let loss = mixed.outputs[0].value;
        assert_eq!(mixed.ty(loss).dtype, DType::F32);
        let grads = crate::autodiff::grad(&mut mixed, loss, &[q, k, v]).unwrap();
        crate::verify(&mixed).unwrap();
        let backward = mixed
            .nodes
            .iter()
            .find(|n| matches!(n.op, Op::AttentionBackward { .. }))
            .expect("attention's gradient");
        for x in backward.inputs.iter().chain(&backward.outputs) {
            assert_eq!(mixed.ty(*x).dtype, DType::BF16);
        }
        for dx in grads {
            assert_eq!(mixed.ty(dx).dtype, DType::F32);
        }
    }
}
