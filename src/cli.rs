//! The `graphtrain` command line. `main` is public so that programs embedding graphtrain (such as
//! an out-of-tree pass plugin) can reuse the same entry point.

use crate::checkpoint::{self, RunIdentity};
use crate::config::{check_model, config_to_ron, load_config};
use crate::data::prepare::{default_cache_dir, prepare_tokens, PrepareOptions};
use crate::data::text::DEFAULT_VAL_FRACTION;
use crate::data::tokenizer::{TextTokenizer, DEFAULT_VOCAB_SIZE};
use crate::data::{DataSource, TextData};
use crate::eval::{sample_text, Sampling, Validator};
use crate::lr_schedule::{Decay, LrSchedule};
use crate::metrics::MetricsWriter;
use crate::replay::{self, BatchDump};
use crate::step_report::{StepReport, TraceTarget};
use crate::trainer::{BuildTimings, TrainConfig, Trainer};
use crate::tuning::Tuning;
use clap::{Parser, Subcommand, ValueEnum};
use graphtrain_ir::autocast::Precision;
use graphtrain_ir::optim::{OptimConfig, Optimizer};
use graphtrain_ir::stats::GraphStats;
use graphtrain_ir::{text, verify, Graph, Phase};
use graphtrain_lowering::{plan_buffers, Mode};
use graphtrain_models::{Llama3Config, LLAMA3_CONFIGS};
use graphtrain_passes::{
    testing, PassRecord, Pipeline, PipelineSpec, Registry, Tier, DEFAULT_PIPELINE,
};
use graphtrain_runtime::{compile, Backend, CompileOptions, GemmKernel, Profile, RuntimeOptions};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// Writes a line to stdout. A closed pipe (`graphtrain ... | head`) ends the process quietly, as
/// the default SIGPIPE action would, instead of panicking inside `println!`.
macro_rules! say {
    () => { $crate::cli::write_stdout(format_args!("\n")) };
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!("{}\n", format_args!($($arg)*))) };
}

/// `say!` without the newline.
macro_rules! say_raw {
    ($($arg:tt)*) => { $crate::cli::write_stdout(format_args!($($arg)*)) };
}

#[doc(hidden)]
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if !speaks_for_the_job() {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(0);
        }
        eprintln!("error: cannot write to stdout: {e}");
        std::process::exit(1);
    }
}

#[derive(Parser, Debug)]
#[command(
    name = "graphtrain",
    version,
    about = "Compiles a model's whole train step into one dataflow graph and runs it",
    after_help = "Environment (read by `run` and `bench`):\n  \
GRAPHTRAIN_PROFILE=1|steps          wait for and time every step, by kind or one by one\n  \
GRAPHTRAIN_GEMM_KERNEL=avx512|avx2|scalar\n  \
\x20                                   a narrower GEMM kernel than the cpu's widest, to measure it\n  \
\x20                                   (avx512: no AMX tiles for bf16 matmuls)\n  \
GRAPHTRAIN_MEMORY_LIMIT_MIB=N       host memory a run may allocate (default: what the OS reports)\n  \
GRAPHTRAIN_DEVICE_BUFFER_MIB=N      the most one wgpu or cuda buffer holds (default: the device's\n  \
\x20                                   limit); a larger arena is split across buffers\n\n\
Logging (every command):\n  \
RUST_LOG=info                       log each compile stage (trace, autodiff, verify, passes and\n  \
\x20                                   each pass, legalize, lower, load) and each training step to\n  \
\x20                                   stderr as it ends, with its time; any tracing env-filter works\n  \
\x20                                   (`graphtrain=info,graphtrain_passes=info`). Unset: errors only"
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
    ///
    /// Each line reads `step: N loss: X grad_norm: Y memory: Z tps: T tflops: F mfu: M`. `memory`
    /// is the executor's peak of live tensor bytes at graph dtypes; `tflops` counts
    /// 6(N - N_emb) + 12·L·D·T FLOPs per token; `mfu` is against this machine's peak on `cpu`
    /// (derived from its threads, clock and FMA width; `bench` prints how) or `--peak-gflops`,
    /// and n/a otherwise. A non-finite loss stops the run with an error naming the step.
    Run(RunArgs),
    /// Train for warm-up plus measured steps and report median tokens/s, compile time by stage,
    /// predicted against measured memory and peak RSS (`--json FILE` writes the summary).
    Bench(BenchArgs),
    /// Search for a faster pass pipeline: candidates from the search space, each gated on
    /// numerics, timed against the incumbent in interleaved pairs of steps and kept only when a
    /// 95% interval of the speed ratio lies above 1 (and a confirmation agrees). Starts from
    /// --passes; logs to --log DIR (results.tsv, samples.jsonl), from which it resumes; writes
    /// the best pipeline to DIR/best.ron (`run --pipeline DIR/best.ron`).
    Search(SearchArgs),
    /// The worker `search` supervises: answers its questions (JSON lines on stdin and stdout)
    /// about candidates compiled and timed in this process.
    #[command(hide = true)]
    SearchWorker(SearchArgs),
    /// Predict one rank's step on a machine without running it: step time, tokens/s per device,
    /// MFU, memory and exposed communication, from the compiled step (after passes) and a
    /// hardware description (`--hardware`: built-in GPUs, a RON file, or `this-cpu`, measured
    /// now).
    Sim(SimArgs),
    /// Choose a parallelization plan for a model on a mesh: an integer linear program over
    /// each parameter class's placements, priced by the simulator's rates (`passes explain
    /// autoshard`); writes the plan as RON for `run --plan`, and compares it with the
    /// built-in Llama plan by the same price.
    Autoshard(AutoshardArgs),
    /// Parse and verify a graph file (text or RON) and summarize it.
    Check {
        /// Graph file: `.ron` is read as RON, anything else as the text format.
        file: PathBuf,
    },
    /// Model configurations.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Graph passes: list them, explain one, apply a pipeline to a graph file.
    #[command(subcommand)]
    Passes(PassesCommand),
    /// Draw a metrics log (`run --metrics`) as panels against step: loss and validation loss,
    /// tokens/s, memory, and the lr where a schedule varies it; or, with --trace, a timeline
    /// (`run --trace-out`) as lanes.
    Plot(PlotArgs),
    /// Sample text from a checkpoint of a run on text data (its tokenizer travels with it).
    Generate(GenerateArgs),
    /// Write a checkpoint's model as a Hugging Face Llama folder (config.json,
    /// model.safetensors, and the tokenizer of a run on text) that transformers loads with
    /// `LlamaForCausalLM.from_pretrained`.
    Export(ExportArgs),
    /// Tokenizers: train a byte-level BPE on a corpus, encode and decode text.
    #[command(subcommand)]
    Tokenizer(TokenizerCommand),
    /// Training text: tokenize a corpus into the cache and report its size.
    #[command(subcommand)]
    Data(DataCommand),
}

#[derive(Subcommand, Debug)]
pub enum TokenizerCommand {
    /// Train a byte-level BPE (with the special token `<|endoftext|>`) on a corpus and write its
    /// tokenizer.json. A small corpus may give fewer tokens than asked.
    Train {
        /// A text file or a folder of text files (each file one document).
        #[arg(long)]
        corpus: PathBuf,
        /// Largest vocab size, `<|endoftext|>` included (at least 257).
        #[arg(long, default_value_t = DEFAULT_VOCAB_SIZE)]
        vocab_size: usize,
        /// Where to write the tokenizer.json.
        #[arg(long)]
        out: PathBuf,
    },
    /// Print the token ids of TEXT, space-separated.
    Encode {
        /// A tokenizer.json, or `gpt2` for GPT-2's BPE.
        #[arg(long)]
        tokenizer: PathBuf,
        text: String,
    },
    /// Print the text of token IDS.
    Decode {
        /// A tokenizer.json, or `gpt2` for GPT-2's BPE.
        #[arg(long)]
        tokenizer: PathBuf,
        #[arg(required = true)]
        ids: Vec<u32>,
    },
}

#[derive(Subcommand, Debug)]
pub enum DataCommand {
    /// Tokenize a corpus once (training a BPE unless --tokenizer is given), cache the tokens and
    /// print the document, token, row and split counts.
    Prepare {
        #[command(flatten)]
        text: TextDataArgs,
        /// A text file, a folder of text files, or a `*.tokens` file.
        #[arg(long)]
        data: PathBuf,
        /// Vocab size of the BPE trained when no --tokenizer is given.
        #[arg(long, default_value_t = DEFAULT_VOCAB_SIZE)]
        vocab_size: usize,
        /// Sequence length: with it, rows of seq_len + 1 tokens and the split are reported.
        #[arg(long)]
        seq_len: Option<usize>,
    },
}

/// How a text corpus becomes tokens; shared by `run`, `bench` and `data prepare`.
#[derive(clap::Args, Debug)]
pub struct TextDataArgs {
    /// A tokenizer.json to tokenize the text with, or `gpt2` for GPT-2's own BPE (50,257
    /// tokens, built in; a model needs vocab_size >= 50257 for it). Default: a byte-level BPE
    /// trained on the corpus, cached in --data-cache. With a `*.tokens` file, checked to be the
    /// one that made it.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Fraction of the text's rows held out for validation (the last rows; at least one).
    #[arg(long, default_value_t = DEFAULT_VAL_FRACTION)]
    pub val_fraction: f64,
    /// Cache folder for trained tokenizers and token files
    /// (default: $XDG_CACHE_HOME/graphtrain, else ~/.cache/graphtrain).
    #[arg(long)]
    pub data_cache: Option<PathBuf>,
}

impl TextDataArgs {
    fn options(&self, data: &Path, vocab_size: usize) -> Result<PrepareOptions, String> {
        Ok(PrepareOptions {
            data: data.to_path_buf(),
            tokenizer: self.tokenizer.clone(),
            vocab_size,
            cache_dir: match &self.data_cache {
                Some(d) => d.clone(),
                None => default_cache_dir()?,
            },
        })
    }

    /// Whether any flag differs from its default (they only apply to text).
    fn any_given(&self, vocab_size: Option<usize>) -> Option<&'static str> {
        if self.tokenizer.is_some() {
            Some("--tokenizer")
        } else if self.data_cache.is_some() {
            Some("--data-cache")
        } else if self.val_fraction != DEFAULT_VAL_FRACTION {
            Some("--val-fraction")
        } else if vocab_size.is_some() {
            Some("--vocab-size")
        } else {
            None
        }
    }
}

/// `--data`: synthetic tokens or a path to text.
#[derive(Clone, Debug, PartialEq)]
pub enum DataArg {
    Random,
    Fixed,
    Path(PathBuf),
}

impl std::fmt::Display for DataArg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DataArg::Random => f.write_str("random"),
            DataArg::Fixed => f.write_str("fixed"),
            DataArg::Path(p) => write!(f, "{}", p.display()),
        }
    }
}

/// `--data`'s parser: `random`, `fixed` or a path.
pub fn parse_data_arg(s: &str) -> Result<DataArg, String> {
    match s {
        "random" => Ok(DataArg::Random),
        "fixed" => Ok(DataArg::Fixed),
        "" => Err("expected `random`, `fixed` or a path".to_string()),
        // `./random` reaches a file named `random`.
        path => Ok(DataArg::Path(PathBuf::from(path))),
    }
}

#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// The metrics log (JSON lines, schema `graphtrain.metrics/1`).
    #[arg(required_unless_present_any = ["trace", "search"], conflicts_with_all = ["trace", "search"])]
    pub file: Option<PathBuf>,
    /// Draw this Chrome trace's lanes instead (one row per lane, one bar per event).
    #[arg(long, conflicts_with = "search")]
    pub trace: Option<PathBuf>,
    /// Draw the best-so-far speed of these searches' logs (`graphtrain search --log DIR`)
    /// against the pairs they timed, one line each (repeat to compare proposers).
    #[arg(long)]
    pub search: Vec<PathBuf>,
    /// The picture: `.svg`, or `.png` (text drawn with a bundled font).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(Subcommand, Debug)]
pub enum PassesCommand {
    /// List every registered pass with its tier and a one-line summary.
    List,
    /// Print a pass's contract: what it changes, what it guarantees, when it declines.
    Explain {
        /// Pass name.
        name: String,
    },
    /// Apply passes to a graph file and print the result (text format) and each pass's report.
    Apply {
        /// A pass to run, `NAME` or `NAME=OPTION`; repeat for a pipeline (run in order).
        #[arg(long = "pass", required = true)]
        passes: Vec<String>,
        /// Graph file: `.ron` is read as RON, anything else as the text format.
        file: PathBuf,
        /// Write the rewritten graph here instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Also run both graphs on seeded random inputs through the reference interpreter and
        /// compare (bitwise for tier-1 pipelines, within tolerance for tier 2).
        #[arg(long)]
        check: bool,
        /// Also write the rewritten graph as Graphviz DOT, nodes the passes made outlined in red
        /// and the ones they removed listed dashed.
        #[arg(long)]
        dot: Option<PathBuf>,
    },
}

/// How the pass pipeline is chosen; shared by `trace` and `run`.
#[derive(clap::Args, Debug)]
pub struct PassArgs {
    /// Pass pipeline: comma-separated names, each `NAME` or `NAME=OPTION`, run in order.
    /// `default` is the tier-1 default pipeline (canonicalize,cse,dce,attention_stats,gather_bf16,capture); `none` runs no pass.
    /// `graphtrain passes list` shows the passes.
    #[arg(long, default_value = "default")]
    pub passes: String,
    /// Read the pipeline from a RON file instead of --passes:
    /// `(passes: [(name: "cse"), (name: "ac", option: Some("full"))])`.
    #[arg(long, conflicts_with = "passes")]
    pub pipeline: Option<PathBuf>,
    /// Remove a pass from the pipeline (repeatable).
    #[arg(long = "disable-pass")]
    pub disable_pass: Vec<String>,
    /// Write the graph text before and after every pass into this directory.
    #[arg(long)]
    pub dump_dir: Option<PathBuf>,
    /// Run the verifier after every pass (always on in debug builds).
    #[arg(long)]
    pub verify_each: bool,
}

impl PassArgs {
    /// The pipeline; `tp_link` is `--link`'s tp entry, which `async_tp`'s cost gate assumes
    /// unless its option names a link.
    fn pipeline(&self, registry: &Registry, tp_link: Option<&str>) -> Result<Pipeline, String> {
        let mut spec = match &self.pipeline {
            Some(path) => PipelineSpec::from_ron_file(path)?,
            None => PipelineSpec::parse_list(&self.passes)?,
        };
        for name in &self.disable_pass {
            spec.disable(name, registry)?;
        }
        gate_async_tp_on(&mut spec, tp_link);
        let mut pipeline = spec.build(registry)?;
        pipeline.verify_each |= self.verify_each;
        pipeline.dump_dir = self.dump_dir.clone();
        Ok(pipeline)
    }
}

#[derive(Subcommand, Debug)]
pub enum ConfigCommand {
    /// Print a configuration as RON (a starting point for `--config FILE.ron`): a built-in one,
    /// or a Hugging Face Llama `config.json` (or its model folder) as graphtrain reads it.
    Show {
        /// Built-in config name, or a transformers config.json or model folder.
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
    /// Built-in config name (tiny, small, debug, peer, 8b, 70b, 405b), a path to a RON config
    /// file, or a Hugging Face Llama `config.json` (or the model folder holding it; batch 8 and
    /// the model's context up to 2048 tokens, which `config show` prints to edit as RON).
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
    /// Write the train-step graph (after the passes) as Graphviz DOT: one cluster per module
    /// path prefix, nodes filled by phase (forward blue, loss yellow, backward orange, optimizer
    /// green). `dot -Tsvg FILE.dot` draws it.
    #[arg(long)]
    pub dot: Option<PathBuf>,
    /// Trace the SPMD train step of one rank on this device mesh, e.g. `dp_shard=8,tp=8` or
    /// `dp_replicate=2,dp_shard=4` (dimensions dp_replicate, dp_shard, tp; cp, pp and ep are
    /// not built yet). The counts and memory figures are then per rank.
    #[arg(long)]
    pub mesh: Option<String>,
    /// A parallelization plan (RON: parameter name patterns to placements per mesh dimension);
    /// default with --mesh: FSDP over dp_shard for every parameter, and with tp, Megatron's
    /// tensor parallelism (attention and MLP weights split, norms, embedding and output head
    /// replicated).
    #[arg(long, requires = "mesh")]
    pub plan: Option<PathBuf>,
    /// The global batch (rows per step over all ranks) instead of the config's; with --mesh it
    /// must split over dp_replicate x dp_shard (the large configs' batch is 1).
    #[arg(long)]
    pub batch: Option<usize>,
    /// `f32` or `bf16-mixed` (matmuls and attention on bf16 casts, f32 master weights; on a
    /// mesh, FSDP's weight gathers move bf16 through the default pipeline's `gather_bf16`).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    #[command(flatten)]
    pub optim: OptimArgs,
    #[command(flatten)]
    pub passes: PassArgs,
}

#[derive(clap::Args, Debug)]
pub struct SimArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The device mesh, e.g. `dp_shard=8` or `dp_shard=8,tp=8`: the SPMD step of one rank is
    /// simulated.
    #[arg(long)]
    pub mesh: Option<String>,
    /// A parallelization plan (RON), as for `run`.
    #[arg(long, requires = "mesh")]
    pub plan: Option<PathBuf>,
    /// The global batch instead of the config's.
    #[arg(long)]
    pub batch: Option<usize>,
    #[command(flatten)]
    pub optim: OptimArgs,
    #[command(flatten)]
    pub passes: PassArgs,
    /// `f32` or `bf16-mixed` (matmuls at the bf16 peak).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// The machine: `h100-sxm`, `h200`, `a100-sxm`, a RON file with the same fields, or
    /// `this-cpu` (this host, measured now with a GEMM, an attention, a memory sweep and a
    /// launch: a few seconds).
    #[arg(long, default_value = "this-cpu")]
    pub hardware: String,
    /// Nodes the run spans (devices per node come from the hardware); a mesh larger than they
    /// hold is refused.
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// One emulated link for every collective, `GBPS:LATENCY_US` as `run --link` takes it for
    /// each dimension: to predict a threads run with emulated links.
    #[arg(long, requires = "mesh")]
    pub link: Option<String>,
    /// Write the hardware description used (with `this-cpu`: what was measured) to this RON
    /// file.
    #[arg(long)]
    pub write_hardware: Option<PathBuf>,
    /// Write the simulated step as a Chrome trace (compute and communication lanes), the
    /// format `run --trace-out` records, so a prediction and a run open side by side.
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct AutoshardArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The device mesh, e.g. `dp_shard=2,tp=2` or `dp_shard=8,tp=8`.
    #[arg(long, required_unless_present = "world", conflicts_with = "world")]
    pub mesh: Option<String>,
    /// Instead of one mesh, every `dp_shard` x `tp` mesh of this many ranks: each solved (the
    /// fastest plan, and the fastest that fits the device's memory or, where none does before
    /// the passes, the smallest), simulated with each pipeline of --survey-passes, ranked, and
    /// the one to run named with the reason (--out writes its plan).
    #[arg(long)]
    pub world: Option<usize>,
    /// The pipelines --world simulates, `;`-separated.
    #[arg(
        long,
        default_value = "default;default,prefetch;default,ac=selective,prefetch;default,ac=full,prefetch",
        requires = "world"
    )]
    pub survey_passes: String,
    /// The global batch instead of the config's.
    #[arg(long)]
    pub batch: Option<usize>,
    #[command(flatten)]
    pub optim: OptimArgs,
    /// `f32` or `bf16-mixed`.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// The machine the plan is for, as `sim` takes it: `h100-sxm`, `h200`, `a100-sxm`, a RON
    /// file, or `this-cpu` (measured now, a few seconds).
    #[arg(long, default_value = "this-cpu")]
    pub hardware: String,
    /// Nodes the run spans (devices per node come from the hardware).
    #[arg(long, default_value_t = 1)]
    pub nodes: usize,
    /// One emulated link for every collective, `GBPS:LATENCY_US` (a threads run with `--link`).
    #[arg(long)]
    pub link: Option<String>,
    /// The most memory a rank may hold at its peak (bytes, or with KiB, MiB or GiB). Default:
    /// the hardware's memory (a device's; on a cpu host, the host's divided by the ranks).
    #[arg(long)]
    pub memory_limit: Option<String>,
    /// Keep these parameters' placements: `PATTERN=DIM:PLACEMENT[,DIM:PLACEMENT]`, e.g.
    /// `*.wq.weight=tp:shard(0)`; repeat for several.
    #[arg(long = "fix")]
    pub fixed: Vec<String>,
    /// Proposals the solver prices exactly per global choice.
    #[arg(long, default_value_t = 4)]
    pub proposals: usize,
    /// Write the plan (RON) here instead of to stdout.
    #[arg(long)]
    pub out: Option<PathBuf>,
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
    /// Split each step's batch into N micro-batches that run one after another in the step,
    /// their gradients summed before the one update (gradient accumulation): only one
    /// micro-batch's activations are live at a time. The batch must split evenly.
    #[arg(long, default_value_t = 1, value_name = "N")]
    pub micro_batches: u32,
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
        if self.micro_batches == 0 {
            return Err("--micro-batches must be at least 1 (1: the batch is not split)".into());
        }
        Ok(OptimConfig {
            optimizer,
            max_grad_norm: self.max_grad_norm,
            micro_batches: self.micro_batches,
        })
    }
}

/// What `run` and `bench` share: the model, where it runs, data, optimizer and passes.
#[derive(clap::Args, Debug)]
pub struct TrainArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Rows per step (over all ranks) instead of the config's batch: the rows each update
    /// sees, split into --micro-batches where given.
    #[arg(long)]
    pub batch: Option<usize>,
    /// Where the step executes: `cpu` (cubecl-cpu kernels and a native GEMM), `wgpu` (any
    /// Vulkan/Metal/DX12 GPU, or lavapipe; correct, not yet fast), `cuda` (built with
    /// `--features cuda`; not yet run on a GPU), `reference` (the interpreter: slow, the numerics
    /// oracle).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    /// How the compiled backends lower the step: `fused` (elementwise chains in one kernel,
    /// layout ops read in place; bitwise equal to eager) or `eager` (one kernel per op, the
    /// numerics baseline).
    #[arg(long, value_enum, default_value = "fused")]
    pub lowering: LoweringMode,
    /// Training data: `random` (a fresh batch of random tokens per step), `fixed` (the same
    /// random batch every step), or a PATH: a text file, a folder of text files (each file one
    /// document, sorted by path), or a `*.tokens` file graphtrain wrote. Text is tokenized once
    /// (cached in --data-cache), cut into rows of seq_len + 1 tokens, the last --val-fraction of
    /// rows held out, and training rows drawn in a per-epoch shuffle seeded by --seed. The
    /// tokenizer's vocab may be smaller than the model's vocab_size (extra embedding rows stay
    /// unused), not larger.
    #[arg(long, default_value = "random", value_parser = parse_data_arg)]
    pub data: DataArg,
    #[command(flatten)]
    pub text: TextDataArgs,
    /// Vocab size of the BPE trained on a --data PATH when no --tokenizer is given
    /// (default: the model config's vocab_size).
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Seed of parameter init and data.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Learning rate: every step's, or with `run --lr-warmup` / `--lr-decay` the peak.
    #[arg(long, default_value_t = 1e-3)]
    pub lr: f64,
    #[command(flatten)]
    pub optim: OptimArgs,
    #[command(flatten)]
    pub passes: PassArgs,
    /// Peak f32 GFLOP/s that `mfu` is measured against, instead of the one derived from this
    /// machine on `cpu` (threads x clock x FLOP per cycle of its widest FMA; printed by
    /// `bench`). Device backends have no peak unless given one here.
    #[arg(long, value_parser = positive_gflops)]
    pub peak_gflops: Option<f64>,
    #[command(flatten)]
    pub mesh: MeshArgs,
    /// Lowering and runtime settings that change speed, not the graph, as `name=value`
    /// comma-separated: `fusion.max_map_inputs`, `fusion.max_expr_nodes`,
    /// `fusion.converge_hops` (the lowering's fusion limits), `gemm` (`widest`, `avx2` or
    /// `scalar`: the cpu GEMM kernel, refused elsewhere), `map_vector` (`widest`, `8` or `16`:
    /// the lanes of the cpu backend's elementwise kernels; widest is 16 with AVX-512, else 8;
    /// the bits do not depend on it), `device_matmul` (`auto`, `tiled` or
    /// `per_output`: the wgpu and cuda matmul kernel; `auto` is tiled on cuda, per-output on
    /// wgpu), `device_collectives` (`auto`, `nccl` or `host`: how cuda ranks move collectives;
    /// `auto` is NCCL where there are as many GPUs as ranks; `nccl` for ranks on several
    /// machines), `device_graphs` (`on` or `off`: whether wgpu and cuda record the capture
    /// pass's regions as device graphs and replay them; on by default), `threads_per_rank` (on
    /// a mesh of threads). `search` varies them and prints what
    /// it found in this form.
    #[arg(long, default_value = "")]
    pub tuning: String,
    /// The element types the step computes in: `f32`, or `bf16-mixed` (torch autocast's
    /// policy: every matmul and attention reads bf16 copies of its operands, accumulates in f32
    /// and rounds its result to bf16, attention's products reading bf16 probabilities as
    /// torch's cpu kernel does; parameters, optimizer state, norms, rope, the loss and every
    /// reduction stay f32). bf16 values are held in f32 slots, so the step takes no less memory
    /// than in f32 yet; on the device backends the matmuls and attention sum in f32 and round
    /// (no tensor cores yet).
    #[arg(long, default_value = "f32")]
    pub precision: String,
}

/// How ranks are started.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// Every rank a thread of this process; collectives through shared memory.
    Threads,
    /// Rank 0 alone, on every core, for one rank's time and memory on a mesh larger than the
    /// machine: collectives move no data (each uses this rank's operand for every member's), so
    /// the losses are no real run's, and nothing is checkpointed.
    Fake,
    /// This process is one rank of an MPI job (`mpirun -np N graphtrain ... --launcher mpi`):
    /// collectives over MPI, bitwise the threads launcher's results; rank 0 prints and writes
    /// files.
    Mpi,
}

#[derive(clap::Args, Debug, Default)]
pub struct MeshArgs {
    /// Train on a device mesh, e.g. `dp_shard=2`, `dp_shard=2,tp=2` or
    /// `dp_replicate=2,dp_shard=2` (dimensions dp_replicate, dp_shard and tp; cp, pp and ep are
    /// not built yet): the SPMD train step (FSDP over dp_shard, DDP over dp_replicate, tensor
    /// parallelism over tp) runs on every rank. The config's batch is
    /// the global batch, split over the data ranks; the metric line gives global tokens/s, the
    /// largest rank's memory, and each rank's time blocked in waits (`wait_ms`). Checkpoints
    /// hold whole tensors, as a one-device run's. On wgpu every rank has its own arena on the
    /// one device and its collectives go through host memory; on cuda each rank opens the GPU
    /// of its index and its collectives run on NCCL (built, not yet run on GPUs).
    #[arg(long)]
    pub mesh: Option<String>,
    /// A parallelization plan (RON: parameter name patterns to placements per mesh dimension);
    /// default: FSDP over dp_shard for every parameter, and with tp, Megatron's tensor
    /// parallelism (attention and MLP weights split, norms, embedding and output head
    /// replicated).
    #[arg(long, requires = "mesh")]
    pub plan: Option<PathBuf>,
    /// Compute threads of each rank (default: this machine's cores divided among the ranks, at
    /// least one).
    #[arg(long, requires = "mesh")]
    pub threads_per_rank: Option<usize>,
    /// How the ranks start: `threads` (every rank a thread of this process, the default), `mpi`
    /// (this process is one rank of an MPI job started by mpirun or srun; its world size must
    /// be the mesh's) or `fake` (rank 0 alone with collectives that move no data: one rank's
    /// step time and memory on a mesh far larger than this machine; its losses are no real
    /// run's).
    #[arg(long, value_enum, requires = "mesh")]
    pub launcher: Option<Launcher>,
    /// Emulate a network on mesh dimensions (threads launcher): `tp=GBPS:LATENCY_US,...`, e.g.
    /// `dp_shard=1:20` holds each collective over dp_shard for 20 µs plus the bytes a rank
    /// sends under a ring algorithm at 1 GB/s after its data has met, while compute goes on.
    /// What overlap is measured with on one machine.
    #[arg(long, requires = "mesh")]
    pub link: Option<String>,
}

impl MeshArgs {
    /// The mesh run the flags ask for, if any.
    pub fn mesh_run(&self) -> Result<Option<crate::trainer::MeshRun>, String> {
        self.mesh_run_tuned(&Tuning::default())
    }

    /// `mesh_run`, its threads per rank from `tuning` where it sets them.
    fn mesh_run_tuned(&self, tuning: &Tuning) -> Result<Option<crate::trainer::MeshRun>, String> {
        let Some(text) = &self.mesh else {
            if tuning.threads_per_rank.is_some() {
                return Err("--tuning threads_per_rank: needs --mesh".into());
            }
            return Ok(None);
        };
        let mesh = parse_mesh(text)?;
        let plan = load_plan(self.plan.as_deref(), &mesh)?;
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let launch = match self.launcher {
            Some(Launcher::Fake) => crate::trainer::Launch::FakeRankZero,
            Some(Launcher::Mpi) => {
                let rank = crate::trainer::mpi_rank().map_err(|e| e.to_string())?;
                let _ = MPI_RANK.set(rank);
                crate::trainer::Launch::Mpi
            }
            Some(Launcher::Threads) | None => crate::trainer::Launch::Threads,
        };
        let threads_per_rank = match (tuning.threads_per_rank.or(self.threads_per_rank), launch) {
            (Some(_), crate::trainer::Launch::FakeRankZero) => {
                return Err(
                    "--threads-per-rank: with --launcher fake rank 0 runs alone on every core"
                        .into(),
                )
            }
            (None, crate::trainer::Launch::FakeRankZero) => cores,
            // The cores shared among this machine's ranks of the job (OpenMPI says how many).
            (None, crate::trainer::Launch::Mpi) => {
                let local = std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
                    .ok()
                    .and_then(|s| s.parse::<usize>().ok())
                    .unwrap_or(1);
                (cores / local.max(1)).max(1)
            }
            (Some(0), _) => return Err("--threads-per-rank must be at least 1".into()),
            (Some(n), _) => n,
            (None, _) => (cores / mesh.world_size()).max(1),
        };
        let links = match &self.link {
            None => Vec::new(),
            Some(_) if launch != crate::trainer::Launch::Threads => {
                return Err(
                    "--link emulates a network between threads: use it with --launcher threads"
                        .into(),
                )
            }
            Some(text) => parse_links(text, &mesh)?,
        };
        Ok(Some(crate::trainer::MeshRun {
            mesh,
            plan,
            threads_per_rank,
            launch,
            links,
        }))
    }
}

fn positive_gflops(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v.is_finite() && v > 0.0 => Ok(v),
        _ => Err(format!("`{s}` is not a positive number of GFLOP/s")),
    }
}

/// A trainer built from the shared flags, with what went into it.
struct Setup {
    /// What the text data is, for the run's log (none for synthetic data).
    data_report: Option<String>,
    /// The text data's tokenizer, when known: for samples, and carried in checkpoints.
    tokenizer: Option<TextTokenizer>,
    /// Resident memory just before the step was loaded onto its backend.
    rss_before_load: Option<usize>,
    cfg: Llama3Config,
    optim: OptimConfig,
    trainer: Trainer,
    /// Lowering and loading on the backend (kernel JIT happens in the first step).
    load_time: Duration,
    /// The mesh the ranks run on, with `--mesh`.
    mesh: Option<crate::trainer::MeshRun>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum LoweringMode {
    Fused,
    Eager,
}

impl LoweringMode {
    fn mode(self) -> Mode {
        match self {
            LoweringMode::Fused => Mode::Fused,
            LoweringMode::Eager => Mode::Eager,
        }
    }
}

/// The runtime settings the environment gives: `GRAPHTRAIN_PROFILE` (`1`: time every step by
/// kind; `steps`: each step on its own line; `0`: off), `GRAPHTRAIN_GEMM_KERNEL` (`avx512`,
/// `avx2` or `scalar`: a narrower GEMM kernel, for benchmarking it; `widest`),
/// `GRAPHTRAIN_MEMORY_LIMIT_MIB` (host memory a run may allocate, instead of what the OS reports
/// available), `GRAPHTRAIN_DEVICE_BUFFER_MIB` (the most one wgpu or cuda buffer may hold, below
/// the device's limit: a larger arena is split across buffers), `GRAPHTRAIN_COLLECTIVE_TIMEOUT_S`
/// and `GRAPHTRAIN_FLIGHT_DIR`. A value a variable does not take is an error naming it; an empty
/// one is the variable unset. The CLI is the only place that reads them; the library is given
/// them.
fn runtime_options_from_env() -> Result<RuntimeOptions, String> {
    // Set to nothing is the same as unset.
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
    // `least`: the smallest number of MiB the setting takes.
    let mib = |name: &str, least: usize| -> Result<Option<usize>, String> {
        match var(name) {
            None => Ok(None),
            Some(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&mib| mib >= least)
                .and_then(|mib| mib.checked_mul(1 << 20))
                .map(Some)
                .ok_or_else(|| {
                    format!("{name}=`{v}` is not a whole number of MiB, at least {least}")
                }),
        }
    };
    let memory_limit_bytes = mib("GRAPHTRAIN_MEMORY_LIMIT_MIB", 0)?;
    let profile = var("GRAPHTRAIN_PROFILE")
        .map(|v| {
            Profile::from_setting(v.trim())
                .ok_or_else(|| format!("GRAPHTRAIN_PROFILE=`{v}`: takes 1, steps or 0"))
        })
        .transpose()?
        .unwrap_or(Profile::Off);
    let gemm_kernel = var("GRAPHTRAIN_GEMM_KERNEL")
        .map(|v| {
            GemmKernel::from_setting(v.trim()).ok_or_else(|| {
                format!(
                    "GRAPHTRAIN_GEMM_KERNEL=`{v}`: takes {}",
                    GemmKernel::SETTINGS
                )
            })
        })
        .transpose()?
        .unwrap_or(GemmKernel::Widest);
    let collective_timeout = var("GRAPHTRAIN_COLLECTIVE_TIMEOUT_S")
        .map(|v| {
            v.trim()
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(std::time::Duration::from_secs_f64)
                .ok_or_else(|| {
                    format!(
                        "GRAPHTRAIN_COLLECTIVE_TIMEOUT_S=`{v}` is not a positive number of seconds"
                    )
                })
        })
        .transpose()?;
    Ok(RuntimeOptions {
        profile,
        gemm_kernel,
        memory_limit_bytes,
        timeline: false,
        map_vector: Default::default(),
        device_matmul: Default::default(),
        device_collectives: Default::default(),
        device_graphs: Default::default(),
        device_buffer_bytes: mib("GRAPHTRAIN_DEVICE_BUFFER_MIB", 1)?,
        // The launcher's index of this process on its machine picks its GPU (OpenMPI, MPICH,
        // Slurm); without one, a rank's index does.
        device_index: [
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "SLURM_LOCALID",
        ]
        .iter()
        .find_map(|name| var(name).and_then(|v| v.parse().ok())),
        collective_timeout,
        flight_dir: var("GRAPHTRAIN_FLIGHT_DIR").map(std::path::PathBuf::from),
    })
}

/// The batches `--data` (with the text flags and `--vocab-size`) asks for, for model `cfg`;
/// for text, also a line saying what was read, cached and split, and the tokenizer.
pub fn data_source(
    data: &DataArg,
    flags: &TextDataArgs,
    vocab_size: Option<usize>,
    cfg: &Llama3Config,
) -> Result<(DataSource, Option<String>, Option<TextTokenizer>), String> {
    let path = match data {
        DataArg::Random | DataArg::Fixed => {
            if let Some(flag) = flags.any_given(vocab_size) {
                return Err(format!(
                    "{flag} applies to text data (--data PATH), not to --data {}",
                    data
                ));
            }
            let source = match data {
                DataArg::Random => DataSource::Random,
                _ => DataSource::Fixed,
            };
            return Ok((source, None, None));
        }
        DataArg::Path(p) => p,
    };
    let vocab_size = vocab_size.unwrap_or(cfg.vocab_size);
    if vocab_size > cfg.vocab_size {
        return Err(format!(
            "--vocab-size {vocab_size} is larger than the model config's vocab_size {}",
            cfg.vocab_size
        ));
    }
    let opts = flags.options(path, vocab_size)?;
    let (tokens, report) = prepare_tokens(&opts)?;
    let text = TextData::new(tokens, cfg.seq_len, flags.val_fraction)
        .map_err(|e| format!("--data {}: {e}", path.display()))?;
    if text.vocab_size() > cfg.vocab_size {
        return Err(format!(
            "--data {}: the tokenizer's vocab size {} is larger than the model config's vocab_size {}",
            path.display(),
            text.vocab_size(),
            cfg.vocab_size
        ));
    }
    let mut line = format!(
        "data: {} | {}{} tokens, {} rows of {} (train {}, val {}) | tokenizer {}, vocab {} | tokens {}",
        path.display(),
        match report.documents {
            Some(d) => format!("{d} documents, "),
            None => String::new(),
        },
        text.tokens().len(),
        text.train_rows() + text.val_rows(),
        cfg.seq_len + 1,
        text.train_rows(),
        text.val_rows(),
        report.tokenizer,
        text.vocab_size(),
        report.tokens
    );
    if text.vocab_size() < cfg.vocab_size {
        line += &format!(
            "\nnote: the tokenizer has {} tokens, the model's vocab_size is {}: the other embedding rows stay unused",
            text.vocab_size(),
            cfg.vocab_size
        );
    }
    Ok((
        DataSource::Text(std::sync::Arc::new(text)),
        Some(line),
        report.tokenizer_used,
    ))
}

impl TrainArgs {
    /// Validates the flags, builds the step through the pipeline and initializes the trainer.
    fn setup(&self, registry: &Registry) -> Result<Setup, String> {
        let tp_link = tp_link(self.mesh.link.as_deref());
        self.setup_with(self.passes.pipeline(registry, tp_link.as_deref())?)
    }

    /// `--precision`, checked.
    pub(crate) fn precision(&self) -> Result<Precision, String> {
        Precision::parse(&self.precision).map_err(|e| format!("--precision: {e}"))
    }

    /// The GEMM kernel: `--tuning`'s `gemm`, else `GRAPHTRAIN_GEMM_KERNEL`'s.
    pub(crate) fn gemm_kernel(&self) -> Result<GemmKernel, String> {
        let tuned = self.tuning_with("")?.gemm;
        Ok(tuned.unwrap_or(runtime_options_from_env()?.gemm_kernel))
    }

    /// `--tuning`, then `more` (later entries win).
    pub(crate) fn tuning_with(&self, more: &str) -> Result<Tuning, String> {
        Tuning::parse(&format!("{},{more}", self.tuning)).map_err(|e| format!("--tuning {e}"))
    }

    /// The batches' source; for text, also a line saying what was read, cached and split.
    fn data_source(
        &self,
        cfg: &Llama3Config,
    ) -> Result<(DataSource, Option<String>, Option<TextTokenizer>), String> {
        data_source(&self.data, &self.text, self.vocab_size, cfg)
    }

    /// `setup` with another pipeline than the flags give.
    fn setup_with(&self, pipeline: Pipeline) -> Result<Setup, String> {
        self.setup_tuned(pipeline, &self.tuning_with("")?)
    }

    /// `setup_with` under `tuning` instead of `--tuning`.
    fn setup_tuned(&self, pipeline: Pipeline, tuning: &Tuning) -> Result<Setup, String> {
        let cfg = model_with_batch(&self.model, self.batch)?;
        LrSchedule::constant(self.lr).check()?;
        let optim = self.optim.config()?;
        let backend: Backend = self.backend.parse()?;
        if let Some(why) = backend.unavailable() {
            return Err(why);
        }
        if tuning.gemm.is_some() && backend != Backend::Cpu {
            return Err(format!(
                "--tuning gemm: the GEMM kernel is the cpu backend's; --backend {backend} has its own"
            ));
        }
        if tuning.map_vector.is_some() && backend != Backend::Cpu {
            return Err(format!(
                "--tuning map_vector: the lanes of the cpu backend's map kernels; --backend {backend} chooses its own"
            ));
        }
        if tuning.device_collectives.is_some() && backend != Backend::Cuda {
            return Err(format!(
                "--tuning device_collectives: how cuda ranks move collectives; --backend {backend} moves them through host memory"
            ));
        }
        if tuning.device_matmul.is_some() && !matches!(backend, Backend::Wgpu | Backend::Cuda) {
            return Err(format!(
                "--tuning device_matmul: the kernel is the device backends' (wgpu, cuda); --backend {backend} has its own"
            ));
        }
        if tuning.device_graphs.is_some() && !matches!(backend, Backend::Wgpu | Backend::Cuda) {
            return Err(format!(
                "--tuning device_graphs: device graphs are the device backends' (wgpu, cuda); --backend {backend} replays captured regions its own way"
            ));
        }
        let mesh = self.mesh.mesh_run_tuned(tuning)?;
        if mesh.is_some() && backend == Backend::Reference {
            return Err(
                "--mesh runs on cpu, wgpu and cuda; the reference interpreter runs meshes in tests only"
                    .into(),
            );
        }
        let (data, data_report, tokenizer) = self.data_source(&cfg)?;
        let from_env = runtime_options_from_env()?;
        let trainer = Trainer::build_on(
            &cfg,
            TrainConfig {
                data,
                seed: self.seed,
                lr: LrSchedule::constant(self.lr),
                optim,
            },
            backend,
            &CompileOptions {
                pipeline: &pipeline,
                mode: self.lowering.mode(),
                fusion: tuning.fusion,
                runtime: RuntimeOptions {
                    gemm_kernel: tuning.gemm.unwrap_or(from_env.gemm_kernel),
                    map_vector: tuning.map_vector.unwrap_or(from_env.map_vector),
                    device_matmul: tuning.device_matmul.unwrap_or(from_env.device_matmul),
                    device_graphs: tuning.device_graphs.unwrap_or(from_env.device_graphs),
                    device_collectives: tuning
                        .device_collectives
                        .unwrap_or(from_env.device_collectives),
                    ..from_env
                },
                precision: self.precision()?,
            },
            mesh.as_ref(),
        )
        .map_err(|e| e.to_string())?;
        let rss_before_load = trainer.rss_before_load;
        let load_time = trainer.timings.lower + trainer.timings.load;
        Ok(Setup {
            data_report,
            tokenizer,
            rss_before_load,
            cfg,
            optim,
            trainer,
            load_time,
            mesh,
        })
    }
}

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    /// Train until this step (with --resume, steps already done count).
    #[arg(long, default_value_t = 10)]
    pub steps: u64,
    /// Warm the lr up linearly over this many steps: --lr / N at step 1, --lr at step N.
    #[arg(long, default_value_t = 0)]
    pub lr_warmup: u64,
    /// After the warm-up, keep --lr (`none`) or decay it to --lr-min-ratio x --lr at the last
    /// step, --steps (`linear`, or half a `cosine`). The lr of a step depends on its number and
    /// these flags alone, so --resume continues the schedule where it stopped, given the same
    /// flags (a checkpoint records its schedule, and a resume under another one says so).
    #[arg(long, value_enum, default_value_t = Decay::None)]
    pub lr_decay: Decay,
    /// Where --lr-decay ends, as a fraction of --lr.
    #[arg(long, default_value_t = 0.1)]
    pub lr_min_ratio: f64,
    /// Save parameters, optimizer state and the step count to this file (atomically) at the end,
    /// every --checkpoint-every steps, and with the last good state when a step fails. The file
    /// is safetensors: one tensor per parameter and optimizer-state tensor under the graph's
    /// names; its metadata holds the run (config, seed, data, optimizer), the step count, the
    /// data position, the graph fingerprint and a checksum of every tensor and of the metadata.
    /// With --launcher mpi it is a directory instead: each rank writes its own parts, and a
    /// manifest written once all have commits them (a sharded checkpoint). No state is saved
    /// after a failed step under MPI: the ranks that failed cannot take part.
    #[arg(long)]
    pub checkpoint: Option<PathBuf>,
    /// Also save the checkpoint every N steps (0: only at the end or on failure).
    #[arg(long, default_value_t = 0, requires = "checkpoint")]
    pub checkpoint_every: u64,
    /// Continue from a checkpoint of the same run (same config, seed, data and optimizer).
    /// Checkpoints are safetensors files whose every tensor and metadata entry is checksummed:
    /// a changed, truncated or foreign file is refused, naming what changed. A checkpoint from
    /// another pass pipeline resumes (state is matched by name); the differing graph
    /// fingerprint is printed. A sharded checkpoint (a directory an MPI run wrote) resumes on
    /// any mesh, launcher or one device: its parts are assembled into whole tensors.
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Write every trained step's batch to this file, for replay in another framework: raw
    /// little-endian u32 token ids, one [batch, seq+1] block per step (the row's tokens plus its
    /// last target), in step order. The file is emptied first; with --resume, block 0 is the
    /// first step after the resume point. A batch whose targets are not its tokens shifted by
    /// one cannot be written this way and stops the run with an error.
    #[arg(long)]
    pub dump_batches: Option<PathBuf>,
    /// Start from these parameters instead of the seed's: a safetensors file with every
    /// parameter under the graph's names (what --init-out writes; F32, BF16 or F16, widened
    /// exactly), a Hugging Face Llama model folder (transformers' names mapped; with
    /// `--config FOLDER`), or a graphtrain checkpoint (file or sharded folder), of which only the
    /// parameters are taken: the run starts at step 1 with fresh optimizer state, e.g. to
    /// fine-tune on other data; a checkpoint of a run on text brings its tokenizer, which
    /// tokenizes --data PATH unless --tokenizer is given. --seed still draws the data. A missing
    /// parameter, a shape that differs, a tensor the step does not have or a non-finite value
    /// is an error naming it. Not with --resume, which restores parameters and optimizer
    /// state.
    #[arg(long, conflicts_with = "resume")]
    pub init: Option<PathBuf>,
    /// Write the initial parameters (before step 1) to this safetensors file, F32, under the
    /// graph's names (torchtitan's, e.g. `layers.0.attention.wq.weight`, Linear weights
    /// [out, in]). The PyTorch peer (../shared/peers/torch/llama_step.py --init) has the layout
    /// of the `peer`-shaped configs only (rotate-half RoPE, no GQA). Not with --resume: the
    /// parameters are then no longer the initial ones.
    #[arg(long, conflicts_with = "resume")]
    pub init_out: Option<PathBuf>,
    /// Write one JSON line per step (schema `graphtrain.metrics/1`, flushed as each step ends)
    /// to this file: created afresh, appended to with --resume. `graphtrain plot` draws it.
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    #[command(flatten)]
    pub trace: TraceOutArgs,
    #[command(flatten)]
    pub eval: EvalArgs,
}

impl RunArgs {
    /// The lr of every step the flags describe (unchecked: see `LrSchedule::check`).
    fn lr_schedule(&self) -> LrSchedule {
        LrSchedule {
            peak: self.train.lr,
            warmup: self.lr_warmup,
            decay: self.lr_decay,
            min_ratio: self.lr_min_ratio,
            total: self.steps,
        }
    }
}

/// Validation and a sample during `run` (text data).
#[derive(clap::Args, Debug)]
pub struct EvalArgs {
    /// Validate every N steps, and after the last, on the held-out split of text data: the mean
    /// cross-entropy of a forward-only graph traced from the same model (no backward, no
    /// optimizer) and its perplexity. Default with text data: 100; 0: only after the last step.
    /// Synthetic data (random, fixed) has no held-out split.
    #[arg(long)]
    pub val_every: Option<u64>,
    /// Batches per validation: the first N of the held-out split, always the same ones (0: all).
    #[arg(long, default_value_t = 20)]
    pub val_batches: usize,
    /// After the last step, print a sample of N tokens continuing --prompt (text data whose
    /// tokenizer is known).
    #[arg(long, default_value_t = 0)]
    pub sample_tokens: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// How samples are drawn (`run --sample-tokens`, `generate`).
#[derive(clap::Args, Debug)]
pub struct SamplingArgs {
    /// The text a sample continues.
    #[arg(long, default_value = "\\n")]
    pub prompt: String,
    /// Softmax temperature; 0 picks the most likely token every time.
    #[arg(long, default_value_t = 0.8)]
    pub temperature: f64,
    /// Draw from the K most likely tokens only (0: all).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Seed of the draws: the same weights, prompt and seed give the same text.
    #[arg(long, default_value_t = 0)]
    pub sample_seed: u64,
}

impl SamplingArgs {
    fn sampling(&self) -> Sampling {
        Sampling {
            temperature: self.temperature,
            top_k: self.top_k,
            seed: self.sample_seed,
        }
    }

    /// The prompt with `\n` written as a newline, as a shell passes it.
    fn prompt(&self) -> String {
        self.prompt.replace("\\n", "\n")
    }
}

/// `graphtrain export`: a checkpoint as a Hugging Face Llama folder.
#[derive(clap::Args, Debug)]
pub struct ExportArgs {
    /// A checkpoint written by `run --checkpoint` (a file or a sharded folder).
    pub checkpoint: PathBuf,
    /// The folder to write (created if missing; its files of those names are replaced).
    #[arg(long)]
    pub out: PathBuf,
    /// How the weights are stored.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: crate::hf::ExportDtype,
}

/// `graphtrain generate`: text from a checkpoint.
#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// A checkpoint written by `run --checkpoint` on text data (it carries its tokenizer).
    #[arg(long)]
    pub checkpoint: PathBuf,
    /// Tokens to generate.
    #[arg(long, default_value_t = 200)]
    pub tokens: usize,
    /// Backend that runs the forward pass (reference, cpu, wgpu, cuda).
    #[arg(long, default_value = "cpu")]
    pub backend: String,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Which step's timeline `run` writes, and where.
#[derive(clap::Args, Debug)]
pub struct TraceOutArgs {
    /// Write one step's timeline as a Chrome trace (chrome://tracing, Perfetto): a complete event
    /// per Program step, named by its graph node and module path, microseconds from the step's
    /// start, pid = rank, tid = lane (0 kernels, 1 host code). That step waits for each of its
    /// steps to time it, so it runs slower than the others. Compiled backends only. On a
    /// --mesh, every rank writes its own file, FILE.rankN.json (collective starts and waits are
    /// host-code events: a wait lasts as long as the rank was blocked and combining).
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    /// Which training step `--trace-out` records (default: the last of the run).
    #[arg(long, requires = "trace_out")]
    pub trace_step: Option<u64>,
}

#[derive(clap::Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub train: TrainArgs,
    /// Measured steps (after the warm-up).
    #[arg(long, default_value_t = 20)]
    pub steps: u64,
    /// Warm-up steps: real training steps, excluded from the speed figures.
    #[arg(long, default_value_t = 3)]
    pub warmup: u64,
    /// Write the summary as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Compare with a second pipeline (same syntax as --passes): both steps are built, warmed
    /// up, then run in alternating pairs for --steps pairs, and the report gives each median and
    /// the median ratio of paired steps (candidate / --passes). Use it to compare pipelines on a
    /// machine whose speed drifts: adjacent steps see the same machine. Both programs are held
    /// at once; --disable-pass and --dump-dir apply to the --passes pipeline only, and --json
    /// writes the paired summary.
    #[arg(long)]
    pub against: Option<String>,
    /// After the measured steps, run one more (not counted) and write its timeline here as a
    /// Chrome trace, as `run --trace-out` does. Compiled backends only.
    #[arg(long, conflicts_with = "against")]
    pub trace_out: Option<PathBuf>,
}

#[derive(clap::Args, Debug)]
pub struct SearchArgs {
    /// The model, data and training flags; --passes is where the search starts (its passes in
    /// the search space's order: canonicalize, cse, egraph, dce, attention_stats, gather_bf16,
    /// ac, offload, merge_matmuls, capture; with --mesh, keep_gathered, bucket, prefetch and
    /// async_tp before merge_matmuls). On a mesh the SPMD step is searched, its ranks threads
    /// of one process.
    #[command(flatten)]
    pub train: TrainArgs,
    /// The search's directory: its log, its lock and the best pipeline. A directory with a log
    /// resumes that search.
    #[arg(long)]
    pub log: PathBuf,
    /// Experiments in all (counting those already logged).
    #[arg(long, default_value_t = 30)]
    pub experiments: usize,
    /// Stop starting experiments after this many minutes.
    #[arg(long)]
    pub minutes: Option<f64>,
    /// Where candidates come from: `neighbour` (one knob of the incumbent changed), `evolution`
    /// (children of the fastest candidates measured), `random` (every knob drawn; the
    /// baseline), or a command (anything with a space or a `/`, run with `sh -c`): it reads the
    /// search's state as JSON on stdin and prints one pipeline (see
    /// autoresearch/examples/propose.py).
    #[arg(long, default_value = "neighbour")]
    pub proposer: String,
    /// Seconds an external proposer may take to answer before it is killed (its experiment is
    /// then logged `invalid`).
    #[arg(long, default_value_t = 60.0)]
    pub proposer_timeout: f64,
    /// The most memory the step may take (bytes, or with KiB, MiB or GiB): pipelines whose
    /// planned arena is larger are logged `over-cap` and never timed; the search answers "the
    /// fastest pipeline that fits".
    #[arg(long)]
    pub memory_cap: Option<String>,
    /// Time every candidate, even those predicted to do more arithmetic in no fewer nodes.
    #[arg(long)]
    pub no_prefilter: bool,
    /// What is measured: `measured` (training steps on this machine), `sim:HARDWARE` (steps
    /// predicted by `graphtrain sim` on `h100-sxm`, `h200`, `a100-sxm`, a hardware RON file or
    /// `this-cpu`, with as many nodes as the mesh needs; the numerics gate then runs on `tiny`)
    /// or `synthetic:SEED` (a seeded model of pass effects with a known optimum, for testing the
    /// search and comparing proposers; `synthetic:SEED:DELAY_MS` makes each timed pair take
    /// DELAY_MS).
    #[arg(long, default_value = "measured")]
    pub objective: String,
    /// Seed of every random choice (with the experiment's number).
    #[arg(long, default_value_t = 0)]
    pub search_seed: u64,
    /// Every this many experiments, time the incumbent against itself and log whether the keep
    /// rule would have kept it (0: never).
    #[arg(long, default_value_t = 10)]
    pub aa_every: usize,
    /// The smallest speedup worth keeping (0.02: a candidate must be estimated at least 2%
    /// faster, with its 95% interval above 1).
    #[arg(long, default_value_t = 0.02)]
    pub min_effect: f64,
    /// Steps the numerics gate trains each candidate against the unoptimized step.
    #[arg(long, default_value_t = 3)]
    pub numerics_steps: u64,
    /// Seconds the worker process that compiles and times candidates may take over one
    /// question (a prediction, the numerics gate, or one look's pairs) before it is killed and
    /// the experiment logged `crash`.
    #[arg(long, default_value_t = 600.0)]
    pub worker_timeout: f64,
}

/// `TrainArgs`' trainer for `pipeline` (for `graphtrain search`).
pub(crate) fn trainer_for(
    args: &TrainArgs,
    pipeline: Pipeline,
    tuning: &Tuning,
) -> Result<Trainer, String> {
    Ok(args.setup_tuned(pipeline, tuning)?.trainer)
}

fn search(a: SearchArgs, registry: &Registry) -> Result<(), String> {
    use graphtrain_autoresearch::{journal::Journal, propose, search::Search, space::Space};
    if a.train.backend != "cpu" {
        return Err("search measures the cpu backend only so far".into());
    }
    let on_mesh = a.train.mesh.mesh.is_some();
    if on_mesh && !matches!(a.train.mesh.launcher, None | Some(Launcher::Threads)) {
        return Err(
            "search on a mesh runs its ranks as threads of one process (--launcher threads)".into(),
        );
    }
    // The mesh's flags are checked here, where a mistake is one error.
    a.train.mesh.mesh_run()?;
    a.train.tuning_with("")?;
    // Settings are measured on this machine; the synthetic objective models passes only.
    let space = match a.objective.as_str() {
        "measured" => Space::builtin_with_settings(on_mesh),
        _ => Space::builtin(on_mesh),
    };
    space.check(|p| registry.info(p).is_some() || crate::tuning::SETTINGS.contains(&p))?;
    let start_list = PipelineSpec::parse_list(&a.train.passes.passes)?
        .passes
        .iter()
        .map(|p| match &p.option {
            Some(o) => format!("{}={o}", p.name),
            None => p.name.clone(),
        })
        .collect::<Vec<_>>()
        .join(",");
    let start = space
        .parse(if start_list.is_empty() {
            "none"
        } else {
            &start_list
        })
        .map_err(|e| format!("--passes as a start of the search: {e}"))?;
    if !(a.proposer_timeout > 0.0 && a.proposer_timeout.is_finite()) {
        return Err("--proposer-timeout must be a number of seconds above 0".into());
    }
    let mut proposer = propose::by_name(
        &a.proposer,
        std::time::Duration::from_secs_f64(a.proposer_timeout),
    )?;
    let memory_cap = a
        .memory_cap
        .as_deref()
        .map(|c| {
            graphtrain_passes::schedule::parse_bytes(c)
                .map(|b| b as u64)
                .map_err(|e| format!("--memory-cap `{c}`: {e}"))
        })
        .transpose()?;
    if !(a.worker_timeout > 0.0 && a.worker_timeout.is_finite()) {
        return Err("--worker-timeout must be a number of seconds above 0".into());
    }
    // Checked here, where a mistake is one error, not a crash logged per experiment.
    model_with_batch(&a.train.model, a.train.batch)?;
    a.train.optim.config()?;
    let mut objective: Box<dyn graphtrain_autoresearch::search::Objective + '_> =
        match a.objective.as_str() {
            "measured" => Box::new(crate::search::Supervised::new(
                worker_args()?,
                std::time::Duration::from_secs_f64(a.worker_timeout),
                a.log.join("worker.log"),
            )),
            sim if sim.starts_with("sim:") => Box::new(sim_objective(&a, registry)?),
            other => Box::new(synthetic_objective(other, &space)?),
        };
    let mut journal = Journal::open(&a.log)?;
    let resumed = journal.lines.len();
    if resumed > 0 {
        say!(
            "resuming the search in {} after {resumed} experiments",
            a.log.display()
        );
    }
    if !(0.0..1.0).contains(&a.min_effect) {
        return Err(format!(
            "--min-effect {}: a fraction from 0 (any significant gain) to below 1",
            a.min_effect
        ));
    }
    let s = Search {
        space,
        rule: graphtrain_autoresearch::stats::KeepRule {
            min_effect: a.min_effect,
            ..Default::default()
        },
        seed: a.search_seed,
        experiments: a.experiments,
        aa_every: a.aa_every,
        start,
        deadline: a
            .minutes
            .map(|m| Instant::now() + std::time::Duration::from_secs_f64(m.max(0.0) * 60.0)),
        memory_cap,
        prefilter: !a.no_prefilter,
    };
    let out = s.run(
        &mut journal,
        proposer.as_mut(),
        objective.as_mut(),
        |l, incumbent| {
            let measured = if l.pairs > 0 {
                format!(
                    "ratio {:.3} [{:.3}, {:.3}] over {} pairs",
                    l.ratio, l.lo, l.hi, l.pairs
                )
            } else {
                l.description.clone()
            };
            say!(
                "experiment {:>3}/{} {:<11} {}  {measured}\n    incumbent: {incumbent}",
                l.experiment + 1,
                a.experiments,
                l.status,
                l.pipeline,
            );
        },
    )?;
    let chart = a.log.join("progress.png");
    if let Err(e) = crate::plot::plot_search(std::slice::from_ref(&a.log), &chart) {
        say!("no progress chart: {e}");
    }
    if !out.fits {
        let smallest = match &out.smallest_peak {
            Some((peak, p)) => format!(
                "the smallest predicted peak was {} (`{p}`)",
                gib(*peak as usize)
            ),
            None => "no pipeline was predicted".into(),
        };
        return Err(format!(
            "no pipeline tried fits under --memory-cap {}: {smallest}; the log is in {}",
            gib(memory_cap.unwrap_or(0) as usize),
            a.log.display()
        ));
    }
    let (passes, settings) = crate::tuning::split(&out.incumbent);
    let spec = PipelineSpec::parse_list(&passes)?;
    let best = a.log.join("best.ron");
    let body = ron::ser::to_string_pretty(&spec, ron::ser::PrettyConfig::default())
        .map_err(|e| format!("cannot write the pipeline: {e}"))?;
    std::fs::write(&best, body).map_err(|e| format!("cannot write `{}`: {e}", best.display()))?;
    say!(
        "best pipeline: {} ({} kept{}), predicted peak {}; A/A checks: {} of {} would have been kept; wrote {} and {}",
        out.incumbent,
        out.kept,
        if out.exhausted {
            ", no untried candidate left to draw"
        } else {
            ""
        },
        gib(out.incumbent_peak as usize),
        out.aa_keeps,
        out.aa_runs,
        best.display(),
        chart.display()
    );
    for p in &spec.passes {
        if let Some(info) = registry.info(&p.name) {
            say!("  {}: {}", p.name, info.contract);
        }
    }
    if !settings.is_empty() {
        let tuning = match a.train.tuning.as_str() {
            "" => settings.clone(),
            base => format!("{base},{settings}"),
        };
        say!(
            "  settings: train with `--pipeline {} --tuning {tuning}` (best.ron holds the passes)",
            best.display()
        );
    }
    if let (Some(cap), "measured") = (memory_cap, a.objective.as_str()) {
        // The cap was checked on the plan; the backend's arena after a step is the measurement.
        drop(objective);
        let tuning = a.train.tuning_with(&settings)?;
        let mut trainer = trainer_for(&a.train, spec.build(registry)?, &tuning)?;
        let m = trainer.step().map_err(|e| e.to_string())?;
        say!(
            "measured: the best pipeline's step held {} on the cpu backend, {} the cap of {}",
            gib(m.peak_bytes),
            if m.peak_bytes as u64 <= cap {
                "within"
            } else {
                "ABOVE"
            },
            gib(cap as usize)
        );
        if m.peak_bytes as u64 > cap {
            return Err("the best pipeline's measured memory is above --memory-cap".into());
        }
    }
    Ok(())
}

/// This process's arguments with `search` as `search-worker`: the worker sees every flag the
/// search was given.
fn worker_args() -> Result<Vec<OsString>, String> {
    let mut args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let at = args.iter().position(|a| a == "search").ok_or_else(|| {
        "search's worker takes this process's `search` arguments, and there is no `search` among them"
            .to_string()
    })?;
    args[at] = "search-worker".into();
    Ok(args)
}

/// `graphtrain search-worker`: what `search` supervises.
fn search_worker(a: SearchArgs, registry: &Registry) -> Result<(), String> {
    let cfg = model_with_batch(&a.train.model, a.train.batch)?;
    let optim = a.train.optim.config()?;
    let mesh = a.train.mesh.mesh_run()?;
    let mut measured =
        crate::search::Measured::new(&a.train, registry, cfg, mesh, &optim, a.numerics_steps, 2)?;
    crate::search::serve(&mut measured)
}

/// `sim:HARDWARE`: the simulator as the search's objective, on the model's step (on the
/// search's mesh) with as many nodes as the mesh needs.
fn sim_objective<'r>(
    a: &SearchArgs,
    registry: &'r Registry,
) -> Result<crate::sim::objective::Simulated<'r>, String> {
    let name = a.objective.trim_start_matches("sim:");
    if a.train.mesh.link.is_some() {
        return Err(
            "--link emulates a link for measured runs; --objective sim uses the hardware's links"
                .into(),
        );
    }
    let hardware = if name == "this-cpu" {
        crate::sim::calibrate::this_cpu()?.hardware
    } else {
        crate::sim::hardware::Hardware::load(name)?
    };
    let model = model_with_batch(&a.train.model, a.train.batch)?;
    let optim = a.train.optim.config()?;
    let precision = a.train.precision()?;
    let run = a.train.mesh.mesh_run()?;
    let on_mesh = run.as_ref().map(|run| (&run.mesh, &run.plan));
    let traced = crate::trainer::build_step_on(&model, on_mesh, &optim, precision)
        .map_err(|e| e.to_string())?;
    let world = run.as_ref().map_or(1, |r| r.mesh.world_size());
    let nodes = world.div_ceil(hardware.gpus_per_node).max(1);
    let objective = crate::sim::objective::Simulated::new(
        registry,
        hardware,
        crate::sim::Links::Hardware,
        nodes,
        traced.step.graph,
        precision,
    )?;
    say!(
        "objective: steps simulated on {name} ({nodes} node(s)); numerics checked on {}",
        objective.gate_description()
    );
    Ok(objective)
}

/// `synthetic:SEED[:DELAY_MS]`: the seeded synthetic objective over `space`.
fn synthetic_objective(
    spec: &str,
    space: &graphtrain_autoresearch::space::Space,
) -> Result<graphtrain_autoresearch::synthetic::Synthetic, String> {
    let bad = || {
        format!("--objective `{spec}`: expected `measured`, `synthetic:SEED` or `synthetic:SEED:DELAY_MS`")
    };
    let rest = spec.strip_prefix("synthetic:").ok_or_else(bad)?;
    let mut parts = rest.split(':');
    let seed: u64 = parts.next().and_then(|p| p.parse().ok()).ok_or_else(bad)?;
    let delay_ms: u64 = match parts.next() {
        Some(p) => p.parse().map_err(|_| bad())?,
        None => 0,
    };
    if parts.next().is_some() {
        return Err(bad());
    }
    let mut s = graphtrain_autoresearch::synthetic::Synthetic::random(space.clone(), seed, 0.1);
    s.delay = std::time::Duration::from_millis(delay_ms);
    Ok(s)
}

/// Parses `args` (program name first), runs the command with the built-in passes, prints errors,
/// returns the exit code.
pub fn main<I, T>(args: I) -> ExitCode
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    main_with(args, Registry::builtin())
}

/// `main` with a caller-supplied pass registry: how an out-of-tree pass plugin ships its own
/// `graphtrain` binary (see examples/plugin-pass).
pub fn main_with<I, T>(args: I, registry: Registry) -> ExitCode
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
    // Without RUST_LOG: errors only, less wgpu's OpenGL probe, which fails on every machine
    // without a GL driver and logs that as an error, though wgpu then uses Vulkan.
    // With RUST_LOG, spans are logged as they close, with their time: how a compile stage or a
    // step shows its duration.
    let (filter, span_events) = match tracing_subscriber::EnvFilter::try_from_default_env() {
        Ok(filter) => (filter, tracing_subscriber::fmt::format::FmtSpan::CLOSE),
        Err(_) => (
            tracing_subscriber::EnvFilter::new("error,wgpu_hal::gles=off"),
            tracing_subscriber::fmt::format::FmtSpan::NONE,
        ),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_span_events(span_events)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    match run_command(cli.command, &registry) {
        Ok(()) => {
            // An MPI rank finalizes MPI before it exits, or `mpirun` counts it as failed.
            #[cfg(feature = "mpi")]
            graphtrain_runtime::mpi_comm::finish();
            ExitCode::SUCCESS
        }
        Err(e) => match mpi_rank_of_this_process() {
            Some(rank) => {
                // Its MPI thread may be blocked in a collective with a stuck rank: leave
                // without finalizing, which makes `mpirun` end every rank of the job.
                eprintln!("error: rank {rank}: {e}");
                std::process::exit(1)
            }
            None => {
                eprintln!("error: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

/// This process's rank when it runs as one rank of an MPI job (`--launcher mpi`).
static MPI_RANK: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

fn mpi_rank_of_this_process() -> Option<usize> {
    MPI_RANK.get().copied()
}

/// Whether a progress bar may be drawn (on a terminal): not in an MPI job, whose launcher
/// gives every rank a terminal and interleaves them.
pub(crate) fn draws_progress() -> bool {
    mpi_rank_of_this_process().is_none()
}

/// Whether this process writes files and prints step lines: always, except on the ranks other
/// than 0 of an MPI job (rank 0 speaks for the job).
pub(crate) fn speaks_for_the_job() -> bool {
    mpi_rank_of_this_process().is_none_or(|r| r == 0)
}

/// Runs one parsed command.
pub fn run_command(command: Command, registry: &Registry) -> Result<(), String> {
    match command {
        Command::Trace(a) => trace(a, registry),
        Command::Run(a) => run(a, registry),
        Command::Bench(a) => bench(a, registry),
        Command::Search(a) => search(a, registry),
        Command::SearchWorker(a) => search_worker(a, registry),
        Command::Passes(c) => passes_command(c, registry),
        Command::Sim(a) => sim(a, registry),
        Command::Autoshard(a) => autoshard(a, registry),
        Command::Check { file } => check(file),
        Command::Plot(a) => plot(a),
        Command::Generate(a) => generate(a),
        Command::Export(a) => {
            let ckpt = crate::sharded::load_any(&a.checkpoint)?;
            let wrote = crate::hf::export(ckpt, &a.out, a.dtype)
                .map_err(|e| format!("export {}: {e}", a.checkpoint.display()))?;
            say!("wrote {}: {wrote}", a.out.display());
            Ok(())
        }
        Command::Tokenizer(c) => tokenizer_command(c),
        Command::Data(c) => data_command(c),
        Command::Config(ConfigCommand::Show { name }) => {
            let hf = crate::config::hf_config_path(&name).is_some();
            let cfg = match Llama3Config::builtin(&name) {
                Some(cfg) => cfg,
                None if hf => crate::config::load_config(&name)?,
                None => {
                    return Err(format!(
                    "unknown config `{name}`; built-in configs: {}; or a transformers config.json",
                    LLAMA3_CONFIGS.join(", ")
                ))
                }
            };
            say_raw!("{}", config_to_ron(&cfg));
            say!();
            Ok(())
        }
        Command::Config(ConfigCommand::List) => {
            for name in LLAMA3_CONFIGS {
                let cfg = Llama3Config::builtin(name).expect("listed configs exist");
                let params = cfg.num_params() as f64;
                let params = if params >= 1e9 {
                    format!("{:.2}B", params / 1e9)
                } else {
                    format!("{:.2}M", params / 1e6)
                };
                say!(
                    "{name:>6}: dim {} layers {} heads {}/{} kv, vocab {}, ffn {}, batch {} x seq {}, {params} params",
                    cfg.dim,
                    cfg.n_layers,
                    cfg.n_heads,
                    cfg.n_kv_heads,
                    cfg.vocab_size,
                    cfg.ffn_hidden,
                    cfg.batch,
                    cfg.seq_len
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

const MIB: f64 = 1024.0 * 1024.0;

/// Buffer offsets are aligned for 512-bit vector loads.
pub(crate) const ARENA_ALIGNMENT: usize = 64;

fn gib(bytes: usize) -> String {
    let b = bytes as f64;
    if b >= 1024.0 * 1024.0 * 1024.0 {
        format!("{:.2} GiB", b / (1024.0 * 1024.0 * 1024.0))
    } else {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    }
}

/// The `GBPS:LATENCY_US` that `--link` gives `tp`, if any (checked with the mesh later).
fn tp_link(link: Option<&str>) -> Option<String> {
    link?.split(',').find_map(|item| {
        let (dim, link) = item.split_once('=')?;
        (dim.trim() == "tp").then(|| link.trim().to_string())
    })
}

/// An `async_tp` without a `link:` option gates on the emulated tp link the run will have.
fn gate_async_tp_on(spec: &mut PipelineSpec, tp_link: Option<&str>) {
    let Some(link) = tp_link else {
        return;
    };
    for pass in spec.passes.iter_mut().filter(|p| p.name == "async_tp") {
        pass.option = match pass.option.take() {
            Some(o) if o.contains("link:") => Some(o),
            Some(o) => Some(format!("{o};link:{link}")),
            None => Some(format!("link:{link}")),
        };
    }
}

/// `--link` as text: a link per mesh dimension it names.
fn parse_links(
    text: &str,
    mesh: &graphtrain_ir::Mesh,
) -> Result<Vec<Option<graphtrain_runtime::Link>>, String> {
    let mut links = vec![None; mesh.dims.len()];
    for item in text.split(',') {
        let (dim, link) = item
            .split_once('=')
            .ok_or_else(|| format!("--link {text}: `{item}` is not DIM=GBPS:LATENCY_US"))?;
        let d = mesh.dim(dim.trim()).ok_or_else(|| {
            format!("--link {text}: `{dim}` is not a dimension of the mesh {mesh}")
        })?;
        links[d] =
            Some(graphtrain_runtime::Link::parse(link).map_err(|e| format!("--link {text}: {e}"))?);
    }
    Ok(links)
}

/// `--mesh` as text, parsed.
fn parse_mesh(mesh: &str) -> Result<graphtrain_ir::Mesh, String> {
    graphtrain_ir::Mesh::parse(mesh).map_err(|e| format!("--mesh {mesh}: {e}"))
}

/// The plan in `--plan FILE` (RON), or the built-in Llama 3 plan for `mesh`: FSDP over
/// `dp_shard` for every parameter, and Megatron's tensor parallelism over `tp`.
fn load_plan(
    plan: Option<&Path>,
    mesh: &graphtrain_ir::Mesh,
) -> Result<graphtrain_passes::parallelize::Plan, String> {
    use graphtrain_passes::parallelize::Plan;
    match plan {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| format!("--plan {}: {e}", path.display()))?;
            Plan::from_ron(&text).map_err(|e| format!("--plan {}: {e}", path.display()))
        }
        None => Ok(Plan::llama(mesh)),
    }
}

/// `--hardware` (a built-in name, a RON file, or `this-cpu`, measured now) and `--link` (one
/// emulated link for every collective), as `sim` and `autoshard` take them.
fn hardware_and_links(
    hardware: &str,
    link: Option<&str>,
) -> Result<(crate::sim::hardware::Hardware, crate::sim::Links), String> {
    use crate::sim::{hardware::Hardware, LinkSpec, Links};
    let hw = if hardware == "this-cpu" {
        let c = crate::sim::calibrate::this_cpu()?;
        say!(
            "this-cpu, measured: GEMM 1024^3 {:.1} GFLOP/s ({:.0}% of the peak {:.1}: {}), in bf16 {:.1} GFLOP/s, causal attention {:.1} GFLOP/s (in bf16 {:.1}), memory {:.1} GB/s, a launch {:.1} us",
            c.gemm_gflops,
            100.0 * c.hardware.efficiency.matmul,
            c.hardware.peak_gflops_f32,
            c.peak_source,
            c.bf16_gemm_gflops,
            c.attention_gflops,
            c.bf16_attention_gflops,
            c.memory_gbps,
            c.launch_us
        );
        c.hardware
    } else {
        Hardware::load(hardware)?
    };
    let links = match link {
        None => Links::Hardware,
        Some(l) => {
            let link = graphtrain_runtime::Link::parse(l).map_err(|e| format!("--link: {e}"))?;
            Links::Every(LinkSpec {
                gbps: link.bytes_per_s / 1e9,
                latency_us: link.latency.as_secs_f64() * 1e6,
            })
        }
    };
    Ok((hw, links))
}

fn autoshard(a: AutoshardArgs, registry: &Registry) -> Result<(), String> {
    use crate::autoshard::{human, Fix, Options, Solver};
    if a.nodes == 0 {
        return Err("--nodes must be at least 1".into());
    }
    let (hw, links) = hardware_and_links(&a.hardware, a.link.as_deref())?;
    if let Some(world) = a.world {
        return autoshard_survey(&a, world, &hw, links, registry);
    }
    let mesh = parse_mesh(
        a.mesh
            .as_deref()
            .expect("clap requires --mesh without --world"),
    )?;
    hw.check_fits(mesh.world_size(), a.nodes)
        .map_err(|e| format!("--mesh {mesh} has {e}"))?;
    let memory_limit = a
        .memory_limit
        .as_deref()
        .map(|m| {
            graphtrain_passes::schedule::parse_bytes(m).map_err(|e| format!("--memory-limit: {e}"))
        })
        .transpose()?
        .map_or_else(|| hw.memory_per_rank(mesh.world_size()), |b| b as f64);
    let fixed = a
        .fixed
        .iter()
        .map(|f| Fix::parse(f).map_err(|e| format!("--fix {e}")))
        .collect::<Result<Vec<_>, _>>()?;
    let opts = Options {
        model: model_with_batch(&a.model, a.batch)?,
        mesh: mesh.clone(),
        optim: a.optim.config()?,
        precision: Precision::parse(&a.precision).map_err(|e| format!("--precision: {e}"))?,
        hardware: &hw,
        links,
        memory_limit: Some(memory_limit),
        fixed,
        proposals: a.proposals,
    };
    let solver = Solver::new(&opts)?;
    let solved = solver.solve()?;
    for line in &solved.log {
        eprintln!("  {line}");
    }
    let show = |c: &crate::autoshard::cost::Cost| {
        format!(
            "priced {:.3} ms ({:.3} compute + {:.3} communication, {} collectives, nothing overlapped), peak {} a rank",
            c.seconds() * 1e3,
            c.compute_s * 1e3,
            c.comm_s * 1e3,
            c.collectives,
            human(c.peak_bytes)
        )
    };
    eprintln!(
        "autoshard: {} parameter classes, {} group placements priced ({} refused by parallelize), {} ILP solves, {:.1} s",
        solved.classes, solved.combinations, solved.refused, solved.ilp_solves, solved.seconds
    );
    eprintln!(
        "chosen plan: {} ({})",
        show(&solved.cost),
        match solved.predicted {
            Some((s, bytes)) =>
                format!("the ILP predicted {:.3} ms, peak {}", s * 1e3, human(bytes)),
            None => "the ILP's least-memory proposal".into(),
        }
    );
    // The built-in plan is priced only now, for the comparison: the solver never sees it.
    match solver.price(&graphtrain_passes::parallelize::Plan::llama(&mesh)) {
        Ok(hand) => eprintln!(
            "Llama plan:  {} ({:+.1}% for the chosen plan; `graphtrain sim --plan` predicts either step with its overlap)",
            show(&hand),
            100.0 * (solved.cost.seconds() / hand.seconds() - 1.0)
        ),
        Err(e) => eprintln!("Llama plan: does not build here: {e}"),
    }
    let ron = solved.plan.to_ron();
    match &a.out {
        Some(path) => {
            std::fs::write(path, format!("{ron}\n"))
                .map_err(|e| format!("--out {}: {e}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => say!("{ron}"),
    }
    Ok(())
}

/// `autoshard --world N`: meshes, plans and pipelines simulated and ranked.
fn autoshard_survey(
    a: &AutoshardArgs,
    world: usize,
    hw: &crate::sim::hardware::Hardware,
    links: crate::sim::Links,
    registry: &Registry,
) -> Result<(), String> {
    use crate::autoshard::survey::{meshes, survey};
    use crate::autoshard::{human, Fix, Options};
    if world == 0 {
        return Err("--world must be at least 1".into());
    }
    hw.check_fits(world, a.nodes)
        .map_err(|e| format!("--world {world}: {e}"))?;
    if a.memory_limit.is_some() {
        return Err("--memory-limit: with --world the limit is the device's memory".into());
    }
    let pipelines = a
        .survey_passes
        .split(';')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            let pipeline = PipelineSpec::parse_list(p.trim())?.build(registry)?;
            Ok((p.trim().to_string(), pipeline))
        })
        .collect::<Result<Vec<_>, String>>()
        .map_err(|e| format!("--survey-passes: {e}"))?;
    let opts = Options {
        model: model_with_batch(&a.model, a.batch)?,
        mesh: graphtrain_ir::Mesh { dims: Vec::new() },
        optim: a.optim.config()?,
        precision: Precision::parse(&a.precision).map_err(|e| format!("--precision: {e}"))?,
        hardware: hw,
        links,
        memory_limit: None,
        fixed: a
            .fixed
            .iter()
            .map(|f| Fix::parse(f).map_err(|e| format!("--fix {e}")))
            .collect::<Result<Vec<_>, _>>()?,
        proposals: a.proposals,
    };
    if meshes(&opts, world).is_empty() {
        return Err(format!(
            "--world {world}: no dp_shard x tp mesh splits batch {} and {} heads ({} key/value) within a node of {}",
            opts.model.batch, opts.model.n_heads, opts.model.n_kv_heads, hw.gpus_per_node
        ));
    }
    let t0 = Instant::now();
    let rows = survey(&opts, world, &pipelines, a.nodes);
    let tokens = (opts.model.batch * opts.model.seq_len) as f64;
    say!(
        "{:<22} {:<8} {:<38} {:>9} {:>12} {:>9} {:>11}  fits",
        "mesh",
        "plan",
        "passes",
        "step s",
        "tok/s/device",
        "exposed",
        "arena"
    );
    for r in &rows {
        match &r.outcome {
            Ok(p) => say!(
                "{:<22} {:<8} {:<38} {:>9.3} {:>12.0} {:>7.0}ms {:>11}  {}",
                r.mesh.to_string(),
                r.plan_kind,
                r.passes,
                p.step_s,
                tokens / p.step_s / world as f64,
                p.exposed_comm_s * 1e3,
                human(p.arena_bytes as f64),
                if r.fits { "yes" } else { "no" }
            ),
            Err(e) => say!(
                "{:<22} {:<8} {:<38} {}",
                r.mesh.to_string(),
                r.plan_kind,
                r.passes,
                e.lines().next().unwrap_or_default()
            ),
        }
    }
    eprintln!(
        "surveyed {} candidates in {:.1} s",
        rows.len(),
        t0.elapsed().as_secs_f64()
    );
    let fitting: Vec<_> = rows.iter().filter(|r| r.fits).collect();
    match fitting.first() {
        None => say!(
            "would run: nothing; no candidate's arena fits the {:.0} GiB of a `{}` (try ac=full in --survey-passes, bf16-mixed, or more ranks)",
            hw.memory_gib,
            hw.name
        ),
        Some(best) => {
            let p = best.outcome.as_ref().expect("fitting rows were simulated");
            let compute: f64 = p.by_kind.iter().map(|(_, s)| s).sum();
            say!(
                "would run: --mesh {} with the `{}` plan and --passes {}: the fastest simulated step that fits ({:.3} s, {:.0} tok/s a device; compute {:.3} s, communication {:.3} s of which {:.3} s exposed; arena {} of {:.0} GiB)",
                best.mesh,
                best.plan_kind,
                best.passes,
                p.step_s,
                tokens / p.step_s / world as f64,
                compute,
                p.comm_s,
                p.exposed_comm_s,
                human(p.arena_bytes as f64),
                hw.memory_gib
            );
            if let Some(next) = fitting.get(1) {
                let q = next.outcome.as_ref().expect("fitting rows were simulated");
                say!(
                    "next: --mesh {} `{}` --passes {}, {:+.1}% step time",
                    next.mesh,
                    next.plan_kind,
                    next.passes,
                    100.0 * (q.step_s / p.step_s - 1.0)
                );
            }
            if let Some(plan) = &best.plan {
                if let Some(path) = &a.out {
                    std::fs::write(path, format!("{}\n", plan.to_ron()))
                        .map_err(|e| format!("--out {}: {e}", path.display()))?;
                    eprintln!("wrote its plan to {}", path.display());
                }
            }
        }
    }
    Ok(())
}

fn sim(a: SimArgs, registry: &Registry) -> Result<(), String> {
    use crate::sim::simulate;
    if a.nodes == 0 {
        return Err("--nodes must be at least 1".into());
    }
    let (hw, links) = hardware_and_links(&a.hardware, a.link.as_deref())?;
    if let Some(path) = &a.write_hardware {
        std::fs::write(path, hw.to_ron()).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    let cfg = model_with_batch(&a.model, a.batch)?;
    let optim = a.optim.config()?;
    let precision = Precision::parse(&a.precision).map_err(|e| format!("--precision: {e}"))?;
    let pipeline = a.passes.pipeline(registry, None)?;
    let traced = step_on_mesh(
        &cfg,
        a.mesh.as_deref(),
        a.plan.as_deref(),
        &optim,
        precision,
    )?;
    let program = crate::sim::lower_for(&traced.step.graph, &pipeline, &hw)?;
    let p = simulate(&program, &hw, links, a.nodes)?;
    let g = &program.graph;
    let world = g.mesh.as_ref().map_or(1, |m| m.world_size());
    let global_tps = (cfg.batch * cfg.seq_len) as f64 / p.step_s;
    let peak = match precision {
        Precision::F32 => hw.peak_gflops_f32,
        Precision::Bf16Mixed => hw.peak_gflops_bf16,
    };
    // On a cpu host the ranks share its peak; on GPUs each rank has a device's.
    let peak_all = match hw.kind {
        crate::sim::hardware::Kind::Cpu => peak,
        crate::sim::hardware::Kind::Gpu => peak * world as f64,
    };
    let mfu = cfg.flops_per_token() * global_tps / 1e9 / peak_all;
    say!(
        "sim: {} on {} ({} rank(s){}): step {:.4} s, {:.0} tok/s ({:.0} per rank), mfu {:.1}% of {:.0} GFLOP/s ({})",
        a.model.config,
        hw.name,
        world,
        g.mesh.as_ref().map(|m| format!(", mesh {m}")).unwrap_or_default(),
        p.step_s,
        global_tps,
        global_tps / world as f64,
        100.0 * mfu,
        peak_all,
        a.precision
    );
    let kinds: Vec<String> = p
        .by_kind
        .iter()
        .map(|(k, s)| format!("{k} {:.2} ms", s * 1e3))
        .collect();
    say!(
        "     compute lane: {} over {} steps; communication: {} collectives, {:.2} ms on the link, {:.2} ms exposed",
        kinds.join(", "),
        p.steps,
        p.collectives,
        p.comm_s * 1e3,
        p.exposed_comm_s * 1e3
    );
    if let Some(path) = &a.trace_out {
        crate::timeline::write_chrome_trace(path, &p.timeline, 0, 1)?;
        say!("     timeline: {}", path.display());
    }
    let fits = (p.arena_bytes as f64) <= hw.memory_gib * (1u64 << 30) as f64;
    say!(
        "     memory: arena {:.2} MiB{} ({} the {:.0} GiB of a device){}",
        p.arena_bytes as f64 / MIB,
        match p.host_bytes {
            0 => String::new(),
            b => format!(" + {:.2} MiB offloaded to host", b as f64 / MIB),
        },
        if fits { "fits in" } else { "DOES NOT FIT in" },
        hw.memory_gib,
        if hw.kind == crate::sim::hardware::Kind::Cpu && world > 1 {
            " (per rank; the ranks share the host)"
        } else {
            ""
        }
    );
    Ok(())
}

/// The model `--config` names, with `--batch` in place of its batch where given.
fn model_with_batch(model: &ModelArgs, batch: Option<usize>) -> Result<Llama3Config, String> {
    let mut cfg = model_config(model)?;
    if let Some(batch) = batch {
        if batch == 0 {
            return Err("--batch must be at least 1".into());
        }
        cfg.batch = batch;
    }
    Ok(cfg)
}

/// The train step of `cfg`: one rank's SPMD step on `mesh` (as `--mesh` takes it, with `--plan`
/// or the Llama plan) where one is given, else one device's.
fn step_on_mesh(
    cfg: &Llama3Config,
    mesh: Option<&str>,
    plan: Option<&Path>,
    optim: &OptimConfig,
    precision: Precision,
) -> Result<crate::trainer::Traced, String> {
    let mesh = mesh.map(parse_mesh).transpose()?;
    let plan = mesh.as_ref().map(|m| load_plan(plan, m)).transpose()?;
    crate::trainer::build_step_on(cfg, mesh.as_ref().zip(plan.as_ref()), optim, precision)
        .map_err(|e| e.to_string())
}

fn trace(a: TraceArgs, registry: &Registry) -> Result<(), String> {
    let cfg = model_with_batch(&a.model, a.batch)?;
    let optim = a.optim.config()?;
    let pipeline = a.passes.pipeline(registry, None)?;
    let t0 = Instant::now();
    let precision = Precision::parse(&a.precision).map_err(|e| format!("--precision: {e}"))?;
    let traced = step_on_mesh(
        &cfg,
        a.mesh.as_deref(),
        a.plan.as_deref(),
        &optim,
        precision,
    )?;
    let compiled = compile(
        &traced.step.graph,
        Backend::Reference,
        &CompileOptions::new(&pipeline, Mode::Fused),
    )
    .map_err(|e| e.to_string())?;
    let total = t0.elapsed();
    let times = BuildTimings {
        passes: compiled.timings.passes,
        ..traced.timings
    };
    print_pass_records(&compiled.passes);
    let g = &compiled.graph;
    let s = GraphStats::of(g);
    // A rank's graph holds its own rows of the batch.
    let batch = match &g.mesh {
        Some(mesh) => {
            let local = cfg.batch / mesh.size_of("dp_replicate") / mesh.size_of("dp_shard");
            say!(
                "mesh {mesh}: {} ranks; what follows is one rank's graph, FLOPs and memory (batch {local} of the global {})",
                mesh.world_size(),
                cfg.batch
            );
            local
        }
        None => cfg.batch,
    };
    let tokens = (batch * cfg.seq_len) as f64;
    say!(
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
    say!("nodes per phase: {}", phases.join(", "));
    let ops: Vec<String> = s
        .nodes_per_op
        .iter()
        .map(|(o, n)| format!("{o} {n}"))
        .collect();
    say!("nodes per op: {}", ops.join(", "));
    let fwd: f64 = s
        .flops_per_phase
        .iter()
        .filter(|(p, _)| *p <= Phase::Loss)
        .map(|(_, f)| f)
        .sum();
    say!(
        "FLOPs per token: {:.4} GFLOP counted in the graph (forward {:.4}), {:.4} GFLOP by 6(N - N_emb) + 12·L·D·T",
        s.flops / tokens / 1e9,
        fwd / tokens / 1e9,
        cfg.flops_per_token() / 1e9
    );
    // Each micro-batch's activations are saved for its own backward: they add up over the
    // step, but one micro-batch's are live at a time.
    let micro_batches = g.micro_batches() as usize;
    let split = match micro_batches {
        1 => String::new(),
        n => format!(
            ", in {n} micro-batches: about {} each, one live at a time",
            gib(s.saved_activation_bytes / n)
        ),
    };
    say!(
        "memory: params {}, grads {}, optimizer state {}, saved activations {} (batch {} x seq {}{split})",
        gib(s.param_bytes),
        gib(s.grad_bytes),
        gib(s.state_bytes),
        gib(s.saved_activation_bytes),
        batch,
        cfg.seq_len
    );
    if !s.comm_per_collective.is_empty() {
        let parts: Vec<String> = s
            .comm_per_collective
            .iter()
            .map(|(name, count, bytes)| format!("{name} x{count} {}", gib(*bytes as usize)))
            .collect();
        let total: f64 = s.comm_per_collective.iter().map(|(_, _, b)| b).sum();
        say!(
            "communication per rank per step: {} sent under ring algorithms ({}); a network's volume, not what the threads launcher copies",
            gib(total as usize),
            parts.join(", ")
        );
    }
    let t_plan = Instant::now();
    let plan = plan_buffers(g, ARENA_ALIGNMENT);
    say!(
        "buffer plan: {plan} (planned in {:.3}s)",
        t_plan.elapsed().as_secs_f64()
    );
    say!(
        "time: trace {:.3}s, autodiff + optimizer {:.3}s, verify {:.3}s, passes {:.3}s, total {:.3}s",
        times.trace.as_secs_f64(),
        times.autodiff_and_optimizer.as_secs_f64(),
        times.verify.as_secs_f64(),
        times.passes.as_secs_f64(),
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
        say!("wrote {}", out.display());
    }
    if let Some(path) = a.dot {
        crate::dot::write(&path, &crate::dot::to_dot(g))?;
        say!("wrote {}", path.display());
    }
    Ok(())
}

/// The peak `mfu` is measured against: this machine's, or with `--launcher fake`, whose
/// tokens/s is the whole mesh's, that of every rank's device (each as this machine).
fn mesh_peak(
    peak: Option<crate::peak::Peak>,
    mesh: Option<&crate::trainer::MeshRun>,
) -> Option<crate::peak::Peak> {
    match mesh {
        Some(run) if run.launch == crate::trainer::Launch::FakeRankZero => {
            let ranks = run.mesh.world_size();
            peak.map(|p| crate::peak::Peak {
                gflops: p.gflops * ranks as f64,
                source: format!("{ranks} ranks x {:.1} GFLOP/s ({})", p.gflops, p.source),
            })
        }
        _ => peak,
    }
}

/// What a mesh run runs, for the line before its steps.
fn describe_mesh_run(run: &crate::trainer::MeshRun, batch: usize) -> String {
    match run.launch {
        crate::trainer::Launch::Threads => format!(
            "mesh {}: {} ranks as threads of this process, {} compute thread(s) each; the graph, plan and arena above are one rank's, the batch {batch} rows over all ranks",
            run.mesh,
            run.mesh.world_size(),
            run.threads_per_rank,
        ),
        crate::trainer::Launch::Mpi => format!(
            "mesh {}: {} ranks as processes of an MPI job, {} compute thread(s) each; the graph, plan and arena above are one rank's, the batch {batch} rows over all ranks",
            run.mesh,
            run.mesh.world_size(),
            run.threads_per_rank,
        ),
        crate::trainer::Launch::FakeRankZero => format!(
            "mesh {}: rank 0 of {} runs alone (--launcher fake) on {} thread(s); its collectives move no data, so losses are no real run's; time and memory are one rank's, and tokens/s is the mesh's global batch ({batch} rows) over one rank's step, as if communication were free",
            run.mesh,
            run.mesh.world_size(),
            run.threads_per_rank,
        ),
    }
}

fn run(mut a: RunArgs, registry: &Registry) -> Result<(), String> {
    let t0 = Instant::now();
    let lr = a.lr_schedule();
    lr.check()?;
    // Read before the step is built: a wrong file fails fast, and a checkpoint's tokenizer
    // tokenizes the new text (its embeddings know no other).
    let initial = match &a.init {
        Some(path) => Some(crate::init_weights::read(path).map_err(|e| format!("--init {e}"))?),
        None => None,
    };
    let init_tokenizer = initial.as_ref().and_then(|i| i.tokenizer_json.as_ref());
    if let (Some(json), DataArg::Path(_), None) =
        (init_tokenizer, &a.train.data, &a.train.text.tokenizer)
    {
        let dir = match &a.train.text.data_cache {
            Some(d) => d.clone(),
            None => default_cache_dir()?,
        }
        .join("init-tokenizers");
        let file = dir.join(format!(
            "{:016x}.json",
            crate::checkpoint::fnv1a64(json.as_bytes())
        ));
        std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::write(&file, json))
            .map_err(|e| {
                format!(
                    "--init: cannot write its tokenizer to {}: {e}",
                    file.display()
                )
            })?;
        say!(
            "tokenizer: the one in {} (--tokenizer to use another)",
            a.init
                .as_ref()
                .map_or(String::new(), |p| p.display().to_string())
        );
        a.train.text.tokenizer = Some(file);
    }
    if a.train.mesh.launcher == Some(Launcher::Fake) {
        let whole = [
            ("--checkpoint", a.checkpoint.is_some()),
            ("--resume", a.resume.is_some()),
            ("--init", a.init.is_some()),
            ("--init-out", a.init_out.is_some()),
            ("--val-every", a.eval.val_every.is_some()),
            ("--sample-tokens", a.eval.sample_tokens > 0),
        ];
        if let Some((flag, _)) = whole.iter().find(|(_, given)| *given) {
            return Err(format!(
                "{flag} needs whole tensors of a real run; with --launcher fake only rank 0 runs, on collectives that move no data"
            ));
        }
    }
    let Setup {
        cfg,
        optim,
        mut trainer,
        data_report,
        tokenizer,
        mesh,
        ..
    } = a.train.setup(registry)?;
    let run_id = RunIdentity::new(&cfg, a.train.seed, trainer.data().clone(), &optim);
    if let Some(line) = data_report {
        say!("{line}");
    }
    let backend: Backend = a.train.backend.parse()?;
    let runtime = runtime_options_from_env()?;
    let text_data = trainer.data().text().is_some();
    let mut validator = match (a.eval.val_every, text_data) {
        (Some(_), false) => {
            return Err(format!(
                "--val-every: --data {} has no held-out split (validation needs text data, --data PATH)",
                a.train.data
            ))
        }
        (None, false) => None,
        (every, true) => Some(
            Validator::new(
                &trainer,
                backend,
                &runtime,
                every.unwrap_or(100),
                a.eval.val_batches,
            )
            .map_err(|e| format!("validation: {e}"))?,
        ),
    };
    if a.eval.sample_tokens > 0 && tokenizer.is_none() {
        return Err(if text_data {
            "--sample-tokens: the token file's tokenizer is not known; give it with --tokenizer"
                .into()
        } else {
            format!(
                "--sample-tokens: --data {} is not text; samples need text data (--data PATH)",
                a.train.data
            )
        });
    }
    // Checkpoints carry the tokenizer, so `graphtrain generate` needs nothing else.
    let tokenizer_json = tokenizer.as_ref().map(|t| t.to_json()).transpose()?;
    print_pass_records(&trainer.passes);
    let flops_per_token = cfg.flops_per_token();
    let predicted = graphtrain_passes::memory::profile(&trainer.graph);
    say!(
        "predicted (liveness over the schedule): peak {:.2}MiB, saved activations {:.2}MiB on device; buffer plan: {}",
        predicted.peak_bytes as f64 / MIB,
        predicted.saved_device_bytes as f64 / MIB,
        plan_buffers(&trainer.graph, ARENA_ALIGNMENT)
    );
    if let Some(p) = trainer.program() {
        let host = match p.host_bytes() {
            0 => String::new(),
            b => format!("; {:.2}MiB offloaded to host memory", b as f64 / MIB),
        };
        // A device whose buffers hold less than the arena holds it in windows (one buffer each).
        let host = match p.plan.window {
            Some(w) => format!(
                "; in {} device buffers of at most {:.2}MiB{host}",
                p.plan.arena_bytes.div_ceil(w),
                w as f64 / MIB
            ),
            None => host,
        };
        say!(
            "lowered ({:?}): {}; arena {:.2}MiB (liveness lower bound {:.2}MiB){host}",
            p.mode,
            p.summary(),
            p.plan.arena_bytes as f64 / MIB,
            p.plan.lower_bound as f64 / MIB
        );
    }
    say!(
        "graphtrain: model {} config {} backend {} | {} params, {} nodes | data {} seed {} lr {} | built in {:.2}s",
        a.train.model.model,
        a.train.model.config,
        a.train.backend,
        cfg.num_params(),
        trainer.graph.nodes.len(),
        a.train.data,
        a.train.seed,
        lr,
        t0.elapsed().as_secs_f64()
    );
    if let Some(run) = &mesh {
        say!("{}", describe_mesh_run(run, cfg.batch));
    }
    let micro_batches = trainer.graph.micro_batches() as usize;
    if micro_batches > 1 {
        say!(
            "batch of {} rows in {micro_batches} micro-batches of {}, run one after another, gradients summed before the update",
            cfg.batch,
            cfg.batch / micro_batches
        );
    }
    if let (Some(path), Some(initial)) = (&a.init, initial) {
        let crate::init_weights::InitialWeights {
            tensors,
            from_checkpoint,
            ..
        } = initial;
        trainer
            .init_parameters(tensors, |name| {
                crate::init_weights::unused_is_fine(from_checkpoint, name)
            })
            .map_err(|e| format!("--init `{}`: {e}", path.display()))?;
        say!("initial parameters from {}", path.display());
    }
    if let Some(path) = &a.resume {
        // An MPI rank reads only the rank files that hold its own parts.
        let ckpt = match trainer.own_parts() {
            Some((mesh, rank, wanted)) if crate::sharded::is_sharded(path) => {
                let (ckpt, files) = crate::sharded::load_parts(path, &mesh, rank, &wanted)
                    .map_err(|e| format!("--resume {}: {e}", path.display()))?;
                tracing::info!(rank, ?files, "read its parts from these rank files");
                ckpt
            }
            _ => crate::sharded::load_any(path)?,
        };
        let fingerprint = trainer.fingerprint.to_string();
        if ckpt.header.fingerprint != fingerprint {
            say!(
                "note: {} was written by a step graph with fingerprint {}, this one is {fingerprint} (another pass pipeline); state is restored by name",
                path.display(),
                ckpt.header.fingerprint
            );
        }
        let (then, now) = (ckpt.header.run.optim.micro_batches, optim.micro_batches);
        if then != now {
            say!(
                "note: {} was trained in {then} micro-batch(es) a step; this run goes on in {now}",
                path.display()
            );
        }
        // The schedule is not part of the run's identity (a run may be resumed with another
        // one), but a resume that forgets a flag would change the lr silently: say so.
        let schedule = lr.to_string();
        if let Some(saved) = ckpt.header.extra.get(LR_SCHEDULE_KEY) {
            if *saved != schedule {
                say!(
                    "note: {} was trained with lr {saved}; this run goes on with lr {schedule}",
                    path.display()
                );
            }
        }
        trainer
            .restore(ckpt, &run_id)
            .map_err(|e| format!("--resume {}: {e}", path.display()))?;
        say!(
            "resumed from {} after step {}",
            path.display(),
            trainer.steps_done()
        );
    }
    let save = |trainer: &mut Trainer| -> Result<(), String> {
        let Some(path) = &a.checkpoint else {
            return Ok(());
        };
        let with_extra = |ckpt: &mut checkpoint::Checkpoint| {
            if let Some(json) = &tokenizer_json {
                ckpt.header
                    .extra
                    .insert(TOKENIZER_KEY.to_string(), json.clone());
            }
            ckpt.header
                .extra
                .insert(LR_SCHEDULE_KEY.to_string(), lr.to_string());
        };
        match (mpi_rank_of_this_process(), &mesh) {
            // Each MPI rank writes its parts; once all have, rank 0 commits the manifest.
            (Some(rank), Some(run)) => {
                let (mut part, placements) = trainer
                    .checkpoint_part(run_id.clone())
                    .map_err(|e| e.to_string())?;
                with_extra(&mut part);
                let wrote = crate::sharded::save_part(path, rank, &part);
                trainer
                    .every_rank_ok(&wrote)
                    .map_err(|e| format!("the checkpoint is not committed: {e}"))?;
                if rank == 0 {
                    let manifest =
                        crate::sharded::manifest(&run.mesh, trainer.steps_done(), placements);
                    crate::sharded::commit(path, &manifest)?;
                }
                Ok(())
            }
            _ => {
                let mut ckpt = trainer
                    .checkpoint(run_id.clone())
                    .map_err(|e| e.to_string())?;
                with_extra(&mut ckpt);
                checkpoint::save(path, &ckpt)
            }
        }
    };
    if let Some(path) = &a.init_out {
        // Under MPI gathering the weights is a collective: every rank takes part, rank 0 writes.
        let params = trainer.parameters().map_err(|e| e.to_string())?;
        if speaks_for_the_job() {
            replay::write_init(path, &params)?;
        }
        say!("initial parameters: {}", path.display());
    }
    // Under MPI rank 0 writes the dump, with every step's whole batch.
    let mut dump = match a.dump_batches.as_ref().filter(|_| speaks_for_the_job()) {
        Some(path) => Some(BatchDump::create(path, cfg.batch, cfg.seq_len)?),
        None => None,
    };
    let peak = mesh_peak(
        crate::peak::peak_in(
            &a.train.backend,
            a.train.peak_gflops,
            a.train.precision()?,
            a.train.gemm_kernel()?,
        ),
        mesh.as_ref(),
    );
    let metrics = match a.metrics.as_ref().filter(|_| speaks_for_the_job()) {
        None => None,
        Some(path) => {
            let config = run_config_json(&a, &cfg, &optim);
            Some(match &a.resume {
                Some(_) => MetricsWriter::append(path, config, trainer.steps_done(), t0)?,
                None => MetricsWriter::create(path, config, t0)?,
            })
        }
    };
    let trace = a.trace.trace_out.clone().map(|path| TraceTarget {
        path,
        step: a.trace.trace_step.unwrap_or(a.steps),
    });
    trainer.set_lr_schedule(lr);
    let mut report = StepReport::new(
        &mut trainer,
        a.steps,
        (flops_per_token, !lr.is_constant(), peak),
        metrics,
        trace,
    )?;
    while trainer.steps_done() < a.steps {
        let next = trainer.steps_done() + 1;
        report.before(&mut trainer, next);
        let m = match trainer.step() {
            Ok(m) => m,
            Err(e) => {
                report.finish();
                // The failed step's update was not kept: save what came before it. Not in an MPI
                // job: gathering needs every rank, and the others may be stopped already.
                if let Some(path) = a
                    .checkpoint
                    .as_ref()
                    .filter(|_| mpi_rank_of_this_process().is_none())
                {
                    match save(&mut trainer) {
                        Ok(()) => eprintln!(
                            "saved the state after step {} to {}",
                            trainer.steps_done(),
                            path.display()
                        ),
                        Err(why) => eprintln!("not saving {}: {why}", path.display()),
                    }
                }
                return Err(e.to_string());
            }
        };
        report.after(&mut trainer, &m)?;
        if let Some(v) = validator.as_mut().filter(|v| v.due(m.step, a.steps)) {
            let result = v.run(&mut trainer).map_err(|e| e.to_string())?;
            report.validation(m.step, &result)?;
        }
        if let Some(dump) = &mut dump {
            if let Some(b) = trainer.last_whole_batch().map_err(|e| e.to_string())? {
                dump.append(m.step, &b)?;
            }
        }
        if a.checkpoint_every > 0 && m.step % a.checkpoint_every == 0 {
            save(&mut trainer)?;
        }
    }
    report.finish();
    save(&mut trainer)?;
    if let Some(path) = &a.checkpoint {
        say!(
            "checkpoint after step {}: {}",
            trainer.steps_done(),
            path.display()
        );
    }
    if let (Some(tok), true) = (&tokenizer, a.eval.sample_tokens > 0) {
        let params = trainer.parameters().map_err(|e| e.to_string())?;
        let prompt = a.eval.sampling.prompt();
        let text = sample_text(
            &cfg,
            &params,
            tok,
            &prompt,
            a.eval.sample_tokens,
            &a.eval.sampling.sampling(),
            (backend, &runtime),
        )
        .map_err(|e| format!("sampling: {e}"))?;
        say!(
            "sample ({} tokens, temperature {}, top-k {}):\n{prompt}{text}",
            a.eval.sample_tokens,
            a.eval.sampling.temperature,
            a.eval.sampling.top_k
        );
    }
    Ok(())
}

/// The checkpoint metadata entry that holds the run's tokenizer (`tokenizer.json` text).
pub(crate) const TOKENIZER_KEY: &str = "tokenizer.json";
/// The lr schedule a checkpoint's run trained with (`LrSchedule`'s text), to say so when a
/// resume goes on with another.
const LR_SCHEDULE_KEY: &str = "lr_schedule";

fn generate(a: GenerateArgs) -> Result<(), String> {
    let ckpt = checkpoint::load(&a.checkpoint)?;
    let json = ckpt.header.extra.get(TOKENIZER_KEY).ok_or_else(|| {
        format!(
            "{} carries no tokenizer: it comes from a run on synthetic data (--data random or fixed), which has no text to sample",
            a.checkpoint.display()
        )
    })?;
    let tokenizer = TextTokenizer::from_json(
        json,
        &format!("the tokenizer in {}", a.checkpoint.display()),
    )?;
    let model = &ckpt.header.run.model.clone();
    if tokenizer.vocab_size() > model.vocab_size {
        return Err(format!(
            "{}: the tokenizer has {} tokens, the model's vocab_size is {}",
            a.checkpoint.display(),
            tokenizer.vocab_size(),
            model.vocab_size
        ));
    }
    let backend: Backend = a.backend.parse()?;
    if let Some(why) = backend.unavailable() {
        return Err(format!("--backend {backend}: {why}"));
    }
    let params = ckpt.named_tensors();
    let prompt = a.sampling.prompt();
    let text = sample_text(
        model,
        &params,
        &tokenizer,
        &prompt,
        a.tokens,
        &a.sampling.sampling(),
        (backend, &runtime_options_from_env()?),
    )
    .map_err(|e| format!("{}: {e}", a.checkpoint.display()))?;
    say!("{prompt}{text}");
    Ok(())
}

/// The run's settings for the metrics log's header.
fn run_config_json(a: &RunArgs, cfg: &Llama3Config, optim: &OptimConfig) -> serde_json::Value {
    let t = &a.train;
    serde_json::json!({
        "model": t.model.model,
        "config": t.model.config,
        "backend": t.backend,
        "lowering": format!("{:?}", t.lowering).to_lowercase(),
        "data": t.data.to_string(),
        "seed": t.seed,
        "lr": t.lr,
        "lr_schedule": a.lr_schedule().to_string(),
        "optimizer": format!("{:?}", optim),
        "passes": match &t.passes.pipeline {
            Some(file) => file.display().to_string(),
            None => t.passes.passes.clone(),
        },
        "steps": a.steps,
        "mesh": t.mesh.mesh,
        "model_config": serde_json::to_value(cfg).unwrap_or(serde_json::Value::Null),
        "tokens_per_step": cfg.batch * cfg.seq_len,
        "flops_per_token": cfg.flops_per_token(),
    })
}

fn bench(a: BenchArgs, registry: &Registry) -> Result<(), String> {
    if a.steps == 0 {
        return Err("--steps must be at least 1".into());
    }
    if let Some(against) = &a.against {
        return bench_paired(&a, against, registry);
    }
    let Setup {
        mut trainer,
        load_time,
        rss_before_load,
        mesh,
        ..
    } = a.train.setup(registry)?;
    if a.trace_out.is_some() && !trainer.record_timeline(false) {
        return Err(format!(
            "--trace-out: backend `{}` records no timeline (the interpreter runs graph nodes, not Program steps); use a compiled backend such as cpu",
            a.train.backend
        ));
    }
    let t_plan = Instant::now();
    let plan = match trainer.program() {
        Some(p) => p.plan.clone(),
        None => plan_buffers(&trainer.graph, ARENA_ALIGNMENT),
    };
    let plan_time = t_plan.elapsed() + load_time;
    let warmup = a.warmup;
    let s = crate::bench::run(
        &mut trainer,
        a.warmup,
        a.steps,
        crate::bench::LoadInfo {
            plan: &plan,
            plan_time,
            rss_before_load,
        },
        (
            &a.train.model.model,
            &a.train.model.config,
            &a.train.backend,
        ),
        mesh_peak(
            crate::peak::peak_in(
                &a.train.backend,
                a.train.peak_gflops,
                a.train.precision()?,
                a.train.gemm_kernel()?,
            ),
            mesh.as_ref(),
        ),
        |m| {
            say!(
                "step: {:>2} loss: {:.4} time: {}{}",
                m.step,
                m.loss,
                duration(m.seconds),
                if m.step <= warmup { "  (warmup)" } else { "" }
            )
        },
    )?;
    let c = &s.compile;
    let mfu = match (s.mfu, s.peak_gflops, &s.peak_source) {
        (Some(m), Some(peak), Some(source)) => {
            format!("{:.1}% of {peak:.1} GFLOP/s ({source})", 100.0 * m)
        }
        _ => format!(
            "n/a (no known peak for {}; --peak-gflops sets one)",
            s.backend
        ),
    };
    say!(
        "summary: median_tps: {:.0} best_tps: {:.0} median_step: {} achieved: {:.2} GFLOP/s mfu: {mfu}",
        s.median_tps,
        s.best_tps,
        duration(s.median_step_s),
        s.achieved_gflops,
    );
    say!(
        "compile: trace {:.3}s, autodiff+optimizer {:.3}s, verify {:.3}s, passes {:.3}s, lowering+load {:.3}s, kernel JIT {}; total {:.3}s",
        c.trace_s,
        c.autodiff_and_optimizer_s,
        c.verify_s,
        c.passes_s,
        c.buffer_plan_s,
        c.kernel_jit_s
            .map(|j| format!("~{j:.3}s (first step minus median step)"))
            .unwrap_or_else(|| "n/a".into()),
        c.total_s
    );
    if let Some(r) = trainer.profile_report() {
        say!("{r}");
    }
    if let Some((graphs, steps)) = trainer.device_graphs() {
        let total = trainer.program().map_or(0, |p| p.steps.len());
        say!("device graphs: {graphs} recorded, replaying {steps} of the Program's {total} steps");
    }
    let mib_or_na = |b: Option<usize>| {
        b.map(|b| format!("{:.0}MiB", b as f64 / MIB))
            .unwrap_or_else(|| "n/a".into())
    };
    say!(
        "memory: predicted {:.2}MiB (buffer plan), held {:.2}MiB (backend arena / interpreter accounting), resident growth over load + first step {}, peak RSS {}",
        s.predicted_peak_bytes as f64 / MIB,
        s.measured_peak_bytes as f64 / MIB,
        mib_or_na(s.load_rss_growth_bytes),
        mib_or_na(s.peak_rss_bytes)
    );
    if let (Some(device), Some(host)) = (s.device_bytes_in_use, s.offloaded_host_bytes) {
        say!(
            "device memory: the arena took {:.2}MiB of the device's allocator; offloaded to host memory: {:.2}MiB",
            device as f64 / MIB,
            host as f64 / MIB
        );
    }
    if !s.median_wait_s.is_empty() {
        let per_rank: Vec<String> = s
            .median_wait_s
            .iter()
            .enumerate()
            .map(|(rank, w)| {
                let split = s
                    .median_peer_wait_s
                    .get(rank)
                    .map(|p| {
                        format!(
                            " ({} for peers to start, {} exposed communication)",
                            duration(*p),
                            duration((w - p).max(0.0))
                        )
                    })
                    .unwrap_or_default();
                format!("rank {rank} {}{split}", duration(*w))
            })
            .collect();
        say!(
            "ranks: {} threads of {} compute thread(s) each; blocked in collective waits per step (medians): {}",
            s.median_wait_s.len(),
            mesh.as_ref().map_or(1, |m| m.threads_per_rank),
            per_rank.join(", ")
        );
    }
    if let Some(run) = mesh
        .as_ref()
        .filter(|r| r.launch != crate::trainer::Launch::Threads)
    {
        say!("{}", describe_mesh_run(run, trainer.model.batch));
    }
    write_json(a.json.as_deref(), &s)?;
    if let Some(path) = &a.trace_out {
        trainer.record_timeline(true);
        let m = trainer.step().map_err(|e| e.to_string())?;
        let timelines = trainer.take_timelines();
        trainer.record_timeline(false);
        if timelines.is_empty() {
            return Err(format!("--trace-out: step {} recorded no timeline", m.step));
        }
        let files =
            crate::timeline::write_rank_traces(path, &timelines, m.step, trainer.timeline_ranks())?;
        let files: Vec<String> = files.iter().map(|p| p.display().to_string()).collect();
        say!(
            "wrote the timeline of step {} (one more after the measured ones, each of its {} Program steps waited for{}) to {}",
            m.step,
            timelines[0].events.len(),
            if files.len() > 1 { "; one file per rank" } else { "" },
            files.join(", ")
        );
    }
    Ok(())
}

/// Writes a bench summary as JSON to `--json`'s file, when one was given.
fn write_json(path: Option<&Path>, summary: &impl serde::Serialize) -> Result<(), String> {
    let Some(path) = path.filter(|_| speaks_for_the_job()) else {
        return Ok(());
    };
    let body = serde_json::to_string_pretty(summary)
        .map_err(|e| format!("cannot encode the summary: {e}"))?;
    std::fs::write(path, body).map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
    say!("wrote {}", path.display());
    Ok(())
}

/// `bench --against`: the baseline (`--passes`) and the candidate step, timed in pairs.
fn bench_paired(a: &BenchArgs, against: &str, registry: &Registry) -> Result<(), String> {
    let tp_link = tp_link(a.train.mesh.link.as_deref());
    let mut candidate_pipeline = PipelineSpec::parse_list(against)
        .and_then(|mut spec| {
            gate_async_tp_on(&mut spec, tp_link.as_deref());
            spec.build(registry)
        })
        .map_err(|e| format!("--against: {e}"))?;
    candidate_pipeline.verify_each |= a.train.passes.verify_each;
    let baseline_label = match &a.train.passes.pipeline {
        Some(file) => file.display().to_string(),
        None => a.train.passes.passes.clone(),
    };
    let mut baseline = a.train.setup(registry)?.trainer;
    let mut candidate = a.train.setup_with(candidate_pipeline)?.trainer;
    let s = crate::bench::paired(
        &mut baseline,
        &mut candidate,
        a.warmup,
        a.steps,
        (
            &a.train.model.model,
            &a.train.model.config,
            &a.train.backend,
        ),
        (&baseline_label, against),
        |i, b, c| {
            say!(
                "pair: {i:>2} baseline: {} candidate: {} ratio: {:.3}",
                duration(b),
                duration(c),
                c / b
            )
        },
    )?;
    say!(
        "paired: baseline `{}` median {}, candidate `{}` median {}; candidate/baseline per pair: median {:.3} (quartiles {:.3}..{:.3}) over {} pairs",
        s.baseline_pipeline,
        duration(s.baseline_median_step_s),
        s.candidate_pipeline,
        duration(s.candidate_median_step_s),
        s.ratio_median,
        s.ratio_q1,
        s.ratio_q3,
        s.pairs
    );
    // The search's estimate on these pairs: speed, not time, so above 1 is faster.
    let pairs: Vec<(f64, f64)> = s
        .baseline_step_times_s
        .iter()
        .copied()
        .zip(s.candidate_step_times_s.iter().copied())
        .collect();
    let v = graphtrain_autoresearch::stats::KeepRule::default().verdict(&pairs, 0);
    say!(
        "candidate speed / baseline speed: {:.3}, bootstrap 95% interval [{:.3}, {:.3}] (10%-trimmed mean of the pairs' log ratios)",
        v.ratio,
        v.lo,
        v.hi
    );
    write_json(a.json.as_deref(), &s)
}

/// Reads and verifies a graph file: `.ron` as RON, anything else as the text format.
fn read_graph(file: &Path) -> Result<Graph, String> {
    let src = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read `{}`: {e}", file.display()))?;
    let g = if file.extension().is_some_and(|e| e == "ron") {
        graphtrain_ir::ron_io::from_ron(&src).map_err(|e| format!("{}: {e}", file.display()))?
    } else {
        text::parse(&src).map_err(|e| format!("{}: {e}", file.display()))?
    };
    verify(&g).map_err(|e| format!("{}: {e}", file.display()))?;
    Ok(g)
}

/// One line per pass: time, node-count diff, what changed.
fn print_pass_records(records: &[PassRecord]) {
    for r in records {
        say!("pass {r}");
        if !r.report.metrics.is_empty() {
            let m: Vec<String> = r
                .report
                .metrics
                .iter()
                .map(|(k, v)| format!("{k}={}", short_number(*v)))
                .collect();
            say!("     {}", m.join(" "));
        }
        // Where the pass declined and why: one line per kind of reason (reasons that differ
        // only in their numbers are one kind), with the first one's text.
        let kind = |reason: &str| -> String {
            let mut k = String::new();
            for ch in reason.chars() {
                if ch.is_ascii_digit() || ch == '.' && k.ends_with('#') {
                    if !k.ends_with('#') {
                        k.push('#');
                    }
                } else {
                    k.push(ch);
                }
            }
            k
        };
        let mut reasons: Vec<(String, usize, &graphtrain_passes::Decline)> = Vec::new();
        for d in &r.report.declined {
            let k = kind(&d.reason);
            match reasons.iter_mut().find(|(seen, ..)| *seen == k) {
                Some((_, count, _)) => *count += 1,
                None => reasons.push((k, 1, d)),
            }
        }
        const SHOWN: usize = 8;
        for (_, count, first) in reasons.iter().take(SHOWN) {
            let reason = &first.reason;
            let at = match first.node {
                Some(n) if *count > 1 => {
                    format!(" (x{count}, first at node {n} `{}`)", first.module)
                }
                Some(n) => format!(" (at node {n} `{}`)", first.module),
                None => String::new(),
            };
            say!("     declined: {reason}{at}");
        }
        if reasons.len() > SHOWN {
            say!(
                "     declined for {} more reasons (`--dump-dir` keeps each graph)",
                reasons.len() - SHOWN
            );
        }
    }
}

/// A metric as people read it: whole numbers whole, others to three decimals.
fn short_number(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v}")
    } else {
        format!("{v:.3}")
    }
}

fn passes_command(c: PassesCommand, registry: &Registry) -> Result<(), String> {
    match c {
        PassesCommand::List => {
            // Names in one column, as wide as the longest (plugins' included).
            let width = registry.infos().map(|i| i.name.len()).max().unwrap_or(0);
            for info in registry.infos() {
                let option = info
                    .option_help
                    .map(|h| format!(" [={h}]"))
                    .unwrap_or_default();
                let tier = match info.tier {
                    Tier::Preserving => "tier 1",
                    Tier::Changing => "tier 2",
                };
                say!("{:<width$} {tier}  {}{option}", info.name, info.summary);
            }
            say!("default pipeline: {}", DEFAULT_PIPELINE.join(","));
            Ok(())
        }
        PassesCommand::Explain { name } if name == "autoshard" => {
            say!("{}", crate::autoshard::CONTRACT);
            Ok(())
        }
        PassesCommand::Explain { name } => {
            registry.require(&name)?;
            let info = registry.info(&name).expect("required above");
            say!("{}: {}\n", info.name, info.tier.label());
            say!("{}", info.contract);
            if let Some(h) = info.option_help {
                say!("\noptions: {}={h}", info.name);
            }
            Ok(())
        }
        PassesCommand::Apply {
            passes,
            file,
            out,
            check,
            dot,
        } => {
            let g = read_graph(&file)?;
            let spec = PipelineSpec::parse_list(&passes.join(","))?;
            let mut pipeline = spec.build(registry)?;
            pipeline.verify_each = true;
            let (after, records) = pipeline.run(&g).map_err(|e| e.to_string())?;
            for r in &records {
                eprintln!("pass {r}");
                for line in r.report.to_string().lines() {
                    eprintln!("  {line}");
                }
            }
            if check {
                testing::compare_numerics(&g, &after, pipeline.tier(), 3)
                    .map_err(|e| format!("numerics check failed: {e}"))?;
                eprintln!(
                    "numerics: identical outputs on 3 seeded input sets ({})",
                    pipeline.tier().label()
                );
            }
            if let Some(path) = &dot {
                crate::dot::write(path, &crate::dot::diff_to_dot(&g, &after))?;
                eprintln!("wrote {}", path.display());
            }
            let body = text::print(&after);
            match out {
                Some(path) => std::fs::write(&path, body)
                    .map_err(|e| format!("cannot write `{}`: {e}", path.display()))?,
                None => say_raw!("{body}"),
            }
            Ok(())
        }
    }
}

fn plot(a: PlotArgs) -> Result<(), String> {
    match (&a.file, &a.trace) {
        (_, Some(trace)) => {
            let t = crate::timeline::read_trace(trace)?;
            crate::plot::plot_trace(&t, trace, &a.out)?;
            say!(
                "wrote {} ({} events on {} lanes)",
                a.out.display(),
                t.events.len(),
                t.lanes().len()
            );
        }
        (Some(file), None) => {
            let log = crate::metrics::read(file)?;
            crate::plot::plot_metrics(&log, file, &a.out)?;
            say!(
                "wrote {} ({} steps, {} validations)",
                a.out.display(),
                log.steps.len(),
                log.vals.len()
            );
        }
        (None, None) if !a.search.is_empty() => {
            crate::plot::plot_search(&a.search, &a.out)?;
            say!("wrote {} ({} searches)", a.out.display(), a.search.len());
        }
        (None, None) => return Err("give a metrics log, --trace FILE or --search DIR".into()),
    }
    Ok(())
}

fn check(file: PathBuf) -> Result<(), String> {
    let g = read_graph(&file)?;
    let s = GraphStats::of(&g);
    say!(
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

/// Seconds for a step-time column: milliseconds below one second, so a sub-millisecond step
/// still shows its figure.
fn duration(seconds: f64) -> String {
    if seconds < 1.0 {
        format!("{:.3}ms", seconds * 1e3)
    } else {
        format!("{seconds:.3}s")
    }
}

fn tokenizer_command(c: TokenizerCommand) -> Result<(), String> {
    match c {
        TokenizerCommand::Train {
            corpus,
            vocab_size,
            out,
        } => {
            let t0 = Instant::now();
            let docs = crate::data::corpus::Corpus::read(&corpus)?;
            let tok = TextTokenizer::train_bpe(
                docs.documents.iter().map(|d| d.text.as_str()),
                vocab_size,
            )?;
            tok.save(&out)?;
            say!(
                "trained a byte-level BPE on {} ({} documents, {} bytes) in {:.2}s: vocab {} (asked {vocab_size}), <|endoftext|> = {}, fingerprint {:016x}; wrote {}",
                corpus.display(),
                docs.documents.len(),
                docs.bytes(),
                t0.elapsed().as_secs_f64(),
                tok.vocab_size(),
                tok.eot(),
                tok.fingerprint(),
                out.display()
            );
            Ok(())
        }
        TokenizerCommand::Encode { tokenizer, text } => {
            let tok = TextTokenizer::load(&tokenizer)?;
            let ids: Vec<String> = tok.encode(&text)?.iter().map(|i| i.to_string()).collect();
            say!("{}", ids.join(" "));
            Ok(())
        }
        TokenizerCommand::Decode { tokenizer, ids } => {
            let tok = TextTokenizer::load(&tokenizer)?;
            say!("{}", tok.decode(&ids)?);
            Ok(())
        }
    }
}

fn data_command(c: DataCommand) -> Result<(), String> {
    match c {
        DataCommand::Prepare {
            text,
            data,
            vocab_size,
            seq_len,
        } => {
            let t0 = Instant::now();
            let (tokens, report) = prepare_tokens(&text.options(&data, vocab_size)?)?;
            say!(
                "{}{} tokens, vocab {}, <|endoftext|> = {} | tokenizer {} | tokens {} | {:.2}s (tokenizer {:.2}s, tokenizing {:.2}s)",
                match (report.documents, report.bytes) {
                    (Some(d), Some(b)) => format!("{d} documents, {b} bytes, "),
                    _ => String::new(),
                },
                tokens.len(),
                tokens.header.vocab_size,
                tokens.header.eot,
                report.tokenizer,
                report.tokens,
                t0.elapsed().as_secs_f64(),
                report.seconds_tokenizer,
                report.seconds_tokenize
            );
            if let Some(seq_len) = seq_len {
                let t = TextData::new(tokens, seq_len, text.val_fraction)?;
                say!(
                    "seq_len {seq_len}: {} rows of {} tokens: train {}, val {}; identity {}",
                    t.train_rows() + t.val_rows(),
                    seq_len + 1,
                    t.train_rows(),
                    t.val_rows(),
                    t.identity()
                );
            }
            Ok(())
        }
    }
}
