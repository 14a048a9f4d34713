//! The `graphtrain` command line. `main` is public so that programs embedding graphtrain (such as
//! an out-of-tree pass plugin) can reuse the same entry point.

use crate::config::{check_model, config_to_ron, load_config};
use crate::data::DataMode;
use crate::trainer::{build_step, TrainConfig, Trainer};
use clap::{Parser, Subcommand, ValueEnum};
use graphtrain_ir::optim::{OptimConfig, Optimizer};
use graphtrain_ir::stats::GraphStats;
use graphtrain_ir::{text, verify, DType, Phase};
use graphtrain_models::{Llama3Config, LLAMA3_CONFIGS};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    name = "graphtrain",
    version,
    about = "Compiles a model's whole train step into one dataflow graph and runs it"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Trace a model's train step (forward, loss, backward, optimizer), verify it, print a summary
    /// and optionally write the graph.
    Trace(TraceArgs),
    /// Train a model and print one line per step.
    Run(RunArgs),
    /// Parse and verify a graph file (text or RON) and summarize it.
    Check {
        /// Graph file: `.ron` is read as RON, anything else as the text format.
        file: PathBuf,
    },
    /// Model configurations.
    #[command(subcommand)]
    Config(ConfigCommand),
}

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Print a built-in configuration as RON (a starting point for `--config FILE.ron`).
    Show {
        /// Built-in config name.
        name: String,
    },
    /// List the built-in configurations.
    List,
}

#[derive(clap::Args, Debug)]
pub struct ModelArgs {
    /// Model architecture.
    #[arg(long, default_value = "llama3")]
    pub model: String,
    /// Built-in config name (tiny, debug, peer, 8b, 70b, 405b) or a path to a RON config file.
    #[arg(long)]
    pub config: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum GraphFormat {
    Text,
    Ron,
}

#[derive(clap::Args, Debug)]
pub struct TraceArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Write the train-step graph here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Format of `--out` (default: `ron` for a `.ron` file, else `text`).
    #[arg(long, value_enum)]
    pub format: Option<GraphFormat>,
    #[command(flatten)]
    pub optim: OptimArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum OptimizerName {
    Adamw,
    Sgd,
}

#[derive(clap::Args, Debug)]
pub struct OptimArgs {
    /// Optimizer built into the step.
    #[arg(long, value_enum, default_value = "adamw")]
    pub optimizer: OptimizerName,
    /// Decoupled weight decay (AdamW) or L2 weight decay (SGD).
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f64,
    /// Clip the global gradient norm to this value (no clipping when absent).
    #[arg(long)]
    pub max_grad_norm: Option<f64>,
}

impl OptimArgs {
    fn config(&self) -> Result<OptimConfig, String> {
        if let Some(m) = self.max_grad_norm {
            if !(m > 0.0 && m.is_finite()) {
                return Err(format!(
                    "--max-grad-norm must be a positive number, got {m}"
                ));
            }
        }
        let optimizer = match self.optimizer {
            OptimizerName::Adamw => Optimizer::AdamW {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: self.weight_decay,
            },
            OptimizerName::Sgd => Optimizer::Sgd {
                weight_decay: self.weight_decay,
            },
        };
        Ok(OptimConfig {
            optimizer,
            max_grad_norm: self.max_grad_norm,
        })
    }
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Where the step executes. Only the reference interpreter exists so far; the cubecl
    /// backends (cpu, wgpu, cuda) arrive with the lowering.
    #[arg(long, default_value = "reference", value_parser = ["reference"])]
    pub backend: String,
    /// Number of train steps.
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Training data: a fresh random batch per step, or the same batch every step.
    #[arg(long, value_enum, default_value = "random")]
    pub data: DataMode,
    /// Seed of parameter init and data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Learning rate (constant).
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[command(flatten)]
    pub optim: OptimArgs,
}

/// Parses `args` (program name first), runs the command, prints errors, returns the exit code.
pub fn main<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                ExitCode::from(2)
            } else {
                ExitCode::SUCCESS
            };
        }
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .try_init();
    match run_command(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Runs one parsed command.
pub fn run_command(command: Command) -> Result<(), String> {
    match command {
        Command::Trace(a) => trace(a),
        Command::Run(a) => run(a),
        Command::Check { file } => check(file),
        Command::Config(ConfigCommand::Show { name }) => {
            let cfg = Llama3Config::builtin(&name).ok_or_else(|| {
                format!(
                    "unknown config `{name}`; built-in configs: {}",
                    LLAMA3_CONFIGS.join(", ")
                )
            })?;
            print!("{}", config_to_ron(&cfg));
            println!();
            Ok(())
        }
        Command::Config(ConfigCommand::List) => {
            for name in LLAMA3_CONFIGS {
                let cfg = Llama3Config::builtin(name).expect("listed configs exist");
                println!(
                    "{name:>6}: dim {} layers {} heads {}/{} kv, vocab {}, ffn {}, batch {} x seq {}, {:.3}B params",
                    cfg.dim,
                    cfg.n_layers,
                    cfg.n_heads,
                    cfg.n_kv_heads,
                    cfg.vocab_size,
                    cfg.ffn_hidden,
                    cfg.batch,
                    cfg.seq_len,
                    cfg.num_params() as f64 / 1e9
                );
            }
            Ok(())
        }
    }
}

fn model_config(m: &ModelArgs) -> Result<Llama3Config, String> {
    check_model(&m.model)?;
    let cfg = load_config(&m.config)?;
    cfg.validate()
        .map_err(|e| format!("config `{}`: {e}", m.config))?;
    Ok(cfg)
}

fn gib(bytes: usize) -> String {
    let b = bytes as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    }
}

fn trace(a: TraceArgs) -> Result<(), String> {
    let cfg = model_config(&a.model)?;
    let optim = a.optim.config()?;
    let t0 = Instant::now();
    let (step, times) = build_step(&cfg, DType::F32, &optim).map_err(|e| e.to_string())?;
    let total = t0.elapsed();
    let g = &step.graph;
    let s = GraphStats::of(g);
    let tokens = (cfg.batch * cfg.seq_len) as f64;
    println!(
        "model {} config {}: {} nodes, {} values, {} params ({:.3}B)",
        a.model.model,
        a.model.config,
        s.nodes,
        g.values.len(),
        s.param_count,
        s.param_count as f64 / 1e9
    );
    let phases: Vec<String> = s
        .nodes_per_phase
        .iter()
        .map(|(p, n)| format!("{} {n}", p.short()))
        .collect();
    println!("nodes per phase: {}", phases.join(", "));
    let ops: Vec<String> = s
        .nodes_per_op
        .iter()
        .map(|(o, n)| format!("{o} {n}"))
        .collect();
    println!("nodes per op: {}", ops.join(", "));
    let fwd: f64 = s
        .flops_per_phase
        .iter()
        .filter(|(p, _)| *p <= Phase::Loss)
        .map(|(_, f)| f)
        .sum();
    println!(
        "FLOPs per token: {:.4} GFLOP counted in the graph (forward {:.4}), {:.4} GFLOP by 6(N - N_emb) + 12·L·D·T",
        s.flops / tokens / 1e9,
        fwd / tokens / 1e9,
        cfg.flops_per_token() / 1e9
    );
    println!(
        "memory: params {}, grads {}, optimizer state {}, saved activations {} (batch {} x seq {})",
        gib(s.param_bytes),
        gib(s.grad_bytes),
        gib(s.state_bytes),
        gib(s.saved_activation_bytes),
        cfg.batch,
        cfg.seq_len
    );
    println!(
        "time: trace {:.3}s, autodiff + optimizer {:.3}s, verify {:.3}s, total {:.3}s",
        times.trace.as_secs_f64(),
        times.autodiff_and_optimizer.as_secs_f64(),
        times.verify.as_secs_f64(),
        total.as_secs_f64()
    );
    if let Some(out) = a.out {
        let format = a
            .format
            .unwrap_or(if out.extension().is_some_and(|e| e == "ron") {
                GraphFormat::Ron
            } else {
                GraphFormat::Text
            });
        let body = match format {
            GraphFormat::Text => text::print(g),
            GraphFormat::Ron => graphtrain_ir::ron_io::to_ron(g),
        };
        std::fs::write(&out, body).map_err(|e| format!("cannot write `{}`: {e}", out.display()))?;
        println!("wrote {}", out.display());
    }
    Ok(())
}

fn run(a: RunArgs) -> Result<(), String> {
    let cfg = model_config(&a.model)?;
    if !(a.lr > 0.0 && a.lr.is_finite()) {
        return Err(format!("--lr must be a positive number, got {}", a.lr));
    }
    let optim = a.optim.config()?;
    let t0 = Instant::now();
    let mut trainer = Trainer::new(
        &cfg,
        TrainConfig {
            data: a.data,
            seed: a.seed,
            lr: a.lr,
            optim,
        },
    )
    .map_err(|e| e.to_string())?;
    let flops_per_token = cfg.flops_per_token();
    println!(
        "graphtrain: model {} config {} backend {} | {} params, {} nodes | data {:?} seed {} lr {} | built in {:.2}s",
        a.model.model,
        a.model.config,
        a.backend,
        cfg.num_params(),
        trainer.graph.nodes.len(),
        a.data,
        a.seed,
        a.lr,
        t0.elapsed().as_secs_f64()
    );
    for _ in 0..a.steps {
        let m = trainer.step().map_err(|e| e.to_string())?;
        let tps = m.tokens as f64 / m.seconds;
        // The reference interpreter has no meaningful hardware peak, so MFU is not reported.
        println!(
            "step: {:>2} loss: {:.4} grad_norm: {:.4} memory: {:.2}MiB tps: {:.0} tflops: {:.4} mfu: n/a",
            m.step,
            m.loss,
            m.grad_norm,
            m.peak_bytes as f64 / (1024.0 * 1024.0),
            tps,
            tps * flops_per_token / 1e12
        );
    }
    Ok(())
}

fn check(file: PathBuf) -> Result<(), String> {
    let src = std::fs::read_to_string(&file)
        .map_err(|e| format!("cannot read `{}`: {e}", file.display()))?;
    let g = if file.extension().is_some_and(|e| e == "ron") {
        graphtrain_ir::ron_io::from_ron(&src).map_err(|e| format!("{}: {e}", file.display()))?
    } else {
        text::parse(&src).map_err(|e| format!("{}: {e}", file.display()))?
    };
    verify(&g).map_err(|e| format!("{}: {e}", file.display()))?;
    let s = GraphStats::of(&g);
    println!(
        "{}: graph `{}` is valid: {} inputs, {} nodes, {} outputs, {:.4} GFLOP",
        file.display(),
        g.name,
        g.inputs.len(),
        s.nodes,
        g.outputs.len(),
        s.flops / 1e9
    );
    Ok(())
}
