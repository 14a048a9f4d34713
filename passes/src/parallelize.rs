//! `parallelize`: a single-device forward-and-loss graph and a [`Plan`] in, the SPMD train step
//! over a [`Mesh`] out. It runs before `--passes`, which then see every collective as a node.
//!
//! What it builds (torchtitan's SimpleFSDP, with its mesh names):
//! - data inputs (`tokens`, `targets`) split by rows over `dp_replicate` and `dp_shard` (the
//!   batch must divide): every shape in a rank's graph is that of its own rows; with sequence
//!   parallelism the tokens also by position over `tp`;
//! - parameters placed as the plan says. A parameter sharded over `dp_shard` (FSDP, the built-in
//!   plan) is all-gathered (a start and a wait node) right before its first use in forward, and
//!   all-gathered again before its first use in backward, so no gathered weight lives from
//!   forward to backward (keeping it instead is a scheduling policy for a later pass); its
//!   gradient is reduce-scattered (the all-gather's adjoint) and AdamW updates only the rank's
//!   shard, with optimizer state sharded alike;
//! - tensor parallelism over `tp` (Megatron's, from the plan: `Plan::llama`): where an op cannot
//!   take its operands' placements a redistribution comes first (`Redistribute`): a partial
//!   operand is reduce-scattered to a sibling's split (the residual add under sequence
//!   parallelism) or all-reduced (under plain TP), an activation split by sequence is
//!   all-gathered (before a block's split matmuls); plan pins redistribute what chosen modules
//!   read (the output head reads its input whole); autodiff gives backward the conjugates;
//! - gradients of parameters replicated over a mesh dimension are all-reduced over it (DDP over
//!   `dp_replicate`, and HSDP as the two together; over `tp` for the norms, the embedding and
//!   the output head), each as placement propagation finds it partial;
//! - each rank starts its backward pass at 1 / (data ranks), so the sum over ranks is the
//!   gradient of the global mean loss, and partial over `tp` (`to_partial`), so that the
//!   gradient of every replicated value is a partial sum, as over the data ranks; the global
//!   gradient norm (and clipping) sums the ranks' squared shards with an all-reduce; the
//!   reported `loss` is averaged over the data ranks.
//!
//! Guarantees: the result passes the verifier, placement propagation included; every input and
//! output carries its placement; a mesh whose dimensions are all of size 1 gives exactly the
//! single-device train step (no collective is emitted over a dimension of size 1).
//!
//! Declines, with an error naming what and where: a mesh with `cp`, `pp` or `ep` larger than 1
//! (not built yet); a batch or a parameter dimension that does not split evenly; a plan rule
//! that matches no parameter or names an unknown mesh dimension; an op whose operands'
//! placements it has no rule for, even after redistribution; a pin on no module or asking for
//! anything but `replicate`. Not built: loss parallelism (the output head split by vocabulary).

use graphtrain_ir::graph::{Graph, InputKind, Meta, Phase, TypeError, ValueId};
use graphtrain_ir::mesh::{Mesh, Placement, Placements, Reduce};
use graphtrain_ir::op::{Collective, Op};
use graphtrain_ir::optim::{build_train_step_with, OptimConfig, RankReductions, TrainStep};
use graphtrain_ir::spmd::node_rule;
use graphtrain_ir::trace::{ParamSpec, Traced};
use graphtrain_ir::{verify, BinaryOp, TensorType};
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::BTreeMap;

/// Where parameters live on the mesh: rules in order, the first whose pattern matches a
/// parameter's name decides; a parameter no rule matches is replicated. Written in RON, e.g.
/// `(params: [(pattern: "*", placements: {"dp_shard": Shard(0)})])`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Plan {
    pub params: Vec<ParamRule>,
    /// Sequence parallelism over `tp`: the activations between blocks (the residual stream and
    /// the norms on it) split by sequence position instead of replicated, all-gathered before
    /// each block's split matmuls and reduce-scattered after them (the all-reduce's two
    /// halves), which divides their memory by `tp`. The tokens are split alike.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Placements pinned on the activations that ops of some modules read: each such operand is
    /// redistributed to them first. So far a pin may only ask for `Replicate` (an all-gather of
    /// a split, an all-reduce of a partial sum).
    #[serde(default)]
    pub pins: Vec<PinRule>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PinRule {
    /// A module path, where `*` stands for any run of characters (`output`, `layers.*.attention`).
    pub module: String,
    /// The placement per mesh dimension name the module's activation operands must have.
    pub placements: BTreeMap<String, Placement>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParamRule {
    /// A parameter name, where `*` stands for any run of characters (`layers.*.attention.wq.weight`).
    pub pattern: String,
    /// The placement per mesh dimension name; dimensions not named are replicated.
    pub placements: BTreeMap<String, Placement>,
}

impl Plan {
    /// FSDP over `dp_shard` for every parameter (row blocks).
    pub fn fsdp() -> Plan {
        Plan {
            params: vec![ParamRule {
                pattern: "*".into(),
                placements: BTreeMap::from([("dp_shard".to_string(), Placement::Shard(0))]),
            }],
            sequence_parallel: false,
            pins: Vec::new(),
        }
    }

    /// The built-in plan for Llama 3 on `mesh`: FSDP over `dp_shard` for every parameter and,
    /// when `tp` is larger than 1, Megatron's tensor parallelism: `wq`, `wk`, `wv`, `w1`, `w3`
    /// split by output features (rows of the `[out, in]` weight), `wo` and `w2` by input
    /// features, so each block needs one all-reduce after attention and one after the MLP in
    /// forward, and one each in backward, with sequence parallelism between blocks (each
    /// all-reduce becomes a reduce-scatter and an all-gather). Norms, the embedding and the
    /// output head stay replicated over `tp` (their gradients are all-reduced over it); the
    /// logits are gathered whole before the loss (loss parallelism is not built). FSDP then splits the
    /// other axis of a `tp`-split weight: all-gathering along the axis `tp` also splits would
    /// interleave the blocks.
    pub fn llama(mesh: &Mesh) -> Plan {
        if mesh.size_of(TENSOR_DIM) == 1 {
            return Plan::fsdp();
        }
        let rule = |pattern: &str, tp: usize, fsdp: usize| ParamRule {
            pattern: pattern.into(),
            placements: BTreeMap::from([
                (TENSOR_DIM.to_string(), Placement::Shard(tp)),
                ("dp_shard".to_string(), Placement::Shard(fsdp)),
            ]),
        };
        let mut params: Vec<ParamRule> = ["attention.wq", "attention.wk", "attention.wv"]
            .iter()
            .chain(&["feed_forward.w1", "feed_forward.w3"])
            .map(|m| rule(&format!("*.{m}.weight"), 0, 1))
            .collect();
        params.extend(
            ["attention.wo", "feed_forward.w2"]
                .iter()
                .map(|m| rule(&format!("*.{m}.weight"), 1, 0)),
        );
        params.extend(Plan::fsdp().params);
        Plan {
            params,
            sequence_parallel: true,
            // The output head reads the whole sequence: gathering its input (`dim` wide) costs
            // less than gathering the logits (`vocab` wide), and the head's weight gradient then
            // needs no split rows.
            pins: vec![PinRule {
                module: "output".into(),
                placements: BTreeMap::from([(TENSOR_DIM.to_string(), Placement::Replicate)]),
            }],
        }
    }

    pub fn from_ron(text: &str) -> Result<Plan, String> {
        ron::from_str(text).map_err(|e| format!("plan: {e}"))
    }

    pub fn to_ron(&self) -> String {
        ron::ser::to_string_pretty(self, ron::ser::PrettyConfig::default())
            .expect("a plan serializes")
    }
}

/// `*` matches any run of characters, everything else itself.
pub fn glob(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, rest)) => {
            let Some(tail) = name.strip_prefix(head) else {
                return false;
            };
            (0..=tail.len()).any(|i| tail.is_char_boundary(i) && glob(rest, &tail[i..]))
        }
    }
}

/// The data dimensions: the batch is split over these.
const DATA_DIMS: [&str; 2] = ["dp_replicate", "dp_shard"];

/// The tensor-parallel dimension: weights split, activations between blocks replicated.
const TENSOR_DIM: &str = "tp";

/// The SPMD train step and what a runner needs to feed it.
pub struct Parallel {
    pub step: TrainStep,
    pub mesh: Mesh,
    /// Every parameter's placement, by name (optimizer state is placed as its parameter).
    pub param_placements: BTreeMap<String, Placements>,
}

/// Builds the SPMD train step of `traced` (a single-device forward graph whose output `loss` is
/// the mean loss) over `mesh` with parameters placed by `plan`.
pub fn parallelize(
    traced: Traced,
    mesh: &Mesh,
    plan: &Plan,
    cfg: &OptimConfig,
) -> Result<Parallel, String> {
    for d in &mesh.dims {
        if !DATA_DIMS.contains(&d.name.as_str()) && d.name != TENSOR_DIM && d.size > 1 {
            return Err(format!(
                "mesh {mesh}: `{}` is not supported yet (context, pipeline and expert parallelism are not built); use dp_replicate, dp_shard and tp",
                d.name
            ));
        }
    }
    let placements = param_placements(&traced, mesh, plan)?;
    let data_split = DataSplit::new(mesh, plan.sequence_parallel);
    check_pins(&traced, mesh, &plan.pins)?;
    let local = localize(&traced, mesh, &placements, &data_split, &plan.pins)?;

    let reductions = DataParallel {
        mesh: mesh.clone(),
        params: traced
            .params
            .iter()
            .map(|p| placements[&p.name].clone())
            .collect(),
        grad_placements: RefCell::new(None),
    };
    let step = build_train_step_with(local, "loss", cfg, Some(&reductions))
        .map_err(|e| format!("parallelize: {e}"))?;
    let mut step = step;
    step.graph = regather_in_backward(&step.graph);
    place_signature(&mut step.graph, mesh, &placements, &data_split);
    step.graph = step.graph.canonical();
    for p in &mut step.params {
        p.value = step
            .graph
            .input_named(&p.name)
            .map(|i| i.value)
            .unwrap_or(p.value);
    }
    verify(&step.graph).map_err(|e| format!("parallelize built an invalid graph: {e}"))?;
    Ok(Parallel {
        step,
        mesh: mesh.clone(),
        param_placements: placements,
    })
}

/// Pins name modules the graph has and ask for `Replicate` on known mesh dimensions.
fn check_pins(traced: &Traced, mesh: &Mesh, pins: &[PinRule]) -> Result<(), String> {
    for pin in pins {
        if !traced
            .graph
            .nodes
            .iter()
            .any(|n| glob(&pin.module, &n.meta.module))
        {
            return Err(format!(
                "plan: the pin on `{}` matches no module of the graph",
                pin.module
            ));
        }
        for (dim, placement) in &pin.placements {
            if mesh.dim(dim).is_none()
                && !graphtrain_ir::mesh::MESH_DIM_NAMES.contains(&dim.as_str())
            {
                return Err(format!(
                    "plan: the pin on `{}` places on `{dim}`, which is not a mesh dimension (known: {})",
                    pin.module,
                    graphtrain_ir::mesh::MESH_DIM_NAMES.join(", ")
                ));
            }
            if *placement != Placement::Replicate {
                return Err(format!(
                    "plan: the pin on `{}` asks for {placement} on `{dim}`; pins may only ask for replicate so far",
                    pin.module
                ));
            }
        }
    }
    Ok(())
}

/// Every parameter's placement from the plan, checked against the mesh and the shapes.
fn param_placements(
    traced: &Traced,
    mesh: &Mesh,
    plan: &Plan,
) -> Result<BTreeMap<String, Placements>, String> {
    for rule in &plan.params {
        if !traced.params.iter().any(|p| glob(&rule.pattern, &p.name)) {
            let names: Vec<&str> = traced
                .params
                .iter()
                .take(4)
                .map(|p| p.name.as_str())
                .collect();
            return Err(format!(
                "plan: `{}` matches no parameter (parameters are named like {})",
                rule.pattern,
                names.join(", ")
            ));
        }
        for name in rule.placements.keys() {
            if mesh.dim(name).is_none()
                && !graphtrain_ir::mesh::MESH_DIM_NAMES.contains(&name.as_str())
            {
                return Err(format!(
                    "plan: `{}` places on `{name}`, which is not a mesh dimension (known: {})",
                    rule.pattern,
                    graphtrain_ir::mesh::MESH_DIM_NAMES.join(", ")
                ));
            }
        }
    }
    let mut out = BTreeMap::new();
    for p in &traced.params {
        let ty = traced.graph.ty(p.value);
        let rule = plan.params.iter().find(|r| glob(&r.pattern, &p.name));
        let placements = Placements(
            mesh.dims
                .iter()
                .map(|d| {
                    let wanted = rule.and_then(|r| r.placements.get(&d.name)).copied();
                    // A dimension of size 1 splits nothing: replicated, so that a mesh of
                    // ones is the single-device step.
                    match wanted {
                        Some(p) if d.size > 1 => p,
                        _ => Placement::Replicate,
                    }
                })
                .collect(),
        );
        if let Some(q) = placements
            .0
            .iter()
            .find(|q| matches!(q, Placement::Partial(_)))
        {
            return Err(format!("plan: parameter `{}` cannot be {q}", p.name));
        }
        placements
            .local_shape(mesh, &ty.shape)
            .map_err(|e| format!("parameter `{}` ({ty}): {e}", p.name))?;
        out.insert(p.name.clone(), placements);
    }
    Ok(out)
}

/// How the batch inputs split: rows over the data dimensions of size > 1; with sequence
/// parallelism the tokens also by position over `tp`, so that the embedding's output, the
/// residual stream, starts split by sequence.
struct DataSplit {
    rows: Placements,
    tokens: Placements,
}

impl DataSplit {
    fn new(mesh: &Mesh, sequence_parallel: bool) -> DataSplit {
        let placed = |tp: Placement| {
            Placements(
                mesh.dims
                    .iter()
                    .map(|d| match d.name.as_str() {
                        _ if d.size == 1 => Placement::Replicate,
                        n if DATA_DIMS.contains(&n) => Placement::Shard(0),
                        TENSOR_DIM => tp,
                        _ => Placement::Replicate,
                    })
                    .collect(),
            )
        };
        let tp = if sequence_parallel {
            Placement::Shard(1)
        } else {
            Placement::Replicate
        };
        DataSplit {
            rows: placed(Placement::Replicate),
            tokens: placed(tp),
        }
    }

    /// The placement of data input `name` of rank `rank` (scalars are replicated).
    fn of(&self, name: &str, rank: usize, mesh: &Mesh) -> Placements {
        match (name, rank) {
            (_, 0) => Placements::replicated(mesh),
            ("tokens", _) => self.tokens.clone(),
            _ => self.rows.clone(),
        }
    }
}

/// The mesh dimensions (of size > 1) where `p` is sharded.
fn sharded_dims(p: &Placements, mesh: &Mesh) -> Vec<usize> {
    (0..mesh.dims.len())
        .filter(|&m| mesh.dims[m].size > 1 && matches!(p.0[m], Placement::Shard(_)))
        .collect()
}

/// A start and its wait.
fn collective(
    g: &mut Graph,
    c: Collective,
    mesh: &Mesh,
    dims: &[usize],
    x: ValueId,
    meta: &Meta,
) -> Result<ValueId, TypeError> {
    let handle = g.push1(
        Op::CollectiveStart {
            collective: c,
            mesh_dims: dims.to_vec(),
            group: mesh.group_size(dims),
        },
        vec![x],
        meta.clone(),
    )?;
    g.push1(Op::Wait, vec![handle], meta.clone())
}

/// The forward graph each rank runs: local input shapes, parameters gathered before first use,
/// shape attributes rewritten to local shapes. Placements follow `spmd::node_rule` on the
/// global types.
fn localize(
    traced: &Traced,
    mesh: &Mesh,
    params: &BTreeMap<String, Placements>,
    data: &DataSplit,
    pins: &[PinRule],
) -> Result<Traced, String> {
    let src = &traced.graph;
    let mut g = Graph::new(src.name.clone());
    g.mesh = Some(mesh.clone());
    // For every source value: its local value and placement.
    let mut map: Vec<Option<(ValueId, Placements)>> = vec![None; src.values.len()];
    let mut new_params = Vec::new();
    for input in &src.inputs {
        let ty = src.ty(input.value);
        let placement = match input.kind {
            InputKind::Param | InputKind::State => params
                .get(&input.name)
                .cloned()
                .unwrap_or_else(|| Placements::replicated(mesh)),
            InputKind::Data => data.of(&input.name, ty.rank(), mesh),
        };
        let local = placement.local_shape(mesh, &ty.shape).map_err(|e| {
            format!(
                "input `{}` ({ty}) does not split over the mesh {mesh}: {e}",
                input.name
            )
        })?;
        let v = g.add_input(
            input.name.clone(),
            input.kind,
            TensorType::new(ty.dtype, local),
        );
        g.inputs.last_mut().expect("just added").placement = Some(placement.clone());
        map[input.value.index()] = Some((v, placement));
    }
    for p in &traced.params {
        let (value, _) = map[p.value.index()].clone().expect("parameters are inputs");
        new_params.push(ParamSpec { value, ..p.clone() });
    }
    // Parameters sharded over some dims are gathered once, right before their first use.
    let mut gathered: BTreeMap<usize, (ValueId, Placements)> = BTreeMap::new();
    // Parameters and their layout changes (a transpose, reshape or cast of one), by source
    // value: never gathered over `tp`.
    let mut weight = vec![false; src.values.len()];
    for p in &traced.params {
        weight[p.value.index()] = true;
    }
    let mut redistributed = Redistributed::new();
    let param_of: BTreeMap<usize, &str> = traced
        .params
        .iter()
        .map(|p| (p.value.index(), p.name.as_str()))
        .collect();
    for (i, node) in src.nodes.iter().enumerate() {
        let at = |m: String| {
            format!(
                "node {i} ({} in `{}`): {m}",
                node.op.name(),
                node.meta.module
            )
        };
        let mut ins = Vec::with_capacity(node.inputs.len());
        for v in &node.inputs {
            let (local, placement) = map[v.index()].clone().expect("operands come first");
            // FSDP: gathered over the data dimensions; a split over `tp` stays (each rank
            // computes with its part of the weight).
            let sharded: Vec<usize> = sharded_dims(&placement, mesh)
                .into_iter()
                .filter(|&m| DATA_DIMS.contains(&mesh.dims[m].name.as_str()))
                .collect();
            if param_of.contains_key(&v.index()) && !sharded.is_empty() {
                if let Some(done) = gathered.get(&v.index()) {
                    ins.push(done.clone());
                    continue;
                }
                let meta = Meta::new(module_of(param_of[&v.index()]), Phase::Forward);
                let mut x = local;
                // One all-gather per sharded mesh dim, along the axis it splits.
                for &m in &sharded {
                    let Placement::Shard(axis) = placement.0[m] else {
                        unreachable!()
                    };
                    x = collective(&mut g, Collective::AllGather { axis }, mesh, &[m], x, &meta)
                        .map_err(|e| at(e.to_string()))?;
                }
                let mut full = (x, placement.clone());
                for &m in &sharded {
                    full.1 .0[m] = Placement::Replicate;
                }
                gathered.insert(v.index(), full.clone());
                ins.push(full);
            } else {
                ins.push((local, placement));
            }
        }
        let global_in: Vec<&TensorType> = node.inputs.iter().map(|v| src.ty(*v)).collect();
        let global_out: Vec<&TensorType> = node.outputs.iter().map(|v| src.ty(*v)).collect();
        let rule = |ins: &[(ValueId, Placements)]| {
            let in_placements: Vec<&Placements> = ins.iter().map(|(_, p)| p).collect();
            node_rule(&node.op, &in_placements, &global_in, &global_out, mesh)
        };
        let is_param: Vec<bool> = node.inputs.iter().map(|v| weight[v.index()]).collect();
        if is_param.iter().any(|w| *w)
            && matches!(
                node.op,
                Op::Transpose { .. } | Op::Reshape { .. } | Op::Cast { .. }
            )
        {
            for o in &node.outputs {
                weight[o.index()] = true;
            }
        }
        let mut apply = |stage: Redistribute, ins: &mut Vec<(ValueId, Placements)>| {
            let operands = Operands {
                g: &mut g,
                mesh,
                ins,
                is_param: &is_param,
                done: &mut redistributed,
                meta: &node.meta,
                pins,
            };
            redistribute(stage, operands).map_err(|e| at(e.to_string()))
        };
        if let Some(pin) = pins.iter().position(|p| glob(&p.module, &node.meta.module)) {
            apply(Redistribute::Pinned(pin), &mut ins)?;
        }
        let mut outs = rule(&ins);
        for stage in [Redistribute::Partials, Redistribute::SequenceShards] {
            if outs.is_ok() {
                break;
            }
            if apply(stage, &mut ins)? {
                outs = rule(&ins);
            }
        }
        let outs = outs
            .map_err(&at)?
            .ok_or_else(|| at("no placement rule for this op yet".into()))?;
        let local_out: Vec<TensorType> = global_out
            .iter()
            .zip(&outs)
            .map(|(t, p)| {
                p.local_shape(mesh, &t.shape)
                    .map(|s| TensorType::new(t.dtype, s))
                    .map_err(|e| at(format!("its result {t} does not split: {e}")))
            })
            .collect::<Result<_, _>>()?;
        let op = with_local_shape(&node.op, &local_out[0]);
        let values = g
            .push(op, ins.iter().map(|(v, _)| *v).collect(), node.meta.clone())
            .map_err(|e| at(e.to_string()))?;
        for (k, ((src_v, v), p)) in node.outputs.iter().zip(values).zip(outs).enumerate() {
            if *g.ty(v) != local_out[k] {
                return Err(at(format!(
                    "internal error: local type {} where the placements give another",
                    g.ty(v)
                )));
            }
            map[src_v.index()] = Some((v, p));
        }
    }
    for out in &src.outputs {
        let (v, _) = map[out.value.index()].clone().expect("outputs are defined");
        g.add_output(out.name.clone(), v, None);
    }
    Ok(Traced {
        graph: g,
        params: new_params,
    })
}

/// The redistributions `localize` inserts: those a plan pins, then, where an op refuses its
/// operands' placements, the others in this order until the op's rule accepts them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Redistribute {
    /// Activation operands made `Replicate` on the dimensions pin `.0` names.
    Pinned(usize),
    /// A partial operand is reduce-scattered to the split another operand has along `tp` (the
    /// residual add after a block under sequence parallelism), or else all-reduced (the
    /// residual add after a block under plain tensor parallelism).
    Partials,
    /// An activation split by sequence over `tp` is all-gathered (the input of a block's split
    /// matmuls under sequence parallelism). Parameters are never gathered over `tp`: their
    /// split is the point.
    SequenceShards,
}

/// What `localize` redistributed, by local value and kind: each once, however many use it.
type Redistributed = BTreeMap<(usize, Redistribute), (ValueId, Placements)>;

/// One node's operands as `redistribute` rewrites them.
struct Operands<'a> {
    g: &'a mut Graph,
    mesh: &'a Mesh,
    ins: &'a mut [(ValueId, Placements)],
    is_param: &'a [bool],
    done: &'a mut Redistributed,
    meta: &'a Meta,
    pins: &'a [PinRule],
}

/// Applies `stage` to every operand it concerns; false when none.
fn redistribute(stage: Redistribute, o: Operands<'_>) -> Result<bool, TypeError> {
    let mesh = o.mesh;
    let before: Vec<(ValueId, Placements)> = o.ins.to_vec();
    let mut changed = false;
    for i in 0..o.ins.len() {
        let key = (o.ins[i].0.index(), stage);
        if let Some(done) = o.done.get(&key) {
            o.ins[i] = done.clone();
            changed = true;
            continue;
        }
        let (mut v, mut p) = o.ins[i].clone();
        let rank = o.g.ty(v).rank();
        for m in 0..mesh.dims.len() {
            let is_tp = mesh.dims[m].name == TENSOR_DIM;
            let c = match (stage, p.0[m]) {
                (Redistribute::Partials, Placement::Partial(reduce)) => {
                    // The split of another operand of the same rank along this dimension.
                    let sibling = before
                        .iter()
                        .enumerate()
                        .find_map(|(j, (w, q))| match q.0[m] {
                            Placement::Shard(d) if j != i && o.g.ty(*w).rank() == rank => Some(d),
                            _ => None,
                        });
                    match sibling {
                        Some(axis) if is_tp => Collective::ReduceScatter { axis, reduce },
                        _ => Collective::AllReduce { reduce },
                    }
                }
                (Redistribute::SequenceShards, Placement::Shard(axis))
                    if is_tp && !o.is_param[i] =>
                {
                    Collective::AllGather { axis }
                }
                (Redistribute::Pinned(pin), q)
                    if !o.is_param[i]
                        && o.pins[pin].placements.contains_key(&mesh.dims[m].name) =>
                {
                    match q {
                        Placement::Shard(axis) => Collective::AllGather { axis },
                        Placement::Partial(reduce) => Collective::AllReduce { reduce },
                        Placement::Replicate => continue,
                    }
                }
                _ => continue,
            };
            v = collective(o.g, c, mesh, &[m], v, o.meta)?;
            p.0[m] = match c {
                Collective::ReduceScatter { axis, .. } => Placement::Shard(axis),
                _ => Placement::Replicate,
            };
        }
        if v != o.ins[i].0 {
            o.done.insert(key, (v, p.clone()));
            o.ins[i] = (v, p);
            changed = true;
        }
    }
    Ok(changed)
}

/// `layers.0.attention.wq.weight` -> `layers.0.attention.wq`: the gather belongs to the module.
fn module_of(param: &str) -> String {
    param
        .rsplit_once('.')
        .map_or(param.to_string(), |(m, _)| m.to_string())
}

/// `op` with the shape attribute that fixes its result's shape set to `local`.
fn with_local_shape(op: &Op, local: &TensorType) -> Op {
    let shape = local.shape.clone();
    match op {
        Op::Reshape { .. } => Op::Reshape { shape },
        Op::Expand { .. } => Op::Expand { shape },
        Op::Full { value, dtype, .. } => Op::Full {
            value: *value,
            shape,
            dtype: *dtype,
        },
        Op::Iota { axis, dtype, .. } => Op::Iota {
            shape,
            axis: *axis,
            dtype: *dtype,
        },
        Op::EmbeddingBackward { .. } => Op::EmbeddingBackward { rows: shape[0] },
        other => other.clone(),
    }
}

/// The reductions of the ranks over the mesh: data parallelism (FSDP, DDP, HSDP) over the data
/// dimensions and tensor parallelism over `tp`.
struct DataParallel {
    mesh: Mesh,
    /// Placement of every parameter, in `Traced::params` order.
    params: Vec<Placements>,
    /// The placement of every value of the graph as it was when the first gradient was reduced
    /// (every gradient exists by then), worked out once.
    grad_placements: RefCell<Option<Vec<Option<Placements>>>>,
}

impl DataParallel {
    fn dims_named(&self, names: &[&str]) -> Vec<usize> {
        (0..self.mesh.dims.len())
            .filter(|&m| {
                names.contains(&self.mesh.dims[m].name.as_str()) && self.mesh.dims[m].size > 1
            })
            .collect()
    }

    /// Where `grad` (a value of `g`) is placed, from the placements of `g`'s inputs.
    fn placement_of(&self, g: &Graph, grad: ValueId, meta: &Meta) -> Result<Placements, TypeError> {
        let fail = |message: String| TypeError {
            op: "parallelize",
            module: meta.module.clone(),
            operands: vec![g.ty(grad).clone()],
            message,
        };
        let mut cache = self.grad_placements.borrow_mut();
        if cache.is_none() {
            let propagation = graphtrain_ir::spmd::propagate(g, &self.mesh).map_err(|(i, e)| {
                fail(format!(
                    "the backward pass cannot be placed at node {i} ({} in `{}`): {e}",
                    g.nodes[i].op.name(),
                    g.nodes[i].meta.module
                ))
            })?;
            *cache = Some(propagation.placements);
        }
        cache
            .as_ref()
            .and_then(|c| c.get(grad.index()).cloned().flatten())
            .ok_or_else(|| fail("the gradient's placement is unknown".into()))
    }
}

impl RankReductions for DataParallel {
    fn seed(&self) -> f64 {
        1.0 / self.mesh.group_size(&self.dims_named(&DATA_DIMS)) as f64
    }

    /// The loss is replicated over `tp`, whose ranks each computed a part of it: its gradient
    /// starts partial there, as every replicated value's gradient is.
    fn seed_partial(&self) -> Option<(Vec<usize>, usize)> {
        let dims = self.dims_named(&[TENSOR_DIM]);
        (!dims.is_empty()).then(|| {
            let group = self.mesh.group_size(&dims);
            (dims, group)
        })
    }

    /// Each rank's gradient of a parameter replicated over a mesh dimension is partial there
    /// (the batch is split over data dimensions, the work over `tp`): all-reduced over those
    /// dimensions. A sharded parameter's was already reduce-scattered (the gather's adjoint).
    /// Checked against placement propagation: the result must be placed as the parameter.
    fn reduce_grad(
        &self,
        g: &mut Graph,
        index: usize,
        grad: ValueId,
        meta: &Meta,
    ) -> Result<ValueId, TypeError> {
        let p = &self.params[index];
        let placed = self.placement_of(g, grad, meta)?;
        let mut out = grad;
        let mut now = placed.clone();
        for reduce in [Reduce::Sum, Reduce::Avg] {
            let dims: Vec<usize> = (0..self.mesh.dims.len())
                .filter(|&m| {
                    p.0[m] == Placement::Replicate && placed.0[m] == Placement::Partial(reduce)
                })
                .collect();
            if dims.is_empty() {
                continue;
            }
            out = collective(
                g,
                Collective::AllReduce { reduce },
                &self.mesh,
                &dims,
                out,
                meta,
            )?;
            for m in dims {
                now.0[m] = Placement::Replicate;
            }
        }
        if now != *p {
            return Err(TypeError {
                op: "parallelize",
                module: meta.module.clone(),
                operands: vec![g.ty(grad).clone()],
                message: format!("the gradient is placed {placed}, the parameter {p}"),
            });
        }
        Ok(out)
    }

    /// Sums of sharded gradients are partial over the dims that shard them: each group of
    /// parameters sharded alike is summed locally, then all-reduced over those dims.
    fn square_sum(
        &self,
        g: &mut Graph,
        sums: &[ValueId],
        meta: &Meta,
    ) -> Result<ValueId, TypeError> {
        let mut groups: BTreeMap<Vec<usize>, ValueId> = BTreeMap::new();
        for (s, p) in sums.iter().zip(&self.params) {
            let key = sharded_dims(p, &self.mesh);
            let total = match groups.get(&key) {
                None => *s,
                Some(t) => g.push1(Op::Binary(BinaryOp::Add), vec![*t, *s], meta.clone())?,
            };
            groups.insert(key, total);
        }
        let mut total: Option<ValueId> = None;
        for (dims, sum) in groups {
            let sum = if dims.is_empty() {
                sum
            } else {
                collective(
                    g,
                    Collective::AllReduce {
                        reduce: Reduce::Sum,
                    },
                    &self.mesh,
                    &dims,
                    sum,
                    meta,
                )?
            };
            total = Some(match total {
                None => sum,
                Some(t) => g.push1(Op::Binary(BinaryOp::Add), vec![t, sum], meta.clone())?,
            });
        }
        match total {
            Some(t) => Ok(t),
            None => g.push1(
                Op::Full {
                    value: 0.0,
                    shape: vec![],
                    dtype: graphtrain_ir::DType::F32,
                },
                vec![],
                meta.clone(),
            ),
        }
    }

    fn report_loss(&self, g: &mut Graph, loss: ValueId, meta: &Meta) -> Result<ValueId, TypeError> {
        let dims = self.dims_named(&DATA_DIMS);
        if dims.is_empty() {
            return Ok(loss);
        }
        collective(
            g,
            Collective::AllReduce {
                reduce: Reduce::Avg,
            },
            &self.mesh,
            &dims,
            loss,
            meta,
        )
    }
}

/// Backward reads of a gathered parameter (or of its transpose, reshape or cast) read a fresh
/// gather instead: the gathers and the layout ops on them are recomputed in backward (the
/// `remat` pass's machinery), so no gathered weight lives from forward to backward.
fn regather_in_backward(g: &Graph) -> Graph {
    let mut from_gather = vec![false; g.values.len()];
    let is_param: Vec<bool> = {
        let mut v = vec![false; g.values.len()];
        for i in g.inputs.iter().filter(|i| i.kind == InputKind::Param) {
            v[i.value.index()] = true;
        }
        v
    };
    let mut tagged = vec![false; g.nodes.len()];
    for (i, n) in g.nodes.iter().enumerate() {
        if n.meta.phase > Phase::Loss {
            continue;
        }
        let reads = |ok: &dyn Fn(ValueId) -> bool| n.inputs.iter().all(|v| ok(*v));
        let gathered = |v: ValueId| from_gather[v.index()];
        tagged[i] = match &n.op {
            Op::CollectiveStart {
                collective: Collective::AllGather { .. },
                ..
            } => reads(&|v| is_param[v.index()] || gathered(v)),
            Op::Wait | Op::Transpose { .. } | Op::Reshape { .. } | Op::Cast { .. } => {
                reads(&gathered)
            }
            _ => false,
        };
        if tagged[i] {
            for o in &n.outputs {
                from_gather[o.index()] = true;
            }
        }
    }
    let plan = crate::remat::plan(g, |i| tagged[i]);
    crate::remat::apply(g, &plan).0
}

/// Placements of every input and output of the train step: data split by rows, parameters and
/// their state as planned, the rest (learning rate, step, loss, grad norm) replicated.
fn place_signature(
    g: &mut Graph,
    mesh: &Mesh,
    params: &BTreeMap<String, Placements>,
    data: &DataSplit,
) {
    let of = |name: &str| -> Option<Placements> {
        params.get(name).cloned().or_else(|| {
            // `opt.m.NAME` and `opt.v.NAME` are placed as `NAME`.
            let rest = name.strip_prefix("opt.")?;
            let (_, param) = rest.split_once('.')?;
            params.get(param).cloned()
        })
    };
    let types: Vec<usize> = g.inputs.iter().map(|i| g.ty(i.value).rank()).collect();
    for (input, rank) in g.inputs.iter_mut().zip(types) {
        input.placement = Some(match (input.kind, input.placement.take()) {
            // The batch as `localize` placed it (and a split into micro-batches moved it).
            (InputKind::Data, Some(placed)) => placed,
            (InputKind::Data, None) => data.of(&input.name, rank, mesh),
            _ => of(&input.name).unwrap_or_else(|| Placements::replicated(mesh)),
        });
    }
    for out in g.outputs.iter_mut() {
        out.placement = Some(of(&out.name).unwrap_or_else(|| Placements::replicated(mesh)));
    }
}
