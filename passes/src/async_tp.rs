//! `async_tp`: micro-pipelined tensor parallelism. The collectives of Megatron's split matmuls
//! are cut into chunks, so that one chunk travels while the matmul of another computes.
//!
//! Changes, at each site the gate accepts (`chunks:K`, default 2):
//! - an all-gather over `tp` whose result feeds matmuls as their rows (the column-parallel
//!   `wq`/`wk`/`wv` and `w1`/`w3` under sequence parallelism, and backward's gathers of the
//!   gradient) becomes K all-gathers, one of each rank's k-th block of rows, all started where
//!   the original started; each matmul then multiplies chunk k as soon as it has arrived, and the
//!   products are put back in row order. Readers of the whole gathered tensor (the weight
//!   gradient) read it reassembled from the chunks.
//! - a matmul whose product is reduce-scattered over `tp` (the row-parallel `wo` and `w2`, and
//!   backward's input gradients) becomes K matmuls over the rows that make up block k of every
//!   rank's result, each reduce-scattered as soon as it is computed; the K results are joined.
//!
//! Guarantees: tier 1. Every element is computed from the same operands by the same kernel as
//! before (a matmul's row does not depend on the other rows) and every reduction adds the ranks
//! in the same fixed order, so results are bitwise equal. Every rank runs the same graph, so the
//! collectives are issued in the same order everywhere.
//!
//! Declines: on a graph without a `tp` mesh dimension (nothing to act on; never an error); at a
//! collective whose result does not feed a matmul's rows, or whose operand is not a matmul's
//! product (or a sum of them) read only by it; and where the cost gate predicts no gain. The
//! gate models a chunk's transfer on the link (`link:GBPS:LATENCY_US`; default: `--link`'s tp
//! entry when the CLI runs it, else shared memory) against its compute (`gflops:G`) plus the
//! copies, nodes and collectives (`overhead_us:U` each) chunking adds, and each decline names
//! the predicted loss. `gate:off` applies the pass wherever it is legal. On this project's
//! 2-core host the gate's constants were fitted to paired step times (docs/benchmarks.md).
//!
//! Errors: a chunk count that does not divide a site's rows per rank, naming the site.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::rebuild::Rebuild;
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::graph::{Meta, Node};
use graphtrain_ir::stats::{comm_bytes, node_flops};
use graphtrain_ir::{BinaryOp, Collective, Graph, Op, ValueId};
use std::collections::HashMap;

pub const INFO: PassInfo = PassInfo {
    name: "async_tp",
    tier: Tier::Preserving,
    summary: "pipeline tensor parallelism's all-gathers and reduce-scatters with their matmuls",
    contract: "Cuts each all-gather over tp that feeds matmuls' rows into K chunks whose matmuls \
run as each chunk arrives, and each matmul feeding a reduce-scatter over tp into K matmuls whose \
reduce-scatters start as each is computed (option chunks:K, default 2). Tier 1: each element is \
computed from the same operands by the same kernel and summed over ranks in the same order, so \
results are bitwise equal. Declines without a tp mesh dimension (not an error), at collectives \
that do not feed or follow a matmul's rows, and where its cost gate predicts no gain: a chunk's \
transfer on the link (link:GBPS:LATENCY_US; default: the run's --link for tp, else shared \
memory 10:5) against its compute (gflops:G, default 220) and the copies and collectives \
chunking adds; gate:off applies it wherever legal. A chunk count that does not divide a \
site's rows per rank is an error naming the site.",
    option_help: Some(
        "`;`-separated: chunks:K (K >= 2, default 2), link:GBPS:LATENCY_US (the link the gate \
assumes; default: the run's --link for tp, else 10:5, shared memory), gflops:G (one rank's \
matmul speed the gate assumes; default 220), overhead_us:U (what each collective costs the \
engine beyond the link; default 300), gate:off (apply wherever legal)",
    ),
};

/// Two chunks: on the threads engine each further collective cost more than it hid (see
/// docs/benchmarks.md).
const DEFAULT_CHUNKS: usize = 2;
/// The link assumed when none is named: ranks as threads of one machine, over shared memory.
const SHARED_MEMORY_GBPS: f64 = 10.0;
const SHARED_MEMORY_LATENCY_US: f64 = 5.0;
/// One core's GEMM on the chunks' shapes: 220 GFLOP/s measured on an AVX-512 Zen 5 core
/// (`peer`, tp=2).
const DEFAULT_GFLOPS: f64 = 220.0;
/// What each node chunking adds costs to dispatch, the speed of the copies it adds (the
/// slices of the operand and the reassembly of the products), and what each collective costs
/// the engine beyond the link (the members meeting, the communication thread waking up on
/// busy cores): fitted to paired step times on the threads engine, 2 and 4 ranks on 2 cores.
const NODE_OVERHEAD_S: f64 = 5e-6;
const COPY_BYTES_PER_S: f64 = 20e9;
const COLLECTIVE_OVERHEAD_US: f64 = 300.0;

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| Ok(Box::new(AsyncTp::parse(option)?)));
}

#[derive(Clone, Debug, PartialEq)]
pub struct AsyncTp {
    pub chunks: usize,
    /// The link the cost gate assumes for `tp`.
    pub link_bytes_per_s: f64,
    pub link_latency_s: f64,
    /// One rank's matmul speed the cost gate assumes.
    pub flops_per_s: f64,
    /// What the gate assumes each collective costs the engine beyond the link.
    pub collective_overhead_s: f64,
    /// Whether the cost gate may decline a legal site.
    pub gate: bool,
}

impl Default for AsyncTp {
    fn default() -> Self {
        AsyncTp {
            chunks: DEFAULT_CHUNKS,
            link_bytes_per_s: SHARED_MEMORY_GBPS * 1e9,
            link_latency_s: SHARED_MEMORY_LATENCY_US * 1e-6,
            flops_per_s: DEFAULT_GFLOPS * 1e9,
            collective_overhead_s: COLLECTIVE_OVERHEAD_US * 1e-6,
            gate: true,
        }
    }
}

impl AsyncTp {
    /// Reads `chunks:K;link:GBPS:LATENCY_US;gflops:G;overhead_us:U;gate:off` (any subset, any
    /// order).
    pub fn parse(option: Option<&str>) -> Result<AsyncTp, String> {
        let mut pass = AsyncTp::default();
        let Some(option) = option else {
            return Ok(pass);
        };
        for item in option.split(';').map(str::trim) {
            let positive = |s: &str, what: &str| -> Result<f64, String> {
                s.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x > 0.0)
                    .ok_or_else(|| format!("async_tp: `{item}`: {what} must be a positive number"))
            };
            let microseconds = |s: &str, what: &str| -> Result<f64, String> {
                s.trim()
                    .parse::<f64>()
                    .ok()
                    .filter(|u| u.is_finite() && *u >= 0.0)
                    .map(|u| u * 1e-6)
                    .ok_or_else(|| format!("async_tp: `{item}`: {what} must be microseconds >= 0"))
            };
            if let Some(k) = item.strip_prefix("chunks:") {
                pass.chunks = match k.trim().parse::<usize>() {
                    Ok(k) if k >= 2 => k,
                    _ => {
                        return Err(format!(
                            "async_tp: `{item}`: the chunk count must be a whole number >= 2"
                        ))
                    }
                };
            } else if let Some(link) = item.strip_prefix("link:") {
                let (gbps, us) = link.split_once(':').ok_or_else(|| {
                    format!("async_tp: `{item}`: a link is link:GBPS:LATENCY_US, as in link:10:5")
                })?;
                pass.link_bytes_per_s = positive(gbps, "the bandwidth in GB/s")? * 1e9;
                pass.link_latency_s = microseconds(us, "the latency")?;
            } else if let Some(g) = item.strip_prefix("gflops:") {
                pass.flops_per_s = positive(g, "the matmul speed in GFLOP/s")? * 1e9;
            } else if let Some(us) = item.strip_prefix("overhead_us:") {
                pass.collective_overhead_s = microseconds(us, "the overhead")?;
            } else if item == "gate:off" {
                pass.gate = false;
            } else if item == "gate:on" {
                pass.gate = true;
            } else {
                return Err(format!(
                    "async_tp: unknown option `{item}`; expected chunks:K, link:GBPS:LATENCY_US, \
gflops:G, overhead_us:U or gate:off, separated by `;`"
                ));
            }
        }
        Ok(pass)
    }

    /// The step time the gate predicts chunking saves at one site (negative: it costs):
    /// unchunked, the transfer and the compute run one after the other; chunked, K transfers
    /// (each paying the latency) pipeline with K computes, plus the copies and nodes added.
    fn predicted_gain_s(&self, site: &SiteCost) -> f64 {
        let k = self.chunks as f64;
        let transfer = site.sent_bytes / self.link_bytes_per_s;
        let latency = self.link_latency_s + self.collective_overhead_s;
        let before = latency + transfer + site.compute_s;
        let chunk_comm = latency + transfer / k;
        let chunk_compute = site.compute_s / k;
        let pipelined = chunk_comm + chunk_compute + (k - 1.0) * chunk_comm.max(chunk_compute);
        let added = site.copied_bytes / COPY_BYTES_PER_S + site.added_nodes * NODE_OVERHEAD_S;
        before - pipelined - added
    }
}

/// What the gate weighs at one site.
struct SiteCost {
    /// Bytes one rank sends for the collective (ring algorithm).
    sent_bytes: f64,
    /// Seconds of the matmuls that overlap it.
    compute_s: f64,
    /// Bytes the slices and reassembly copy.
    copied_bytes: f64,
    added_nodes: f64,
}

#[derive(Clone, Debug)]
enum Site {
    /// An all-gather over tp whose result feeds matmuls (`consumers`) as their rows.
    Gather {
        start: usize,
        wait: usize,
        axis: usize,
        consumers: Vec<usize>,
    },
    /// A matmul whose product only a reduce-scatter over tp reads, or a sum of such matmuls
    /// (backward's input gradient of `wq`, `wk` and `wv`): `tree` holds the matmuls and adds,
    /// each read only by the next, in schedule order; the last produces the operand.
    Scatter {
        tree: Vec<usize>,
        start: usize,
        wait: usize,
        axis: usize,
    },
}

/// What a node of the input graph becomes.
#[derive(Clone, Copy, PartialEq)]
enum Role {
    Keep,
    GatherStart(usize),
    GatherWait,
    GatherConsumer(usize),
    ScatterRoot(usize),
    Skip,
    ScatterWait(usize),
}

impl Pass for AsyncTp {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let tp = match g.mesh.as_ref().map(|m| (m.dim("tp"), m)) {
            None => {
                report.decline(
                    None,
                    "",
                    "the graph has no mesh, so no tp dimension to act on",
                );
                return Ok((g.clone(), report));
            }
            Some((None, m)) => {
                report.decline(
                    None,
                    "",
                    format!("the mesh `{m}` has no tp dimension to act on"),
                );
                return Ok((g.clone(), report));
            }
            Some((Some(tp), _)) => tp,
        };
        let sites = self.find_sites(g, tp, &mut report)?;
        let mut accepted = Vec::new();
        let mut gain_s = 0.0;
        for site in sites {
            let gain = self.predicted_gain_s(&self.cost(g, &site));
            let (at, module) = match &site {
                Site::Gather { start, .. } | Site::Scatter { start, .. } => {
                    (*start, g.nodes[*start].meta.module.clone())
                }
            };
            if self.gate && gain <= 0.0 {
                report.decline(
                    Some(at),
                    module,
                    format!(
                        "the cost gate predicts {} chunks lose {:.1} µs here on a {} GB/s, {} µs \
link (what overlaps is too small to pay for what chunking adds)",
                        self.chunks,
                        -gain * 1e6,
                        self.link_bytes_per_s / 1e9,
                        self.link_latency_s * 1e6
                    ),
                );
            } else {
                gain_s += gain;
                accepted.push(site);
            }
        }
        // A matmul that multiplies a pipelined all-gather's chunks is not also cut for a
        // reduce-scatter (one chunking per node).
        let gathered_by: Vec<usize> = accepted
            .iter()
            .flat_map(|s| match s {
                Site::Gather { consumers, .. } => consumers.clone(),
                Site::Scatter { .. } => Vec::new(),
            })
            .collect();
        accepted.retain(|site| match site {
            Site::Scatter { tree, start, .. } if tree.iter().any(|n| gathered_by.contains(n)) => {
                report.decline(
                    Some(*start),
                    g.nodes[*start].meta.module.clone(),
                    "its matmul already multiplies a pipelined all-gather's chunks",
                );
                false
            }
            _ => true,
        });
        if accepted.is_empty() {
            if report.declined.is_empty() {
                report.decline(
                    None,
                    "",
                    "no all-gather over tp feeds a matmul and no matmul feeds a reduce-scatter \
over tp",
                );
            }
            return Ok((g.clone(), report));
        }
        let gathers = accepted
            .iter()
            .filter(|s| matches!(s, Site::Gather { .. }))
            .count();
        let scatters = accepted.len() - gathers;
        let out = self.rewrite(g, &accepted)?;
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        report.change(format!(
            "pipelined {} and {} over tp with their matmuls in {} chunks; predicted gain {:.1} \
µs per step",
            plural(gathers, "all-gather"),
            plural(scatters, "reduce-scatter"),
            self.chunks,
            gain_s * 1e6
        ));
        report.metric("async_tp.gathers", gathers as f64);
        report.metric("async_tp.scatters", scatters as f64);
        report.metric("async_tp.chunks", self.chunks as f64);
        report.metric("async_tp.predicted_gain_us", gain_s * 1e6);
        Ok((out.canonical(), report))
    }
}

impl AsyncTp {
    fn find_sites(
        &self,
        g: &Graph,
        tp: usize,
        report: &mut PassReport,
    ) -> Result<Vec<Site>, PassError> {
        let users = g.users();
        let producers = g.producers();
        let mut sites = Vec::new();
        for (i, node) in g.nodes.iter().enumerate() {
            let Op::CollectiveStart {
                collective,
                mesh_dims,
                ..
            } = &node.op
            else {
                continue;
            };
            if mesh_dims.as_slice() != [tp] {
                continue;
            }
            let wait = match users[node.outputs[0].index()].as_slice() {
                [w] if matches!(g.nodes[*w].op, Op::Wait) => *w,
                _ => continue,
            };
            let module = node.meta.module.clone();
            match *collective {
                Collective::AllGather { axis } => {
                    let gathered = g.nodes[wait].outputs[0];
                    let consumers: Vec<usize> = users[gathered.index()]
                        .iter()
                        .copied()
                        .filter(|&u| multiplies_rows(g, u, gathered, axis))
                        .collect();
                    if consumers.is_empty() {
                        report.decline(
                            Some(i),
                            module,
                            "this all-gather's result feeds no matmul as its rows",
                        );
                        continue;
                    }
                    let rows = g.ty(node.inputs[0]).shape[axis];
                    self.check_divides(rows, axis, i, &module, "all-gather")?;
                    sites.push(Site::Gather {
                        start: i,
                        wait,
                        axis,
                        consumers,
                    });
                }
                Collective::ReduceScatter { axis, .. } => {
                    let mut tree = Vec::new();
                    let legal = row_sum(g, &producers, &users, node.inputs[0], i, axis, &mut tree);
                    if !legal {
                        report.decline(
                            Some(i),
                            module,
                            "this reduce-scatter's operand is not a matmul's rows (or a sum of \
them) read only by it",
                        );
                        continue;
                    }
                    let rows = g.ty(g.nodes[wait].outputs[0]).shape[axis];
                    self.check_divides(rows, axis, i, &module, "reduce-scatter")?;
                    sites.push(Site::Scatter {
                        tree,
                        start: i,
                        wait,
                        axis,
                    });
                }
                _ => {}
            }
        }
        Ok(sites)
    }

    fn check_divides(
        &self,
        rows: usize,
        axis: usize,
        node: usize,
        module: &str,
        what: &str,
    ) -> Result<(), PassError> {
        if rows.is_multiple_of(self.chunks) {
            return Ok(());
        }
        Err(PassError {
            pass: INFO.name.into(),
            message: format!(
                "option chunks:{}: the {what} at node {node} (`{module}`) has {rows} rows per \
rank along axis {axis}, which {} chunks do not divide",
                self.chunks, self.chunks
            ),
        })
    }

    fn cost(&self, g: &Graph, site: &Site) -> SiteCost {
        let k = self.chunks as f64;
        let bytes = |v: ValueId| g.ty(v).size_bytes() as f64;
        let (start, matmuls) = match site {
            Site::Gather {
                start, consumers, ..
            } => (*start, consumers.clone()),
            Site::Scatter { start, tree, .. } => (
                *start,
                tree.iter()
                    .copied()
                    .filter(|&n| matches!(g.nodes[n].op, Op::Matmul))
                    .collect(),
            ),
        };
        let node = &g.nodes[start];
        let (collective, group) = match &node.op {
            Op::CollectiveStart {
                collective, group, ..
            } => (*collective, *group),
            _ => unreachable!("a site starts at a collective"),
        };
        let sent_bytes = comm_bytes(collective, group, g.ty(node.inputs[0]).size_bytes());
        let flops: f64 = matmuls.iter().map(|&m| node_flops(g, &g.nodes[m])).sum();
        let products: f64 = matmuls.iter().map(|&m| bytes(g.nodes[m].outputs[0])).sum();
        let (copied_bytes, added_nodes) = match site {
            // Slices of the operand; each product's chunks joined; per chunk a slice, a start,
            // a wait, and per consumer a matmul and a reshape.
            Site::Gather { .. } => (
                bytes(node.inputs[0]) + products,
                k * 3.0 - 2.0 + matmuls.len() as f64 * (2.0 * k + 1.0),
            ),
            // The rows of each chunk gathered from the matmuls' operands; the results joined;
            // per chunk and matmul a slice, a reshape and a matmul, and a start and a wait.
            Site::Scatter { .. } => (
                matmuls
                    .iter()
                    .map(|&m| bytes(g.nodes[m].inputs[0]))
                    .sum::<f64>()
                    + products / matmuls.len() as f64 / group as f64,
                k * (3.0 * matmuls.len() as f64 + 2.0) - 2.0,
            ),
        };
        SiteCost {
            sent_bytes,
            compute_s: flops / self.flops_per_s,
            copied_bytes,
            added_nodes,
        }
    }

    fn rewrite(&self, g: &Graph, sites: &[Site]) -> Result<Graph, PassError> {
        let k = self.chunks;
        let mut roles = vec![Role::Keep; g.nodes.len()];
        for (s, site) in sites.iter().enumerate() {
            match site {
                Site::Gather {
                    start,
                    wait,
                    consumers,
                    ..
                } => {
                    roles[*start] = Role::GatherStart(s);
                    roles[*wait] = Role::GatherWait;
                    for &c in consumers {
                        roles[c] = Role::GatherConsumer(s);
                    }
                }
                Site::Scatter {
                    tree, start, wait, ..
                } => {
                    for &n in tree {
                        roles[n] = Role::Skip;
                    }
                    roles[*tree.last().expect("a tree has a root")] = Role::ScatterRoot(s);
                    roles[*start] = Role::Skip;
                    roles[*wait] = Role::ScatterWait(s);
                }
            }
        }
        let mut e = Emitter {
            r: Rebuild::of(g, INFO.name),
            chunks: k,
            handles: vec![Vec::new(); sites.len()],
            arrived: vec![Vec::new(); sites.len()],
            whole: vec![None; sites.len()],
        };
        let producers = g.producers();
        // Nodes already emitted ahead of their place: a consumer multiplied with the first
        // one, and the node computing its matrix.
        let mut emitted_early = vec![false; g.nodes.len()];
        // The gathered value of each gather site, to find its readers.
        let mut gathered_site = vec![None; g.values.len()];
        for (s, site) in sites.iter().enumerate() {
            if let Site::Gather { wait, .. } = site {
                gathered_site[g.nodes[*wait].outputs[0].index()] = Some(s);
            }
        }
        for (i, node) in g.nodes.iter().enumerate() {
            e.r.enter(&node.meta);
            match roles[i] {
                Role::GatherStart(s) => e.start_gather(g, node, s)?,
                Role::GatherWait | Role::Skip => {}
                Role::Keep if emitted_early[i] => {}
                Role::GatherConsumer(_) if emitted_early[i] => {}
                Role::GatherConsumer(s) => {
                    let Site::Gather {
                        axis,
                        ref consumers,
                        ..
                    } = sites[s]
                    else {
                        unreachable!()
                    };
                    // Every consumer whose matrix exists by now (or is one node away from the
                    // inputs, such as a weight's transpose, moved up) multiplies each chunk as
                    // it arrives, so that all their compute overlaps the next chunk's transfer.
                    let mut ready = vec![i];
                    for &j in consumers.iter().filter(|&&j| j > i) {
                        let matrix = g.nodes[j].inputs[1];
                        let available = |v: ValueId| producers[v.index()].is_none_or(|p| p < i);
                        match producers[matrix.index()] {
                            Some(p) if p > i => {
                                let from = &g.nodes[p];
                                let movable = from.meta.stage() == node.meta.stage()
                                    && roles[p] == Role::Keep
                                    && !matches!(from.op, Op::CollectiveStart { .. } | Op::Wait)
                                    && from.inputs.iter().all(|&v| available(v));
                                if !movable {
                                    continue;
                                }
                                e.r.keep(from);
                                emitted_early[p] = true;
                            }
                            _ => {}
                        }
                        ready.push(j);
                    }
                    let mut products = vec![Vec::with_capacity(k); ready.len()];
                    for c in 0..k {
                        let rows = e.arrived_chunk(g, &sites[s], s, c)?;
                        for (r, &j) in ready.iter().enumerate() {
                            let matrix = e.r.map[g.nodes[j].inputs[1].index()];
                            let meta = &g.nodes[j].meta;
                            products[r].push(e.r.add(Op::Matmul, vec![rows, matrix], meta)?);
                        }
                    }
                    for (r, &j) in ready.iter().enumerate() {
                        let meta = &g.nodes[j].meta;
                        let joined = e.join_gathered(&products[r], axis, g, &sites[s], meta)?;
                        e.r.map[g.nodes[j].outputs[0].index()] = joined;
                        emitted_early[j] = true;
                    }
                }
                Role::ScatterRoot(s) => e.scatter_chunks(g, &producers, &sites[s], s)?,
                Role::ScatterWait(s) => {
                    let Site::Scatter { axis, .. } = sites[s] else {
                        unreachable!()
                    };
                    // Each chunk is one block per rank: joined as (rank, chunk, row), so
                    // that each rank's rows stay one block.
                    let whole = g.ty(node.outputs[0]).shape.clone();
                    let mut block = whole.clone();
                    block.splice(axis..=axis, [1, whole[axis] / k]);
                    let mut parts = Vec::with_capacity(k);
                    for c in 0..k {
                        let handle = e.handles[s][c];
                        let part = e.r.add(Op::Wait, vec![handle], &node.meta)?;
                        let shape = block.clone();
                        parts.push(e.r.add(Op::Reshape { shape }, vec![part], &node.meta)?);
                    }
                    let joined = e.r.add(Op::Concat { axis: axis + 1 }, parts, &node.meta)?;
                    let joined =
                        e.r.add(Op::Reshape { shape: whole }, vec![joined], &node.meta)?;
                    e.r.map[node.outputs[0].index()] = joined;
                }
                Role::Keep => {
                    for v in &node.inputs {
                        if let Some(s) = gathered_site[v.index()] {
                            e.whole_gathered(g, &sites[s], s)?;
                        }
                    }
                    e.r.keep(node);
                }
            }
        }
        for (s, site) in sites.iter().enumerate() {
            if let Site::Gather { wait, .. } = site {
                let gathered = g.nodes[*wait].outputs[0];
                if g.outputs.iter().any(|o| o.value == gathered) {
                    e.whole_gathered(g, site, s)?;
                }
            }
        }
        Ok(e.r.finish())
    }
}

/// Builds the rewritten graph node by node (`r`), with what the chunked sites have emitted.
struct Emitter {
    r: Rebuild,
    chunks: usize,
    /// Per site, the handles of its chunk collectives.
    handles: Vec<Vec<ValueId>>,
    /// Per gather site, the chunks waited for so far.
    arrived: Vec<Vec<ValueId>>,
    /// Per gather site, the gathered tensor reassembled, once a reader needed it whole.
    whole: Vec<Option<ValueId>>,
}

impl Emitter {
    /// At the all-gather's start: slice block k of the rank's rows and start gathering it.
    fn start_gather(&mut self, g: &Graph, start: &Node, s: usize) -> Result<(), PassError> {
        let Op::CollectiveStart {
            collective: Collective::AllGather { axis },
            ..
        } = start.op
        else {
            unreachable!("a gather site starts at an all-gather")
        };
        // The rank's rows, as one block of a (rank, row) split: sliced along the row, each
        // chunk stays one block per rank, which is what the placements can say.
        let shape = &g.ty(start.inputs[0]).shape;
        let mut by_rank = shape.clone();
        by_rank.splice(axis..=axis, [1, shape[axis]]);
        let rows = shape[axis] / self.chunks;
        let mut chunk_shape = shape.clone();
        chunk_shape[axis] = rows;
        let operand = self.r.map[start.inputs[0].index()];
        let operand = self
            .r
            .add(Op::Reshape { shape: by_rank }, vec![operand], &start.meta)?;
        for c in 0..self.chunks {
            let block = self.r.add(
                Op::Slice {
                    axis: axis + 1,
                    start: c * rows,
                    end: (c + 1) * rows,
                },
                vec![operand],
                &start.meta,
            )?;
            let block = self.r.add(
                Op::Reshape {
                    shape: chunk_shape.clone(),
                },
                vec![block],
                &start.meta,
            )?;
            let handle = self.r.add(start.op.clone(), vec![block], &start.meta)?;
            self.handles[s].push(handle);
        }
        Ok(())
    }

    /// Gathered chunk `c` of a gather site, waiting for it (and the chunks before it) first.
    fn arrived_chunk(
        &mut self,
        g: &Graph,
        site: &Site,
        s: usize,
        c: usize,
    ) -> Result<ValueId, PassError> {
        let Site::Gather { wait, .. } = *site else {
            unreachable!()
        };
        while self.arrived[s].len() <= c {
            let handle = self.handles[s][self.arrived[s].len()];
            let chunk = self.r.add(Op::Wait, vec![handle], &g.nodes[wait].meta)?;
            self.arrived[s].push(chunk);
        }
        Ok(self.arrived[s][c])
    }

    /// The gathered tensor in its original row order, for readers that need it whole.
    fn whole_gathered(&mut self, g: &Graph, site: &Site, s: usize) -> Result<(), PassError> {
        let Site::Gather { wait, axis, .. } = *site else {
            unreachable!()
        };
        if self.whole[s].is_some() {
            return Ok(());
        }
        let chunks = (0..self.chunks)
            .map(|c| self.arrived_chunk(g, site, s, c))
            .collect::<Result<Vec<_>, _>>()?;
        let whole = self.join_gathered(&chunks, axis, g, site, &g.nodes[wait].meta)?;
        self.whole[s] = Some(whole);
        self.r.map[g.nodes[wait].outputs[0].index()] = whole;
        Ok(())
    }

    /// Joins per-chunk tensors whose rows along `axis` run (rank, row of the chunk) into rows
    /// that run (rank, chunk, row of the chunk): the order the unchunked all-gather gives.
    fn join_gathered(
        &mut self,
        chunks: &[ValueId],
        axis: usize,
        g: &Graph,
        site: &Site,
        meta: &Meta,
    ) -> Result<ValueId, PassError> {
        let Site::Gather { start, .. } = *site else {
            unreachable!()
        };
        let ranks = match g.nodes[start].op {
            Op::CollectiveStart { group, .. } => group,
            _ => unreachable!(),
        };
        let chunk_shape = self.r.out.ty(chunks[0]).shape.clone();
        let rows = chunk_shape[axis] / ranks;
        let mut split = chunk_shape.clone();
        split.splice(axis..=axis, [ranks, rows]);
        let mut blocks = Vec::with_capacity(chunks.len());
        for &chunk in chunks {
            blocks.push(self.r.add(
                Op::Reshape {
                    shape: split.clone(),
                },
                vec![chunk],
                meta,
            )?);
        }
        let joined = self.r.add(Op::Concat { axis: axis + 1 }, blocks, meta)?;
        let mut whole = chunk_shape;
        whole[axis] = ranks * rows * chunks.len();
        self.r.add(Op::Reshape { shape: whole }, vec![joined], meta)
    }

    /// At the root of the sum: for each chunk, the rows that become block k of every rank's
    /// result, their products summed as before, and the sum's reduce-scatter.
    fn scatter_chunks(
        &mut self,
        g: &Graph,
        producers: &[Option<usize>],
        site: &Site,
        s: usize,
    ) -> Result<(), PassError> {
        let Site::Scatter {
            ref tree,
            start,
            wait,
            axis,
        } = *site
        else {
            unreachable!()
        };
        let ranks = match g.nodes[start].op {
            Op::CollectiveStart { group, .. } => group,
            _ => unreachable!(),
        };
        let per_rank = g.ty(g.nodes[wait].outputs[0]).shape[axis];
        let mut rows = RowChunks {
            axis,
            ranks,
            per_rank,
            rows: per_rank / self.chunks,
            by_rank: HashMap::new(),
        };
        let root = g.nodes[*tree.last().expect("a tree has a root")].outputs[0];
        for c in 0..self.chunks {
            let sum = self.chunk_of(g, producers, root, c, &mut rows)?;
            let meta = &g.nodes[start].meta;
            let handle = self.r.add(g.nodes[start].op.clone(), vec![sum], meta)?;
            self.handles[s].push(handle);
        }
        Ok(())
    }

    /// Chunk `c` of `v`, a matmul's product or a sum of them, computed from chunk `c` of the
    /// matmuls' rows.
    fn chunk_of(
        &mut self,
        g: &Graph,
        producers: &[Option<usize>],
        v: ValueId,
        c: usize,
        rows: &mut RowChunks,
    ) -> Result<ValueId, PassError> {
        let node = &g.nodes[producers[v.index()].expect("a tree value has a producer")];
        if let Op::Binary(BinaryOp::Add) = node.op {
            let a = self.chunk_of(g, producers, node.inputs[0], c, rows)?;
            let b = self.chunk_of(g, producers, node.inputs[1], c, rows)?;
            return self.r.add(node.op.clone(), vec![a, b], &node.meta);
        }
        let lhs = node.inputs[0];
        let by_rank = match rows.by_rank.get(&lhs) {
            Some(&v) => v,
            None => {
                let mut split = g.ty(lhs).shape.clone();
                split.splice(rows.axis..=rows.axis, [rows.ranks, rows.per_rank]);
                let mapped = self.r.map[lhs.index()];
                let v = self
                    .r
                    .add(Op::Reshape { shape: split }, vec![mapped], &node.meta)?;
                rows.by_rank.insert(lhs, v);
                v
            }
        };
        let block = self.r.add(
            Op::Slice {
                axis: rows.axis + 1,
                start: c * rows.rows,
                end: (c + 1) * rows.rows,
            },
            vec![by_rank],
            &node.meta,
        )?;
        let mut shape = g.ty(lhs).shape.clone();
        shape[rows.axis] = rows.ranks * rows.rows;
        let chunk_rows = self.r.add(Op::Reshape { shape }, vec![block], &node.meta)?;
        let rhs = self.r.map[node.inputs[1].index()];
        self.r.add(Op::Matmul, vec![chunk_rows, rhs], &node.meta)
    }
}

/// How a reduce-scatter site's rows split into chunks, and each matmul operand already split
/// into (rank, row) blocks.
struct RowChunks {
    axis: usize,
    ranks: usize,
    per_rank: usize,
    rows: usize,
    by_rank: HashMap<ValueId, ValueId>,
}

/// `node` multiplies `rows` (split along `axis`) by a matrix: each row of its product depends
/// on that row alone.
fn multiplies_rows(g: &Graph, node: usize, rows: ValueId, axis: usize) -> bool {
    let n = &g.nodes[node];
    matches!(n.op, Op::Matmul)
        && n.inputs[0] == rows
        && n.inputs[1] != rows
        && g.ty(n.inputs[1]).rank() == 2
        && axis + 1 < g.ty(rows).rank()
}

/// Whether `v`, read only by node `reader`, is a matmul's product over rows split along
/// `axis`, or a sum of such; pushes the nodes computing it onto `tree` in schedule order.
fn row_sum(
    g: &Graph,
    producers: &[Option<usize>],
    users: &[Vec<usize>],
    v: ValueId,
    reader: usize,
    axis: usize,
    tree: &mut Vec<usize>,
) -> bool {
    let Some(p) = producers[v.index()] else {
        return false;
    };
    if users[v.index()] != [reader] || g.outputs.iter().any(|o| o.value == v) {
        return false;
    }
    let node = &g.nodes[p];
    let legal = match node.op {
        Op::Matmul => multiplies_rows(g, p, node.inputs[0], axis),
        Op::Binary(BinaryOp::Add) => {
            let (a, b) = (node.inputs[0], node.inputs[1]);
            a != b
                && g.ty(a) == g.ty(b)
                && row_sum(g, producers, users, a, p, axis, tree)
                && row_sum(g, producers, users, b, p, axis, tree)
        }
        _ => false,
    };
    if legal {
        tree.push(p);
    }
    legal
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check, try_check};

    /// Sequence-parallel column and row matmuls on tp=2: the gathered rows feed a matmul and
    /// a reader of the whole tensor; the row-parallel product is reduce-scattered. Checked
    /// bitwise on both ranks.
    const TP_BLOCK: &str = "graph g {
  mesh tp=2
  input %x: f32[2,4,8] @ [shard(1)]
  param %w: f32[8,6] @ [shard(1)]
  param %v: f32[6,8] @ [shard(0)]
  %3: f32[2,8,8] = all_gather_start(%x, mesh_dims=[0], group=2, axis=1)  # fwd col
  %4: f32[2,8,8] = wait(%3)  # fwd col
  %5: f32[2,8,6] = matmul(%4, %w)  # fwd col.w
  %6: f32[2,8,6] = exp(%5)  # fwd col
  %7: f32[2,8,8] = matmul(%6, %v)  # fwd row.v
  %8: f32[2,4,8] = reduce_scatter_start(%7, mesh_dims=[0], group=2, axis=1, reduce=sum)  # fwd row
  %9: f32[2,4,8] = wait(%8)  # fwd row
  %10: f32[16,8] = reshape(%4, shape=[16,8])  # bwd col
  output y = %9 @ [shard(1)]
  output z = %10 @ [replicate]
}";

    fn pass(option: &str) -> AsyncTp {
        AsyncTp::parse(Some(option)).unwrap()
    }

    #[test]
    fn gathers_and_scatters_pipeline_in_chunks() {
        insta::assert_snapshot!(check(&pass("chunks:2;gate:off"), TP_BLOCK));
    }

    /// Two matmuls read the gathered rows (`wq` and `wk`): the second's weight transpose moves
    /// up, and both multiply each chunk as it arrives.
    #[test]
    fn every_consumer_multiplies_each_chunk_as_it_arrives() {
        let out = check(
            &pass("chunks:2;gate:off"),
            "graph g {
  mesh tp=2
  input %x: f32[2,4,8] @ [shard(1)]
  param %w: f32[6,8] @ [shard(0)]
  param %u: f32[6,8] @ [shard(0)]
  %3: f32[2,8,8] = all_gather_start(%x, mesh_dims=[0], group=2, axis=1)  # fwd attn
  %4: f32[2,8,8] = wait(%3)  # fwd attn
  %5: f32[8,6] = transpose(%w, perm=[1,0])  # fwd attn.wq
  %6: f32[2,8,6] = matmul(%4, %5)  # fwd attn.wq
  %7: f32[8,6] = transpose(%u, perm=[1,0])  # fwd attn.wk
  %8: f32[2,8,6] = matmul(%4, %7)  # fwd attn.wk
  %9: f32[2,8,6] = mul(%6, %8)  # fwd attn
  output y = %9 @ [shard(2)]
}",
        );
        insta::assert_snapshot!(out);
    }

    /// Backward's input gradient of two column-parallel weights is a sum of two row matmuls
    /// before its reduce-scatter: both are cut, and the chunks summed in the same order.
    #[test]
    fn a_sum_of_matmuls_is_cut_before_its_reduce_scatter() {
        let out = check(
            &pass("chunks:2;gate:off"),
            "graph g {
  mesh tp=2
  input %x: f32[2,8,6] @ [shard(2)]
  input %y: f32[2,8,6] @ [shard(2)]
  param %v: f32[6,8] @ [shard(0)]
  param %u: f32[6,8] @ [shard(0)]
  %4: f32[2,8,8] = matmul(%x, %v)  # bwd a.v
  %5: f32[2,8,8] = matmul(%y, %u)  # bwd a.u
  %6: f32[2,8,8] = add(%4, %5)  # bwd a
  %7: f32[2,4,8] = reduce_scatter_start(%6, mesh_dims=[0], group=2, axis=1, reduce=sum)  # bwd a
  %8: f32[2,4,8] = wait(%7)  # bwd a
  output dx = %8 @ [shard(1)]
}",
        );
        insta::assert_snapshot!(out);
    }

    /// On shared memory these tensors are far too small to hide anything: the gate declines
    /// each site with its predicted loss, and the graph is unchanged.
    #[test]
    fn the_gate_declines_where_chunking_costs_more_than_it_hides() {
        let out = check(&AsyncTp::default(), TP_BLOCK);
        assert!(out.contains("// no change"), "{out}");
        assert_eq!(
            out.matches("the cost gate predicts 2 chunks lose").count(),
            2,
            "{out}"
        );
        // A slow link and a slow matmul: worth chunking.
        let slow = pass("chunks:2;link:0.001:1;gflops:0.001");
        let out = check(&slow, TP_BLOCK);
        assert!(
            out.contains("pipelined 1 all-gather and 1 reduce-scatter"),
            "{out}"
        );
    }

    #[test]
    fn without_tp_it_says_so_and_changes_nothing() {
        let no_mesh = "graph g {
  input %x: f32[2,4] @ [replicate]
  %1: f32[2,4] = exp(%x)  # fwd a
  output y = %1
}";
        let no_mesh = no_mesh.replace(" @ [replicate]", "");
        let out = check(&AsyncTp::default(), &no_mesh);
        assert!(out.contains("no tp dimension to act on"), "{out}");
        let fsdp = TP_BLOCK.replace("mesh tp=2", "mesh dp_shard=2");
        let out = check(&pass("gate:off"), &fsdp);
        assert!(out.contains("has no tp dimension to act on"), "{out}");
    }

    #[test]
    fn bad_options_and_chunk_counts_are_refused_by_name() {
        for (option, says) in [
            ("chunks:0", "the chunk count must be a whole number >= 2"),
            ("chunks:1", "the chunk count must be a whole number >= 2"),
            ("chunks:x", "the chunk count must be a whole number >= 2"),
            ("link:3", "a link is link:GBPS:LATENCY_US"),
            (
                "link:0:5",
                "the bandwidth in GB/s must be a positive number",
            ),
            (
                "gflops:-1",
                "the matmul speed in GFLOP/s must be a positive number",
            ),
            ("ring:2", "unknown option `ring:2`"),
        ] {
            let e = AsyncTp::parse(Some(option)).unwrap_err();
            assert!(e.starts_with("async_tp: "), "{e}");
            assert!(e.contains(says), "{option}: {e}");
        }
        let e = try_check(&pass("chunks:3;gate:off"), TP_BLOCK).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains(
                "pass `async_tp`: option chunks:3: the all-gather at node 0 (`col`) has 4 \
rows per rank along axis 1, which 3 chunks do not divide"
            ),
            "{e}"
        );
    }
}
