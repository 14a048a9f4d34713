//! The text format and RON serialization: printing, parsing back, error reporting, and
//! robustness against malformed input.

use graphtrain_ir::graph::layer_from_module;
use graphtrain_ir::rng;
use graphtrain_ir::ron_io::{from_ron, to_ron};
use graphtrain_ir::text::{parse, print, ParseError};
use graphtrain_ir::{
    BinaryOp, CompareOp, DType, Graph, InputKind, Meta, Op, Phase, Remat, RopeLayout, TensorType,
    UnaryOp, ValueId,
};
use std::collections::BTreeSet;

fn f32t(shape: &[usize]) -> TensorType {
    TensorType::new(DType::F32, shape)
}

fn meta(module: &str, phase: Phase) -> Meta {
    Meta::new(module, phase)
}

/// A small train step touching every part of the format: all input kinds, a multi-output node,
/// special floats, identifier attributes, tags, layer overrides and donation.
fn train_step() -> Graph {
    let mut g = Graph::new("train_step");
    let tokens = g.add_input(
        "tokens",
        InputKind::Data,
        TensorType::new(DType::I32, [2, 8]),
    );
    let emb = g.add_input("tok_embeddings.weight", InputKind::Param, f32t(&[64, 16]));
    let norm = g.add_input(
        "layers.0.attention_norm.weight",
        InputKind::Param,
        f32t(&[16]),
    );
    let m = g.add_input(
        "opt.m.tok_embeddings.weight",
        InputKind::State,
        f32t(&[64, 16]),
    );
    let v = g.add_input(
        "opt.v.tok_embeddings.weight",
        InputKind::State,
        f32t(&[64, 16]),
    );
    let lr = g.add_input("lr", InputKind::Data, f32t(&[]));
    let step = g.add_input("step", InputKind::Data, TensorType::scalar(DType::I64));

    let push = |g: &mut Graph, op: Op, ins: Vec<ValueId>, meta: Meta| {
        g.push(op, ins, meta)
            .expect("the example graph is well typed")
    };
    let x = push(
        &mut g,
        Op::Embedding,
        vec![emb, tokens],
        meta("tok_embeddings", Phase::Forward),
    )[0];
    let h = push(
        &mut g,
        Op::RmsNorm { eps: 1e-5 },
        vec![x, norm],
        meta("layers.0.attention_norm", Phase::Forward),
    )[0];
    let q = push(
        &mut g,
        Op::Reshape {
            shape: vec![2, 8, 2, 8],
        },
        vec![h],
        meta("layers.0.attention", Phase::Forward),
    )[0];
    let mut rope_meta = meta("layers.0.attention", Phase::Forward);
    rope_meta.tags.remat = Some(Remat::Recompute);
    push(
        &mut g,
        Op::Rope {
            theta: 500000.0,
            layout: RopeLayout::Interleaved,
            inverse: false,
        },
        vec![q],
        rope_meta,
    );
    let loss = push(
        &mut g,
        Op::ReduceSum {
            axes: vec![0, 1, 2],
            keepdim: false,
        },
        vec![h],
        meta("", Phase::Loss),
    )[0];
    let grad = push(
        &mut g,
        Op::MulScalar { value: -0.0 },
        vec![h],
        meta("", Phase::Backward),
    )[0];
    let mut norm_meta = meta("layers.0.ffn_norm", Phase::Backward);
    norm_meta.layer = Some(7);
    norm_meta.tags.stream = Some(1);
    norm_meta.tags.region = Some(2);
    push(
        &mut g,
        Op::RmsNormBackward { eps: 1e-5 },
        vec![x, norm, grad],
        norm_meta,
    );
    let mut emb_meta = meta("tok_embeddings", Phase::Backward);
    emb_meta.layer = Some(0);
    let grad_emb = push(
        &mut g,
        Op::EmbeddingBackward { rows: 64 },
        vec![grad, tokens],
        emb_meta,
    )[0];
    let clip = push(
        &mut g,
        Op::Full {
            value: f64::NEG_INFINITY,
            shape: vec![],
            dtype: DType::F32,
        },
        vec![],
        meta("", Phase::Optimizer),
    )[0];
    let mut opt_meta = meta("tok_embeddings.weight", Phase::Optimizer);
    opt_meta.tags.remat = Some(Remat::Save);
    opt_meta.tags.bucket = Some(3);
    let updated = push(
        &mut g,
        Op::AdamW {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        vec![emb, grad_emb, m, v, lr, step],
        opt_meta,
    );
    let mut layerless = meta("layers.0.attention_norm.weight", Phase::Optimizer);
    layerless.layer = None;
    let clipped = push(&mut g, Op::Binary(BinaryOp::Max), vec![lr, clip], layerless)[0];

    g.add_output("loss", loss, None);
    g.add_output("tok_embeddings.weight", updated[0], Some(emb));
    g.add_output("opt.m.tok_embeddings.weight", updated[1], Some(m));
    g.add_output("opt.v.tok_embeddings.weight", updated[2], Some(v));
    g.add_output("lr_clipped", clipped, None);
    g
}

#[test]
fn train_step_prints_and_parses_back() {
    let g = train_step();
    let text = print(&g);
    insta::assert_snapshot!(text);
    assert_eq!(g.to_string(), text, "Display prints the same text");
    let parsed = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(parsed, g.canonical());
    assert_eq!(print(&parsed), text);
}

#[test]
fn comments_blank_lines_and_defaults_are_accepted() {
    let src = "\
// a hand-written graph
graph tiny{   // header comment

\tinput %x : f32[ 2, 3 ]
  param %_w.0: f32[3]

  %a: f32[2,3]=rms_norm(%x,%_w.0,eps=1e-5)
  %b: f32[3] = reduce_sum(%a, axes=[0], keepdim=false)  # loss layers.2.out layer=none
  %c: f32[3] = add_scalar(%b, value=1)  #bwd layers.2.out layer=2 region=0 remat=offload micro=1
  output out = %c   // trailing comment
}
// the end
";
    let g = parse(src).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(g.name, "tiny");
    assert_eq!(
        g.nodes[0].meta,
        Meta::default(),
        "missing metadata means fwd at the root"
    );
    assert_eq!(g.nodes[1].meta.phase, Phase::Loss);
    assert_eq!(g.nodes[1].meta.layer, None);
    assert_eq!(g.nodes[2].meta.layer, Some(2));
    assert_eq!(g.nodes[2].meta.tags.remat, Some(Remat::Offload));
    assert_eq!(g.nodes[2].meta.tags.region, Some(0));
    assert_eq!(g.nodes[2].meta.micro_batch, Some(1));
    assert_eq!(g.nodes[1].meta.micro_batch, None);
    assert_eq!(g.nodes[2].op, Op::AddScalar { value: 1.0 });
    assert_eq!(
        print(&g),
        "\
graph tiny {
  input %x: f32[2,3]
  param %_w.0: f32[3]
  %2: f32[2,3] = rms_norm(%x, %_w.0, eps=1e-5)  # fwd
  %3: f32[3] = reduce_sum(%2, axes=[0], keepdim=false)  # loss layers.2.out layer=none
  %4: f32[3] = add_scalar(%3, value=1.0)  # bwd layers.2.out micro=1 remat=offload region=0
  output out = %4
}
"
    );
}

#[test]
fn values_are_printed_in_canonical_numbering() {
    // Inputs added after nodes, and a value nothing reads: the text renumbers them.
    let mut g = Graph::new("late_inputs");
    let x = g.add_input("x", InputKind::Data, f32t(&[4]));
    let y = g
        .push1(Op::Unary(UnaryOp::Exp), vec![x], Meta::default())
        .unwrap();
    let w = g.add_input("w", InputKind::Param, f32t(&[4]));
    let z = g
        .push1(Op::Binary(BinaryOp::Mul), vec![y, w], Meta::default())
        .unwrap();
    g.add_output("z", z, None);
    assert!(!g.is_canonical());
    let text = print(&g);
    assert!(text.contains("%2: f32[4] = exp(%x)"), "{text}");
    assert!(text.contains("%3: f32[4] = mul(%2, %w)"), "{text}");
    assert_eq!(parse(&text).unwrap(), g.canonical());
}

#[test]
fn special_floats_round_trip_bit_for_bit() {
    let cases = [
        (f64::NEG_INFINITY, "-inf"),
        (f64::INFINITY, "inf"),
        (f64::NAN, "NaN"),
        (1e-5, "1e-5"),
        (500000.0, "500000.0"),
        (-0.0, "-0.0"),
        (0.1 + 0.2, "0.30000000000000004"),
        (5e-324, "5e-324"),
        (f64::MAX, "1.7976931348623157e308"),
    ];
    for (value, written) in cases {
        let mut g = Graph::new("floats");
        let x = g.add_input("x", InputKind::Data, f32t(&[]));
        let y = g
            .push1(Op::AddScalar { value }, vec![x], Meta::default())
            .unwrap();
        g.add_output("y", y, None);
        let text = print(&g);
        assert!(text.contains(&format!("value={written})")), "{text}");
        let parsed = parse(&text).unwrap();
        let Op::AddScalar { value: back } = parsed.nodes[0].op else {
            panic!("parsed {:?}", parsed.nodes[0].op);
        };
        assert_eq!(back.to_bits(), value.to_bits(), "{written}");
        let Op::AddScalar { value: back } = from_ron(&to_ron(&g)).unwrap().nodes[0].op else {
            panic!("RON changed the op");
        };
        assert_eq!(back.to_bits(), value.to_bits(), "{written} through RON");
    }
}

#[test]
fn ron_errors_say_where() {
    let err = from_ron("(name: \"g\", values: [oops])").unwrap_err();
    assert!(err.contains("1:"), "{err}");
    let ron = to_ron(&train_step());
    assert_eq!(from_ron(&ron).unwrap(), train_step());
    let err = from_ron(&ron[..ron.len() / 2]).unwrap_err();
    assert!(err.starts_with("invalid graph RON at "), "{err}");
}

// ---- randomized round trips

/// A deterministic stream of random numbers for the generator.
struct Rng {
    seed: u64,
    index: u64,
}

impl Rng {
    fn next(&mut self) -> u64 {
        self.index += 1;
        rng::bits(self.seed, 0, self.index)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<T: Clone>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())].clone()
    }
}

/// Builds random well-typed graphs through `Graph::push`.
struct Gen {
    rng: Rng,
    g: Graph,
    with_nan: bool,
    names: usize,
}

const MODULES: [&str; 10] = [
    "",
    "tok_embeddings",
    "norm",
    "output",
    "layers.0.attention.wq",
    "layers.3.feed_forward.w1",
    "layers.12",
    "layers.x.attention",
    "layers_1.mlp",
    "model.layers.2",
];

impl Gen {
    fn fresh_name(&mut self, prefix: &str) -> String {
        self.names += 1;
        format!("{prefix}{}", self.names)
    }

    fn float(&mut self) -> f64 {
        let specials = [
            0.0,
            -0.0,
            1.0,
            -1.5,
            1e-5,
            1e-8,
            0.9,
            0.999,
            500000.0,
            1e300,
            -1e-300,
            5e-324,
            f64::MAX,
            f64::MIN_POSITIVE,
            f64::INFINITY,
            f64::NEG_INFINITY,
        ];
        if self.with_nan && self.rng.chance(10) {
            return f64::NAN;
        }
        if self.rng.chance(60) {
            return self.rng.pick(&specials);
        }
        loop {
            let x = f64::from_bits(self.rng.next());
            if !x.is_nan() {
                return x;
            }
        }
    }

    fn float_dtype(&mut self) -> DType {
        self.rng
            .pick(&[DType::F32, DType::F32, DType::BF16, DType::F64])
    }

    fn shape(&mut self, min_rank: usize) -> Vec<usize> {
        let rank = min_rank + self.rng.below(4 - min_rank);
        (0..rank).map(|_| 1 + self.rng.below(4)).collect()
    }

    fn meta(&mut self) -> Meta {
        let module = self.rng.pick(&MODULES);
        let mut meta = Meta::new(module, self.rng.pick(&Phase::ALL));
        if self.rng.chance(20) {
            meta.layer = self.rng.pick(&[None, Some(0), Some(7), Some(31)]);
        }
        if self.rng.chance(20) {
            meta.micro_batch = self.rng.pick(&[Some(0), Some(3)]);
        }
        let tags = &mut meta.tags;
        if self.rng.chance(25) {
            tags.remat = Some(
                self.rng
                    .pick(&[Remat::Save, Remat::Recompute, Remat::Offload]),
            );
        }
        for tag in [&mut tags.bucket, &mut tags.stream, &mut tags.region] {
            if self.rng.chance(25) {
                *tag = Some(self.rng.pick(&[0, 1, 5, u32::MAX]));
            }
        }
        meta
    }

    fn input(&mut self, kind: InputKind, ty: TensorType) -> ValueId {
        let prefix = match kind {
            InputKind::Data => "data_",
            InputKind::Param => "layers.1.w",
            InputKind::State => "opt.m.layers.1.w",
        };
        let name = self.fresh_name(prefix);
        self.g.add_input(name, kind, ty)
    }

    fn random_input(&mut self) -> ValueId {
        let kind = self
            .rng
            .pick(&[InputKind::Data, InputKind::Param, InputKind::State]);
        let ty = TensorType::new(self.float_dtype(), self.shape(0));
        self.input(kind, ty)
    }

    /// A random existing value whose type satisfies `pred`.
    fn value(&mut self, pred: impl Fn(&TensorType) -> bool) -> Option<ValueId> {
        let ok: Vec<ValueId> = (0..self.g.values.len())
            .map(|i| ValueId(i as u32))
            .filter(|&v| pred(self.g.ty(v)))
            .collect();
        (!ok.is_empty()).then(|| self.rng.pick(&ok))
    }

    fn float_value(&mut self, min_rank: usize) -> Option<ValueId> {
        self.value(|t| t.dtype.is_float() && t.rank() >= min_rank)
    }

    fn ty(&self, v: ValueId) -> TensorType {
        self.g.ty(v).clone()
    }

    fn push(&mut self, op: Op, inputs: Vec<ValueId>) -> Vec<ValueId> {
        let meta = self.meta();
        self.g
            .push(op, inputs, meta)
            .unwrap_or_else(|e| panic!("the generator built an ill-typed node: {e}"))
    }

    /// The scalar data input `name`, declared on first use.
    fn shared_scalar(&mut self, name: &str, dtype: DType) -> ValueId {
        match self.g.input_named(name) {
            Some(input) => input.value,
            None => self
                .g
                .add_input(name, InputKind::Data, TensorType::scalar(dtype)),
        }
    }

    /// Adds one random node (or a few, for ops that need prepared operands).
    fn node(&mut self) {
        match self.rng.below(20) {
            0 => {
                if let Some(x) = self.float_value(0) {
                    let u = self.rng.pick(&UnaryOp::ALL);
                    self.push(Op::Unary(u), vec![x]);
                }
            }
            1 => {
                if let Some(a) = self.float_value(0) {
                    let ty = self.ty(a);
                    let b = self.value(|t| *t == ty).unwrap_or(a);
                    let op = self.rng.pick(&BinaryOp::ALL);
                    self.push(Op::Binary(op), vec![a, b]);
                }
            }
            2 | 3 => {
                if let Some(a) = self.value(|_| true) {
                    let ty = self.ty(a);
                    let b = self.value(|t| *t == ty).unwrap_or(a);
                    let op = Op::Compare(self.rng.pick(&CompareOp::ALL));
                    let cond = self.push(op, vec![a, b]);
                    if self.rng.chance(50) {
                        self.push(Op::Select, vec![cond[0], b, a]);
                    }
                }
            }
            4 => {
                if let Some(x) = self.float_value(0) {
                    let value = self.float();
                    let op = self.rng.pick(&[
                        Op::AddScalar { value },
                        Op::MulScalar { value },
                        Op::PowScalar { exponent: value },
                    ]);
                    self.push(op, vec![x]);
                }
            }
            5 => {
                if let Some(x) = self.value(|_| true) {
                    let dtype = self.rng.pick(&DType::ALL);
                    self.push(Op::Cast { dtype }, vec![x]);
                }
            }
            6 => {
                if let Some(x) = self.float_value(1) {
                    let rank = self.g.ty(x).rank();
                    let axes = (0..rank).filter(|_| self.rng.chance(50)).collect();
                    let keepdim = self.rng.chance(50);
                    let op = if self.rng.chance(50) {
                        Op::ReduceSum { axes, keepdim }
                    } else {
                        Op::ReduceMax { axes, keepdim }
                    };
                    self.push(op, vec![x]);
                }
            }
            7 => {
                if let Some(x) = self.value(|_| true) {
                    let n = self.g.ty(x).numel();
                    let shape = self.rng.pick(&[vec![n], vec![1, n], vec![n, 1], vec![]]);
                    if shape.iter().product::<usize>() == n {
                        self.push(Op::Reshape { shape }, vec![x]);
                    }
                }
            }
            8 => {
                if let Some(x) = self.value(|_| true) {
                    let mut perm: Vec<usize> = (0..self.g.ty(x).rank()).collect();
                    for i in (1..perm.len()).rev() {
                        let j = self.rng.below(i + 1);
                        perm.swap(i, j);
                    }
                    self.push(Op::Transpose { perm }, vec![x]);
                }
            }
            9 => {
                if let Some(x) = self.value(|_| true) {
                    let from = self.g.ty(x).shape.clone();
                    let shape = from
                        .iter()
                        .map(|&d| if d == 1 { 1 + self.rng.below(3) } else { d })
                        .collect();
                    self.push(Op::Expand { shape }, vec![x]);
                }
            }
            10 => {
                if let Some(x) = self.value(|t| t.rank() >= 1) {
                    let shape = self.g.ty(x).shape.clone();
                    let axis = self.rng.below(shape.len());
                    let end = self.rng.below(shape[axis] + 1);
                    let start = self.rng.below(end + 1);
                    self.push(Op::Slice { axis, start, end }, vec![x]);
                }
            }
            11 => {
                if let Some(x) = self.value(|t| t.rank() >= 1) {
                    let axis = self.rng.below(self.g.ty(x).rank());
                    let copies = 1 + self.rng.below(3);
                    self.push(Op::Concat { axis }, vec![x; copies]);
                }
            }
            12 => {
                if let Some(a) = self.float_value(2) {
                    let ty = self.ty(a);
                    let k = ty.shape[ty.rank() - 1];
                    let b = if self.rng.chance(50) {
                        let n = 1 + self.rng.below(4);
                        self.input(InputKind::Param, TensorType::new(ty.dtype, [k, n]))
                    } else {
                        let mut perm: Vec<usize> = (0..ty.rank()).collect();
                        perm.swap(ty.rank() - 2, ty.rank() - 1);
                        self.push(Op::Transpose { perm }, vec![a])[0]
                    };
                    self.push(Op::Matmul, vec![a, b]);
                }
            }
            13 => {
                let value = self.float();
                let shape = self.shape(0);
                let dtype = self.float_dtype();
                self.push(
                    Op::Full {
                        value,
                        shape,
                        dtype,
                    },
                    vec![],
                );
            }
            14 => {
                let shape = self.shape(1);
                let axis = self.rng.below(shape.len());
                let dtype = self.rng.pick(&[DType::I32, DType::I64, DType::F32]);
                self.push(Op::Iota { shape, axis, dtype }, vec![]);
            }
            15 => {
                if let Some(x) = self.float_value(1) {
                    let axis = self.rng.below(self.g.ty(x).rank());
                    let op = self
                        .rng
                        .pick(&[Op::Softmax { axis }, Op::LogSoftmax { axis }]);
                    self.push(op, vec![x]);
                }
            }
            16 => {
                if let Some(x) = self.float_value(1) {
                    let ty = self.ty(x);
                    let w = self.input(
                        InputKind::Param,
                        TensorType::new(ty.dtype, [ty.shape[ty.rank() - 1]]),
                    );
                    let eps = self.float();
                    if self.rng.chance(50) {
                        self.push(Op::RmsNorm { eps }, vec![x, w]);
                    } else {
                        self.push(Op::RmsNormBackward { eps }, vec![x, w, x]);
                    }
                }
            }
            17 => {
                let p = self
                    .value(|t| t.dtype.is_float())
                    .unwrap_or_else(|| self.random_input());
                let ty = self.ty(p);
                let grad = self
                    .value(|t| t.dtype.is_float() && t.shape == ty.shape)
                    .unwrap_or(p);
                let m = self.input(InputKind::State, ty.clone());
                let v = self.input(InputKind::State, ty);
                let lr = self.shared_scalar("lr", DType::F32);
                let step = self.shared_scalar("step", DType::I64);
                let op = Op::AdamW {
                    beta1: self.float(),
                    beta2: self.float(),
                    eps: self.float(),
                    weight_decay: self.float(),
                };
                let outs = self.push(op, vec![p, grad, m, v, lr, step]);
                for (out, donated) in outs.into_iter().zip([p, m, v]) {
                    let name = self.fresh_name("updated.");
                    self.g.add_output(name, out, Some(donated));
                }
            }
            18 => {
                let ids_ty = TensorType::new(DType::I32, self.shape(0));
                let ids = self.input(InputKind::Data, ids_ty);
                let rows = 1 + self.rng.below(8);
                let ty = TensorType::new(self.float_dtype(), [rows, 1 + self.rng.below(4)]);
                let w = self.input(InputKind::Param, ty);
                self.push(Op::Embedding, vec![w, ids]);
            }
            _ => {
                let mut shape = self.shape(0);
                shape.resize(3, 2);
                shape.push(2 * (1 + self.rng.below(2)));
                let ty = TensorType::new(self.float_dtype(), shape);
                let x = self.input(InputKind::Data, ty);
                let op = Op::Rope {
                    theta: self.float(),
                    layout: self.rng.pick(&[RopeLayout::Half, RopeLayout::Interleaved]),
                    inverse: self.rng.chance(50),
                };
                self.push(op, vec![x]);
            }
        }
    }
}

fn random_graph(seed: u64, with_nan: bool) -> Graph {
    let mut gen = Gen {
        rng: Rng { seed, index: 0 },
        g: Graph::new(format!("random_{seed}")),
        with_nan,
        names: 0,
    };
    for _ in 0..1 + gen.rng.below(4) {
        gen.random_input();
    }
    for _ in 0..3 + gen.rng.below(15) {
        gen.node();
    }
    let inputs: Vec<ValueId> = gen.g.inputs.iter().map(|i| i.value).collect();
    for _ in 0..1 + gen.rng.below(3) {
        let value = ValueId(gen.rng.below(gen.g.values.len()) as u32);
        let donates = gen.rng.chance(30).then(|| gen.rng.pick(&inputs));
        let name = gen.fresh_name("out.");
        gen.g.add_output(name, value, donates);
    }
    gen.g
}

/// Parses `print(g)` and reads `to_ron(g)` back, checking both give the same graph, floats
/// compared bit for bit (through `Debug`, which tells `-0.0` from `0.0`).
fn check_round_trips(g: &Graph) {
    let canonical = g.canonical();
    let text = print(g);
    let parsed = parse(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    assert_eq!(format!("{parsed:?}"), format!("{canonical:?}"), "\n{text}");
    assert_eq!(print(&parsed), text);

    let ron = to_ron(g);
    let back = from_ron(&ron).unwrap_or_else(|e| panic!("{e}\n{ron}"));
    assert_eq!(format!("{back:?}"), format!("{g:?}"));
    assert_eq!(to_ron(&back), ron);
}

#[test]
fn random_graphs_round_trip() {
    let mut ops = BTreeSet::new();
    let mut non_canonical = 0;
    for seed in 0..300 {
        let g = random_graph(seed, false);
        check_round_trips(&g);
        assert_eq!(parse(&print(&g)).unwrap(), g.canonical(), "seed {seed}");
        assert_eq!(from_ron(&to_ron(&g)).unwrap(), g, "seed {seed}");
        ops.extend(g.nodes.iter().map(|n| n.op.name()));
        non_canonical += usize::from(!g.is_canonical());
    }
    // The generator must keep exercising what it claims to.
    for op in [
        "exp",
        "add",
        "eq",
        "select",
        "add_scalar",
        "pow_scalar",
        "cast",
        "reduce_sum",
        "reduce_max",
        "reshape",
        "transpose",
        "expand",
        "slice",
        "concat",
        "matmul",
        "full",
        "iota",
        "softmax",
        "log_softmax",
        "rms_norm",
        "rms_norm_backward",
        "adamw",
        "embedding",
        "rope",
    ] {
        assert!(ops.contains(op), "no random graph used `{op}`: {ops:?}");
    }
    assert!(
        non_canonical > 30,
        "only {non_canonical} graphs needed renumbering"
    );
}

#[test]
fn random_graphs_with_nan_round_trip_as_text() {
    let mut saw_nan = false;
    for seed in 1000..1100 {
        let g = random_graph(seed, true);
        saw_nan |= print(&g).contains("NaN");
        check_round_trips(&g);
    }
    assert!(saw_nan);
}

#[test]
fn printed_layer_follows_the_module_path() {
    for module in MODULES {
        for layer in [None, Some(0), Some(12)] {
            let mut g = Graph::new("layers");
            let mut meta = Meta::new(module, Phase::Backward);
            meta.layer = layer;
            g.push(
                Op::Iota {
                    shape: vec![2],
                    axis: 0,
                    dtype: DType::I32,
                },
                vec![],
                meta.clone(),
            )
            .unwrap();
            let text = print(&g);
            let implied = layer_from_module(module);
            assert_eq!(text.contains("layer="), layer != implied, "{text}");
            assert_eq!(parse(&text).unwrap().nodes[0].meta, meta, "{text}");
        }
    }
}

// ---- errors

const VALID: &str = "\
graph g {
  input %x: f32[2,3]
  param %w: f32[3]
  %2: f32[2,3] = rms_norm(%x, %w, eps=1e-5)  # fwd layers.0.norm
  %3: f32[3] = reduce_sum(%2, axes=[0], keepdim=false)  # loss
  output loss = %3 donates %x
}
";

/// Marks an error at the end of a line in `assert_error`.
const END: &str = "<end of line>";

/// Parses `VALID` with `from` replaced by `to` and checks the error's line, that its column is
/// where `at` starts in that line (or just past its end, for `END`), and that the message contains
/// `phrase`.
fn assert_error(from: &str, to: &str, line: usize, at: &str, phrase: &str) -> ParseError {
    assert!(VALID.contains(from), "{from}");
    let src = VALID.replacen(from, to, 1);
    let err = parse(&src).expect_err(&src);
    let text = src.lines().nth(line - 1).unwrap_or_default();
    let col = if at == END {
        text.len() + 1
    } else {
        text.find(at)
            .unwrap_or_else(|| panic!("`{at}` not in `{text}`"))
            + 1
    };
    assert_eq!((err.line, err.col), (line, col), "{err}\n{src}");
    assert!(err.message.contains(phrase), "`{phrase}` not in: {err}");
    assert_eq!(
        err.to_string(),
        format!("line {line}, column {col}: {}", err.message)
    );
    err
}

#[test]
fn valid_reference_text_parses() {
    let g = parse(VALID).unwrap();
    assert_eq!(print(&g), VALID);
}

#[test]
fn truncated_file_is_missing_its_closing_brace() {
    let src = VALID.strip_suffix("}\n").unwrap();
    let err = parse(src).unwrap_err();
    assert_eq!((err.line, err.col), (7, 1));
    assert_eq!(
        err.message,
        "unexpected end of input: the graph is missing its closing `}`"
    );
    let err = parse("graph g {\n  input %x: f32[]").unwrap_err();
    assert_eq!((err.line, err.col), (2, 18));
    let err = parse("  // nothing\n").unwrap_err();
    assert!(err.message.contains("expected `graph NAME {`"), "{err}");
}

#[test]
fn unknown_op_lists_the_known_ones() {
    let err = assert_error(
        "rms_norm(",
        "rms_normal(",
        4,
        "rms_normal",
        "unknown op `rms_normal`",
    );
    assert!(err.message.contains("known ops:"), "{err}");
    assert!(
        err.message.contains("reduce_sum") && err.message.contains("adamw"),
        "{err}"
    );
}

#[test]
fn undefined_values_are_refused() {
    assert_error(
        "reduce_sum(%2",
        "reduce_sum(%9",
        5,
        "%9",
        "unknown value `%9`",
    );
    assert_error(
        "= %3 donates",
        "= %12 donates",
        6,
        "%12",
        "unknown value `%12`",
    );
    assert_error("donates %x", "donates %y", 6, "%y", "unknown value `%y`");
    // A node cannot read its own output.
    assert_error(
        "reduce_sum(%2",
        "reduce_sum(%3",
        5,
        "%3, axes",
        "unknown value `%3`",
    );
}

#[test]
fn values_and_inputs_cannot_be_defined_twice() {
    assert_error(
        "%3: f32[3] =",
        "%2: f32[3] =",
        5,
        "%2",
        "value `%2` is defined twice",
    );
    assert_error(
        "%2: f32[2,3] =",
        "%x: f32[2,3] =",
        4,
        "%x",
        "value `%x` is defined twice",
    );
    assert_error("param %w", "param %x", 3, "%x", "duplicate input name `%x`");
    assert_error(
        "output loss = %3 donates %x",
        "output loss = %3\n  output loss = %2",
        7,
        "loss",
        "output `loss` is declared twice",
    );
}

#[test]
fn malformed_types_are_refused() {
    assert_error(
        "f32[2,3]\n",
        "f32[2,x]\n",
        2,
        "x]",
        "expected a dimension size",
    );
    assert_error(
        "param %w: f32",
        "param %w: f16",
        3,
        "f16",
        "unknown dtype `f16`",
    );
    assert_error(
        "f32[3]\n",
        "f32[3\n",
        3,
        END,
        "expected `,` or `]` in the shape, found end of line",
    );
    assert_error(
        "f32[3]\n",
        "f32 3]\n",
        3,
        "3]",
        "expected `[` after the dtype, found `3`",
    );
    assert_error(
        "%x: f32[2,3]",
        "%x: [2,3]",
        2,
        "[2",
        "expected a type such as `f32[2,3]`, found `[`",
    );
}

#[test]
fn syntax_errors_say_what_was_expected() {
    assert_error(
        "f32[2,3] = rms_norm",
        "f32[2,3] rms_norm",
        4,
        "rms_norm",
        "expected `,` or `=` after the output type, found `rms_norm`",
    );
    assert_error(
        "(%x, %w,",
        "(%x = %w,",
        4,
        "= %w",
        "expected `)` or `,` after operand, found `=`",
    );
    assert_error(
        "keepdim=false)",
        "keepdim=false",
        5,
        "# loss",
        "expected `)` or `,` after attribute, found `#`",
    );
    assert_error(
        "axes=[0], keepdim",
        "axes=[0], %x, keepdim",
        5,
        "%x",
        "operands must come before attributes",
    );
    assert_error(
        "output loss =",
        "output loss",
        6,
        "%3 donates",
        "expected `=` after the output name",
    );
    assert_error(
        "%3 donates %x",
        "%3 donating %x",
        6,
        "donating",
        "expected `donates %input`, `@ [placements]` or end of line",
    );
    assert_error(
        "graph g {",
        "graph 1g {",
        1,
        "1g",
        "invalid graph name `1g`",
    );
    assert_error(
        "input %x",
        "inputs %x",
        2,
        "inputs",
        "expected `mesh`, `input`, `param`, `state`",
    );
    assert_error("  param %w: f32[3]\n", "", 3, "%w", "unknown value `%w`");
    assert_error(
        "%2: f32[2,3] = rms",
        "%2: f32[2,3] ~ rms",
        4,
        "~",
        "unexpected character `~`",
    );
}

#[test]
fn sections_come_in_order() {
    assert_error(
        "  output",
        "  state %y: f32[]\n  output",
        6,
        "state",
        "inputs must be declared before nodes and outputs",
    );
    let src = VALID.replace(
        "  output loss = %3 donates %x\n",
        "  output loss = %3 donates %x\n  input %y: f32[]\n",
    );
    let err = parse(&src).unwrap_err();
    assert_eq!((err.line, err.col), (7, 3));
    assert!(
        err.message.contains("inputs must be declared before"),
        "{err}"
    );
    let src = VALID.replace(
        "  output loss = %3 donates %x\n",
        "  output loss = %3 donates %x\n  %4: f32[3] = exp(%3)\n",
    );
    let err = parse(&src).unwrap_err();
    assert_eq!(
        (err.line, err.col, err.message.as_str()),
        (7, 3, "nodes must come before outputs")
    );
}

#[test]
fn bad_metadata_is_refused() {
    assert_error(
        "# fwd layers.0.norm",
        "# fw layers.0.norm",
        4,
        "fw ",
        "unknown phase `fw`",
    );
    assert_error(
        "# fwd layers.0.norm",
        "# fwd layers.0.norm colour=red",
        4,
        "colour",
        "unknown tag `colour`",
    );
    assert_error(
        "# fwd layers.0.norm",
        "# fwd layers.0.norm remat=never",
        4,
        "never",
        "unknown remat policy `never`",
    );
    assert_error(
        "# fwd layers.0.norm",
        "# fwd layers.0.norm layer=-1",
        4,
        "-1",
        "expected a layer index or `none`",
    );
    assert_error(
        "# fwd layers.0.norm",
        "# fwd layers.0.norm bucket=1 bucket=2",
        4,
        "bucket=2",
        "the tag `bucket` is given twice",
    );
    assert_error(
        "# fwd layers.0.norm",
        "# fwd layers.0.norm stream",
        4,
        END,
        "expected `=` after the tag name `stream`, found end of line",
    );
    assert_error(
        "# fwd layers.0.norm",
        "# fwd =3",
        4,
        "=3",
        "expected a tag `name=value`, found `=`",
    );
    assert_error(
        "# fwd layers.0.norm",
        "#",
        4,
        END,
        "expected a phase (fwd, loss, bwd, opt) after `#`, found end of line",
    );
}

#[test]
fn attribute_errors_point_at_the_attribute() {
    assert_error(
        "axes=[0]",
        "axes=true",
        5,
        "axes",
        "attribute `axes` must be a list",
    );
    assert_error(
        "eps=1e-5",
        "eps=1e-5, eps=1.0",
        4,
        "eps",
        "attribute `eps` given twice",
    );
    assert_error(
        "eps=1e-5",
        "eps=1e-5, beta=2",
        4,
        "beta",
        "unknown attribute `beta`",
    );
    assert_error(
        "eps=1e-5",
        "eps=1e-5, epsilon=1e-5",
        4,
        "epsilon",
        "unknown attribute `epsilon`",
    );
    assert_error(
        "eps=1e-5",
        "epsilon=1e-5",
        4,
        "rms_norm",
        "rms_norm: missing attribute `eps`",
    );
    assert_error(
        "axes=[0]",
        "axes=[0,x]",
        5,
        "x]",
        "expected an integer, found `x`",
    );
    assert_error(
        "eps=1e-5",
        "eps=1.2.3",
        4,
        "1.2.3",
        "invalid number `1.2.3`",
    );
    assert_error(
        "axes=[0]",
        "axes=[99999999999999999999]",
        5,
        "999",
        "integer `99999999999999999999` is out of range",
    );
    assert_error(
        "f32[2,3] =",
        "f32[2,99999999999999999999999] =",
        4,
        "999",
        "is out of range",
    );
}

#[test]
fn garbage_after_the_closing_brace_is_refused() {
    let err = parse(&format!("{VALID}  // fine\nfoo\n")).unwrap_err();
    assert_eq!((err.line, err.col), (9, 1));
    assert_eq!(
        err.message,
        "unexpected `foo` after the graph's closing `}`"
    );
    let err = parse(&VALID.replace("}\n", "} }\n")).unwrap_err();
    assert_eq!((err.line, err.col), (7, 3));
    assert!(parse(&format!("{VALID}\n   // only a comment\n\n")).is_ok());
}

// ---- robustness

#[test]
fn no_input_makes_the_parser_panic() {
    let text = print(&train_step());
    for end in (0..=text.len()).filter(|&i| text.is_char_boundary(i)) {
        let _ = parse(&text[..end]);
        let _ = parse(&text[end..]);
    }
    let garbage = [
        "",
        "}",
        "{",
        "%",
        "graph",
        "graph g",
        "graph g {\n%",
        "graph g {\n  %1: f32[] = (",
        "graph g {\n  %1: f32[",
        "graph g {\n  %1: f32[] = full(value=, shape=[], dtype=f32)\n}",
        "graph g {\n  %1: f32[] = full(value=--1, shape=[-], dtype=-)\n}",
        "graph g {\n  output = \n}",
        "graph g {\n  %1: f32[] = exp(%1) # \n}",
        "graph g {\n  input %é: f32[]\n}",
        "graph g {\r\n  input %x: f32[]\r\n}\r\n",
        "\u{0}\u{feff}💥",
        "graph g {\n  %a: f32[] = full(value=1e999999, shape=[], dtype=f32)\n}",
    ];
    for src in garbage {
        let _ = parse(src);
    }
    // Token soup from the format's own alphabet, and valid text with random spans deleted.
    let alphabet: Vec<char> = "graph{}()[],:=#%/ \n\t-.+_eE0123456789xfi32nput"
        .chars()
        .collect();
    let mut rng = Rng { seed: 99, index: 0 };
    for _ in 0..3000 {
        let len = rng.below(60);
        let soup: String = (0..len).map(|_| rng.pick(&alphabet)).collect();
        let _ = parse(&format!("graph g {{\n{soup}"));
        let a = rng.below(text.len());
        let b = a + rng.below(text.len() - a);
        let _ = parse(&format!("{}{}", &text[..a], &text[b..]));
    }
}
