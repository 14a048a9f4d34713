//! Parallel plans for burn's weight layout. A burn `Linear` holds `[d_in, d_out]`, the
//! transpose of torch's `[out, in]` that graphtrain's built-in Llama plan is written for, so
//! each split axis of a two-dimensional weight swaps: Megatron's column split (output
//! features) is axis 1 here, its row split axis 0, and FSDP's row blocks move alike.

use graphtrain_ir::{Mesh, Placement};
use graphtrain_passes::parallelize::Plan;

/// The built-in Llama plan (`Plan::llama`) for a burn model with torchtitan's module names
/// and burn's `[d_in, d_out]` Linear weights: the split axes of the Linear weights swapped.
/// Embedding tables (`[vocab, dim]` in both) and norm gains keep theirs.
pub fn llama_plan(mesh: &Mesh) -> Plan {
    let mut plan = Plan::llama(mesh);
    for rule in &mut plan.params {
        let linear = ["attention.w", "feed_forward.w", "output.weight"]
            .iter()
            .any(|m| rule.pattern.contains(m));
        if !linear {
            continue;
        }
        for placement in rule.placements.values_mut() {
            if let Placement::Shard(axis @ (0 | 1)) = *placement {
                *placement = Placement::Shard(1 - axis);
            }
        }
    }
    plan
}
