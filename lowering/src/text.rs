//! The text form of a Program (`Display`): what snapshot tests compare and dumps show.
//!
//! Line oriented so that a diff of two Programs reads as a diff of steps (a masked, weighted sum
//! of squares, `tests/programs.rs`):
//!
//! ```text
//! program fused: 1 step, 1 constant, arena 1152 bytes
//! const %4: bool[8,16]@512 = [0, 1, 1, 1, 1, 1, 1, 1, ... 128 values]
//! 0 map_reduce %11: f32[8]@1088 = sum(square(select($0, 0.0, mul($1, $2)))) <- $0=%4@512, $1=%x@0, $2=%w@1024 Inner(period=16); over=inner outer=8 inner=16 region=1
//! ```
//!
//! - The header: the mode, the step and constant counts, the arena size.
//! - One `const` line per folded value: its type, its offset and its first elements.
//! - One line per step: its index and kind, what it writes (`%v: type@offset`), what it reads
//!   (`%v@offset`), then after `;` its attributes and its capture region. A value is written
//!   `%name` when it is a graph input, `%N` (its id in `Program::graph`) otherwise; offsets are
//!   in bytes. A read or write through a view that is not the whole value adds
//!   `(shape [..], strides [..], offset N)`, in elements. A `Map` or `MapReduce` shows its
//!   expression over `$k`, its `k`-th input, with how each input is read when it is broadcast
//!   (`Outer(inner=C)`, `Inner(period=C)`, `Scalar`). An `adamw` step lists its updates on the
//!   lines below it.
//!
//! Deterministic: it depends on nothing but the Program, and floats print as the shortest text
//! that reads back to the same bits.

use crate::program::{Access, Expr, MapInput, Mode, Program, ReduceKind, ReduceOver, Step, View};
use graphtrain_ir::{Collective, DType, ValueId};
use std::fmt;

/// Elements of a constant the text shows: enough to recognize a mask or a table, few enough to
/// keep its line short.
const CONST_PREVIEW: usize = 8;

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Expr::Input(k) => write!(f, "${k}"),
            Expr::Const(bits) => write!(f, "{:?}", f32::from_bits(*bits)),
            Expr::Unary(u, a) => write!(f, "{}({a})", u.name()),
            Expr::Binary(o, a, b) => write!(f, "{}({a}, {b})", o.name()),
            Expr::Compare(o, a, b) => write!(f, "{}({a}, {b})", o.name()),
            Expr::Select(c, a, b) => write!(f, "select({c}, {a}, {b})"),
            Expr::Trunc(a) => write!(f, "trunc({a})"),
            Expr::NonZero(a) => write!(f, "nonzero({a})"),
            Expr::RoundBf16(a) => write!(f, "round_bf16({a})"),
        }
    }
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = Printer::new(self);
        let mode = match self.mode {
            Mode::Eager => "eager",
            Mode::Fused => "fused",
        };
        write!(
            f,
            "program {mode}: {}, {}, arena {} bytes",
            plural(self.steps.len(), "step"),
            plural(self.constants.len(), "constant"),
            self.plan.arena_bytes
        )?;
        if !self.host_values.is_empty() {
            write!(f, ", host {} bytes", self.host_bytes())?;
        }
        writeln!(f)?;
        for (v, t) in &self.constants {
            let shown: Vec<String> = t
                .data
                .iter()
                .take(CONST_PREVIEW)
                .map(|&x| {
                    if t.ty.dtype.is_float() {
                        format!("{:?}", x as f32)
                    } else {
                        format!("{}", x as i64)
                    }
                })
                .collect();
            let more = if t.data.len() > CONST_PREVIEW {
                format!(", ... {} values", t.data.len())
            } else {
                String::new()
            };
            writeln!(f, "const {} = [{}{more}]", p.out(*v), shown.join(", "))?;
        }
        for pack in &self.packs {
            let parts: Vec<String> = pack.parts.iter().map(|v| p.at(*v)).collect();
            writeln!(
                f,
                "pack {}: {} = {} (side by side, no step)",
                p.at(pack.concat),
                self.graph.ty(pack.concat),
                parts.join(", ")
            )?;
        }
        let width = self.steps.len().saturating_sub(1).to_string().len();
        for (i, s) in self.steps.iter().enumerate() {
            let (head, mut attrs, below) = p.step(s);
            if let Some(r) = self.step_regions.get(i).copied().flatten() {
                attrs.push(format!("region={r}"));
            }
            write!(f, "{i:>width$} {head}")?;
            if !attrs.is_empty() {
                write!(f, "; {}", attrs.join(" "))?;
            }
            writeln!(f)?;
            for line in below {
                writeln!(f, "{:width$}   {line}", "")?;
            }
        }
        Ok(())
    }
}

fn plural(n: usize, what: &str) -> String {
    format!("{n} {what}{}", if n == 1 { "" } else { "s" })
}

/// `[a,b,c]`, as a type's shape is printed.
fn dims(d: &[usize]) -> String {
    let parts: Vec<String> = d.iter().map(|x| x.to_string()).collect();
    format!("[{}]", parts.join(","))
}

fn reduce(kind: ReduceKind) -> &'static str {
    match kind {
        ReduceKind::Sum => "sum",
        ReduceKind::Max => "max",
    }
}

struct Printer<'a> {
    p: &'a Program,
    /// Graph inputs by name: the values a reader of the source graph knows.
    names: Vec<Option<&'a str>>,
}

impl<'a> Printer<'a> {
    fn new(p: &'a Program) -> Self {
        let mut names = vec![None; p.graph.values.len()];
        for i in &p.graph.inputs {
            names[i.value.index()] = Some(i.name.as_str());
        }
        Printer { p, names }
    }

    fn name(&self, v: ValueId) -> String {
        match self.names.get(v.index()).copied().flatten() {
            Some(n) => format!("%{n}"),
            None => format!("%{}", v.0),
        }
    }

    fn at(&self, v: ValueId) -> String {
        format!("{}@{}", self.name(v), self.place(v))
    }

    /// Where a value lives: its arena offset, `host` (offloaded), or `?` (no buffer).
    fn place(&self, v: ValueId) -> String {
        match self.p.plan.offset_of(v) {
            Some(o) => o.to_string(),
            None if self.p.host_values.contains(&v) => "host".to_string(),
            None => "?".to_string(),
        }
    }

    /// A value a step writes: its name, type and offset, and `(2 bytes)` where it is stored as
    /// bf16 in 2 bytes an element.
    fn out(&self, v: ValueId) -> String {
        let two = if self.p.is_two_byte(v) {
            " (2 bytes)"
        } else {
            ""
        };
        format!(
            "{}: {}@{}{two}",
            self.name(v),
            self.p.graph.ty(v),
            self.place(v)
        )
    }

    /// The view's geometry, unless it is the whole value as it is stored.
    fn geometry(&self, v: &View) -> String {
        let whole = v.offset == 0 && v.is_contiguous() && v.shape == self.p.graph.ty(v.base).shape;
        if whole {
            return String::new();
        }
        let offset = if v.offset == 0 {
            String::new()
        } else {
            format!(", offset {}", v.offset)
        };
        format!(
            " (shape {}, strides {}{offset})",
            dims(&v.shape),
            dims(&v.strides)
        )
    }

    fn read(&self, v: &View) -> String {
        format!("{}{}", self.at(v.base), self.geometry(v))
    }

    /// A matmul operand: `round_bf16(..)` around a view the product rounds as it reads it.
    fn operand(&self, v: &View, round_bf16: bool) -> String {
        if round_bf16 {
            format!("round_bf16({})", self.read(v))
        } else {
            self.read(v)
        }
    }

    fn write(&self, v: &View) -> String {
        format!("{}{}", self.out(v.base), self.geometry(v))
    }

    /// ` <- $0=.., $1=..`, or nothing for an expression of constants only.
    fn inputs(&self, inputs: &[MapInput]) -> String {
        if inputs.is_empty() {
            return String::new();
        }
        let parts: Vec<String> = inputs
            .iter()
            .enumerate()
            .map(|(k, i)| {
                let access = match i.access {
                    Access::Full => String::new(),
                    Access::Scalar => " Scalar".into(),
                    Access::Outer { inner } => format!(" Outer(inner={inner})"),
                    Access::Inner { period } => format!(" Inner(period={period})"),
                };
                format!("${k}={}{access}", self.at(i.value))
            })
            .collect();
        format!(" <- {}", parts.join(", "))
    }

    /// The step's line (without its index) and attributes, and the lines below it.
    fn step(&self, s: &Step) -> (String, Vec<String>, Vec<String>) {
        let kind = s.kind();
        let named = |args: &[(&str, String)]| {
            let parts: Vec<String> = args.iter().map(|(k, v)| format!("{k}={v}")).collect();
            parts.join(", ")
        };
        let mut below = Vec::new();
        let (head, attrs): (String, Vec<String>) = match s {
            Step::Map {
                out, inputs, expr, ..
            } => (
                format!("{kind} {} = {expr}{}", self.out(*out), self.inputs(inputs)),
                vec![],
            ),
            Step::MapReduce {
                kind: rk,
                over,
                out,
                outer,
                inner,
                inputs,
                expr,
            } => {
                let over = match over {
                    ReduceOver::Inner => "inner",
                    ReduceOver::Outer => "outer",
                };
                (
                    format!(
                        "{kind} {} = {}({expr}){}",
                        self.out(*out),
                        reduce(*rk),
                        self.inputs(inputs)
                    ),
                    vec![
                        format!("over={over}"),
                        format!("outer={outer}"),
                        format!("inner={inner}"),
                    ],
                )
            }
            Step::Copy { dst, src } => (
                format!("{kind} {} <- {}", self.write(dst), self.read(src)),
                vec![],
            ),
            Step::Reduce {
                kind: rk,
                out,
                src,
                out_rank,
            } => {
                let axes: Vec<usize> = (*out_rank..src.shape.len()).collect();
                (
                    format!(
                        "{kind} {} = {}({})",
                        self.out(*out),
                        reduce(*rk),
                        self.read(src)
                    ),
                    vec![format!("axes={}", dims(&axes))],
                )
            }
            Step::Matmul {
                out,
                a,
                b,
                batch,
                m,
                n,
                k,
                bf16,
            } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[
                        ("a", self.operand(a, bf16.a)),
                        ("b", self.operand(b, bf16.b))
                    ])
                ),
                [
                    format!("batch={batch}"),
                    format!("m={m}"),
                    format!("n={n}"),
                    format!("k={k}"),
                ]
                .into_iter()
                // A bf16 result is the rule for a bf16 value; say it where the value is not one.
                .chain(
                    (bf16.out && self.p.graph.ty(*out).dtype != DType::BF16)
                        .then(|| "round_out=bf16".to_string()),
                )
                .collect(),
            ),
            Step::Gather {
                out,
                src,
                index,
                axis,
            } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[("src", self.at(*src)), ("index", self.at(*index))])
                ),
                vec![format!("axis={axis}")],
            ),
            Step::ScatterAdd {
                out,
                src,
                index,
                add,
                axis,
            } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[
                        ("src", self.at(*src)),
                        ("index", self.at(*index)),
                        ("add", self.at(*add)),
                    ])
                ),
                vec![format!("axis={axis}")],
            ),
            Step::Iota { out, inner, dim } => (
                format!("{kind} {}", self.out(*out)),
                vec![format!("inner={inner}"), format!("dim={dim}")],
            ),
            Step::Random {
                out,
                seed,
                stream,
                normal,
            } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[("seed", self.at(*seed))])
                ),
                vec![
                    format!("stream={stream}"),
                    format!("dist={}", if *normal { "normal" } else { "uniform" }),
                ],
            ),
            Step::Attention {
                out,
                q,
                k,
                v,
                stats,
                causal,
                scale,
                bf16,
            } => (
                format!(
                    "{kind} {}{} <- {}",
                    self.write(out),
                    stats
                        .map(|s| format!(", {}", self.out(s)))
                        .unwrap_or_default(),
                    named(&[
                        ("q", self.read(q)),
                        ("k", self.read(k)),
                        ("v", self.read(v))
                    ])
                ),
                attention_attrs(*causal, *scale, *bf16),
            ),
            Step::AttentionBackward {
                dq,
                dk,
                dv,
                q,
                k,
                v,
                dout,
                stats,
                causal,
                scale,
                bf16,
            } => (
                format!(
                    "{kind} {}, {}, {} <- {}",
                    self.write(dq),
                    self.write(dk),
                    self.write(dv),
                    named(
                        &[
                            ("q", self.read(q)),
                            ("k", self.read(k)),
                            ("v", self.read(v)),
                            ("dout", self.read(dout)),
                        ]
                        .into_iter()
                        .chain(stats.map(|s| ("stats", self.at(s))))
                        .collect::<Vec<_>>()
                    )
                ),
                attention_attrs(*causal, *scale, *bf16),
            ),
            Step::CollectiveStart {
                collective,
                mesh_dims,
                src,
                handle,
            } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*handle),
                    named(&[("src", self.at(*src))])
                ),
                collective_attrs(collective, mesh_dims),
            ),
            Step::Offload { src, out } | Step::Reload { src, out } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[("src", self.at(*src))])
                ),
                Vec::new(),
            ),
            Step::Wait { handle, out, .. } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[("handle", self.at(*handle))])
                ),
                Vec::new(),
            ),
            Step::Rope {
                out,
                x,
                theta,
                layout,
                inverse,
            } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[("x", self.read(x))])
                ),
                vec![
                    format!("theta={theta:?}"),
                    format!("layout={}", layout.name()),
                    format!("inverse={inverse}"),
                ],
            ),
            Step::AdamW {
                updates,
                lr,
                step,
                beta1,
                beta2,
                eps,
                weight_decay,
            } => {
                for u in updates {
                    below.push(format!(
                        "{}, {}, {} <- {}",
                        self.out(u.p_out),
                        self.out(u.m_out),
                        self.out(u.v_out),
                        named(&[
                            ("p", self.at(u.p)),
                            ("g", self.at(u.g)),
                            ("m", self.at(u.m)),
                            ("v", self.at(u.v)),
                        ])
                    ));
                }
                (
                    format!(
                        "{kind} {} <- {}",
                        plural(updates.len(), "update"),
                        named(&[("lr", self.at(*lr)), ("step", self.at(*step))])
                    ),
                    vec![
                        format!("beta1={beta1:?}"),
                        format!("beta2={beta2:?}"),
                        format!("eps={eps:?}"),
                        format!("weight_decay={weight_decay:?}"),
                    ],
                )
            }
            Step::CrossEntropy {
                out,
                logits,
                targets,
            } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[
                        ("logits", self.read(logits)),
                        ("targets", self.read(targets))
                    ])
                ),
                vec![],
            ),
            Step::CrossEntropyBackward {
                out,
                logits,
                targets,
                grad,
            } => (
                format!(
                    "{kind} {} <- {}",
                    self.out(*out),
                    named(&[
                        ("logits", self.read(logits)),
                        ("targets", self.read(targets)),
                        ("grad", self.at(*grad)),
                    ])
                ),
                vec![],
            ),
        };
        (head, attrs, below)
    }
}

/// Attention's attributes; `bf16` only where it holds (f32 attention prints as before).
fn attention_attrs(causal: bool, scale: f64, bf16: bool) -> Vec<String> {
    let mut attrs = vec![format!("causal={causal}"), format!("scale={scale:?}")];
    if bf16 {
        attrs.push("bf16".into());
    }
    attrs
}

/// A collective step's attributes, as the graph's text format writes its start node's.
fn collective_attrs(collective: &Collective, mesh_dims: &[usize]) -> Vec<String> {
    let mut attrs = match *collective {
        Collective::AllGather { axis } => vec![format!("axis={axis}")],
        Collective::ReduceScatter { axis, reduce } => {
            vec![format!("axis={axis}"), format!("reduce={}", reduce.name())]
        }
        Collective::AllReduce { reduce } => vec![format!("reduce={}", reduce.name())],
        Collective::AllToAll {
            split_axis,
            concat_axis,
        } => vec![
            format!("split_axis={split_axis}"),
            format!("concat_axis={concat_axis}"),
        ],
        Collective::Broadcast { root } => vec![format!("root={root}")],
    };
    attrs.push(format!("mesh_dims={mesh_dims:?}"));
    attrs
}
