//! `graphtrain search`: the pass-search loop (`graphtrain-autoresearch`) driving this machine:
//! each candidate pipeline's optimized graph is fingerprinted (a graph measured once), gated on
//! numerics against the unoptimized step on the `cpu` backend (bitwise for tier 1), and timed
//! against the incumbent in interleaved pairs of real training steps, both compiled in this
//! process. The best pipeline is written as a RON file `run --pipeline` takes.
//!
//! Each candidate is predicted first from its optimized graph: the buffer planner's arena (the
//! peak `--memory-cap` bounds), FLOPs and node count (the pre-filter).
//!
//! Every compile and measurement runs in a supervised worker process (`Supervised`, serving
//! `graphtrain search-worker` with the search's own flags): a candidate that crashes it (a
//! panic, an abort, the kernel's out-of-memory killer) or leaves it without an answer for
//! `--worker-timeout` is logged `crash`, the worker is killed and started afresh, and the search
//! goes on. Candidate and incumbent are still compiled and timed in one process (the worker).
//!
//! A candidate is a pass list and settings (`crate::tuning`): fusion limits, the GEMM kernel and
//! on a mesh the threads per rank; on a mesh the SPMD step is searched, its ranks threads.
//!
//! Not yet: the GEMM's block sizes as settings (they are constants of its kernels).

use crate::bench;
use crate::cli::ARENA_ALIGNMENT;
use crate::cli::{trainer_for, TrainArgs};
use crate::trainer::{build_step_on, MeshRun, Trainer};
use crate::tuning::{split, Tuning};
use graphtrain_autoresearch::search::{Failure, Objective, Prediction};
use graphtrain_ir::autocast::Precision;
use graphtrain_ir::optim::OptimConfig;
use graphtrain_ir::stats::GraphStats;
use graphtrain_ir::Graph;
use graphtrain_lowering::plan_buffers;
use graphtrain_lowering::Mode;
use graphtrain_models::Llama3Config;
use graphtrain_passes::{Pipeline, PipelineSpec, Registry};
use graphtrain_runtime::{compile, Backend, CompileOptions};

/// Candidates measured as they would train here.
pub struct Measured<'a> {
    args: &'a TrainArgs,
    registry: &'a Registry,
    model: Llama3Config,
    /// The mesh whose SPMD step is searched (ranks as threads), or one device.
    mesh: Option<MeshRun>,
    /// `--precision`: the step the candidates rewrite is traced under it.
    precision: Precision,
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
        mesh: Option<MeshRun>,
        optim: &OptimConfig,
        numerics_steps: u64,
        warmup: u64,
    ) -> Result<Measured<'a>, String> {
        let precision = Precision::parse(&args.precision)?;
        let on_mesh = mesh.as_ref().map(|run| (&run.mesh, &run.plan));
        let step = build_step_on(&model, on_mesh, optim, precision)
            .map_err(|e| e.to_string())?
            .step
            .graph;
        Ok(Measured {
            args,
            registry,
            model,
            mesh,
            precision,
            step,
            numerics_steps,
            warmup,
            held: Vec::new(),
        })
    }

    /// A candidate's passes as a pipeline and its settings over `--tuning`.
    fn pipeline(&self, candidate: &str) -> Result<(Pipeline, Tuning, String), String> {
        let (passes, settings) = split(candidate);
        let pipeline = PipelineSpec::parse_list(&passes)?.build(self.registry)?;
        Ok((pipeline, self.args.tuning_with(&settings)?, settings))
    }

    /// The compiled step for `key` (a candidate, or `CANDIDATE#2`), and whether it is new.
    fn take(&mut self, key: &str) -> Result<(Trainer, bool), String> {
        if let Some(i) = self.held.iter().position(|(k, _)| k == key) {
            return Ok((self.held.remove(i).1, false));
        }
        let list = key.split('#').next().unwrap_or(key);
        let (pipeline, tuning, _) = self.pipeline(list)?;
        Ok((trainer_for(self.args, pipeline, &tuning)?, true))
    }

    fn give_back(&mut self, key: String, trainer: Trainer) {
        self.held.push((key, trainer));
        while self.held.len() > HELD {
            self.held.remove(0);
        }
    }
}

impl Objective for Measured<'_> {
    fn predict(&mut self, list: &str) -> Result<Prediction, Failure> {
        let (pipeline, tuning, settings) = self.pipeline(list)?;
        let options = CompileOptions {
            fusion: tuning.fusion,
            ..CompileOptions::new(&pipeline, Mode::Fused)
        };
        let compiled = compile(&self.step, Backend::Cpu, &options).map_err(|e| e.to_string())?;
        let optimized = &compiled.graph;
        // Settings change the program or how it runs, not the graph: a candidate is the graph
        // and its settings.
        let fingerprint = match settings.as_str() {
            "" => compiled.fingerprint.to_string(),
            s => format!("{}+{s}", compiled.fingerprint),
        };
        Ok(Prediction {
            fingerprint,
            peak_bytes: plan_buffers(optimized, ARENA_ALIGNMENT).arena_bytes as u64,
            flops: GraphStats::of(optimized).flops,
            launches: compiled.program.as_ref().map_or(0, |p| p.steps.len()),
        })
    }

    fn numerics(&mut self, list: &str) -> Result<(), Failure> {
        let (pipeline, tuning, _) = self.pipeline(list)?;
        let mesh = self.mesh.clone().map(|mut run| {
            run.threads_per_rank = tuning.threads_per_rank.unwrap_or(run.threads_per_rank);
            run
        });
        crate::gate::check_pipeline_tuned(
            &self.model,
            &pipeline,
            self.numerics_steps,
            Backend::Cpu,
            mesh.as_ref(),
            &tuning,
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
        let s = run.map_err(Failure::Crashed)?;
        Ok(s.baseline_step_times_s
            .into_iter()
            .zip(s.candidate_step_times_s)
            .collect())
    }
}

/// One question to the worker, one JSON line on its stdin.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
enum Request {
    Predict(String),
    Numerics(String),
    Pairs(String, String, usize),
}

/// The worker's answer, one JSON line on its stdout after `ANSWER`.
#[derive(serde::Serialize, serde::Deserialize, Debug)]
enum Answer {
    Predicted(Prediction),
    Passed,
    Pairs(Vec<(f64, f64)>),
    Refused(String),
    Crashed(String),
}

/// Marks the worker's answers on its stdout, which compiling a step may also print to.
const ANSWER: &str = "@graphtrain-search-worker ";

/// Fault injection for the supervision's tests: `abort:TEXT` and `hang:TEXT` (comma-separated)
/// make the worker abort, or stop answering, when asked to run (gate or time) a pipeline
/// containing TEXT.
pub const FAULT_ENV: &str = "GRAPHTRAIN_SEARCH_WORKER_FAULT";

fn inject_fault(pipeline: &str) {
    let Ok(faults) = std::env::var(FAULT_ENV) else {
        return;
    };
    for fault in faults.split(',') {
        match fault.split_once(':') {
            Some(("abort", text)) if pipeline.contains(text) => std::process::abort(),
            Some(("hang", text)) if pipeline.contains(text) => loop {
                std::thread::sleep(std::time::Duration::from_secs(3600));
            },
            _ => {}
        }
    }
}

/// The worker's loop: answers each request on `input` about `objective` until `input` ends.
pub fn serve(objective: &mut dyn Objective) -> Result<(), String> {
    use std::io::BufRead;
    for line in std::io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("reading a request: {e}"))?;
        let request: Request = serde_json::from_str(&line)
            .map_err(|e| format!("a request the worker cannot read (`{line}`): {e}"))?;
        let answer = match request {
            Request::Predict(p) => objective.predict(&p).map(Answer::Predicted),
            Request::Numerics(p) => {
                inject_fault(&p);
                objective.numerics(&p).map(|()| Answer::Passed)
            }
            Request::Pairs(a, b, k) => {
                inject_fault(&b);
                objective.pairs(&a, &b, k).map(Answer::Pairs)
            }
        };
        let answer = answer.unwrap_or_else(|f| match f {
            Failure::Refused(why) => Answer::Refused(why),
            Failure::Crashed(why) => Answer::Crashed(why),
        });
        let text = serde_json::to_string(&answer).map_err(|e| e.to_string())?;
        // Straight to stdout: `say!` is silent on MPI ranks other than 0, and this is a
        // protocol, not a report.
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{ANSWER}{text}")
            .and_then(|()| out.flush())
            .map_err(|e| format!("answering: {e}"))?;
    }
    Ok(())
}

/// The search's side of the worker: starts `graphtrain search-worker` with the search's
/// flags, asks it each question, and turns its death or silence into `Failure::Crashed`
/// (the worker is then killed; the next question starts a fresh one).
pub struct Supervised {
    args: Vec<std::ffi::OsString>,
    timeout: std::time::Duration,
    /// Where the worker's stderr goes (the crash report quotes its end).
    stderr_log: std::path::PathBuf,
    worker: Option<Worker>,
}

struct Worker {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    answers: std::sync::mpsc::Receiver<String>,
}

impl Supervised {
    /// `args`: the worker's arguments (the search's, with `search-worker` as the command).
    pub fn new(
        args: Vec<std::ffi::OsString>,
        timeout: std::time::Duration,
        stderr_log: std::path::PathBuf,
    ) -> Supervised {
        Supervised {
            args,
            timeout,
            stderr_log,
            worker: None,
        }
    }

    fn start(&self) -> Result<Worker, String> {
        use std::process::{Command, Stdio};
        let exe = std::env::current_exe().map_err(|e| format!("cannot find graphtrain: {e}"))?;
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr_log)
            .map_err(|e| format!("cannot open `{}`: {e}", self.stderr_log.display()))?;
        let mut command = Command::new(exe);
        command
            .args(&self.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(stderr);
        die_with_parent(&mut command);
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start the search worker: {e}"))?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let (tx, answers) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if let Some(answer) = line.strip_prefix(ANSWER) {
                    if tx.send(answer.to_string()).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Worker {
            child,
            stdin,
            answers,
        })
    }

    fn ask(&mut self, request: &Request) -> Result<Answer, Failure> {
        use std::io::Write;
        if self.worker.is_none() {
            self.worker = Some(self.start().map_err(Failure::Crashed)?);
        }
        let w = self.worker.as_mut().expect("started above");
        let line = serde_json::to_string(request).expect("requests serialize");
        let sent = writeln!(w.stdin, "{line}").and_then(|()| w.stdin.flush());
        let answer = match sent {
            Ok(()) => w.answers.recv_timeout(self.timeout),
            Err(_) => Err(std::sync::mpsc::RecvTimeoutError::Disconnected),
        };
        match answer {
            Ok(text) => serde_json::from_str(&text).map_err(|e| {
                self.stop();
                Failure::Crashed(format!("the worker answered `{text}`, not an answer: {e}"))
            }),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                self.stop();
                Err(Failure::Crashed(format!(
                    "the worker gave no answer in {:.0} s (--worker-timeout); killed",
                    self.timeout.as_secs_f64()
                )))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let status = self.stop();
                Err(Failure::Crashed(format!(
                    "the worker died ({status}){}",
                    self.stderr_tail()
                )))
            }
        }
    }

    /// Kills the worker (if it still runs) and says how it ended.
    fn stop(&mut self) -> String {
        let Some(mut w) = self.worker.take() else {
            return "not running".into();
        };
        let _ = w.child.kill();
        match w.child.wait() {
            Ok(status) => {
                use std::os::unix::process::ExitStatusExt;
                match (status.code(), status.signal()) {
                    (Some(code), _) => format!("exit code {code}"),
                    (None, Some(sig)) => format!("signal {sig}"),
                    _ => status.to_string(),
                }
            }
            Err(e) => format!("cannot tell how: {e}"),
        }
    }

    /// The worker log's last non-empty line, as `: LINE`, or nothing.
    fn stderr_tail(&self) -> String {
        std::fs::read_to_string(&self.stderr_log)
            .ok()
            .and_then(|t| {
                t.lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .map(str::to_string)
            })
            .map(|l| format!("; its last words: {}", l.trim()))
            .unwrap_or_default()
    }
}

/// Has Linux kill the worker when the search that started it dies (a SIGKILLed search would
/// otherwise leave a worker hung in a kernel running until it next reads its stdin).
#[cfg(target_os = "linux")]
fn die_with_parent(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    const PR_SET_PDEATHSIG: i32 = 1;
    const SIGKILL: u64 = 9;
    extern "C" {
        fn prctl(option: i32, ...) -> i32;
    }
    // SAFETY: runs in the child between fork and exec; prctl is async-signal-safe and touches
    // nothing of the parent's.
    unsafe {
        command.pre_exec(|| {
            prctl(PR_SET_PDEATHSIG, SIGKILL);
            Ok(())
        });
    }
}

#[cfg(not(target_os = "linux"))]
fn die_with_parent(_command: &mut std::process::Command) {}

impl Drop for Supervised {
    fn drop(&mut self) {
        self.stop();
    }
}

/// An answer of the wrong kind: the worker is not the one this search started.
fn unexpected(answer: Answer) -> Failure {
    Failure::Crashed(format!("the worker answered out of turn: {answer:?}"))
}

fn failed(answer: Answer) -> Failure {
    match answer {
        Answer::Refused(why) => Failure::Refused(why),
        Answer::Crashed(why) => Failure::Crashed(why),
        other => unexpected(other),
    }
}

impl Objective for Supervised {
    fn predict(&mut self, pipeline: &str) -> Result<Prediction, Failure> {
        match self.ask(&Request::Predict(pipeline.into()))? {
            Answer::Predicted(p) => Ok(p),
            other => Err(failed(other)),
        }
    }

    fn numerics(&mut self, pipeline: &str) -> Result<(), Failure> {
        match self.ask(&Request::Numerics(pipeline.into()))? {
            Answer::Passed => Ok(()),
            other => Err(failed(other)),
        }
    }

    fn pairs(
        &mut self,
        incumbent: &str,
        candidate: &str,
        k: usize,
    ) -> Result<Vec<(f64, f64)>, Failure> {
        match self.ask(&Request::Pairs(incumbent.into(), candidate.into(), k))? {
            Answer::Pairs(p) => Ok(p),
            other => Err(failed(other)),
        }
    }
}
