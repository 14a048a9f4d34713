//! The tracing API: model code calls methods on `Tensor` handles and each call appends a node to
//! the graph under the current module scope, so every node knows which module made it.
//!
//! Shape errors surface at trace time as `TypeError`s naming the module, the op and the operand
//! types; model code propagates them with `?`.

use crate::dtype::{DType, TensorType};
use crate::graph::{Graph, InputKind, Meta, Phase, TypeError, ValueId};
use crate::op::{BinaryOp, CompareOp, Op, RopeLayout, UnaryOp};
use std::cell::RefCell;

/// How a parameter is initialized before the first step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    Ones,
    Zeros,
}

/// A parameter declared while tracing.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub value: ValueId,
    pub init: Init,
}

/// A finished trace: the graph and the parameters it declared, in declaration order.
#[derive(Clone, Debug)]
pub struct Traced {
    pub graph: Graph,
    pub params: Vec<ParamSpec>,
}

struct State {
    graph: Graph,
    scope: Vec<String>,
    phase: Phase,
    params: Vec<ParamSpec>,
}

/// Records a model's computation into a `Graph`.
pub struct Tracer {
    state: RefCell<State>,
}

/// A value in the graph being traced.
#[derive(Clone, Copy)]
pub struct Tensor<'t> {
    tracer: &'t Tracer,
    pub id: ValueId,
}

impl std::fmt::Debug for Tensor<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tensor(%{}: {})", self.id.0, self.ty())
    }
}

/// Leaves the module scope when dropped.
pub struct Scope<'t> {
    tracer: &'t Tracer,
}

impl Drop for Scope<'_> {
    fn drop(&mut self) {
        self.tracer.state.borrow_mut().scope.pop();
    }
}

impl Tracer {
    pub fn new(name: &str) -> Self {
        Tracer {
            state: RefCell::new(State {
                graph: Graph::new(name),
                scope: Vec::new(),
                phase: Phase::Forward,
                params: Vec::new(),
            }),
        }
    }

    /// Enters a module scope (`layers`, then `3`, gives `layers.3`) until the guard drops.
    pub fn scope(&self, name: impl std::fmt::Display) -> Scope<'_> {
        self.state.borrow_mut().scope.push(name.to_string());
        Scope { tracer: self }
    }

    /// The current module path.
    pub fn module_path(&self) -> String {
        self.state.borrow().scope.join(".")
    }

    /// Sets the phase recorded on nodes traced from now on.
    pub fn set_phase(&self, phase: Phase) {
        self.state.borrow_mut().phase = phase;
    }

    fn qualified(&self, name: &str) -> String {
        let path = self.module_path();
        if path.is_empty() {
            name.to_string()
        } else {
            format!("{path}.{name}")
        }
    }

    /// A data input fed every step (tokens, targets).
    pub fn input(&self, name: &str, ty: TensorType) -> Tensor<'_> {
        let id = self
            .state
            .borrow_mut()
            .graph
            .add_input(name, InputKind::Data, ty);
        Tensor { tracer: self, id }
    }

    /// A trainable parameter named `<module path>.<name>`.
    pub fn param(&self, name: &str, ty: TensorType, init: Init) -> Tensor<'_> {
        let name = self.qualified(name);
        let mut st = self.state.borrow_mut();
        let id = st.graph.add_input(name.clone(), InputKind::Param, ty);
        st.params.push(ParamSpec {
            name,
            value: id,
            init,
        });
        Tensor { tracer: self, id }
    }

    /// Applies `op` to `inputs` under the current scope and phase.
    pub fn op(&self, op: Op, inputs: &[Tensor<'_>]) -> Result<Vec<Tensor<'_>>, TypeError> {
        let mut st = self.state.borrow_mut();
        let meta = Meta::new(st.scope.join("."), st.phase);
        let ids = st
            .graph
            .push(op, inputs.iter().map(|t| t.id).collect(), meta)?;
        Ok(ids
            .into_iter()
            .map(|id| Tensor { tracer: self, id })
            .collect())
    }

    fn op1(&self, op: Op, inputs: &[Tensor<'_>]) -> Result<Tensor<'_>, TypeError> {
        Ok(self.op(op, inputs)?[0])
    }

    /// A constant tensor.
    pub fn full(&self, value: f64, shape: &[usize], dtype: DType) -> Result<Tensor<'_>, TypeError> {
        self.op1(
            Op::Full {
                value,
                shape: shape.to_vec(),
                dtype,
            },
            &[],
        )
    }

    /// Declares `value` as a graph output.
    pub fn output(&self, name: &str, value: Tensor<'_>) {
        self.state
            .borrow_mut()
            .graph
            .add_output(name, value.id, None);
    }

    /// Ends the trace; the graph is renumbered canonically (inputs first).
    pub fn finish(self) -> Traced {
        let st = self.state.into_inner();
        // Canonical renumbering moves value ids; keep parameter ids in step.
        let canonical = st.graph.canonical();
        let params = st
            .params
            .into_iter()
            .map(|p| {
                let value = canonical
                    .input_named(&p.name)
                    .map(|i| i.value)
                    .unwrap_or(p.value);
                ParamSpec { value, ..p }
            })
            .collect();
        Traced {
            graph: canonical,
            params,
        }
    }
}

type R<'t> = Result<Tensor<'t>, TypeError>;

// `add`, `mul`, ... return `Result` (a shape error names the module), which the std operator
// traits cannot express.
#[allow(clippy::should_implement_trait)]
impl<'t> Tensor<'t> {
    pub fn ty(&self) -> TensorType {
        self.tracer.state.borrow().graph.ty(self.id).clone()
    }

    pub fn shape(&self) -> Vec<usize> {
        self.ty().shape
    }

    pub fn dtype(&self) -> DType {
        self.ty().dtype
    }

    fn unary(self, u: UnaryOp) -> R<'t> {
        self.tracer.op1(Op::Unary(u), &[self])
    }

    fn binary(self, b: BinaryOp, other: Tensor<'t>) -> R<'t> {
        self.tracer.op1(Op::Binary(b), &[self, other])
    }

    pub fn neg(self) -> R<'t> {
        self.unary(UnaryOp::Neg)
    }
    pub fn exp(self) -> R<'t> {
        self.unary(UnaryOp::Exp)
    }
    pub fn log(self) -> R<'t> {
        self.unary(UnaryOp::Log)
    }
    pub fn sqrt(self) -> R<'t> {
        self.unary(UnaryOp::Sqrt)
    }
    pub fn rsqrt(self) -> R<'t> {
        self.unary(UnaryOp::Rsqrt)
    }
    pub fn silu(self) -> R<'t> {
        self.unary(UnaryOp::Silu)
    }
    pub fn square(self) -> R<'t> {
        self.unary(UnaryOp::Square)
    }
    pub fn add(self, other: Tensor<'t>) -> R<'t> {
        self.binary(BinaryOp::Add, other)
    }
    pub fn sub(self, other: Tensor<'t>) -> R<'t> {
        self.binary(BinaryOp::Sub, other)
    }
    pub fn mul(self, other: Tensor<'t>) -> R<'t> {
        self.binary(BinaryOp::Mul, other)
    }
    pub fn div(self, other: Tensor<'t>) -> R<'t> {
        self.binary(BinaryOp::Div, other)
    }
    pub fn maximum(self, other: Tensor<'t>) -> R<'t> {
        self.binary(BinaryOp::Max, other)
    }
    pub fn minimum(self, other: Tensor<'t>) -> R<'t> {
        self.binary(BinaryOp::Min, other)
    }
    pub fn compare(self, c: CompareOp, other: Tensor<'t>) -> R<'t> {
        self.tracer.op1(Op::Compare(c), &[self, other])
    }
    /// `self ? a : b` elementwise; `self` is bool.
    pub fn select(self, a: Tensor<'t>, b: Tensor<'t>) -> R<'t> {
        self.tracer.op1(Op::Select, &[self, a, b])
    }
    pub fn add_scalar(self, value: f64) -> R<'t> {
        self.tracer.op1(Op::AddScalar { value }, &[self])
    }
    pub fn mul_scalar(self, value: f64) -> R<'t> {
        self.tracer.op1(Op::MulScalar { value }, &[self])
    }
    pub fn cast(self, dtype: DType) -> R<'t> {
        self.tracer.op1(Op::Cast { dtype }, &[self])
    }
    pub fn sum(self, axes: &[usize], keepdim: bool) -> R<'t> {
        self.tracer.op1(
            Op::ReduceSum {
                axes: axes.to_vec(),
                keepdim,
            },
            &[self],
        )
    }
    pub fn reshape(self, shape: &[usize]) -> R<'t> {
        self.tracer.op1(
            Op::Reshape {
                shape: shape.to_vec(),
            },
            &[self],
        )
    }
    pub fn transpose(self, perm: &[usize]) -> R<'t> {
        self.tracer.op1(
            Op::Transpose {
                perm: perm.to_vec(),
            },
            &[self],
        )
    }
    pub fn expand(self, shape: &[usize]) -> R<'t> {
        self.tracer.op1(
            Op::Expand {
                shape: shape.to_vec(),
            },
            &[self],
        )
    }
    pub fn matmul(self, other: Tensor<'t>) -> R<'t> {
        self.tracer.op1(Op::Matmul, &[self, other])
    }
    /// `self @ weightᵀ` for a torch-layout weight `[out, in]`.
    pub fn linear(self, weight: Tensor<'t>) -> R<'t> {
        let wt = weight.transpose(&[1, 0])?;
        self.matmul(wt)
    }
    pub fn softmax(self, axis: usize) -> R<'t> {
        self.tracer.op1(Op::Softmax { axis }, &[self])
    }
    pub fn log_softmax(self, axis: usize) -> R<'t> {
        self.tracer.op1(Op::LogSoftmax { axis }, &[self])
    }
    pub fn rms_norm(self, weight: Tensor<'t>, eps: f64) -> R<'t> {
        self.tracer.op1(Op::RmsNorm { eps }, &[self, weight])
    }
    pub fn rope(self, theta: f64, layout: RopeLayout) -> R<'t> {
        self.tracer.op1(
            Op::Rope {
                theta,
                layout,
                inverse: false,
            },
            &[self],
        )
    }
    /// Attention of `self` as queries `[B, Hq, S, D]` over `k`, `v` `[B, Hkv, S, D]`.
    pub fn attention(self, k: Tensor<'t>, v: Tensor<'t>, causal: bool, scale: f64) -> R<'t> {
        self.tracer.op1(
            Op::Attention {
                causal,
                scale,
                stats: false,
            },
            &[self, k, v],
        )
    }
    /// Rows of `self` (an embedding table `[V, D]`) at `ids`.
    pub fn embedding(self, ids: Tensor<'t>) -> R<'t> {
        self.tracer.op1(Op::Embedding, &[self, ids])
    }
    /// `op` applied to `self` then `rest`, for ops without a method of their own (a frontend
    /// translating another framework's ops one by one).
    pub fn apply(self, op: Op, rest: &[Tensor<'t>]) -> R<'t> {
        let mut inputs = vec![self];
        inputs.extend_from_slice(rest);
        self.tracer.op1(op, &inputs)
    }
    /// Mean cross-entropy of `self` (logits `[N, V]`) against `targets` `[N]`.
    pub fn cross_entropy(self, targets: Tensor<'t>) -> R<'t> {
        self.tracer.op1(Op::CrossEntropy, &[self, targets])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nodes_carry_module_path_and_layer() {
        let tr = Tracer::new("t");
        let x = tr.input("x", TensorType::new(DType::F32, [2, 4]));
        let y = {
            let _l = tr.scope("layers");
            let _i = tr.scope(3);
            let _m = tr.scope("feed_forward");
            let w = tr.param("w1.weight", TensorType::new(DType::F32, [8, 4]), Init::Ones);
            x.linear(w).unwrap()
        };
        tr.output("y", y);
        let t = tr.finish();
        let last = t.graph.nodes.last().unwrap();
        assert_eq!(last.meta.module, "layers.3.feed_forward");
        assert_eq!(last.meta.layer, Some(3));
        assert_eq!(t.params[0].name, "layers.3.feed_forward.w1.weight");
        assert_eq!(
            t.graph
                .input_named("layers.3.feed_forward.w1.weight")
                .unwrap()
                .value,
            t.params[0].value
        );
    }

    #[test]
    fn shape_error_names_module_and_both_shapes() {
        let tr = Tracer::new("t");
        let x = tr.input("x", TensorType::new(DType::F32, [2, 4]));
        let _s = tr.scope("layers");
        let _i = tr.scope(0);
        let _a = tr.scope("attention");
        let w = tr.param("wq.weight", TensorType::new(DType::F32, [4, 5]), Init::Ones);
        let err = x.matmul(w.transpose(&[1, 0]).unwrap()).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("layers.0.attention"), "{msg}");
        assert!(
            msg.contains("f32[2,4]") && msg.contains("f32[5,4]"),
            "{msg}"
        );
    }
}
