//! Forward-only runs of a model that is being (or was) trained: the validation loss on held-out
//! batches, and logits for sampling.
//!
//! Contract:
//! - The graph is traced from the same `Llama3Config` as the train step (`trace` for the loss,
//!   `trace_logits` for sampling): no backward, no optimizer. Parameters have the train step's
//!   names and types, and `load_params` copies them in by name before each use, so a validation
//!   sees exactly the weights the last completed step left.
//! - It compiles through the one driver (`graphtrain_runtime::compile`) for the same backend as
//!   training, with no passes: the pipeline's passes are chosen for the train step (checkpointing
//!   and offload act on backward), and legalization's `cse,dce` still runs.
//! - A parameter the source does not have, or has with another type, is an error naming it; a
//!   non-finite validation loss is an error naming the batch, never averaged in.

use crate::data::tokenizer::TextTokenizer;
use crate::data::Batch;
use crate::trainer::{TrainError, Trainer};
use graphtrain_ir::{rng, DType, Graph, HostTensor, InputKind, ValueId};
use graphtrain_lowering::Mode;
use graphtrain_models::Llama3Config;
use graphtrain_passes::Pipeline;
use graphtrain_runtime::{compile, Backend, CompileOptions, Executor, RuntimeOptions, SingleRank};

fn err(e: impl std::fmt::Display) -> TrainError {
    TrainError(e.to_string())
}

/// A compiled forward graph and its executor.
pub struct Forward {
    exec: Box<dyn Executor>,
    /// `(name, value)` of every parameter input, in the executor's graph.
    params: Vec<(String, ValueId)>,
    tokens: ValueId,
    targets: Option<ValueId>,
    output: ValueId,
    batch: usize,
    seq: usize,
}

impl Forward {
    /// The forward pass and mean cross-entropy for `model`'s own batch shape: validation.
    pub fn validation(
        model: &Llama3Config,
        backend: Backend,
        runtime: &RuntimeOptions,
    ) -> Result<Self, TrainError> {
        let traced = model
            .trace(DType::F32)
            .map_err(|e| err(format!("tracing the validation graph failed: {e}")))?;
        Self::compile(traced.graph, backend, runtime, model.batch, model.seq_len)
    }

    /// The forward pass to logits for `batch` rows of `seq` tokens: sampling.
    pub fn logits(
        model: &Llama3Config,
        batch: usize,
        seq: usize,
        backend: Backend,
        runtime: &RuntimeOptions,
    ) -> Result<Self, TrainError> {
        let traced = model
            .trace_logits(DType::F32, batch, seq)
            .map_err(|e| err(format!("tracing the sampling graph failed: {e}")))?;
        Self::compile(traced.graph, backend, runtime, batch, seq)
    }

    fn compile(
        graph: Graph,
        backend: Backend,
        runtime: &RuntimeOptions,
        batch: usize,
        seq: usize,
    ) -> Result<Self, TrainError> {
        graphtrain_ir::verify(&graph)
            .map_err(|e| err(format!("the forward graph fails verification: {e}")))?;
        let no_passes = Pipeline::new(Vec::new());
        let mut options = CompileOptions::new(&no_passes, Mode::Fused);
        options.runtime = runtime.clone();
        let compiled = compile(&graph, backend, &options).map_err(err)?;
        let exec = compiled.load(Box::new(SingleRank)).map_err(err)?;
        let g = exec.graph();
        let input = |name: &str| g.inputs.iter().find(|i| i.name == name).map(|i| i.value);
        let tokens = input("tokens").ok_or_else(|| err("the forward graph has no `tokens`"))?;
        let targets = input("targets");
        let output = g
            .outputs
            .first()
            .map(|o| o.value)
            .ok_or_else(|| err("the forward graph has no output"))?;
        let params = g
            .inputs
            .iter()
            .filter(|i| i.kind == InputKind::Param)
            .map(|i| (i.name.clone(), i.value))
            .collect();
        Ok(Forward {
            exec,
            params,
            tokens,
            targets,
            output,
            batch,
            seq,
        })
    }

    /// Names of the parameters the forward pass reads.
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.params.iter().map(|(n, _)| n.as_str())
    }

    /// Writes every parameter from `source` (by name).
    pub fn load_params<'a>(
        &mut self,
        mut source: impl FnMut(&str) -> Option<&'a HostTensor>,
    ) -> Result<(), TrainError> {
        for (name, value) in &self.params {
            let want = self.exec.graph().ty(*value).clone();
            let t = source(name).ok_or_else(|| {
                err(format!(
                    "the forward pass needs parameter `{name}`, which the weights do not have"
                ))
            })?;
            if t.ty != want {
                return Err(err(format!(
                    "parameter `{name}` is {}, the forward pass needs {want}",
                    t.ty
                )));
            }
            self.exec.write(*value, t).map_err(err)?;
        }
        Ok(())
    }

    fn write_tokens(&mut self, value: ValueId, ids: &[i64]) -> Result<(), TrainError> {
        let ty = self.exec.graph().ty(value).clone();
        if ids.len() != ty.numel() {
            return Err(err(format!(
                "{} token ids for an input of {} ({} expected)",
                ids.len(),
                ty,
                ty.numel()
            )));
        }
        let t = HostTensor::new(ty, ids.iter().map(|&i| i as f64).collect()).map_err(err)?;
        self.exec.write(value, &t).map_err(err)
    }

    /// The mean cross-entropy of one batch (validation graphs only).
    pub fn loss(&mut self, batch: &Batch) -> Result<f64, TrainError> {
        let targets = self
            .targets
            .ok_or_else(|| err("this forward graph computes logits, not a loss"))?;
        self.write_tokens(self.tokens, &batch.tokens)?;
        self.write_tokens(targets, &batch.targets)?;
        self.exec.run().map_err(err)?;
        Ok(self.exec.read(self.output).map_err(err)?.data[0])
    }

    /// Logits `[batch, seq, vocab]` for `tokens` (`batch * seq` ids, row-major).
    pub fn run_logits(&mut self, tokens: &[i64]) -> Result<HostTensor, TrainError> {
        if self.targets.is_some() {
            return Err(err("this forward graph computes a loss, not logits"));
        }
        self.write_tokens(self.tokens, tokens)?;
        self.exec.run().map_err(err)?;
        self.exec.read(self.output).map_err(err)
    }

    /// Rows and tokens per row of one run.
    pub fn shape(&self) -> (usize, usize) {
        (self.batch, self.seq)
    }
}

/// Validation loss over `batches`: the mean of the batches' mean cross-entropies (every batch
/// holds the same number of tokens, so this is the mean over tokens), and its perplexity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Validation {
    pub loss: f64,
    pub perplexity: f64,
    pub batches: usize,
}

/// Runs `forward` (a validation graph with parameters loaded) over `batches`.
pub fn validate(forward: &mut Forward, batches: &[Batch]) -> Result<Validation, TrainError> {
    if batches.is_empty() {
        return Err(err("no validation batches"));
    }
    let mut sum = 0.0;
    for (i, b) in batches.iter().enumerate() {
        let loss = forward.loss(b)?;
        if !loss.is_finite() {
            return Err(err(format!(
                "validation batch {i} of {}: loss is {loss}",
                batches.len()
            )));
        }
        sum += loss;
    }
    let loss = sum / batches.len() as f64;
    Ok(Validation {
        loss,
        perplexity: loss.exp(),
        batches: batches.len(),
    })
}

/// How the next token is drawn from the logits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0 picks the most likely token (greedy); otherwise logits are divided by it.
    pub temperature: f64,
    /// Only the `top_k` most likely tokens are kept (0 keeps all).
    pub top_k: usize,
    pub seed: u64,
}

/// Stream of the sampler's uniform draws, apart from data and parameter streams.
const SAMPLE_STREAM: u64 = 0x5A3E;

/// Draws a token from one row of logits; `draw` numbers the draw within the seed's stream, so a
/// generation is a pure function of (weights, prompt, sampling).
pub fn sample(logits: &[f64], s: &Sampling, draw: u64) -> Result<usize, TrainError> {
    if logits.is_empty() {
        return Err(err("no logits to sample from"));
    }
    if let Some(i) = logits.iter().position(|l| !l.is_finite()) {
        return Err(err(format!("logit {i} is {}", logits[i])));
    }
    if !(s.temperature >= 0.0 && s.temperature.is_finite()) {
        return Err(err(format!(
            "the temperature must be zero or positive, got {}",
            s.temperature
        )));
    }
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Highest first; ties by id so the order is total and reproducible.
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if s.temperature == 0.0 {
        return Ok(order[0]);
    }
    let keep = if s.top_k == 0 {
        order.len()
    } else {
        s.top_k.min(order.len())
    };
    let top = logits[order[0]];
    let weights: Vec<f64> = order[..keep]
        .iter()
        .map(|&i| ((logits[i] - top) / s.temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng::uniform(s.seed, SAMPLE_STREAM, draw) * total;
    for (&i, w) in order[..keep].iter().zip(&weights) {
        if u < *w {
            return Ok(i);
        }
        u -= w;
    }
    Ok(order[keep - 1])
}

/// Continues `prompt` by `new_tokens` tokens with `forward` (a logits graph of one row, with
/// parameters loaded), drawn among ids below `allowed` (a tokenizer smaller than the model's
/// vocabulary cannot decode the rest, whose embedding rows never trained; `None`: every id).
/// The context is the last `seq` tokens; shorter contexts are padded on the right, which causal
/// attention never lets the real positions see.
pub fn generate(
    forward: &mut Forward,
    prompt: &[i64],
    new_tokens: usize,
    sampling: &Sampling,
    allowed: Option<usize>,
) -> Result<Vec<i64>, TrainError> {
    let (rows, seq) = forward.shape();
    if rows != 1 {
        return Err(err("sampling runs a forward graph of one row"));
    }
    if prompt.is_empty() {
        return Err(err(
            "the prompt is empty: give at least one token (an empty text encodes to none)",
        ));
    }
    let mut tokens = prompt.to_vec();
    for draw in 0..new_tokens as u64 {
        let start = tokens.len().saturating_sub(seq);
        let context = &tokens[start..];
        let mut row = context.to_vec();
        row.resize(seq, 0);
        let logits = forward.run_logits(&row)?;
        let vocab = logits.ty.shape[2];
        let drawn = allowed.map_or(vocab, |a| a.clamp(1, vocab));
        let last = context.len() - 1;
        let next = sample(
            &logits.data[last * vocab..last * vocab + drawn],
            sampling,
            draw,
        )?;
        tokens.push(next as i64);
    }
    Ok(tokens[prompt.len()..].to_vec())
}

/// Writes `forward`'s parameters from `params` (name, value) pairs.
pub fn load_named(
    forward: &mut Forward,
    params: &[(String, HostTensor)],
) -> Result<(), TrainError> {
    let by_name: std::collections::HashMap<&str, &HostTensor> =
        params.iter().map(|(n, t)| (n.as_str(), t)).collect();
    forward.load_params(|name| by_name.get(name).copied())
}

/// Validation during a run: the forward graph, the held-out batches, and how often.
pub struct Validator {
    forward: Forward,
    batches: Vec<Batch>,
    every: u64,
}

impl Validator {
    /// Validates every `every` steps (and after the last) on the first `max_batches` held-out
    /// batches of `trainer`'s data (all of them when `max_batches` is 0).
    pub fn new(
        trainer: &Trainer,
        backend: Backend,
        runtime: &RuntimeOptions,
        every: u64,
        max_batches: usize,
    ) -> Result<Self, TrainError> {
        let mut batches = trainer.val_batches()?;
        if max_batches > 0 {
            batches.truncate(max_batches);
        }
        Ok(Validator {
            forward: Forward::validation(&trainer.model, backend, runtime)?,
            batches,
            every,
        })
    }

    /// Held-out batches one validation runs.
    pub fn batches(&self) -> usize {
        self.batches.len()
    }

    /// Whether step `step` of a run that ends at `last` is followed by a validation.
    pub fn due(&self, step: u64, last: u64) -> bool {
        step == last || (self.every > 0 && step.is_multiple_of(self.every))
    }

    /// The validation loss of `trainer`'s current weights.
    pub fn run(&mut self, trainer: &mut Trainer) -> Result<Validation, TrainError> {
        let params = trainer.parameters()?;
        load_named(&mut self.forward, &params)?;
        validate(&mut self.forward, &self.batches)
    }
}

/// Continues `prompt` (text) by `new_tokens` tokens from the weights in `params` and returns the
/// new text.
pub fn sample_text(
    model: &Llama3Config,
    params: &[(String, HostTensor)],
    tokenizer: &TextTokenizer,
    prompt: &str,
    new_tokens: usize,
    sampling: &Sampling,
    (backend, runtime): (Backend, &RuntimeOptions),
) -> Result<String, TrainError> {
    let ids: Vec<i64> = tokenizer
        .encode(prompt)
        .map_err(err)?
        .into_iter()
        .map(i64::from)
        .collect();
    if let Some(&too_big) = ids.iter().find(|&&i| i as usize >= model.vocab_size) {
        return Err(err(format!(
            "the prompt encodes to token {too_big}, outside the model's vocabulary of {}: the tokenizer does not match the model",
            model.vocab_size
        )));
    }
    let mut forward = Forward::logits(model, 1, model.seq_len, backend, runtime)?;
    load_named(&mut forward, params)?;
    let out = generate(
        &mut forward,
        &ids,
        new_tokens,
        sampling,
        Some(tokenizer.vocab_size()),
    )?;
    let out: Vec<u32> = out.into_iter().map(|t| t as u32).collect();
    tokenizer.decode(&out).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            seed: 0,
        }
    }

    #[test]
    fn greedy_takes_the_largest_logit_and_the_lowest_id_on_ties() {
        assert_eq!(sample(&[0.1, 3.0, -2.0, 3.0], &greedy(), 0).unwrap(), 1);
    }

    #[test]
    fn top_k_never_draws_outside_the_k_most_likely() {
        let logits = [5.0, 4.9, 4.8, -1.0, 4.7];
        let s = Sampling {
            temperature: 10.0,
            top_k: 2,
            seed: 3,
        };
        let mut seen = [0usize; 5];
        for draw in 0..2000 {
            seen[sample(&logits, &s, draw).unwrap()] += 1;
        }
        assert_eq!(seen[2] + seen[3] + seen[4], 0, "{seen:?}");
        // At a high temperature the two kept tokens are close to equally likely.
        assert!(seen[0] > 800 && seen[1] > 800, "{seen:?}");
    }

    #[test]
    fn sampling_follows_the_softmax() {
        // p = softmax([ln 1, ln 3]) = [0.25, 0.75] at temperature 1.
        let logits = [0.0, 3f64.ln()];
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            seed: 11,
        };
        let n = 20_000;
        let ones = (0..n)
            .filter(|&d| sample(&logits, &s, d).unwrap() == 1)
            .count();
        let p = ones as f64 / n as f64;
        assert!((p - 0.75).abs() < 0.015, "p(1) = {p}");
    }

    #[test]
    fn bad_logits_and_temperatures_are_refused() {
        assert!(sample(&[0.0, f64::NAN], &greedy(), 0)
            .unwrap_err()
            .0
            .contains("logit 1 is NaN"));
        let s = Sampling {
            temperature: -1.0,
            ..greedy()
        };
        assert!(sample(&[0.0], &s, 0).unwrap_err().0.contains("temperature"));
        assert!(sample(&[], &greedy(), 0).is_err());
    }
}
