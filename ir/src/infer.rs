//! Output types of every op from its operand types: the single source of shape rules, used when
//! nodes are built (tracing, autodiff, passes) and by the verifier.

use crate::dtype::{DType, TensorType};
use crate::op::{Arity, Collective, Op};

fn same_type(op: &str, a: &TensorType, b: &TensorType) -> Result<(), String> {
    if a != b {
        return Err(format!(
            "{op} needs operands of the same type, got {a} and {b}"
        ));
    }
    Ok(())
}

fn need_float(what: &str, t: &TensorType) -> Result<(), String> {
    if !t.dtype.is_float() {
        return Err(format!("{what} must be a float tensor, got {t}"));
    }
    Ok(())
}

fn need_int(what: &str, t: &TensorType) -> Result<(), String> {
    if !t.dtype.is_int() {
        return Err(format!(
            "{what} must be an integer tensor (i32 or i64), got {t}"
        ));
    }
    Ok(())
}

fn need_rank(what: &str, t: &TensorType, rank: usize) -> Result<(), String> {
    if t.rank() != rank {
        return Err(format!("{what} must have rank {rank}, got {t}"));
    }
    Ok(())
}

fn need_scalar(what: &str, t: &TensorType) -> Result<(), String> {
    if t.rank() != 0 {
        return Err(format!("{what} must be a scalar, got {t}"));
    }
    Ok(())
}

fn check_axis(axis: usize, rank: usize) -> Result<(), String> {
    if axis >= rank {
        return Err(format!("axis {axis} is out of range for rank {rank}"));
    }
    Ok(())
}

/// The output types of `op` applied to operands of types `ins`, or why the op refuses them.
pub fn infer_types(op: &Op, ins: &[TensorType]) -> Result<Vec<TensorType>, String> {
    match op.arity() {
        Arity::Exactly(n) if ins.len() != n => {
            return Err(format!("takes {n} operand(s), got {}", ins.len()));
        }
        Arity::AtLeast(n) if ins.len() < n => {
            return Err(format!("takes at least {n} operand(s), got {}", ins.len()));
        }
        _ => {}
    }
    let one = |t: TensorType| Ok(vec![t]);
    match op {
        Op::Unary(u) => {
            need_float(&format!("the operand of {}", u.name()), &ins[0])?;
            one(ins[0].clone())
        }
        Op::AddScalar { .. } | Op::MulScalar { .. } => {
            if ins[0].dtype == DType::Bool {
                return Err(format!("operand must be numeric, got {}", ins[0]));
            }
            one(ins[0].clone())
        }
        Op::PowScalar { .. } => {
            need_float("the operand", &ins[0])?;
            one(ins[0].clone())
        }
        Op::Binary(b) => {
            same_type(b.name(), &ins[0], &ins[1])?;
            if ins[0].dtype == DType::Bool {
                return Err(format!("operands must be numeric, got {}", ins[0]));
            }
            one(ins[0].clone())
        }
        Op::Compare(c) => {
            same_type(c.name(), &ins[0], &ins[1])?;
            one(ins[0].with_dtype(DType::Bool))
        }
        Op::Select => {
            if ins[0].dtype != DType::Bool {
                return Err(format!("the condition must be bool, got {}", ins[0]));
            }
            same_type("select", &ins[1], &ins[2])?;
            if ins[0].shape != ins[1].shape {
                return Err(format!(
                    "the condition shape {} differs from the operand shape {}",
                    ins[0], ins[1]
                ));
            }
            one(ins[1].clone())
        }
        Op::Cast { dtype } => one(ins[0].with_dtype(*dtype)),
        Op::Offload | Op::Reload => one(ins[0].clone()),
        Op::ReduceSum { axes, keepdim } | Op::ReduceMax { axes, keepdim } => {
            let t = &ins[0];
            if t.dtype == DType::Bool {
                return Err(format!("operand must be numeric, got {t}"));
            }
            let mut seen = vec![false; t.rank()];
            for &a in axes {
                check_axis(a, t.rank())?;
                if seen[a] {
                    return Err(format!("axis {a} is listed twice"));
                }
                seen[a] = true;
            }
            let shape: Vec<usize> = if *keepdim {
                t.shape
                    .iter()
                    .enumerate()
                    .map(|(i, &d)| if seen[i] { 1 } else { d })
                    .collect()
            } else {
                t.shape
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !seen[*i])
                    .map(|(_, &d)| d)
                    .collect()
            };
            one(t.with_shape(shape))
        }
        Op::Reshape { shape } => {
            let n: usize = shape.iter().product();
            if n != ins[0].numel() {
                return Err(format!(
                    "cannot reshape {} ({} elements) to {:?} ({n} elements)",
                    ins[0],
                    ins[0].numel(),
                    shape
                ));
            }
            one(ins[0].with_shape(shape.clone()))
        }
        Op::Transpose { perm } => {
            let t = &ins[0];
            let mut sorted = perm.clone();
            sorted.sort_unstable();
            if sorted != (0..t.rank()).collect::<Vec<_>>() {
                return Err(format!(
                    "perm {perm:?} is not a permutation of 0..{}",
                    t.rank()
                ));
            }
            one(t.with_shape(perm.iter().map(|&p| t.shape[p]).collect::<Vec<_>>()))
        }
        Op::Expand { shape } => {
            let t = &ins[0];
            if shape.len() != t.rank() {
                return Err(format!(
                    "expand keeps the rank: {t} cannot expand to {shape:?} (reshape first)"
                ));
            }
            for (i, (&from, &to)) in t.shape.iter().zip(shape).enumerate() {
                if from != to && from != 1 {
                    return Err(format!(
                        "dim {i} has size {from}, which cannot expand to {to}"
                    ));
                }
            }
            one(t.with_shape(shape.clone()))
        }
        Op::Slice { axis, start, end } => {
            let t = &ins[0];
            check_axis(*axis, t.rank())?;
            if start > end || *end > t.shape[*axis] {
                return Err(format!(
                    "slice {start}..{end} is out of bounds for dim {axis} of size {}",
                    t.shape[*axis]
                ));
            }
            let mut shape = t.shape.clone();
            shape[*axis] = end - start;
            one(t.with_shape(shape))
        }
        Op::Concat { axis } => {
            let first = &ins[0];
            check_axis(*axis, first.rank())?;
            let mut total = 0;
            for (k, t) in ins.iter().enumerate() {
                if t.dtype != first.dtype || t.rank() != first.rank() {
                    return Err(format!("operand {k} is {t}, operand 0 is {first}"));
                }
                for d in 0..t.rank() {
                    if d != *axis && t.shape[d] != first.shape[d] {
                        return Err(format!(
                            "operand {k} is {t}, operand 0 is {first}: they differ in dim {d}, which is not the concat axis"
                        ));
                    }
                }
                total += t.shape[*axis];
            }
            let mut shape = first.shape.clone();
            shape[*axis] = total;
            one(first.with_shape(shape))
        }
        Op::Gather { axis } => {
            let (x, idx) = (&ins[0], &ins[1]);
            check_axis(*axis, x.rank())?;
            need_int("the index", idx)?;
            check_index_shape(x, idx, *axis)?;
            one(x.with_shape(idx.shape.clone()))
        }
        Op::ScatterAdd { axis } => {
            let (x, idx, src) = (&ins[0], &ins[1], &ins[2]);
            check_axis(*axis, x.rank())?;
            need_int("the index", idx)?;
            check_index_shape(x, idx, *axis)?;
            if src.dtype != x.dtype || src.shape != idx.shape {
                return Err(format!(
                    "the source must have the index's shape and the target's dtype: target {x}, index {idx}, source {src}"
                ));
            }
            one(x.clone())
        }
        Op::Matmul => {
            let (a, b) = (&ins[0], &ins[1]);
            if a.dtype != b.dtype || !a.dtype.is_float() {
                return Err(format!(
                    "operands must share a float dtype, got {a} and {b}"
                ));
            }
            if a.rank() < 2 || b.rank() < 2 {
                return Err(format!("operands must have rank >= 2, got {a} and {b}"));
            }
            let (m, k) = (a.shape[a.rank() - 2], a.shape[a.rank() - 1]);
            let (k2, n) = (b.shape[b.rank() - 2], b.shape[b.rank() - 1]);
            if k != k2 {
                return Err(format!("inner dims differ: {a} @ {b} ({k} vs {k2})"));
            }
            let batch_a = &a.shape[..a.rank() - 2];
            let batch_b = &b.shape[..b.rank() - 2];
            if b.rank() != 2 && batch_a != batch_b {
                return Err(format!(
                    "batch dims differ: {a} @ {b} (the right operand must have the same batch dims or rank 2)"
                ));
            }
            let mut shape = batch_a.to_vec();
            shape.extend([m, n]);
            one(a.with_shape(shape))
        }
        Op::Full { shape, dtype, .. } => one(TensorType::new(*dtype, shape.clone())),
        Op::Iota { shape, axis, dtype } => {
            check_axis(*axis, shape.len())?;
            if *dtype == DType::Bool {
                return Err("iota cannot produce bool".into());
            }
            one(TensorType::new(*dtype, shape.clone()))
        }
        Op::RandomUniform { shape, dtype, .. } | Op::RandomNormal { shape, dtype, .. } => {
            need_scalar("the seed", &ins[0])?;
            need_int("the seed", &ins[0])?;
            if !dtype.is_float() {
                return Err(format!("random values must be float, got {dtype}"));
            }
            one(TensorType::new(*dtype, shape.clone()))
        }
        Op::Embedding => {
            let (w, ids) = (&ins[0], &ins[1]);
            need_float("the weight", w)?;
            need_rank("the weight", w, 2)?;
            need_int("the ids", ids)?;
            let mut shape = ids.shape.clone();
            shape.push(w.shape[1]);
            one(w.with_shape(shape))
        }
        Op::EmbeddingBackward { rows } => {
            let (g, ids) = (&ins[0], &ins[1]);
            need_float("the gradient", g)?;
            need_int("the ids", ids)?;
            if g.rank() != ids.rank() + 1 || g.shape[..ids.rank()] != ids.shape[..] {
                return Err(format!(
                    "the gradient {g} must have the ids' shape {ids} plus one trailing dim"
                ));
            }
            one(g.with_shape(vec![*rows, g.shape[g.rank() - 1]]))
        }
        Op::RmsNorm { .. } => {
            let (x, w) = (&ins[0], &ins[1]);
            check_norm(x, w)?;
            one(x.clone())
        }
        Op::RmsNormBackward { .. } => {
            let (x, w, g) = (&ins[0], &ins[1], &ins[2]);
            check_norm(x, w)?;
            same_type("rms_norm_backward", x, g)?;
            Ok(vec![x.clone(), w.clone()])
        }
        Op::Rope { .. } => {
            let x = &ins[0];
            need_float("the operand", x)?;
            need_rank("the operand ([B, S, H, D])", x, 4)?;
            if !x.shape[3].is_multiple_of(2) {
                return Err(format!("the head dim must be even, got {x}"));
            }
            one(x.clone())
        }
        Op::Attention { stats, .. } => {
            check_attention(&ins[0], &ins[1], &ins[2])?;
            let mut outs = vec![ins[0].clone()];
            if *stats {
                outs.push(attention_stats_type(&ins[0]));
            }
            Ok(outs)
        }
        Op::AttentionBackward { stats, .. } => {
            check_attention(&ins[0], &ins[1], &ins[2])?;
            same_type("attention_backward (q vs grad)", &ins[0], &ins[3])?;
            if *stats {
                same_type(
                    "attention_backward (the forward's statistics for q)",
                    &attention_stats_type(&ins[0]),
                    &ins[4],
                )?;
            }
            Ok(vec![ins[0].clone(), ins[1].clone(), ins[2].clone()])
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } => {
            need_float("the operand", &ins[0])?;
            check_axis(*axis, ins[0].rank())?;
            one(ins[0].clone())
        }
        Op::CrossEntropy => {
            let (logits, targets) = (&ins[0], &ins[1]);
            check_cross_entropy(logits, targets)?;
            one(TensorType::scalar(logits.dtype))
        }
        Op::CrossEntropyBackward => {
            let (logits, targets, g) = (&ins[0], &ins[1], &ins[2]);
            check_cross_entropy(logits, targets)?;
            if *g != TensorType::scalar(logits.dtype) {
                return Err(format!(
                    "the loss gradient must be a {} scalar, got {g}",
                    logits.dtype
                ));
            }
            one(logits.clone())
        }
        Op::AdamW { .. } => {
            let (p, g, m, v, lr, step) = (&ins[0], &ins[1], &ins[2], &ins[3], &ins[4], &ins[5]);
            need_float("the parameter", p)?;
            for (name, t) in [("gradient", g), ("first moment", m), ("second moment", v)] {
                if t.shape != p.shape || !t.dtype.is_float() {
                    return Err(format!("the {name} {t} does not match the parameter {p}"));
                }
            }
            need_scalar("the learning rate", lr)?;
            need_float("the learning rate", lr)?;
            need_scalar("the step", step)?;
            Ok(vec![p.clone(), m.clone(), v.clone()])
        }
        Op::Sgd { .. } => {
            let (p, g, lr) = (&ins[0], &ins[1], &ins[2]);
            need_float("the parameter", p)?;
            if g.shape != p.shape || !g.dtype.is_float() {
                return Err(format!("the gradient {g} does not match the parameter {p}"));
            }
            need_scalar("the learning rate", lr)?;
            need_float("the learning rate", lr)?;
            one(p.clone())
        }
        Op::CollectiveStart {
            collective,
            mesh_dims,
            group,
        } => one(collective_type(*collective, mesh_dims, *group, &ins[0])?),
        Op::Wait => one(ins[0].clone()),
        Op::ToPartial { group, .. } => {
            if *group == 0 {
                return Err("to_partial over a group of 0 ranks".into());
            }
            need_float("to_partial's operand", &ins[0])?;
            one(ins[0].clone())
        }
    }
}

/// The result type of `collective` over a group of `group` ranks (the mesh itself is checked by
/// the verifier: `group` must be the product of the sizes of `mesh_dims`).
fn collective_type(
    collective: Collective,
    mesh_dims: &[usize],
    group: usize,
    x: &TensorType,
) -> Result<TensorType, String> {
    if mesh_dims.is_empty() {
        return Err("a collective needs at least one mesh dimension".into());
    }
    if group == 0 {
        return Err("a collective's group has at least one rank".into());
    }
    let mut shape = x.shape.clone();
    let split = |shape: &[usize], axis: usize| -> Result<usize, String> {
        check_axis(axis, shape.len())?;
        if !shape[axis].is_multiple_of(group) {
            return Err(format!(
                "axis {axis} of {x} does not split into {group} equal blocks"
            ));
        }
        Ok(shape[axis] / group)
    };
    match collective {
        Collective::AllGather { axis } => {
            check_axis(axis, shape.len())?;
            shape[axis] *= group;
        }
        Collective::ReduceScatter { axis, .. } => {
            need_float("the operand of reduce_scatter", x)?;
            shape[axis] = split(&shape, axis)?;
        }
        Collective::AllReduce { .. } => need_float("the operand of all_reduce", x)?,
        Collective::AllToAll {
            split_axis,
            concat_axis,
        } => {
            shape[split_axis] = split(&shape, split_axis)?;
            check_axis(concat_axis, shape.len())?;
            shape[concat_axis] *= group;
        }
        Collective::Broadcast { root } => {
            if root >= group {
                return Err(format!(
                    "broadcast root {root} is not in a group of {group}"
                ));
            }
        }
    }
    Ok(TensorType::new(x.dtype, shape))
}

fn check_index_shape(x: &TensorType, idx: &TensorType, axis: usize) -> Result<(), String> {
    if idx.rank() != x.rank() {
        return Err(format!("the index {idx} must have the rank of {x}"));
    }
    for d in 0..x.rank() {
        if d != axis && idx.shape[d] != x.shape[d] {
            return Err(format!(
                "the index {idx} must match {x} in every dim but the axis {axis} (dim {d} differs)"
            ));
        }
    }
    Ok(())
}

fn check_norm(x: &TensorType, w: &TensorType) -> Result<(), String> {
    need_float("the operand", x)?;
    if x.rank() == 0 {
        return Err("the operand must have rank >= 1".into());
    }
    let d = x.shape[x.rank() - 1];
    if w.rank() != 1 || w.shape[0] != d || w.dtype != x.dtype {
        return Err(format!("the weight must be {}[{d}], got {w}", x.dtype));
    }
    Ok(())
}

/// Attention's softmax statistics for queries `q: [B, H, S, D]`: `[B, H, S, 2]`, each row's max
/// and sum of exponentials (`Op::Attention`), in f32 (f64 for f64 queries: the precision the
/// softmax is computed in).
pub fn attention_stats_type(q: &TensorType) -> TensorType {
    let mut shape = q.shape.clone();
    if let Some(last) = shape.last_mut() {
        *last = 2;
    }
    let dtype = if q.dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    TensorType::new(dtype, shape)
}

fn check_attention(q: &TensorType, k: &TensorType, v: &TensorType) -> Result<(), String> {
    need_float("q", q)?;
    need_rank("q ([B, H, S, D])", q, 4)?;
    need_rank("k", k, 4)?;
    need_rank("v", v, 4)?;
    if k != v {
        return Err(format!("k and v must have the same type, got {k} and {v}"));
    }
    if k.dtype != q.dtype
        || k.shape[0] != q.shape[0]
        || k.shape[2] != q.shape[2]
        || k.shape[3] != q.shape[3]
    {
        return Err(format!(
            "k {k} must match q {q} in batch, sequence and head dim"
        ));
    }
    if k.shape[1] == 0 || !q.shape[1].is_multiple_of(k.shape[1]) {
        return Err(format!(
            "query heads ({}) must be a multiple of key/value heads ({})",
            q.shape[1], k.shape[1]
        ));
    }
    Ok(())
}

fn check_cross_entropy(logits: &TensorType, targets: &TensorType) -> Result<(), String> {
    need_float("the logits", logits)?;
    need_rank("the logits ([N, V])", logits, 2)?;
    need_int("the targets", targets)?;
    if targets.shape != [logits.shape[0]] {
        return Err(format!(
            "the targets must be [{}], got {targets}",
            logits.shape[0]
        ));
    }
    Ok(())
}
