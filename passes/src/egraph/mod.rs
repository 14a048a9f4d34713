//! `egraph`: equality saturation over the whole train step, and `rewrite`, the same machinery
//! driven by a rule file.
//!
//! Changes: the graph is loaded into an e-graph (egg), where hashconsing already merges duplicate
//! nodes; directional rules (`rules.rs`, or a rule file for `rewrite`) add equivalent forms; the
//! extractor (`extract.rs`) picks, per needed value, the form that makes the whole DAG smallest,
//! counting shared subgraphs once; and a graph is rebuilt from the picks. Unused nodes disappear
//! on the way, as with `cse` + `dce`.
//!
//! Guarantees:
//! - same inputs (names, kinds, order, types) and outputs (names, donations), verifier-clean;
//! - tier 1 by default: only rules exact in IEEE arithmetic run. `tier2` adds reassociation and
//!   reciprocal rules and makes the pass tier 2. A rule file declares its tier (`rulefile.rs`);
//! - types never change: a rule application whose right side has another type than what it
//!   matched is refused and listed in the report; a union of differently typed classes that gets
//!   through anyway fails the pass rather than emitting a wrong graph;
//! - every extracted node takes the metadata (module path, phase, layer, tags) of the earliest
//!   input node of its e-class; a node new to the graph takes its consumer's. Nodes keep their
//!   input schedule position where they have one, the rest is fixed up topologically with phases
//!   kept monotone;
//! - bounded: egg's runner stops at the iteration, e-node or time limit, whichever comes first,
//!   and the best graph found by then is extracted. (The limits are checked between iterations,
//!   so one iteration can overshoot them; extraction is bounded by work budgets, not the clock.) The report gives the e-graph size, iterations,
//!   the stop reason, the time, node counts before and after, and how often each rule fired.
//!
//! Declines (returns its input unchanged, saying why): when the graph already holds activation
//! checkpointing's recompute copies (the e-graph would merge them back into the forward values
//! they replace; run `egraph` before `ac`), when extraction finds no acyclic choice,
//! when the rebuilt graph fails the verifier (a donation read too late, say), or when it is not
//! smaller than the input: better to keep a known-good schedule than to churn it for nothing.
//!
//! Options (`egraph=iters:8;nodes:100000;ms:2000;tier2`): iteration limit, e-node limit, time
//! limit in milliseconds, and the tier-2 rule group. `rewrite=FILE` takes a rule file.

pub mod analysis;
pub mod extract;
pub mod lang;
pub mod rule;
pub mod rulefile;
pub mod rules;

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use crate::substitute::is_recompute_copy;
use analysis::{GraphAnalysis, EG};
use egg::{Id, Language, Runner, StopReason};
use extract::Origin;
use graphtrain_ir::{verify, Graph};
use lang::GNode;
use rule::Rule;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

pub use rulefile::{load_rules, parse_rules, RuleFile, RuleFileError};

pub const INFO: PassInfo = PassInfo {
    name: "egraph",
    tier: Tier::Preserving,
    summary: "equality saturation with built-in rules, DAG-cost extraction",
    contract: "Loads the graph into an e-graph, applies the built-in directional rules (tier 1: \
exact in IEEE arithmetic; `tier2` adds reassociation and reciprocals and makes the pass tier 2) \
within iteration, e-node and time limits, and extracts the smallest DAG (shared subgraphs counted \
once). Same inputs and outputs, types never change (type-changing applications are refused and \
reported), nodes keep the metadata and schedule position of their e-class's earliest input node. \
Declines, returning the input, when extraction is cyclic, the result fails the verifier, or it is \
not smaller.",
    option_help: Some("iters:N;nodes:N;ms:N;tier2 (defaults iters:8;nodes:100000;ms:2000)"),
};

pub const REWRITE_INFO: PassInfo = PassInfo {
    name: "rewrite",
    // The real tier is the one the file declares; the registry shows the worst case.
    tier: Tier::Changing,
    summary: "apply the rules of a rule file through the e-graph (rewrite=FILE)",
    contract: "Like `egraph`, but with the rules of the rule file given as option instead of the \
built-in ones. The pass has the tier the file declares (`tier 1` or `tier 2`; tier 1 if it says \
nothing), which tests hold it to. Rules that provably change a type are refused when the file is \
loaded; other type-changing applications are skipped and reported.",
    option_help: Some("FILE, a rule file (see passes/examples/rules/layout.rules)"),
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |opt| {
        let options = Options::parse(opt.unwrap_or(""))?;
        Ok(Box::new(Saturate::builtin(options)))
    });
    r.register(REWRITE_INFO, |opt| {
        let path = opt.ok_or("needs a rule file: rewrite=FILE")?;
        let file = load_rules(Path::new(path)).map_err(|e| e.to_string())?;
        Ok(Box::new(Saturate::from_rule_file(file, Limits::default())))
    });
}

/// When the runner stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    pub iterations: usize,
    pub nodes: usize,
    pub time: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            iterations: 8,
            nodes: 100_000,
            time: Duration::from_millis(2000),
        }
    }
}

/// The `egraph` pass options.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    pub limits: Limits,
    pub tier2: bool,
}

impl Options {
    /// Parses `iters:N;nodes:N;ms:N;tier2` (any subset, any order).
    pub fn parse(s: &str) -> Result<Options, String> {
        let mut o = Options::default();
        for item in s.split(';').map(str::trim).filter(|i| !i.is_empty()) {
            if item == "tier2" {
                o.tier2 = true;
                continue;
            }
            let (key, value) = item
                .split_once(':')
                .ok_or_else(|| format!("option `{item}` is not `key:value` or `tier2`"))?;
            let n: u64 = value
                .trim()
                .parse()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("`{key}` needs a positive integer, got `{value}`"))?;
            match key.trim() {
                "iters" => o.limits.iterations = n as usize,
                "nodes" => o.limits.nodes = n as usize,
                "ms" => o.limits.time = Duration::from_millis(n),
                other => return Err(format!("unknown option `{other}`")),
            }
        }
        Ok(o)
    }
}

/// Equality saturation with a fixed rule set: the `egraph` and `rewrite` passes.
pub struct Saturate {
    name: &'static str,
    tier: Tier,
    rules: Vec<Rule>,
    limits: Limits,
}

impl Saturate {
    /// The `egraph` pass: built-in rules of the tier the options ask for.
    pub fn builtin(options: Options) -> Self {
        let tier = if options.tier2 {
            Tier::Changing
        } else {
            Tier::Preserving
        };
        Saturate {
            name: INFO.name,
            tier,
            rules: rules::rules_for(tier),
            limits: options.limits,
        }
    }

    /// The `rewrite` pass: the rules of a rule file, at the tier it declares.
    pub fn from_rule_file(file: RuleFile, limits: Limits) -> Self {
        Saturate {
            name: REWRITE_INFO.name,
            tier: file.tier,
            rules: file.rules,
            limits,
        }
    }

    pub fn rules(&self) -> &[Rule] {
        &self.rules
    }
}

impl Pass for Saturate {
    fn name(&self) -> &str {
        self.name
    }

    fn tier(&self) -> Tier {
        self.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let fail = |message: String| PassError {
            pass: self.name.to_string(),
            message,
        };
        // Hashconsing would merge activation checkpointing's backward copies back into their
        // forward originals and silently undo it.
        if let Some(i) = g.nodes.iter().position(is_recompute_copy) {
            let mut report = PassReport::default();
            report.decline(
                Some(i),
                g.nodes[i].meta.module.clone(),
                "the graph holds remat=recompute copies, which the e-graph would merge back into \
                 their forward originals; run egraph before ac/remat",
            );
            return Ok((g.clone(), report));
        }
        let start = Instant::now();
        let loaded = load(g).map_err(fail)?;
        let rewrites = self
            .rules
            .iter()
            .map(Rule::to_rewrite)
            .collect::<Result<Vec<_>, _>>()
            .map_err(fail)?;
        let mut runner: Runner<GNode, GraphAnalysis> = Runner::new(GraphAnalysis::default())
            .with_egraph(loaded.egraph)
            .with_iter_limit(self.limits.iterations)
            .with_node_limit(self.limits.nodes)
            .with_time_limit(self.limits.time)
            .run(&rewrites);
        let egraph = std::mem::take(&mut runner.egraph);
        let mut report = PassReport::default();
        if let Some(c) = egraph.analysis.conflicts.first() {
            return Err(fail(format!(
                "a rule equated values of different types: {c}"
            )));
        }
        for (refusal, count) in count(&egraph.analysis.refused) {
            report.decline(
                None,
                "",
                format!(
                    "rule `{}` refused {count} time(s): it would replace a {} value by {}",
                    refusal.rule, refusal.matched, refusal.replacement
                ),
            );
        }
        let mut fired: BTreeMap<String, usize> = BTreeMap::new();
        for it in &runner.iterations {
            for (rule, n) in &it.applied {
                *fired.entry(rule.to_string()).or_default() += n;
            }
        }
        let stop = runner
            .stop_reason
            .clone()
            .unwrap_or(StopReason::Other("not run".into()));
        if !matches!(stop, StopReason::Saturated) {
            report.decline(
                None,
                "",
                format!(
                    "stopped before saturation ({}); extracted the best graph found so far",
                    describe_stop(&stop)
                ),
            );
        }

        let roots: Vec<Id> = loaded.roots.iter().map(|&r| egraph.find(r)).collect();
        let order: Vec<Id> = loaded.order.iter().map(|&c| egraph.find(c)).collect();
        let original: HashSet<GNode> = loaded
            .nodes
            .iter()
            .map(|n| n.clone().map_children(|c| egraph.find(c)))
            .collect();
        let mut origins: HashMap<Id, Origin> = HashMap::new();
        for (id, origin) in loaded.origins {
            // The earliest input node of a class wins.
            origins.entry(egraph.find(id)).or_insert(origin);
        }
        let result = extract::extract_dag(&egraph, &roots, &order, &original)
            .and_then(|choice| extract::rebuild(g, &egraph, &choice, &roots, &origins))
            .and_then(|out| {
                verify(&out)
                    .map(|_| out)
                    .map_err(|e| format!("the rebuilt graph fails the verifier: {e}"))
            });

        report.metric("egraph.nodes", egraph.total_number_of_nodes() as f64);
        report.metric("egraph.classes", egraph.number_of_classes() as f64);
        report.metric("iterations", runner.iterations.len() as f64);
        report.metric("nodes.before", g.nodes.len() as f64);
        for (rule, n) in &fired {
            report.metric(format!("fired.{rule}"), *n as f64);
        }
        let out = match result {
            Ok(out)
                if out.nodes.len() < g.nodes.len()
                    || (out.nodes.len() == g.nodes.len() && out == g.canonical()) =>
            {
                out
            }
            Ok(out) => {
                report.decline(
                    None,
                    "",
                    format!(
                        "the extracted graph has {} nodes, not fewer than the input's {}; kept the input",
                        out.nodes.len(),
                        g.nodes.len()
                    ),
                );
                g.clone()
            }
            Err(why) => {
                report.decline(None, "", format!("kept the input: {why}"));
                g.clone()
            }
        };
        report.metric("nodes.after", out.nodes.len() as f64);
        let saturate: f64 = runner.iterations.iter().map(|i| i.total_time).sum();
        report.metric("time_ms.saturate", saturate * 1e3);
        report.metric("time_ms", start.elapsed().as_secs_f64() * 1e3);
        if out.nodes.len() < g.nodes.len() {
            report.change(format!(
                "{} -> {} nodes; rules fired: {}",
                g.nodes.len(),
                out.nodes.len(),
                if fired.is_empty() {
                    "none (duplicates and dead nodes only)".to_string()
                } else {
                    fired
                        .iter()
                        .map(|(r, n)| format!("{r} ×{n}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                }
            ));
            Ok((out, report))
        } else {
            Ok((g.clone(), report))
        }
    }
}

fn describe_stop(s: &StopReason) -> String {
    match s {
        StopReason::Saturated => "saturated".into(),
        StopReason::IterationLimit(n) => format!("iteration limit, {n} iterations"),
        StopReason::NodeLimit(n) => format!("e-node limit, {n} e-nodes"),
        StopReason::TimeLimit(t) => format!("time limit, {:.0} ms", t * 1e3),
        StopReason::Other(o) => o.clone(),
    }
}

/// Identical refusals folded into one, with a count, in first-seen order.
fn count(refused: &[analysis::Refusal]) -> Vec<(&analysis::Refusal, usize)> {
    let mut out: Vec<(&analysis::Refusal, usize)> = Vec::new();
    for r in refused {
        match out.iter_mut().find(|(s, _)| *s == r) {
            Some((_, n)) => *n += 1,
            None => out.push((r, 1)),
        }
    }
    out
}

/// A graph loaded into an e-graph.
struct Loaded {
    egraph: EG,
    /// Class of every graph output, in order.
    roots: Vec<Id>,
    /// Classes in schedule order (inputs, then nodes).
    order: Vec<Id>,
    /// The input graph's nodes as e-nodes.
    nodes: Vec<GNode>,
    /// (class, origin) of every input node, in schedule order.
    origins: Vec<(Id, Origin)>,
}

fn load(g: &Graph) -> Result<Loaded, String> {
    let types = g.inputs.iter().map(|i| g.ty(i.value).clone()).collect();
    let mut egraph = EG::new(GraphAnalysis::new(types));
    let mut class: Vec<Option<Id>> = vec![None; g.values.len()];
    let mut order = Vec::new();
    let mut nodes = Vec::new();
    let mut origins = Vec::new();
    for (k, input) in g.inputs.iter().enumerate() {
        let id = egraph.add(GNode::Input(k as u32));
        class[input.value.index()] = Some(id);
        order.push(id);
    }
    for (i, n) in g.nodes.iter().enumerate() {
        let children = n
            .inputs
            .iter()
            .map(|v| class.get(v.index()).copied().flatten())
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| format!("node {i} ({}) reads an undefined value", n.op.name()))?;
        let node = GNode::op(&n.op, children);
        let id = egraph.add(node.clone());
        if let analysis::ClassType::Invalid(why) = &egraph[id].data {
            return Err(format!(
                "node {i} ({}) does not type-check: {why}",
                n.op.name()
            ));
        }
        nodes.push(node);
        order.push(id);
        origins.push((
            id,
            Origin {
                position: i,
                meta: n.meta.clone(),
            },
        ));
        if n.outputs.len() == 1 {
            class[n.outputs[0].index()] = Some(id);
        } else {
            for (k, out) in n.outputs.iter().enumerate() {
                class[out.index()] = Some(egraph.add(GNode::Get(k as u32, [id])));
            }
        }
    }
    let roots = g
        .outputs
        .iter()
        .map(|o| {
            class
                .get(o.value.index())
                .copied()
                .flatten()
                .ok_or_else(|| format!("output `{}` is undefined", o.name))
        })
        .collect::<Result<Vec<_>, _>>()?;
    egraph.rebuild();
    Ok(Loaded {
        egraph,
        roots,
        order,
        nodes,
        origins,
    })
}

#[cfg(test)]
mod tests;
