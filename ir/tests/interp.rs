//! The reference interpreter on hand-computed cases, finite-difference checks of the backward
//! composites, the memory accounting and every error path, plus a matmul throughput print.

use graphtrain_ir::interp::run;
use graphtrain_ir::{
    BinaryOp, DType, Graph, HostTensor, InputKind, Meta, Op, Phase, RopeLayout, TensorType,
    UnaryOp, ValueId,
};

fn meta() -> Meta {
    Meta::new("layers.0.test", Phase::Forward)
}

fn ty(dtype: DType, shape: &[usize]) -> TensorType {
    TensorType::new(dtype, shape.to_vec())
}

fn t64(shape: &[usize], data: &[f64]) -> HostTensor {
    HostTensor::new(ty(DType::F64, shape), data.to_vec()).expect("test data has the right length")
}

fn ids(shape: &[usize], data: &[i64]) -> HostTensor {
    let data = data.iter().map(|&v| v as f64).collect();
    HostTensor::new(ty(DType::I64, shape), data).expect("test data has the right length")
}

fn det(seed: u64, shape: &[usize]) -> HostTensor {
    HostTensor::from_fn(ty(DType::F64, shape), |i| {
        graphtrain_ir::rng::normal(seed, 1, i as u64)
    })
}

/// A graph with one node applying `op` to fresh inputs of the given types; every node output is
/// a graph output.
fn single(op: Op, input_types: &[TensorType]) -> Graph {
    let mut g = Graph::new("single");
    let ins: Vec<ValueId> = input_types
        .iter()
        .enumerate()
        .map(|(i, t)| g.add_input(format!("x{i}"), InputKind::Data, t.clone()))
        .collect();
    let outs = g.push(op, ins, meta()).expect("test graphs are well typed");
    for (i, o) in outs.into_iter().enumerate() {
        g.add_output(format!("y{i}"), o, None);
    }
    g
}

/// Runs `op` on `inputs` and returns its outputs.
fn apply(op: Op, inputs: &[HostTensor]) -> Vec<HostTensor> {
    let types: Vec<TensorType> = inputs.iter().map(|t| t.ty.clone()).collect();
    run(&single(op, &types), inputs)
        .expect("run succeeds")
        .outputs
}

fn apply1(op: Op, inputs: &[HostTensor]) -> HostTensor {
    apply(op, inputs).remove(0)
}

fn assert_close(got: &HostTensor, want: &[f64], tol: f64) {
    assert_eq!(got.data.len(), want.len(), "length of {:?}", got.data);
    for (i, (g, w)) in got.data.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * (1.0 + w.abs()),
            "element {i}: got {g}, want {w} (all: {:?})",
            got.data
        );
    }
}

#[test]
fn matmul_plain_batched_and_shared() {
    let a = t64(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    let b = t64(&[3, 2], &[7., 8., 9., 10., 11., 12.]);
    let c = apply1(Op::Matmul, &[a, b]);
    assert_eq!(c.shape(), &[2, 2]);
    assert_eq!(c.data, vec![58., 64., 139., 154.]);

    let a = t64(&[2, 1, 2], &[1., 2., 3., 4.]);
    let b = t64(&[2, 2, 1], &[5., 6., 7., 8.]);
    let c = apply1(Op::Matmul, &[a.clone(), b]);
    assert_eq!(c.shape(), &[2, 1, 1]);
    assert_eq!(c.data, vec![17., 53.]);

    let shared = t64(&[2, 2], &[1., 0., 0., 2.]);
    let c = apply1(Op::Matmul, &[a, shared]);
    assert_eq!(c.shape(), &[2, 1, 2]);
    assert_eq!(c.data, vec![1., 4., 3., 8.]);
}

#[test]
fn reductions_keepdim_empty_and_nan() {
    let x = t64(&[2, 3], &[1., 5., 3., -4., 2., 0.]);
    let keep = apply1(
        Op::ReduceSum {
            axes: vec![1],
            keepdim: true,
        },
        std::slice::from_ref(&x),
    );
    assert_eq!(keep.shape(), &[2, 1]);
    assert_eq!(keep.data, vec![9., -2.]);
    let cols = apply1(
        Op::ReduceMax {
            axes: vec![0],
            keepdim: false,
        },
        std::slice::from_ref(&x),
    );
    assert_eq!(cols.data, vec![1., 5., 3.]);
    let all = apply1(
        Op::ReduceSum {
            axes: vec![0, 1],
            keepdim: false,
        },
        &[x],
    );
    assert_eq!((all.shape().len(), all.data.clone()), (0, vec![7.]));

    let empty = apply1(
        Op::ReduceMax {
            axes: vec![1],
            keepdim: false,
        },
        &[t64(&[2, 0], &[])],
    );
    assert_eq!(empty.data, vec![f64::NEG_INFINITY; 2]);

    let with_nan = apply1(
        Op::ReduceMax {
            axes: vec![0],
            keepdim: false,
        },
        &[t64(&[3], &[1., f64::NAN, 2.])],
    );
    assert!(with_nan.data[0].is_nan());
}

#[test]
fn transpose_expand_slice_concat() {
    let x = t64(&[2, 3], &[1., 2., 3., 4., 5., 6.]);
    let xt = apply1(Op::Transpose { perm: vec![1, 0] }, std::slice::from_ref(&x));
    assert_eq!(xt.shape(), &[3, 2]);
    assert_eq!(xt.data, vec![1., 4., 2., 5., 3., 6.]);

    let y = t64(&[2, 1, 2], &[1., 2., 3., 4.]);
    let yt = apply1(
        Op::Transpose {
            perm: vec![2, 0, 1],
        },
        &[y],
    );
    assert_eq!(yt.shape(), &[2, 2, 1]);
    assert_eq!(yt.data, vec![1., 3., 2., 4.]);

    let col = t64(&[2, 1], &[1., 2.]);
    let e = apply1(Op::Expand { shape: vec![2, 3] }, &[col]);
    assert_eq!(e.data, vec![1., 1., 1., 2., 2., 2.]);
    let row = t64(&[1, 3], &[1., 2., 3.]);
    let e = apply1(Op::Expand { shape: vec![2, 3] }, &[row]);
    assert_eq!(e.data, vec![1., 2., 3., 1., 2., 3.]);

    let s = apply1(
        Op::Slice {
            axis: 1,
            start: 1,
            end: 3,
        },
        std::slice::from_ref(&x),
    );
    assert_eq!(
        (s.shape().to_vec(), s.data.clone()),
        (vec![2, 2], vec![2., 3., 5., 6.])
    );

    let other = t64(&[2, 1], &[7., 8.]);
    let c = apply1(Op::Concat { axis: 1 }, &[x.clone(), other]);
    assert_eq!(c.shape(), &[2, 4]);
    assert_eq!(c.data, vec![1., 2., 3., 7., 4., 5., 6., 8.]);
    let c = apply1(Op::Concat { axis: 0 }, &[x.clone(), x]);
    assert_eq!(c.data, vec![1., 2., 3., 4., 5., 6., 1., 2., 3., 4., 5., 6.]);
}

#[test]
fn gather_and_scatter_add() {
    let x = t64(&[2, 3], &[10., 11., 12., 20., 21., 22.]);
    let g = apply1(
        Op::Gather { axis: 1 },
        &[x.clone(), ids(&[2, 2], &[2, 0, 1, 1])],
    );
    assert_eq!(g.data, vec![12., 10., 21., 21.]);
    let g = apply1(
        Op::Gather { axis: 0 },
        &[x.clone(), ids(&[1, 3], &[1, 0, 1])],
    );
    assert_eq!(g.data, vec![20., 11., 22.]);

    // Repeated indices accumulate.
    let src = t64(&[2, 2], &[1., 2., 3., 4.]);
    let s = apply1(
        Op::ScatterAdd { axis: 1 },
        &[x.clone(), ids(&[2, 2], &[0, 0, 2, 1]), src],
    );
    assert_eq!(s.data, vec![13., 11., 12., 20., 25., 25.]);
    let s = apply1(
        Op::ScatterAdd { axis: 0 },
        &[x, ids(&[1, 3], &[1, 1, 0]), t64(&[1, 3], &[1., 1., 1.])],
    );
    assert_eq!(s.data, vec![10., 11., 13., 21., 22., 22.]);
}

#[test]
fn softmax_and_log_softmax() {
    let x = t64(&[2, 2], &[0., 3f64.ln(), 1000., 1000.]);
    let s = apply1(Op::Softmax { axis: 1 }, std::slice::from_ref(&x));
    assert_close(&s, &[0.25, 0.75, 0.5, 0.5], 1e-15);
    let ls = apply1(Op::LogSoftmax { axis: 1 }, std::slice::from_ref(&x));
    assert_close(
        &ls,
        &[0.25f64.ln(), 0.75f64.ln(), 0.5f64.ln(), 0.5f64.ln()],
        1e-15,
    );
    // Along axis 0 the pairs are (0, 1000) and (ln 3, 1000).
    let s0 = apply1(Op::Softmax { axis: 0 }, &[x]);
    assert_close(&s0, &[0.0, 0.0, 1.0, 1.0], 1e-15);
}

#[test]
fn cross_entropy_and_its_gradient() {
    let logits = t64(&[2, 2], &[0., 0., 3f64.ln(), 0.]);
    let targets = ids(&[2], &[1, 0]);
    // Row 0: uniform, loss ln 2. Row 1: softmax (3/4, 1/4), target 0, loss ln(4/3).
    let loss = apply1(Op::CrossEntropy, &[logits.clone(), targets.clone()]);
    assert_close(&loss, &[(2f64.ln() + (4.0f64 / 3.0).ln()) / 2.0], 1e-15);

    let g = HostTensor::scalar(DType::F64, 2.0);
    let grad = apply1(Op::CrossEntropyBackward, &[logits, targets, g]);
    assert_close(&grad, &[0.5, -0.5, -0.25, 0.25], 1e-15);
}

#[test]
fn embedding_and_its_gradient() {
    let w = t64(&[3, 2], &[0., 1., 10., 11., 20., 21.]);
    let e = apply1(Op::Embedding, &[w, ids(&[2, 2], &[2, 0, 2, 1])]);
    assert_eq!(e.shape(), &[2, 2, 2]);
    assert_eq!(e.data, vec![20., 21., 0., 1., 20., 21., 10., 11.]);

    let g = t64(&[3, 2], &[1., 2., 3., 4., 5., 6.]);
    let gw = apply1(
        Op::EmbeddingBackward { rows: 4 },
        &[g, ids(&[3], &[3, 0, 3])],
    );
    assert_eq!(gw.shape(), &[4, 2]);
    assert_eq!(gw.data, vec![3., 4., 0., 0., 0., 0., 6., 8.]);
}

#[test]
fn rms_norm_by_hand() {
    let x = t64(&[1, 2], &[3., 4.]);
    let w = t64(&[2], &[1., 2.]);
    let y = apply1(Op::RmsNorm { eps: 0.0 }, &[x, w]);
    let r = 1.0 / 12.5f64.sqrt();
    assert_close(&y, &[3.0 * r, 8.0 * r], 1e-15);
}

fn rope(layout: RopeLayout, inverse: bool) -> Op {
    Op::Rope {
        theta: 100.0,
        layout,
        inverse,
    }
}

#[test]
fn rope_rotates_known_pairs_and_inverse_undoes_it() {
    // B=1, S=2, H=1, D=4: pair 0 has frequency 1, pair 1 has 100^(-1/2) = 0.1.
    let x = t64(&[1, 2, 1, 4], &[1., 2., 3., 4., 1., 0., 1., 0.]);
    let (c1, s1) = (1f64.cos(), 1f64.sin());
    let (c2, s2) = (0.1f64.cos(), 0.1f64.sin());

    // Half layout pairs (0, 2) and (1, 3): at position 1, (1, 1) rotates by 1 and (0, 0) stays.
    let y = apply1(rope(RopeLayout::Half, false), std::slice::from_ref(&x));
    assert_close(&y, &[1., 2., 3., 4., c1 - s1, 0., s1 + c1, 0.], 1e-15);

    // Interleaved pairs (0, 1) and (2, 3): (1, 0) rotates by 1 and (1, 0) by 0.1.
    let y = apply1(
        rope(RopeLayout::Interleaved, false),
        std::slice::from_ref(&x),
    );
    assert_close(&y, &[1., 2., 3., 4., c1, s1, c2, s2], 1e-15);

    for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
        let x = det(3, &[2, 5, 3, 6]);
        let y = apply1(rope(layout, false), std::slice::from_ref(&x));
        let back = apply1(rope(layout, true), &[y]);
        assert!(back.max_abs_diff(&x) < 1e-14, "{layout:?}");
    }
}

fn attention(causal: bool, scale: f64) -> Op {
    Op::Attention {
        causal,
        scale,
        stats: false,
    }
}

#[test]
fn causal_attention_first_row_is_v0_and_rows_average_under_zero_scores() {
    let (q, k, v) = (
        det(1, &[1, 2, 3, 4]),
        det(2, &[1, 2, 3, 4]),
        det(3, &[1, 2, 3, 4]),
    );
    let out = apply1(attention(true, 0.5), &[q, k.clone(), v.clone()]);
    for h in 0..2 {
        for c in 0..4 {
            assert_eq!(out.get(&[0, h, 0, c]), v.get(&[0, h, 0, c]));
        }
    }
    // With scale 0 every score is 0: row i averages v_0..=v_i (causal) or all of v.
    let zeros = t64(&[1, 2, 3, 4], &[0.0; 24]);
    let causal = apply1(attention(true, 0.0), &[zeros.clone(), k.clone(), v.clone()]);
    let full = apply1(attention(false, 0.0), &[zeros, k, v.clone()]);
    for c in 0..4 {
        let vs: Vec<f64> = (0..3).map(|j| v.get(&[0, 1, j, c])).collect();
        assert!((causal.get(&[0, 1, 1, c]) - (vs[0] + vs[1]) / 2.0).abs() < 1e-15);
        assert!((full.get(&[0, 1, 0, c]) - (vs[0] + vs[1] + vs[2]) / 3.0).abs() < 1e-15);
    }
}

#[test]
fn grouped_query_heads_read_their_kv_head() {
    // One key per sequence: each query head returns its kv head's value. Hq=4, Hkv=2: heads 0 and
    // 1 read kv head 0, heads 2 and 3 read kv head 1.
    let q = det(1, &[2, 4, 1, 3]);
    let k = det(2, &[2, 2, 1, 3]);
    let v = det(3, &[2, 2, 1, 3]);
    let out = apply1(attention(false, 1.0), &[q, k, v.clone()]);
    for b in 0..2 {
        for h in 0..4 {
            for c in 0..3 {
                assert_eq!(
                    out.get(&[b, h, 0, c]),
                    v.get(&[b, h / 2, 0, c]),
                    "b {b} h {h}"
                );
            }
        }
    }
}

#[test]
fn adamw_first_step_matches_the_closed_form() {
    let (b1, b2, eps, wd, lr) = (0.9, 0.95, 1e-8, 0.1, 0.01);
    let p = t64(&[3], &[1.0, -2.0, 0.5]);
    let g = t64(&[3], &[0.3, -0.1, 0.0]);
    let zeros = t64(&[3], &[0.0; 3]);
    let outs = apply(
        Op::AdamW {
            beta1: b1,
            beta2: b2,
            eps,
            weight_decay: wd,
        },
        &[
            p.clone(),
            g.clone(),
            zeros.clone(),
            zeros,
            HostTensor::scalar(DType::F64, lr),
            HostTensor::scalar(DType::I64, 1.0),
        ],
    );
    // At step 1 the bias corrections cancel the (1 - beta) factors: the update is
    // lr * g / (|g| + eps) on top of the decay.
    let want_p: Vec<f64> = p
        .data
        .iter()
        .zip(&g.data)
        .map(|(p, g)| p * (1.0 - lr * wd) - lr * g / (g.abs() + eps))
        .collect();
    assert_close(&outs[0], &want_p, 1e-12);
    assert_close(
        &outs[1],
        &g.data.iter().map(|g| (1.0 - b1) * g).collect::<Vec<_>>(),
        1e-15,
    );
    assert_close(
        &outs[2],
        &g.data
            .iter()
            .map(|g| (1.0 - b2) * g * g)
            .collect::<Vec<_>>(),
        1e-15,
    );
}

#[test]
fn sgd_step() {
    let p = t64(&[2], &[1.0, -1.0]);
    let g = t64(&[2], &[0.5, 0.25]);
    let out = apply1(
        Op::Sgd { weight_decay: 0.1 },
        &[p, g, HostTensor::scalar(DType::F64, 0.5)],
    );
    assert_close(
        &out,
        &[1.0 - 0.5 * (0.5 + 0.1), -1.0 - 0.5 * (0.25 - 0.1)],
        1e-15,
    );
}

#[test]
fn outputs_round_to_their_dtype() {
    let a = HostTensor::new(ty(DType::F32, &[1]), vec![0.1]).expect("length 1");
    let b = HostTensor::new(ty(DType::F32, &[1]), vec![0.2]).expect("length 1");
    // Inputs are held rounded to f32...
    assert_eq!(a.data[0], 0.1f32 as f64);
    let sum = apply1(Op::Binary(BinaryOp::Add), &[a, b]);
    // ...and so is the result, unlike the f64 sum of the same two values.
    assert_eq!(sum.data[0], (0.1f32 + 0.2f32) as f64);
    assert_ne!(sum.data[0], 0.1f32 as f64 + 0.2f32 as f64);

    let e = apply1(
        Op::Unary(UnaryOp::Exp),
        &[HostTensor::scalar(DType::F32, 1.0)],
    );
    assert_eq!(e.data[0], std::f64::consts::E as f32 as f64);

    let x = t64(&[5], &[-1.7, -0.2, 0.0, 2.9, 1.0 + 1.0 / 512.0]);
    let cast = |dtype| apply1(Op::Cast { dtype }, std::slice::from_ref(&x)).data;
    assert_eq!(cast(DType::I64), vec![-1., 0., 0., 2., 1.]);
    assert_eq!(cast(DType::I32), vec![-1., 0., 0., 2., 1.]);
    assert_eq!(cast(DType::Bool), vec![1., 1., 0., 1., 1.]);
    // bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1.
    assert_eq!(cast(DType::BF16)[4], 1.0);

    // Integer arithmetic truncates toward zero.
    let i = ids(&[2], &[1, -1]);
    let half = apply1(Op::AddScalar { value: 0.5 }, &[i]);
    assert_eq!(half.data, vec![1., 0.]);
}

#[test]
fn sources_iota_full_random() {
    let iota = apply1(
        Op::Iota {
            shape: vec![2, 3],
            axis: 1,
            dtype: DType::I32,
        },
        &[],
    );
    assert_eq!(iota.data, vec![0., 1., 2., 0., 1., 2.]);
    let full = apply1(
        Op::Full {
            value: 2.5,
            shape: vec![2],
            dtype: DType::I64,
        },
        &[],
    );
    assert_eq!(full.data, vec![2., 2.]);

    let seed = HostTensor::scalar(DType::I64, -3.0);
    let u = apply1(
        Op::RandomUniform {
            shape: vec![4],
            dtype: DType::F64,
            stream: 9,
        },
        std::slice::from_ref(&seed),
    );
    let want: Vec<f64> = (0..4)
        .map(|i| graphtrain_ir::rng::uniform(-3i64 as u64, 9, i))
        .collect();
    assert_eq!(u.data, want);
    let n = apply1(
        Op::RandomNormal {
            shape: vec![3],
            dtype: DType::F64,
            stream: 2,
        },
        &[seed],
    );
    let want: Vec<f64> = (0..3)
        .map(|i| graphtrain_ir::rng::normal(-3i64 as u64, 2, i))
        .collect();
    assert_eq!(n.data, want);
}

#[test]
fn peak_bytes_counts_live_values_including_inputs() {
    // x -> a -> b -> c: at most two f64[4] are alive at once.
    let mut g = Graph::new("chain");
    let x = g.add_input("x", InputKind::Data, ty(DType::F64, &[4]));
    let neg = || Op::Unary(UnaryOp::Neg);
    let a = g.push1(neg(), vec![x], meta()).expect("typed");
    let b = g.push1(neg(), vec![a], meta()).expect("typed");
    let c = g.push1(neg(), vec![b], meta()).expect("typed");
    g.add_output("c", c, None);
    let out = run(&g, &[t64(&[4], &[1., 2., 3., 4.])]).expect("runs");
    assert_eq!(out.outputs[0].data, vec![-1., -2., -3., -4.]);
    assert_eq!(out.peak_bytes, 64);

    // x feeds both branches, so it stays alive beside a and b: three f32[4] at once; when x is
    // also a graph output it is never freed, and c makes four.
    for (keep_x, want) in [(false, 48), (true, 64)] {
        let mut g = Graph::new("diamond");
        let x = g.add_input("x", InputKind::Data, ty(DType::F32, &[4]));
        let a = g.push1(neg(), vec![x], meta()).expect("typed");
        let b = g
            .push1(Op::Unary(UnaryOp::Exp), vec![x], meta())
            .expect("typed");
        let c = g
            .push1(Op::Binary(BinaryOp::Add), vec![a, b], meta())
            .expect("typed");
        g.add_output("c", c, None);
        if keep_x {
            g.add_output("x", x, None);
        }
        let x_in = HostTensor::zeros(ty(DType::F32, &[4]));
        let out = run(&g, std::slice::from_ref(&x_in)).expect("runs");
        assert_eq!(out.peak_bytes, want, "keep_x {keep_x}");
        assert_eq!(out.outputs[0].data, vec![1.0; 4]);
        if keep_x {
            assert_eq!(out.outputs[1], x_in);
        }
    }
}

#[test]
fn bad_embedding_id_names_node_position_and_bound() {
    let mut g = Graph::new("emb");
    let w = g.add_input("w", InputKind::Param, ty(DType::F64, &[3, 2]));
    let i = g.add_input("ids", InputKind::Data, ty(DType::I64, &[2, 2]));
    let pre = g
        .push1(
            Op::Unary(UnaryOp::Neg),
            vec![w],
            Meta::new("pre", Phase::Forward),
        )
        .expect("typed");
    let e = g
        .push1(
            Op::Embedding,
            vec![pre, i],
            Meta::new("tok_embeddings", Phase::Forward),
        )
        .expect("typed");
    g.add_output("e", e, None);
    let err = run(
        &g,
        &[
            HostTensor::zeros(ty(DType::F64, &[3, 2])),
            ids(&[2, 2], &[0, 1, 2, 3]),
        ],
    )
    .expect_err("id 3 is out of range");
    assert_eq!(err.node, Some(1));
    assert_eq!(err.op, "embedding");
    assert_eq!(err.module, "tok_embeddings");
    let text = err.to_string();
    assert!(
        text.starts_with("node 1 (`tok_embeddings`, embedding): "),
        "{text}"
    );
    assert!(
        text.contains("id 3") && text.contains("[1, 1]") && text.contains("0..3"),
        "{text}"
    );

    let err = run(
        &g,
        &[
            HostTensor::zeros(ty(DType::F64, &[3, 2])),
            ids(&[2, 2], &[0, -1, 2, 2]),
        ],
    )
    .expect_err("negative id");
    assert!(
        err.to_string().contains("id -1 at position [0, 1]"),
        "{err}"
    );
}

#[test]
fn bad_gather_scatter_and_target_indices_are_errors() {
    let x = t64(&[2, 2], &[1., 2., 3., 4.]);
    let types = [x.ty.clone(), ty(DType::I64, &[2, 1])];
    let err = run(
        &single(Op::Gather { axis: 1 }, &types),
        &[x.clone(), ids(&[2, 1], &[1, 2])],
    )
    .expect_err("index 2 is out of range");
    assert!(
        err.message
            .contains("index 2 at position [1, 0] is out of range 0..2"),
        "{err}"
    );

    let types = [
        x.ty.clone(),
        ty(DType::I64, &[1, 2]),
        ty(DType::F64, &[1, 2]),
    ];
    let err = run(
        &single(Op::ScatterAdd { axis: 0 }, &types),
        &[x.clone(), ids(&[1, 2], &[5, 0]), t64(&[1, 2], &[1., 1.])],
    )
    .expect_err("index 5 is out of range");
    assert!(err.message.contains("index 5 at position [0, 0]"), "{err}");

    let types = [x.ty.clone(), ty(DType::I64, &[2])];
    let err =
        run(&single(Op::CrossEntropy, &types), &[x, ids(&[2], &[0, 7])]).expect_err("target 7");
    assert!(
        err.message
            .contains("target 7 at position [1] is out of range 0..2"),
        "{err}"
    );
}

#[test]
fn wrong_inputs_are_errors() {
    let g = single(Op::Unary(UnaryOp::Neg), &[ty(DType::F32, &[2])]);
    let err = run(&g, &[t64(&[2], &[1., 2.])]).expect_err("f64 given for f32");
    assert_eq!(err.node, None);
    assert_eq!(err.to_string(), "input `x0` must be f32[2], got f64[2]");

    let err = run(&g, &[HostTensor::zeros(ty(DType::F32, &[3]))]).expect_err("wrong shape");
    assert!(err.message.contains("must be f32[2], got f32[3]"), "{err}");

    let err = run(&g, &[]).expect_err("missing input");
    assert!(
        err.message.contains("takes 1 input(s) (x0), got 0"),
        "{err}"
    );

    let bad = HostTensor {
        ty: ty(DType::F32, &[2]),
        data: vec![1.0],
    };
    let err = run(&g, &[bad]).expect_err("short data");
    assert!(err.message.contains("holds 1 values"), "{err}");

    assert!(HostTensor::new(ty(DType::F64, &[2, 2]), vec![0.0; 3]).is_err());
}

#[test]
fn mistyped_graph_is_an_error_not_a_panic() {
    let mut g = Graph::new("mistyped");
    let x = g.add_input("x", InputKind::Data, ty(DType::F64, &[2]));
    let y = g.push_typed(
        Op::Unary(UnaryOp::Neg),
        vec![x],
        vec![ty(DType::F64, &[3])],
        meta(),
    );
    g.add_output("y", y[0], None);
    let err = run(&g, &[t64(&[2], &[1., 2.])]).expect_err("declared shape is wrong");
    assert_eq!(err.node, Some(0));
    assert!(err.message.contains("declares outputs (f64[3])"), "{err}");
}

// ---- finite-difference checks of the backward composites

/// `sum(f(x) * w)` for a fixed random weighting `w`, so its gradient w.r.t. the outputs is `w`.
fn probe(outs: &HostTensor, w: &HostTensor) -> f64 {
    outs.data.iter().zip(&w.data).map(|(a, b)| a * b).sum()
}

/// Checks `analytic` against central differences of `sum(forward(inputs)[0] * w)` with respect
/// to input `which`.
fn check_grad(
    forward: &Op,
    inputs: &[HostTensor],
    which: usize,
    w: &HostTensor,
    analytic: &HostTensor,
) {
    let h = 1e-6;
    for i in 0..inputs[which].data.len() {
        let mut plus = inputs.to_vec();
        plus[which].data[i] += h;
        let mut minus = inputs.to_vec();
        minus[which].data[i] -= h;
        let numeric = (probe(&apply1(forward.clone(), &plus), w)
            - probe(&apply1(forward.clone(), &minus), w))
            / (2.0 * h);
        let got = analytic.data[i];
        assert!(
            (numeric - got).abs() < 1e-6 * (1.0 + numeric.abs()),
            "{} input {which} element {i}: analytic {got}, numeric {numeric}",
            forward.name()
        );
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    for causal in [true, false] {
        let q = det(1, &[1, 4, 3, 2]);
        let k = det(2, &[1, 2, 3, 2]);
        let v = det(3, &[1, 2, 3, 2]);
        let dout = det(4, &[1, 4, 3, 2]);
        let scale = 0.7;
        let fwd = attention(causal, scale);
        // The probabilities softmaxed again, and rebuilt from the forward's statistics.
        let stats = apply(
            Op::Attention {
                causal,
                scale,
                stats: true,
            },
            &[q.clone(), k.clone(), v.clone()],
        )
        .swap_remove(1);
        for stats_in in [None, Some(stats)] {
            let mut ins = vec![q.clone(), k.clone(), v.clone(), dout.clone()];
            let op = Op::AttentionBackward {
                causal,
                scale,
                stats: stats_in.is_some(),
            };
            ins.extend(stats_in);
            let grads = apply(op, &ins);
            for (which, grad) in grads.iter().enumerate() {
                check_grad(&fwd, &[q.clone(), k.clone(), v.clone()], which, &dout, grad);
            }
        }
    }
}

/// The statistics output is each row's max scaled score and its sum of `exp(s - max)`, and
/// leaves the attention output as it was.
#[test]
fn attention_statistics_are_each_rows_max_and_sum() {
    let (q, k, v) = (
        det(1, &[1, 2, 3, 2]),
        det(2, &[1, 1, 3, 2]),
        det(3, &[1, 1, 3, 2]),
    );
    let scale = 0.7;
    let plain = apply1(attention(true, scale), &[q.clone(), k.clone(), v.clone()]);
    let outs = apply(
        Op::Attention {
            causal: true,
            scale,
            stats: true,
        },
        &[q.clone(), k.clone(), v],
    );
    assert_eq!(outs[0].data, plain.data);
    assert_eq!(outs[1].shape(), [1, 2, 3, 2]);
    for h in 0..2 {
        for i in 0..3 {
            let qi = &q.data[(h * 3 + i) * 2..][..2];
            let scores: Vec<f64> = (0..=i)
                .map(|j| scale * (qi[0] * k.data[2 * j] + qi[1] * k.data[2 * j + 1]))
                .collect();
            let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let sum: f64 = scores.iter().map(|s| (s - max).exp()).sum();
            let got = &outs[1].data[(h * 3 + i) * 2..][..2];
            assert_eq!(got[0], max, "head {h} row {i}: max");
            assert!(
                (got[1] - sum).abs() < 1e-14,
                "head {h} row {i}: sum {} vs {sum}",
                got[1]
            );
        }
    }
}

#[test]
fn rms_norm_backward_matches_finite_differences() {
    let x = det(1, &[3, 5]);
    let w = det(2, &[5]);
    let gy = det(3, &[3, 5]);
    let eps = 1e-3;
    let grads = apply(
        Op::RmsNormBackward { eps },
        &[x.clone(), w.clone(), gy.clone()],
    );
    check_grad(
        &Op::RmsNorm { eps },
        &[x.clone(), w.clone()],
        0,
        &gy,
        &grads[0],
    );
    check_grad(&Op::RmsNorm { eps }, &[x, w], 1, &gy, &grads[1]);
}

#[test]
fn cross_entropy_backward_matches_finite_differences() {
    let logits = det(1, &[3, 4]);
    let targets = ids(&[3], &[3, 0, 3]);
    let one = HostTensor::scalar(DType::F64, 1.0);
    let grad = apply1(
        Op::CrossEntropyBackward,
        &[logits.clone(), targets.clone(), one.clone()],
    );
    check_grad(&Op::CrossEntropy, &[logits, targets], 0, &one, &grad);
}

#[test]
fn inverse_rope_is_the_transpose_of_rope() {
    // Rope is a rotation, so its gradient is the inverse rotation: <rope(x), y> = <x, rope⁻¹(y)>.
    for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
        let x = det(1, &[2, 3, 2, 4]);
        let y = det(2, &[2, 3, 2, 4]);
        let lhs = probe(&apply1(rope(layout, false), std::slice::from_ref(&x)), &y);
        let rhs = probe(&x, &apply1(rope(layout, true), &[y]));
        assert!((lhs - rhs).abs() < 1e-12, "{layout:?}: {lhs} vs {rhs}");
    }
}

// ---- throughput

#[test]
fn matmul_throughput() {
    for (m, k, n) in [(512, 512, 512), (2048, 256, 768)] {
        let g = single(
            Op::Matmul,
            &[ty(DType::F64, &[m, k]), ty(DType::F64, &[k, n])],
        );
        let inputs = [det(1, &[m, k]), det(2, &[k, n])];
        run(&g, &inputs).expect("warm-up run");
        let reps = 3;
        let start = std::time::Instant::now();
        for _ in 0..reps {
            run(&g, &inputs).expect("runs");
        }
        let secs = start.elapsed().as_secs_f64() / reps as f64;
        let gflops = 2.0 * (m * k * n) as f64 / secs / 1e9;
        eprintln!(
            "matmul {m}x{k}x{n} f64: {:.2} ms, {gflops:.1} GFLOP/s",
            secs * 1e3
        );
    }
}
