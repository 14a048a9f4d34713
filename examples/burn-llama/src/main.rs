//! Trains the burn-nn Llama of `graphtrain_burn::llama` through graphtrain: burn captures the
//! model's loss, graphtrain imports it, adds backward and AdamW, runs its passes, lowers and
//! trains; the trained weights go back into the burn module and, with `--record-out`, into a
//! burnpack record that burn loads as usual. `--peer burn` trains the same model from the same
//! weights on the same batches with burn itself (flex, autodiff, AdamW) instead.
//!
//! ```sh
//! cargo run --release -p burn-llama -- --config tiny --data fixed --steps 20
//! cargo run --release -p burn-llama -- --config tiny --data fixed --steps 20 --peer burn
//! ```

use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::store::{BurnpackStore, ModuleSnapshot};
use burn::tensor::{Device, Int, Tensor, TensorData};
use clap::Parser;
use graphtrain::data::{Batch, DataSource};
use graphtrain::ir::optim::{OptimConfig, Optimizer as GtOptimizer};
use graphtrain::lr_schedule::LrSchedule;
use graphtrain::models::Llama3Config;
use graphtrain::passes::pipeline::PipelineSpec;
use graphtrain::passes::registry::Registry;
use graphtrain::trainer::{ImportedModel, TrainConfig, Trainer};
use graphtrain_burn::llama::{Llama, LlamaConfig};
use graphtrain_burn::{capture_loss, import, weights};
use graphtrain_runtime::{Backend, CompileOptions};
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "Train a burn-nn Llama through graphtrain's compiled step")]
struct Args {
    /// A graphtrain config whose shape the burn model takes (tiny, small, peer, ...): its
    /// dim, layers, heads (without grouped-query heads), FFN width, vocabulary, batch and
    /// sequence length.
    #[arg(long, default_value = "tiny")]
    config: String,
    #[arg(long, default_value_t = 20)]
    steps: u64,
    /// `fixed` (batch 0 every step), `random` (a fresh batch each step) or a PATH to text, as
    /// `graphtrain run --data` (with its text flags: --tokenizer, --data-cache, ...).
    #[arg(long, default_value = "fixed", value_parser = graphtrain::cli::parse_data_arg)]
    data: graphtrain::cli::DataArg,
    #[command(flatten)]
    text: graphtrain::cli::TextDataArgs,
    /// Vocab size of the BPE trained on a --data PATH when no --tokenizer is given.
    #[arg(long)]
    vocab_size: Option<usize>,
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seeds the batches and burn's initial weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Where graphtrain runs the step: cpu, reference, wgpu or cuda.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// graphtrain's pass pipeline, as `graphtrain run --passes`.
    #[arg(long, default_value = "default")]
    passes: String,
    /// Train with burn itself (`burn`: flex, autodiff, AdamW) instead of graphtrain.
    #[arg(long)]
    peer: Option<String>,
    /// Write the trained weights as a burnpack record here.
    #[arg(long)]
    record_out: Option<PathBuf>,
    /// `f32`, or `bf16-mixed` (as `graphtrain run --precision`: the matmuls on bf16 copies,
    /// f32 accumulation, everything else f32). graphtrain only.
    #[arg(long, default_value = "f32")]
    precision: String,
    /// The mesh to train on (graphtrain only), as `graphtrain run --mesh`. Without `--plan`, the
    /// built-in Llama plan (the burn model has torchtitan's parameter names) with its split
    /// axes moved to burn's `[d_in, d_out]` Linear weights.
    #[command(flatten)]
    mesh: graphtrain::cli::MeshArgs,
}

fn main() {
    if let Err(e) = run(Args::parse()) {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// graphtrain's default AdamW (no clipping), which both trainers run: its hyperparameters
/// `(beta1, beta2, eps, weight_decay)`.
fn adamw() -> Result<(f64, f64, f64, f64), String> {
    match OptimConfig::default() {
        OptimConfig {
            optimizer:
                GtOptimizer::AdamW {
                    beta1,
                    beta2,
                    eps,
                    weight_decay,
                },
            max_grad_norm: None,
            micro_batches: 1,
        } => Ok((beta1, beta2, eps, weight_decay)),
        other => Err(format!(
            "the burn peer runs AdamW without clipping, not {other:?}"
        )),
    }
}

fn int_data(v: &[i64], cfg: &Llama3Config) -> TensorData {
    TensorData::new(v.to_vec(), [cfg.batch, cfg.seq_len])
}

fn run(args: Args) -> Result<(), String> {
    let cfg = graphtrain::config::load_config(&args.config)?;
    let shape = LlamaConfig::like(&cfg)?;
    let (data, report, _) =
        graphtrain::cli::data_source(&args.data, &args.text, args.vocab_size, &cfg)?;
    if let Some(line) = report {
        println!("{line}");
    }
    // On the autodiff device, so that burn's own training (the peer) tracks the parameters;
    // capture takes the module without autodiff.
    let device = Device::flex().autodiff();
    device.seed(args.seed);
    let model = shape.init(&device);
    let params: usize = weights::values(&model)?
        .iter()
        .map(|(_, t)| t.data.len())
        .sum();
    println!(
        "burn-nn Llama on `{}`: {} layers, dim {}, {} heads, vocab {}, {params} parameters",
        args.config, cfg.n_layers, cfg.dim, cfg.n_heads, cfg.vocab_size
    );
    let model = match args.peer.as_deref() {
        Some("burn") if args.mesh.mesh.is_some() || args.precision != "f32" => {
            return Err(
                "--mesh and --precision train through graphtrain; the burn peer runs on one \
device in f32"
                    .into(),
            )
        }
        Some("burn") => train_with_burn(&args, &cfg, &data, model)?,
        Some(other) => return Err(format!("--peer `{other}`: the peer is `burn`")),
        None => train_with_graphtrain(&args, &cfg, data, model)?,
    };
    if let Some(peak) = peak_rss_mib() {
        println!("peak RSS {peak:.0} MiB");
    }
    if let Some(path) = &args.record_out {
        let mut store = BurnpackStore::from_file(path).overwrite(true);
        model
            .save_into(&mut store)
            .map_err(|e| format!("writing {}: {e:?}", path.display()))?;
        println!(
            "wrote the trained weights as a burnpack record: {}",
            path.display()
        );
    }
    Ok(())
}

fn train_with_graphtrain(
    args: &Args,
    cfg: &Llama3Config,
    data: DataSource,
    model: Llama,
) -> Result<Llama, String> {
    let backend: Backend = args.backend.parse()?;
    let sample = vec![0i64; cfg.batch * cfg.seq_len];
    let started = Instant::now();
    let captured = capture_loss(
        &model,
        &[
            ("tokens", int_data(&sample, cfg)),
            ("targets", int_data(&sample, cfg)),
        ],
        |m, t| m.loss(t[0].clone(), t[1].clone()),
    )?;
    let imported = import(&captured)?;
    let recognised: Vec<String> = imported
        .composites
        .iter()
        .map(|(k, n)| format!("{k} x{n}"))
        .collect();
    println!(
        "captured {} burn ops, imported with composites: {} ({:.2} s)",
        captured.graph.operations.len(),
        recognised.join(", "),
        started.elapsed().as_secs_f64()
    );
    let pipeline = PipelineSpec::parse_list(&args.passes)
        .and_then(|p| p.build(&Registry::builtin()))
        .map_err(|e| format!("--passes: {e}"))?;
    let precision = graphtrain::ir::autocast::Precision::parse(&args.precision)
        .map_err(|e| format!("--precision: {e}"))?;
    // Without --plan, the built-in Llama plan with its split axes moved to burn's layout.
    let mut mesh = args.mesh.mesh_run()?;
    if let (Some(run), None) = (mesh.as_mut(), &args.mesh.plan) {
        run.plan = graphtrain_burn::plan::llama_plan(&run.mesh);
    }
    let mut trainer = Trainer::build_imported(
        cfg,
        &ImportedModel {
            forward: imported.traced,
            initial: imported.initial,
        },
        TrainConfig {
            data,
            seed: args.seed,
            lr: LrSchedule::constant(args.lr),
            optim: OptimConfig::default(),
        },
        backend,
        &CompileOptions {
            pipeline: &pipeline,
            mode: graphtrain_lowering::Mode::Fused,
            fusion: Default::default(),
            runtime: Default::default(),
            precision,
        },
        mesh.as_ref(),
    )
    .map_err(|e| e.to_string())?;
    let mut last_batch: Option<Batch> = None;
    let mut seconds = 0.0;
    for _ in 0..args.steps {
        let m = trainer.step().map_err(|e| e.to_string())?;
        println!(
            "step {:>4}  loss {:.6}  grad_norm {:.4}  {:.0} tok/s",
            m.step,
            m.loss,
            m.grad_norm,
            m.tokens as f64 / m.seconds
        );
        if m.step > 1 {
            seconds += m.seconds;
        }
        last_batch = trainer.last_whole_batch().map_err(|e| e.to_string())?;
    }
    if args.steps > 1 {
        println!(
            "graphtrain ({}): {:.0} tok/s over steps 2..{}",
            args.backend,
            (cfg.batch * cfg.seq_len) as f64 * (args.steps - 1) as f64 / seconds,
            args.steps
        );
    }
    let trained = trainer.parameters().map_err(|e| e.to_string())?;
    let model = weights::apply(model, &trained)?;
    if let Some(b) = last_batch {
        let loss = model
            .valid()
            .loss(
                Tensor::<2, Int>::from_data(int_data(&b.tokens, cfg), &Device::flex()),
                Tensor::<2, Int>::from_data(int_data(&b.targets, cfg), &Device::flex()),
            )
            .into_scalar::<f32>();
        println!("burn's loss of the trained weights on the last batch: {loss:.6}");
    }
    Ok(model)
}

fn train_with_burn(
    args: &Args,
    cfg: &Llama3Config,
    data: &DataSource,
    model: Llama,
) -> Result<Llama, String> {
    let (beta1, beta2, eps, weight_decay) = adamw()?;
    let device = Device::flex().autodiff();
    let mut model = model;
    let mut optim = AdamWConfig::new()
        .with_beta_1(beta1 as f32)
        .with_beta_2(beta2 as f32)
        .with_epsilon(eps as f32)
        .with_weight_decay(weight_decay as f32)
        .init();
    let mut seconds = 0.0;
    for step in 1..=args.steps {
        let b = data.batch(args.seed, step - 1, cfg.batch, cfg.seq_len, cfg.vocab_size)?;
        let t = Instant::now();
        let loss = model.loss(
            Tensor::<2, Int>::from_data(int_data(&b.tokens, cfg), &device),
            Tensor::<2, Int>::from_data(int_data(&b.targets, cfg), &device),
        );
        let value = loss.clone().into_scalar::<f32>();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optim.step(args.lr, model, grads);
        let took = t.elapsed().as_secs_f64();
        if step > 1 {
            seconds += took;
        }
        println!(
            "step {step:>4}  loss {value:.6}  {:.0} tok/s",
            (cfg.batch * cfg.seq_len) as f64 / took
        );
    }
    if args.steps > 1 {
        println!(
            "burn (flex, eager): {:.0} tok/s over steps 2..{}",
            (cfg.batch * cfg.seq_len) as f64 * (args.steps - 1) as f64 / seconds,
            args.steps
        );
    }
    Ok(model.valid())
}

/// The process's peak resident memory (Linux `VmHWM`), in MiB.
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}
