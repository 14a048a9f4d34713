//! The text format of a graph: what tests, snapshots, dumps and error reports show, and what
//! hand-written test graphs are written in.
//!
//! It is line oriented, one declaration per line, so that a diff of two dumps reads as a diff of
//! nodes:
//!
//! ```text
//! graph train_step {
//!   input %tokens: i32[2,8]
//!   param %tok_embeddings.weight: f32[64,16]
//!   state %opt.m.tok_embeddings.weight: f32[64,16]
//!   input %lr: f32[]
//!   %4: f32[2,8,16] = embedding(%tok_embeddings.weight, %tokens)  # fwd tok_embeddings
//!   %5: f32[16] = reduce_sum(%4, axes=[0,1], keepdim=false)  # bwd layers.0.ffn_norm layer=7 stream=1
//!   output loss = %5
//!   output tok_embeddings.weight = %6 donates %tok_embeddings.weight
//! }
//! ```
//!
//! - `mesh dp_shard=2,tp=2` (first, and only in an SPMD graph) declares the device mesh; an input
//!   or output may then end in `@ [shard(0), replicate]`, its placement on each mesh dimension
//!   (see [`crate::mesh`]). Types are always the local (per-rank) ones.
//! - `input`, `param` and `state` declare graph inputs (data, parameters, optimizer state) by
//!   name; they come first.
//! - A node line lists its outputs with their types, the op name, the operands and then the
//!   attributes in [`Op::attrs`](crate::op::Op::attrs) order. After `#` comes the metadata: the phase (`fwd`, `loss`,
//!   `bwd`, `opt`), the module path if any, then the tags `layer=N`, `micro=N` (the
//!   micro-batch), `remat=save|recompute|offload`, `bucket=N`, `stream=N`, `region=N`. `layer=`
//!   is only written when the layer differs from the one the module path implies
//!   ([`layer_from_module`]); `layer=none` says there is none.
//! - `output NAME = %v` names a result; `donates %input` marks an in-place update.
//! - `//` starts a comment; blank lines are ignored.
//!
//! Values are numbered as [`Graph::canonical`] numbers them, and node outputs are printed by that
//! number while inputs keep their names, so `parse(&print(g)) == g.canonical()`. Floats are
//! printed with `{:?}`, the shortest text that reads back to the same bits (`inf`, `-inf`, `NaN`
//! and `-0.0` included).
//!
//! Names (of the graph, inputs, outputs and module paths) read back only when made of letters,
//! digits, `_` and `.`; the printer writes whatever it is given and never fails.
//!
//! The parser only checks syntax and names: it takes the output types as written and leaves
//! checking them against the op's rules to the verifier.

mod parse;

pub use parse::{parse, ParseError};

use crate::graph::{layer_from_module, Graph, Meta, ValueId};
use std::fmt::{self, Write};

/// The text of `g` (of its canonical form). Never fails: a broken graph prints as text that the
/// parser or the verifier will reject. (Value ids must index `g.values`, as everywhere.)
pub fn print(g: &Graph) -> String {
    g.to_string()
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write_graph(f, self)
    }
}

fn write_graph(out: &mut impl Write, g: &Graph) -> fmt::Result {
    let g = g.canonical();
    // Inputs are printed by name, every other value by its canonical number.
    let mut input_names: Vec<Option<&str>> = vec![None; g.values.len()];
    for input in &g.inputs {
        input_names[input.value.index()] = Some(&input.name);
    }
    let value = |v: ValueId| ValueName(input_names[v.index()], v.0);

    writeln!(out, "graph {} {{", g.name)?;
    if let Some(mesh) = &g.mesh {
        writeln!(out, "  mesh {mesh}")?;
    }
    for input in &g.inputs {
        write!(
            out,
            "  {} {}: {}",
            input.kind.keyword(),
            value(input.value),
            g.ty(input.value)
        )?;
        if let Some(p) = &input.placement {
            write!(out, " @ {p}")?;
        }
        out.write_char('\n')?;
    }
    for node in &g.nodes {
        out.write_str("  ")?;
        for (i, &v) in node.outputs.iter().enumerate() {
            if i > 0 {
                out.write_str(", ")?;
            }
            write!(out, "{}: {}", value(v), g.ty(v))?;
        }
        write!(out, " = {}(", node.op.name())?;
        let mut sep = "";
        for &v in &node.inputs {
            write!(out, "{sep}{}", value(v))?;
            sep = ", ";
        }
        for (key, attr) in node.op.attrs() {
            write!(out, "{sep}{key}={attr}")?;
            sep = ", ";
        }
        out.write_str(")  # ")?;
        write_meta(out, &node.meta)?;
        out.write_char('\n')?;
    }
    for output in &g.outputs {
        write!(out, "  output {} = {}", output.name, value(output.value))?;
        if let Some(d) = output.donates {
            write!(out, " donates {}", value(d))?;
        }
        if let Some(p) = &output.placement {
            write!(out, " @ {p}")?;
        }
        out.write_char('\n')?;
    }
    out.write_str("}\n")
}

/// `phase [module] [tags...]`, the part of a node line after `#`.
fn write_meta(out: &mut impl Write, meta: &Meta) -> fmt::Result {
    out.write_str(meta.phase.short())?;
    if !meta.module.is_empty() {
        write!(out, " {}", meta.module)?;
    }
    if meta.layer != layer_from_module(&meta.module) {
        match meta.layer {
            Some(layer) => write!(out, " layer={layer}")?,
            None => out.write_str(" layer=none")?,
        }
    }
    if let Some(micro_batch) = meta.micro_batch {
        write!(out, " micro={micro_batch}")?;
    }
    let tags = &meta.tags;
    if let Some(remat) = tags.remat {
        write!(out, " remat={}", remat.name())?;
    }
    for (key, tag) in [
        ("bucket", tags.bucket),
        ("stream", tags.stream),
        ("region", tags.region),
    ] {
        if let Some(n) = tag {
            write!(out, " {key}={n}")?;
        }
    }
    Ok(())
}

/// How a value is written: `%name` for a graph input, `%N` for anything else.
struct ValueName<'a>(Option<&'a str>, u32);

impl fmt::Display for ValueName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(name) => write!(f, "%{name}"),
            None => write!(f, "%{}", self.1),
        }
    }
}
