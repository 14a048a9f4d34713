//! A graph as Graphviz DOT (`graphtrain trace --dot`, `graphtrain passes apply --dot`): one box
//! per node, nested `subgraph cluster_*` per module-path prefix (`layers` > `layers.0` >
//! `layers.0.attention` ...), filled by phase (forward blue, loss yellow, backward orange,
//! optimizer green), graph inputs and outputs as ellipses, one edge per value read.
//!
//! For a pass's result (`diff_to_dot`) the nodes the pass made are drawn with a thick red
//! border, and the nodes it removed are listed, dashed and without edges, in a cluster of their
//! own. Which nodes are new is decided structurally, since node indices do not survive a
//! rewrite: a node is kept when the same op (with its attributes), module, phase and operands
//! (the same inputs by name, or kept nodes' outputs) existed before; anything else is new.
//!
//! Guarantees: every identifier is quoted and escaped, so any module path or input name gives a
//! file `dot` accepts; every edge endpoint is declared. Built only on the IR's public API.

use graphtrain_ir::{Graph, Phase, ValueId};
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::fmt::Write;
use std::hash::{Hash, Hasher};

fn phase_color(p: Phase) -> &'static str {
    match p {
        Phase::Forward => "#cfe2ff",
        Phase::Loss => "#fff3bf",
        Phase::Backward => "#ffd8a8",
        Phase::Optimizer => "#d3f9d8",
    }
}

/// A DOT string literal.
fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' => q.push_str("\\\""),
            '\\' => q.push_str("\\\\"),
            '\n' => q.push_str("\\n"),
            c => q.push(c),
        }
    }
    q.push('"');
    q
}

/// What a pass changed: nodes of the new graph that are new, nodes of the old one that are gone.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GraphDiff {
    /// Indices into the new graph's nodes.
    pub added: Vec<usize>,
    /// Indices into the old graph's nodes.
    pub removed: Vec<usize>,
}

/// A structural key per node: op with attributes, module, phase and the keys of its operands.
fn node_keys(g: &Graph) -> Vec<u64> {
    let producers = g.producers();
    let input_names: HashMap<ValueId, &str> = g
        .inputs
        .iter()
        .map(|i| (i.value, i.name.as_str()))
        .collect();
    let mut keys: Vec<u64> = Vec::with_capacity(g.nodes.len());
    for node in &g.nodes {
        let mut h = DefaultHasher::new();
        format!("{:?}", node.op).hash(&mut h);
        node.meta.module.hash(&mut h);
        node.meta.phase.hash(&mut h);
        for v in &node.inputs {
            match (producers[v.index()], input_names.get(v)) {
                (Some(p), _) => {
                    keys[p].hash(&mut h);
                    g.nodes[p].outputs.iter().position(|o| o == v).hash(&mut h);
                }
                (None, Some(name)) => name.hash(&mut h),
                (None, None) => v.index().hash(&mut h),
            }
        }
        keys.push(h.finish());
    }
    keys
}

/// Which nodes of `after` are new and which of `before` are gone (see the file comment).
pub fn diff(before: &Graph, after: &Graph) -> GraphDiff {
    let mut remaining: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, k) in node_keys(before).into_iter().enumerate() {
        remaining.entry(k).or_default().push(i);
    }
    let mut added = Vec::new();
    for (i, k) in node_keys(after).into_iter().enumerate() {
        match remaining.get_mut(&k).and_then(|v| v.pop()) {
            Some(_) => {}
            None => added.push(i),
        }
    }
    let mut removed: Vec<usize> = remaining.into_values().flatten().collect();
    removed.sort_unstable();
    GraphDiff { added, removed }
}

/// Nodes grouped by module path: each level a cluster, its own nodes, then its children.
#[derive(Default)]
struct Scope {
    nodes: Vec<usize>,
    children: Vec<(String, Scope)>,
}

impl Scope {
    fn insert(&mut self, path: &[&str], node: usize) {
        let Some((first, rest)) = path.split_first() else {
            self.nodes.push(node);
            return;
        };
        let i = match self.children.iter().position(|(name, _)| name == first) {
            Some(i) => i,
            None => {
                self.children.push((first.to_string(), Scope::default()));
                self.children.len() - 1
            }
        };
        self.children[i].1.insert(rest, node);
    }
}

fn node_id(i: usize) -> String {
    format!("n{i}")
}

fn node_label(g: &Graph, i: usize) -> String {
    let node = &g.nodes[i];
    let types: Vec<String> = node.outputs.iter().map(|v| g.ty(*v).to_string()).collect();
    format!("{} #{i}\n{}", node.op.name(), types.join(", "))
}

/// `g` as DOT.
pub fn to_dot(g: &Graph) -> String {
    render(g, None)
}

/// `after` as DOT with what the pass changed from `before` marked (see the file comment).
pub fn diff_to_dot(before: &Graph, after: &Graph) -> String {
    let d = diff(before, after);
    render(after, Some((before, &d)))
}

fn render(g: &Graph, changes: Option<(&Graph, &GraphDiff)>) -> String {
    let mut out = String::new();
    let added: std::collections::HashSet<usize> = changes
        .map(|(_, d)| d.added.iter().copied().collect())
        .unwrap_or_default();
    // `write!` to a String cannot fail.
    let _ = writeln!(out, "digraph {} {{", quote(&g.name));
    out.push_str("  rankdir=TB;\n  compound=true;\n");
    out.push_str("  node [shape=box, style=filled, fontname=\"Helvetica\", fontsize=10];\n");
    out.push_str("  edge [color=\"#555555\"];\n");
    if let Some((_, d)) = changes {
        let _ = writeln!(
            out,
            "  label={};\n  labelloc=t;",
            quote(&format!(
                "{} nodes new (red border), {} removed (dashed, right)",
                d.added.len(),
                d.removed.len()
            ))
        );
    }
    for (i, input) in g.inputs.iter().enumerate() {
        let _ = writeln!(
            out,
            "  {} [label={}, shape=ellipse, fillcolor=\"#eeeeee\"];",
            quote(&format!("in{i}")),
            quote(&format!(
                "{} ({:?})\n{}",
                input.name,
                input.kind,
                g.ty(input.value)
            ))
        );
    }
    let mut root = Scope::default();
    for (i, node) in g.nodes.iter().enumerate() {
        let path: Vec<&str> = if node.meta.module.is_empty() {
            Vec::new()
        } else {
            node.meta.module.split('.').collect()
        };
        root.insert(&path, i);
    }
    let mut clusters = 0usize;
    write_scope(&mut out, g, &root, "", 1, &added, &mut clusters);
    for (i, output) in g.outputs.iter().enumerate() {
        let _ = writeln!(
            out,
            "  {} [label={}, shape=ellipse, fillcolor=\"#eeeeee\"];",
            quote(&format!("out{i}")),
            quote(&output.name)
        );
    }
    // Edges: from whatever defines a value to each reader of it.
    let producers = g.producers();
    let input_index: HashMap<ValueId, usize> = g
        .inputs
        .iter()
        .enumerate()
        .map(|(i, input)| (input.value, i))
        .collect();
    let source = |v: &ValueId| -> Option<String> {
        match producers.get(v.index()).copied().flatten() {
            Some(p) => Some(node_id(p)),
            None => input_index.get(v).map(|i| format!("in{i}")),
        }
    };
    for (i, node) in g.nodes.iter().enumerate() {
        for v in &node.inputs {
            if let Some(src) = source(v) {
                let _ = writeln!(out, "  {} -> {};", quote(&src), quote(&node_id(i)));
            }
        }
    }
    for (i, output) in g.outputs.iter().enumerate() {
        if let Some(src) = source(&output.value) {
            let _ = writeln!(out, "  {} -> {};", quote(&src), quote(&format!("out{i}")));
        }
    }
    if let Some((before, d)) = changes {
        if !d.removed.is_empty() {
            out.push_str("  subgraph \"cluster_removed\" {\n");
            let _ = writeln!(out, "    label={};", quote("removed by the pass"));
            out.push_str("    style=dashed;\n");
            for &i in &d.removed {
                let node = &before.nodes[i];
                let _ = writeln!(
                    out,
                    "    {} [label={}, style=\"dashed\", fillcolor=\"#ffffff\"];",
                    quote(&format!("removed{i}")),
                    quote(&format!("{}\n{}", node_label(before, i), node.meta.module))
                );
            }
            out.push_str("  }\n");
        }
    }
    out.push_str("}\n");
    out
}

fn write_scope(
    out: &mut String,
    g: &Graph,
    scope: &Scope,
    path: &str,
    depth: usize,
    added: &std::collections::HashSet<usize>,
    clusters: &mut usize,
) {
    let pad = "  ".repeat(depth);
    for &i in &scope.nodes {
        let node = &g.nodes[i];
        let border = if added.contains(&i) {
            ", color=\"#d00000\", penwidth=3"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "{pad}{} [label={}, fillcolor=\"{}\"{border}];",
            quote(&node_id(i)),
            quote(&node_label(g, i)),
            phase_color(node.meta.phase)
        );
    }
    for (name, child) in &scope.children {
        let child_path = if path.is_empty() {
            name.clone()
        } else {
            format!("{path}.{name}")
        };
        *clusters += 1;
        let _ = writeln!(
            out,
            "{pad}subgraph {} {{",
            quote(&format!("cluster_{clusters}"))
        );
        let _ = writeln!(out, "{pad}  label={};", quote(&child_path));
        let _ = writeln!(out, "{pad}  style=rounded;");
        write_scope(out, g, child, &child_path, depth + 1, added, clusters);
        let _ = writeln!(out, "{pad}}}");
    }
}

/// Writes `body` to `path`, naming the file on failure.
pub fn write(path: &std::path::Path, body: &str) -> Result<(), String> {
    std::fs::write(path, body).map_err(|e| format!("cannot write `{}`: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphtrain_ir::text;

    const TINY: &str = "graph tiny {
  input %x: f32[4]
  param %w: f32[4]
  %1: f32[4] = mul(%x, %w)  # fwd layers.0.ffn
  %2: f32[4] = exp(%1)  # fwd layers.0.ffn
  %3: f32[4] = exp(%1)  # fwd layers.1
  %4: f32[4] = add(%2, %3)  # loss
  output y = %4
}";

    /// A syntactic check of what `render` writes: strings are closed, braces and brackets
    /// balance outside strings, the file is one `digraph`, and every edge endpoint is a node
    /// declared (`"id" [...]`) somewhere in it.
    fn check_dot(dot: &str) -> Result<(), String> {
        // Tokens: quoted strings (kept with their quotes), `->`, single punctuation, bare words.
        let mut tokens: Vec<String> = Vec::new();
        let mut chars = dot.chars().peekable();
        while let Some(c) = chars.next() {
            match c {
                c if c.is_whitespace() => {}
                '"' => {
                    let mut t = String::from('"');
                    let mut closed = false;
                    while let Some(c) = chars.next() {
                        t.push(c);
                        match c {
                            '\\' => t.push(chars.next().ok_or("a `\\` ends the file")?),
                            '"' => {
                                closed = true;
                                break;
                            }
                            _ => {}
                        }
                    }
                    if !closed {
                        return Err(format!("unclosed string {t}"));
                    }
                    tokens.push(t);
                }
                '-' if chars.peek() == Some(&'>') => {
                    chars.next();
                    tokens.push("->".into());
                }
                '{' | '}' | '[' | ']' | ';' | '=' | ',' => tokens.push(c.to_string()),
                c => {
                    let mut t = String::from(c);
                    while let Some(&n) = chars.peek() {
                        if n.is_alphanumeric() || n == '_' || n == '.' || n == '#' {
                            t.push(n);
                            chars.next();
                        } else {
                            break;
                        }
                    }
                    tokens.push(t);
                }
            }
        }
        if tokens.first().map(String::as_str) != Some("digraph") {
            return Err("not a digraph".into());
        }
        let (mut braces, mut brackets) = (0i64, 0i64);
        let mut statement: Vec<&str> = Vec::new();
        let mut declared = std::collections::HashSet::new();
        let mut edges = Vec::new();
        for t in &tokens {
            match t.as_str() {
                "{" | "}" | ";" if brackets == 0 => {
                    if let [id, "[", ..] = statement.as_slice() {
                        declared.insert(id.to_string());
                    }
                    for (i, tok) in statement.iter().enumerate() {
                        if *tok == "->" {
                            edges.push((
                                statement.get(i.wrapping_sub(1)).copied(),
                                statement.get(i + 1).copied(),
                            ));
                        }
                    }
                    statement.clear();
                    braces += match t.as_str() {
                        "{" => 1,
                        "}" => -1,
                        _ => 0,
                    };
                    if braces < 0 {
                        return Err("a `}` closes nothing".into());
                    }
                }
                "[" => {
                    brackets += 1;
                    statement.push(t);
                }
                "]" => {
                    brackets -= 1;
                    statement.push(t);
                }
                _ if brackets == 0 => statement.push(t),
                _ => {}
            }
        }
        if braces != 0 || brackets != 0 || !statement.is_empty() {
            return Err(format!(
                "unbalanced: braces {braces}, brackets {brackets}, trailing {statement:?}"
            ));
        }
        for (a, b) in edges {
            for end in [a, b] {
                match end {
                    Some(id) if declared.contains(id) => {}
                    other => return Err(format!("edge endpoint {other:?} is not a declared node")),
                }
            }
        }
        Ok(())
    }

    #[test]
    fn a_tiny_graph_is_clustered_by_module_and_coloured_by_phase() {
        let g = text::parse(TINY).unwrap();
        let dot = to_dot(&g);
        check_dot(&dot).unwrap();
        insta::assert_snapshot!(dot);
    }

    #[test]
    fn the_checker_catches_broken_dot() {
        let g = text::parse(TINY).unwrap();
        let dot = to_dot(&g);
        assert!(check_dot(&dot.replacen("}\n", "\n", 1)).is_err());
        assert!(check_dot(&dot.replace("\"n0\" [label", "\"m0\" [label")).is_err());
        assert!(check_dot(&format!("{dot}}}")).is_err());
    }

    #[test]
    fn names_that_need_quoting_stay_inside_their_strings() {
        let mut g = text::parse(TINY).unwrap();
        g.name = "a \"quoted\" {graph}".into();
        g.inputs[0].name = "x\\\"} -> evil".into();
        g.nodes[0].meta.module = "odd\"scope.{x}".into();
        check_dot(&to_dot(&g)).unwrap();
    }

    #[test]
    fn a_pass_result_marks_new_nodes_and_lists_removed_ones() {
        let before = text::parse(TINY).unwrap();
        // As CSE would leave it, had both exps the same module: here a hand-made rewrite that
        // drops the second exp and adds a node reading the first.
        let after = text::parse(
            "graph tiny {
  input %x: f32[4]
  param %w: f32[4]
  %1: f32[4] = mul(%x, %w)  # fwd layers.0.ffn
  %2: f32[4] = exp(%1)  # fwd layers.0.ffn
  %3: f32[4] = add(%2, %2)  # loss
  output y = %3
}",
        )
        .unwrap();
        let d = diff(&before, &after);
        assert_eq!(d.added, vec![2], "the add reads other operands: new");
        assert_eq!(d.removed, vec![2, 3], "the layers.1 exp and the old add");
        let dot = diff_to_dot(&before, &after);
        check_dot(&dot).unwrap();
        assert!(dot.contains("\"n2\" [label=\"add #2\\nf32[4]\", fillcolor=\"#fff3bf\", color=\"#d00000\", penwidth=3];"), "{dot}");
        assert!(dot.contains("\"removed2\" [label=\"exp #2"), "{dot}");
        assert!(dot.contains("\"removed3\" [label=\"add #3"), "{dot}");
        assert!(!dot.contains("\"n1\" [label=\"exp #1\\nf32[4]\", fillcolor=\"#cfe2ff\", color"));
        assert_eq!(diff(&before, &before), GraphDiff::default());
    }
}
