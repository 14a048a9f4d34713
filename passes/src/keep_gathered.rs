//! `keep_gathered`: keeps parameters gathered in forward for backward, instead of gathering them
//! again (FSDP's `reshard_after_forward=False`): memory against communication.
//!
//! FSDP frees each gathered weight after its forward use and gathers it again in backward: the
//! same all-gather of the same shard, twice a step. This pass removes the second where asked:
//! `all` (every block), or `last:N` (the last N transformer blocks, whose backward comes soonest
//! after their forward, so their weights are held the shortest).
//!
//! Changes: a later all-gather of the same operand over the same group as an earlier one (the
//! backward re-gather) is removed with its wait; its readers read the earlier wait's result.
//! A gather of a cast that only it reads (`gather_bf16`'s) moves the cast's operand, cast: two
//! such gathers of one weight repeat each other, and the later one's cast goes with it.
//! Guarantees: tier 1: the removed collective would have returned the same bits. The earlier
//! result lives until its last backward reader: the predicted peak is reported before and after.
//! Declines: without a mesh or without repeated gathers; repeated gathers outside the chosen
//! blocks (counted).

use crate::memory::{human_bytes, profile};
use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::{Collective, Graph, Node, Op, ValueId};

pub const INFO: PassInfo = PassInfo {
    name: "keep_gathered",
    tier: Tier::Preserving,
    summary: "keep forward's gathered weights for backward instead of gathering them again",
    contract: "Removes each all-gather that repeats an earlier one (same operand, same group: \
FSDP's backward re-gather) in the chosen blocks (all, default, or last:N transformer blocks), \
its readers reading the earlier result. Tier 1: the same bits. The earlier result lives on into \
backward; the predicted peak is reported before and after. Declines without repeated gathers \
and outside the chosen blocks.",
    option_help: Some("all (default) or last:N (the last N transformer blocks)"),
};

/// What a gather moves: a value, cast by the op when one is given.
type Moved<'g> = (ValueId, Option<&'g Op>);

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| Ok(Box::new(KeepGathered::parse(option)?)));
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepGathered {
    All,
    /// The last N transformer blocks.
    Last(u32),
}

impl KeepGathered {
    pub fn parse(option: Option<&str>) -> Result<KeepGathered, String> {
        match option {
            None | Some("all") => Ok(KeepGathered::All),
            Some(o) => match o.strip_prefix("last:").map(str::parse::<u32>) {
                Some(Ok(n)) if n > 0 => Ok(KeepGathered::Last(n)),
                _ => Err(format!(
                    "keep_gathered: unknown option `{o}`; expected all or last:N (N >= 1)"
                )),
            },
        }
    }
}

impl Pass for KeepGathered {
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
        let blocks = g.nodes.iter().filter_map(|n| n.meta.layer).max();
        let chosen = |layer: Option<u32>| match (*self, layer, blocks) {
            (KeepGathered::All, ..) => true,
            (KeepGathered::Last(n), Some(l), Some(last)) => l + n > last,
            _ => false,
        };
        let producers = g.producers();
        // What a gather moves: its operand, or, for a cast that only this gather reads
        // (`gather_bf16`'s bf16 shard, cast again before each gather), the cast's operand and
        // the cast, which goes with a removed gather.
        let moved = |operand: ValueId| -> (ValueId, Option<(usize, &Op)>) {
            match producers[operand.index()] {
                Some(c)
                    if matches!(g.nodes[c].op, Op::Cast { .. })
                        && users[operand.index()].len() == 1 =>
                {
                    (g.nodes[c].inputs[0], Some((c, &g.nodes[c].op)))
                }
                _ => (operand, None),
            }
        };
        // The first gather of each (what it moves, op) and its wait's result.
        let mut first: Vec<(Moved, &Op, ValueId)> = Vec::new();
        // Per value: what to read instead (a repeated gather's result -> the first's).
        let mut instead: Vec<Option<ValueId>> = vec![None; g.values.len()];
        let mut removed = vec![false; g.nodes.len()];
        let (mut kept, mut outside) = (0usize, 0usize);
        for (i, node) in g.nodes.iter().enumerate() {
            let Op::CollectiveStart {
                collective: Collective::AllGather { .. },
                ..
            } = &node.op
            else {
                continue;
            };
            let wait = match users[node.outputs[0].index()].as_slice() {
                [w] if matches!(g.nodes[*w].op, Op::Wait) => *w,
                _ => continue,
            };
            let (source, cast) = moved(node.inputs[0]);
            let key = (source, cast.map(|(_, op)| op));
            let result = g.nodes[wait].outputs[0];
            match first.iter().find(|(k, op, _)| *k == key && **op == node.op) {
                None => first.push((key, &node.op, result)),
                Some(_) if !chosen(node.meta.layer) => outside += 1,
                Some(&(_, _, earlier)) => {
                    instead[result.index()] = Some(earlier);
                    removed[i] = true;
                    removed[wait] = true;
                    if let Some((c, _)) = cast {
                        removed[c] = true;
                    }
                    kept += 1;
                }
            }
        }
        if outside > 0 {
            report.decline(
                None,
                "",
                format!("{outside} repeated gathers are outside the chosen blocks"),
            );
        }
        if kept == 0 {
            if outside == 0 {
                report.decline(None, "", "no all-gather repeats an earlier one");
            }
            return Ok((g.clone(), report));
        }
        let mut out = g.clone();
        out.nodes = g
            .nodes
            .iter()
            .zip(&removed)
            .filter(|(_, &r)| !r)
            .map(|(n, _)| Node {
                inputs: n
                    .inputs
                    .iter()
                    .map(|v| instead[v.index()].unwrap_or(*v))
                    .collect(),
                ..n.clone()
            })
            .collect();
        for o in &mut out.outputs {
            o.value = instead[o.value.index()].unwrap_or(o.value);
        }
        let (before, after) = (profile(g).peak_bytes, profile(&out).peak_bytes);
        report.change(format!(
            "kept {kept} gathered tensors from their first gather instead of gathering them \
again; predicted peak {} -> {}",
            human_bytes(before),
            human_bytes(after)
        ));
        report.metric("keep_gathered.kept", kept as f64);
        report.metric("keep_gathered.peak_bytes_before", before as f64);
        report.metric("keep_gathered.peak_bytes_after", after as f64);
        Ok((out.canonical(), report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    /// Two blocks' weights gathered in forward and again in backward.
    const TWO_BLOCKS: &str = "graph g {
  mesh dp_shard=2
  input %x: f32[2,4] @ [shard(0)]
  param %w: f32[2,4] @ [shard(0)]
  param %v: f32[2,4] @ [shard(0)]
  %3: f32[4,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.w
  %4: f32[4,4] = wait(%3)  # fwd layers.0.w
  %5: f32[2,4] = matmul(%x, %4)  # fwd layers.0.w
  %6: f32[4,4] = all_gather_start(%v, mesh_dims=[0], group=2, axis=0)  # fwd layers.1.v
  %7: f32[4,4] = wait(%6)  # fwd layers.1.v
  %8: f32[2,4] = matmul(%5, %7)  # fwd layers.1.v
  %9: f32[4,4] = all_gather_start(%v, mesh_dims=[0], group=2, axis=0)  # bwd layers.1.v
  %10: f32[4,4] = wait(%9)  # bwd layers.1.v
  %11: f32[4,4] = transpose(%10, perm=[1,0])  # bwd layers.1.v
  %12: f32[2,4] = matmul(%8, %11)  # bwd layers.1.v
  %13: f32[4,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # bwd layers.0.w
  %14: f32[4,4] = wait(%13)  # bwd layers.0.w
  %15: f32[4,4] = transpose(%14, perm=[1,0])  # bwd layers.0.w
  %16: f32[2,4] = matmul(%12, %15)  # bwd layers.0.w
  output y = %16 @ [shard(0)]
}";

    #[test]
    fn the_last_block_keeps_its_weights_and_the_first_gathers_again() {
        insta::assert_snapshot!(check(&KeepGathered::Last(1), TWO_BLOCKS));
        let all = check(&KeepGathered::All, TWO_BLOCKS);
        assert!(all.contains("kept 2 gathered tensors"), "{all}");
        assert_eq!(all.matches("all_gather_start").count(), 2, "{all}");
    }

    /// `gather_bf16`'s form: each gather moves a cast of the shard made just for it.
    #[test]
    fn gathers_of_bf16_casts_of_one_weight_repeat_each_other() {
        let cast_gathers = "graph g {
  mesh dp_shard=2
  input %x: bf16[2,4] @ [shard(0)]
  param %w: f32[2,4] @ [shard(0)]
  %2: bf16[2,4] = cast(%w, dtype=bf16)  # fwd layers.0.w
  %3: bf16[4,4] = all_gather_start(%2, mesh_dims=[0], group=2, axis=0)  # fwd layers.0.w
  %4: bf16[4,4] = wait(%3)  # fwd layers.0.w
  %5: bf16[2,4] = matmul(%x, %4)  # fwd layers.0.w
  %6: bf16[2,4] = cast(%w, dtype=bf16)  # bwd layers.0.w
  %7: bf16[4,4] = all_gather_start(%6, mesh_dims=[0], group=2, axis=0)  # bwd layers.0.w
  %8: bf16[4,4] = wait(%7)  # bwd layers.0.w
  %9: bf16[4,4] = transpose(%8, perm=[1,0])  # bwd layers.0.w
  %10: bf16[2,4] = matmul(%5, %9)  # bwd layers.0.w
  output y = %10 @ [shard(0)]
}";
        let out = check(&KeepGathered::All, cast_gathers);
        assert!(out.contains("kept 1 gathered tensors"), "{out}");
        assert_eq!(out.matches("all_gather_start").count(), 1, "{out}");
        assert_eq!(
            out.matches("cast(").count(),
            1,
            "the second cast went too: {out}"
        );
    }

    #[test]
    fn options_and_declines() {
        for bad in ["last:0", "first:2", "some"] {
            let e = KeepGathered::parse(Some(bad)).unwrap_err();
            assert!(e.contains("keep_gathered") && e.contains(bad), "{e}");
        }
        let out = check(
            &KeepGathered::All,
            "graph g {
  input %x: f32[2,4]
  %1: f32[2,4] = exp(%x)  # fwd a
  output y = %1
}",
        );
        assert!(out.contains("no mesh"), "{out}");
    }
}
