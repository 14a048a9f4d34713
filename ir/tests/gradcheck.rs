//! Every gradient rule checked against central finite differences in f64.
//!
//! Each case is one op applied to seeded random inputs. The checked scalar is
//! `Σ_k sum(output_k * r_k)` with fixed random weights `r_k`, so every output element matters
//! with a distinct weight. A coverage test fails when an op with a gradient rule has no case, and
//! a sensitivity test breaks each rule on purpose (through `GradOptions::perturb_rule`) and
//! requires the check to fail.

use graphtrain_ir::autodiff::{grad_with, GradOptions};
use graphtrain_ir::interp::{run, HostTensor};
use graphtrain_ir::{
    rng, verify, BinaryOp, CompareOp, DType, Graph, InputKind, Meta, Op, RopeLayout, TensorType,
    UnaryOp, ValueId,
};

const F: DType = DType::F64;

/// How to fill a case input.
#[derive(Clone, Copy)]
enum Fill {
    /// N(0, 1), differentiated.
    Normal,
    /// Uniform in [lo, hi), differentiated.
    Range(f64, f64),
    /// Integers in 0..n, not differentiated.
    Index(usize),
    /// N(0, 1), not differentiated (a data input such as a weight that is held fixed).
    Fixed,
}

struct Case {
    name: String,
    graph: Graph,
    fills: Vec<Fill>,
    /// The op under test: the one whose rule the sensitivity test perturbs.
    op: Op,
}

fn case(name: &str, inputs: &[(TensorType, Fill)], op: Op) -> Case {
    let mut g = Graph::new(name);
    let ins: Vec<ValueId> = inputs
        .iter()
        .enumerate()
        .map(|(i, (t, _))| g.add_input(format!("x{i}"), InputKind::Data, t.clone()))
        .collect();
    let outs = g
        .push(op.clone(), ins, Meta::default())
        .unwrap_or_else(|e| panic!("case {name}: {e}"));
    for (k, o) in outs.iter().enumerate() {
        g.add_output(format!("y{k}"), *o, None);
    }
    Case {
        name: name.to_string(),
        graph: g,
        fills: inputs.iter().map(|(_, f)| *f).collect(),
        op,
    }
}

fn t(shape: &[usize]) -> TensorType {
    TensorType::new(F, shape.to_vec())
}

fn ti(shape: &[usize]) -> TensorType {
    TensorType::new(DType::I32, shape.to_vec())
}

fn all_cases() -> Vec<Case> {
    use Fill::*;
    let mut cases = Vec::new();
    for u in UnaryOp::ALL {
        let fill = match u {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt | UnaryOp::Recip => Range(0.5, 2.0),
            _ => Normal,
        };
        cases.push(case(u.name(), &[(t(&[3, 5]), fill)], Op::Unary(u)));
    }
    for b in BinaryOp::ALL {
        let (fa, fb) = match b {
            BinaryOp::Div => (Normal, Range(0.5, 2.0)),
            BinaryOp::Pow => (Range(0.5, 2.0), Range(-1.5, 1.5)),
            _ => (Normal, Normal),
        };
        cases.push(case(
            b.name(),
            &[(t(&[4, 3]), fa), (t(&[4, 3]), fb)],
            Op::Binary(b),
        ));
    }
    cases.push(case(
        "add_scalar",
        &[(t(&[5]), Normal)],
        Op::AddScalar { value: 0.7 },
    ));
    cases.push(case(
        "mul_scalar",
        &[(t(&[5]), Normal)],
        Op::MulScalar { value: -1.3 },
    ));
    cases.push(case(
        "pow_scalar",
        &[(t(&[5]), Range(0.5, 2.0))],
        Op::PowScalar { exponent: 2.5 },
    ));
    cases.push(case("cast", &[(t(&[2, 3]), Normal)], Op::Cast { dtype: F }));
    cases.push(case("offload", &[(t(&[2, 3]), Normal)], Op::Offload));
    cases.push(case("reload", &[(t(&[2, 3]), Normal)], Op::Reload));
    cases.push(case(
        "reduce_sum",
        &[(t(&[2, 3, 4]), Normal)],
        Op::ReduceSum {
            axes: vec![0, 2],
            keepdim: false,
        },
    ));
    cases.push(case(
        "reduce_max",
        &[(t(&[3, 5]), Normal)],
        Op::ReduceMax {
            axes: vec![1],
            keepdim: true,
        },
    ));
    cases.push(case(
        "reshape",
        &[(t(&[2, 6]), Normal)],
        Op::Reshape { shape: vec![3, 4] },
    ));
    cases.push(case(
        "transpose",
        &[(t(&[2, 3, 4]), Normal)],
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
    ));
    cases.push(case(
        "expand",
        &[(t(&[2, 1, 3]), Normal)],
        Op::Expand {
            shape: vec![2, 4, 3],
        },
    ));
    cases.push(case(
        "slice",
        &[(t(&[3, 7]), Normal)],
        Op::Slice {
            axis: 1,
            start: 2,
            end: 5,
        },
    ));
    cases.push(case(
        "concat",
        &[
            (t(&[2, 3]), Normal),
            (t(&[2, 1]), Normal),
            (t(&[2, 2]), Normal),
        ],
        Op::Concat { axis: 1 },
    ));
    cases.push(case(
        "gather",
        &[(t(&[4, 3]), Normal), (ti(&[6, 3]), Index(4))],
        Op::Gather { axis: 0 },
    ));
    cases.push(case(
        "scatter_add",
        &[
            (t(&[4, 3]), Normal),
            (ti(&[4, 5]), Index(3)),
            (t(&[4, 5]), Normal),
        ],
        Op::ScatterAdd { axis: 1 },
    ));
    cases.push(case(
        "matmul",
        &[(t(&[2, 3, 4]), Normal), (t(&[2, 4, 5]), Normal)],
        Op::Matmul,
    ));
    cases.push(case(
        "matmul_shared_rhs",
        &[(t(&[2, 3, 4]), Normal), (t(&[4, 5]), Normal)],
        Op::Matmul,
    ));
    cases.push(case(
        "embedding",
        &[(t(&[7, 3]), Normal), (ti(&[2, 4]), Index(7))],
        Op::Embedding,
    ));
    cases.push(case(
        "embedding_backward",
        &[(t(&[2, 4, 3]), Normal), (ti(&[2, 4]), Index(5))],
        Op::EmbeddingBackward { rows: 5 },
    ));
    cases.push(case(
        "rms_norm",
        &[(t(&[2, 3, 6]), Normal), (t(&[6]), Normal)],
        Op::RmsNorm { eps: 1e-5 },
    ));
    for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
        for inverse in [false, true] {
            cases.push(case(
                &format!("rope_{}_{inverse}", layout.name()),
                &[(t(&[2, 5, 2, 6]), Normal)],
                Op::Rope {
                    theta: 10000.0,
                    layout,
                    inverse,
                },
            ));
        }
    }
    for causal in [true, false] {
        cases.push(case(
            &format!("attention_gqa_causal_{causal}"),
            &[
                (t(&[2, 4, 5, 3]), Normal),
                (t(&[2, 2, 5, 3]), Normal),
                (t(&[2, 2, 5, 3]), Normal),
            ],
            Op::Attention { causal, scale: 0.6 },
        ));
    }
    cases.push(case(
        "softmax",
        &[(t(&[3, 5]), Normal)],
        Op::Softmax { axis: 1 },
    ));
    cases.push(case(
        "softmax_axis0",
        &[(t(&[3, 5]), Normal)],
        Op::Softmax { axis: 0 },
    ));
    cases.push(case(
        "log_softmax",
        &[(t(&[3, 5]), Normal)],
        Op::LogSoftmax { axis: 1 },
    ));
    cases.push(case(
        "cross_entropy",
        &[(t(&[6, 5]), Normal), (ti(&[6]), Index(5))],
        Op::CrossEntropy,
    ));

    // select: the condition comes from a compare of a fixed input, inside the same graph.
    let mut g = Graph::new("select");
    let c = g.add_input("x0", InputKind::Data, t(&[3, 4]));
    let a = g.add_input("x1", InputKind::Data, t(&[3, 4]));
    let b = g.add_input("x2", InputKind::Data, t(&[3, 4]));
    let zero = g
        .push1(
            Op::Full {
                value: 0.0,
                shape: vec![3, 4],
                dtype: F,
            },
            vec![],
            Meta::default(),
        )
        .unwrap();
    let cond = g
        .push1(Op::Compare(CompareOp::Gt), vec![c, zero], Meta::default())
        .unwrap();
    let y = g
        .push1(Op::Select, vec![cond, a, b], Meta::default())
        .unwrap();
    g.add_output("y0", y, None);
    cases.push(Case {
        name: "select".into(),
        graph: g,
        fills: vec![Fill::Fixed, Fill::Normal, Fill::Normal],
        op: Op::Select,
    });
    cases
}

/// Ops with no gradient rule: comparisons and sources have no differentiable operand, backward
/// and optimizer ops are not differentiated (no second order yet).
const NO_RULE: &[&str] = &[
    "eq",
    "ne",
    "lt",
    "le",
    "gt",
    "ge",
    "full",
    "iota",
    "random_uniform",
    "random_normal",
    "rms_norm_backward",
    "attention_backward",
    "cross_entropy_backward",
    "adamw",
    "sgd",
];

fn fill(f: Fill, ty: &TensorType, seed: u64) -> HostTensor {
    let n = ty.numel();
    let data = (0..n as u64)
        .map(|i| match f {
            Fill::Normal | Fill::Fixed => rng::normal(seed, 0, i),
            Fill::Range(lo, hi) => lo + (hi - lo) * rng::uniform(seed, 0, i),
            Fill::Index(k) => rng::below(seed, 0, i, k as u64) as f64,
        })
        .collect();
    HostTensor {
        ty: ty.clone(),
        data,
    }
}

/// Runs the gradcheck of one case; `Err` describes the first mismatch.
fn gradcheck(c: &Case, perturb: Option<f64>) -> Result<usize, String> {
    let mut g = c.graph.clone();
    let m = Meta::default();
    // loss = Σ_k sum(y_k * r_k)
    let outs: Vec<ValueId> = g.outputs.iter().map(|o| o.value).collect();
    g.outputs.clear();
    let mut loss = None;
    for (k, y) in outs.iter().enumerate() {
        let ty = g.ty(*y).clone();
        let r = g.add_input(format!("r{k}"), InputKind::Data, ty.clone());
        let p = g
            .push1(Op::Binary(BinaryOp::Mul), vec![*y, r], m.clone())
            .unwrap();
        let s = g
            .push1(
                Op::ReduceSum {
                    axes: (0..ty.rank()).collect(),
                    keepdim: false,
                },
                vec![p],
                m.clone(),
            )
            .unwrap();
        loss = Some(match loss {
            None => s,
            Some(l) => g
                .push1(Op::Binary(BinaryOp::Add), vec![l, s], m.clone())
                .unwrap(),
        });
    }
    let loss = loss.expect("every case has an output");
    let wrt: Vec<(usize, ValueId)> = c
        .fills
        .iter()
        .enumerate()
        .filter(|(_, f)| matches!(f, Fill::Normal | Fill::Range(..)))
        .map(|(i, _)| (i, g.inputs[i].value))
        .collect();
    let hook = move |op: &Op| perturb.filter(|_| op.name() == c.op.name());
    let opts = GradOptions {
        perturb_rule: Some(&hook),
    };
    let grads = grad_with(
        &mut g,
        loss,
        &wrt.iter().map(|w| w.1).collect::<Vec<_>>(),
        &opts,
    )
    .map_err(|e| format!("autodiff failed: {e}"))?;
    g.add_output("loss", loss, None);
    for (k, gr) in grads.iter().enumerate() {
        g.add_output(format!("grad{k}"), *gr, None);
    }
    verify(&g).map_err(|e| format!("gradient graph is invalid: {e}"))?;

    let mut inputs: Vec<HostTensor> = Vec::new();
    for (i, input) in g.inputs.iter().enumerate() {
        let f = c.fills.get(i).copied().unwrap_or(Fill::Fixed);
        inputs.push(fill(f, g.ty(input.value), 1000 + i as u64));
    }
    let base = run(&g, &inputs).map_err(|e| format!("run failed: {e}"))?;
    let loss_at = |inputs: &[HostTensor]| -> f64 {
        run(&g, inputs).expect("perturbed run").outputs[0].data[0]
    };

    let h = 1e-6;
    let mut checked = 0;
    for (k, (input_idx, _)) in wrt.iter().enumerate() {
        let analytic = &base.outputs[1 + k].data;
        for (e, &a) in analytic.iter().enumerate() {
            let x0 = inputs[*input_idx].data[e];
            inputs[*input_idx].data[e] = x0 + h;
            let up = loss_at(&inputs);
            inputs[*input_idx].data[e] = x0 - h;
            let down = loss_at(&inputs);
            inputs[*input_idx].data[e] = x0;
            let numeric = (up - down) / (2.0 * h);
            let tol = 1e-6 * (1.0 + numeric.abs().max(a.abs()));
            if (numeric - a).abs() > tol {
                return Err(format!(
                    "input x{input_idx} element {e}: analytic {a:.10} vs numeric {numeric:.10}"
                ));
            }
            checked += 1;
        }
    }
    Ok(checked)
}

#[test]
fn every_gradient_rule_matches_finite_differences() {
    let mut failures = Vec::new();
    for c in all_cases() {
        match gradcheck(&c, None) {
            Ok(n) => assert!(n > 0, "case {} checked nothing", c.name),
            Err(e) => failures.push(format!("{}: {e}", c.name)),
        }
    }
    assert!(
        failures.is_empty(),
        "gradcheck failures:\n{}",
        failures.join("\n")
    );
}

#[test]
fn a_broken_rule_is_caught() {
    // Scaling a rule's gradients by 1% must fail its gradcheck, for every case.
    let mut missed = Vec::new();
    for c in all_cases() {
        if gradcheck(&c, Some(1.01)).is_ok() {
            missed.push(c.name.clone());
        }
    }
    assert!(
        missed.is_empty(),
        "perturbed rules passed gradcheck: {missed:?}"
    );
}

#[test]
fn every_op_with_a_rule_has_a_case() {
    let covered: Vec<&str> = all_cases().iter().map(|c| c.op.name()).collect();
    let missing: Vec<&str> = Op::all_names()
        .into_iter()
        .filter(|n| !NO_RULE.contains(n) && !covered.contains(n))
        .collect();
    assert!(
        missing.is_empty(),
        "ops without a gradcheck case: {missing:?}"
    );
}
