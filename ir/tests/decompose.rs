//! Every composite against its decomposition through the reference interpreter: same outputs to
//! 1e-10 on f64 graphs (odd sizes, GQA, both rope layouts, causal and not), no composite left, and
//! graph structure (inputs, outputs, donations) preserved.

use graphtrain_ir::decompose::decompose;
use graphtrain_ir::interp::run;
use graphtrain_ir::{
    DType, Graph, HostTensor, InputKind, Meta, Op, Phase, RopeLayout, TensorType, ValueId,
};

fn ty(dtype: DType, shape: &[usize]) -> TensorType {
    TensorType::new(dtype, shape.to_vec())
}

fn normal(seed: u64, dtype: DType, shape: &[usize]) -> HostTensor {
    HostTensor::from_fn(ty(dtype, shape), |i| {
        graphtrain_ir::rng::normal(seed, 7, i as u64)
    })
}

fn randn(seed: u64, shape: &[usize]) -> HostTensor {
    normal(seed, DType::F64, shape)
}

fn int_ids(seed: u64, dtype: DType, shape: &[usize], bound: u64) -> HostTensor {
    HostTensor::from_fn(ty(dtype, shape), |i| {
        graphtrain_ir::rng::below(seed, 3, i as u64, bound) as f64
    })
}

fn scalar(dtype: DType, v: f64) -> HostTensor {
    HostTensor::scalar(dtype, v)
}

/// A graph applying `op` to inputs of the given tensors' types, every output a graph output.
fn single(op: &Op, inputs: &[HostTensor]) -> Graph {
    let mut g = Graph::new(op.name());
    let ins: Vec<ValueId> = inputs
        .iter()
        .enumerate()
        .map(|(i, t)| g.add_input(format!("x{i}"), InputKind::Data, t.ty.clone()))
        .collect();
    let outs = g
        .push(op.clone(), ins, Meta::new("layers.1.block", Phase::Forward))
        .expect("test graphs are well typed");
    for (i, o) in outs.into_iter().enumerate() {
        g.add_output(format!("y{i}"), o, None);
    }
    g
}

fn assert_outputs_close(what: &str, a: &[HostTensor], b: &[HostTensor], tol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: output count");
    for (k, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.ty, y.ty, "{what}: output {k} type");
        for (i, (p, q)) in x.data.iter().zip(&y.data).enumerate() {
            assert!(
                (p - q).abs() <= tol * (1.0 + p.abs()),
                "{what}: output {k} element {i}: composite {p}, decomposed {q}"
            );
        }
    }
}

/// Decomposes a one-node graph of `op` fully and checks it against the composite.
fn check_with(op: Op, inputs: &[HostTensor], tol: f64) {
    let what = format!("{op:?}");
    let g = single(&op, inputs);
    let d = decompose(&g, &|_| true).expect("decomposes");
    let left: Vec<&str> = d
        .nodes
        .iter()
        .filter(|n| n.op.is_composite())
        .map(|n| n.op.name())
        .collect();
    assert!(left.is_empty(), "{what}: composites left: {left:?}");
    assert!(d.is_canonical(), "{what}: result is not canonical");
    assert!(
        d.nodes.iter().all(|n| n.meta == g.nodes[0].meta),
        "{what}: meta not copied"
    );
    let want = run(&g, inputs).expect("composite runs");
    let got = run(&d, inputs).expect("decomposition runs");
    assert_outputs_close(&what, &want.outputs, &got.outputs, tol);
}

fn check(op: Op, inputs: &[HostTensor]) {
    check_with(op, inputs, 1e-10);
}

#[test]
fn embedding_and_backward() {
    for dtype in [DType::I64, DType::I32] {
        let ids = int_ids(1, dtype, &[2, 3], 7);
        check(Op::Embedding, &[randn(2, &[7, 5]), ids.clone()]);
        check(
            Op::EmbeddingBackward { rows: 7 },
            &[randn(3, &[2, 3, 5]), ids],
        );
    }
    // Repeated ids accumulate.
    let ids = HostTensor::new(ty(DType::I64, &[4]), vec![1.0, 1.0, 0.0, 1.0]).expect("4 ids");
    check(Op::EmbeddingBackward { rows: 3 }, &[randn(4, &[4, 3]), ids]);
}

#[test]
fn rms_norm_and_backward() {
    for shape in [vec![2, 3, 5], vec![5]] {
        let eps = 1e-5;
        let (x, w, gy) = (randn(1, &shape), randn(2, &[5]), randn(3, &shape));
        check(Op::RmsNorm { eps }, &[x.clone(), w.clone()]);
        check(Op::RmsNormBackward { eps }, &[x, w, gy]);
    }
}

#[test]
fn rope_both_layouts_and_inverse() {
    for layout in [RopeLayout::Half, RopeLayout::Interleaved] {
        for inverse in [false, true] {
            let op = Op::Rope {
                theta: 10000.0,
                layout,
                inverse,
            };
            check(op, &[randn(1, &[2, 5, 3, 6])]);
        }
    }
}

#[test]
fn attention_and_backward_with_gqa() {
    // (B, Hq, Hkv, S, D): grouped heads, plain heads, and a single query position.
    for (b, hq, hkv, s, d) in [(2, 4, 2, 5, 3), (1, 3, 3, 4, 2), (1, 2, 1, 1, 4)] {
        for causal in [true, false] {
            let scale = 1.0 / (d as f64).sqrt();
            let q = randn(1, &[b, hq, s, d]);
            let k = randn(2, &[b, hkv, s, d]);
            let v = randn(3, &[b, hkv, s, d]);
            let dout = randn(4, &[b, hq, s, d]);
            check(
                Op::Attention {
                    causal,
                    scale,
                    stats: false,
                },
                &[q.clone(), k.clone(), v.clone()],
            );
            let with_stats = Op::Attention {
                causal,
                scale,
                stats: true,
            };
            check(with_stats.clone(), &[q.clone(), k.clone(), v.clone()]);
            let stats = run(
                &single(&with_stats, &[q.clone(), k.clone(), v.clone()]),
                &[q.clone(), k.clone(), v.clone()],
            )
            .expect("runs")
            .outputs
            .swap_remove(1);
            for stats_in in [None, Some(stats)] {
                let op = Op::AttentionBackward {
                    causal,
                    scale,
                    stats: stats_in.is_some(),
                };
                let mut ins = vec![q.clone(), k.clone(), v.clone(), dout.clone()];
                ins.extend(stats_in);
                check(op, &ins);
            }
        }
    }
}

#[test]
fn softmax_and_log_softmax_on_every_axis() {
    let x = randn(1, &[3, 4, 5]);
    for axis in 0..3 {
        check(Op::Softmax { axis }, std::slice::from_ref(&x));
        check(Op::LogSoftmax { axis }, std::slice::from_ref(&x));
    }
}

#[test]
fn cross_entropy_and_backward() {
    let logits = randn(1, &[5, 7]);
    let targets = int_ids(2, DType::I64, &[5], 7);
    check(Op::CrossEntropy, &[logits.clone(), targets.clone()]);
    check(
        Op::CrossEntropyBackward,
        &[logits, targets, scalar(DType::F64, 0.7)],
    );
}

#[test]
fn bad_target_still_fails_after_decomposition() {
    let logits = randn(1, &[2, 3]);
    let targets = HostTensor::new(ty(DType::I64, &[2]), vec![0.0, 3.0]).expect("2 targets");
    let g = single(&Op::CrossEntropy, &[logits.clone(), targets.clone()]);
    let d = decompose(&g, &|_| true).expect("decomposes");
    let err = run(&d, &[logits, targets]).expect_err("target 3 is out of range");
    assert!(
        err.message.contains("3") && err.message.contains("0..3"),
        "{err}"
    );
}

fn adamw_op() -> Op {
    Op::AdamW {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
    }
}

fn adamw_inputs(step: HostTensor) -> Vec<HostTensor> {
    let v = HostTensor::from_fn(ty(DType::F64, &[3, 4]), |i| {
        graphtrain_ir::rng::uniform(4, 0, i as u64) * 0.01
    });
    vec![
        randn(1, &[3, 4]),
        randn(2, &[3, 4]),
        randn(3, &[3, 4]),
        v,
        scalar(DType::F64, 1e-2),
        step,
    ]
}

#[test]
fn optimizers() {
    check(adamw_op(), &adamw_inputs(scalar(DType::I64, 3.0)));
    check(adamw_op(), &adamw_inputs(scalar(DType::F64, 1.0)));
    check(
        Op::Sgd { weight_decay: 0.01 },
        &[
            randn(1, &[3, 4]),
            randn(2, &[3, 4]),
            scalar(DType::F64, 0.1),
        ],
    );
}

#[test]
fn f32_graphs_agree_to_f32_precision() {
    let f32n = |seed, shape: &[usize]| normal(seed, DType::F32, shape);
    let (q, k, v) = (
        f32n(1, &[1, 4, 6, 8]),
        f32n(2, &[1, 2, 6, 8]),
        f32n(3, &[1, 2, 6, 8]),
    );
    check_with(
        Op::Attention {
            causal: true,
            scale: 0.35,
            stats: false,
        },
        &[q, k, v],
        1e-5,
    );
    check_with(
        Op::RmsNorm { eps: 1e-6 },
        &[f32n(4, &[3, 8]), f32n(5, &[8])],
        1e-5,
    );
    let rope = Op::Rope {
        theta: 500000.0,
        layout: RopeLayout::Interleaved,
        inverse: false,
    };
    check_with(rope, &[f32n(6, &[1, 9, 2, 8])], 1e-5);
}

#[test]
fn picking_a_subset_keeps_the_rest_and_the_graph_structure() {
    // An optimizer step with donated buffers, an attention and a cross-entropy: decomposing only
    // attention leaves its softmax and the other composites alone.
    let mut g = Graph::new("step");
    let meta = |m: &str| Meta::new(m, Phase::Forward);
    let q = g.add_input("q", InputKind::Data, ty(DType::F64, &[1, 2, 3, 4]));
    let kv = g.add_input("kv", InputKind::Param, ty(DType::F64, &[1, 1, 3, 4]));
    let m = g.add_input("kv_m", InputKind::State, ty(DType::F64, &[1, 1, 3, 4]));
    let v = g.add_input("kv_v", InputKind::State, ty(DType::F64, &[1, 1, 3, 4]));
    let lr = g.add_input("lr", InputKind::Data, ty(DType::F64, &[]));
    let step = g.add_input("step", InputKind::Data, ty(DType::I64, &[]));
    let attn = Op::Attention {
        causal: true,
        scale: 0.5,
        stats: false,
    };
    let out = g
        .push1(attn, vec![q, kv, kv], meta("layers.0.attention"))
        .expect("typed");
    let sm = g
        .push1(Op::Softmax { axis: 3 }, vec![out], meta("head"))
        .expect("typed");
    let upd = g
        .push(adamw_op(), vec![kv, kv, m, v, lr, step], meta("optimizer"))
        .expect("typed");
    g.add_output("probs", sm, None);
    g.add_output("kv", upd[0], Some(kv));
    g.add_output("kv_m", upd[1], Some(m));
    g.add_output("kv_v", upd[2], Some(v));

    let d = decompose(&g, &|op| matches!(op, Op::Attention { .. })).expect("decomposes");
    let hist = d.op_histogram();
    let count = |name: &str| hist.iter().find(|(n, _)| *n == name).map_or(0, |(_, c)| *c);
    assert_eq!(count("attention"), 0);
    assert_eq!(
        count("softmax"),
        2,
        "attention's own softmax plus the head's"
    );
    assert_eq!(count("adamw"), 1);
    assert!(d.is_canonical());
    assert_eq!(d.inputs.len(), g.inputs.len());
    for (a, b) in d.inputs.iter().zip(&g.inputs) {
        assert_eq!(
            (&a.name, a.kind, d.ty(a.value)),
            (&b.name, b.kind, g.ty(b.value))
        );
    }
    let names: Vec<&str> = d.outputs.iter().map(|o| o.name.as_str()).collect();
    assert_eq!(names, ["probs", "kv", "kv_m", "kv_v"]);
    for o in &d.outputs[1..] {
        let donated = d
            .input_named(&o.name)
            .expect("donation target exists")
            .value;
        assert_eq!(o.donates, Some(donated), "{}", o.name);
    }
    assert!(
        d.nodes
            .iter()
            .filter(|n| n.meta.module == "layers.0.attention")
            .count()
            > 5
    );

    let inputs = vec![
        randn(1, &[1, 2, 3, 4]),
        randn(2, &[1, 1, 3, 4]),
        randn(3, &[1, 1, 3, 4]),
        HostTensor::full(ty(DType::F64, &[1, 1, 3, 4]), 0.5),
        scalar(DType::F64, 0.01),
        scalar(DType::I64, 2.0),
    ];
    let want = run(&g, &inputs).expect("runs");
    let got = run(&d, &inputs).expect("runs");
    assert_outputs_close("subset", &want.outputs, &got.outputs, 1e-10);

    let full = decompose(&g, &|_| true).expect("decomposes");
    assert!(full.nodes.iter().all(|n| !n.op.is_composite()));
    let got = run(&full, &inputs).expect("runs");
    assert_outputs_close("full", &want.outputs, &got.outputs, 1e-10);
}
