//! `search --objective sim:HARDWARE`: the search loop's `Objective` answered by the simulator,
//! so a search can choose passes for a machine it cannot touch.
//!
//! - predictions: the candidate's lowered Program (fingerprint, planned arena, FLOPs, launches),
//!   as the measured objective gives them;
//! - pairs: the simulated step times of incumbent and candidate, the same every time (the
//!   simulator has no noise, so the keep rule's interval is the ratio itself and a candidate is
//!   kept when it is predicted faster by more than `--min-effect`);
//! - numerics: the model's own step is too large to run here, so the numerics gate runs the
//!   candidate on `tiny` with the cpu backend, on the search's mesh when `tiny` splits over it
//!   (batch set to the data-parallel size; its 4 heads and 2 KV heads over `tp`), else on one
//!   device. The passes are the same; the model is not: this checks what a pass does to a
//!   graph, not the large model's numerics.

use super::hardware::Hardware;
use super::{lower_for, simulate, Links};
use crate::trainer::{Launch, MeshRun};
use crate::tuning::Tuning;
use graphtrain_autoresearch::search::{Failure, Objective, Prediction};
use graphtrain_ir::autocast::Precision;
use graphtrain_ir::stats::GraphStats;
use graphtrain_ir::Graph;
use graphtrain_models::Llama3Config;
use graphtrain_passes::parallelize::Plan;
use graphtrain_passes::{Pipeline, PipelineSpec, Registry};
use graphtrain_runtime::{Backend, Fingerprint};
use std::collections::HashMap;

pub struct Simulated<'a> {
    registry: &'a Registry,
    hardware: Hardware,
    links: Links,
    nodes: usize,
    /// The model's train step, on the search's mesh when it has one.
    step: Graph,
    precision: Precision,
    /// Where the numerics gate runs: `tiny`, on a mesh of threads when it splits over it.
    gate_model: Llama3Config,
    gate_mesh: Option<MeshRun>,
    /// Simulated step seconds per candidate.
    times: HashMap<String, f64>,
}

impl<'a> Simulated<'a> {
    pub fn new(
        registry: &'a Registry,
        hardware: Hardware,
        links: Links,
        nodes: usize,
        step: Graph,
        precision: Precision,
    ) -> Result<Simulated<'a>, String> {
        let mut gate_model = Llama3Config::builtin("tiny").ok_or("the tiny config is missing")?;
        let gate_mesh = step.mesh.as_ref().and_then(|mesh| {
            let tp = mesh.size_of("tp");
            let dp = mesh.size_of("dp_replicate") * mesh.size_of("dp_shard");
            let splits = gate_model.n_heads % tp == 0 && gate_model.n_kv_heads % tp == 0;
            // A mesh of threads, one per rank: kept small enough to run here.
            (splits && mesh.world_size() <= 8).then(|| {
                gate_model.batch = dp.max(1);
                MeshRun {
                    plan: Plan::llama(mesh),
                    mesh: mesh.clone(),
                    threads_per_rank: 1,
                    launch: Launch::Threads,
                    links: Vec::new(),
                }
            })
        });
        Ok(Simulated {
            registry,
            hardware,
            links,
            nodes,
            step,
            precision,
            gate_model,
            gate_mesh,
            times: HashMap::new(),
        })
    }

    /// Where the numerics gate runs, for the search's opening lines.
    pub fn gate_description(&self) -> String {
        match (&self.gate_mesh, &self.step.mesh) {
            (Some(run), _) => format!("tiny on {} (threads, cpu)", run.mesh),
            (None, Some(mesh)) => format!(
                "tiny on one device (cpu): it does not split over {mesh} here (4 heads, 2 KV heads, at most 8 ranks)"
            ),
            (None, None) => "tiny on one device (cpu)".into(),
        }
    }

    fn pipeline(&self, candidate: &str) -> Result<Pipeline, String> {
        let (passes, settings) = crate::tuning::split(candidate);
        if !settings.is_empty() {
            return Err(format!(
                "settings (`{settings}`) are this machine's; the simulator does not model them"
            ));
        }
        PipelineSpec::parse_list(&passes)?.build(self.registry)
    }

    fn step_seconds(&mut self, candidate: &str) -> Result<f64, Failure> {
        if let Some(t) = self.times.get(candidate) {
            return Ok(*t);
        }
        let pipeline = self.pipeline(candidate)?;
        let program = lower_for(&self.step, &pipeline, &self.hardware)?;
        let t = simulate(&program, &self.hardware, self.links, self.nodes)?.step_s;
        self.times.insert(candidate.to_string(), t);
        Ok(t)
    }
}

impl Objective for Simulated<'_> {
    fn predict(&mut self, candidate: &str) -> Result<Prediction, Failure> {
        let pipeline = self.pipeline(candidate)?;
        let program = lower_for(&self.step, &pipeline, &self.hardware)?;
        // Its step time too, while the Program is at hand: the pairs then lower nothing again.
        let t = simulate(&program, &self.hardware, self.links, self.nodes)?.step_s;
        self.times.insert(candidate.to_string(), t);
        Ok(Prediction {
            fingerprint: Fingerprint::of(&program.graph).to_string(),
            peak_bytes: program.plan.arena_bytes as u64,
            flops: GraphStats::of(&program.graph).flops,
            launches: program.steps.len(),
        })
    }

    fn numerics(&mut self, candidate: &str) -> Result<(), Failure> {
        let pipeline = self.pipeline(candidate)?;
        crate::gate::check_pipeline_tuned(
            &self.gate_model,
            &pipeline,
            3,
            Backend::Cpu,
            self.gate_mesh.as_ref(),
            &Tuning::default(),
            self.precision,
        )
        .map_err(Failure::Refused)
    }

    fn pairs(
        &mut self,
        incumbent: &str,
        candidate: &str,
        k: usize,
    ) -> Result<Vec<(f64, f64)>, Failure> {
        let pair = (self.step_seconds(incumbent)?, self.step_seconds(candidate)?);
        Ok(vec![pair; k])
    }
}
