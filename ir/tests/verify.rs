//! The verifier on small graphs in text form: one valid graph, then one broken invariant per case,
//! each with the phrase its error must contain and the node it must name.

use graphtrain_ir::{
    text, verify, DType, Graph, InputKind, Meta, Op, TensorType, UnaryOp, ValueId,
};

const VALID: &str = "graph g {
  input %x: f32[2,3]
  param %w: f32[3,3]
  state %m: f32[3,3]
  input %lr: f32[]
  %4: f32[2,3] = matmul(%x, %w)  # fwd layers.0.mlp
  %5: f32[] = reduce_sum(%4, axes=[0,1], keepdim=false)  # loss
  %6: f32[3,3] = full(value=1.0, shape=[3,3], dtype=f32)  # bwd
  %7: f32[3,3] = sgd(%w, %6, %lr, weight_decay=0.0)  # opt w
  %8: f32[3,3] = add(%m, %6)  # opt w
  output loss = %5
  output w = %7 donates %w
  output m = %8 donates %m
}
";

fn check(text_src: &str) -> Result<(), String> {
    let g = text::parse(text_src).map_err(|e| format!("parse: {e}"))?;
    verify(&g).map_err(|e| e.to_string())
}

#[test]
fn the_valid_graph_passes() {
    check(VALID).unwrap();
}

#[test]
fn each_broken_invariant_is_reported() {
    let cases: &[(&str, String, &[&str])] = &[
        (
            "declared type disagrees with the op",
            VALID.replace("%4: f32[2,3] = matmul", "%4: f32[2,4] = matmul"),
            &[
                "node 0",
                "matmul",
                "layers.0.mlp",
                "declared f32[2,4]",
                "produces f32[2,3]",
            ],
        ),
        (
            "operand shapes refused",
            VALID.replace("input %x: f32[2,3]", "input %x: f32[2,5]"),
            &[
                "node 0",
                "matmul",
                "layers.0.mlp",
                "f32[2,5]",
                "f32[3,3]",
                "5 vs 3",
            ],
        ),
        (
            "wrong operand count",
            VALID.replace("matmul(%x, %w)", "matmul(%x)"),
            &["node 0", "takes 2 operand(s), got 1"],
        ),
        (
            "phase goes backwards",
            VALID.replace("dtype=f32)  # bwd", "dtype=f32)  # fwd"),
            &["node 2", "a `fwd` node comes after a `loss` node"],
        ),
        (
            "a micro-batch goes backwards",
            VALID
                .replace("# fwd layers.0.mlp", "# fwd layers.0.mlp micro=1")
                .replace("keepdim=false)  # loss", "keepdim=false)  # loss micro=0"),
            &[
                "node 1",
                "a `loss` node comes after a `fwd` node of micro-batch 1",
            ],
        ),
        (
            "donating a data input",
            VALID.replace("donates %m", "donates %x"),
            &["donates `x`, a data input"],
        ),
        (
            "donating to a different type",
            VALID
                .replace(
                    "state %m: f32[3,3]",
                    "state %m: f32[3,3]\n  state %n: f32[3]",
                )
                .replace("donates %m", "donates %n"),
            &["different type"],
        ),
        (
            "donating twice",
            VALID.replace("donates %m", "donates %w"),
            &["`w` is donated twice"],
        ),
        (
            "reading a donated input after its replacement is written",
            VALID.replace("%8: f32[3,3] = add(%m, %6)", "%8: f32[3,3] = add(%w, %6)"),
            &[
                "node 4",
                "reads `w` after node 3 wrote its donated replacement",
            ],
        ),
        (
            "a donated input also returned",
            VALID.replace("output loss = %5", "output loss = %5\n  output raw = %w"),
            &["also returned"],
        ),
    ];
    for (name, src, needles) in cases {
        let err = check(src).expect_err(name);
        for n in *needles {
            assert!(err.contains(n), "{name}: `{n}` missing from: {err}");
        }
    }
}

#[test]
fn use_before_definition_is_reported_for_built_graphs() {
    // The parser refuses unknown names itself, so build the out-of-order graph directly.
    let mut g = Graph::new("g");
    let x = g.add_input("x", InputKind::Data, TensorType::new(DType::F32, [4]));
    let later = ValueId(2);
    g.push_typed(
        Op::Unary(UnaryOp::Exp),
        vec![later],
        vec![TensorType::new(DType::F32, [4])],
        Meta::new("layers.1.act", graphtrain_ir::Phase::Forward),
    );
    g.push_typed(
        Op::Unary(UnaryOp::Exp),
        vec![x],
        vec![TensorType::new(DType::F32, [4])],
        Meta::default(),
    );
    let err = verify(&g).unwrap_err().to_string();
    assert!(
        err.contains("node 0")
            && err.contains("layers.1.act")
            && err.contains("used before it is defined"),
        "{err}"
    );
}

#[test]
fn duplicate_names_are_reported() {
    let mut g = Graph::new("g");
    g.add_input("x", InputKind::Data, TensorType::scalar(DType::F32));
    g.add_input("x", InputKind::Data, TensorType::scalar(DType::F32));
    assert!(verify(&g)
        .unwrap_err()
        .to_string()
        .contains("input `x` is declared twice"));
}

#[test]
fn the_dataflow_view_is_acyclic_and_follows_the_schedule() {
    let g = text::parse(VALID).unwrap();
    let df = g.dataflow();
    assert!(!petgraph::algo::is_cyclic_directed(&df));
    for e in df.edge_indices() {
        let (a, b) = df.edge_endpoints(e).unwrap();
        assert!(df[a] < df[b], "edge against the schedule");
    }
    // matmul -> reduce_sum, full -> sgd, full -> add
    assert_eq!(df.edge_count(), 3);
}
