//! Extraction: pick one node per needed e-class so that the resulting DAG is small, then rebuild a
//! `Graph` from the picks.
//!
//! Why not egg's `Extractor`: it minimizes *tree* cost, so a value read by two consumers is paid
//! twice, and on a train step (where every forward activation feeds the backward pass) it
//! happily duplicates whole subgraphs to save a node on one path. This is the greedy DAG
//! extractor of extraction-gym (`greedy-dag`): the cost of a class is the *set* of op classes its
//! chosen sub-DAG uses, so shared subgraphs count once, and a class's cost is the size of the
//! union of its children's sets plus itself. Costs are propagated to a fixpoint with a worklist
//! (a class is revisited when a child's cost improves); a node whose children's sets already
//! contain its own class would close a cycle and is skipped. Ties go to nodes of the input graph,
//! so that an e-graph where nothing got better extracts the input back.
//!
//! Greedy DAG extraction is not optimal (that is NP-hard; the ILP extractor is), but it never
//! does worse than the input on what it measures: the input's own nodes are a candidate at every
//! class.

use super::analysis::EG;
use super::lang::{op_of, GNode};
use egg::{Id, Language};
use graphtrain_ir::{Graph, Meta, Phase, ValueId};
use std::collections::{BinaryHeap, HashMap, HashSet, VecDeque};
use std::rc::Rc;

/// The chosen node of every class the roots need, children canonical.
pub struct Choice {
    pub nodes: HashMap<Id, GNode>,
    /// Op nodes in the extracted DAG (projections and inputs are free).
    pub cost: usize,
}

/// Greedy DAG extraction from `roots`. `order` lists classes in the order to visit first (the
/// input's schedule order makes the first sweep bottom-up, so most classes settle on their first
/// visit); `original` holds the input graph's nodes (canonical), preferred on ties.
pub fn extract_dag(
    eg: &EG,
    roots: &[Id],
    order: &[Id],
    original: &HashSet<GNode>,
) -> Result<Choice, String> {
    let mut index: HashMap<Id, usize> = HashMap::new();
    let mut classes: Vec<Id> = Vec::new();
    for id in order
        .iter()
        .map(|&c| eg.find(c))
        .chain(eg.classes().map(|c| c.id))
    {
        index.entry(id).or_insert_with(|| {
            classes.push(id);
            classes.len() - 1
        });
    }
    let n = classes.len();
    let mut parents: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, &c) in classes.iter().enumerate() {
        for node in &eg[c].nodes {
            for k in node.children() {
                parents[index[&eg.find(*k)]].push(i);
            }
        }
    }
    // Cost of a class: the sorted set of op classes (dense indices) its chosen sub-DAG uses.
    let mut cost: Vec<Option<Rc<Vec<u32>>>> = vec![None; n];
    let mut pick: Vec<Option<(usize, bool)>> = vec![None; n];
    let mut queue: VecDeque<usize> = (0..n).collect();
    let mut queued = vec![true; n];
    // Greedy DAG costs can in principle oscillate; the bound keeps the worst case finite, and the
    // picks made by then are as valid as the fixpoint's (cycles are checked below).
    let mut budget = n.saturating_mul(64).max(1024);
    while let Some(i) = queue.pop_front() {
        queued[i] = false;
        if budget == 0 {
            break;
        }
        budget -= 1;
        let class = &eg[classes[i]];
        let mut best: Option<(usize, bool, usize, Vec<u32>)> = None;
        for (k, node) in class.nodes.iter().enumerate() {
            let mut set: Vec<u32> = Vec::new();
            let mut ready = true;
            for child in node.children() {
                match &cost[index[&eg.find(*child)]] {
                    Some(s) => set = union(&set, s),
                    None => ready = false,
                }
                if !ready {
                    break;
                }
            }
            if !ready || set.binary_search(&(i as u32)).is_ok() {
                continue;
            }
            if matches!(node, GNode::Op { .. }) {
                set = union(&set, &[i as u32]);
            }
            let novel = !original.contains(node);
            let better = match &best {
                None => true,
                Some((_, b_novel, b_len, _)) => (set.len(), novel) < (*b_len, *b_novel),
            };
            if better {
                best = Some((k, novel, set.len(), set));
            }
        }
        let Some((k, novel, len, set)) = best else {
            continue;
        };
        let improves = match (&cost[i], pick[i]) {
            (Some(old), Some((_, old_novel))) => (len, novel) < (old.len(), old_novel),
            _ => true,
        };
        if improves {
            cost[i] = Some(Rc::new(set));
            pick[i] = Some((k, novel));
            for &p in &parents[i] {
                if !queued[p] {
                    queued[p] = true;
                    queue.push_back(p);
                }
            }
        }
    }

    improve(eg, &classes, &index, roots, &mut pick);

    // Walk the picks from the roots; a class met again while still on the path is a cycle.
    let mut nodes: HashMap<Id, GNode> = HashMap::new();
    let mut state: HashMap<Id, bool> = HashMap::new(); // false: on the path, true: done
    let mut stack: Vec<(Id, bool)> = roots.iter().rev().map(|&r| (eg.find(r), false)).collect();
    while let Some((c, exiting)) = stack.pop() {
        if exiting {
            state.insert(c, true);
            continue;
        }
        match state.get(&c) {
            Some(true) => continue,
            Some(false) => return Err("the extracted graph has a cycle".into()),
            None => {}
        }
        let i = index[&c];
        let Some((k, _)) = pick[i] else {
            return Err(format!("e-class {c} has no acyclic choice"));
        };
        let node = eg[c].nodes[k].clone().map_children(|x| eg.find(x));
        state.insert(c, false);
        stack.push((c, true));
        for child in node.children().iter().rev() {
            match state.get(child) {
                Some(true) => {}
                Some(false) => return Err("the extracted graph has a cycle".into()),
                None => stack.push((*child, false)),
            }
        }
        nodes.insert(c, node);
    }
    let cost = nodes
        .values()
        .filter(|n| matches!(n, GNode::Op { .. }))
        .count();
    Ok(Choice { nodes, cost })
}

/// Work bound of [`improve`], in class visits: a few sweeps over a train step, while an e-graph
/// near the node limit gets a bounded share rather than quadratic time.
const IMPROVE_BUDGET: usize = 20_000_000;

/// Local search on top of the greedy picks. Greedy costs are per class, so when two forms of a
/// class cost the same it cannot see that one of them shares nodes with a sibling's sub-DAG
/// (`a * transpose(-x)` vs `a * -(transpose x)` with `a = transpose x`). Here each alternative node
/// of every class in the extracted DAG is tried against the *whole* DAG's size, and kept when
/// that shrinks; sweeps repeat until nothing improves or the budget is spent.
fn improve(
    eg: &EG,
    classes: &[Id],
    index: &HashMap<Id, usize>,
    roots: &[Id],
    pick: &mut [Option<(usize, bool)>],
) {
    let roots: Vec<usize> = roots.iter().map(|r| index[&eg.find(*r)]).collect();
    let children: Vec<Vec<Vec<usize>>> = classes
        .iter()
        .map(|&c| {
            eg[c]
                .nodes
                .iter()
                .map(|n| n.children().iter().map(|k| index[&eg.find(*k)]).collect())
                .collect()
        })
        .collect();
    let is_op: Vec<Vec<bool>> = classes
        .iter()
        .map(|&c| {
            eg[c]
                .nodes
                .iter()
                .map(|n| matches!(n, GNode::Op { .. }))
                .collect()
        })
        .collect();
    let mut budget = IMPROVE_BUDGET;
    // Size of the DAG the picks reach from the roots, or None on a cycle or a missing pick.
    let mut mark = vec![0u32; classes.len()]; // 2*epoch: on the path, 2*epoch+1: done
    let mut epoch = 0u32;
    let mut dag =
        |pick: &[Option<(usize, bool)>], budget: &mut usize| -> Option<(usize, Vec<usize>)> {
            epoch += 1;
            let (open, done) = (2 * epoch, 2 * epoch + 1);
            let mut size = 0;
            let mut seen = Vec::new();
            let mut stack: Vec<(usize, bool)> = roots.iter().map(|&r| (r, false)).collect();
            while let Some((c, exiting)) = stack.pop() {
                if exiting {
                    mark[c] = done;
                    continue;
                }
                if mark[c] == done {
                    continue;
                }
                if mark[c] == open {
                    return None;
                }
                *budget = budget.saturating_sub(1);
                let (k, _) = pick[c]?;
                mark[c] = open;
                seen.push(c);
                size += usize::from(is_op[c][k]);
                stack.push((c, true));
                for &child in &children[c][k] {
                    if mark[child] == open {
                        return None;
                    }
                    if mark[child] != done {
                        stack.push((child, false));
                    }
                }
            }
            Some((size, seen))
        };
    let Some((mut best, mut reached)) = dag(pick, &mut budget) else {
        return;
    };
    loop {
        let mut improved = false;
        for c in reached.clone() {
            for (k, kids) in children[c].iter().enumerate() {
                if budget == 0 {
                    return;
                }
                let Some(old) = pick[c] else { continue };
                if k == old.0 || kids.iter().any(|&d| pick[d].is_none()) {
                    continue;
                }
                pick[c] = Some((k, old.1));
                match dag(pick, &mut budget) {
                    Some((size, seen)) if size < best => {
                        best = size;
                        reached = seen;
                        improved = true;
                    }
                    _ => pick[c] = Some(old),
                }
            }
        }
        if !improved {
            return;
        }
    }
}

/// Union of two sorted sets.
fn union(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            std::cmp::Ordering::Less => {
                out.push(a[i]);
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                out.push(b[j]);
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                out.push(a[i]);
                i += 1;
                j += 1;
            }
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// Where an extracted node goes: the metadata and schedule position of the earliest input node
/// of its class.
#[derive(Clone, Debug)]
pub struct Origin {
    pub position: usize,
    pub meta: Meta,
}

/// Rebuilds a graph from the picks: same inputs and outputs as `g` (names, kinds, order,
/// donations), `roots[k]` the class of output `k`, `origins` the input-node origin of classes.
///
/// Schedule: every node is keyed by (stage, position of its origin), the stage being the
/// micro-batch and phase (`Meta::stage`); a class new to the e-graph has no origin and takes its
/// first consumer's, so it lands just before it. Stages are lifted to the latest stage of the
/// operands, and nodes are emitted by a topological sort that always takes the smallest ready
/// key; with lifted stages that order is topological and stage-monotone.
pub fn rebuild(
    g: &Graph,
    eg: &EG,
    choice: &Choice,
    roots: &[Id],
    origins: &HashMap<Id, Origin>,
) -> Result<Graph, String> {
    // Op classes in depth-first post-order, each with the origin it inherits.
    let mut items: Vec<Id> = Vec::new();
    let mut item_of: HashMap<Id, usize> = HashMap::new();
    let mut origin_of: HashMap<Id, Origin> = HashMap::new();
    let fallback = Origin {
        position: g.nodes.len(),
        meta: Meta::new("", Phase::Optimizer),
    };
    let mut stack: Vec<(Id, Origin, bool)> = roots
        .iter()
        .rev()
        .map(|&r| (eg.find(r), fallback.clone(), false))
        .collect();
    let mut seen: HashSet<Id> = HashSet::new();
    while let Some((c, inherited, exiting)) = stack.pop() {
        let node = choice
            .nodes
            .get(&c)
            .ok_or_else(|| format!("no choice for e-class {c}"))?;
        if exiting {
            if matches!(node, GNode::Op { .. }) {
                item_of.insert(c, items.len());
                items.push(c);
            }
            continue;
        }
        if !seen.insert(c) {
            continue;
        }
        let own = origins.get(&c).cloned().unwrap_or(inherited);
        origin_of.insert(c, own.clone());
        stack.push((c, own.clone(), true));
        for child in node.children().iter().rev() {
            stack.push((*child, own.clone(), false));
        }
    }

    // Operand items of every item (projections resolve to their tuple's item).
    let item_of_class = |c: Id| -> Option<usize> {
        match choice.nodes.get(&c)? {
            GNode::Get(_, [t]) => item_of.get(t).copied(),
            GNode::Op { .. } => item_of.get(&c).copied(),
            GNode::Input(_) => None,
        }
    };
    let mut deps: Vec<Vec<usize>> = vec![Vec::new(); items.len()];
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); items.len()];
    let mut stage: Vec<(u32, Phase)> = Vec::with_capacity(items.len());
    for (i, &c) in items.iter().enumerate() {
        let mut s = origin_of[&c].meta.stage();
        for child in choice.nodes[&c].children() {
            if let Some(d) = item_of_class(*child) {
                deps[i].push(d);
                users[d].push(i);
                // Post-order: operands were numbered (and staged) first.
                s = s.max(stage[d]);
            }
        }
        stage.push(s);
    }
    let mut missing: Vec<usize> = deps.iter().map(Vec::len).collect();
    let key = |i: usize| std::cmp::Reverse((stage[i], origin_of[&items[i]].position, i));
    let mut ready: BinaryHeap<_> = (0..items.len())
        .filter(|&i| missing[i] == 0)
        .map(key)
        .collect();
    let mut order = Vec::with_capacity(items.len());
    while let Some(std::cmp::Reverse((_, _, i))) = ready.pop() {
        order.push(i);
        for &u in &users[i] {
            missing[u] -= 1;
            if missing[u] == 0 {
                ready.push(key(u));
            }
        }
    }
    if order.len() != items.len() {
        return Err("the extracted graph has a cycle".into());
    }

    let mut out = Graph::new(g.name.clone());
    for input in &g.inputs {
        out.add_input(input.name.clone(), input.kind, g.ty(input.value).clone());
    }
    let mut outputs_of: Vec<Vec<ValueId>> = vec![Vec::new(); items.len()];
    let value_of = |c: Id, outputs_of: &[Vec<ValueId>]| -> Result<ValueId, String> {
        match choice.nodes.get(&c) {
            Some(GNode::Input(k)) => out_input(g, *k),
            Some(GNode::Get(k, [t])) => item_of
                .get(t)
                .and_then(|&i| outputs_of[i].get(*k as usize).copied())
                .ok_or_else(|| format!("projection {k} of e-class {t} has no value")),
            Some(GNode::Op { .. }) => item_of
                .get(&c)
                .and_then(|&i| outputs_of[i].first().copied())
                .ok_or_else(|| format!("e-class {c} has no value")),
            None => Err(format!("no choice for e-class {c}")),
        }
    };
    for &i in &order {
        let c = items[i];
        let GNode::Op {
            name,
            attrs,
            children,
        } = &choice.nodes[&c]
        else {
            continue;
        };
        let op = op_of(name.as_str(), attrs.as_str())?;
        let operands = children
            .iter()
            .map(|k| value_of(*k, &outputs_of))
            .collect::<Result<Vec<_>, _>>()?;
        let mut meta = origin_of[&c].meta.clone();
        let (micro_batch, phase) = stage[i];
        meta.phase = phase;
        if meta.stage() != stage[i] {
            meta.micro_batch = (phase != Phase::Optimizer).then_some(micro_batch);
        }
        outputs_of[i] = out.push(op, operands, meta).map_err(|e| e.to_string())?;
    }
    for (o, &root) in g.outputs.iter().zip(roots) {
        let value = value_of(eg.find(root), &outputs_of)?;
        let donates = match o.donates {
            Some(d) => {
                let k = g
                    .inputs
                    .iter()
                    .position(|i| i.value == d)
                    .ok_or_else(|| format!("output `{}` donates a non-input", o.name))?;
                Some(out_input(g, k as u32)?)
            }
            None => None,
        };
        out.add_output(o.name.clone(), value, donates);
    }
    out.keep_distribution_of(g);
    Ok(out)
}

/// The value of input `k` in the rebuilt graph: inputs are added first, in order.
fn out_input(g: &Graph, k: u32) -> Result<ValueId, String> {
    if (k as usize) < g.inputs.len() {
        Ok(ValueId(k))
    } else {
        Err(format!("no graph input #{k}"))
    }
}
