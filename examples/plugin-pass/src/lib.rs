//! Out-of-tree graphtrain passes, written only against graphtrain's public API: `silu-expand`
//! (below) and `split-all-reduce` (`split_all_reduce.rs`, a pass that rewrites collectives),
//! registered next to the built-in passes by `registry()`.
//!
//! `silu-expand` rewrites `silu(x)` as `mul(x, sigmoid(x))`.
//!
//! Changes: every `silu` node becomes a `sigmoid` node followed by a `mul` node, both with the
//! silu's metadata (module, phase, layer and tags, so a capture region or remat policy covers both);
//! every later use reads the `mul`. Other nodes, inputs and outputs are kept, values renumbered
//! canonically. Why: a backend without a silu kernel then needs only sigmoid and mul, which the
//! lowering can fuse into one kernel.
//! Guarantees: tier 2. `x * sigmoid(x)` rounds the sigmoid before the product, where `silu`
//! rounds once, so results differ in the last bits; `testing::check` holds it to the tier-2
//! tolerance. The output verifies.
//! Declines: never; a graph without `silu` is returned unchanged.

use graphtrain::ir::{BinaryOp, Graph, Op, UnaryOp, ValueId};
use graphtrain_passes::{Pass, PassError, PassInfo, PassReport, Registry, Tier};

mod split_all_reduce;
pub use split_all_reduce::SplitAllReduce;

pub const INFO: PassInfo = PassInfo {
    name: "silu-expand",
    tier: Tier::Changing,
    summary: "rewrite silu(x) as x * sigmoid(x) (example plugin)",
    contract:
        "Every silu(x) becomes sigmoid(x) then mul(x, sigmoid(x)), both nodes with the silu's \
metadata and tags; later uses read the mul. Tier 2: the sigmoid is rounded before the product, so \
the last bits differ from silu's single rounding. Never declines; a graph without silu is returned \
unchanged.",
    option_help: None,
};

/// Adds `silu-expand` and `split-all-reduce` to `r`.
pub fn register(r: &mut Registry) {
    r.register(INFO, |_| Ok(Box::new(SiluExpand)));
    split_all_reduce::register(r);
}

/// graphtrain's built-in passes plus this example's: what its CLI runs with.
pub fn registry() -> Registry {
    let mut r = Registry::builtin();
    register(&mut r);
    r
}

pub struct SiluExpand;

impl SiluExpand {
    fn error(&self, message: impl Into<String>) -> PassError {
        PassError {
            pass: INFO.name.to_string(),
            message: message.into(),
        }
    }
}

impl Pass for SiluExpand {
    fn name(&self) -> &str {
        INFO.name
    }

    fn tier(&self) -> Tier {
        INFO.tier
    }

    fn run(&self, g: &Graph) -> Result<(Graph, PassReport), PassError> {
        let mut report = PassReport::default();
        let is_silu = |op: &Op| matches!(op, Op::Unary(UnaryOp::Silu));
        let count = g.nodes.iter().filter(|n| is_silu(&n.op)).count();
        if count == 0 {
            return Ok((g.clone(), report));
        }

        // Rebuilding through `Graph::push` re-infers every type, so a mistake here surfaces as a
        // type error rather than as a graph the verifier rejects later.
        let mut out = Graph::new(g.name.clone());
        let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
        for input in &g.inputs {
            let v = out.add_input(input.name.clone(), input.kind, g.ty(input.value).clone());
            map[input.value.index()] = Some(v);
        }
        let lookup = |map: &[Option<ValueId>], v: ValueId| {
            map[v.index()]
                .ok_or_else(|| self.error(format!("%{} is read before it is defined", v.0)))
        };
        for n in &g.nodes {
            let inputs = n
                .inputs
                .iter()
                .map(|v| lookup(&map, *v))
                .collect::<Result<Vec<_>, _>>()?;
            let type_error = |e: graphtrain::ir::TypeError| self.error(e.to_string());
            let outputs = if is_silu(&n.op) {
                let x = inputs[0];
                let s = out
                    .push1(Op::Unary(UnaryOp::Sigmoid), vec![x], n.meta.clone())
                    .map_err(type_error)?;
                vec![out
                    .push1(Op::Binary(BinaryOp::Mul), vec![x, s], n.meta.clone())
                    .map_err(type_error)?]
            } else {
                out.push(n.op.clone(), inputs, n.meta.clone())
                    .map_err(type_error)?
            };
            for (old, new) in n.outputs.iter().zip(outputs) {
                map[old.index()] = Some(new);
            }
        }
        for o in &g.outputs {
            let value = lookup(&map, o.value)?;
            let donates = o.donates.map(|d| lookup(&map, d)).transpose()?;
            out.add_output(o.name.clone(), value, donates);
        }
        // An SPMD graph keeps its mesh and the placements of its inputs and outputs.
        out.keep_distribution_of(g);

        report.change(format!("expanded {count} silu node(s) into sigmoid + mul"));
        report.metric("silu_expanded", count as f64);
        Ok((out, report))
    }
}
