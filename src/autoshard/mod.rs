//! `autoshard`: chooses where every parameter of a Llama model lives on a mesh, and writes the
//! choice as a [`Plan`] (the RON format of the hand-written Llama plan), so it can be read,
//! edited, diffed and given to `run --plan`. Like `parallelize`, which turns a plan into the
//! SPMD step, it runs before `--passes`; it is not a pipeline pass.
//!
//! The choice, per *class* of parameters (the parameters of the repeated transformer blocks
//! with the layer index as `*`: `layers.*.attention.wq.weight`), solved once and shared by every
//! block: a placement on every mesh dimension (`tp`: replicate or shard an axis; `dp_shard`:
//! replicate, as DDP, or shard an axis, as FSDP; `dp_replicate`: replicate), never two
//! dimensions on one axis; and for the whole plan, sequence parallelism and the output head's
//! pin (each of the four combinations is solved; with no `tp`, only the first).
//!
//! How, in the manner of Alpa's intra-operator pass:
//! 1. The `tp` choices of classes in one module (`layers.*.attention`: `wq`, `wk`, `wv`, `wo`)
//!    interact through the activations between them, so each combination of them is built and
//!    priced: `parallelize` gives the SPMD step of a one-block model with that group placed so
//!    and every other parameter replicated, and `cost::graph_cost` prices it (compute per node
//!    as a roofline, each collective by alpha-beta on its link, peak memory by liveness). What it
//!    adds to the all-replicated step, times the blocks, is the combination's cost;
//!    combinations `parallelize` refuses are left out.
//! 2. A class's `dp_shard` choice adds, in closed form at the same rates: the FSDP all-gather in
//!    forward and again in backward plus the gradient's reduce-scatter, instead of the
//!    gradient's all-reduce; the optimizer's update on a shard (it reads the parameter, the
//!    gradient and each state tensor and writes the parameter and the states: 7 floats an
//!    element for AdamW, 3 for SGD); and the bytes held per element (parameter, gradient and
//!    the optimizer's states: 16 for AdamW, 8 for SGD) divided by the shards. The gathered copy
//!    of the weight in use is not counted.
//! 3. An integer linear program (`milp`, solved by CBC) picks one candidate per class and one
//!    combination per group, consistent with each other, under the memory limit, minimizing
//!    the sum. The groups' terms are exact only around the context they were priced in (the
//!    other groups' placements), so the sum is a model; each proposal is then built whole (one
//!    and two blocks, extrapolated to the model's depth: times add over nodes) and priced
//!    exactly, excluded, and the ILP proposes again, `proposals` times; while nothing priced
//!    fits the limit, it also proposes the least memory it can. Then the terms are priced again
//!    around the best plan so far (at most `ROUNDS` times, until it stays). The best proposal by
//!    the exact price that fits the limit wins.
//!
//! What it guarantees: the plan it returns is one `parallelize` accepts for this model and
//! mesh, fits the memory limit by the exact price, and the cost it reports is that price; user
//! placements (`Fix`) are constraints it never breaks. It declines, naming why: a fix that
//! matches no parameter or names a dimension the mesh lacks; a memory limit no proposal fits
//! (the error gives the smallest memory it found).
//!
//! Why CBC: COIN-OR's branch and cut, which Debian ships as a library
//! (`coinor-libcbc-dev`), so a clean build links it instead of compiling a solver (HiGHS would
//! be built from its C++ sources on every clean build); these programs have a few hundred
//! binaries and solve in milliseconds.

pub mod cost;
mod milp;
pub mod survey;

use crate::sim::hardware::Hardware;
use crate::sim::Links;
use crate::sim::Rates;
use cost::{graph_cost, Cost};
use graphtrain_ir::autocast::Precision;
use graphtrain_ir::mesh::{Mesh, Placement, Reduce};
use graphtrain_ir::op::Collective;
use graphtrain_ir::optim::OptimConfig;
use graphtrain_models::Llama3Config;
use graphtrain_passes::parallelize::{glob, ParamRule, PinRule, Plan};
use milp::{ClassVars, Delta, GroupVars, Ilp, Minimize};
use std::collections::BTreeMap;
use std::time::Instant;

/// What the solver is asked.
pub struct Options<'a> {
    pub model: Llama3Config,
    pub mesh: Mesh,
    pub optim: OptimConfig,
    pub precision: Precision,
    pub hardware: &'a Hardware,
    pub links: Links,
    /// The most bytes a rank may hold at its peak.
    pub memory_limit: Option<f64>,
    pub fixed: Vec<Fix>,
    /// How many proposals the ILP makes per global choice (each priced exactly).
    pub proposals: usize,
}

/// A user's placement for the parameters a pattern matches: the solver keeps it.
#[derive(Clone, Debug, PartialEq)]
pub struct Fix {
    pub pattern: String,
    pub placements: BTreeMap<String, Placement>,
}

impl Fix {
    /// Reads `PATTERN=DIM:PLACEMENT[,DIM:PLACEMENT]`, e.g. `*.wq.weight=tp:shard(0),dp_shard:replicate`.
    pub fn parse(s: &str) -> Result<Fix, String> {
        let (pattern, rest) = s.split_once('=').ok_or_else(|| {
            format!("`{s}`: expected PATTERN=DIM:PLACEMENT[,DIM:PLACEMENT], as in `*.wq.weight=tp:shard(0)`")
        })?;
        let mut placements = BTreeMap::new();
        for entry in rest.split(',').filter(|e| !e.trim().is_empty()) {
            let (dim, p) = entry
                .split_once(':')
                .ok_or_else(|| format!("`{s}`: `{entry}` is not DIM:PLACEMENT"))?;
            placements.insert(
                dim.trim().to_string(),
                Placement::parse(p).map_err(|e| format!("`{s}`: {e}"))?,
            );
        }
        if placements.is_empty() {
            return Err(format!("`{s}`: no placement given"));
        }
        Ok(Fix {
            pattern: pattern.trim().to_string(),
            placements,
        })
    }
}

/// The solver's answer.
pub struct Solved {
    pub plan: Plan,
    /// The exact price of `plan` (the model's depth extrapolated from one and two blocks).
    pub cost: Cost,
    /// What the ILP predicted for it, seconds and peak bytes, when it proposed it as the
    /// fastest (`None`: it came from minimizing memory, where time was not the objective).
    pub predicted: Option<(f64, f64)>,
    pub classes: usize,
    /// Group combinations built and priced, and how many `parallelize` refused.
    pub combinations: usize,
    pub refused: usize,
    pub ilp_solves: usize,
    pub seconds: f64,
    /// One line per proposal: global choice, predicted and exact price.
    pub log: Vec<String>,
}

/// One class of parameters: the same name up to the layer index.
struct Class {
    pattern: String,
    names: Vec<String>,
    shape: Vec<usize>,
    /// Blocks it repeats in (1 outside the blocks).
    repeats: f64,
    /// Its `tp` placements (index 0 is replicate).
    tp: Vec<Placement>,
    candidates: Vec<Candidate>,
}

struct Candidate {
    /// Placements on the mesh dimensions that are not replicate.
    placements: BTreeMap<String, Placement>,
    /// Index into the class's `tp` placements.
    tp: usize,
}

struct Group {
    classes: Vec<usize>,
    repeats: f64,
}

/// The global choices: sequence parallelism and the output head's pin.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Global {
    sequence_parallel: bool,
    pin_output: bool,
}

impl std::fmt::Display for Global {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "sequence parallel {}, output {}",
            if self.sequence_parallel { "on" } else { "off" },
            if self.pin_output {
                "pinned replicate"
            } else {
                "unpinned"
            }
        )
    }
}

/// Rounds of linearization per global choice, at most.
const ROUNDS: usize = 3;

struct Linearized {
    groups: Vec<GroupVars>,
    priced: usize,
    refused: usize,
}

const TP: &str = "tp";
const DP_SHARD: &str = "dp_shard";
const DP_REPLICATE: &str = "dp_replicate";

/// `layers.3.attention.wq.weight` -> `layers.*.attention.wq.weight`.
fn class_pattern(name: &str) -> String {
    name.split('.')
        .map(|s| {
            if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
                "*"
            } else {
                s
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// The module a class's module sits in: `layers.*.attention.wq.weight` -> `layers.*.attention`.
fn group_key(pattern: &str) -> String {
    let parts: Vec<&str> = pattern.split('.').collect();
    parts[..parts.len().saturating_sub(2)].join(".")
}

pub struct Solver<'a> {
    opts: &'a Options<'a>,
    rates: Rates<'a>,
    classes: Vec<Class>,
    groups: Vec<Group>,
}

impl<'a> Solver<'a> {
    pub fn new(opts: &'a Options<'a>) -> Result<Solver<'a>, String> {
        let traced = opts
            .model
            .trace(graphtrain_ir::DType::F32)
            .map_err(|e| format!("autoshard: tracing the model: {e}"))?;
        let mesh = &opts.mesh;
        for d in &mesh.dims {
            if ![TP, DP_SHARD, DP_REPLICATE].contains(&d.name.as_str()) && d.size > 1 {
                return Err(format!(
                    "autoshard: mesh dimension `{}` is not supported (only dp_replicate, dp_shard and tp are built)",
                    d.name
                ));
            }
        }
        let mut classes: Vec<Class> = Vec::new();
        for p in &traced.params {
            let pattern = class_pattern(&p.name);
            if let Some(c) = classes.iter_mut().find(|c| c.pattern == pattern) {
                c.names.push(p.name.clone());
                c.repeats += 1.0;
                continue;
            }
            let shape = traced.graph.ty(p.value).shape.clone();
            let (tp, candidates) = candidates_of(&shape, mesh);
            classes.push(Class {
                pattern,
                names: vec![p.name.clone()],
                shape,
                repeats: 1.0,
                tp,
                candidates,
            });
        }
        let mut keys: Vec<String> = Vec::new();
        let mut groups: Vec<Group> = Vec::new();
        for (c, class) in classes.iter().enumerate() {
            let key = group_key(&class.pattern);
            match keys.iter().position(|k| *k == key) {
                Some(g) => groups[g].classes.push(c),
                None => {
                    keys.push(key);
                    groups.push(Group {
                        classes: vec![c],
                        repeats: class.repeats,
                    });
                }
            }
        }
        for fix in &opts.fixed {
            for dim in fix.placements.keys() {
                if mesh.dim(dim).is_none() {
                    return Err(format!(
                        "--fix {}: `{dim}` is not a dimension of the mesh {mesh}",
                        fix.pattern
                    ));
                }
            }
            if !classes
                .iter()
                .any(|c| c.names.iter().any(|n| glob(&fix.pattern, n)))
            {
                return Err(format!(
                    "--fix {}: matches no parameter (parameters are named like {})",
                    fix.pattern,
                    classes
                        .iter()
                        .take(3)
                        .map(|c| c.names[0].as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
        let rates = Rates::new(opts.hardware, opts.links, mesh.world_size());
        Ok(Solver {
            opts,
            rates,
            classes,
            groups,
        })
    }

    /// The plan with each class at `chosen` (a candidate index per class).
    fn plan_of(&self, chosen: &[usize], global: Global) -> Plan {
        let params = self
            .classes
            .iter()
            .zip(chosen)
            .filter(|(c, &k)| !c.candidates[k].placements.is_empty())
            .map(|(c, &k)| ParamRule {
                pattern: c.pattern.clone(),
                placements: c.candidates[k].placements.clone(),
            })
            .collect();
        self.plan_with(params, global)
    }

    fn plan_with(&self, params: Vec<ParamRule>, global: Global) -> Plan {
        Plan {
            params,
            sequence_parallel: global.sequence_parallel,
            pins: if global.pin_output {
                vec![PinRule {
                    module: "output".into(),
                    placements: BTreeMap::from([(TP.to_string(), Placement::Replicate)]),
                }]
            } else {
                Vec::new()
            },
        }
    }

    /// The price of `plan` on a model of `layers` blocks.
    fn price_at(&self, plan: &Plan, layers: usize) -> Result<Cost, String> {
        let mut model = self.opts.model.clone();
        model.n_layers = layers;
        let step = crate::trainer::build_spmd_step_in(
            &model,
            &self.opts.mesh,
            plan,
            &self.opts.optim,
            self.opts.precision,
        )
        .map_err(|e| e.to_string())?;
        Ok(graph_cost(&step.step.graph, &self.rates))
    }

    /// The exact price of `plan` on the whole model: one and two blocks built, the rest
    /// extrapolated (every block is the same graph, so times add exactly; the peak memory is
    /// extrapolated the same way).
    pub fn price(&self, plan: &Plan) -> Result<Cost, String> {
        match self.opts.model.n_layers {
            2 => self.price_at(plan, 2),
            _ => self.price_from(plan, self.price_at(plan, 1)?),
        }
    }

    /// `price`, given the one-block price already built.
    fn price_from(&self, plan: &Plan, one: Cost) -> Result<Cost, String> {
        match self.opts.model.n_layers {
            1 => Ok(one),
            2 => self.price_at(plan, 2),
            layers => Ok(one.extrapolate(&self.price_at(plan, 2)?, (layers - 1) as f64)),
        }
    }

    /// What class `c`'s candidate `k` adds over its `tp` placement with `dp_shard` replicated.
    fn data_parallel_delta(&self, c: &Class, k: &Candidate) -> Delta {
        let mesh = &self.opts.mesh;
        let (Some(ds), Some(Placement::Shard(_))) =
            (mesh.dim(DP_SHARD), k.placements.get(DP_SHARD))
        else {
            return Delta::default();
        };
        let n = mesh.dims[ds].size as f64;
        let tp_split = match k.placements.get(TP) {
            Some(Placement::Shard(_)) => mesh.size_of(TP) as f64,
            _ => 1.0,
        };
        let bytes = c.shape.iter().product::<usize>() as f64 * 4.0 / tp_split;
        let data_dims: Vec<usize> = [DP_REPLICATE, DP_SHARD]
            .iter()
            .filter_map(|d| mesh.dim(d))
            .collect();
        let replicate_dims: Vec<usize> = mesh.dim(DP_REPLICATE).into_iter().collect();
        let r = &self.rates;
        let sum = Reduce::Sum;
        // Per element, in floats: what the update reads and writes, and what a rank holds.
        let states = self.opts.optim.optimizer.state_names().len() as f64;
        let (update, held) = (3.0 + 2.0 * states, 2.0 + states);
        let sharded = 2.0
            * r.collective_seconds(Collective::AllGather { axis: 0 }, mesh, &[ds], bytes / n)
            + r.collective_seconds(
                Collective::ReduceScatter {
                    axis: 0,
                    reduce: sum,
                },
                mesh,
                &[ds],
                bytes,
            )
            + r.collective_seconds(
                Collective::AllReduce { reduce: sum },
                mesh,
                &replicate_dims,
                bytes / n,
            )
            + r.memory_seconds(update * bytes / n);
        let replicated = r.collective_seconds(
            Collective::AllReduce { reduce: sum },
            mesh,
            &data_dims,
            bytes,
        ) + r.memory_seconds(update * bytes);
        Delta {
            seconds: (sharded - replicated) * c.repeats,
            bytes: held * bytes * (1.0 / n - 1.0) * c.repeats,
        }
    }

    /// Each class's `tp` placement index under `chosen` candidates.
    fn tp_of(&self, chosen: &[usize]) -> Vec<usize> {
        self.classes
            .iter()
            .zip(chosen)
            .map(|(c, &k)| c.candidates[k].tp)
            .collect()
    }

    /// The plan with each class at `tp` index `tp[c]` and replicated over the data dims.
    fn tp_plan(&self, tp: &[usize], global: Global) -> Plan {
        let params = self
            .classes
            .iter()
            .zip(tp)
            .filter(|(_, &t)| t > 0)
            .map(|(c, &t)| ParamRule {
                pattern: c.pattern.clone(),
                placements: BTreeMap::from([(TP.to_string(), c.tp[t])]),
            })
            .collect();
        self.plan_with(params, global)
    }

    /// The ILP's terms around `context` (a `tp` placement index per class): the whole model's
    /// price at the context, and per group what each combination of its classes' placements
    /// adds, the other classes staying at the context.
    fn linearize(&self, global: Global, context: &[usize]) -> Result<(Linearized, Delta), String> {
        let at_context = self.tp_plan(context, global);
        let one = self.price_at(&at_context, 1)?;
        let whole = self.price_from(&at_context, one)?;
        let mut out = Linearized {
            groups: Vec::new(),
            priced: 0,
            refused: 0,
        };
        for group in &self.groups {
            let options: Vec<usize> = group
                .classes
                .iter()
                .map(|&c| self.classes[c].tp.len())
                .collect();
            if options.iter().all(|&n| n == 1) {
                continue;
            }
            let mut combos = Vec::new();
            for combo in product(&options) {
                let mut tp = context.to_vec();
                for (&c, &t) in group.classes.iter().zip(&combo) {
                    tp[c] = t;
                }
                if tp == context {
                    combos.push((combo, Delta::default()));
                    continue;
                }
                out.priced += 1;
                match self.price_at(&self.tp_plan(&tp, global), 1) {
                    Ok(cost) => combos.push((
                        combo,
                        Delta {
                            seconds: (cost.seconds() - one.seconds()) * group.repeats,
                            bytes: (cost.peak_bytes - one.peak_bytes) * group.repeats,
                        },
                    )),
                    Err(_) => out.refused += 1,
                }
            }
            out.groups.push(GroupVars {
                classes: group.classes.clone(),
                combos,
            });
        }
        Ok((
            out,
            Delta {
                seconds: whole.seconds(),
                bytes: whole.peak_bytes,
            },
        ))
    }

    fn allowed(&self, c: &Class, k: &Candidate) -> bool {
        self.opts
            .fixed
            .iter()
            .filter(|f| c.names.iter().any(|n| glob(&f.pattern, n)))
            .all(|f| {
                f.placements.iter().all(|(dim, want)| {
                    let size = self.opts.mesh.size_of(dim);
                    let have = k
                        .placements
                        .get(dim)
                        .copied()
                        .unwrap_or(Placement::Replicate);
                    // On a dimension of size 1 everything is replicated.
                    size <= 1 || have == *want
                })
            })
    }

    /// Solves, proposal by proposal, for each global choice.
    pub fn solve(&self) -> Result<Solved, String> {
        self.solve_or_smallest().map_err(|(e, _)| e)
    }

    /// `solve`, and where no plan fits the limit, the plan with the smallest peak it priced
    /// beside the error (passes after it, such as activation checkpointing, may make it fit).
    pub fn solve_or_smallest(&self) -> Result<Solved, (String, Option<Plan>)> {
        let t0 = Instant::now();
        let tp = self.opts.mesh.size_of(TP) > 1;
        let globals: Vec<Global> = if tp {
            [(false, false), (false, true), (true, false), (true, true)]
                .iter()
                .map(|&(s, p)| Global {
                    sequence_parallel: s,
                    pin_output: p,
                })
                .collect()
        } else {
            vec![Global {
                sequence_parallel: false,
                pin_output: false,
            }]
        };
        let class_vars: Vec<ClassVars> = self
            .classes
            .iter()
            .map(|c| ClassVars {
                candidates: c
                    .candidates
                    .iter()
                    .map(|k| (k.tp, self.data_parallel_delta(c, k)))
                    .collect(),
                allowed: c.candidates.iter().map(|k| self.allowed(c, k)).collect(),
            })
            .collect();
        // The plan, its price, and what the ILP predicted for it.
        type Best = (Plan, Cost, Option<(f64, f64)>);
        let mut best: Option<Best> = None;
        let mut best_tp: Option<(Vec<usize>, f64)> = None;
        let mut smallest: Option<(Plan, Cost)> = None;
        let (mut combinations, mut refused, mut ilp_solves) = (0, 0, 0);
        let mut log = Vec::new();
        for global in globals {
            // Rounds: the ILP's sums are exact at the context (every class's `tp` placement
            // outside the group being priced); each round moves the context to the best plan
            // priced so far under this global choice, until it stays.
            // The first context: every parameter replicated, or where that does not build
            // under this global choice (sequence parallelism around unsplit weights), the
            // `tp` placements of the best plan so far.
            let mut context = vec![0usize; self.classes.len()];
            let mut excluded: Vec<Vec<usize>> = Vec::new();
            let mut incumbent: Option<(Vec<usize>, f64)> = None;
            for round in 0..ROUNDS {
                let mut linearized = self.linearize(global, &context);
                if let (Err(_), 0, Some((plan_tp, _))) = (&linearized, round, &best_tp) {
                    context = plan_tp.clone();
                    linearized = self.linearize(global, &context);
                }
                let (group_vars, base) = match linearized {
                    Ok(l) => l,
                    Err(e) => {
                        log.push(format!("{global}: declined: {e}"));
                        break;
                    }
                };
                combinations += group_vars.priced;
                refused += group_vars.refused;
                let ilp = |memory_limit: Option<f64>, excluded: &[Vec<usize>], minimize| {
                    let ilp = Ilp {
                        classes: &class_vars,
                        groups: &group_vars.groups,
                        base,
                        memory_limit,
                        excluded,
                    };
                    milp::solve(&ilp, minimize)
                };
                // Proposals for time, then, while nothing priced fits the limit, the one
                // the ILP thinks smallest (its memory sums are a model: a plan it thinks over
                // the limit may fit, and the next round linearizes around it).
                let mut smallest_here: Option<Vec<usize>> = None;
                for proposal in 0..=self.opts.proposals.max(1) {
                    let minimize = if proposal < self.opts.proposals.max(1) {
                        Minimize::Time
                    } else if self.opts.memory_limit.is_some() && incumbent.is_none() {
                        Minimize::Memory
                    } else {
                        break;
                    };
                    ilp_solves += 1;
                    let solution = match minimize {
                        Minimize::Time => ilp(self.opts.memory_limit, &excluded, minimize),
                        Minimize::Memory => ilp(None, &[], minimize),
                    }
                    .map_err(|e| (e, None))?;
                    let Some((chosen, predicted)) = solution else {
                        continue;
                    };
                    let plan = self.plan_of(&chosen, global);
                    match self.price(&plan) {
                        Ok(cost) => {
                            let fits = self.opts.memory_limit.is_none_or(|l| cost.peak_bytes <= l);
                            log.push(format!(
                                "{global}: {} predicted {:.3} ms, priced {:.3} ms ({} collectives), peak {}{}",
                                match minimize {
                                    Minimize::Time => "fastest",
                                    Minimize::Memory => "smallest",
                                },
                                predicted.seconds * 1e3,
                                cost.seconds() * 1e3,
                                cost.collectives,
                                human(cost.peak_bytes),
                                if fits { "" } else { ", over the limit" }
                            ));
                            if smallest
                                .as_ref()
                                .is_none_or(|(_, s)| cost.peak_bytes < s.peak_bytes)
                            {
                                smallest = Some((plan.clone(), cost));
                                smallest_here = Some(self.tp_of(&chosen));
                            }
                            if fits && incumbent.as_ref().is_none_or(|(_, b)| cost.seconds() < *b) {
                                incumbent = Some((chosen.clone(), cost.seconds()));
                            }
                            if fits
                                && best
                                    .as_ref()
                                    .is_none_or(|(_, b, _)| cost.seconds() < b.seconds())
                            {
                                best_tp = Some((self.tp_of(&chosen), cost.seconds()));
                                let predicted = (minimize == Minimize::Time)
                                    .then_some((predicted.seconds, predicted.bytes));
                                best = Some((plan, cost, predicted));
                            }
                        }
                        Err(e) => log.push(format!("{global}: a proposal does not build: {e}")),
                    }
                    if minimize == Minimize::Time {
                        excluded.push(chosen);
                    }
                }
                let next = match (&incumbent, smallest_here) {
                    (Some((chosen, _)), _) => self.tp_of(chosen),
                    (None, Some(tp)) => tp,
                    (None, None) => break,
                };
                if next == context {
                    break;
                }
                context = next;
            }
        }
        let Some((plan, cost, predicted)) = best else {
            let limit = self.opts.memory_limit.map(human).unwrap_or_default();
            return Err(match smallest {
                Some((plan, s)) => (
                    format!(
                        "autoshard: no plan fits the memory limit {limit} on the mesh {}: the smallest peak found is {} a rank",
                        self.opts.mesh,
                        human(s.peak_bytes)
                    ),
                    Some(plan),
                ),
                None => (
                    format!(
                        "autoshard: no plan builds on the mesh {}:\n  {}",
                        self.opts.mesh,
                        log.join("\n  ")
                    ),
                    None,
                ),
            });
        };
        Ok(Solved {
            plan,
            cost,
            predicted,
            classes: self.classes.len(),
            combinations,
            refused,
            ilp_solves,
            seconds: t0.elapsed().as_secs_f64(),
            log,
        })
    }
}

/// A class's `tp` placements and its candidates: every combination of a placement per mesh
/// dimension (replicate, or on `tp` and `dp_shard` a shard of an axis the dimension divides),
/// no two dimensions sharding one axis (their blocks would interleave).
fn candidates_of(shape: &[usize], mesh: &Mesh) -> (Vec<Placement>, Vec<Candidate>) {
    let options = |name: &str| -> Vec<Placement> {
        let size = mesh.size_of(name);
        let mut v = vec![Placement::Replicate];
        if size > 1 && name != DP_REPLICATE {
            v.extend(
                (0..shape.len())
                    .filter(|&a| shape[a].is_multiple_of(size))
                    .map(Placement::Shard),
            );
        }
        v
    };
    let tp = options(TP);
    let dp = options(DP_SHARD);
    let mut candidates = Vec::new();
    for (t, tp_p) in tp.iter().enumerate() {
        for dp_p in &dp {
            if let (Placement::Shard(a), Placement::Shard(b)) = (tp_p, dp_p) {
                if a == b {
                    continue;
                }
            }
            let mut placements = BTreeMap::new();
            if *tp_p != Placement::Replicate {
                placements.insert(TP.to_string(), *tp_p);
            }
            if *dp_p != Placement::Replicate {
                placements.insert(DP_SHARD.to_string(), *dp_p);
            }
            candidates.push(Candidate { placements, tp: t });
        }
    }
    (tp, candidates)
}

/// Every combination of one index below each of `sizes`, the last fastest.
fn product(sizes: &[usize]) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new()];
    for &n in sizes {
        out = out
            .into_iter()
            .flat_map(|prefix| {
                (0..n).map(move |i| {
                    let mut p = prefix.clone();
                    p.push(i);
                    p
                })
            })
            .collect();
    }
    out
}

pub fn human(bytes: f64) -> String {
    graphtrain_passes::memory::human_bytes(bytes.max(0.0) as usize)
}

/// `passes explain autoshard`: the contract and the cost model.
pub const CONTRACT: &str =
    "autoshard: not a pipeline pass. `graphtrain autoshard --config C --mesh M` writes a plan \
(the RON of `run --plan`) chosen for C on M, before `parallelize` and `--passes` run.\n\
\n\
Chooses, per class of parameters (one per name with the layer index as `*`, shared by every \
block), a placement on each mesh dimension: tp replicate or shard(axis), dp_shard replicate \
(DDP) or shard(axis) (FSDP), dp_replicate replicate; never two dimensions on one axis. \
Chooses sequence parallelism and the output head's pin by solving each of the four.\n\
\n\
Cost model (one rank, nothing overlapped): compute per node of the SPMD train step as a \
roofline (FLOPs at the peak of its precision times the matmul or attention efficiency; bytes \
read and written at the memory bandwidth times its efficiency), collectives as latency + ring \
bytes / bandwidth on the link of their group (--hardware, --link, --nodes), memory as the \
liveness peak. Tensor-parallel choices of one module's parameters are priced together by \
building the step of a one-block model; FSDP against DDP is priced in closed form (two \
all-gathers and a reduce-scatter against an all-reduce; the optimizer's update and the \
parameter, gradient and optimizer state held on a shard). An integer linear program (CBC) picks the cheapest consistent choice under \
--memory-limit; each proposal is built whole and priced exactly (depth extrapolated from one \
and two blocks), excluded, and the program asked again (--proposals times), then priced again \
around the best plan so far; the best priced proposal that fits wins. `--world N` ranks every \
mesh of N ranks with each pipeline on the simulator.\n\
\n\
Guarantees: the plan builds, fits the limit by its exact price, and keeps every --fix. \
Declines: a --fix matching no parameter or naming a dimension the mesh lacks; a limit nothing \
fits (the error gives the smallest peak found); mesh dimensions other than dp_replicate, \
dp_shard and tp.";
