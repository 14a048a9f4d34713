//! `schedule`: starts each collective as early as a per-rank memory limit allows, so that its
//! communication overlaps as much compute as the memory can pay for.
//!
//! A collective started earlier holds its result buffer (and keeps its operand) from its start
//! to its wait: the start/wait distance is memory. `prefetch` moves every start a fixed number
//! of nodes; `schedule=memory:BYTES` moves each one, in schedule order, to the earliest place
//! where the liveness prediction of the whole step (`memory::profile`, the planner's model)
//! still peaks at or under BYTES.
//!
//! Changes: node order only, as `prefetch` (a start never goes before the node producing its
//! operand nor out of its phase, layout nodes preparing its operand move with it; waits stay
//! right before their first use).
//! Guarantees: tier 1 (only when collectives are issued changes, the same on every rank); the
//! predicted peak of the result is at most BYTES.
//! Declines: a graph without collectives; a step whose predicted peak already exceeds BYTES
//! (nothing can move), saying by how much; starts that cannot move a single node under the
//! limit are left where they are and counted.

use crate::memory::{human_bytes, profile};
use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::prefetch::{place, reordered, Moves};
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::{Graph, Op, ValueId};

pub const INFO: PassInfo = PassInfo {
    name: "schedule",
    tier: Tier::Preserving,
    summary: "start each collective as early as a per-rank memory limit allows",
    contract: "Moves each collective start, in schedule order, to the earliest place (after its \
operand, within its phase, with the layout nodes preparing its operand) where the predicted peak \
memory of the step (liveness, the planner's model) stays at or under the limit \
(memory:BYTES, required; suffixes KiB, MiB, GiB). Waits stay before their first use. Tier 1: \
only when collectives are issued changes. Declines without collectives, and when the step \
already peaks above the limit.",
    option_help: Some("memory:BYTES (required; e.g. memory:64MiB): the per-rank peak it may reach"),
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| Ok(Box::new(Schedule::parse(option)?)));
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    /// The predicted peak, in bytes, the schedule may reach.
    pub memory_bytes: usize,
}

impl Schedule {
    pub fn parse(option: Option<&str>) -> Result<Schedule, String> {
        let Some(option) = option else {
            return Err("schedule: needs a memory limit, as schedule=memory:64MiB".into());
        };
        let value = option.strip_prefix("memory:").ok_or_else(|| {
            format!(
                "schedule: unknown option `{option}`; expected memory:BYTES (e.g. memory:64MiB)"
            )
        })?;
        let memory_bytes = parse_bytes(value).map_err(|e| format!("schedule: `{option}`: {e}"))?;
        Ok(Schedule { memory_bytes })
    }
}

/// A byte count: digits with an optional unit `KiB`, `MiB` or `GiB` (`64MiB`), above 0.
pub fn parse_bytes(value: &str) -> Result<usize, String> {
    let (digits, unit) = value.split_at(
        value
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(value.len()),
    );
    let scale = match unit {
        "" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        _ => return Err("the unit must be KiB, MiB or GiB (or none, for bytes)".into()),
    };
    match digits.parse::<usize>() {
        Ok(n) if n > 0 => Ok(n.saturating_mul(scale)),
        _ => Err("the limit must be a whole number of bytes above 0".into()),
    }
}

impl Pass for Schedule {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        // Starts are followed by their handle, which no reordering changes.
        let handles: Vec<ValueId> = g
            .nodes
            .iter()
            .filter(|n| matches!(n.op, Op::CollectiveStart { .. }))
            .map(|n| n.outputs[0])
            .collect();
        if handles.is_empty() {
            report.decline(None, "", "the graph has no collective to start earlier");
            return Ok((g.clone(), report));
        }
        let limit = self.memory_bytes;
        let before = profile(g).peak_bytes;
        if before > limit {
            report.decline(
                None,
                "",
                format!(
                    "the step already peaks at {} (predicted), above the limit of {}: no start \
can move",
                    human_bytes(before),
                    human_bytes(limit)
                ),
            );
            return Ok((g.clone(), report));
        }
        let mut current = g.clone();
        let (mut moved, mut held, mut distance) = (0usize, 0usize, 0usize);
        for handle in handles {
            let i = current
                .nodes
                .iter()
                .position(|n| n.outputs.first() == Some(&handle))
                .expect("reordering keeps every start");
            let moves = Moves::of(&current);
            let (earliest, prep) = moves.earliest(&current, i);
            if earliest >= i {
                continue;
            }
            let moved_to = |target: usize| {
                let mut keys: Vec<(usize, u8, usize)> =
                    (0..current.nodes.len()).map(|n| (n, 1, n)).collect();
                place(&mut keys, i, target, &prep);
                reordered(&current, &keys)
            };
            // The earliest target that fits: memory grows as the start moves up, so search.
            let (mut lo, mut hi) = (earliest, i);
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if profile(&moved_to(mid)).peak_bytes <= limit {
                    hi = mid;
                } else {
                    lo = mid + 1;
                }
            }
            if lo < i {
                let candidate = moved_to(lo);
                if profile(&candidate).peak_bytes <= limit {
                    current = candidate;
                    moved += 1;
                    distance += i - lo;
                    continue;
                }
            }
            held += 1;
        }
        let after = profile(&current).peak_bytes;
        if held > 0 {
            report.decline(
                None,
                "",
                format!("{held} starts could not move a node without passing the limit"),
            );
        }
        if moved == 0 {
            if held == 0 {
                report.decline(
                    None,
                    "",
                    "every collective already starts right after its operand is produced",
                );
            }
            return Ok((g.clone(), report));
        }
        report.change(format!(
            "started {moved} collectives earlier, by {:.1} nodes on average; predicted peak {} \
-> {} (limit {})",
            distance as f64 / moved as f64,
            human_bytes(before),
            human_bytes(after),
            human_bytes(limit)
        ));
        report.metric("schedule.moved", moved as f64);
        report.metric("schedule.peak_bytes_before", before as f64);
        report.metric("schedule.peak_bytes_after", after as f64);
        Ok((current.canonical(), report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    /// Two gathered weights of 64 bytes each, to be started earlier over a stretch of compute
    /// on [2,4] values: the limit decides how far each may go.
    const TWO_GATHERS: &str = "graph g {
  mesh dp_shard=2
  input %x: f32[2,4] @ [shard(0)]
  param %w: f32[2,4] @ [shard(0)]
  param %v: f32[2,4] @ [shard(0)]
  %3: f32[2,4] = exp(%x)  # fwd a
  %4: f32[2,4] = neg(%3)  # fwd a
  %5: f32[2,4] = exp(%4)  # fwd a
  %6: f32[4,4] = all_gather_start(%w, mesh_dims=[0], group=2, axis=0)  # fwd b
  %7: f32[4,4] = wait(%6)  # fwd b
  %8: f32[2,4] = matmul(%5, %7)  # fwd b
  %9: f32[2,4] = neg(%8)  # fwd c
  %10: f32[2,4] = exp(%9)  # fwd c
  %11: f32[4,4] = all_gather_start(%v, mesh_dims=[0], group=2, axis=0)  # fwd c
  %12: f32[4,4] = wait(%11)  # fwd c
  %13: f32[2,4] = matmul(%10, %12)  # fwd c
  output y = %13 @ [shard(0)]
}";

    #[test]
    fn starts_move_as_far_as_the_memory_limit_allows() {
        let g = graphtrain_ir::text::parse(TWO_GATHERS).unwrap();
        let base = profile(&g).peak_bytes;
        // Room for everything: both gathers go to the start of the phase.
        let roomy = check(
            &Schedule {
                memory_bytes: 1 << 20,
            },
            TWO_GATHERS,
        );
        insta::assert_snapshot!("roomy", roomy);
        // No room above the step's own peak: each start moves only as far as that costs
        // nothing, less far than above.
        let tight = check(&Schedule { memory_bytes: base }, TWO_GATHERS);
        insta::assert_snapshot!("tight", tight);
        let e = check(
            &Schedule {
                memory_bytes: base - 1,
            },
            TWO_GATHERS,
        );
        assert!(e.contains("already peaks at"), "{e}");
    }

    #[test]
    fn options_are_checked() {
        assert_eq!(
            Schedule::parse(Some("memory:64MiB")).unwrap().memory_bytes,
            64 << 20
        );
        assert_eq!(
            Schedule::parse(Some("memory:4096")).unwrap().memory_bytes,
            4096
        );
        for (option, says) in [
            (None, "needs a memory limit"),
            (Some("memory:0"), "above 0"),
            (Some("memory:12MB"), "KiB, MiB or GiB"),
            (Some("nodes:4"), "unknown option `nodes:4`"),
        ] {
            let e = Schedule::parse(option).unwrap_err();
            assert!(
                e.starts_with("schedule: ") && e.contains(says),
                "{option:?}: {e}"
            );
        }
    }
}
