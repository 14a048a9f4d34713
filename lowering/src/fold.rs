//! Constant folding: values that depend on no graph input (rope tables, causal masks, iota
//! comparisons) are computed once at lowering by the interpreter and written into the arena at
//! load, instead of by kernels on every step.
//!
//! Guarantees: random draws are never folded (their seed is an input); only the folded values
//! an unfolded node or a graph output reads get a buffer; a `full` or `expand` that a kernel
//! reads is not folded at its expanded size (it stays a constant in its reader's kernel, or a
//! broadcast read of its folded source), so a `[B, H, S, S]` mask costs `[S, S]`. Both modes
//! fold the same nodes, so folding cannot make eager and fused lowering differ.
//!
//! Declines (`LowerError`): a folded value reaching a kernel as a dtype other than f32, i32 or
//! bool; an integer constant beyond 2^24 (`MAX_EXACT_INT`); the interpreter failing on the
//! constant subgraph.

use crate::program::{LowerError, MAX_EXACT_INT};
use graphtrain_ir::{interp, DType, Graph, HostTensor, Op, ValueId};

/// Marks the nodes computable without any graph input (random draws excluded: their seed is an
/// input), and evaluates, with the interpreter, the folded values that unfolded nodes read.
/// Per node: folded; and the folded values the program needs, with their contents.
type Folding = (Vec<bool>, Vec<(ValueId, HostTensor)>);

pub(crate) fn fold_constants(g: &Graph) -> Result<Folding, LowerError> {
    let mut is_const = vec![false; g.values.len()];
    let mut folded = vec![false; g.nodes.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        let random = matches!(n.op, Op::RandomUniform { .. } | Op::RandomNormal { .. });
        if !random && n.inputs.iter().all(|v| is_const[v.index()]) {
            folded[k] = true;
            for o in &n.outputs {
                is_const[o.index()] = true;
            }
        }
    }
    // Folded values read by an unfolded node or returned by the graph.
    let producers = g.producers();
    let needed_by = |folded: &[bool]| {
        let mut needed: Vec<ValueId> = Vec::new();
        let mut push = |v: ValueId| {
            let folded_here = producers[v.index()].is_some_and(|k| folded[k]);
            if is_const[v.index()] && folded_here && !needed.contains(&v) {
                needed.push(v);
            }
        };
        for (k, n) in g.nodes.iter().enumerate() {
            if !folded[k] {
                n.inputs.iter().for_each(|&v| push(v));
            }
        }
        g.outputs.iter().for_each(|o| push(o.value));
        needed
    };
    // A needed `full` or `expand` is not folded: a `full` is a constant expression its
    // consumer's kernel evaluates, an `expand` a broadcast read of its (folded) input. Folded,
    // either would hold a buffer of the expanded size for the whole program and make every
    // reader stream it (the causal mask and its -inf fill are `[B, H, S, S]`).
    let computable = folded.clone();
    let mut needed = needed_by(&folded);
    loop {
        let mut unfolded = false;
        for v in &needed {
            if let Some(k) = producers[v.index()] {
                if folded[k]
                    && matches!(g.nodes[k].op, Op::Full { .. } | Op::Expand { .. })
                    && g.ty(*v).numel() > 1
                {
                    folded[k] = false;
                    unfolded = true;
                }
            }
        }
        if !unfolded {
            break;
        }
        needed = needed_by(&folded);
    }
    if needed.is_empty() {
        return Ok((folded, Vec::new()));
    }
    // The folded nodes the needed values depend on, as a graph of their own, run once by the
    // interpreter. (Only those: an unfolded `full` or `expand` may be huge, and nothing needs
    // its value at load.)
    let mut required = vec![false; g.nodes.len()];
    let mut stack: Vec<usize> = needed.iter().filter_map(|v| producers[v.index()]).collect();
    while let Some(k) = stack.pop() {
        if std::mem::replace(&mut required[k], true) {
            continue;
        }
        stack.extend(
            g.nodes[k]
                .inputs
                .iter()
                .filter_map(|v| producers[v.index()])
                .filter(|&p| computable[p]),
        );
    }
    let mut sub = Graph::new("constants");
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        if !required[k] {
            continue;
        }
        let ins: Vec<ValueId> = n
            .inputs
            .iter()
            .map(|v| map[v.index()].expect("folded"))
            .collect();
        let types = n.outputs.iter().map(|o| g.ty(*o).clone()).collect();
        let outs = sub.push_typed(n.op.clone(), ins, types, n.meta.clone());
        for (o, new) in n.outputs.iter().zip(outs) {
            map[o.index()] = Some(new);
        }
    }
    for (i, v) in needed.iter().enumerate() {
        sub.add_output(format!("c{i}"), map[v.index()].expect("folded"), None);
    }
    let out = interp::run(&sub, &[]).map_err(|e| LowerError {
        node: None,
        module: String::new(),
        message: format!("evaluating the graph's constants failed: {e}"),
    })?;
    for (v, t) in needed.iter().zip(&out.outputs) {
        let d = g.ty(*v).dtype;
        if !matches!(d, DType::F32 | DType::I32 | DType::Bool) {
            return Err(LowerError {
                node: None,
                module: String::new(),
                message: format!("a {d} constant reaches a kernel: the compiled backends hold f32, i32 and bool tensors"),
            });
        }
        if !d.is_float() && t.data.iter().any(|x| x.abs() > MAX_EXACT_INT as f64) {
            return Err(LowerError {
                node: None,
                module: String::new(),
                message:
                    "an integer constant exceeds 2^24, which the f32 storage cannot hold exactly"
                        .into(),
            });
        }
    }
    Ok((folded, needed.into_iter().zip(out.outputs).collect()))
}

#[cfg(test)]
mod tests {
    use crate::{lower, Mode};

    /// A causal mask and its -inf fill, broadcast to the scores' shape, stay small: the mask is
    /// folded at its own `[S, S]` size and read as a broadcast, the fill is a constant in the
    /// kernel. Numerics are checked on the cpu backend (tests/backends.rs, attention).
    #[test]
    fn broadcast_and_filled_constants_are_not_folded_at_full_size() {
        let g = graphtrain_ir::text::parse(
            "graph g {
  input %x: f32[2,3,16,16]
  %1: i32[16,16] = iota(shape=[16,16], axis=0, dtype=i32)
  %2: i32[16,16] = iota(shape=[16,16], axis=1, dtype=i32)
  %3: bool[16,16] = gt(%2, %1)
  %7: bool[1,1,16,16] = reshape(%3, shape=[1,1,16,16])
  %4: bool[2,3,16,16] = expand(%7, shape=[2,3,16,16])
  %5: f32[2,3,16,16] = full(value=-inf, shape=[2,3,16,16], dtype=f32)
  %6: f32[2,3,16,16] = select(%4, %5, %x)
  output o = %6
}",
        )
        .unwrap();
        let p = lower(&g, Mode::Fused).unwrap();
        let folded: Vec<usize> = p.constants.iter().map(|(_, t)| t.data.len()).collect();
        assert_eq!(folded, vec![256], "only the [16, 16] mask is folded");
        assert_eq!(p.steps.len(), 1, "one map: {:?}", p.steps);
    }
}
