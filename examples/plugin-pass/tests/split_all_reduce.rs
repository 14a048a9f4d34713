//! `split-all-reduce`, a plugin that rewrites collectives, through graphtrain's snapshot helper:
//! checked bitwise on every rank of the N-rank interpreter. And `silu-expand` on an SPMD graph.

use graphtrain_passes::testing::check;
use plugin_pass::{SiluExpand, SplitAllReduce};

/// DDP's gradient sums over dp_replicate: the first all-reduce splits; the second, whose rows do
/// not split over two ranks, is declined by name.
#[test]
fn splits_all_reduces_into_scatter_and_gather() {
    let out = check(
        &SplitAllReduce,
        "graph g {
  mesh dp_replicate=2
  input %x: f32[2,4] @ [shard(0)]
  param %w: f32[4,4] @ [replicate]
  %2: f32[2,4] = matmul(%x, %w)  # fwd layers.0.w
  %3: f32[4,2] = transpose(%x, perm=[1,0])  # bwd layers.0.w
  %4: f32[4,4] = matmul(%3, %2)  # bwd layers.0.w
  %5: f32[4,4] = all_reduce_start(%4, mesh_dims=[0], group=2, reduce=sum)  # bwd layers.0.w
  %6: f32[1,4] = reduce_sum(%2, axes=[0], keepdim=true)  # bwd layers.0.b
  %7: f32[1,4] = all_reduce_start(%6, mesh_dims=[0], group=2, reduce=sum)  # bwd layers.0.b
  %8: f32[4,4] = wait(%5)  # bwd layers.0.w
  %9: f32[1,4] = wait(%7)  # bwd layers.0.b
  output y = %2 @ [shard(0)]
  output gw = %8 @ [replicate]
  output gb = %9 @ [replicate]
}",
    );
    insta::assert_snapshot!(out);
}

/// A plugin that rebuilds the graph keeps its mesh and placements.
#[test]
fn silu_expand_keeps_an_spmd_graph_distributed() {
    let out = check(
        &SiluExpand,
        "graph g {
  mesh tp=2
  input %x: f32[2,4] @ [shard(1)]
  %1: f32[2,4] = silu(%x)  # fwd layers.0.feed_forward
  output y = %1 @ [shard(1)]
}",
    );
    assert!(
        out.contains("mesh tp=2") && out.contains("@ [shard(1)]"),
        "{out}"
    );
}
