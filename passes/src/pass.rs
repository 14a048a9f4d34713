//! The pass ABI: a pass takes a graph (its options were bound when it was built) and returns a new
//! graph plus a report of what it changed, or, where it declined, why.

use graphtrain_ir::Graph;
use std::fmt;

/// Whether a pass may change numerics.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Tier {
    /// Bitwise-identical results on the same backend. Default pipelines hold only these.
    Preserving,
    /// May change numerics (reassociation, new reduction order, lower precision); opt-in and
    /// checked against a tolerance.
    Changing,
}

impl Tier {
    pub fn label(self) -> &'static str {
        match self {
            Tier::Preserving => "tier 1 (numerics-preserving)",
            Tier::Changing => "tier 2 (numerics-changing)",
        }
    }
}

/// A place where a pass chose not to act, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Decline {
    /// Node index in the input graph, when the decision concerns one node.
    pub node: Option<usize>,
    pub module: String,
    pub reason: String,
}

/// What a pass did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PassReport {
    /// Human-readable changes, one per line ("removed 3 dead nodes").
    pub changes: Vec<String>,
    /// Where it declined and why.
    pub declined: Vec<Decline>,
    /// Named figures (bytes saved, recompute FLOPs, e-graph size, ...), in insertion order.
    pub metrics: Vec<(String, f64)>,
}

impl PassReport {
    pub fn change(&mut self, what: impl Into<String>) {
        self.changes.push(what.into());
    }

    pub fn decline(
        &mut self,
        node: Option<usize>,
        module: impl Into<String>,
        reason: impl Into<String>,
    ) {
        self.declined.push(Decline {
            node,
            module: module.into(),
            reason: reason.into(),
        });
    }

    pub fn metric(&mut self, name: impl Into<String>, value: f64) {
        self.metrics.push((name.into(), value));
    }

    pub fn is_noop(&self) -> bool {
        self.changes.is_empty()
    }
}

impl fmt::Display for PassReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.changes.is_empty() {
            writeln!(f, "no change")?;
        }
        for c in &self.changes {
            writeln!(f, "changed: {c}")?;
        }
        for d in &self.declined {
            match d.node {
                Some(n) => writeln!(f, "declined at node {n} (`{}`): {}", d.module, d.reason)?,
                None => writeln!(f, "declined: {}", d.reason)?,
            }
        }
        for (k, v) in &self.metrics {
            writeln!(f, "{k}: {v}")?;
        }
        Ok(())
    }
}

/// A pass failed outright (as opposed to declining): its input broke one of its preconditions.
#[derive(Clone, Debug, PartialEq)]
pub struct PassError {
    pub pass: String,
    pub message: String,
}

impl fmt::Display for PassError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pass `{}`: {}", self.pass, self.message)
    }
}

impl std::error::Error for PassError {}

/// One graph transformation with its options already bound.
pub trait Pass {
    /// The registry name (`dce`, `ac`, ...).
    fn name(&self) -> &str;
    fn tier(&self) -> Tier;
    /// Returns the transformed graph and what changed. The result must satisfy the verifier;
    /// the pass manager checks that in tests and debug builds.
    fn run(&self, graph: &Graph) -> Result<(Graph, PassReport), PassError>;
}
