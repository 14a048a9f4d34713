//! `fusion`: groups elementwise and reduction regions that the lowering can emit as one kernel.
//!
//! Changes: `meta.tags.fusion` on every node, nothing else: `Some(group)` on the members of a
//! fusion group, `None` elsewhere (tags from an earlier run are replaced). A group is a set of
//! nodes connected through producer → consumer edges, all in one phase, made of
//! - elementwise ops (`Op::is_elementwise`),
//! - the layout ops `reshape` and `expand`, which a fused kernel reads as views (index arithmetic,
//!   no copy), so they may sit between the elementwise ops or at either end,
//! - at most one reduction (`reduce_sum`, `reduce_max`) fed by the group. The reduction ends the
//!   group: its output is materialized, so nothing that reads it, nor anything later, joins.
//!
//! Nodes are visited in schedule order and each joins the groups of its producers, in operand
//! order (greedy: maximal under these rules, not the fewest kernels possible). Group ids are dense
//! from 0, in the schedule order of each group's first node. A group of one node, or of views
//! alone, is left untagged: it saves no launch.
//!
//! Guarantees: tier 1, since only tags change. Every tagged group satisfies `validate_groups`: one
//! phase, only the ops above, at most one reduction and no member reading it, and the graph with
//! every group contracted to one vertex is acyclic, so the lowering can order the group kernels.
//! At most `max:N` nodes per group (default 64), which bounds the generated kernel's size.
//!
//! Declines, per node, where a merge was refused:
//! - "would create a cycle through node N": the two groups are also connected through an outside
//!   node, so one kernel would have to run both before and after it;
//! - "different phase": phases are scheduled apart (the forward's values wait for the backward),
//!   so a group spanning two would hold its early results until the late ones are computed;
//! - the producer's group already ends in a reduction, or the merged group would exceed `max:N`;
//! - "composite op has its own kernel", reported once on each composite next to an elementwise op
//!   or reduction: it keeps its library kernel (attention, rms_norm, ...) and is never fused.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::{Graph, Op, Phase};
use std::collections::BTreeMap;

/// The most nodes in one group unless `fusion=max:N` says otherwise.
pub const DEFAULT_MAX_NODES: usize = 64;

pub const INFO: PassInfo = PassInfo {
    name: "fusion",
    tier: Tier::Preserving,
    summary: "tag elementwise/reduction regions that lower to one kernel (tags only)",
    contract:
        "Sets meta.tags.fusion on maximal connected groups of elementwise ops in one phase, joined \
through producer-consumer edges, with reshape/expand views in between and at most one reduction, \
which ends its group. Group ids are dense from 0 in schedule order; single-node and view-only \
groups are not tagged; earlier fusion tags are replaced. Tier 1: only tags change. Guarantees one \
phase and at most one reduction per group, no member reading the reduction, and an acyclic graph \
of groups. Declines, per node: a merge that would create a cycle through an outside node, a \
different phase, a producer group that already ends in a reduction, a group above max:N nodes; and \
composite ops, which have their own kernel.",
    option_help: Some("max:N, the most nodes in one group (N >= 2, default 64)"),
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| Ok(Box::new(Fusion::from_option(option)?)));
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fusion {
    /// The most nodes in one group.
    pub max_nodes: usize,
}

impl Default for Fusion {
    fn default() -> Self {
        Fusion {
            max_nodes: DEFAULT_MAX_NODES,
        }
    }
}

impl Fusion {
    /// Parses the `fusion=OPTION` text: `max:N` with `N >= 2`.
    pub fn from_option(option: Option<&str>) -> Result<Self, String> {
        let Some(option) = option else {
            return Ok(Fusion::default());
        };
        let value = option
            .strip_prefix("max:")
            .ok_or_else(|| format!("unknown option `{option}`"))?;
        match value.parse::<usize>() {
            Ok(n) if n >= 2 => Ok(Fusion { max_nodes: n }),
            _ => Err(format!(
                "`max:{value}`: N must be an integer >= 2 (a group of one node is no group)"
            )),
        }
    }
}

/// What part an op may play in a group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Elementwise,
    Reduction,
    View,
    Composite,
    /// Everything else (matmul, transpose, gather, sources, host transfers): not fused, silently,
    /// since a fused elementwise kernel has no way to express them.
    Other,
}

fn role(op: &Op) -> Role {
    match op {
        _ if op.is_elementwise() => Role::Elementwise,
        Op::ReduceSum { .. } | Op::ReduceMax { .. } => Role::Reduction,
        Op::Reshape { .. } | Op::Expand { .. } => Role::View,
        _ if op.is_composite() => Role::Composite,
        _ => Role::Other,
    }
}

fn is_fusible(r: Role) -> bool {
    matches!(r, Role::Elementwise | Role::Reduction | Role::View)
}

/// `node 4 (`matmul` → %7)`: the node index the report uses, and the value the text format shows.
fn describe(g: &Graph, i: usize) -> String {
    let n = &g.nodes[i];
    match n.outputs.first() {
        Some(v) => format!("node {i} (`{}` → %{})", n.op.name(), v.0),
        None => format!("node {i} (`{}`)", n.op.name()),
    }
}

#[derive(Debug)]
struct Group {
    /// Node indices; empty once merged into another group.
    members: Vec<usize>,
    phase: Phase,
    /// Holds its reduction, so it is closed to later nodes.
    sealed: bool,
}

impl Group {
    fn first(&self) -> usize {
        self.members.iter().copied().min().unwrap_or(usize::MAX)
    }
}

/// The groups under construction, with what the cycle check needs.
struct Grouping<'g> {
    graph: &'g Graph,
    successors: Vec<Vec<usize>>,
    group_of: Vec<Option<usize>>,
    groups: Vec<Group>,
    /// `visited[v] == epoch` marks nodes seen by the current cycle search, so the searches share
    /// one buffer instead of allocating per merge.
    visited: Vec<u32>,
    epoch: u32,
}

impl<'g> Grouping<'g> {
    fn new(graph: &'g Graph) -> Self {
        let df = graph.dataflow();
        let mut successors = vec![Vec::new(); graph.nodes.len()];
        for e in df.raw_edges() {
            successors[df[e.source()]].push(df[e.target()]);
        }
        for s in &mut successors {
            s.sort_unstable();
            s.dedup();
        }
        Grouping {
            graph,
            successors,
            group_of: vec![None; graph.nodes.len()],
            groups: Vec::new(),
            visited: vec![0; graph.nodes.len()],
            epoch: 0,
        }
    }

    /// Why groups `a` (holding the node just visited) and `b` (a producer's) may not merge.
    fn refusal(&mut self, a: usize, b: usize, max_nodes: usize) -> Option<String> {
        let g = self.graph;
        let (ga, gb) = (&self.groups[a], &self.groups[b]);
        let theirs = gb.first();
        if ga.phase != gb.phase {
            return Some(format!(
                "different phase: this {} node reads the {} group of node {theirs}",
                ga.phase.short(),
                gb.phase.short()
            ));
        }
        if gb.sealed {
            return Some(format!(
                "the group of node {theirs} already ends in a reduction, whose output is materialized"
            ));
        }
        let size = ga.members.len() + gb.members.len();
        if size > max_nodes {
            return Some(format!(
                "the merged group would have {size} nodes, above max:{max_nodes} (group of node \
{theirs})"
            ));
        }
        // Every member is at or before the node just visited, so later nodes cannot lead back.
        let limit = ga.members.iter().chain(&gb.members).copied().max()?;
        self.cycle_through(a, b, limit).map(|via| {
            format!(
                "would create a cycle through {}: not merged with the group of node {theirs}",
                describe(g, via)
            )
        })
    }

    /// An outside node on a path from the union of groups `a` and `b` back into it, if any. Other
    /// groups count as single vertices: reaching one member reaches the whole kernel.
    fn cycle_through(&mut self, a: usize, b: usize, limit: usize) -> Option<usize> {
        self.epoch += 1;
        let epoch = self.epoch;
        let group_of = &self.group_of;
        let inside = |v: usize| matches!(group_of[v], Some(x) if x == a || x == b);
        let mut stack: Vec<usize> = Vec::new();
        for &m in self.groups[a].members.iter().chain(&self.groups[b].members) {
            stack.extend(self.successors[m].iter().copied().filter(|&s| !inside(s)));
        }
        while let Some(v) = stack.pop() {
            if v > limit || self.visited[v] == epoch {
                continue;
            }
            let mates: &[usize] = match group_of[v] {
                Some(gv) => &self.groups[gv].members,
                None => std::slice::from_ref(&v),
            };
            for &u in mates {
                self.visited[u] = epoch;
            }
            for &u in mates {
                for &w in &self.successors[u] {
                    if inside(w) {
                        return Some(u);
                    }
                    if w <= limit && self.visited[w] != epoch {
                        stack.push(w);
                    }
                }
            }
        }
        None
    }

    /// Moves the smaller group into the larger; returns the survivor.
    fn merge(&mut self, a: usize, b: usize) -> usize {
        let (keep, gone) = if self.groups[a].members.len() >= self.groups[b].members.len() {
            (a, b)
        } else {
            (b, a)
        };
        let moved = std::mem::take(&mut self.groups[gone].members);
        for &m in &moved {
            self.group_of[m] = Some(keep);
        }
        self.groups[keep].members.extend(moved);
        self.groups[keep].sealed |= self.groups[gone].sealed;
        keep
    }
}

impl Pass for Fusion {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let roles: Vec<Role> = g.nodes.iter().map(|n| role(&n.op)).collect();
        let producer = g.producers();
        let mut declines: Vec<(usize, String)> = Vec::new();
        let mut grouping = Grouping::new(g);

        for (i, n) in g.nodes.iter().enumerate() {
            if !is_fusible(roles[i]) {
                continue;
            }
            let mut cur = grouping.groups.len();
            grouping.groups.push(Group {
                members: vec![i],
                phase: n.meta.phase,
                sealed: roles[i] == Role::Reduction,
            });
            grouping.group_of[i] = Some(cur);
            // Each producer group is tried once even when several operands come from it.
            let mut tried: Vec<usize> = Vec::new();
            for v in &n.inputs {
                let Some(p) = producer[v.index()] else {
                    continue;
                };
                let Some(pg) = grouping.group_of[p] else {
                    continue;
                };
                if pg == cur || tried.contains(&pg) {
                    continue;
                }
                tried.push(pg);
                match grouping.refusal(cur, pg, self.max_nodes) {
                    Some(reason) => declines.push((i, reason)),
                    None => cur = grouping.merge(cur, pg),
                }
            }
        }

        let users = g.users();
        for (i, n) in g.nodes.iter().enumerate() {
            if roles[i] != Role::Composite {
                continue;
            }
            let computes = |j: usize| matches!(roles[j], Role::Elementwise | Role::Reduction);
            let next_to_fusible = n
                .inputs
                .iter()
                .filter_map(|v| producer[v.index()])
                .chain(
                    n.outputs
                        .iter()
                        .flat_map(|v| users[v.index()].iter().copied()),
                )
                .any(computes);
            if next_to_fusible {
                declines.push((
                    i,
                    format!(
                        "composite op has its own kernel: `{}` is not fused with its elementwise \
neighbours",
                        n.op.name()
                    ),
                ));
            }
        }

        // Dense ids in schedule order of each group's first node, which is the order this visits.
        let mut id_of: BTreeMap<usize, u32> = BTreeMap::new();
        let mut sizes: Vec<usize> = Vec::new();
        for i in 0..g.nodes.len() {
            let Some(gi) = grouping.group_of[i] else {
                continue;
            };
            if id_of.contains_key(&gi) {
                continue;
            }
            let members = &grouping.groups[gi].members;
            let computes = members.iter().any(|&m| roles[m] != Role::View);
            if members.len() >= 2 && computes {
                id_of.insert(gi, sizes.len() as u32);
                sizes.push(members.len());
            }
        }

        let mut out = g.clone();
        let mut retagged = 0usize;
        for (i, node) in out.nodes.iter_mut().enumerate() {
            let tag = grouping.group_of[i].and_then(|gi| id_of.get(&gi).copied());
            if node.meta.tags.fusion != tag {
                retagged += 1;
            }
            node.meta.tags.fusion = tag;
        }

        let mut report = PassReport::default();
        let fused: usize = sizes.iter().sum();
        if !sizes.is_empty() {
            let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
            report.change(format!(
                "tagged {} fusion group(s) covering {fused} node(s) (sizes {})",
                sizes.len(),
                list.join(", ")
            ));
        } else if retagged > 0 {
            report.change(format!("cleared stale fusion tags on {retagged} node(s)"));
        }
        declines.sort_by_key(|(i, _)| *i);
        for (i, reason) in declines {
            report.decline(Some(i), g.nodes[i].meta.module.clone(), reason);
        }
        report.metric("fusion_groups", sizes.len() as f64);
        report.metric("fused_nodes", fused as f64);
        report.metric(
            "largest_group",
            sizes.iter().copied().max().unwrap_or(0) as f64,
        );
        Ok((out, report))
    }
}

/// Checks the fusion tags of `g` against what the lowering relies on (whoever set them): each
/// group holds only elementwise ops, reshape/expand and at most one reduction, lies in one phase,
/// has no member reading its reduction, and the graph of groups is acyclic.
pub fn validate_groups(g: &Graph) -> Result<(), String> {
    let mut groups: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
    for (i, n) in g.nodes.iter().enumerate() {
        if let Some(f) = n.meta.tags.fusion {
            groups.entry(f).or_default().push(i);
        }
    }
    let producer = g.producers();
    for (id, members) in &groups {
        let first = &g.nodes[members[0]];
        let mut reductions = Vec::new();
        for &m in members {
            let n = &g.nodes[m];
            if !is_fusible(role(&n.op)) {
                return Err(format!("group {id}: {} cannot be fused", describe(g, m)));
            }
            if n.meta.phase != first.meta.phase {
                return Err(format!(
                    "group {id} spans phases {} and {}",
                    first.meta.phase.short(),
                    n.meta.phase.short()
                ));
            }
            if role(&n.op) == Role::Reduction {
                reductions.push(m);
            }
        }
        if reductions.len() > 1 {
            return Err(format!("group {id} holds {} reductions", reductions.len()));
        }
        for &m in members {
            let reads_reduction = g.nodes[m]
                .inputs
                .iter()
                .any(|v| producer[v.index()].is_some_and(|p| reductions.contains(&p)));
            if reads_reduction {
                return Err(format!(
                    "group {id}: {} reads the group's reduction",
                    describe(g, m)
                ));
            }
        }
    }

    // Kahn's algorithm on the graph whose vertices are groups and untagged nodes.
    let dense: BTreeMap<u32, usize> = groups.keys().enumerate().map(|(k, id)| (*id, k)).collect();
    let vertex = |i: usize| match g.nodes[i].meta.tags.fusion {
        Some(f) => dense[&f],
        None => groups.len() + i,
    };
    let count = groups.len() + g.nodes.len();
    let df = g.dataflow();
    let mut edges: Vec<(usize, usize)> = df
        .raw_edges()
        .iter()
        .map(|e| (vertex(df[e.source()]), vertex(df[e.target()])))
        .filter(|(a, b)| a != b)
        .collect();
    edges.sort_unstable();
    edges.dedup();
    let mut indegree = vec![0usize; count];
    let mut out_edges = vec![Vec::new(); count];
    for &(a, b) in &edges {
        indegree[b] += 1;
        out_edges[a].push(b);
    }
    let mut ready: Vec<usize> = (0..count).filter(|&v| indegree[v] == 0).collect();
    let mut done = 0;
    while let Some(v) = ready.pop() {
        done += 1;
        for &w in &out_edges[v] {
            indegree[w] -= 1;
            if indegree[w] == 0 {
                ready.push(w);
            }
        }
    }
    if done < count {
        let stuck: Vec<String> = groups
            .iter()
            .filter(|(id, _)| indegree[dense[id]] > 0)
            .map(|(id, _)| id.to_string())
            .collect();
        return Err(format!(
            "the groups form a cycle (groups involved: {})",
            stuck.join(", ")
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::try_check;

    /// Runs the pass through the numerics check, then checks the groups it tagged.
    fn fuse(pass: &Fusion, input: &str) -> String {
        let checked = try_check(pass, input).unwrap_or_else(|e| panic!("{e}"));
        if let Err(e) = validate_groups(&checked.graph) {
            panic!("invalid groups: {e}\n{}", checked.text);
        }
        checked.text
    }

    #[test]
    fn chain_through_views_is_one_group() {
        let out = fuse(
            &Fusion::default(),
            "graph g {
  input %x: f32[2,3]
  input %b: f32[3]
  %2: f32[2,3] = exp(%x)  # fwd
  %3: f32[6] = reshape(%2, shape=[6])  # fwd
  %4: f32[6] = mul_scalar(%3, value=2.0)  # fwd
  %5: f32[1,3] = reshape(%b, shape=[1,3])  # fwd
  %6: f32[2,3] = expand(%5, shape=[2,3])  # fwd
  %7: f32[2,3] = reshape(%4, shape=[2,3])  # fwd
  %8: f32[2,3] = add(%7, %6)  # fwd
  %9: f32[3,2] = transpose(%8, perm=[1,0])  # fwd
  %10: f32[3,2] = neg(%9)  # fwd
  output y = %10
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn diamond_merges_both_branches() {
        let out = fuse(
            &Fusion::default(),
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd
  %2: f32[4] = sin(%1)  # fwd
  %3: f32[4] = cos(%1)  # fwd
  %4: f32[4] = mul(%2, %3)  # fwd
  output y = %4
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn reduction_ends_its_group() {
        let out = fuse(
            &Fusion::default(),
            "graph g {
  input %x: f32[4,8]
  %1: f32[4,8] = square(%x)  # fwd
  %2: f32[4,1] = reduce_sum(%1, axes=[1], keepdim=true)  # fwd
  %3: f32[4,1] = rsqrt(%2)  # fwd
  %4: f32[4,8] = expand(%3, shape=[4,8])  # fwd
  %5: f32[4,8] = mul(%x, %4)  # fwd
  %6: f32[4] = reduce_max(%5, axes=[1], keepdim=false)  # fwd
  %7: f32[] = reduce_sum(%6, axes=[0], keepdim=false)  # fwd
  output y = %7
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn merge_through_an_outside_node_is_declined() {
        // %4 reads %1 directly and through the matmul: fusing it with %1's group would make the
        // group both feed and consume the matmul.
        let out = fuse(
            &Fusion::default(),
            "graph g {
  input %x: f32[4,4]
  %1: f32[4,4] = exp(%x)  # fwd a
  %2: f32[4,4] = neg(%1)  # fwd a
  %3: f32[4,4] = matmul(%1, %x)  # fwd mm
  %4: f32[4,4] = add(%2, %3)  # fwd b
  %5: f32[4,4] = tanh(%4)  # fwd b
  output y = %5
}",
        );
        assert!(out.contains("would create a cycle through node 2"), "{out}");
        insta::assert_snapshot!(out);
    }

    #[test]
    fn phases_and_composites_bound_groups() {
        let out = fuse(
            &Fusion::default(),
            "graph g {
  input %x: f32[2,4]
  param %w: f32[4]
  %2: f32[2,4] = mul_scalar(%x, value=3.0)  # fwd
  %3: f32[2,4] = rms_norm(%2, %w, eps=1e-5)  # fwd norm
  %4: f32[2,4] = silu(%3)  # fwd
  %5: f32[2,4] = square(%4)  # fwd
  %6: f32[2,4] = neg(%5)  # bwd
  %7: f32[2,4] = exp(%6)  # bwd
  output y = %7
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn max_bounds_group_size_and_retagging_replaces_old_tags() {
        let input = "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd fuse=7
  %2: f32[4] = neg(%1)  # fwd
  %3: f32[4] = sin(%2)  # fwd
  %4: f32[4] = cos(%3)  # fwd
  %5: f32[4] = tanh(%4)  # fwd
  output y = %5
}";
        let out = fuse(&Fusion::from_option(Some("max:2")).unwrap(), input);
        insta::assert_snapshot!(out);
    }

    #[test]
    fn bad_options_are_refused_with_the_accepted_form() {
        let r = Registry::builtin();
        for bad in ["max:1", "max:x", "max:", "size:4"] {
            let err = r.build("fusion", Some(bad)).err().unwrap_or_default();
            assert!(err.contains("accepted: max:N"), "{bad}: {err}");
        }
        assert!(r.build("fusion", Some("max:8")).is_ok());
    }

    #[test]
    fn validate_groups_rejects_a_cycle_and_a_read_reduction() {
        let cyclic = graphtrain_ir::text::parse(
            "graph g {
  input %x: f32[4,4]
  %1: f32[4,4] = exp(%x)  # fwd fuse=0
  %2: f32[4,4] = matmul(%1, %x)  # fwd
  %3: f32[4,4] = add(%1, %2)  # fwd fuse=0
  output y = %3
}",
        )
        .unwrap();
        let err = validate_groups(&cyclic).unwrap_err();
        assert!(err.contains("cycle"), "{err}");

        let reads_reduction = graphtrain_ir::text::parse(
            "graph g {
  input %x: f32[4]
  %1: f32[] = reduce_sum(%x, axes=[0], keepdim=false)  # fwd fuse=0
  %2: f32[] = neg(%1)  # fwd fuse=0
  output y = %2
}",
        )
        .unwrap();
        let err = validate_groups(&reads_reduction).unwrap_err();
        assert!(err.contains("reads the group's reduction"), "{err}");
    }
}
