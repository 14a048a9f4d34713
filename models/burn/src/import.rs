//! `burn_ir::GraphIr` -> graphtrain IR, op by op.
//!
//! Contract:
//! - Parameters become the graph's parameter inputs, named by their burn module paths
//!   (`layers.0.attention.wq.weight`), in burn's visiting order, with burn's layouts (a
//!   `Linear` weight is `[d_in, d_out]`, burn's, not torch's `[out, in]`). Their values are
//!   returned beside the graph (`Imported::initial`).
//! - The captured runtime inputs become data inputs under their names (`tokens`, `targets`,
//!   i32), and the loss (burn's `[1]`) the scalar output `loss`, as a traced model has them.
//! - Nodes are in the forward phase up to the recognised cross-entropy and in the loss phase
//!   from it on, as a traced model's.
//! - Every node carries a module path: the module of the parameter it reads, else that of the
//!   last parameter read before it, cut to its `layers.N` prefix inside a layer (burn's graph
//!   names no modules; parameters are the only names it has). The layer index follows from
//!   the path, as for traced models.
//! - Patterns with a graphtrain composite (`patterns.rs`) become the composite; everything
//!   else translates to primitives. Constants made inside the captured scope (RoPE's tables)
//!   are only accepted inside a recognised pattern: graphtrain has no literal tensors, so a
//!   constant read elsewhere is an error naming the op that reads it.
//! - Declines with an `ImportError` naming the op (burn's variant name), its position in the
//!   captured graph and the module it was attributed to, for any op it does not translate;
//!   shape errors from graphtrain's type inference are reported the same way. Never a panic.

use crate::capture::Captured;
use crate::patterns::{self, Composite};
use burn::tensor::{DType as BurnDType, TensorData};
use burn_ir::{
    ActivationOperationIr, BaseOperationIr, FloatOperationIr, ModuleOperationIr,
    NumericOperationIr, OperationIr, ScalarIr, TensorIr,
};
use graphtrain_ir::trace::{Init, Tensor, Tracer};
use graphtrain_ir::{DType, HostTensor, Op, TensorType, Traced};
use std::collections::{BTreeMap, HashMap};
use std::fmt;

/// Why a captured graph could not be imported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImportError {
    pub message: String,
}

impl ImportError {
    pub fn new(message: impl Into<String>) -> Self {
        ImportError {
            message: message.into(),
        }
    }
}

impl fmt::Display for ImportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ImportError {}

impl From<ImportError> for String {
    fn from(e: ImportError) -> String {
        e.message
    }
}

/// A burn module's loss as a graphtrain forward graph, and its parameters' values.
#[derive(Debug)]
pub struct Imported {
    /// Forward and loss; the output `loss` is a scalar. Parameters carry `Init::Zeros` as a
    /// placeholder: their values are `initial`'s.
    pub traced: Traced,
    /// Each parameter's value when it was captured, by name, in the graph's parameter order.
    pub initial: Vec<(String, HostTensor)>,
    /// The composites recognised, by kind: what the lowering's kernels will run.
    pub composites: BTreeMap<&'static str, usize>,
}

/// What a captured tensor id stands for before any op.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Source {
    Param(String),
    Input(String),
    Constant,
}

/// The captured graph indexed for the pattern matchers.
pub(crate) struct Index<'c> {
    pub ops: &'c [OperationIr],
    /// The op producing each tensor.
    pub producer: HashMap<u64, usize>,
    /// How many ops read each tensor (the loss output counts as one more read).
    pub reads: HashMap<u64, usize>,
    pub sources: HashMap<u64, Source>,
    pub values: &'c BTreeMap<burn::tensor::TensorId, TensorData>,
}

impl Index<'_> {
    /// The op that produced `t`, if an op did (not an input, parameter or constant).
    pub fn producer_of(&self, t: &TensorIr) -> Option<(usize, &OperationIr)> {
        let i = *self.producer.get(&t.id.value())?;
        Some((i, &self.ops[i]))
    }
    pub fn reads_of(&self, t: &TensorIr) -> usize {
        self.reads.get(&t.id.value()).copied().unwrap_or(0)
    }
    pub fn constant(&self, t: &TensorIr) -> Option<Vec<f32>> {
        if self.sources.get(&t.id.value()) != Some(&Source::Constant) {
            return None;
        }
        let data = self.values.get(&t.id)?;
        data.clone().convert::<f32>().try_into_vec::<f32>().ok()
    }
    pub fn param_name(&self, t: &TensorIr) -> Option<&str> {
        match self.sources.get(&t.id.value()) {
            Some(Source::Param(name)) => Some(name),
            _ => None,
        }
    }
}

/// Translates `captured` into graphtrain's IR.
pub fn import(captured: &Captured) -> Result<Imported, ImportError> {
    let ops = &captured.graph.operations;
    let mut sources: HashMap<u64, Source> = HashMap::new();
    for id in captured.values.keys() {
        sources.insert(id.value(), Source::Constant);
    }
    for (id, name) in &captured.params {
        sources.insert(id.value(), Source::Param(name.clone()));
    }
    for (id, name) in &captured.inputs {
        sources.insert(id.value(), Source::Input(name.clone()));
    }
    let mut producer = HashMap::new();
    let mut reads: HashMap<u64, usize> = HashMap::new();
    for (i, op) in ops.iter().enumerate() {
        for t in op.outputs() {
            producer.insert(t.id.value(), i);
        }
        if !matches!(op, OperationIr::Init(_)) {
            for t in op.inputs() {
                *reads.entry(t.id.value()).or_default() += 1;
            }
        }
    }
    let loss = match captured.graph.outputs.as_slice() {
        [one] => *one,
        other => {
            return Err(ImportError::new(format!(
                "the captured graph has {} outputs; the loss must be its only one",
                other.len()
            )))
        }
    };
    *reads.entry(loss.value()).or_default() += 1;
    let index = Index {
        ops,
        producer,
        reads,
        sources,
        values: &captured.values,
    };
    let matches = patterns::find(&index);

    let tr = Tracer::new("burn_train_step");
    let mut vals: HashMap<u64, Tensor<'_>> = HashMap::new();
    let mut initial = Vec::new();
    for (id, name) in &captured.params {
        let data = captured.values.get(id).ok_or_else(|| {
            ImportError::new(format!("parameter `{name}` has no data in the capture"))
        })?;
        let ty = TensorType::new(DType::F32, data.shape().as_slice().to_vec());
        let values = data
            .clone()
            .convert::<f32>()
            .try_into_vec::<f32>()
            .map_err(|e| ImportError::new(format!("parameter `{name}`: {e:?}")))?;
        let host = HostTensor::new(ty.clone(), values.iter().map(|&x| x as f64).collect())
            .map_err(|e| ImportError::new(format!("parameter `{name}`: {e}")))?;
        vals.insert(id.value(), tr.param(name, ty, Init::Zeros));
        initial.push((name.clone(), host));
    }
    for (id, name) in &captured.inputs {
        let data = captured.values.get(id).ok_or_else(|| {
            ImportError::new(format!("input `{name}` has no sample data in the capture"))
        })?;
        let ty = TensorType::new(DType::I32, data.shape().as_slice().to_vec());
        vals.insert(id.value(), tr.input(name, ty));
    }

    let mut composites: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut module = String::new();
    for (i, op) in ops.iter().enumerate() {
        if matches.absorbed.contains(&i) || matches!(op, OperationIr::Init(_)) {
            continue;
        }
        // The module: the first parameter this op (or its pattern) reads, else the last one's.
        let read_param = match matches.roots.get(&i) {
            Some(m) => m.param.clone(),
            None => op
                .inputs()
                .find_map(|t| index.param_name(t).map(str::to_string)),
        };
        let here = match &read_param {
            Some(p) => {
                module = p
                    .rsplit_once('.')
                    .map_or(p.as_str(), |(m, _)| m)
                    .to_string();
                module.clone()
            }
            None => layer_prefix(&module),
        };
        let _scope = (!here.is_empty()).then(|| tr.scope(&here));
        let fail = |why: String| {
            ImportError::new(format!(
                "burn op {} (#{i} of the captured graph, module `{}`): {why}",
                op_name(op),
                if here.is_empty() { "<root>" } else { &here }
            ))
        };
        let get = |t: &TensorIr| -> Result<Tensor<'_>, ImportError> {
            vals.get(&t.id.value()).copied().ok_or_else(|| {
                fail(match index.sources.get(&t.id.value()) {
                    Some(Source::Constant) => format!(
                        "it reads a constant tensor {:?} made inside the captured scope; \
graphtrain imports constants only inside the patterns it recognises (RoPE's tables)",
                        t.shape.as_slice()
                    ),
                    _ => format!("its input t{} was never produced", t.id.value()),
                })
            })
        };
        let (out, value) = if let Some(m) = matches.roots.get(&i) {
            *composites.entry(m.composite.name()).or_default() += 1;
            // From the loss on, nodes are the loss phase's, as a traced model's are.
            if matches!(m.composite, Composite::CrossEntropy { .. }) {
                tr.set_phase(graphtrain_ir::Phase::Loss);
            }
            let out = single_output(op).ok_or_else(|| fail("no single output".into()))?;
            (out, emit_composite(&m.composite, &get).map_err(&fail)?)
        } else {
            let out = single_output(op)
                .ok_or_else(|| fail("graphtrain imports ops with one output".into()))?;
            (out, translate(op, out, &get).map_err(&fail)?)
        };
        let want = out.shape.as_slice();
        if value.shape() != want {
            return Err(fail(format!(
                "graphtrain's result has shape {:?} where burn's has {want:?}",
                value.shape()
            )));
        }
        vals.insert(out.id.value(), value);
    }
    let loss_value = vals
        .get(&loss.value())
        .copied()
        .ok_or_else(|| ImportError::new("the loss was never computed by a translated op"))?;
    let scalar = loss_value
        .reshape(&[])
        .map_err(|e| ImportError::new(format!("the loss must have one element: {e}")))?;
    tr.output("loss", scalar);
    drop(vals);
    Ok(Imported {
        traced: tr.finish(),
        initial,
        composites,
    })
}

/// `layers.3` for any path under `layers.3`; other paths as they are.
fn layer_prefix(module: &str) -> String {
    let mut parts = module.split('.');
    match (parts.next(), parts.next()) {
        (Some(a), Some(b)) if b.parse::<u32>().is_ok() => format!("{a}.{b}"),
        _ => module.to_string(),
    }
}

fn single_output(op: &OperationIr) -> Option<&TensorIr> {
    let mut outs = op.outputs();
    let first = outs.next()?;
    outs.next().is_none().then_some(first)
}

/// burn's name of `op`: its variant path, as `NumericFloat/Mul` or `Module/Attention`.
pub fn op_name(op: &OperationIr) -> String {
    let debug = format!("{op:?}");
    // `Outer(F32, Inner(...))` or `Outer(Inner(...))`: the identifiers before the payload.
    let mut names = Vec::new();
    for token in debug.split(['(', ',', ' ']).filter(|t| !t.is_empty()) {
        let is_dtype = matches!(
            token,
            "F64" | "F32" | "F16" | "BF16" | "I64" | "I32" | "I16" | "I8" | "U64" | "U32"
        );
        if is_dtype {
            continue;
        }
        if token.starts_with(|c: char| c.is_ascii_uppercase())
            && token.chars().all(|c| c.is_ascii_alphanumeric())
            && !token.ends_with("Ir")
        {
            names.push(token);
            if names.len() == 2 {
                break;
            }
        } else {
            break;
        }
    }
    names.join("/")
}

fn dtype_of(t: &TensorIr) -> Result<DType, String> {
    Ok(match t.dtype {
        BurnDType::F32 => DType::F32,
        BurnDType::F64 => DType::F64,
        BurnDType::BF16 => DType::BF16,
        BurnDType::I32 | BurnDType::I64 => DType::I32,
        BurnDType::Bool(_) => DType::Bool,
        other => return Err(format!("element type {other:?} has no graphtrain type")),
    })
}

fn scalar(s: &ScalarIr) -> f64 {
    match s {
        ScalarIr::Float(x) => *x,
        ScalarIr::Int(x) => *x as f64,
        ScalarIr::UInt(x) => *x as f64,
        ScalarIr::Bool(b) => f64::from(u8::from(*b)),
    }
}

type Get<'a, 't> = dyn Fn(&TensorIr) -> Result<Tensor<'t>, ImportError> + 'a;

fn emit_composite<'t>(c: &Composite, get: &Get<'_, 't>) -> Result<Tensor<'t>, String> {
    let g = |t: &TensorIr| get(t).map_err(|e| e.message);
    let e = |e: graphtrain_ir::TypeError| e.to_string();
    match c {
        Composite::RmsNorm { x, gamma, eps } => g(x)?.rms_norm(g(gamma)?, *eps).map_err(e),
        Composite::Silu { x } => g(x)?.silu().map_err(e),
        Composite::Rope { x, theta } => {
            // graphtrain's rope is [B, S, H, D]; burn's input is [B, H, S, D].
            let swapped = g(x)?.transpose(&[0, 2, 1, 3]).map_err(e)?;
            let rotated = swapped
                .rope(*theta, graphtrain_ir::RopeLayout::Interleaved)
                .map_err(e)?;
            rotated.transpose(&[0, 2, 1, 3]).map_err(e)
        }
        Composite::CrossEntropy { logits, targets } => {
            let loss = g(logits)?.cross_entropy(g(targets)?).map_err(e)?;
            loss.reshape(&[1]).map_err(e)
        }
    }
}

/// `x` broadcast to `shape` (same rank; burn inserts the reshapes that change rank).
fn broadcast<'t>(x: Tensor<'t>, shape: &[usize]) -> Result<Tensor<'t>, String> {
    if x.shape() == shape {
        return Ok(x);
    }
    x.expand(shape).map_err(|e| e.to_string())
}

/// A reduction over `axes` into burn's kept-dimension shape, as a sum or a mean.
fn reduce<'t>(
    x: Tensor<'t>,
    axes: &[usize],
    out: &[usize],
    mean: bool,
) -> Result<Tensor<'t>, String> {
    let e = |e: graphtrain_ir::TypeError| e.to_string();
    let count: usize = axes.iter().map(|&a| x.shape()[a]).product();
    let summed = x.sum(axes, false).map_err(e)?.reshape(out).map_err(e)?;
    if mean {
        summed.mul_scalar(1.0 / count as f64).map_err(e)
    } else {
        Ok(summed)
    }
}

fn translate<'t>(
    op: &OperationIr,
    out: &TensorIr,
    get: &Get<'_, 't>,
) -> Result<Tensor<'t>, String> {
    let g = |t: &TensorIr| get(t).map_err(|e| e.message);
    let e = |e: graphtrain_ir::TypeError| e.to_string();
    let out_shape = out.shape.as_slice().to_vec();
    let unsupported = || Err("graphtrain does not translate this op".to_string());
    match op {
        OperationIr::BaseFloat(b) | OperationIr::BaseInt(b) | OperationIr::BaseBool(b) => match b {
            BaseOperationIr::Reshape(r) => g(&r.input)?.reshape(&out_shape).map_err(e),
            BaseOperationIr::SwapDims(s) => {
                let mut perm: Vec<usize> = (0..s.input.shape.num_dims()).collect();
                perm.swap(s.dim1, s.dim2);
                g(&s.input)?.transpose(&perm).map_err(e)
            }
            BaseOperationIr::Permute(p) => g(&p.input)?.transpose(&p.axes).map_err(e),
            BaseOperationIr::Expand(r) => {
                let x = g(&r.input)?;
                let rank = out_shape.len();
                let shape = x.shape();
                let x = if shape.len() < rank {
                    let mut padded = vec![1; rank - shape.len()];
                    padded.extend(shape);
                    x.reshape(&padded).map_err(e)?
                } else {
                    x
                };
                broadcast(x, &out_shape)
            }
            BaseOperationIr::Slice(s) => {
                let mut x = g(&s.tensor)?;
                for (axis, range) in s.ranges.iter().enumerate() {
                    let size = x.shape()[axis] as isize;
                    let resolve = |i: isize| {
                        if i < 0 {
                            (size + i).max(0)
                        } else {
                            i.min(size)
                        }
                    };
                    let start = resolve(range.start) as usize;
                    let end = resolve(range.end.unwrap_or(size)) as usize;
                    if range.step != 1 {
                        return Err(format!("a slice with step {} (only step 1)", range.step));
                    }
                    if start == 0 && end == size as usize {
                        continue;
                    }
                    x = x.apply(Op::Slice { axis, start, end }, &[]).map_err(e)?;
                }
                Ok(x)
            }
            BaseOperationIr::Gather(gather) => g(&gather.tensor)?
                .apply(Op::Gather { axis: gather.dim }, &[g(&gather.indices)?])
                .map_err(e),
            BaseOperationIr::Cast(c) => g(&c.input)?.cast(dtype_of(&c.out)?).map_err(e),
            BaseOperationIr::Cat(c) => {
                let parts = c.tensors.iter().map(g).collect::<Result<Vec<_>, _>>()?;
                let (first, rest) = parts
                    .split_first()
                    .ok_or_else(|| "a concatenation of nothing".to_string())?;
                first.apply(Op::Concat { axis: c.dim }, rest).map_err(e)
            }
            _ => unsupported(),
        },
        OperationIr::NumericFloat(_, n) => match n {
            NumericOperationIr::Add(b)
            | NumericOperationIr::Sub(b)
            | NumericOperationIr::Mul(b)
            | NumericOperationIr::Div(b) => {
                let lhs = broadcast(g(&b.lhs)?, &out_shape)?;
                let rhs = broadcast(g(&b.rhs)?, &out_shape)?;
                match n {
                    NumericOperationIr::Add(_) => lhs.add(rhs),
                    NumericOperationIr::Sub(_) => lhs.sub(rhs),
                    NumericOperationIr::Mul(_) => lhs.mul(rhs),
                    _ => lhs.div(rhs),
                }
                .map_err(e)
            }
            NumericOperationIr::AddScalar(s) => g(&s.lhs)?.add_scalar(scalar(&s.rhs)).map_err(e),
            NumericOperationIr::SubScalar(s) => g(&s.lhs)?.add_scalar(-scalar(&s.rhs)).map_err(e),
            NumericOperationIr::MulScalar(s) => g(&s.lhs)?.mul_scalar(scalar(&s.rhs)).map_err(e),
            NumericOperationIr::DivScalar(s) => {
                g(&s.lhs)?.mul_scalar(1.0 / scalar(&s.rhs)).map_err(e)
            }
            NumericOperationIr::Neg(u) => g(&u.input)?.neg().map_err(e),
            NumericOperationIr::Abs(u) => g(&u.input)?
                .apply(Op::Unary(graphtrain_ir::UnaryOp::Abs), &[])
                .map_err(e),
            NumericOperationIr::SumDim(r) => reduce(g(&r.input)?, &[r.axis], &out_shape, false),
            NumericOperationIr::MeanDim(r) => reduce(g(&r.input)?, &[r.axis], &out_shape, true),
            NumericOperationIr::Sum(r) | NumericOperationIr::Mean(r) => {
                let x = g(&r.input)?;
                let axes: Vec<usize> = (0..x.shape().len()).collect();
                reduce(
                    x,
                    &axes,
                    &out_shape,
                    matches!(n, NumericOperationIr::Mean(_)),
                )
            }
            _ => unsupported(),
        },
        OperationIr::Float(_, f) => {
            let unary = |u: &burn_ir::UnaryOpIr, op: graphtrain_ir::UnaryOp| {
                g(&u.input)?.apply(Op::Unary(op), &[]).map_err(e)
            };
            use graphtrain_ir::UnaryOp as U;
            match f {
                FloatOperationIr::Exp(u) => unary(u, U::Exp),
                FloatOperationIr::Log(u) => unary(u, U::Log),
                FloatOperationIr::Sqrt(u) => unary(u, U::Sqrt),
                FloatOperationIr::Cos(u) => unary(u, U::Cos),
                FloatOperationIr::Sin(u) => unary(u, U::Sin),
                FloatOperationIr::Tanh(u) => unary(u, U::Tanh),
                FloatOperationIr::Recip(u) => unary(u, U::Recip),
                FloatOperationIr::PowfScalar(s) => g(&s.lhs)?
                    .apply(
                        Op::PowScalar {
                            exponent: scalar(&s.rhs),
                        },
                        &[],
                    )
                    .map_err(e),
                FloatOperationIr::Matmul(m) => {
                    // Batch dimensions broadcast (burn's rule); the matrices are the last two.
                    let (lhs, rhs) = (g(&m.lhs)?, g(&m.rhs)?);
                    let rank = out_shape.len();
                    let batch = &out_shape[..rank - 2];
                    let widen = |x: Tensor<'t>| -> Result<Tensor<'t>, String> {
                        let s = x.shape();
                        let mut want = batch.to_vec();
                        want.extend_from_slice(&s[rank - 2..]);
                        broadcast(x, &want)
                    };
                    widen(lhs)?.matmul(widen(rhs)?).map_err(e)
                }
                _ => unsupported(),
            }
        }
        OperationIr::Activation(a) => match a {
            ActivationOperationIr::Sigmoid(u) => g(&u.input)?
                .apply(Op::Unary(graphtrain_ir::UnaryOp::Sigmoid), &[])
                .map_err(e),
            ActivationOperationIr::Softmax(d) => g(&d.input)?.softmax(d.axis).map_err(e),
            ActivationOperationIr::LogSoftmax(d) => g(&d.input)?.log_softmax(d.axis).map_err(e),
            _ => unsupported(),
        },
        OperationIr::Module(m) => match m {
            ModuleOperationIr::Embedding(em) => {
                g(&em.weights)?.embedding(g(&em.indices)?).map_err(e)
            }
            ModuleOperationIr::Attention(at) => {
                if at.mask.is_some() || at.attn_bias.is_some() || at.options.softcap.is_some() {
                    return Err(
                        "attention with a mask, a bias or a softcap (graphtrain's attention is \
causal or full, unbiased)"
                            .into(),
                    );
                }
                let (q, k, v) = (g(&at.query)?, g(&at.key)?, g(&at.value)?);
                let head_dim = *q.shape().last().unwrap_or(&1) as f64;
                let scale = at
                    .options
                    .scale
                    .as_ref()
                    .map_or(1.0 / head_dim.sqrt(), scalar);
                q.attention(k, v, at.options.is_causal, scale).map_err(e)
            }
            _ => unsupported(),
        },
        _ => unsupported(),
    }
}
