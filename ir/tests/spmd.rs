//! SPMD graphs: the mesh and placements in the text format, the verifier's collective and
//! placement checks (each with the phrase its error must contain), collectives on the N-rank
//! interpreter against values worked out by hand, and every collective's gradient rule against
//! finite differences of the joint program (all ranks) in f64, with a planted wrong rule that
//! must fail.

use graphtrain_ir::autodiff::{grad_with, GradOptions};
use graphtrain_ir::interp::run_ranks;
use graphtrain_ir::mesh::{assemble, local_part};
use graphtrain_ir::{
    text, verify, DType, Graph, HostTensor, Mesh, Op, Placement, Placements, TensorType, ValueId,
};

const VALID: &str = "graph g {
  mesh dp_shard=2,tp=2
  input %x: f32[2,6] @ [shard(0), replicate]
  param %w: f32[3,4] @ [shard(0), replicate]
  %2: f32[6,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.mlp
  %3: f32[6,4] = wait(%2)  # fwd layers.0.mlp
  %4: f32[2,4] = matmul(%x, %3)  # fwd layers.0.mlp
  %5: f32[] = reduce_sum(%4, axes=[0,1], keepdim=false)  # loss
  %6: f32[] = all_reduce_start(%5, mesh_dims=[0], group=2, reduce=sum)  # loss
  %7: f32[] = wait(%6)  # loss
  output loss = %7 @ [replicate, replicate]
  output partial_loss = %5 @ [partial(sum), replicate]
}
";

fn check(src: &str) -> Result<Graph, String> {
    let g = text::parse(src).map_err(|e| format!("parse: {e}"))?;
    verify(&g).map_err(|e| e.to_string())?;
    Ok(g)
}

#[test]
fn the_valid_spmd_graph_passes_and_round_trips() {
    let g = check(VALID).unwrap();
    assert_eq!(g.mesh.as_ref().unwrap().to_string(), "dp_shard=2,tp=2");
    assert_eq!(text::print(&g), VALID);
    let again = text::parse(&text::print(&g)).unwrap();
    assert_eq!(again, g.canonical());
    let ron = graphtrain_ir::ron_io::to_ron(&g);
    assert_eq!(graphtrain_ir::ron_io::from_ron(&ron).unwrap(), g);
}

#[test]
fn each_broken_spmd_invariant_is_reported() {
    let cases: Vec<(&str, String, &[&str])> = vec![
        (
            "a start nothing waits for",
            VALID.replace("%3: f32[6,4] = wait(%2)", "%3: f32[6,4] = neg(%2)"),
            &["node 0", "all_gather_start", "exactly one `wait`"],
        ),
        (
            "a wait on a plain value",
            VALID.replace("  output loss", "  %8: f32[] = wait(%5)  # loss\n  output loss"),
            &["node 6", "no collective start produced"],
        ),
        (
            "a group that is not the mesh dims' size",
            VALID.replace("mesh_dims=[0], group=2, axis=0", "mesh_dims=[0,1], group=2, axis=0"),
            &["node 0", "group 2", "(4)"],
        ),
        (
            "an operand updated in place before its collective's wait",
            "graph g {
  mesh dp_shard=2
  param %w: f32[3,4] @ [shard(0)]
  input %lr: f32[]
  %2: f32[6,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd
  %3: f32[3,4] = full(value=1.0, shape=[3,4], dtype=f32)  # bwd
  %4: f32[3,4] = sgd(%w, %3, %lr, weight_decay=0.0)  # opt w
  %5: f32[6,4] = wait(%2)  # opt
  %6: f32[] = reduce_sum(%5, axes=[0,1], keepdim=false)  # opt
  output s = %6 @ [replicate]
  output w = %4 donates %w @ [shard(0)]
}
"
            .to_string(),
            &["node 3", "node 2 updates %0 in place", "wait before node 2"],
        ),
        (
            "a mesh dim outside the mesh",
            VALID.replace("mesh_dims=[0], group=2, axis=0", "mesh_dims=[2], group=2, axis=0"),
            &["node 0", "mesh dimension 2"],
        ),
        (
            "collectives without a mesh",
            VALID
                .replace("  mesh dp_shard=2,tp=2\n", "")
                .replace(" @ [shard(0), replicate]", "")
                .replace(" @ [replicate, replicate]", "")
                .replace(" @ [partial(sum), replicate]", ""),
            &["node 0", "without a mesh"],
        ),
        (
            "a placement without a mesh",
            "graph g {\n  input %x: f32[2] @ [replicate]\n  %1: f32[2] = neg(%x)  # fwd\n  output y = %1\n}\n".to_string(),
            &["`x` has a placement", "no mesh"],
        ),
        (
            "a partial parameter",
            VALID.replace(
                "param %w: f32[3,4] @ [shard(0), replicate]",
                "param %w: f32[3,4] @ [partial(sum), replicate]",
            ),
            &["`w`", "never partial"],
        ),
        (
            "a handle read as a tensor",
            VALID.replace("matmul(%x, %3)", "matmul(%x, %2)").replace(
                "%3: f32[6,4] = wait(%2)  # fwd layers.0.mlp\n",
                "%3: f32[6,4] = wait(%2)  # fwd layers.0.mlp\n  %99: f32[6,4] = neg(%3)  # fwd\n",
            ),
            &["exactly one `wait`"],
        ),
        (
            "a matmul of a sharded weight without its gather",
            VALID
                .replace(
                    "param %w: f32[3,4] @ [shard(0), replicate]",
                    "param %w: f32[6,4] @ [shard(1), replicate]",
                )
                .replace(
                    "  %2: f32[6,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.mlp\n  %3: f32[6,4] = wait(%2)  # fwd layers.0.mlp\n",
                    "",
                )
                .replace("matmul(%x, %3)", "matmul(%x, %w)"),
            &["matmul", "dp_shard", "redistribution"],
        ),
        (
            "a declared output placement the graph does not compute",
            VALID.replace(
                "output partial_loss = %5 @ [partial(sum), replicate]",
                "output partial_loss = %5 @ [replicate, replicate]",
            ),
            &["partial_loss", "declared [replicate, replicate]", "computes it [partial(sum), replicate]"],
        ),
        (
            "a reduction of a value that is not partial",
            VALID.replace("reduce_sum(%4, axes=[0,1]", "reduce_sum(%4, axes=[1]").replace(
                "%5: f32[] = reduce_sum",
                "%5: f32[2] = reduce_sum",
            ).replace("%6: f32[] = all_reduce", "%6: f32[2] = all_reduce").replace("%7: f32[] = wait", "%7: f32[2] = wait"),
            &["all_reduce_start", "sum reduction of a value placed shard(0)"],
        ),
    ];
    for (what, src, needles) in cases {
        let err = match check(&src) {
            Ok(_) => panic!("{what}: accepted\n{src}"),
            Err(e) => e,
        };
        for n in needles {
            assert!(err.contains(n), "{what}: `{n}` not in: {err}");
        }
    }
}

#[test]
fn meshes_and_placements_parse_or_say_why_not() {
    let m = Mesh::parse("dp_replicate=2, dp_shard=2,tp=2").unwrap();
    assert_eq!(m.world_size(), 8);
    assert_eq!(m.coords(5), vec![1, 0, 1]);
    assert_eq!(m.group(5, &[2]), vec![4, 5]);
    assert_eq!(m.group(5, &[0, 1]), vec![1, 3, 5, 7]);
    assert_eq!(m.group_index(5, &[0, 1]), 2);
    for (bad, needle) in [
        ("dp=2", "unknown mesh dimension `dp`"),
        ("tp=0", "at least 1"),
        ("tp=2,tp=2", "twice"),
        ("tp", "NAME=SIZE"),
        ("", "no dimensions"),
    ] {
        let e = Mesh::parse(bad).unwrap_err();
        assert!(e.contains(needle), "{bad}: {e}");
    }
    assert!(Placement::parse("shard(x)")
        .unwrap_err()
        .contains("shard(0)"));
    assert!(Placement::parse("partial(max)")
        .unwrap_err()
        .contains("sum"));
    let p = Placements(vec![Placement::Shard(0), Placement::Shard(0)]);
    let m = Mesh::parse("dp_shard=2,tp=3").unwrap();
    let e = p.local_shape(&m, &[8, 4]).unwrap_err();
    assert!(e.contains("does not split evenly 6 ways"), "{e}");
}

/// `local_part` and `assemble` are inverses, for shards over one or two mesh dims, replicas
/// and partial sums.
#[test]
fn local_parts_assemble_to_the_global_tensor() {
    let mesh = Mesh::parse("dp_shard=2,tp=2").unwrap();
    let global = HostTensor::from_fn(TensorType::new(DType::F64, [4, 6]), |i| i as f64 + 0.5);
    use Placement::*;
    for p in [
        vec![Shard(0), Replicate],
        vec![Replicate, Shard(1)],
        vec![Shard(0), Shard(0)],
        vec![Shard(1), Shard(0)],
        vec![Replicate, Replicate],
        vec![Partial(graphtrain_ir::Reduce::Sum), Shard(1)],
    ] {
        let p = Placements(p);
        let parts: Vec<HostTensor> = (0..4)
            .map(|r| local_part(&global, &p, &mesh, r).unwrap())
            .collect();
        let refs: Vec<&HostTensor> = parts.iter().collect();
        assert_eq!(assemble(&refs, &p, &mesh).unwrap(), global, "{p}");
    }
    // Shard(0) twice: the earlier mesh dim splits first, so rank 1 (dp 0, tp 1) has rows 1.
    let p = Placements(vec![Shard(0), Shard(0)]);
    let part = local_part(&global, &p, &mesh, 1).unwrap();
    assert_eq!(part.data[0], 6.5);
}

fn graph_of(src: &str) -> Graph {
    let g = text::parse(src).unwrap_or_else(|e| panic!("{e}\n{src}"));
    verify(&g).unwrap_or_else(|e| panic!("{e}\n{src}"));
    g
}

fn t(shape: &[usize], data: Vec<f64>) -> HostTensor {
    HostTensor::new(TensorType::new(DType::F64, shape.to_vec()), data).unwrap()
}

/// One collective over `dims` of `dp_shard=2,tp=2` on rank inputs `x_r` = `[r*10 + i]`.
fn run_collective(op: &str, attrs: &str, in_shape: &[usize], out_shape: &[usize]) -> Vec<Vec<f64>> {
    let shape = |s: &[usize]| {
        s.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    let src = format!(
        "graph c {{
  mesh dp_shard=2,tp=2
  input %x: f64[{}]
  %1: f64[{}] = {op}(%x, {attrs})  # fwd
  %2: f64[{}] = wait(%1)  # fwd
  output y = %2
}}
",
        shape(in_shape),
        shape(out_shape),
        shape(out_shape)
    );
    let g = text::parse(&src).unwrap();
    let n: usize = in_shape.iter().product();
    let inputs: Vec<Vec<HostTensor>> = (0..4)
        .map(|r| vec![t(in_shape, (0..n).map(|i| (r * 10 + i) as f64).collect())])
        .collect();
    let refs: Vec<&[HostTensor]> = inputs.iter().map(|v| v.as_slice()).collect();
    run_ranks(&g, &refs)
        .unwrap()
        .into_iter()
        .map(|o| o.outputs[0].data.clone())
        .collect()
}

#[test]
fn collectives_combine_the_group_in_rank_order() {
    // tp groups: {0,1} and {2,3}; dp_shard groups: {0,2} and {1,3}.
    let y = run_collective(
        "all_gather_start",
        "mesh_dims=[1], group=2, axis=0",
        &[2],
        &[4],
    );
    assert_eq!(y[0], vec![0.0, 1.0, 10.0, 11.0]);
    assert_eq!(y[3], vec![20.0, 21.0, 30.0, 31.0]);
    let y = run_collective(
        "all_gather_start",
        "mesh_dims=[0], group=2, axis=1",
        &[1, 2],
        &[1, 4],
    );
    assert_eq!(y[1], vec![10.0, 11.0, 30.0, 31.0]);
    let y = run_collective(
        "reduce_scatter_start",
        "mesh_dims=[1], group=2, axis=0, reduce=sum",
        &[4],
        &[2],
    );
    assert_eq!(y[0], vec![10.0, 12.0]);
    assert_eq!(y[1], vec![14.0, 16.0]);
    let y = run_collective(
        "all_reduce_start",
        "mesh_dims=[0,1], group=4, reduce=avg",
        &[2],
        &[2],
    );
    assert!(y.iter().all(|v| *v == vec![15.0, 16.0]), "{y:?}");
    let y = run_collective(
        "all_to_all_start",
        "mesh_dims=[1], group=2, split_axis=0, concat_axis=0",
        &[4],
        &[4],
    );
    assert_eq!(y[0], vec![0.0, 1.0, 10.0, 11.0]);
    assert_eq!(y[1], vec![2.0, 3.0, 12.0, 13.0]);
    let y = run_collective(
        "broadcast_start",
        "mesh_dims=[0], group=2, root=1",
        &[2],
        &[2],
    );
    assert_eq!(y[0], vec![20.0, 21.0]);
    assert_eq!(y[3], vec![30.0, 31.0]);
}

/// d/dx_r of Σ_r <w_r, y_r>, by central differences over every rank's every input element.
fn numeric_grad(g: &Graph, xs: &[HostTensor], ws: &[HostTensor]) -> Vec<Vec<f64>> {
    let objective = |xs: &[HostTensor]| -> f64 {
        let inputs: Vec<Vec<HostTensor>> = xs.iter().map(|x| vec![x.clone()]).collect();
        let refs: Vec<&[HostTensor]> = inputs.iter().map(|v| v.as_slice()).collect();
        let outs = run_ranks(g, &refs).unwrap();
        outs.iter()
            .zip(ws)
            .map(|(o, w)| {
                o.outputs[0]
                    .data
                    .iter()
                    .zip(&w.data)
                    .map(|(a, b)| a * b)
                    .sum::<f64>()
            })
            .sum()
    };
    let h = 1e-6;
    (0..xs.len())
        .map(|r| {
            (0..xs[r].data.len())
                .map(|i| {
                    let mut plus = xs.to_vec();
                    plus[r].data[i] += h;
                    let mut minus = xs.to_vec();
                    minus[r].data[i] -= h;
                    (objective(&plus) - objective(&minus)) / (2.0 * h)
                })
                .collect()
        })
        .collect()
}

/// The gradient autodiff builds for the same objective, run on the N-rank interpreter: the graph
/// gets an input `w` per rank and the loss Σ <w, y>; each rank's backward starts at 1.
fn autodiff_grad(src: &str, xs: &[HostTensor], ws: &[HostTensor], planted: bool) -> Vec<Vec<f64>> {
    let mut g = graph_of(src);
    let x = g.inputs[0].value;
    let y = g.outputs[0].value;
    let w = g.add_input("w", graphtrain_ir::InputKind::Data, g.ty(y).clone());
    let meta = graphtrain_ir::Meta::new("loss", graphtrain_ir::Phase::Loss);
    let prod = g
        .push1(
            Op::Binary(graphtrain_ir::BinaryOp::Mul),
            vec![y, w],
            meta.clone(),
        )
        .unwrap();
    let rank = g.ty(prod).rank();
    let loss = g
        .push1(
            Op::ReduceSum {
                axes: (0..rank).collect(),
                keepdim: false,
            },
            vec![prod],
            meta,
        )
        .unwrap();
    // The planted bug: every collective's input cotangent doubled.
    let hook = |g: &mut Graph,
                site: &graphtrain_ir::autodiff::RuleSite<'_>,
                cots: Vec<Option<ValueId>>|
     -> Result<Vec<Option<ValueId>>, graphtrain_ir::TypeError> {
        if !matches!(
            site.node.op,
            Op::CollectiveStart { .. } | Op::ToPartial { .. }
        ) {
            return Ok(cots);
        }
        cots.into_iter()
            .map(|c| {
                c.map(|c| g.push1(Op::MulScalar { value: 2.0 }, vec![c], site.meta.clone()))
                    .transpose()
            })
            .collect()
    };
    let opts = GradOptions {
        replace_rule: if planted { Some(&hook) } else { None },
        ..GradOptions::default()
    };
    let grads = grad_with(&mut g, loss, &[x], &opts).unwrap();
    g.outputs.clear();
    g.add_output("dx", grads[0], None);
    verify(&g).unwrap_or_else(|e| panic!("{e}\n{g}"));
    let inputs: Vec<Vec<HostTensor>> = xs
        .iter()
        .zip(ws)
        .map(|(x, w)| vec![x.clone(), w.clone()])
        .collect();
    let refs: Vec<&[HostTensor]> = inputs.iter().map(|v| v.as_slice()).collect();
    run_ranks(&g, &refs)
        .unwrap()
        .into_iter()
        .map(|o| o.outputs[0].data.clone())
        .collect()
}

fn max_error(a: &[Vec<f64>], b: &[Vec<f64>]) -> f64 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| {
            if x.is_nan() || y.is_nan() {
                f64::INFINITY
            } else {
                (x - y).abs() / y.abs().max(1.0)
            }
        })
        .fold(0.0, f64::max)
}

#[test]
fn collective_gradients_match_finite_differences_and_a_wrong_rule_fails() {
    let cases: [(&str, &str, &[usize], &[usize]); 7] = [
        (
            "all_gather_start",
            "mesh_dims=[1], group=2, axis=1",
            &[2, 3],
            &[2, 6],
        ),
        (
            "reduce_scatter_start",
            "mesh_dims=[0], group=2, axis=0, reduce=sum",
            &[4, 3],
            &[2, 3],
        ),
        (
            "reduce_scatter_start",
            "mesh_dims=[0,1], group=4, axis=1, reduce=avg",
            &[2, 4],
            &[2, 1],
        ),
        (
            "all_reduce_start",
            "mesh_dims=[0,1], group=4, reduce=sum",
            &[2, 3],
            &[2, 3],
        ),
        (
            "all_reduce_start",
            "mesh_dims=[1], group=2, reduce=avg",
            &[2, 3],
            &[2, 3],
        ),
        (
            "all_to_all_start",
            "mesh_dims=[1], group=2, split_axis=0, concat_axis=1",
            &[4, 3],
            &[2, 6],
        ),
        // Not a collective (no data moves, no wait), but an SPMD op with a rule all the same.
        ("to_partial", "mesh_dims=[0,1], group=4", &[2, 3], &[2, 3]),
    ];
    let dims = |s: &[usize]| {
        s.iter()
            .map(|d| d.to_string())
            .collect::<Vec<_>>()
            .join(",")
    };
    for (op, attrs, in_shape, out_shape) in cases {
        let src = if op == "to_partial" {
            format!(
                "graph c {{\n  mesh dp_shard=2,tp=2\n  input %x: f64[{}]\n  %1: f64[{}] = {op}(%x, {attrs})  # fwd\n  output y = %1\n}}\n",
                dims(in_shape),
                dims(out_shape),
            )
        } else {
            format!(
                "graph c {{\n  mesh dp_shard=2,tp=2\n  input %x: f64[{}]\n  %1: f64[{}] = {op}(%x, {attrs})  # fwd\n  %2: f64[{}] = wait(%1)  # fwd\n  output y = %2\n}}\n",
                dims(in_shape),
                dims(out_shape),
                dims(out_shape)
            )
        };
        let g = graph_of(&src);
        let n_in: usize = in_shape.iter().product();
        let n_out: usize = out_shape.iter().product();
        let xs: Vec<HostTensor> = (0..4)
            .map(|r| {
                t(
                    in_shape,
                    (0..n_in)
                        .map(|i| ((r * 7 + i * 3) % 11) as f64 * 0.3 - 1.0)
                        .collect(),
                )
            })
            .collect();
        let ws: Vec<HostTensor> = (0..4)
            .map(|r| {
                t(
                    out_shape,
                    (0..n_out)
                        .map(|i| ((r * 5 + i * 2) % 7) as f64 * 0.25 - 0.6)
                        .collect(),
                )
            })
            .collect();
        let numeric = numeric_grad(&g, &xs, &ws);
        let exact = autodiff_grad(&src, &xs, &ws, false);
        let err = max_error(&exact, &numeric);
        assert!(
            err < 1e-6,
            "{op} {attrs}: autodiff {exact:?} vs numeric {numeric:?}"
        );
        let wrong = autodiff_grad(&src, &xs, &ws, true);
        assert!(
            max_error(&wrong, &numeric) > 1e-3,
            "{op} {attrs}: the doubled rule passed"
        );
    }
}
