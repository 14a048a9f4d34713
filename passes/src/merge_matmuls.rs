//! `merge_matmuls`: sibling matmuls (one left operand, several right operands: a block's `wq`,
//! `wk`, `wv`, the feed-forward's `w1` and `w3`) become one matmul over the right operands side
//! by side, whose column blocks are the old results.
//!
//! Why: each matmul reads its left operand again (and the cpu GEMM packs it again); one wider
//! product reads it once, in fewer, wider launches.
//!
//! Changes: two or more matmuls of one phase with the same left operand `a` and right operands
//! `b_i: [K, N_i]` of one dtype become `y = matmul(a, concat(b_i, axis=1))`, and result `i` is
//! `slice(y)` along the last axis. Where every result is read only by a cast to one dtype
//! (bf16-mixed's `cast_out`), `y` is cast once and the casts' readers read slices of that. The
//! concat is lifted through the transposes and casts the right operands share, so a Linear's
//! weights are concatenated as they are stored: `concat(w_i, axis=0)` of parameters, which the
//! fused lowering stores side by side and reads in place (`Program::packs`), with no copy,
//! where each is a whole number of the arena's alignment (64 bytes; else it copies). The
//! parameters stay separate graph inputs: names, checkpoints, sharding plans and the optimizer
//! see them as before.
//! Guarantees: tier 1: every element of `y` is the same products summed in the same order as in
//! the matmul it comes from (the interpreter, and the cpu and device GEMMs, sum each output
//! element over k whatever N is).
//! Declines: groups whose concat the lowering would have to copy (right operands that are not
//! parameters, as backward's weight gradients are) where the copy moves at least the bytes the
//! merge saves (`a` read once instead of k times); right operands computed after the group's
//! first matmul; on a mesh, a concat along a split axis (tensor parallel's column shards);
//! siblings with different tags (capture region, remat). And, unless the option is `any`,
//! groups with a result that an elementwise op reads (the feed-forward's `w1`/`w3`, read by
//! SiLU and the product): the lowering's elementwise kernels read contiguous operands, so each
//! such slice of the merged result would be copied out of it, which costs more than the merge
//! saves. Results read only by layout ops and ops that read strided operands in place (matmul,
//! rope, attention, cross-entropy; `q`, `k` and `v`) are read where they lie.
//! Costs: the merged result is one buffer, live until its last slice's last reader: `v`, saved
//! for attention's backward, keeps `q` and `k`'s columns (before rope) alive until then.
//! Runs after `parallelize` (not a pipeline pass) and after `async_tp`, whose patterns look for
//! one matmul per weight: put it after them in `--passes`.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::rebuild::Rebuild;
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::graph::{Meta, Node, Phase};
use graphtrain_ir::spmd;
use graphtrain_ir::{DType, Graph, Op, Placements, ValueId};

/// Layout ops and casts, which the lowering may turn into views of their operand (keeping its
/// buffer alive for their readers).
fn is_view_like(op: &Op) -> bool {
    matches!(
        op,
        Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Cast { .. }
    )
}

/// The nodes that read `v`, directly or through view-like ops (those included), and whether
/// `v` or a view-like op's result on the way is a graph output.
fn view_readers(g: &Graph, users: &[Vec<usize>], v: ValueId) -> (Vec<usize>, bool) {
    let (mut readers, mut output) = (Vec::new(), false);
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        output |= g.outputs.iter().any(|o| o.value == v);
        for &u in &users[v.index()] {
            readers.push(u);
            if is_view_like(&g.nodes[u].op) {
                stack.push(g.nodes[u].outputs[0]);
            }
        }
    }
    (readers, output)
}

/// Results read in place: through view-like ops, by ops that read strided operands.
fn read_in_place(g: &Graph, users: &[Vec<usize>], v: ValueId) -> bool {
    let (readers, output) = view_readers(g, users, v);
    !output
        && readers.iter().all(|&u| {
            let op = &g.nodes[u].op;
            is_view_like(op)
                || matches!(
                    op,
                    Op::Matmul
                        | Op::Rope { .. }
                        | Op::Attention { .. }
                        | Op::AttentionBackward { .. }
                        | Op::CrossEntropy
                )
        })
}

/// The latest stage (micro-batch and phase) that reads `v`, directly or through view-like ops.
fn last_reading_stage(g: &Graph, users: &[Vec<usize>], v: ValueId) -> (u32, Phase) {
    let (readers, _) = view_readers(g, users, v);
    readers
        .iter()
        .map(|&u| g.nodes[u].meta.stage())
        .max()
        .unwrap_or((0, Phase::Forward))
}

pub const INFO: PassInfo = PassInfo {
    name: "merge_matmuls",
    tier: Tier::Preserving,
    summary: "merge matmuls that share their left operand (wq/wk/wv, w1/w3) into one wider matmul",
    contract: "Matmuls of one phase reading the same left operand and right operands [K, N_i] of \
one dtype become one matmul over the right operands concatenated along N, each old result a \
slice of it (casts of every result to one dtype become one cast). The concat is lifted through \
shared transposes and casts, so weights are concatenated as stored: parameters, which the fused \
lowering places side by side and reads in place. Tier 1: each element is the same sum in the \
same order. Declines where the concat would be a copy moving at least the bytes it saves, where \
a right operand comes after the first matmul, along a split mesh axis, for siblings tagged \
differently, and (unless `any`) where an elementwise op reads a result, which the lowering would \
copy out of the merged one. The merged result lives until its last slice's last reader. Run it \
after async_tp.",
    option_help: Some(
        "`any`: also merge matmuls whose results elementwise ops read (copied out of the merged \
result on the current backends)",
    ),
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| match option {
        None => Ok(Box::new(MergeMatmuls { any_readers: false })),
        Some("any") => Ok(Box::new(MergeMatmuls { any_readers: true })),
        Some(o) => Err(format!(
            "merge_matmuls takes no option or `any` (got `{o}`)"
        )),
    });
}

pub struct MergeMatmuls {
    /// Merge whatever reads the results (else only results read in place).
    pub any_readers: bool,
}

/// Sibling matmuls that become one.
struct Group {
    /// The matmul nodes, in schedule order.
    members: Vec<usize>,
    /// The values concatenated (the right operands, or what they are computed from through
    /// `chain`), one per member.
    roots: Vec<ValueId>,
    /// The concat's axis among the roots' axes.
    axis: usize,
    /// The ops that take the concatenated roots to the merged right operand, in order.
    chain: Vec<Op>,
    /// The casts reading the results (one per member) and their dtype, where every result has
    /// exactly one reader and it is such a cast.
    casts: Option<(DType, Vec<usize>)>,
    /// Whether the concat is of distinct parameters (graph inputs) along their first axis,
    /// which the fused lowering stores side by side instead of copying.
    in_place: bool,
}

/// Follows the right operands `bs` down through ops they share (the same transpose, the same
/// cast): the values those ops read, the concat axis among them, and the ops from them back up.
fn lift(
    g: &Graph,
    producers: &[Option<usize>],
    bs: &[ValueId],
    mut axis: usize,
) -> (Vec<ValueId>, usize, Vec<Op>) {
    let mut roots = bs.to_vec();
    let mut chain = Vec::new();
    loop {
        let nodes: Option<Vec<&Node>> = roots
            .iter()
            .map(|v| producers[v.index()].map(|p| &g.nodes[p]))
            .collect();
        let Some(nodes) = nodes else { break };
        let op = &nodes[0].op;
        let alike = nodes.iter().all(|n| {
            n.op == *op
                && n.inputs.len() == 1
                && g.ty(n.inputs[0]).dtype == g.ty(nodes[0].inputs[0]).dtype
        });
        if !alike {
            break;
        }
        match op {
            // out.shape[d] = in.shape[perm[d]]
            Op::Transpose { perm } => axis = perm[axis],
            Op::Cast { .. } => {}
            _ => break,
        }
        chain.push(op.clone());
        roots = nodes.iter().map(|n| n.inputs[0]).collect();
    }
    chain.reverse();
    (roots, axis, chain)
}

/// The longest module path that every member's path starts with, cut at a `.`.
fn common_module(g: &Graph, members: &[usize]) -> String {
    let first = &g.nodes[members[0]].meta.module;
    let mut len = first.len();
    for &m in &members[1..] {
        let other = &g.nodes[m].meta.module;
        len = first
            .bytes()
            .zip(other.bytes())
            .take(len)
            .take_while(|(a, b)| a == b)
            .count();
    }
    if len == first.len() {
        return first.clone();
    }
    first[..len]
        .rsplit_once('.')
        .map_or("", |(head, _)| head)
        .to_string()
}

/// Why a group of siblings cannot be merged, or the merge.
fn plan_group(
    g: &Graph,
    producers: &[Option<usize>],
    users: &[Vec<usize>],
    placements: Option<&[Option<Placements>]>,
    packed: &[bool],
    members: Vec<usize>,
) -> Result<Group, String> {
    let first = members[0];
    let tags = &g.nodes[first].meta.tags;
    if members.iter().any(|&m| g.nodes[m].meta.tags != *tags) {
        return Err("its matmuls are tagged differently (capture region or remat)".into());
    }
    let bs: Vec<ValueId> = members.iter().map(|&m| g.nodes[m].inputs[1]).collect();
    let (roots, axis, chain) = lift(g, producers, &bs, 1);
    if let Some(late) = roots
        .iter()
        .find(|r| producers[r.index()].is_some_and(|p| p >= first))
    {
        return Err(format!(
            "right operand %{} is computed after the first matmul",
            late.index()
        ));
    }
    if let (Some(placements), Some(mesh)) = (placements, &g.mesh) {
        let ins: Option<Vec<&Placements>> = roots
            .iter()
            .map(|r| placements[r.index()].as_ref())
            .collect();
        if let Some(ins) = ins {
            let types: Vec<_> = roots.iter().map(|r| g.ty(*r)).collect();
            if let Err(why) = spmd::node_rule(&Op::Concat { axis }, &ins, &types, &[], mesh) {
                return Err(format!(
                    "the mesh refuses the concat of its right operands: {why}"
                ));
            }
        }
    }
    let mut distinct = roots.clone();
    distinct.sort_unstable();
    distinct.dedup();
    let in_place = axis == 0
        && distinct.len() == roots.len()
        && roots
            .iter()
            .all(|r| producers[r.index()].is_none() && !packed[r.index()]);
    let a_bytes = g.ty(g.nodes[first].inputs[0]).size_bytes();
    let saved = a_bytes * (members.len() - 1);
    let copied: usize = if in_place {
        0
    } else {
        // Read and written once.
        2 * roots.iter().map(|r| g.ty(*r).size_bytes()).sum::<usize>()
    };
    if copied >= saved {
        return Err(format!(
            "its right operands would be copied side by side ({copied} bytes moved) to save \
reading the left operand {} more times ({saved} bytes)",
            members.len() - 1
        ));
    }
    let cast_of = |m: usize| -> Option<(DType, usize)> {
        let y = g.nodes[m].outputs[0];
        if g.outputs.iter().any(|o| o.value == y) {
            return None;
        }
        match users[y.index()].as_slice() {
            [c] => match g.nodes[*c].op {
                Op::Cast { dtype } => Some((dtype, *c)),
                _ => None,
            },
            _ => None,
        }
    };
    let casts: Option<Vec<(DType, usize)>> = members.iter().map(|&m| cast_of(m)).collect();
    let casts = casts.and_then(|cs| {
        let dtype = cs[0].0;
        let tags_alike = cs
            .iter()
            .all(|(_, c)| g.nodes[*c].meta.tags == g.nodes[cs[0].1].meta.tags);
        (cs.iter().all(|(d, _)| *d == dtype) && tags_alike)
            .then(|| (dtype, cs.iter().map(|(_, c)| *c).collect()))
    });
    Ok(Group {
        members,
        roots,
        axis,
        chain,
        casts,
        in_place,
    })
}

/// What becomes of a node of the input graph.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Kept,
    /// The first matmul of group `g`: the merged nodes are emitted here.
    First(usize),
    /// A later matmul of a group, or a cast of a result: its value is a slice now.
    Replaced,
}

impl Pass for MergeMatmuls {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let producers = g.producers();
        let users = g.users();
        let placements = match &g.mesh {
            Some(mesh) => Some(
                spmd::propagate(g, mesh)
                    .map_err(|(node, why)| PassError {
                        pass: INFO.name.into(),
                        message: format!("placements do not propagate at node {node}: {why}"),
                    })?
                    .placements,
            ),
            None => None,
        };
        // Siblings: same left operand, stage, right operands' K and dtype, and result dtype.
        type Key = (ValueId, (u32, Phase), usize, DType, DType);
        let mut siblings: Vec<(Key, Vec<usize>)> = Vec::new();
        for (i, n) in g.nodes.iter().enumerate() {
            if n.op != Op::Matmul || g.ty(n.inputs[1]).rank() != 2 {
                continue;
            }
            let b = g.ty(n.inputs[1]);
            let key = (
                n.inputs[0],
                n.meta.stage(),
                b.shape[0],
                b.dtype,
                g.ty(n.outputs[0]).dtype,
            );
            match siblings.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(i),
                None => siblings.push((key, vec![i])),
            }
        }
        // In order of each group's first matmul.
        let candidates = siblings
            .into_iter()
            .map(|(_, members)| members)
            .filter(|m| m.len() >= 2);
        let mut packed = vec![false; g.values.len()];
        let mut groups = Vec::new();
        let mut merge_candidates = Vec::new();
        for mut members in candidates {
            if !self.any_readers {
                members.retain(|&m| {
                    let in_place = read_in_place(g, &users, g.nodes[m].outputs[0]);
                    if !in_place {
                        report.decline(
                            Some(m),
                            g.nodes[m].meta.module.clone(),
                            "an elementwise op (or the graph's outputs) reads its result, which \
the lowering would copy out of a merged one (`merge_matmuls=any` merges it anyway)",
                        );
                    }
                    in_place
                });
                if members.len() < 2 {
                    continue;
                }
            }
            // One buffer holds the merged result until its last slice's last reader: results
            // saved for a later phase (attention's `v`) are merged only with each other, so that
            // they do not keep their siblings (`q`, `k`) alive.
            let stage = g.nodes[members[0]].meta.stage();
            let (saved, rest): (Vec<usize>, Vec<usize>) = members
                .iter()
                .partition(|&&m| last_reading_stage(g, &users, g.nodes[m].outputs[0]) > stage);
            for part in [rest, saved] {
                if part.len() < 2 {
                    for &m in &part {
                        report.decline(
                            Some(m),
                            g.nodes[m].meta.module.clone(),
                            "its result is needed in a later phase than its siblings' (or the other \
way round): merged, the longer-lived would keep the others alive",
                        );
                    }
                    continue;
                }
                merge_candidates.push(part);
            }
        }
        for members in merge_candidates {
            let first = members[0];
            let planned = plan_group(
                g,
                &producers,
                &users,
                placements.as_deref(),
                &packed,
                members,
            );
            match planned {
                Ok(group) => {
                    if group.in_place {
                        for r in &group.roots {
                            packed[r.index()] = true;
                        }
                    }
                    groups.push(group);
                }
                Err(why) => report.decline(Some(first), g.nodes[first].meta.module.clone(), why),
            }
        }
        if groups.is_empty() {
            if report.declined.is_empty() {
                report.decline(None, "", "no two matmuls share their left operand");
            }
            return Ok((g.clone(), report));
        }

        let mut role = vec![Role::Kept; g.nodes.len()];
        for (k, group) in groups.iter().enumerate() {
            role[group.members[0]] = Role::First(k);
            for &m in &group.members[1..] {
                role[m] = Role::Replaced;
            }
            for &c in group.casts.iter().flat_map(|(_, cs)| cs) {
                role[c] = Role::Replaced;
            }
        }
        // The transposes and casts that only fed the merged matmuls' right operands go too
        // (not a value some group concatenates).
        let roots: Vec<ValueId> = groups.iter().flat_map(|gr| gr.roots.clone()).collect();
        for group in &groups {
            for &m in &group.members {
                let mut b = g.nodes[m].inputs[1];
                while let Some(p) = producers[b.index()] {
                    let feeds_only_merged = users[b.index()].iter().all(|&u| role[u] != Role::Kept)
                        && !g.outputs.iter().any(|o| o.value == b);
                    if !feeds_only_merged || roots.contains(&b) {
                        break;
                    }
                    role[p] = Role::Replaced;
                    b = g.nodes[p].inputs[0];
                }
            }
        }
        let mut rb = Rebuild::of(g, INFO.name);
        for (i, node) in g.nodes.iter().enumerate() {
            rb.enter(&node.meta);
            match role[i] {
                Role::Kept => rb.keep(node),
                Role::Replaced => {}
                Role::First(k) => {
                    let group = &groups[k];
                    let meta = Meta {
                        module: common_module(g, &group.members),
                        ..node.meta.clone()
                    };
                    let roots = group.roots.iter().map(|r| rb.map[r.index()]).collect();
                    let mut b = rb.add(Op::Concat { axis: group.axis }, roots, &meta)?;
                    for op in &group.chain {
                        b = rb.add(op.clone(), vec![b], &meta)?;
                    }
                    let a = rb.map[node.inputs[0].index()];
                    let mut y = rb.add(Op::Matmul, vec![a, b], &meta)?;
                    let results: Vec<(ValueId, &Meta)> = match &group.casts {
                        Some((dtype, casts)) => {
                            let cast_meta = Meta {
                                module: meta.module.clone(),
                                ..g.nodes[casts[0]].meta.clone()
                            };
                            y = rb.add(Op::Cast { dtype: *dtype }, vec![y], &cast_meta)?;
                            casts
                                .iter()
                                .map(|&c| (g.nodes[c].outputs[0], &g.nodes[c].meta))
                                .collect()
                        }
                        None => group
                            .members
                            .iter()
                            .map(|&m| (g.nodes[m].outputs[0], &g.nodes[m].meta))
                            .collect(),
                    };
                    let last = rb.out.ty(y).rank() - 1;
                    let mut start = 0;
                    for (old, meta) in results {
                        let end = start + g.ty(old).shape[last];
                        let slice = Op::Slice {
                            axis: last,
                            start,
                            end,
                        };
                        rb.map[old.index()] = rb.add(slice, vec![y], meta)?;
                        start = end;
                    }
                }
            }
        }
        let merged: usize = groups.iter().map(|g| g.members.len()).sum();
        let in_place = groups.iter().filter(|gr| gr.in_place).count();
        let sizes: Vec<String> = groups
            .iter()
            .map(|gr| gr.members.len().to_string())
            .collect();
        report.change(format!(
            "{merged} matmuls merged into {} (groups of {}); {in_place} concatenate parameters, \
which the fused lowering stores side by side and reads in place where each is a whole number of 64 bytes (lowering/src/packs.rs)",
            groups.len(),
            sizes.join(", ")
        ));
        let saved: usize = groups
            .iter()
            .map(|gr| g.ty(g.nodes[gr.members[0]].inputs[0]).size_bytes() * (gr.members.len() - 1))
            .sum();
        report.metric("merge_matmuls.groups", groups.len() as f64);
        report.metric(
            "merge_matmuls.matmuls_removed",
            (merged - groups.len()) as f64,
        );
        report.metric("merge_matmuls.left_operand_bytes_saved", saved as f64);
        Ok((rb.finish().canonical(), report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    const ANY: MergeMatmuls = MergeMatmuls { any_readers: true };

    /// An attention block's projections (`wq`, `wk`, `wv` read the same normed input through
    /// their transposes) and a feed-forward pair, in f32.
    const LINEARS: &str = "graph g {
  input %x: f32[2,3,4]
  param %wq: f32[4,4]
  param %wk: f32[2,4]
  param %wv: f32[2,4]
  param %w1: f32[6,4]
  param %w3: f32[6,4]
  %7: f32[4,4] = transpose(%wq, perm=[1,0])  # fwd layers.0.attention.wq
  %8: f32[2,3,4] = matmul(%x, %7)  # fwd layers.0.attention.wq
  %9: f32[4,2] = transpose(%wk, perm=[1,0])  # fwd layers.0.attention.wk
  %10: f32[2,3,2] = matmul(%x, %9)  # fwd layers.0.attention.wk
  %11: f32[4,2] = transpose(%wv, perm=[1,0])  # fwd layers.0.attention.wv
  %12: f32[2,3,2] = matmul(%x, %11)  # fwd layers.0.attention.wv
  %13: f32[2,3,2] = mul(%10, %12)  # fwd layers.0.attention
  %14: f32[4,6] = transpose(%w1, perm=[1,0])  # fwd layers.0.feed_forward.w1
  %15: f32[2,3,6] = matmul(%8, %14)  # fwd layers.0.feed_forward.w1
  %16: f32[4,6] = transpose(%w3, perm=[1,0])  # fwd layers.0.feed_forward.w3
  %17: f32[2,3,6] = matmul(%8, %16)  # fwd layers.0.feed_forward.w3
  %18: f32[2,3,6] = mul(%15, %17)  # fwd layers.0.feed_forward
  output y = %13
  output z = %18
}";

    #[test]
    fn projections_of_one_input_become_one_matmul_over_their_weights_side_by_side() {
        let out = check(&ANY, LINEARS);
        insta::assert_snapshot!(out);
        assert!(out.contains("5 matmuls merged into 2"), "{out}");
        assert!(out.contains("concat(%wq, %wk, %wv, axis=0)"), "{out}");
    }

    /// Attention's projections as the model has them: `q` and `k` through rope, `v` straight
    /// to attention (and, standing in for attention's backward, a backward matmul), all through
    /// reshapes and transposes, read in place; and a pair of projections an elementwise op
    /// reads, which only `any` merges. `v` lives into backward, `q` and `k` do not: only they
    /// merge.
    const ATTENTION: &str = "graph g {
  input %x: f32[1,4,16]
  param %wq: f32[16,16]
  param %wk: f32[16,16]
  param %wv: f32[16,16]
  param %w1: f32[8,16]
  param %w3: f32[8,16]
  %6: f32[16,16] = transpose(%wq, perm=[1,0])  # fwd layers.0.attention.wq
  %7: f32[1,4,16] = matmul(%x, %6)  # fwd layers.0.attention.wq
  %8: f32[16,16] = transpose(%wk, perm=[1,0])  # fwd layers.0.attention.wk
  %9: f32[1,4,16] = matmul(%x, %8)  # fwd layers.0.attention.wk
  %10: f32[16,16] = transpose(%wv, perm=[1,0])  # fwd layers.0.attention.wv
  %11: f32[1,4,16] = matmul(%x, %10)  # fwd layers.0.attention.wv
  %12: f32[1,4,2,8] = reshape(%7, shape=[1,4,2,8])  # fwd layers.0.attention
  %13: f32[1,4,2,8] = reshape(%9, shape=[1,4,2,8])  # fwd layers.0.attention
  %14: f32[1,4,2,8] = reshape(%11, shape=[1,4,2,8])  # fwd layers.0.attention
  %15: f32[1,4,2,8] = rope(%12, theta=10000.0, layout=interleaved, inverse=false)  # fwd layers.0.attention
  %16: f32[1,4,2,8] = rope(%13, theta=10000.0, layout=interleaved, inverse=false)  # fwd layers.0.attention
  %17: f32[1,2,4,8] = transpose(%15, perm=[0,2,1,3])  # fwd layers.0.attention
  %18: f32[1,2,4,8] = transpose(%16, perm=[0,2,1,3])  # fwd layers.0.attention
  %19: f32[1,2,4,8] = transpose(%14, perm=[0,2,1,3])  # fwd layers.0.attention
  %20: f32[1,2,4,8] = attention(%17, %18, %19, causal=true, scale=0.25)  # fwd layers.0.attention
  %21: f32[16,8] = transpose(%w1, perm=[1,0])  # fwd layers.0.feed_forward.w1
  %22: f32[1,4,8] = matmul(%x, %21)  # fwd layers.0.feed_forward.w1
  %23: f32[16,8] = transpose(%w3, perm=[1,0])  # fwd layers.0.feed_forward.w3
  %24: f32[1,4,8] = matmul(%x, %23)  # fwd layers.0.feed_forward.w3
  %25: f32[1,4,8] = mul(%22, %24)  # fwd layers.0.feed_forward
  %26: f32[1,4,16] = matmul(%11, %6)  # bwd layers.0.attention
  output y = %20
  output z = %25
  output w = %26
}";

    #[test]
    fn by_default_only_results_read_in_place_are_merged() {
        let out = check(&MergeMatmuls { any_readers: false }, ATTENTION);
        insta::assert_snapshot!(out);
        assert!(out.contains("2 matmuls merged into 1"), "{out}");
        assert!(
            out.contains("declined at node 5 (`layers.0.attention.wv`): its result is needed in a later phase"),
            "{out}"
        );
        assert!(
            out.contains("declined at node 16 (`layers.0.feed_forward.w1`): an elementwise op"),
            "{out}"
        );
        let any = check(&ANY, ATTENTION);
        assert!(any.contains("4 matmuls merged into 1"), "{any}");
    }

    /// bf16-mixed's form: one cast of the input, casts of the transposed weights, and each
    /// result cast back to f32.
    const MIXED: &str = "graph g {
  input %x: f32[2,3,4]
  param %wq: f32[4,4]
  param %wk: f32[4,4]
  %3: bf16[2,3,4] = cast(%x, dtype=bf16)  # fwd layers.0.attention.wq.cast_a
  %4: f32[4,4] = transpose(%wq, perm=[1,0])  # fwd layers.0.attention.wq
  %5: bf16[4,4] = cast(%4, dtype=bf16)  # fwd layers.0.attention.wq.cast_b
  %6: bf16[2,3,4] = matmul(%3, %5)  # fwd layers.0.attention.wq
  %7: f32[2,3,4] = cast(%6, dtype=f32)  # fwd layers.0.attention.wq.cast_out
  %8: f32[4,4] = transpose(%wk, perm=[1,0])  # fwd layers.0.attention.wk
  %9: bf16[4,4] = cast(%8, dtype=bf16)  # fwd layers.0.attention.wk.cast_b
  %10: bf16[2,3,4] = matmul(%3, %9)  # fwd layers.0.attention.wk
  %11: f32[2,3,4] = cast(%10, dtype=f32)  # fwd layers.0.attention.wk.cast_out
  %12: f32[2,3,4] = mul(%7, %11)  # fwd layers.0.attention
  output y = %12
}";

    #[test]
    fn bf16_results_are_cast_back_once() {
        let out = check(&ANY, MIXED);
        insta::assert_snapshot!(out);
        assert!(out.contains("2 matmuls merged into 1"), "{out}");
        assert_eq!(out.matches("dtype=f32").count(), 1, "{out}");
    }

    /// Weight gradients share the left operand (the input, transposed) but their right
    /// operands are activations' gradients: concatenating them is a copy as large as what it
    /// saves. And on a tensor-parallel mesh the weights are column shards.
    const DECLINED: &str = "graph g {
  mesh tp=2
  input %x: f32[6,4] @ [replicate]
  input %dq: f32[6,4] @ [replicate]
  input %dk: f32[6,4] @ [replicate]
  param %wq: f32[4,4] @ [shard(0)]
  param %wk: f32[4,4] @ [shard(0)]
  %5: f32[4,4] = transpose(%wq, perm=[1,0])  # fwd layers.0.attention.wq
  %6: f32[6,4] = matmul(%x, %5)  # fwd layers.0.attention.wq
  %7: f32[4,4] = transpose(%wk, perm=[1,0])  # fwd layers.0.attention.wk
  %8: f32[6,4] = matmul(%x, %7)  # fwd layers.0.attention.wk
  %9: f32[4,6] = transpose(%x, perm=[1,0])  # bwd layers.0.attention
  %10: f32[4,4] = matmul(%9, %dq)  # bwd layers.0.attention.wq
  %11: f32[4,4] = matmul(%9, %dk)  # bwd layers.0.attention.wk
  output a = %10 @ [replicate]
  output b = %11 @ [replicate]
  output c = %6 @ [shard(1)]
  output d = %8 @ [shard(1)]
}";

    #[test]
    fn copies_that_save_nothing_and_split_axes_are_declined() {
        let out = check(&ANY, DECLINED);
        insta::assert_snapshot!(out);
        assert!(out.contains("would be copied side by side"), "{out}");
        assert!(out.contains("the mesh refuses the concat"), "{out}");
        assert!(!out.contains("concat("), "{out}");
    }
}
