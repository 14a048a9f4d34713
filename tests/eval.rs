//! Forward-only runs: the validation graph gives the train step's own loss for the same weights
//! and batch, and sampling sees only the context before each position (right padding is
//! invisible), on the interpreter and on cpu.

use graphtrain::checkpoint;
use graphtrain::data::{batch, DataMode};
use graphtrain::eval::{generate, validate, Forward, Sampling};
use graphtrain::ir::optim::OptimConfig;
use graphtrain::lr_schedule::LrSchedule;
use graphtrain::models::Llama3Config;
use graphtrain::passes::Pipeline;
use graphtrain::trainer::{TrainConfig, Trainer};
use graphtrain_lowering::Mode;
use graphtrain_runtime::{Backend, RuntimeOptions};

fn tiny() -> Llama3Config {
    Llama3Config::builtin("tiny").unwrap()
}

fn trainer_on(backend: Backend) -> Trainer {
    let cfg = TrainConfig {
        data: DataMode::Fixed.into(),
        seed: 5,
        lr: LrSchedule::constant(1e-2),
        optim: OptimConfig::default(),
    };
    let mut t = Trainer::new(&tiny(), cfg, &Pipeline::new(Vec::new())).unwrap();
    if backend != Backend::Reference {
        t.use_backend(backend, Mode::Fused).unwrap();
    }
    t
}

fn load(forward: &mut Forward, t: &mut Trainer) {
    let names: Vec<String> = forward.param_names().map(str::to_string).collect();
    let values: Vec<_> = names.iter().map(|n| t.input_value(n).cloned()).collect();
    forward
        .load_params(|name| {
            names
                .iter()
                .position(|n| n == name)
                .and_then(|i| values[i].as_ref())
        })
        .unwrap();
}

#[test]
fn validation_loss_is_the_train_steps_loss_for_the_same_weights_and_batch() {
    for backend in [Backend::Reference, Backend::Cpu] {
        let mut t = trainer_on(backend);
        // Train a few steps so the weights are not the initial ones.
        for _ in 0..3 {
            t.step().unwrap();
        }
        let m = tiny();
        let fixed = batch(DataMode::Fixed, 5, 0, m.batch, m.seq_len, m.vocab_size);
        let mut forward = Forward::validation(&m, backend, &RuntimeOptions::default()).unwrap();
        load(&mut forward, &mut t);
        let v = validate(&mut forward, std::slice::from_ref(&fixed)).unwrap();
        // Step 4's reported loss is the forward loss of the weights after step 3.
        let step = t.step().unwrap();
        let rel = (v.loss - step.loss).abs() / step.loss.abs();
        assert!(
            rel <= 1e-6,
            "{backend}: validation {} vs train step {}",
            v.loss,
            step.loss
        );
        assert!((v.perplexity - v.loss.exp()).abs() <= 1e-12 * v.perplexity);
    }
}

#[test]
fn logits_at_a_position_do_not_depend_on_later_tokens() {
    let mut backends = vec![Backend::Reference, Backend::Cpu];
    backends.extend(graphtrain::gate::device_backends_for_tests());
    for backend in backends {
        let m = tiny();
        let mut t = trainer_on(backend);
        t.step().unwrap();
        let mut forward =
            Forward::logits(&m, 1, m.seq_len, backend, &RuntimeOptions::default()).unwrap();
        load(&mut forward, &mut t);
        let prefix = [3i64, 17, 42, 5, 9];
        let mut a = prefix.to_vec();
        a.resize(m.seq_len, 0);
        let mut b = prefix.to_vec();
        b.extend((prefix.len()..m.seq_len).map(|i| (i * 7 % 60) as i64 + 1));
        let (la, lb) = (
            forward.run_logits(&a).unwrap(),
            forward.run_logits(&b).unwrap(),
        );
        let v = m.vocab_size;
        let upto = prefix.len() * v;
        assert_eq!(
            la.data[..upto],
            lb.data[..upto],
            "{backend}: the prefix's logits changed"
        );
        assert_ne!(
            la.data[upto..],
            lb.data[upto..],
            "later positions must see their tokens"
        );
    }
}

#[test]
fn greedy_generation_is_the_same_on_cpu_and_on_the_interpreter() {
    let m = tiny();
    let greedy = Sampling {
        temperature: 0.0,
        top_k: 0,
        seed: 0,
    };
    let mut outs = Vec::new();
    for backend in [Backend::Reference, Backend::Cpu] {
        let mut t = trainer_on(backend);
        for _ in 0..5 {
            t.step().unwrap();
        }
        let mut forward =
            Forward::logits(&m, 1, m.seq_len, backend, &RuntimeOptions::default()).unwrap();
        load(&mut forward, &mut t);
        // Longer than one context, so the window slides.
        let out = generate(&mut forward, &[1, 2, 3], m.seq_len + 4, &greedy, None).unwrap();
        assert_eq!(out.len(), m.seq_len + 4);
        assert!(out.iter().all(|&t| (0..m.vocab_size as i64).contains(&t)));
        outs.push(out);
    }
    assert_eq!(outs[0], outs[1]);
}

/// A tokenizer smaller than the model's vocabulary: ids it cannot decode are never drawn, even
/// at a temperature that makes every id likely.
#[test]
fn generation_draws_only_ids_the_tokenizer_knows() {
    let m = tiny();
    let hot = Sampling {
        temperature: 50.0,
        top_k: 0,
        seed: 7,
    };
    let mut t = trainer_on(Backend::Cpu);
    t.step().unwrap();
    let mut forward =
        Forward::logits(&m, 1, m.seq_len, Backend::Cpu, &RuntimeOptions::default()).unwrap();
    load(&mut forward, &mut t);
    let out = generate(&mut forward, &[1, 2, 3], 60, &hot, Some(5)).unwrap();
    assert!(out.iter().all(|&t| (0..5).contains(&t)), "{out:?}");
    let all = generate(&mut forward, &[1, 2, 3], 60, &hot, None).unwrap();
    assert!(
        all.iter().any(|&t| t >= 5),
        "the hot draw never left 0..5: {all:?}"
    );
}

#[test]
fn a_validation_graph_refuses_weights_it_cannot_use() {
    let m = tiny();
    let mut forward =
        Forward::validation(&m, Backend::Reference, &RuntimeOptions::default()).unwrap();
    let e = forward.load_params(|_| None).unwrap_err();
    assert!(e.0.contains("needs parameter `"), "{e}");
    let wrong = graphtrain::ir::HostTensor::zeros(graphtrain::ir::TensorType::new(
        graphtrain::ir::DType::F32,
        [3],
    ));
    let e = forward.load_params(|_| Some(&wrong)).unwrap_err();
    assert!(e.0.contains("the forward pass needs"), "{e}");
}

// ---- `graphtrain run` with validation and a sample, then `graphtrain generate` ----

fn graphtrain(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn text_run_files(name: &str) -> (std::path::PathBuf, String, String, String) {
    let dir = std::env::temp_dir().join(format!("graphtrain-eval-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("text.ron");
    let cfg = Llama3Config {
        vocab_size: 512,
        ..tiny()
    };
    std::fs::write(&config, graphtrain::config::config_to_ron(&cfg)).unwrap();
    let words = ["the", "king", "is", "dead", "long", "live", "queen", "and"];
    let text: String = (0..300)
        .map(|i| {
            let w: Vec<&str> = (0..6).map(|j| words[(i * 3 + j * 5) % 8]).collect();
            format!("{}.\n", w.join(" "))
        })
        .collect();
    let corpus = dir.join("corpus.txt");
    std::fs::write(&corpus, text).unwrap();
    let s = |p: std::path::PathBuf| p.to_str().unwrap().to_string();
    (dir.clone(), s(config), s(corpus), s(dir.join("cache")))
}

#[test]
fn a_text_run_validates_samples_and_its_checkpoint_generates() {
    let (dir, config, corpus, cache) = text_run_files("run");
    let ckpt = dir.join("run.ckpt");
    let metrics = dir.join("run.jsonl");
    let o = graphtrain(&[
        "run",
        "--config",
        &config,
        "--data",
        &corpus,
        "--data-cache",
        &cache,
        "--lr",
        "1e-2",
        "--steps",
        "12",
        "--val-every",
        "5",
        "--sample-tokens",
        "20",
        "--prompt",
        "the king",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{err}\n{out}");
    // Steps 5 and 10, and the last one.
    let vals: Vec<f64> = out
        .lines()
        .filter(|l| l.starts_with("val: step"))
        .map(|l| {
            let loss = l.split("loss:").nth(1).unwrap().split_whitespace().next();
            loss.unwrap().parse().unwrap()
        })
        .collect();
    assert_eq!(vals.len(), 3, "{out}");
    assert!(vals.iter().all(|v| v.is_finite() && *v > 0.0), "{vals:?}");
    assert!(
        vals[2] < vals[0],
        "the validation loss did not fall: {vals:?}"
    );
    let log = std::fs::read_to_string(&metrics).unwrap();
    assert_eq!(log.matches("\"val_loss\"").count(), 3, "{log}");
    let sample = out.split("sample (20 tokens").nth(1).expect("a sample");
    assert!(sample.contains("the king"), "{out}");
    // The checkpoint carries the tokenizer: generate needs nothing else, and the same seed
    // gives the same text.
    let gen = |seed: &str| {
        let o = graphtrain(&[
            "generate",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--prompt",
            "the",
            "--tokens",
            "15",
            "--sample-seed",
            seed,
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let (a, b) = (gen("1"), gen("1"));
    assert!(a.starts_with("the") && a.len() > 3, "{a:?}");
    assert_eq!(a, b);
}

#[test]
fn validation_and_samples_need_text_and_generate_needs_a_tokenizer() {
    let refused = |args: &[&str], needle: &str| {
        let o = graphtrain(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && err.contains(needle) && !err.contains("panicked"),
            "{args:?}: {err}"
        );
    };
    refused(
        &[
            "run",
            "--config",
            "tiny",
            "--data",
            "fixed",
            "--val-every",
            "5",
        ],
        "no held-out split",
    );
    refused(
        &["run", "--config", "tiny", "--sample-tokens", "5"],
        "samples need text data",
    );
    let dir = std::env::temp_dir().join(format!("graphtrain-eval-{}-synth", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ckpt = dir.join("synthetic.ckpt");
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "1",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    refused(
        &["generate", "--checkpoint", ckpt.to_str().unwrap()],
        "carries no tokenizer",
    );
    refused(
        &[
            "generate",
            "--checkpoint",
            dir.join("missing").to_str().unwrap(),
        ],
        "missing",
    );
}

/// The loss of each `step:` line, as `run` prints it (time and memory vary between runs).
fn step_losses(stdout: &str) -> Vec<(u64, String)> {
    stdout
        .lines()
        .filter_map(|l| {
            let step = l
                .strip_prefix("step:")?
                .split_whitespace()
                .next()?
                .parse()
                .ok()?;
            let loss = l.split("loss:").nth(1)?.split_whitespace().next()?;
            Some((step, loss.to_string()))
        })
        .collect()
}

fn assert_bitwise_same_state(a: &checkpoint::Checkpoint, b: &checkpoint::Checkpoint) {
    assert_eq!(a.header.steps_done, b.header.steps_done);
    assert_eq!(
        a.header.data_batches_consumed,
        b.header.data_batches_consumed
    );
    assert_eq!(a.header.tensors, b.header.tensors);
    for ((entry, x), y) in a.header.tensors.iter().zip(&a.tensors).zip(&b.tensors) {
        let bits = |t: &graphtrain::ir::interp::HostTensor| -> Vec<u64> {
            t.data.iter().map(|v| v.to_bits()).collect()
        };
        assert!(
            x.data.iter().all(|v| v.is_finite()),
            "{} is not finite",
            entry.name
        );
        assert!(bits(x) == bits(y), "{} differs", entry.name);
    }
}

/// `run` on the text of `text_run_files`, checkpointing to `ckpt`, with `extra` flags.
fn text_run_args(
    files: &(std::path::PathBuf, String, String, String),
    ckpt: &std::path::Path,
    extra: &[&str],
) -> Vec<String> {
    let (_, config, corpus, cache) = files;
    let base = [
        "run",
        "--config",
        config,
        "--data",
        corpus,
        "--data-cache",
        cache,
        "--lr",
        "1e-2",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

fn graphtrain_owned(args: &[String]) -> std::process::Output {
    graphtrain(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// A text run killed mid-run (SIGKILL: nothing runs on the way out) and resumed from its last
/// checkpoint ends with the same weights, optimizer state, data position and losses, bit for
/// bit, as a run that was never stopped; validation on the way changes nothing.
#[test]
fn a_killed_text_run_resumes_bitwise() {
    let files = text_run_files("kill");
    let dir = files.0.clone();
    const STEPS: u64 = 300;
    let steps = STEPS.to_string();
    let flags = [
        "--steps",
        &steps,
        "--val-every",
        "40",
        "--checkpoint-every",
        "3",
    ];
    let straight_ckpt = dir.join("straight.ckpt");
    let straight = graphtrain_owned(&text_run_args(&files, &straight_ckpt, &flags));
    assert!(
        straight.status.success(),
        "{}",
        String::from_utf8_lossy(&straight.stderr)
    );

    let killed_ckpt = dir.join("killed.ckpt");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args(text_run_args(&files, &killed_ckpt, &flags))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    loop {
        std::thread::sleep(std::time::Duration::from_millis(5));
        let saved = checkpoint::load(&killed_ckpt).map(|c| c.header.steps_done);
        if matches!(saved, Ok(n) if n >= 6) {
            child.kill().unwrap();
            break;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the run ended ({status}) before it could be killed: make it longer");
        }
    }
    let status = child.wait().unwrap();
    assert!(!status.success(), "the run was not killed: {status}");
    let killed_at = checkpoint::load(&killed_ckpt).unwrap().header.steps_done;
    assert!(killed_at < STEPS, "killed after the last step");

    let killed = killed_ckpt.to_str().unwrap();
    let resumed = graphtrain_owned(&text_run_args(
        &files,
        &killed_ckpt,
        &[&flags[..], &["--resume", killed]].concat(),
    ));
    let out = String::from_utf8_lossy(&resumed.stdout);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert!(out.contains(&format!("after step {killed_at}")), "{out}");
    let want: Vec<_> = step_losses(&String::from_utf8_lossy(&straight.stdout))
        .into_iter()
        .filter(|(s, _)| *s > killed_at)
        .collect();
    assert_eq!(want.len() as u64, STEPS - killed_at);
    assert_eq!(step_losses(&out), want);
    assert_bitwise_same_state(
        &checkpoint::load(&straight_ckpt).unwrap(),
        &checkpoint::load(&killed_ckpt).unwrap(),
    );
}

/// Resuming a text run with another tokenizer would feed the model other token ids: refused,
/// naming the data, and the checkpoint is left as it was.
#[test]
fn resuming_with_another_tokenizer_is_refused() {
    let files = text_run_files("other-tokenizer");
    let dir = files.0.clone();
    let tokenizer = |vocab: &str| {
        let path = dir.join(format!("bpe{vocab}.json"));
        let o = graphtrain(&[
            "tokenizer",
            "train",
            "--corpus",
            &files.2,
            "--vocab-size",
            vocab,
            "--out",
            path.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        path.to_str().unwrap().to_string()
    };
    let (ours, other) = (tokenizer("300"), tokenizer("280"));
    let ckpt = dir.join("run.ckpt");
    let first = graphtrain_owned(&text_run_args(
        &files,
        &ckpt,
        &["--tokenizer", &ours, "--steps", "4"],
    ));
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let before = std::fs::read(&ckpt).unwrap();
    let c = ckpt.to_str().unwrap();
    let o = graphtrain_owned(&text_run_args(
        &files,
        &ckpt,
        &["--tokenizer", &other, "--steps", "6", "--resume", c],
    ));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--data") && err.contains("differs"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        std::fs::read(&ckpt).unwrap(),
        before,
        "the checkpoint changed"
    );
}
