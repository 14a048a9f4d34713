//! The e-graph language of graph nodes.
//!
//! One generic op node instead of one variant per `Op`: the node carries the op name and its
//! attributes printed as in the text format (`transpose` + `perm=[1,0]`), so that every op,
//! present and future, round-trips through `Op::attrs` / `Op::from_name_attrs` without a second
//! op table to keep in sync. Graph inputs are leaves keyed by their position in `Graph::inputs`.
//!
//! Multi-output ops (`adamw`, `rms_norm_backward`, `attention_backward`) are one tuple-valued
//! node plus `get` projections, one per output used. Hashconsing then merges duplicate tuple
//! nodes like any other node, and rules may rewrite a projection's class; the tuple node itself
//! only ever equals another tuple node of the same type (the analysis enforces that).

use egg::{Id, Language, Symbol};
use graphtrain_ir::{Attr, Op};
use std::cmp::Ordering;
use std::fmt;

/// An interned string ordered by its text, not by interning order, so that the order of nodes
/// inside an e-class (and everything derived from it) is the same in every process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Text(pub Symbol);

impl Text {
    pub fn new(s: &str) -> Self {
        Text(Symbol::from(s))
    }

    pub fn as_str(&self) -> &'static str {
        self.0.as_str()
    }
}

impl Ord for Text {
    fn cmp(&self, other: &Self) -> Ordering {
        if self.0 == other.0 {
            Ordering::Equal
        } else {
            self.as_str().cmp(other.as_str())
        }
    }
}

impl PartialOrd for Text {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// A node of the e-graph.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GNode {
    /// Graph input number `i` (position in `Graph::inputs`).
    Input(u32),
    /// Output `i` of a multi-output op's tuple.
    Get(u32, [Id; 1]),
    /// An op: its name, its attributes as printed by [`attrs_text`], its operands.
    Op {
        name: Text,
        attrs: Text,
        children: Vec<Id>,
    },
}

/// What `Language::discriminant` groups by. Only the op *name*: egg finds candidate nodes by
/// discriminant and then filters them with `matches`, and nodes sharing a name are contiguous in
/// the `Ord` order (the name is compared first), which egg's binary search relies on. Grouping
/// by name also lets the native rules find every `transpose` whatever its attributes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Disc {
    Input(u32),
    Get(u32),
    Op(Text),
}

impl Language for GNode {
    type Discriminant = Disc;

    fn discriminant(&self) -> Disc {
        match self {
            GNode::Input(i) => Disc::Input(*i),
            GNode::Get(i, _) => Disc::Get(*i),
            GNode::Op { name, .. } => Disc::Op(*name),
        }
    }

    fn matches(&self, other: &Self) -> bool {
        match (self, other) {
            (GNode::Input(a), GNode::Input(b)) => a == b,
            (GNode::Get(a, _), GNode::Get(b, _)) => a == b,
            (
                GNode::Op {
                    name: n1,
                    attrs: a1,
                    children: c1,
                },
                GNode::Op {
                    name: n2,
                    attrs: a2,
                    children: c2,
                },
            ) => n1 == n2 && a1 == a2 && c1.len() == c2.len(),
            _ => false,
        }
    }

    fn children(&self) -> &[Id] {
        match self {
            GNode::Input(_) => &[],
            GNode::Get(_, c) => c,
            GNode::Op { children, .. } => children,
        }
    }

    fn children_mut(&mut self) -> &mut [Id] {
        match self {
            GNode::Input(_) => &mut [],
            GNode::Get(_, c) => c,
            GNode::Op { children, .. } => children,
        }
    }
}

impl fmt::Display for GNode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GNode::Input(i) => write!(f, "input#{i}"),
            GNode::Get(i, _) => write!(f, "get{i}"),
            GNode::Op { name, attrs, .. } if attrs.as_str().is_empty() => {
                f.write_str(name.as_str())
            }
            GNode::Op { name, attrs, .. } => {
                write!(f, "{}{{{}}}", name.as_str(), attrs.as_str())
            }
        }
    }
}

impl GNode {
    /// The node for `op` applied to `children`.
    pub fn op(op: &Op, children: Vec<Id>) -> GNode {
        GNode::Op {
            name: Text::new(op.name()),
            attrs: Text::new(&attrs_text(op)),
            children,
        }
    }

    /// The op name, for op nodes.
    pub fn op_name(&self) -> Option<&'static str> {
        match self {
            GNode::Op { name, .. } => Some(name.as_str()),
            _ => None,
        }
    }
}

/// `op`'s attributes as `k=v` words separated by single spaces, in `Op::attrs` order. Floats
/// print with `{:?}` (shortest exact text), so the text identifies the attribute values bit for
/// bit and parses back with [`parse_attr`].
pub fn attrs_text(op: &Op) -> String {
    op.attrs()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The op an op node stands for.
pub fn op_of(name: &str, attrs: &str) -> Result<Op, String> {
    let mut parsed = Vec::new();
    for word in attrs.split(' ').filter(|w| !w.is_empty()) {
        let (k, v) = word
            .split_once('=')
            .ok_or_else(|| format!("attribute `{word}` is not `key=value`"))?;
        parsed.push((k.to_string(), parse_attr(v)?));
    }
    Op::from_name_attrs(name, &parsed)
}

/// Reads an attribute value as the text format writes it: `true`/`false`, `[1,2]`, an integer,
/// a float (`1.0`, `-0.0`, `1e-8`, `inf`, `NaN`), or a name.
pub fn parse_attr(s: &str) -> Result<Attr, String> {
    match s {
        "" => Err("empty attribute value".into()),
        "true" => Ok(Attr::Bool(true)),
        "false" => Ok(Attr::Bool(false)),
        _ if s.starts_with('[') => {
            let inner = s
                .strip_prefix('[')
                .and_then(|r| r.strip_suffix(']'))
                .ok_or_else(|| format!("list `{s}` is not closed with `]`"))?;
            inner
                .split(',')
                .map(str::trim)
                .filter(|w| !w.is_empty())
                .map(|w| {
                    w.parse::<i64>()
                        .map_err(|_| format!("list element `{w}` is not an integer"))
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Attr::Ints)
        }
        _ => {
            if let Ok(i) = s.parse::<i64>() {
                Ok(Attr::Int(i))
            } else if let Ok(x) = s.parse::<f64>() {
                Ok(Attr::Float(x))
            } else if s
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.')
            {
                Ok(Attr::Ident(s.to_string()))
            } else {
                Err(format!(
                    "`{s}` is not a number, a list, true/false or a name"
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphtrain_ir::{DType, RopeLayout};

    #[test]
    fn attrs_round_trip_bit_for_bit() {
        let ops = [
            Op::MulScalar { value: -0.0 },
            Op::AddScalar { value: 1e-8 },
            Op::MulScalar {
                value: f64::NEG_INFINITY,
            },
            Op::Transpose { perm: vec![1, 0] },
            Op::Cast { dtype: DType::BF16 },
            Op::Rope {
                theta: 500000.0,
                layout: RopeLayout::Interleaved,
                inverse: true,
            },
            Op::Matmul,
        ];
        for op in ops {
            let back = op_of(op.name(), &attrs_text(&op)).unwrap();
            assert_eq!(format!("{back:?}"), format!("{op:?}"));
        }
    }

    #[test]
    fn node_order_is_by_text() {
        let a = GNode::Op {
            name: Text::new("zzz_late_interned"),
            attrs: Text::new(""),
            children: vec![],
        };
        let b = GNode::Op {
            name: Text::new("aaa_later_interned"),
            attrs: Text::new(""),
            children: vec![],
        };
        assert!(b < a);
    }
}
