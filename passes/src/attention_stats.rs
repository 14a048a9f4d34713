//! `attention_stats`: attention's backward rebuilds the probabilities from the forward's row
//! statistics instead of softmaxing the scores again.
//!
//! Why: the backward recomputes each score row `s = q kᵀ · scale` (the forward keeps no
//! `[S, S]` probabilities) and then its softmax: a max over the row, `exp(s - max)`, a sum and a
//! division, three passes over the row besides the exponentials. With the forward's max and
//! sum (8 bytes a query row, as flash attention keeps its logsumexp), the backward makes one
//! pass: `p = exp(s - max) / sum`.
//!
//! Changes: an `attention_backward` whose `q`, `k` and `v` are the very values an `attention`
//! of the same mask and scale read becomes `attention_backward(q, k, v, dout, stats,
//! stats=true)`, where `stats` is that forward's new second output (`attention(...,
//! stats=true)`, `[B, H, S, 2]`: each query row's max and sum, f32, f64 for f64 attention).
//! Guarantees: tier 1: the statistics are the ones the backward's own softmax would compute
//! (the same scores, max and sum in the same order and precision on every backend: the
//! interpreter holds them in the statistics' dtype both ways), so every result is bit for bit
//! the same. Costs: the statistics live from the forward to the backward, `B·H·S·8` bytes a
//! layer (0.5 MiB over `peer`'s four layers).
//! Declines: a backward whose `q`, `k` or `v` is not a forward attention's operand (activation
//! checkpointing recomputed them in backward: put this pass before `ac`, as the default
//! pipeline does), or whose forward has another mask or scale.

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::infer::attention_stats_type;
use graphtrain_ir::{Graph, Op, ValueId};
use std::collections::HashMap;

pub const INFO: PassInfo = PassInfo {
    name: "attention_stats",
    tier: Tier::Preserving,
    summary: "attention's backward rebuilds the probabilities from the forward's row max and sum",
    contract: "An attention_backward whose q, k and v are the operands of an attention with the \
same mask and scale reads that forward's softmax statistics (a second output, [B, H, S, 2]: each \
query row's max and sum of exponentials) and rebuilds the probabilities as exp(s - max) / sum, \
one pass over each score row instead of a softmax. Tier 1: the statistics are the ones the \
backward's softmax would compute, so results are bitwise unchanged. The statistics live from \
forward to backward (8 bytes a query row). Declines a backward whose q, k or v were recomputed \
(activation checkpointing: run it before ac, as the default pipeline does).",
    option_help: None,
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| match option {
        None => Ok(Box::new(AttentionStats)),
        Some(o) => Err(format!("attention_stats takes no option (got `{o}`)")),
    });
}

pub struct AttentionStats;

/// What pairs a backward with its forward: the operands, the mask and the scale's bits.
type Key = (ValueId, ValueId, ValueId, bool, u64);

impl Pass for AttentionStats {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut out = g.clone();
        let mut report = PassReport::default();
        // Forward attentions by what they read; the first of equal ones (cse merges them).
        let mut forwards: HashMap<Key, usize> = HashMap::new();
        let mut stats_of: HashMap<usize, ValueId> = HashMap::new();
        let (mut pairs, mut bytes) = (0usize, 0usize);
        for i in 0..out.nodes.len() {
            let node = &out.nodes[i];
            match node.op {
                Op::Attention {
                    causal,
                    scale,
                    stats,
                } => {
                    let [q, k, v] = node.inputs[..] else { continue };
                    let key = (q, k, v, causal, scale.to_bits());
                    forwards.entry(key).or_insert(i);
                    if stats {
                        stats_of.entry(i).or_insert(node.outputs[1]);
                    }
                }
                Op::AttentionBackward {
                    causal,
                    scale,
                    stats: false,
                } => {
                    let [q, k, v, _] = node.inputs[..] else {
                        continue;
                    };
                    let Some(&forward) = forwards.get(&(q, k, v, causal, scale.to_bits())) else {
                        report.decline(
                            Some(i),
                            &node.meta.module,
                            "its q, k and v are not a forward attention's operands (recomputed \
in backward, or no forward of this mask and scale)",
                        );
                        continue;
                    };
                    let stats = match stats_of.get(&forward) {
                        Some(&stats) => stats,
                        None => {
                            let ty = attention_stats_type(out.ty(q));
                            bytes += ty.size_bytes();
                            let stats = ValueId(out.values.len() as u32);
                            out.values.push(ty);
                            let f = &mut out.nodes[forward];
                            f.outputs.push(stats);
                            if let Op::Attention { stats: with, .. } = &mut f.op {
                                *with = true;
                            }
                            stats_of.insert(forward, stats);
                            stats
                        }
                    };
                    let b = &mut out.nodes[i];
                    b.inputs.push(stats);
                    if let Op::AttentionBackward { stats: with, .. } = &mut b.op {
                        *with = true;
                    }
                    pairs += 1;
                }
                _ => {}
            }
        }
        if pairs == 0 {
            if report.declined.is_empty() {
                report.decline(None, "", "no attention backward in the graph");
            }
            return Ok((g.clone(), report));
        }
        report.change(format!(
            "{pairs} attention backwards rebuild their probabilities from the forward's row \
statistics (one exp per score, no softmax); {bytes} bytes of statistics held from forward to \
backward"
        ));
        report.metric("attention_stats.pairs", pairs as f64);
        report.metric("attention_stats.bytes", bytes as f64);
        Ok((out.canonical(), report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    /// One causal attention and its backward over grouped heads (2 query heads, 1 kv head).
    const PAIR: &str = "graph g {
  input %q: f32[1,2,3,4]
  input %k: f32[1,1,3,4]
  input %v: f32[1,1,3,4]
  input %g: f32[1,2,3,4]
  %4: f32[1,2,3,4] = attention(%q, %k, %v, causal=true, scale=0.5)  # fwd layers.0.attention
  %5: f32[1,2,3,4], %6: f32[1,1,3,4], %7: f32[1,1,3,4] = attention_backward(%q, %k, %v, %g, causal=true, scale=0.5)  # bwd layers.0.attention
  output o = %4
  output dq = %5
  output dk = %6
  output dv = %7
}";

    #[test]
    fn the_backward_reads_its_forwards_statistics() {
        let out = check(&AttentionStats, PAIR);
        insta::assert_snapshot!(out);
        assert!(out.contains("1 attention backwards rebuild"), "{out}");
        assert!(out.contains("stats=true"), "{out}");
    }

    /// The backward reads a recomputed `q` (as after activation checkpointing), and a second
    /// backward reads a forward of another scale: both are left as they are.
    #[test]
    fn recomputed_operands_and_another_scale_are_declined() {
        let text = "graph g {
  input %q: f32[1,2,3,4]
  input %k: f32[1,1,3,4]
  input %v: f32[1,1,3,4]
  input %g: f32[1,2,3,4]
  %4: f32[1,2,3,4] = attention(%q, %k, %v, causal=true, scale=0.5)  # fwd layers.0.attention
  %5: f32[1,2,3,4] = mul_scalar(%q, value=1.0)  # bwd layers.0.attention
  %6: f32[1,2,3,4], %7: f32[1,1,3,4], %8: f32[1,1,3,4] = attention_backward(%5, %k, %v, %g, causal=true, scale=0.5)  # bwd layers.0.attention
  %9: f32[1,2,3,4], %10: f32[1,1,3,4], %11: f32[1,1,3,4] = attention_backward(%q, %k, %v, %g, causal=true, scale=0.25)  # bwd layers.0.attention
  output o = %4
  output dq = %6
  output dq2 = %9
}";
        let out = check(&AttentionStats, text);
        insta::assert_snapshot!(out);
        assert!(!out.contains("stats=true"), "{out}");
    }
}
