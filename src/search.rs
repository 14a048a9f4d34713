//! `graphtrain search`: the pass-search loop (`graphtrain-autoresearch`) driving this machine:
//! each candidate pipeline's optimized graph is fingerprinted (a graph measured once), gated on
//! numerics against the unoptimized step on the `cpu` backend (bitwise for tier 1), and timed
//! against the incumbent in interleaved pairs of real training steps, both compiled in this
//! process. The best pipeline is written as a RON file `run --pipeline` takes.
//!
//! Each candidate is predicted first from its optimized graph: the buffer planner's arena (the
//! peak `--memory-cap` bounds), FLOPs and node count (the pre-filter).
//!
//! Not yet: a supervised worker process per candidate (a crash of a candidate ends the search,
//! logged up to the experiment before), meshes, and lowering or runtime knobs (kernel block
//! sizes, threads) in the search space.

use crate::bench;
use crate::cli::ARENA_ALIGNMENT;
use crate::cli::{trainer_for, TrainArgs};
use crate::trainer::{build_step, Trainer};
use graphtrain_autoresearch::search::{Objective, Prediction};
use graphtrain_ir::optim::OptimConfig;
use graphtrain_ir::stats::GraphStats;
use graphtrain_ir::{DType, Graph};
use graphtrain_lowering::plan_buffers;
use graphtrain_models::Llama3Config;
use graphtrain_passes::{Pipeline, PipelineSpec, Registry};
use graphtrain_runtime::{Backend, Fingerprint};

/// Candidates measured as they would train here.
pub struct Measured<'a> {
    args: &'a TrainArgs,
    registry: &'a Registry,
    model: Llama3Config,
    /// The unoptimized train step, which every candidate's pipeline rewrites.
    step: Graph,
    numerics_steps: u64,
    warmup: u64,
    /// Compiled steps by pipeline (and a second copy for the incumbent against itself), the
    /// most recently used last; at most `HELD`.
    held: Vec<(String, Trainer)>,
}

const HELD: usize = 3;

impl<'a> Measured<'a> {
    pub fn new(
        args: &'a TrainArgs,
        registry: &'a Registry,
        model: Llama3Config,
        optim: &OptimConfig,
        numerics_steps: u64,
        warmup: u64,
    ) -> Result<Measured<'a>, String> {
        let step = build_step(&model, DType::F32, optim)
            .map_err(|e| e.to_string())?
            .step
            .graph;
        Ok(Measured {
            args,
            registry,
            model,
            step,
            numerics_steps,
            warmup,
            held: Vec::new(),
        })
    }

    fn pipeline(&self, list: &str) -> Result<Pipeline, String> {
        PipelineSpec::parse_list(list)?.build(self.registry)
    }

    /// The compiled step for `key` (a pipeline, or `PIPELINE#2`), and whether it is new.
    fn take(&mut self, key: &str) -> Result<(Trainer, bool), String> {
        if let Some(i) = self.held.iter().position(|(k, _)| k == key) {
            return Ok((self.held.remove(i).1, false));
        }
        let list = key.split('#').next().unwrap_or(key);
        Ok((trainer_for(self.args, self.pipeline(list)?)?, true))
    }

    fn give_back(&mut self, key: String, trainer: Trainer) {
        self.held.push((key, trainer));
        while self.held.len() > HELD {
            self.held.remove(0);
        }
    }
}

impl Objective for Measured<'_> {
    fn predict(&mut self, list: &str) -> Result<Prediction, String> {
        let pipeline = self.pipeline(list)?;
        let (optimized, _) = pipeline.run(&self.step).map_err(|e| e.to_string())?;
        let stats = GraphStats::of(&optimized);
        Ok(Prediction {
            fingerprint: Fingerprint::of(&optimized).to_string(),
            peak_bytes: plan_buffers(&optimized, ARENA_ALIGNMENT).arena_bytes as u64,
            flops: stats.flops,
            nodes: stats.nodes,
        })
    }

    fn numerics(&mut self, list: &str) -> Result<(), String> {
        let pipeline = self.pipeline(list)?;
        crate::gate::check_pipeline_on(&self.model, &pipeline, self.numerics_steps, Backend::Cpu)
    }

    fn pairs(
        &mut self,
        incumbent: &str,
        candidate: &str,
        k: usize,
    ) -> Result<Vec<(f64, f64)>, String> {
        let key_b = if incumbent == candidate {
            format!("{candidate}#2")
        } else {
            candidate.to_string()
        };
        let (mut a, fresh_a) = self.take(incumbent)?;
        let (mut b, fresh_b) = self.take(&key_b)?;
        let warmup = if fresh_a || fresh_b { self.warmup } else { 0 };
        let run = bench::paired(
            &mut a,
            &mut b,
            warmup,
            k as u64,
            ("llama3", "", "cpu"),
            (incumbent, candidate),
            |_, _, _| {},
        );
        self.give_back(incumbent.to_string(), a);
        self.give_back(key_b, b);
        let s = run?;
        Ok(s.baseline_step_times_s
            .into_iter()
            .zip(s.candidate_step_times_s)
            .collect())
    }
}
