//! `ac_policy`: the deciding half of activation checkpointing. Tags forward nodes
//! `remat=save` or `remat=recompute`; `remat` (or `ac`, which runs both) acts on the tags.
//!
//! Structure every policy shares, as in PyTorch where each transformer block is wrapped in a
//! checkpoint region:
//! - forward/loss nodes outside transformer layers (`meta.layer` is `None`: embedding, final
//!   norm, output head, loss) are saved;
//! - a value that leaves its layer (read by a forward node of another layer, or outside layers)
//!   is the next region's input and is saved, so recomputation never crosses a layer;
//! - the policy decides every other forward node of a layer (the candidates).
//!
//! Policies (the option string):
//! - `full`: every candidate is recomputed; only layer inputs stay saved.
//! - `selective` (default): save the outputs of matmul, attention, embedding and cross_entropy,
//!   recompute pointwise, layout, norm and rope ops (PyTorch's selective AC / torchtitan op-SAC).
//! - `names:PAT1;PAT2`: save candidates whose module path starts with one of the patterns,
//!   segment by segment (`layers.1` matches `layers.1.attention` but not `layers.10`; `*` matches
//!   any one segment, so `layers.*.attention.wq` names wq in every layer); recompute the rest.
//! - `budget:F`, 0 < F <= 1: save at most F × the no-AC saved activation bytes with as few
//!   recompute FLOPs as the solver finds (see [`solve_budget`] for the algorithm and its gap).
//!
//! Changes: only `meta.tags.remat` of forward/loss nodes. Nodes tagged `offload` keep their tag
//! (an explicit offload choice wins, and such a value is never recomputed); backward and
//! optimizer nodes are untouched. Guarantees: tier 1, no node or value changes.
//! Declines: when the graph has no forward node inside a transformer layer there is nothing to
//! decide; and `budget:F` reports when F is below what saving only the layer inputs reaches (it
//! then tags like `full`).

use crate::memory::human_bytes;
use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use crate::remat::{plan, RematPlan};
use graphtrain_ir::{Graph, Op, Phase, Remat};

pub const OPTION_HELP: &str =
    "full | selective (default) | names:PAT1;PAT2 (module path prefixes, `*` = any segment) | \
budget:F (0 < F <= 1)";

pub const INFO: PassInfo = PassInfo {
    name: "ac_policy",
    tier: Tier::Preserving,
    summary: "tag forward nodes remat=save|recompute by an activation-checkpointing policy",
    contract: "Tags forward/loss nodes remat=save or remat=recompute; nothing else changes. \
Outside transformer layers everything is saved, and a value leaving its layer is saved (recompute \
never crosses a layer). Inside layers: full recomputes everything else; selective saves matmul, \
attention, embedding and cross_entropy outputs; names:PAT;.. saves modules with those path \
prefixes; budget:F saves at most F x the no-AC saved bytes with few recompute FLOPs (greedy). \
offload tags are kept. Tier 1. Declines on a graph with no forward node inside a layer.",
    option_help: Some(OPTION_HELP),
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |opt| {
        Ok(Box::new(AcPolicy {
            policy: Policy::parse(opt)?,
        }))
    });
}

/// An activation-checkpointing policy, parsed from the pass option.
#[derive(Clone, Debug, PartialEq)]
pub enum Policy {
    Full,
    Selective,
    /// Module path patterns whose nodes are saved.
    Names(Vec<String>),
    /// Fraction of the no-AC saved activation bytes.
    Budget(f64),
}

impl Policy {
    /// Parses `full`, `selective`, `names:PAT1;PAT2` or `budget:F`; `None` means `selective`.
    pub fn parse(option: Option<&str>) -> Result<Policy, String> {
        let Some(option) = option else {
            return Ok(Policy::Selective);
        };
        match option.trim() {
            "full" => return Ok(Policy::Full),
            "selective" => return Ok(Policy::Selective),
            _ => {}
        }
        if let Some(list) = option.trim().strip_prefix("names:") {
            let mut patterns = Vec::new();
            for pat in list.split(';').map(str::trim) {
                let ok = !pat.is_empty()
                    && pat.split('.').all(|seg| {
                        !seg.is_empty()
                            && (seg == "*"
                                || seg.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
                    });
                if !ok {
                    return Err(format!(
                        "`names:{list}`: `{pat}` is not a module path pattern (dot-separated \
segments of letters, digits and `_`, or `*`)"
                    ));
                }
                patterns.push(pat.to_string());
            }
            return Ok(Policy::Names(patterns));
        }
        if let Some(f) = option.trim().strip_prefix("budget:") {
            let frac: f64 = f
                .trim()
                .parse()
                .map_err(|_| format!("`budget:{f}`: `{f}` is not a number"))?;
            if !(frac > 0.0 && frac <= 1.0) {
                return Err(format!(
                    "`budget:{f}`: the fraction must be in (0, 1], got {frac}"
                ));
            }
            return Ok(Policy::Budget(frac));
        }
        Err(format!(
            "unknown activation-checkpointing policy `{option}`"
        ))
    }

    /// The option string that parses back to this policy.
    pub fn label(&self) -> String {
        match self {
            Policy::Full => "full".into(),
            Policy::Selective => "selective".into(),
            Policy::Names(p) => format!("names:{}", p.join(";")),
            Policy::Budget(f) => format!("budget:{f}"),
        }
    }
}

/// `pattern` is a segment-wise prefix of `module`, `*` matching any one segment.
fn module_matches(pattern: &str, module: &str) -> bool {
    let mut segs = module.split('.');
    pattern
        .split('.')
        .all(|p| segs.next().is_some_and(|m| p == "*" || p == m))
}

/// Ops whose outputs selective AC saves: the expensive ones to recompute.
fn selective_saves(op: &Op) -> bool {
    matches!(
        op,
        Op::Matmul | Op::Attention { .. } | Op::Embedding | Op::CrossEntropy
    )
}

/// Per forward node: whether the policy may choose for it (inside a layer, not producing a value
/// that leaves the layer, not tagged `offload`).
pub fn candidates(g: &Graph) -> Vec<bool> {
    let producers = g.producers();
    let mut leaves_layer = vec![false; g.nodes.len()];
    for n in g.nodes.iter().filter(|n| n.meta.phase <= Phase::Loss) {
        for v in &n.inputs {
            if let Some(p) = producers[v.index()] {
                if g.nodes[p].meta.layer != n.meta.layer {
                    leaves_layer[p] = true;
                }
            }
        }
    }
    g.nodes
        .iter()
        .enumerate()
        .map(|(i, n)| {
            n.meta.phase <= Phase::Loss
                && n.meta.layer.is_some()
                && !leaves_layer[i]
                && n.meta.tags.remat != Some(Remat::Offload)
        })
        .collect()
}

/// Where the budget solver landed.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetPoint {
    /// The requested fraction F.
    pub fraction: f64,
    /// Saved activation bytes without AC.
    pub no_ac_bytes: usize,
    /// F × `no_ac_bytes`, rounded down.
    pub budget_bytes: usize,
    /// What recomputing every candidate leaves saved: the least any policy here reaches.
    pub floor_bytes: usize,
    pub saved_bytes: usize,
    pub recompute_flops: f64,
    /// `saved_bytes <= budget_bytes`.
    pub reached: bool,
}

impl BudgetPoint {
    /// Achieved saved bytes as a fraction of the budget (1.0 = exactly on budget).
    pub fn fraction_of_budget(&self) -> f64 {
        self.saved_bytes as f64 / self.budget_bytes.max(1) as f64
    }
}

/// The policy's decision: a tag per node (`None`: leave the node's tag as it is).
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub tags: Vec<Option<Remat>>,
    pub budget: Option<BudgetPoint>,
}

/// Decides the tags of every forward node of `g` under `policy`.
pub fn decide(g: &Graph, policy: &Policy) -> Decision {
    let cand = candidates(g);
    let mut budget = None;
    let recompute: Vec<bool> = match policy {
        Policy::Full => cand.clone(),
        Policy::Selective => g
            .nodes
            .iter()
            .zip(&cand)
            .map(|(n, c)| *c && !selective_saves(&n.op))
            .collect(),
        Policy::Names(patterns) => g
            .nodes
            .iter()
            .zip(&cand)
            .map(|(n, c)| *c && !patterns.iter().any(|p| module_matches(p, &n.meta.module)))
            .collect(),
        Policy::Budget(frac) => {
            let (r, point) = solve_budget(g, &cand, *frac);
            budget = Some(point);
            r
        }
    };
    let tags = g
        .nodes
        .iter()
        .zip(&recompute)
        .map(|(n, r)| {
            if n.meta.phase > Phase::Loss || n.meta.tags.remat == Some(Remat::Offload) {
                None
            } else if *r {
                Some(Remat::Recompute)
            } else {
                Some(Remat::Save)
            }
        })
        .collect();
    Decision { tags, budget }
}

/// The budget solver: which candidates to recompute so that saved activation bytes stay within
/// `frac` × the no-AC figure, with few recompute FLOPs.
///
/// Algorithm (greedy with cost updates, then repair), every trial scored exactly by
/// [`crate::remat::plan`], so that recompute chains and newly saved inputs are accounted:
/// 1. From "save everything", repeatedly apply the move with the fewest extra FLOPs per byte it
///    frees, until the saved bytes fit. A move recomputes one currently saved candidate, either
///    alone (its inputs become saved) or together with the chain of its unsaved candidate
///    ancestors up to values already saved (so a rope → transpose chain in front of attention
///    can be dropped as a whole; one-node moves alone would see no gain there).
/// 2. Repair: while some recomputed candidate can be saved again without breaking the budget,
///    save the one that removes the most FLOPs per byte it adds. This pulls the result back up
///    to the budget when the last greedy move overshot.
///
/// Cost: each trial is a linear plan, O(N). All C candidates are scored once; after a move only
/// the candidates of the touched layer are scored again, so the total is about
/// O(C · N · (1 + moves / layers)) instead of O(C² · N).
///
/// Optimality gap: no bound is guaranteed. The exact problem (Checkmate's ILP, a knapsack with
/// precedence constraints) is NP-hard; the greedy can miss choices that only pay off in
/// combinations wider than one ancestor chain, and the repair undoes one node at a time. What
/// holds on exit: saving again any recomputed node that costs FLOPs would break the budget, so
/// the unused slack is below the bytes of the cheapest such undo. Not compared against an exact
/// solver; on the Llama `peer` step it lands at 98.5% of the budget for F = 0.5 and 0.25, with
/// 25% (3.2 GFLOP) and 73% (9.4 GFLOP) of `full`'s recompute FLOPs.
pub fn solve_budget(g: &Graph, cand: &[bool], frac: f64) -> (Vec<bool>, BudgetPoint) {
    let n = g.nodes.len();
    let base = plan(g, |_| false);
    let floor = plan(g, |i| cand[i]);
    let budget_bytes = (frac * base.saved_bytes as f64).floor() as usize;
    let point = |p: &RematPlan| BudgetPoint {
        fraction: frac,
        no_ac_bytes: base.saved_bytes,
        budget_bytes,
        floor_bytes: floor.saved_bytes,
        saved_bytes: p.saved_bytes,
        recompute_flops: p.recompute_flops,
        reached: p.saved_bytes <= budget_bytes,
    };
    if floor.saved_bytes > budget_bytes {
        return (cand.to_vec(), point(&floor));
    }
    let producers = g.producers();
    // Every policy saves the values that leave a layer, so recomputation never reads across a
    // layer boundary and a move changes the plan only inside the layers of the nodes it tags.
    // Scores of candidates elsewhere stay exact; only the touched layers are scored again.
    // (Nodes outside any layer touch everything, conservatively.)
    let layer = |i: usize| g.nodes[i].meta.layer;
    let affected = |moved: &[usize], c: usize| {
        moved
            .iter()
            .any(|&i| layer(i).is_none() || layer(i) == layer(c))
    };

    // Phase 1 scores: (extra flops per freed byte, freed bytes, the move) of candidate `c`.
    let drop_score = |c: usize, r: &[bool], cur: &RematPlan| -> Option<(f64, usize, Vec<usize>)> {
        if !cand[c] || r[c] || !g.nodes[c].outputs.iter().any(|o| cur.saved[o.index()]) {
            return None;
        }
        let alone = vec![c];
        let chain = unsaved_chain(g, &producers, cand, r, cur, c);
        let moves = if chain.len() > 1 {
            vec![alone, chain]
        } else {
            vec![alone]
        };
        let mut best: Option<(f64, usize, Vec<usize>)> = None;
        for mv in moves {
            let trial = plan(g, |i| r[i] || mv.contains(&i));
            let Some(freed) = cur.saved_bytes.checked_sub(trial.saved_bytes) else {
                continue;
            };
            if freed == 0 {
                continue;
            }
            let cost = (trial.recompute_flops - cur.recompute_flops).max(0.0) / freed as f64;
            if best
                .as_ref()
                .is_none_or(|(bc, bf, _)| cost < *bc || (cost == *bc && freed > *bf))
            {
                best = Some((cost, freed, mv));
            }
        }
        best
    };

    let mut r = vec![false; n];
    let mut cur = base.clone();
    let mut scores: Vec<_> = (0..n).map(|c| drop_score(c, &r, &cur)).collect();
    while cur.saved_bytes > budget_bytes {
        let mut best: Option<usize> = None;
        for (c, s) in scores.iter().enumerate() {
            let Some((cost, freed, _)) = s else { continue };
            let better = match best.and_then(|b| scores[b].as_ref()) {
                None => true,
                Some((bc, bf, _)) => cost < bc || (cost == bc && freed > bf),
            };
            if better {
                best = Some(c);
            }
        }
        match best.and_then(|c| scores[c].take()) {
            Some((_, _, mv)) => {
                for &i in &mv {
                    r[i] = true;
                }
                cur = plan(g, |i| r[i]);
                for (c, score) in scores.iter_mut().enumerate() {
                    if affected(&mv, c) {
                        *score = drop_score(c, &r, &cur);
                    }
                }
            }
            // No single move frees bytes any more: start the repair from the floor, which fits.
            None => {
                r = cand.to_vec();
                cur = floor.clone();
            }
        }
    }

    // Phase 2 scores: (bytes added, flops removed) by saving recomputed candidate `c` again,
    // both local to its layer, so they stay valid until that layer changes.
    let undo_delta = |c: usize, r: &[bool], cur: &RematPlan| -> Option<(i64, f64)> {
        if !r[c] || !cur.recompute[c] {
            return None;
        }
        let trial = plan(g, |i| r[i] && i != c);
        Some((
            trial.saved_bytes as i64 - cur.saved_bytes as i64,
            cur.recompute_flops - trial.recompute_flops,
        ))
    };
    let mut deltas: Vec<_> = (0..n).map(|c| undo_delta(c, &r, &cur)).collect();
    loop {
        // (flops removed per added byte, the node to save again)
        let mut best: Option<(f64, usize)> = None;
        for (c, d) in deltas.iter().enumerate() {
            let Some((added, removed)) = *d else { continue };
            let trial_saved = cur.saved_bytes as i64 + added;
            if trial_saved > budget_bytes as i64 || removed <= 0.0 {
                continue;
            }
            let score = removed / added.max(1) as f64;
            if best.is_none_or(|(b, _)| score > b) {
                best = Some((score, c));
            }
        }
        let Some((_, c)) = best else { break };
        r[c] = false;
        cur = plan(g, |i| r[i]);
        for (k, delta) in deltas.iter_mut().enumerate() {
            if affected(&[c], k) {
                *delta = undo_delta(k, &r, &cur);
            }
        }
    }
    (r, point(&cur))
}

/// `c` plus its candidate ancestors that are neither saved nor recomputed now, reached through
/// such ancestors only: recomputing all of them reads only values already saved.
fn unsaved_chain(
    g: &Graph,
    producers: &[Option<usize>],
    cand: &[bool],
    r: &[bool],
    cur: &RematPlan,
    c: usize,
) -> Vec<usize> {
    let mut chain = vec![c];
    let mut k = 0;
    while k < chain.len() {
        for v in &g.nodes[chain[k]].inputs {
            let Some(q) = producers[v.index()] else {
                continue;
            };
            if cand[q] && !r[q] && !cur.saved[v.index()] && !chain.contains(&q) {
                chain.push(q);
            }
        }
        k += 1;
    }
    chain
}

/// Writes `decision` into a copy of `g`.
pub fn apply_tags(g: &Graph, decision: &Decision) -> Graph {
    let mut out = g.clone();
    for (n, t) in out.nodes.iter_mut().zip(&decision.tags) {
        if let Some(t) = t {
            n.meta.tags.remat = Some(*t);
        }
    }
    out
}

/// Tags `g` under `policy`, adding to `report` what the policy decided; shared with `ac`.
pub(crate) fn tag(g: &Graph, policy: &Policy, report: &mut PassReport) -> Graph {
    if !g
        .nodes
        .iter()
        .any(|n| n.meta.phase <= Phase::Loss && n.meta.layer.is_some())
    {
        report.decline(
            None,
            "",
            format!(
                "no forward node belongs to a transformer layer (meta.layer); policy `{}` only \
decides inside layers",
                policy.label()
            ),
        );
        return g.clone();
    }
    let decision = decide(g, policy);
    let out = apply_tags(g, &decision);
    let count = |r: Remat| decision.tags.iter().filter(|t| **t == Some(r)).count();
    let changed = g
        .nodes
        .iter()
        .zip(&out.nodes)
        .filter(|(a, b)| a.meta.tags.remat != b.meta.tags.remat)
        .count();
    if changed > 0 {
        report.change(format!(
            "policy `{}`: tagged {} node(s) save, {} recompute",
            policy.label(),
            count(Remat::Save),
            count(Remat::Recompute)
        ));
    }
    if let Some(b) = &decision.budget {
        if !b.reached {
            report.decline(
                None,
                "",
                format!(
                    "budget {} ({}) is below the floor {} that saving only layer inputs and \
non-layer values reaches; tagged like `full`",
                    b.fraction,
                    human_bytes(b.budget_bytes),
                    human_bytes(b.floor_bytes)
                ),
            );
        }
        report.metric("budget_fraction", b.fraction);
        report.metric("budget_bytes", b.budget_bytes as f64);
        report.metric("budget_saved_bytes", b.saved_bytes as f64);
        report.metric("budget_fraction_of_budget", b.fraction_of_budget());
        report.metric(
            "budget_fraction_of_no_ac",
            b.saved_bytes as f64 / b.no_ac_bytes.max(1) as f64,
        );
        report.metric("budget_recompute_flops", b.recompute_flops);
    }
    out
}

pub struct AcPolicy {
    pub policy: Policy,
}

impl Pass for AcPolicy {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let out = tag(g, &self.policy, &mut report);
        if !report.is_noop() {
            let p = crate::remat::plan_from_tags(&out);
            report.metric("planned_saved_activation_bytes", p.saved_bytes as f64);
            report.metric("planned_recompute_flops", p.recompute_flops);
        }
        Ok((out, report))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::testing::check;

    /// Two layers of `y = x + w2·silu(w1·norm(x))` (pointwise and matmul ops, a layer boundary),
    /// with a hand-written backward that reads the usual saved values.
    pub(crate) const TWO_LAYERS: &str = "graph g {
  input %x: f32[2,4]
  param %n0: f32[4]
  param %w0: f32[4,4]
  param %n1: f32[4]
  param %w1: f32[4,4]
  %5: f32[2,4] = rms_norm(%x, %n0, eps=1e-5)  # fwd layers.0.norm
  %6: f32[2,4] = matmul(%5, %w0)  # fwd layers.0.mlp.w
  %7: f32[2,4] = silu(%6)  # fwd layers.0.mlp
  %8: f32[2,4] = add(%x, %7)  # fwd layers.0
  %9: f32[2,4] = rms_norm(%8, %n1, eps=1e-5)  # fwd layers.1.norm
  %10: f32[2,4] = matmul(%9, %w1)  # fwd layers.1.mlp.w
  %11: f32[2,4] = silu(%10)  # fwd layers.1.mlp
  %12: f32[2,4] = add(%8, %11)  # fwd layers.1
  %13: f32[] = reduce_sum(%12, axes=[0,1], keepdim=false)  # loss
  %14: f32[2,4] = sigmoid(%10)  # bwd layers.1.mlp
  %15: f32[2,4] = mul(%14, %11)  # bwd layers.1.mlp
  %16: f32[2,4] = mul(%9, %15)  # bwd layers.1.mlp.w
  %17: f32[2,4] = mul(%15, %8)  # bwd layers.1.norm
  %18: f32[2,4] = sigmoid(%6)  # bwd layers.0.mlp
  %19: f32[2,4] = mul(%18, %17)  # bwd layers.0.mlp
  %20: f32[2,4] = mul(%19, %7)  # bwd layers.0.mlp
  %21: f32[2,4] = mul(%5, %20)  # bwd layers.0.mlp.w
  output loss = %13
  output g1 = %16
  output g0 = %21
}";

    fn policy(opt: &str) -> AcPolicy {
        AcPolicy {
            policy: Policy::parse(Some(opt)).unwrap(),
        }
    }

    #[test]
    fn full_saves_only_layer_inputs() {
        insta::assert_snapshot!(check(&policy("full"), TWO_LAYERS));
    }

    #[test]
    fn selective_saves_matmuls() {
        insta::assert_snapshot!(check(&policy("selective"), TWO_LAYERS));
    }

    #[test]
    fn names_saves_matching_modules_in_every_layer() {
        insta::assert_snapshot!(check(&policy("names:layers.*.norm"), TWO_LAYERS));
    }

    #[test]
    fn budget_fits_and_reports_its_point() {
        insta::assert_snapshot!(check(&policy("budget:0.6"), TWO_LAYERS));
    }

    #[test]
    fn budget_below_the_floor_is_reported() {
        let out = check(&policy("budget:0.01"), TWO_LAYERS);
        assert!(out.contains("below the floor"), "{out}");
    }

    #[test]
    fn offload_tags_survive() {
        let src = TWO_LAYERS.replace("# fwd layers.0.mlp\n", "# fwd layers.0.mlp remat=offload\n");
        let out = check(&policy("full"), &src);
        assert!(
            out.contains("silu(%6)  # fwd layers.0.mlp remat=offload"),
            "{out}"
        );
    }

    #[test]
    fn graphs_without_layers_are_declined() {
        let out = check(
            &policy("full"),
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd a
  %2: f32[4] = mul(%1, %x)  # bwd
  output g = %2
}",
        );
        assert!(out.starts_with("// no change"), "{out}");
        assert!(out.contains("transformer layer"), "{out}");
    }

    #[test]
    fn options_are_parsed_with_clear_errors() {
        assert_eq!(Policy::parse(None), Ok(Policy::Selective));
        assert_eq!(
            Policy::parse(Some("names:layers.*.attention;output")),
            Ok(Policy::Names(vec![
                "layers.*.attention".into(),
                "output".into()
            ]))
        );
        assert_eq!(Policy::parse(Some("budget:0.25")), Ok(Policy::Budget(0.25)));
        for (bad, why) in [
            ("budget:0", "(0, 1]"),
            ("budget:1.5", "(0, 1]"),
            ("budget:NaN", "(0, 1]"),
            ("budget:half", "not a number"),
            ("names:", "not a module path pattern"),
            ("names:a..b", "not a module path pattern"),
            ("everything", "unknown activation-checkpointing policy"),
        ] {
            let e = Policy::parse(Some(bad)).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        // Through the registry, the error lists what is accepted.
        let e = Registry::builtin()
            .build("ac_policy", Some("everything"))
            .err()
            .unwrap_or_default();
        assert!(e.contains("budget:F"), "{e}");
    }

    #[test]
    fn module_patterns_match_whole_segments() {
        assert!(module_matches("layers.1", "layers.1.attention.wq"));
        assert!(!module_matches("layers.1", "layers.10.attention"));
        assert!(module_matches(
            "layers.*.attention",
            "layers.7.attention.wo"
        ));
        assert!(!module_matches(
            "layers.*.attention.wq",
            "layers.7.attention"
        ));
    }
}
