//! `gather_bf16`: FSDP under mixed precision gathers each weight as bf16, not f32 (torchtitan's
//! `param_dtype=bfloat16`): half the bytes on a network. MPI and emulated links carry a bf16
//! element in 2 bytes; the threads launcher copies, and NCCL moves, its 4-byte slot.
//!
//! `parallelize` gathers a sharded parameter where it is read, and under `bf16-mixed` the reader
//! is autocast's cast of the weight to bf16 for its matmul: the f32 weight crosses the network
//! and each rank rounds the gathered copy. Rounding is elementwise, so rounding the shard first
//! and gathering the rounded values gives every rank the same bits, in half the bytes where the
//! transport carries bf16 as 2 bytes.
//!
//! Changes: an all-gather of an f32 value whose result is read only by casts to bf16 (directly
//! or through transposes and reshapes, as a Linear's weight is) gathers the bf16 cast of its
//! operand instead (a cast of the shard before the start); the layout ops between run on the
//! bf16 values, the casts are gone and their readers read what the casts would have given.
//! Guarantees: tier 1: the same bits on every rank (`round(concat(x)) == concat(round(x))`);
//! the starts and waits keep their places, so overlap passes see the same schedule. A block's
//! parameter shards (same layer and phase) are cast together where its first gather starts,
//! so `bucket` can still merge the block's gathers; other operands are cast in place.
//! Declines: without a mesh; gathers whose result has a reader other than a cast to bf16 (a
//! norm's weight, read in f32) or is a graph output; gathers of non-f32 values. Gradients are
//! untouched: their reduce-scatters stay f32 (torchtitan's `reduce_dtype`).

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::rebuild::Rebuild;
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::{Collective, DType, Graph, Op};

pub const INFO: PassInfo = PassInfo {
    name: "gather_bf16",
    tier: Tier::Preserving,
    summary: "gather weights that are only read as bf16 as bf16 (half the bytes over MPI and links)",
    contract: "An all-gather of an f32 value whose every reader is a cast to bf16 (a weight \
gathered for mixed precision's matmuls) gathers the bf16 cast of its shard instead, and the \
readers of the casts read the gathered bf16 (through the transposes and reshapes between). Tier 1: the same bits (rounding is elementwise). \
Declines without a mesh and for gathers with any other reader; reduce-scatters stay f32.",
    option_help: None,
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| match option {
        None => Ok(Box::new(GatherBf16)),
        Some(o) => Err(format!("gather_bf16 takes no option (got `{o}`)")),
    });
}

pub struct GatherBf16;

/// What happens to a node of the input graph.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Kept,
    /// The start of a gather that moves bf16 from now on.
    Start,
    /// Its wait, whose result is bf16 now.
    Wait,
    /// A cast to bf16 of such a gather's result: dropped, its value is the new result.
    Cast,
    /// A transpose or reshape between the result and its casts: the same op on bf16 now.
    Layout,
}

/// Whether every reader of `v` is a cast to bf16, or a transpose or reshape whose readers all
/// are (`v` not an output); if so, `marks` gets what becomes of each of them (on `false` it
/// holds partial marks, which the caller drops).
fn read_only_as_bf16(
    g: &Graph,
    users: &[Vec<usize>],
    v: graphtrain_ir::ValueId,
    marks: &mut Vec<(usize, Role)>,
) -> bool {
    let readers = &users[v.index()];
    if readers.is_empty() || g.outputs.iter().any(|o| o.value == v) {
        return false;
    }
    readers.iter().all(|&r| match &g.nodes[r].op {
        Op::Cast { dtype: DType::BF16 } => {
            marks.push((r, Role::Cast));
            true
        }
        Op::Transpose { .. } | Op::Reshape { .. } => {
            marks.push((r, Role::Layout));
            read_only_as_bf16(g, users, g.nodes[r].outputs[0], marks)
        }
        _ => false,
    })
}

impl Pass for GatherBf16 {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        if g.mesh.is_none() {
            report.decline(None, "", "the graph has no mesh, so nothing is gathered");
            return Ok((g.clone(), report));
        }
        let users = g.users();
        let mut role = vec![Role::Kept; g.nodes.len()];
        let (mut sites, mut f32_readers, mut bytes_before) = (0usize, 0usize, 0usize);
        for (i, node) in g.nodes.iter().enumerate() {
            let Op::CollectiveStart {
                collective: Collective::AllGather { .. },
                ..
            } = &node.op
            else {
                continue;
            };
            if g.ty(node.inputs[0]).dtype != DType::F32 {
                continue;
            }
            let wait = match users[node.outputs[0].index()].as_slice() {
                [w] if g.nodes[*w].op == Op::Wait => *w,
                _ => continue,
            };
            let result = g.nodes[wait].outputs[0];
            let mut marks = Vec::new();
            if !read_only_as_bf16(g, &users, result, &mut marks) {
                f32_readers += 1;
                continue;
            }
            for (r, m) in marks {
                role[r] = m;
            }
            role[i] = Role::Start;
            role[wait] = Role::Wait;
            sites += 1;
            bytes_before += g.ty(result).size_bytes();
        }
        if f32_readers > 0 {
            report.decline(
                None,
                "",
                format!("{f32_readers} gathered f32 values are read as f32 (or are outputs)"),
            );
        }
        if sites == 0 {
            if f32_readers == 0 {
                report.decline(None, "", "no all-gather of an f32 value");
            }
            return Ok((g.clone(), report));
        }
        // A parameter's shard is cast where its block's (layer and stage) first such gather
        // starts, with the block's other parameters: FSDP unshards a module's parameters
        // together, and `bucket` merges a block's gathers only where every operand is ready
        // at the first. Other operands (sequence parallelism's activations) are cast in place.
        let producers = g.producers();
        let is_input = |v: graphtrain_ir::ValueId| producers[v.index()].is_none();
        let block = |n: &graphtrain_ir::graph::Node| (n.meta.layer, n.meta.stage());
        let mut cast_of: Vec<Option<graphtrain_ir::ValueId>> = vec![None; g.nodes.len()];
        let mut rb = Rebuild::of(g, INFO.name);
        for (i, node) in g.nodes.iter().enumerate() {
            rb.enter(&node.meta);
            match role[i] {
                Role::Kept => rb.keep(node),
                Role::Start => {
                    if cast_of[i].is_none() && is_input(node.inputs[0]) {
                        for (j, later) in g.nodes.iter().enumerate().skip(i) {
                            if role[j] == Role::Start
                                && block(later) == block(node)
                                && is_input(later.inputs[0])
                            {
                                let shard = rb.map[later.inputs[0].index()];
                                let low = Op::Cast { dtype: DType::BF16 };
                                cast_of[j] = Some(rb.add(low, vec![shard], &later.meta)?);
                            }
                        }
                    }
                    let low = match cast_of[i] {
                        Some(low) => low,
                        None => {
                            let shard = rb.map[node.inputs[0].index()];
                            rb.add(Op::Cast { dtype: DType::BF16 }, vec![shard], &node.meta)?
                        }
                    };
                    let start = rb.add(node.op.clone(), vec![low], &node.meta)?;
                    rb.map[node.outputs[0].index()] = start;
                }
                Role::Wait | Role::Layout => {
                    let operand = rb.map[node.inputs[0].index()];
                    let result = rb.add(node.op.clone(), vec![operand], &node.meta)?;
                    rb.map[node.outputs[0].index()] = result;
                }
                Role::Cast => {
                    // The wait before it holds the bf16 values already.
                    rb.map[node.outputs[0].index()] = rb.map[node.inputs[0].index()];
                }
            }
        }
        let out = rb.finish();
        report.change(format!(
            "{sites} all-gathers move bf16 instead of f32: {} -> {} bytes gathered per step over MPI \
or an emulated link (the threads launcher and NCCL still copy 4-byte slots)",
            bytes_before,
            bytes_before / 2
        ));
        report.metric("gather_bf16.gathers", sites as f64);
        report.metric("gather_bf16.bytes_before", bytes_before as f64);
        report.metric("gather_bf16.bytes_after", (bytes_before / 2) as f64);
        Ok((out.canonical(), report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    /// A weight gathered for a bf16 matmul (forward, and backward through a transpose), and one
    /// read both in f32 and, through a transpose, as bf16 (which keeps it f32).
    const MIXED: &str = "graph g {
  mesh dp_shard=2
  input %x: f32[2,4] @ [shard(0)]
  param %w: f32[2,4] @ [shard(0)]
  param %n: f32[2,4] @ [shard(0)]
  %3: f32[4,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.w
  %4: f32[4,4] = wait(%3)  # fwd layers.0.w
  %5: bf16[4,4] = cast(%4, dtype=bf16)  # fwd layers.0.w.cast_b
  %6: bf16[2,4] = cast(%x, dtype=bf16)  # fwd layers.0.w.cast_a
  %7: bf16[2,4] = matmul(%6, %5)  # fwd layers.0.w
  %8: f32[2,4] = cast(%7, dtype=f32)  # fwd layers.0.w.cast_out
  %9: f32[4,4] = all_gather_start(%n, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.n
  %10: f32[4,4] = wait(%9)  # fwd layers.0.n
  %11: f32[4,4] = transpose(%10, perm=[1,0])  # fwd layers.0.n
  %12: bf16[4,4] = cast(%11, dtype=bf16)  # fwd layers.0.n
  %13: bf16[2,4] = matmul(%6, %12)  # fwd layers.0.n
  %14: f32[2,4] = matmul(%8, %10)  # fwd layers.0.n
  %15: f32[4,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # bwd layers.0.w
  %16: f32[4,4] = wait(%15)  # bwd layers.0.w
  %17: f32[4,4] = transpose(%16, perm=[1,0])  # bwd layers.0.w
  %18: bf16[4,4] = cast(%16, dtype=bf16)  # bwd layers.0.w.cast_b
  %19: bf16[4,4] = cast(%17, dtype=bf16)  # bwd layers.0.w.cast_b
  %20: bf16[4,4] = add(%19, %18)  # bwd layers.0.w
  %21: bf16[2,4] = matmul(%7, %20)  # bwd layers.0.w
  %22: f32[2,4] = cast(%21, dtype=f32)  # bwd layers.0.w
  %23: f32[2,4] = add(%14, %22)  # bwd layers.0.w
  output y = %23 @ [shard(0)]
  output z = %13 @ [shard(0)]
}";

    #[test]
    fn weights_read_as_bf16_are_gathered_as_bf16_and_the_norm_stays_f32() {
        let out = check(&GatherBf16, MIXED);
        insta::assert_snapshot!(out);
        assert!(out.contains("2 all-gathers move bf16"), "{out}");
        assert!(
            out.contains("1 gathered f32 values are read as f32"),
            "{out}"
        );
        assert!(
            out.contains("bf16[4,4] = all_gather_start"),
            "the weight's gathers move bf16: {out}"
        );
        assert!(
            out.contains("f32[4,4] = all_gather_start(%n"),
            "the norm's gather stays f32: {out}"
        );
    }

    /// Two weights of one block: both shards are cast before the block's first gather, so a
    /// later `bucket` finds every operand ready there.
    #[test]
    fn a_blocks_shards_are_cast_together_before_its_first_gather() {
        let out = check(
            &GatherBf16,
            "graph g {
  mesh dp_shard=2
  input %x: bf16[2,4] @ [shard(0)]
  param %w: f32[2,4] @ [shard(0)]
  param %u: f32[2,4] @ [shard(0)]
  %3: f32[4,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.w
  %4: f32[4,4] = wait(%3)  # fwd layers.0.w
  %5: bf16[4,4] = cast(%4, dtype=bf16)  # fwd layers.0.w
  %6: bf16[2,4] = matmul(%x, %5)  # fwd layers.0.w
  %7: f32[4,4] = all_gather_start(%u, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.u
  %8: f32[4,4] = wait(%7)  # fwd layers.0.u
  %9: bf16[4,4] = cast(%8, dtype=bf16)  # fwd layers.0.u
  %10: bf16[2,4] = matmul(%6, %9)  # fwd layers.0.u
  output y = %10 @ [shard(0)]
}",
        );
        let first_start = out.find("all_gather_start").unwrap();
        for cast in ["cast(%w, dtype=bf16)", "cast(%u, dtype=bf16)"] {
            let at = out.find(cast).unwrap_or_else(|| panic!("{cast}: {out}"));
            assert!(at < first_start, "{cast} after the first gather: {out}");
        }
    }

    #[test]
    fn declines_without_a_mesh_and_refuses_an_option() {
        let out = check(
            &GatherBf16,
            "graph g {\n  input %x: f32[2]\n  %1: bf16[2] = cast(%x, dtype=bf16)\n  output y = %1\n}",
        );
        assert!(out.contains("no mesh"), "{out}");
        let mut r = Registry::empty();
        register(&mut r);
        assert!(r.build("gather_bf16", Some("x")).is_err());
    }
}
