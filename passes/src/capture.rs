//! `capture`: marks the regions of the schedule that can be captured as one replayable launch.
//!
//! Changes: `meta.tags.region` on every node, nothing else: `Some(r)` on the nodes of capture
//! region `r`, `None` on nodes left uncaptured (tags from an earlier run are replaced). A region is
//! a maximal run of consecutive nodes in schedule order with no capture breaker in it; ids are
//! dense from 0 in schedule order. Regions may span phases: the whole step can be one region.
//!
//! What a region becomes is the lowering's and runtime's business. On cpu each kernel step of a
//! region is bound to the arena on its first run and then replayed by direct calls into its
//! compiled kernel, without cubecl's per-launch dispatch (`runtime/src/cpu/replay.rs`); steps
//! outside every region are dispatched one by one. On the device backends each run of a
//! region's steps that are launches alone is recorded as a device graph in the second run and
//! replayed after (`runtime/src/device/graphs.rs`: a CUDA graph on cuda, cubecl's software
//! graph on wgpu).
//! Capture relies on what the IR already guarantees (static shapes, randomness keyed by a seed
//! input, no host reads inside the step) plus the memory planner keeping buffer addresses fixed
//! between replays.
//!
//! Capture breakers, each left uncaptured and reported as a decline with its reason:
//! - `offload` and `reload`: host-memory transfers synchronize with the host allocator, which a
//!   replayed launch cannot do;
//! - nodes the user excluded with `exclude:MODULE` (the module or anything under it), for example
//!   to keep a region under study out of a capture.
//!
//! Regions shorter than `min:N` nodes (default 2: replaying one launch saves nothing) are left
//! uncaptured and declined with "region of K nodes is below min N".
//!
//! Guarantees: tier 1, since only tags change. Every node carries either its region or a decline
//! that explains why not (on the breaker itself, or on the first node of a region below `min:N`).

use crate::pass::{Pass, PassError, PassReport, Tier};
use crate::registry::{PassInfo, Registry};
use graphtrain_ir::{Graph, Node, Op};

/// Regions shorter than this are left uncaptured unless `capture=min:N` says otherwise.
pub const DEFAULT_MIN_NODES: usize = 2;

pub const INFO: PassInfo = PassInfo {
    name: "capture",
    tier: Tier::Preserving,
    summary: "tag runs of nodes that can be captured as one replayable launch (tags only)",
    contract:
        "Sets meta.tags.region on maximal runs of consecutive nodes in schedule order that hold no \
capture breaker; ids are dense from 0 in schedule order and earlier region tags are replaced. \
Breakers are offload and reload (host-memory transfers synchronize with the host allocator) and \
nodes excluded with exclude:MODULE; each is declined with its reason, and so is every region \
shorter than min:N nodes (default 2). Tier 1: only tags change. The cpu runtime replays the \
kernel steps of each region as launches bound once to the arena (bitwise equal to dispatching \
them); other steps are dispatched one by one.",
    option_help: Some(
        "min:N (regions below N nodes stay uncaptured, N >= 1, default 2) and exclude:MODULE \
(never capture that module or anything under it), joined with `;`, e.g. min:4;exclude:optim",
    ),
};

pub fn register(r: &mut Registry) {
    r.register(INFO, |option| Ok(Box::new(Capture::from_option(option)?)));
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Capture {
    /// Regions with fewer nodes are left uncaptured.
    pub min_nodes: usize,
    /// Module paths whose nodes (and those of their submodules) are never captured.
    pub exclude: Vec<String>,
}

impl Default for Capture {
    fn default() -> Self {
        Capture {
            min_nodes: DEFAULT_MIN_NODES,
            exclude: Vec::new(),
        }
    }
}

impl Capture {
    /// Parses the `capture=OPTION` text: `min:N` and `exclude:MODULE` items joined with `;` (the
    /// pipeline list already uses `,` between passes).
    pub fn from_option(option: Option<&str>) -> Result<Self, String> {
        let mut capture = Capture::default();
        let Some(option) = option else {
            return Ok(capture);
        };
        for item in option.split(';') {
            if let Some(n) = item.strip_prefix("min:") {
                capture.min_nodes = match n.parse::<usize>() {
                    Ok(n) if n >= 1 => n,
                    _ => return Err(format!("`min:{n}`: N must be an integer >= 1")),
                };
            } else if let Some(module) = item.strip_prefix("exclude:") {
                if module.is_empty() {
                    return Err("`exclude:` needs a module path, e.g. exclude:optim".into());
                }
                capture.exclude.push(module.to_string());
            } else {
                return Err(format!("unknown option `{item}`"));
            }
        }
        Ok(capture)
    }

    /// Why `node` cannot be inside a captured region, if it cannot.
    fn breaker(&self, node: &Node) -> Option<String> {
        match node.op {
            Op::Offload => {
                return Some(
                    "offload moves a buffer to host memory; the transfer synchronizes with the \
host allocator, which a replayed launch cannot do"
                        .into(),
                )
            }
            Op::Reload => {
                return Some(
                    "reload brings a buffer back from host memory; the transfer synchronizes with \
the host allocator, which a replayed launch cannot do"
                        .into(),
                )
            }
            _ => {}
        }
        let module = &node.meta.module;
        self.exclude
            .iter()
            .find(|m| {
                module == *m
                    || module
                        .strip_prefix(m.as_str())
                        .is_some_and(|rest| rest.starts_with('.'))
            })
            .map(|m| format!("excluded by the user (exclude:{m})"))
    }
}

impl Pass for Capture {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let mut tags: Vec<Option<u32>> = vec![None; g.nodes.len()];
        let mut sizes: Vec<usize> = Vec::new();

        // Nodes from `start` up to the current index form the run being built.
        let mut close = |start: usize, end: usize, report: &mut PassReport| {
            let len = end - start;
            if len == 0 {
                return;
            }
            if len < self.min_nodes {
                report.decline(
                    Some(start),
                    g.nodes[start].meta.module.clone(),
                    format!("region of {len} nodes is below min {}", self.min_nodes),
                );
                return;
            }
            let id = sizes.len() as u32;
            tags[start..end].fill(Some(id));
            sizes.push(len);
        };
        let mut start = 0;
        for (i, node) in g.nodes.iter().enumerate() {
            if let Some(reason) = self.breaker(node) {
                close(start, i, &mut report);
                report.decline(Some(i), node.meta.module.clone(), reason);
                start = i + 1;
            }
        }
        close(start, g.nodes.len(), &mut report);

        let mut out = g.clone();
        let mut retagged = 0usize;
        for (node, tag) in out.nodes.iter_mut().zip(&tags) {
            if node.meta.tags.region != *tag {
                retagged += 1;
            }
            node.meta.tags.region = *tag;
        }

        let captured: usize = sizes.iter().sum();
        let uncaptured = g.nodes.len() - captured;
        if !sizes.is_empty() {
            let list: Vec<String> = sizes.iter().map(|s| s.to_string()).collect();
            report.change(format!(
                "captured {} region(s) covering {captured} of {} node(s) (sizes {})",
                sizes.len(),
                g.nodes.len(),
                list.join(", ")
            ));
        } else if retagged > 0 {
            report.change(format!("cleared stale region tags on {retagged} node(s)"));
        }
        report.metric("capture_regions", sizes.len() as f64);
        report.metric("captured_nodes", captured as f64);
        report.metric("uncaptured_nodes", uncaptured as f64);
        Ok((out, report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::check;

    const OFFLOADED: &str = "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd a
  %2: f32[4] = offload(%1)  # fwd a
  %3: f32[4] = neg(%x)  # fwd b
  %4: f32[4] = sin(%3)  # fwd b
  %5: f32[4] = cos(%4)  # bwd b
  %6: f32[4] = reload(%2)  # bwd a
  %7: f32[4] = mul(%6, %5)  # bwd c
  %8: f32[4] = add(%7, %5)  # opt optim
  %9: f32[4] = tanh(%8)  # opt optim
  output y = %9
}";

    #[test]
    fn everything_capturable_is_one_region_across_phases() {
        let out = check(
            &Capture::default(),
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd region=5
  %2: f32[4] = neg(%1)  # loss
  %3: f32[4] = sin(%2)  # bwd
  %4: f32[4] = cos(%3)  # opt
  output y = %4
}",
        );
        insta::assert_snapshot!(out);
    }

    #[test]
    fn offload_and_reload_break_regions() {
        insta::assert_snapshot!(check(&Capture::default(), OFFLOADED));
    }

    #[test]
    fn short_regions_and_excluded_modules_stay_uncaptured() {
        let pass = Capture::from_option(Some("min:3;exclude:optim")).unwrap();
        insta::assert_snapshot!(check(&pass, OFFLOADED));
    }

    #[test]
    fn exclusion_matches_whole_module_path_segments() {
        let pass = Capture::from_option(Some("min:1;exclude:layers.1")).unwrap();
        let out = check(
            &pass,
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd layers.1.ffn
  %2: f32[4] = neg(%1)  # fwd layers.10.ffn
  %3: f32[4] = sin(%2)  # fwd layers.1
  %4: f32[4] = cos(%3)  # fwd layers.12
  output y = %4
}",
        );
        assert!(out.contains("declined at node 0"), "{out}");
        assert!(out.contains("declined at node 2"), "{out}");
        assert!(!out.contains("declined at node 1 "), "{out}");
    }

    #[test]
    fn bad_options_are_refused_with_the_accepted_forms() {
        let r = Registry::builtin();
        for bad in ["min:0", "min:two", "exclude:", "max:3", "min:2+"] {
            let err = r.build("capture", Some(bad)).err().unwrap_or_default();
            assert!(err.contains("accepted: min:N"), "{bad}: {err}");
        }
        assert!(r
            .build("capture", Some("min:1;exclude:optim;exclude:norm"))
            .is_ok());
    }
}
