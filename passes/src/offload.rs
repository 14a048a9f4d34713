//! `offload`: moves saved activations to host memory between their last forward use and their
//! first backward use.
//!
//! Option: which values, optionally with how early to bring them back, joined by `;`:
//! - `tagged` (default): values whose producer is tagged `remat=offload`;
//! - `min_bytes:N`: every saved activation (a forward/loss value a backward/optimizer node reads)
//!   of at least N bytes;
//! - `prefetch:K` (K >= 1, default 1): the reload goes K backward nodes before the first backward
//!   reader (1 = right before it), so a backend can overlap the copy with compute.
//!
//! Changes: for each chosen value, inserts an `offload` node right after its last forward use (or
//! after its producer when forward never reads it), with the producer's module and the phase of
//! the node it follows (`fwd`, or `loss` there); and a `reload` node K nodes before its first
//! backward reader, phase `bwd` (`opt` if it lands among optimizer nodes). Backward readers read
//! the reload, so the device buffer dies at the offload. Both nodes carry `remat=offload`.
//!
//! What a backend does with them: the device backends (`wgpu`, `cuda`) keep an offloaded value
//! in host memory, outside the arena, from the offload to the reload; on `cpu` the arena is host
//! memory already, so the driver removes both nodes before lowering (`without_offloading`) and
//! adds to this pass's report that nothing moved.
//!
//! Guarantees: tier 1 (offload and reload are identities on values); phases stay monotone.
//! Running it again changes nothing: offloaded values have no backward reader left.
//!
//! Declines: a chosen value that is a graph output (it must stay on the device to the end), and
//! a `remat=offload`-tagged value that backward never reads (nothing to move).

use crate::memory::{human_bytes, profile};
use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use crate::substitute::{rebuild, Substitution};
use graphtrain_ir::{Graph, Meta, Node, Op, Phase, Remat, Tags, ValueId};

pub const OPTION_HELP: &str =
    "tagged (default) | min_bytes:N, optionally followed by ;prefetch:K (K >= 1, default 1)";

pub const INFO: PassInfo = PassInfo {
    name: "offload",
    tier: Tier::Preserving,
    summary: "move saved activations to host memory between forward and backward",
    contract: "For each chosen saved activation (tagged: producer has remat=offload; min_bytes:N: \
at least N bytes), inserts `offload` right after its last forward use and `reload` K backward \
nodes before its first backward reader (prefetch:K, default 1); backward readers read the reload. \
Tier 1: both ops are identities on values. Phases stay monotone. Declines for graph outputs and \
for tagged values no backward node reads. wgpu and cuda hold offloaded values in host memory, \
outside the arena; on cpu, whose arena is host memory, nothing moves and the nodes are removed \
before lowering.",
    option_help: Some(OPTION_HELP),
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |opt| Ok(Box::new(Offload::parse(opt)?)));
}

/// Which values to offload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Select {
    Tagged,
    MinBytes(usize),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Offload {
    pub select: Select,
    /// Backward nodes between the reload and the first reader, plus one.
    pub prefetch: usize,
}

impl Offload {
    /// Parses the option (see the module docs); `None` is `tagged` with prefetch 1.
    pub fn parse(option: Option<&str>) -> Result<Offload, String> {
        let mut select = None;
        let mut prefetch = None;
        for item in option.unwrap_or("tagged").split(';').map(str::trim) {
            let number = |s: &str, what: &str| -> Result<usize, String> {
                s.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("`{item}`: `{s}` is not {what}"))
            };
            let (slot, value) = if item == "tagged" {
                (&mut select, None)
            } else if let Some(n) = item.strip_prefix("min_bytes:") {
                (&mut select, Some(number(n, "a byte count")?))
            } else if let Some(k) = item.strip_prefix("prefetch:") {
                let k = number(k, "a node count")?;
                if k == 0 {
                    return Err(format!("`{item}`: prefetch counts from 1 (right before)"));
                }
                if prefetch.replace(k).is_some() {
                    return Err(format!("`{item}`: prefetch is given twice"));
                }
                continue;
            } else {
                return Err(format!("unknown offload option `{item}`"));
            };
            let chosen = match value {
                None => Select::Tagged,
                Some(n) => Select::MinBytes(n),
            };
            if slot.replace(chosen).is_some() {
                return Err(format!(
                    "`{item}`: choose one of `tagged` and `min_bytes:N`"
                ));
            }
        }
        Ok(Offload {
            select: select.unwrap_or(Select::Tagged),
            prefetch: prefetch.unwrap_or(1),
        })
    }
}

/// `g` with every `offload` and `reload` removed (their readers read the value itself) and the
/// number of values that were offloaded; `None` when `g` has none. For a backend whose arena is
/// host memory, where moving a value to host memory would be a copy that frees nothing.
pub fn without_offloading(g: &Graph) -> Option<(Graph, usize)> {
    let mut subst = Substitution::new(g);
    let mut offloaded = 0;
    let keep: Vec<bool> = g
        .nodes
        .iter()
        .map(|n| {
            let moves = matches!(n.op, Op::Offload | Op::Reload);
            if moves {
                subst.set(n.outputs[0], n.inputs[0]);
                offloaded += usize::from(matches!(n.op, Op::Offload));
            }
            !moves
        })
        .collect();
    (offloaded > 0).then(|| (rebuild(g, g.nodes.clone(), &keep, &subst), offloaded))
}

impl Pass for Offload {
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
        let Some(first_bwd) = g.nodes.iter().position(|n| n.meta.phase >= Phase::Backward) else {
            return Ok((g.clone(), report));
        };
        let is_output = |v: usize| g.outputs.iter().any(|o| o.value.index() == v);

        // (value, offload after this node, reload before this node)
        let mut moves: Vec<(ValueId, usize, usize)> = Vec::new();
        for (v, prod) in producers.iter().enumerate() {
            let Some(p) = *prod else { continue };
            let pn = &g.nodes[p];
            if pn.meta.phase > Phase::Loss || matches!(pn.op, Op::Offload | Op::Reload) {
                continue;
            }
            let first_bwd_use = users[v]
                .iter()
                .copied()
                .find(|&u| g.nodes[u].meta.phase >= Phase::Backward);
            let chosen = match self.select {
                Select::Tagged => pn.meta.tags.remat == Some(Remat::Offload),
                Select::MinBytes(n) => first_bwd_use.is_some() && g.values[v].size_bytes() >= n,
            };
            if !chosen {
                continue;
            }
            let Some(first_use) = first_bwd_use else {
                report.decline(
                    Some(p),
                    pn.meta.module.clone(),
                    format!(
                        "{} is tagged offload but no backward node reads it",
                        pn.op.name()
                    ),
                );
                continue;
            };
            if is_output(v) {
                report.decline(
                    Some(p),
                    pn.meta.module.clone(),
                    format!(
                        "{} is a graph output and must stay on the device",
                        pn.op.name()
                    ),
                );
                continue;
            }
            let last_fwd_use = users[v]
                .iter()
                .copied()
                .filter(|&u| g.nodes[u].meta.phase <= Phase::Loss)
                .max()
                .unwrap_or(p);
            let reload_at = first_use
                .saturating_sub(self.prefetch.saturating_sub(1))
                .max(first_bwd);
            moves.push((ValueId(v as u32), last_fwd_use, reload_at));
        }
        if moves.is_empty() {
            return Ok((g.clone(), report));
        }

        let mut out = g.clone();
        let mut after: Vec<Vec<Node>> = vec![Vec::new(); g.nodes.len()];
        let mut before: Vec<Vec<Node>> = vec![Vec::new(); g.nodes.len()];
        let mut reloaded: Vec<Option<ValueId>> = vec![None; g.values.len()];
        let mut moved_bytes = 0usize;
        for &(v, off_after, reload_at) in &moves {
            let src = &g.nodes[producers[v.index()].unwrap_or(off_after)];
            let ty = g.ty(v).clone();
            moved_bytes += ty.size_bytes();
            // Each copy runs where it is placed: the phase and micro-batch of its neighbour.
            let meta = |at: usize| Meta {
                module: src.meta.module.clone(),
                phase: g.nodes[at].meta.phase,
                micro_batch: g.nodes[at].meta.micro_batch,
                layer: src.meta.layer,
                tags: Tags {
                    remat: Some(Remat::Offload),
                    ..Tags::default()
                },
            };
            let host = ValueId(out.values.len() as u32);
            out.values.push(ty.clone());
            let dev = ValueId(out.values.len() as u32);
            out.values.push(ty);
            after[off_after].push(Node {
                op: Op::Offload,
                inputs: vec![v],
                outputs: vec![host],
                meta: meta(off_after),
            });
            before[reload_at].push(Node {
                op: Op::Reload,
                inputs: vec![host],
                outputs: vec![dev],
                meta: meta(reload_at),
            });
            reloaded[v.index()] = Some(dev);
        }
        let mut nodes = Vec::with_capacity(g.nodes.len() + 2 * moves.len());
        for (i, n) in g.nodes.iter().enumerate() {
            nodes.append(&mut before[i]);
            let mut n = n.clone();
            if n.meta.phase >= Phase::Backward {
                for v in &mut n.inputs {
                    *v = reloaded[v.index()].unwrap_or(*v);
                }
            }
            nodes.push(n);
            nodes.append(&mut after[i]);
        }
        out.nodes = nodes;
        let out = out.canonical();

        let (pb, pa) = (profile(g), profile(&out));
        report.change(format!(
            "offloaded {} value(s), {} to host; predicted device peak {} -> {}",
            moves.len(),
            human_bytes(moved_bytes),
            human_bytes(pb.peak_bytes),
            human_bytes(pa.peak_bytes)
        ));
        report.metric("offloaded_bytes", moved_bytes as f64);
        report.metric("peak_bytes_before", pb.peak_bytes as f64);
        report.metric("peak_bytes_after", pa.peak_bytes as f64);
        Ok((out, report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    const GRAPH: &str = "graph g {
  input %x: f32[16]
  %1: f32[16] = exp(%x)  # fwd a remat=offload
  %2: f32[16] = sin(%1)  # fwd b
  %3: f32[4] = slice(%2, axis=0, start=0, end=4)  # fwd c
  %4: f32[] = reduce_sum(%2, axes=[0], keepdim=false)  # loss
  %5: f32[16] = neg(%x)  # bwd b
  %6: f32[16] = mul(%5, %2)  # bwd b
  %7: f32[16] = mul(%6, %1)  # bwd a
  output loss = %4
  output g = %7
  output s = %3
}";

    fn offload(opt: &str) -> Offload {
        Offload::parse(Some(opt)).unwrap()
    }

    #[test]
    fn tagged_values_move_after_their_last_forward_use() {
        insta::assert_snapshot!(check(&offload("tagged"), GRAPH));
    }

    #[test]
    fn min_bytes_with_prefetch() {
        // %2 is last read in loss (its offload is a loss node) and %1 in forward; both reloads
        // go two backward nodes before their readers, clamped to the start of backward.
        insta::assert_snapshot!(check(&offload("min_bytes:64;prefetch:2"), GRAPH));
    }

    #[test]
    fn small_values_and_outputs_stay() {
        let out = check(&offload("min_bytes:65"), GRAPH);
        assert!(out.starts_with("// no change"), "{out}");
        let out = check(
            &Offload::parse(None).unwrap(),
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd a remat=offload
  %2: f32[4] = neg(%1)  # bwd
  output y = %1
  output g = %2
}",
        );
        assert!(out.contains("graph output"), "{out}");
    }

    #[test]
    fn running_twice_changes_nothing_more() {
        let once = crate::testing::try_check(&offload("min_bytes:1"), GRAPH).unwrap();
        let (_, report) = offload("min_bytes:1").run(&once.graph).unwrap();
        assert!(report.is_noop(), "{report}");
    }

    #[test]
    fn options_are_parsed_with_clear_errors() {
        assert_eq!(
            Offload::parse(Some("min_bytes:1024;prefetch:3")),
            Ok(Offload {
                select: Select::MinBytes(1024),
                prefetch: 3
            })
        );
        assert_eq!(
            Offload::parse(Some("prefetch:2")),
            Ok(Offload {
                select: Select::Tagged,
                prefetch: 2
            })
        );
        for (bad, why) in [
            ("min_bytes:lots", "not a byte count"),
            ("prefetch:0", "counts from 1"),
            ("tagged;min_bytes:4", "choose one"),
            ("prefetch:1;prefetch:2", "twice"),
            ("everything", "unknown offload option"),
        ] {
            let e = Offload::parse(Some(bad)).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        let e = Registry::builtin()
            .build("offload", Some("everything"))
            .err()
            .unwrap_or_default();
        assert!(e.contains("min_bytes:N"), "{e}");
    }
}
