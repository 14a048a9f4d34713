//! The simulator (`graphtrain::sim`): its cost model on Programs small enough to work out by
//! hand, its lanes (communication overlapped or exposed), the cluster's shape, and the CLI.
//! How close it comes to measured steps is a benchmark (docs/benchmarks.md), not a test.

use graphtrain::sim::hardware::Hardware;
use graphtrain::sim::{lower_for, simulate, LinkSpec, Links, Prediction};
use graphtrain::trainer::build_spmd_step;
use graphtrain_ir::optim::OptimConfig;
use graphtrain_ir::{text, Graph, Mesh};
use graphtrain_lowering::Program;
use graphtrain_models::Llama3Config;
use graphtrain_passes::parallelize::Plan;
use graphtrain_passes::{Pipeline, PipelineSpec, Registry};

/// A made-up GPU with round figures, so that expected times are easy to write down.
fn round_gpu() -> Hardware {
    Hardware::parse(
        "(name: \"round\", kind: Gpu, peak_gflops_f32: 1000.0, peak_gflops_bf16: 4000.0,
          memory_gbps: 100.0, memory_gib: 1.0, launch_us: 10.0,
          efficiency: (matmul: 0.5, attention: 0.25, memory: 0.5), gpus_per_node: 2,
          intra_node: (gbps: 10.0, latency_us: 5.0), inter_node: (gbps: 1.0, latency_us: 50.0),
          host_link: (gbps: 1.0, latency_us: 0.0))",
        "round",
    )
    .unwrap()
}

fn none() -> Pipeline {
    Pipeline::new(Vec::new())
}

/// `g` lowered without passes and simulated on `round_gpu`'s own links, one node.
fn on_round_gpu(g: &Graph) -> (Program, Prediction) {
    let hw = round_gpu();
    let program = lower_for(g, &none(), &hw).unwrap();
    let p = simulate(&program, &hw, Links::Hardware, 1).unwrap();
    (program, p)
}

fn pipeline(list: &str) -> Pipeline {
    PipelineSpec::parse_list(list)
        .unwrap()
        .build(&Registry::builtin())
        .unwrap()
}

// A GEMM bound by FLOPs and an add bound by bytes, each timed as the roofline says plus its
// launch.
#[test]
fn a_step_costs_its_launch_plus_its_roofline() {
    let g = text::parse(
        "graph g {
  input %a: f32[256,512]
  input %b: f32[512,128]
  %2: f32[256,128] = matmul(%a, %b)
  %3: f32[256,128] = exp(%2)
  output o = %3
}",
    )
    .unwrap();
    let (_, p) = on_round_gpu(&g);
    let matmul = 2.0 * 256.0 * 512.0 * 128.0 / (1000e9 * 0.5);
    let bytes = 4.0 * (256.0 * 512.0 + 512.0 * 128.0 + 256.0 * 128.0);
    assert!(
        matmul > bytes / (100e9 * 0.5),
        "the GEMM is compute-bound here"
    );
    let exp = 2.0 * 4.0 * 256.0 * 128.0 / (100e9 * 0.5);
    let want = matmul + exp + 2.0 * 10e-6;
    assert_eq!(p.steps, 2);
    assert!((p.step_s - want).abs() < 1e-12, "{} vs {want}", p.step_s);
    assert_eq!(p.exposed_comm_s, 0.0);
}

// bf16-mixed's products run at the bf16 rate whatever their result is stored as: a weight
// gradient's product (`xᵀ dy`, its casts to bf16 folded into it, as it rounds its operands as it
// reads them) is written through its widening cast and transpose straight into the f32 layout
// that reads it, so the one step writes an f32 value and is still a bf16 product.
#[test]
fn a_bf16_product_costs_the_bf16_rate() {
    let g = text::parse(
        "graph g {
  input %x: f32[1024,512]
  input %dy: f32[1024,512]
  %2: bf16[1024,512] = cast(%x, dtype=bf16)
  %3: bf16[1024,512] = cast(%dy, dtype=bf16)
  %4: bf16[512,1024] = transpose(%2, perm=[1,0])
  %5: bf16[512,512] = matmul(%4, %3)
  %6: f32[512,512] = cast(%5, dtype=f32)
  %7: f32[512,512] = transpose(%6, perm=[1,0])
  output o = %7
}",
    )
    .unwrap();
    let (program, p) = on_round_gpu(&g);
    let matmul = 2.0 * 512.0 * 1024.0 * 512.0 / (4000e9 * 0.5);
    let bytes = 4.0 * (512.0 * 1024.0 + 1024.0 * 512.0 + 512.0 * 512.0);
    assert!(
        matmul > bytes / (100e9 * 0.5),
        "the GEMM is compute-bound here"
    );
    assert_eq!(
        p.steps, 1,
        "the casts and the transpose folded into the product:\n{program}"
    );
    let want = matmul + 10e-6;
    assert!((p.step_s - want).abs() < 1e-12, "{} vs {want}", p.step_s);
}

/// The time `p` spent on attention, seconds.
fn attention_s(p: &Prediction) -> f64 {
    p.by_kind
        .iter()
        .find(|(kind, _)| kind == "attention")
        .map(|(_, s)| *s)
        .expect("an attention step")
}

// bf16-mixed's attention (bf16 casts of f32 q, k and v, folded into it) runs its products at the
// bf16 peak, at the `attention_bf16` share of it where the hardware gives one and at the
// `attention` share where it does not; an f32 attention stays at the f32 rate.
#[test]
fn bf16_attention_costs_the_bf16_rate() {
    let attention = |bf16: bool| {
        let body = if bf16 {
            "  %3: bf16[2,4,256,64] = cast(%q, dtype=bf16)
  %4: bf16[2,4,256,64] = cast(%k, dtype=bf16)
  %5: bf16[2,4,256,64] = cast(%v, dtype=bf16)
  %6: bf16[2,4,256,64] = attention(%3, %4, %5, causal=true, scale=0.125)
  %7: f32[2,4,256,64] = cast(%6, dtype=f32)
  output o = %7"
        } else {
            "  %3: f32[2,4,256,64] = attention(%q, %k, %v, causal=true, scale=0.125)
  output o = %3"
        };
        text::parse(&format!(
            "graph g {{
  input %q: f32[2,4,256,64]
  input %k: f32[2,4,256,64]
  input %v: f32[2,4,256,64]
{body}
}}"
        ))
        .unwrap()
    };
    // Causal: half of the two products' 4·B·H·S²·D.
    let flops = 4.0 * 2.0 * 4.0 * 256.0 * 256.0 * 64.0 / 2.0;
    let close = |got: f64, want: f64| (got - want).abs() < 1e-12 * want.max(1.0);

    let (_, f32_run) = on_round_gpu(&attention(false));
    let want = flops / (1000e9 * 0.25);
    assert!(close(attention_s(&f32_run), want), "{f32_run:?}");

    let bf16 = attention(true);
    let (program, bf16_run) = on_round_gpu(&bf16);
    assert!(
        program
            .steps
            .iter()
            .any(|s| matches!(s, graphtrain_lowering::Step::Attention { bf16: true, .. })),
        "a bf16 attention step:\n{program}"
    );
    let want = flops / (4000e9 * 0.25);
    assert!(close(attention_s(&bf16_run), want), "{bf16_run:?}");

    let mut hw = round_gpu();
    hw.efficiency.attention_bf16 = Some(0.5);
    let hw = Hardware::parse(&hw.to_ron(), "round with attention_bf16").unwrap();
    assert_eq!(hw.efficiency.attention_bf16, Some(0.5), "it round-trips");
    let program = lower_for(&bf16, &none(), &hw).unwrap();
    let p = simulate(&program, &hw, Links::Hardware, 1).unwrap();
    let want = flops / (4000e9 * 0.5);
    assert!(close(attention_s(&p), want), "{p:?}");
}

fn tiny_on(mesh: &str) -> graphtrain_ir::Graph {
    let tiny = Llama3Config::builtin("tiny").unwrap();
    let mesh = Mesh::parse(mesh).unwrap();
    build_spmd_step(&tiny, &mesh, &Plan::llama(&mesh), &OptimConfig::default())
        .unwrap()
        .step
        .graph
}

// With every wait right after its start (no passes) the whole link time is exposed; `prefetch`
// moves starts earlier and the compute lane waits less, never more. A slow link makes the step
// longer by what is exposed.
#[test]
fn waits_expose_what_compute_does_not_hide() {
    let g = tiny_on("dp_shard=2");
    let hw = round_gpu();
    let slow = Links::Every(LinkSpec {
        gbps: 0.001,
        latency_us: 100.0,
    });
    let plain = simulate(&lower_for(&g, &none(), &hw).unwrap(), &hw, slow, 1).unwrap();
    assert!(plain.collectives > 0);
    assert!(
        plain.exposed_comm_s > 0.9 * plain.comm_s,
        "{} of {}",
        plain.exposed_comm_s,
        plain.comm_s
    );
    let overlapped = simulate(
        &lower_for(&g, &pipeline("prefetch=nodes:32"), &hw).unwrap(),
        &hw,
        slow,
        1,
    )
    .unwrap();
    assert!(
        overlapped.exposed_comm_s < plain.exposed_comm_s,
        "prefetch hid nothing: {} vs {}",
        overlapped.exposed_comm_s,
        plain.exposed_comm_s
    );
    let fast = Links::Every(LinkSpec {
        gbps: 1000.0,
        latency_us: 0.0,
    });
    let quick = simulate(&lower_for(&g, &none(), &hw).unwrap(), &hw, fast, 1).unwrap();
    assert!(plain.step_s - quick.step_s > 0.9 * (plain.exposed_comm_s - quick.exposed_comm_s));
}

// Groups inside a node use the intra-node link, groups across nodes the inter-node one; a mesh
// larger than the nodes hold is refused.
#[test]
fn the_cluster_shape_picks_links_and_refuses_what_does_not_fit() {
    let hw = round_gpu(); // 2 devices per node
    let g = tiny_on("dp_shard=2,tp=2");
    let program = lower_for(&g, &none(), &hw).unwrap();
    let e = simulate(&program, &hw, Links::Hardware, 1).unwrap_err();
    assert!(e.contains("4 ranks") && e.contains("--nodes 2"), "{e}");
    // tp (the last dimension) stays inside a node, dp_shard crosses nodes: slower than the
    // same mesh with every group inside a node.
    let across = simulate(&program, &hw, Links::Hardware, 2).unwrap();
    let inside = simulate(&program, &hw, Links::Every(hw.intra_node), 2).unwrap();
    assert!(across.comm_s > inside.comm_s, "{across:?} vs {inside:?}");
}

#[test]
fn offload_costs_the_host_link_on_a_gpu() {
    let tiny = Llama3Config::builtin("tiny").unwrap();
    let g =
        graphtrain::trainer::build_step(&tiny, graphtrain_ir::DType::F32, &OptimConfig::default())
            .unwrap()
            .step
            .graph;
    let hw = round_gpu();
    let plain = simulate(
        &lower_for(&g, &none(), &hw).unwrap(),
        &hw,
        Links::Hardware,
        1,
    )
    .unwrap();
    let program = lower_for(&g, &pipeline("offload=min_bytes:1024"), &hw).unwrap();
    let off = simulate(&program, &hw, Links::Hardware, 1).unwrap();
    assert!(off.host_bytes > 0 && off.arena_bytes < plain.arena_bytes);
    let host = off.by_kind.iter().find(|(k, _)| k == "host").unwrap().1;
    assert!(host > 0.0 && off.step_s > plain.step_s);
}

// The simulated run is a timeline like a recorded one: compute events one after another,
// one communication event per collective, all inside the step; written as a Chrome trace it
// reads back with both lanes.
#[test]
fn the_simulated_step_is_a_timeline_and_a_chrome_trace() {
    use graphtrain_runtime::timeline::{COMMUNICATION, KERNELS};
    let g = tiny_on("dp_shard=2");
    let hw = round_gpu();
    let program = lower_for(&g, &pipeline("prefetch=nodes:32"), &hw).unwrap();
    let p = simulate(&program, &hw, Links::Hardware, 1).unwrap();
    let lane = |l: u32| {
        p.timeline
            .events
            .iter()
            .filter(move |e| e.lane == l)
            .collect::<Vec<_>>()
    };
    assert_eq!(lane(COMMUNICATION).len(), p.collectives);
    let compute = lane(KERNELS);
    assert!(!compute.is_empty());
    for w in compute.windows(2) {
        assert!(w[0].start + w[0].duration <= w[1].start + std::time::Duration::from_nanos(1));
    }
    for e in &p.timeline.events {
        assert!(e.start + e.duration <= p.timeline.total + std::time::Duration::from_nanos(1));
    }
    let path = std::env::temp_dir().join(format!("graphtrain-sim-{}.json", std::process::id()));
    graphtrain::timeline::write_chrome_trace(&path, &p.timeline, 0, 1).unwrap();
    let back = graphtrain::timeline::read_trace(&path).unwrap();
    assert_eq!(back.events.len(), p.timeline.events.len());
    assert_eq!(back.lanes(), vec![KERNELS as u64, COMMUNICATION as u64]);
    std::fs::remove_file(path).ok();
}
