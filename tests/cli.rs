//! The `graphtrain` binary end to end: the commands README.md shows, and bad input of every kind
//! giving a clear error (never a panic).

use std::process::{Command, Output};

fn graphtrain(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Fails unless the command failed cleanly with a message containing every `needle`.
fn assert_clean_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(
        !o.status.success(),
        "expected failure, got success; stdout:\n{}",
        stdout(o)
    );
    assert!(!err.contains("panicked"), "panic:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks `{n}`:\n{err}");
    }
}

/// A folder of this test process's own, named `name`.
fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("graphtrain-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn temp_file(name: &str, body: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("graphtrain-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

#[test]
fn run_tiny_prints_torchtitan_style_step_lines() {
    let o = graphtrain(&[
        "run", "--model", "llama3", "--config", "tiny", "--steps", "3", "--data", "fixed",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let steps: Vec<&str> = out.lines().filter(|l| l.starts_with("step:")).collect();
    assert_eq!(steps.len(), 3, "{out}");
    for l in steps {
        for key in ["loss:", "grad_norm:", "memory:", "tps:", "tflops:", "mfu:"] {
            assert!(l.contains(key), "`{key}` missing in `{l}`");
        }
        // The default backend is cpu, measured against the machine's peak where it is known.
        if graphtrain::peak::peak("cpu", None).is_some() {
            assert!(
                l.trim_end().ends_with('%'),
                "mfu is not a percentage in `{l}`"
            );
        } else {
            assert!(l.trim_end().ends_with("mfu: n/a"), "{l}");
        }
    }
}

// `--lr-warmup` and `--lr-decay` schedule the lr that each step line and the metrics log show;
// a schedule that cannot be run is refused naming the flag.
#[test]
fn run_schedules_the_lr_and_refuses_an_impossible_schedule() {
    let dir = scratch_dir("lr-schedule");
    let metrics = dir.join("run.jsonl");
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "4",
        "--data",
        "fixed",
        "--lr",
        "0.01",
        "--lr-warmup",
        "2",
        "--lr-decay",
        "linear",
        "--lr-min-ratio",
        "0",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let shown: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with("step:"))
        .map(|l| l.split("lr: ").nth(1).expect("the step line shows its lr"))
        .collect();
    assert_eq!(
        shown,
        ["5.000e-3", "1.000e-2", "5.000e-3", "0.000e0"],
        "{out}"
    );
    assert!(
        out.contains("lr 0.01, warm-up 2 steps, linear to 0x at step 4"),
        "{out}"
    );
    let logged: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == "step")
        .map(|v| v["lr"].as_f64().unwrap())
        .collect();
    assert_eq!(logged, [0.005, 0.01, 0.005, 0.0]);

    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "4",
        "--data",
        "fixed",
        "--lr-warmup",
        "4",
        "--lr-decay",
        "cosine",
    ]);
    assert_clean_error(&o, &["--lr-decay cosine", "--lr-warmup", "--steps"]);
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "4",
        "--data",
        "fixed",
        "--lr-decay",
        "cosine",
        "--lr-min-ratio",
        "2",
    ]);
    assert_clean_error(&o, &["--lr-min-ratio must be in [0, 1]"]);
    let o = graphtrain(&["run", "--config", "tiny", "--lr-decay", "exponential"]);
    assert_clean_error(&o, &["exponential", "cosine"]);

    // A checkpoint keeps the schedule it trained with: a resume under the same one goes on
    // quietly, one under another says so.
    let ckpt = dir.join("warm.ckpt");
    let base = [
        "run",
        "--config",
        "tiny",
        "--data",
        "fixed",
        "--lr-warmup",
        "4",
    ];
    let o = graphtrain(
        &[
            &base[..],
            &["--steps", "2", "--checkpoint", ckpt.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let resume = ["--steps", "3", "--resume", ckpt.to_str().unwrap()];
    let o = graphtrain(&[&base[..], &resume].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        !stdout(&o).contains("was trained with lr"),
        "{}",
        stdout(&o)
    );
    assert!(
        stdout(&o).contains("lr: 7.500e-4"),
        "step 3 of the warm-up: {}",
        stdout(&o)
    );
    let o = graphtrain(&[&base[..5], &resume].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o)
            .contains("was trained with lr 0.001, warm-up 4 steps; this run goes on with lr 0.001"),
        "{}",
        stdout(&o)
    );
}

/// A step that cannot fit says so with the numbers before allocating: on the host (the 8b
/// model's f64 parameter and state copies exceed any machine this runs on, and a limit makes
/// that certain) and on the cpu backend (its arena, from the buffer plan).
/// `--micro-batches` splits `--batch` into micro-batches: the run says so and trains as the
/// whole batch does (the same losses to the step line's four places); a batch that does not
/// split, and zero micro-batches or rows, are refused naming the flag.
#[test]
fn run_splits_the_batch_into_micro_batches_and_refuses_an_uneven_split() {
    let losses = |extra: &[&str]| -> (String, Vec<String>) {
        let mut args = vec!["run", "--config", "tiny", "--steps", "3", "--batch", "4"];
        args.extend_from_slice(extra);
        let o = graphtrain(&args);
        assert!(o.status.success(), "{extra:?}: {}", stderr(&o));
        let out = stdout(&o);
        let losses = out
            .lines()
            .filter(|l| l.starts_with("step:"))
            .map(|l| l.split_whitespace().nth(3).unwrap().to_string())
            .collect();
        (out, losses)
    };
    let (_, whole) = losses(&[]);
    let (out, split) = losses(&["--micro-batches", "2"]);
    assert_eq!(split, whole, "{out}");
    assert_eq!(whole.len(), 3);
    assert!(
        out.contains("batch of 4 rows in 2 micro-batches of 2"),
        "{out}"
    );
    // A run checkpointed in 2 micro-batches goes on unsplit, saying so, with the losses the
    // whole run had.
    let ckpt = scratch_dir("micro-batches").join("split.ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let base = ["run", "--config", "tiny", "--batch", "4"];
    let first = [
        &base[..],
        &["--steps", "2", "--micro-batches", "2", "--checkpoint", ckpt],
    ];
    let o = graphtrain(&first.concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let o = graphtrain(&[&base[..], &["--steps", "3", "--resume", ckpt]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("was trained in 2 micro-batch(es) a step; this run goes on in 1"),
        "{out}"
    );
    let step3 = out
        .lines()
        .find(|l| l.starts_with("step:  3"))
        .expect("step 3");
    assert_eq!(
        step3.split_whitespace().nth(3),
        Some(whole[2].as_str()),
        "{out}"
    );
    for (args, needle) in [
        (
            &["--batch", "4", "--micro-batches", "3"][..],
            "--micro-batches 3: the batch of 4 rows does not split into 3 equal micro-batches",
        ),
        (
            &["--micro-batches", "0"][..],
            "--micro-batches must be at least 1",
        ),
        (&["--batch", "0"][..], "--batch must be at least 1"),
    ] {
        let mut all = vec!["run", "--config", "tiny", "--steps", "1"];
        all.extend_from_slice(args);
        assert_clean_error(&graphtrain(&all), &[needle]);
    }
}

#[test]
fn a_step_that_does_not_fit_says_so_with_the_planner_numbers() {
    let limited = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_graphtrain"))
            .args(args)
            .env("GRAPHTRAIN_MEMORY_LIMIT_MIB", "200")
            .output()
            .expect("the binary runs")
    };
    let o = limited(&["run", "--config", "8b", "--steps", "1"]);
    assert_clean_error(
        &o,
        &["does not fit", "f64 host copies", "200.0 MiB is available"],
    );
    let o = limited(&["run", "--config", "tiny", "--steps", "1"]);
    assert!(o.status.success(), "tiny fits in 200 MiB: {}", stderr(&o));
    // peer: its host copies fit, its 251 MiB arena does not.
    let o = limited(&["run", "--config", "peer", "--steps", "1"]);
    assert_clean_error(
        &o,
        &[
            "the program does not fit",
            "buffer plan needs",
            "liveness lower bound",
        ],
    );
    // 64 x 2048 tokens of 32768-way logits need a 48 GiB arena, past what the cpu kernels'
    // 32-bit offsets reach: an error, not a panic in cubecl (nor the constant folder trying to
    // allocate the logits-sized fills).
    let huge = temp_file(
        "huge.ron",
        "(dim: 32, n_layers: 2, n_heads: 4, n_kv_heads: 2, vocab_size: 32768, ffn_hidden: 48,
          rope_theta: 500000.0, rope_layout: Interleaved, norm_eps: 1e-5, batch: 64,
          seq_len: 2048, tied_embeddings: false)",
    );
    let o = graphtrain(&["run", "--config", huge.to_str().unwrap(), "--steps", "1"]);
    assert_clean_error(&o, &["the program does not fit", "2^32 elements"]);
}

/// A runtime variable set to a value it does not take stops the run with an error naming the
/// variable and what it takes: before, an unknown GEMM kernel ran the widest, any word in
/// `GRAPHTRAIN_PROFILE` (`0` too) turned profiling on and a malformed timeout was dropped.
#[test]
fn a_runtime_variable_with_a_wrong_value_is_refused_by_name() {
    for (name, value, says) in [
        (
            "GRAPHTRAIN_GEMM_KERNEL",
            "avx9",
            "widest, avx512, avx2 or scalar",
        ),
        ("GRAPHTRAIN_PROFILE", "yes", "takes 1, steps or 0"),
        (
            "GRAPHTRAIN_COLLECTIVE_TIMEOUT_S",
            "soon",
            "not a positive number of seconds",
        ),
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_graphtrain"))
            .args(["run", "--config", "tiny", "--steps", "1"])
            .env(name, value)
            .output()
            .expect("the binary runs");
        assert_clean_error(&o, &[name, value, says]);
    }
    // The values they take still run, and `0` turns the profile off where `1` turns it on.
    for (profile, profiled) in [("0", false), ("1", true)] {
        let o = Command::new(env!("CARGO_BIN_EXE_graphtrain"))
            .args(["bench", "--config", "tiny", "--steps", "2", "--warmup", "1"])
            .env("GRAPHTRAIN_GEMM_KERNEL", "scalar")
            .env("GRAPHTRAIN_PROFILE", profile)
            .env("GRAPHTRAIN_COLLECTIVE_TIMEOUT_S", "2.5")
            .output()
            .expect("the binary runs");
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(
            stdout(&o).contains("profile over"),
            profiled,
            "GRAPHTRAIN_PROFILE={profile}:\n{}",
            stdout(&o)
        );
    }
}

#[test]
fn unknown_config_lists_the_known_ones() {
    let o = graphtrain(&["run", "--config", "nope"]);
    assert_clean_error(
        &o,
        &["unknown config `nope`", "tiny", "debug", "peer", "8b"],
    );
}

#[test]
fn unknown_model_lists_the_known_ones() {
    let o = graphtrain(&["trace", "--model", "gpt2", "--config", "tiny"]);
    assert_clean_error(&o, &["unknown model `gpt2`", "llama3"]);
}

/// `--backend wgpu` trains (on lavapipe without a GPU). Skipped with a message where no adapter
/// exists, except under CI, which installs lavapipe.
#[test]
fn run_trains_on_wgpu() {
    if graphtrain::gate::device_backends_for_tests().is_empty() {
        return;
    }
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--backend",
        "wgpu",
        "--steps",
        "2",
    ]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success(),
        "{}{out}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(out.contains("step:  2 loss:"), "{out}");
}

/// `GRAPHTRAIN_DEVICE_BUFFER_MIB` below the arena splits it across device buffers, which
/// `run` says, and the step lines are those of the arena in one buffer; a value that is not a
/// positive number of MiB is refused, naming the variable.
#[test]
fn a_device_buffer_limit_splits_the_arena_and_trains_the_same() {
    if graphtrain::gate::device_backends_for_tests().is_empty() {
        return;
    }
    // A 5.3 MiB arena.
    let cfg = temp_file(
        "wide.ron",
        "(dim: 256, n_layers: 1, n_heads: 4, n_kv_heads: 4, vocab_size: 64, ffn_hidden: 48,
          rope_theta: 10000.0, rope_layout: Half, norm_eps: 1e-5, batch: 2, seq_len: 16,
          tied_embeddings: false)",
    );
    let run = |limit: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_graphtrain"));
        c.args(["run", "--config", cfg.to_str().unwrap()]).args([
            "--backend",
            "wgpu",
            "--steps",
            "2",
        ]);
        if let Some(mib) = limit {
            c.env("GRAPHTRAIN_DEVICE_BUFFER_MIB", mib);
        }
        c.output().expect("the binary runs")
    };
    let steps = |o: &Output| -> Vec<String> {
        assert!(o.status.success(), "{}", stderr(o));
        let out = stdout(o);
        let lines: Vec<String> = out
            .lines()
            .filter(|l| l.starts_with("step:"))
            .map(|l| l.split(" memory:").next().unwrap().to_string())
            .collect();
        assert_eq!(lines.len(), 2, "{out}");
        lines
    };
    let whole = run(None);
    assert!(
        !stdout(&whole).contains("device buffers"),
        "{}",
        stdout(&whole)
    );
    let split = run(Some("2"));
    assert!(
        stdout(&split).contains("in 3 device buffers of at most 2.00MiB"),
        "{}",
        stdout(&split)
    );
    assert_eq!(steps(&split), steps(&whole));
    assert_clean_error(
        &run(Some("0")),
        &["GRAPHTRAIN_DEVICE_BUFFER_MIB=`0`", "at least 1"],
    );
}

/// A wgpu device that is named but cannot be opened is an error, not a crash.
#[test]
fn a_wgpu_device_that_cannot_open_is_an_error() {
    let o = Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args([
            "run",
            "--config",
            "tiny",
            "--backend",
            "wgpu",
            "--steps",
            "1",
        ])
        .env("CUBECL_WGPU_DEFAULT_DEVICE", "DiscreteGpu(63)")
        .env("RUST_BACKTRACE", "0")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: backend `wgpu`") && last.contains("--backend cpu"),
        "{err}"
    );
    assert!(!err.contains("RecvError"), "{err}");
}

#[test]
fn unknown_flag_and_backend_are_refused() {
    let o = graphtrain(&["run", "--config", "tiny", "--bogus"]);
    assert_clean_error(&o, &["--bogus"]);
    assert_eq!(o.status.code(), Some(2));
    // Not compiled in (the default build), or compiled in on a machine without an NVIDIA GPU.
    let o = graphtrain(&["run", "--config", "tiny", "--backend", "cuda"]);
    assert_clean_error(&o, &["backend `cuda`", "NVIDIA", "--backend cpu"]);
    let o = graphtrain(&["run", "--config", "tiny", "--backend", "tpu"]);
    assert_clean_error(&o, &["unknown backend `tpu`", "cpu, reference, wgpu, cuda"]);
}

#[test]
fn config_show_reads_back_and_a_wrong_field_is_named() {
    let o = graphtrain(&["config", "show", "tiny"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let good = temp_file("tiny.ron", &stdout(&o));
    let o = graphtrain(&["trace", "--config", good.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));

    let bad = stdout(&graphtrain(&["config", "show", "tiny"])).replace("n_layers", "n_layer");
    let bad = temp_file("bad.ron", &bad);
    let o = graphtrain(&["run", "--config", bad.to_str().unwrap()]);
    assert_clean_error(&o, &["bad.ron", "n_layer", ":"]);

    let o = graphtrain(&["config", "show", "huge"]);
    assert_clean_error(&o, &["unknown config `huge`", "405b"]);
}

const GOOD_GRAPH: &str = "graph g {
  input %x: f32[2,3]
  input %w: f32[3,4]
  %2: f32[2,4] = matmul(%x, %w)  # fwd
  output y = %2
}
";

#[test]
fn check_accepts_a_valid_graph_file() {
    let p = temp_file("good.gt", GOOD_GRAPH);
    let o = graphtrain(&["check", p.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("is valid"));
}

#[test]
fn bad_graph_files_give_clear_errors() {
    // Truncated: the closing brace and the output line are gone.
    let truncated = &GOOD_GRAPH[..GOOD_GRAPH.find("  output").unwrap()];
    let p = temp_file("truncated.gt", truncated);
    assert_clean_error(
        &graphtrain(&["check", p.to_str().unwrap()]),
        &["truncated.gt", "line"],
    );

    let p = temp_file("unknown_op.gt", &GOOD_GRAPH.replace("matmul(", "matmull("));
    assert_clean_error(
        &graphtrain(&["check", p.to_str().unwrap()]),
        &["line 4", "unknown op `matmull`", "matmul"],
    );

    let p = temp_file(
        "shape.gt",
        &GOOD_GRAPH.replace("%w: f32[3,4]", "%w: f32[5,4]"),
    );
    assert_clean_error(
        &graphtrain(&["check", p.to_str().unwrap()]),
        &["node 0", "matmul", "3 vs 5"],
    );

    let p = temp_file(
        "use_before_def.gt",
        &GOOD_GRAPH.replace("matmul(%x, %w)", "matmul(%x, %7)"),
    );
    assert_clean_error(
        &graphtrain(&["check", p.to_str().unwrap()]),
        &["line 4", "%7"],
    );

    let p = temp_file("missing.gt", "");
    let missing = p.with_file_name("does-not-exist.gt");
    assert_clean_error(
        &graphtrain(&["check", missing.to_str().unwrap()]),
        &["cannot read"],
    );
}

#[test]
fn passes_list_and_explain() {
    let o = graphtrain(&["passes", "list"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for name in [
        "canonicalize",
        "cse",
        "dce",
        "default pipeline: canonicalize,cse,dce,attention_stats,gather_bf16,capture",
    ] {
        assert!(out.contains(name), "`{name}` missing:\n{out}");
    }
    let o = graphtrain(&["passes", "explain", "cse"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("tier 1"));
    assert_clean_error(
        &graphtrain(&["passes", "explain", "nope"]),
        &["unknown pass `nope`", "dce"],
    );
}

#[test]
fn bad_pipelines_give_clear_errors() {
    assert_clean_error(
        &graphtrain(&[
            "run",
            "--config",
            "tiny",
            "--steps",
            "1",
            "--passes",
            "cse,frobnicate",
        ]),
        &["unknown pass `frobnicate`", "known passes", "canonicalize"],
    );
    assert_clean_error(
        &graphtrain(&[
            "run", "--config", "tiny", "--steps", "1", "--passes", "cse=fast",
        ]),
        &["pass `cse` takes no option"],
    );
    assert_clean_error(
        &graphtrain(&[
            "run",
            "--config",
            "tiny",
            "--steps",
            "1",
            "--disable-pass",
            "ac_foo",
        ]),
        &["unknown pass `ac_foo`"],
    );
    assert_clean_error(
        &graphtrain(&[
            "run",
            "--config",
            "tiny",
            "--steps",
            "1",
            "--passes",
            "cse",
            "--disable-pass",
            "dce",
        ]),
        &["`dce` is not in the pipeline (cse)"],
    );
    let p = temp_file("pipeline.ron", "(passes: [(name: \"cse\", optoin: None)])");
    assert_clean_error(
        &graphtrain(&[
            "run",
            "--config",
            "tiny",
            "--steps",
            "1",
            "--pipeline",
            p.to_str().unwrap(),
        ]),
        &["pipeline.ron", "1:", "optoin"],
    );
}

#[test]
fn run_with_a_pipeline_file_and_dump_dir() {
    let p = temp_file(
        "good-pipeline.ron",
        "(passes: [(name: \"canonicalize\"), (name: \"dce\")])",
    );
    let dump = std::env::temp_dir().join(format!("graphtrain-dump-{}", std::process::id()));
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "1",
        "--pipeline",
        p.to_str().unwrap(),
        "--dump-dir",
        dump.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("pass canonicalize"), "{}", stdout(&o));
    for f in ["00-input.gt", "01-canonicalize.gt", "02-dce.gt"] {
        let text = std::fs::read_to_string(dump.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
        assert!(text.starts_with("graph train_step"), "{f}");
    }
}

#[test]
fn passes_apply_rewrites_and_checks_numerics() {
    let src = "graph g {
  input %x: f32[2,3]
  %1: f32[3,2] = transpose(%x, perm=[1,0])  # fwd
  %2: f32[2,3] = transpose(%1, perm=[1,0])  # fwd
  %3: f32[2,3] = exp(%2)  # fwd
  %4: f32[2,3] = exp(%2)  # fwd
  %5: f32[2,3] = add(%3, %4)  # fwd
  output y = %5
}
";
    let p = temp_file("apply.gt", src);
    let o = graphtrain(&[
        "passes",
        "apply",
        "--pass",
        "canonicalize",
        "--pass",
        "cse",
        "--pass",
        "dce",
        "--check",
        p.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        !out.contains("transpose") && out.matches("exp(").count() == 1,
        "{out}"
    );
    assert!(stderr(&o).contains("numerics: identical"), "{}", stderr(&o));
}

#[test]
fn bench_reports_speed_compile_time_and_memory() {
    let json = std::env::temp_dir().join(format!("graphtrain-bench-{}.json", std::process::id()));
    let o = graphtrain(&[
        "bench",
        "--config",
        "tiny",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for key in [
        "(warmup)",
        "summary: median_tps:",
        "compile: trace",
        "memory: predicted",
    ] {
        assert!(out.contains(key), "`{key}` missing:\n{out}");
    }
    let body = std::fs::read_to_string(&json).unwrap();
    for key in [
        "\"median_tps\"",
        "\"predicted_peak_bytes\"",
        "\"losses\"",
        "\"compile\"",
        "\"peak_gflops\"",
        "\"peak_source\"",
    ] {
        assert!(body.contains(key), "`{key}` missing from the JSON");
    }
    assert_clean_error(
        &graphtrain(&["bench", "--config", "tiny", "--steps", "0"]),
        &["--steps must be at least 1"],
    );
}

#[test]
fn mfu_peak_can_be_given_and_a_bad_one_is_refused() {
    // The interpreter has no peak of its own; a given one is used and named as given.
    let bench_reference = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--config",
            "tiny",
            "--backend",
            "reference",
            "--steps",
            "1",
        ];
        args.extend_from_slice(extra);
        let o = graphtrain(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let out = bench_reference(&["--peak-gflops", "10"]);
    assert!(
        out.contains("of 10.0 GFLOP/s (given with --peak-gflops)"),
        "{out}"
    );
    let out = bench_reference(&[]);
    assert!(
        out.contains("mfu: n/a (no known peak for reference; --peak-gflops sets one)"),
        "{out}"
    );
    for bad in ["0", "abc", "inf"] {
        let o = graphtrain(&["run", "--config", "tiny", &format!("--peak-gflops={bad}")]);
        assert_clean_error(
            &o,
            &[&format!("`{bad}` is not a positive number of GFLOP/s")],
        );
    }
}

#[test]
fn bench_against_times_two_pipelines_in_pairs() {
    let json = std::env::temp_dir().join(format!("graphtrain-paired-{}.json", std::process::id()));
    let o = graphtrain(&[
        "bench",
        "--config",
        "tiny",
        "--steps",
        "3",
        "--warmup",
        "1",
        "--against",
        "ac=full,default",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert_eq!(
        out.lines().filter(|l| l.starts_with("pair: ")).count(),
        3,
        "{out}"
    );
    assert!(
        out.contains("paired: baseline `default` median")
            && out.contains("candidate `ac=full,default` median")
            && out.contains("over 3 pairs"),
        "{out}"
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let times = |key: &str| summary[key].as_array().map(|a| a.len());
    assert_eq!(times("baseline_step_times_s"), Some(3));
    assert_eq!(times("candidate_step_times_s"), Some(3));
    let ratio = summary["ratio_median"].as_f64().unwrap();
    assert!(ratio.is_finite() && ratio > 0.0, "{ratio}");
    assert_clean_error(
        &graphtrain(&["bench", "--config", "tiny", "--against", "ac=sometimes"]),
        &["--against", "sometimes"],
    );
}

#[test]
fn trace_on_a_mesh_prints_one_ranks_step_and_refuses_what_cannot_work() {
    let o = graphtrain(&["trace", "--config", "tiny", "--mesh", "dp_shard=2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("mesh dp_shard=2: 2 ranks") && out.contains("batch 1 of the global 2"),
        "{out}"
    );
    assert!(
        out.contains("all_gather_start") && out.contains("reduce_scatter_start"),
        "{out}"
    );
    // What each rank's collectives send: gathers of the parameters' other halves, and the
    // reduce-scatters and all-reduces of gradients and the loss.
    let comm = out
        .lines()
        .find(|l| l.starts_with("communication per rank per step:"))
        .unwrap_or_else(|| panic!("no communication line:\n{out}"));
    for kind in [
        "all_gather_start x",
        "reduce_scatter_start x",
        "all_reduce_start x",
    ] {
        assert!(comm.contains(kind), "{comm}");
    }
    // Under bf16-mixed, FSDP's weight gathers move bf16: the gathers' volume drops by about
    // half (the norms' and the embedding's gathers stay f32).
    let gathered = |comm: &str| -> f64 {
        let after = comm.split("all_gather_start x").nth(1).expect("gathers");
        let words: Vec<&str> = after.split_whitespace().collect();
        let unit = match words[2].trim_end_matches([',', ')']) {
            "B" => 1.0,
            "KiB" => 1024.0,
            "MiB" => 1024.0 * 1024.0,
            "GiB" => 1024.0 * 1024.0 * 1024.0,
            u => panic!("unit {u} in {comm}"),
        };
        words[1].parse::<f64>().unwrap() * unit
    };
    // (`peer`, whose volumes print with enough digits.)
    let peer_comm = |precision: &str| {
        let o = graphtrain(&[
            "trace",
            "--config",
            "peer",
            "--mesh",
            "dp_shard=2",
            "--precision",
            precision,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let out = stdout(&o);
        let line = out
            .lines()
            .find(|l| l.starts_with("communication per rank per step:"))
            .unwrap()
            .to_string();
        (out, line)
    };
    let (mixed, mixed_comm) = peer_comm("bf16-mixed");
    assert!(mixed.contains("58 all-gathers move bf16"), "{mixed}");
    let (_, comm) = peer_comm("f32");
    let (f32_bytes, bf16_bytes) = (gathered(&comm), gathered(&mixed_comm));
    assert!(
        bf16_bytes < 0.6 * f32_bytes,
        "{f32_bytes} -> {bf16_bytes}: {comm}\n{mixed_comm}"
    );
    let plan = temp_file(
        "plan.ron",
        "(params: [(pattern: \"layers.*.attention.wz.weight\", placements: {})])",
    );
    let plan = plan.to_str().unwrap();
    // The built-in plan on tp: Megatron's split with sequence parallelism.
    let o = graphtrain(&["trace", "--config", "tiny", "--mesh", "dp_shard=2,tp=2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("mesh dp_shard=2,tp=2: 4 ranks"), "{out}");
    for op in ["reduce_scatter_start", "to_partial"] {
        assert!(out.contains(op), "{op} missing:\n{out}");
    }
    for (args, needles) in [
        (vec!["--mesh", "cp=2"], vec!["`cp` is not supported yet"]),
        // tiny's 4 query heads over 3 ranks, its 2 key/value heads over 4.
        (
            vec!["--mesh", "tp=3"],
            vec!["4 query heads do not split over tp=3"],
        ),
        (
            vec!["--mesh", "tp=4"],
            vec!["2 key/value heads do not split over tp=4", "not built"],
        ),
        (vec!["--mesh", "dp=2"], vec!["unknown mesh dimension `dp`"]),
        (
            vec!["--mesh", "dp_shard=3"],
            vec!["does not split evenly 3 ways"],
        ),
        (
            vec!["--mesh", "dp_shard=2", "--plan", plan],
            vec!["layers.*.attention.wz.weight", "matches no parameter"],
        ),
    ] {
        let o = graphtrain(&[&["trace", "--config", "tiny"][..], &args].concat());
        assert_clean_error(&o, &needles);
    }
}

/// The losses of a run's step lines.
fn step_losses(out: &str) -> Vec<f64> {
    out.lines()
        .filter(|l| l.starts_with("step:"))
        .map(|l| {
            let after = l.split("loss:").nth(1).expect("a loss");
            after.split_whitespace().next().unwrap().parse().unwrap()
        })
        .collect()
}

#[test]
fn run_on_a_mesh_of_threads_trains_as_one_device_and_refuses_what_cannot_work() {
    let base = ["run", "--config", "tiny", "--steps", "3", "--data", "fixed"];
    let one = graphtrain(&base);
    assert!(one.status.success(), "{}", stderr(&one));
    let two = graphtrain(&[&base[..], &["--mesh", "dp_shard=2"]].concat());
    assert!(two.status.success(), "{}", stderr(&two));
    let out = stdout(&two);
    assert!(
        out.contains("mesh dp_shard=2: 2 ranks as threads of this process"),
        "{out}"
    );
    let (a, b) = (step_losses(&stdout(&one)), step_losses(&out));
    assert_eq!(a.len(), 3, "{}", stdout(&one));
    assert_eq!(
        a, b,
        "the losses of two FSDP ranks differ from one device's (to 4 decimals)"
    );
    for l in out.lines().filter(|l| l.starts_with("step:")) {
        let waits = l.split("wait_ms: ").nth(1).expect("wait_ms on a mesh");
        assert_eq!(
            waits.trim().split(',').count(),
            2,
            "one wait per rank: `{l}`"
        );
    }
    // Rank 0 of a mesh alone: it trains, says what it is, and refuses what needs whole tensors.
    let fake = graphtrain(
        &[
            &base[..],
            &["--mesh", "dp_shard=2,tp=2", "--launcher", "fake"],
        ]
        .concat(),
    );
    assert!(fake.status.success(), "{}", stderr(&fake));
    let out = stdout(&fake);
    assert!(
        out.contains("rank 0 of 4 runs alone (--launcher fake)") && out.contains("no real run's"),
        "{out}"
    );
    assert_eq!(step_losses(&out).len(), 3, "{out}");
    let ckpt = temp_file("fake.safetensors", "");
    let o = graphtrain(
        &[
            &base[..],
            &["--mesh", "dp_shard=2", "--launcher", "fake", "--checkpoint"],
            &[ckpt.to_str().unwrap()],
        ]
        .concat(),
    );
    assert_clean_error(&o, &["--checkpoint needs whole tensors", "--launcher fake"]);
    // Tensor (and sequence) parallelism with FSDP: the same losses to 4 decimals.
    let four = graphtrain(&[&base[..], &["--mesh", "dp_shard=2,tp=2"]].concat());
    assert!(four.status.success(), "{}", stderr(&four));
    assert_eq!(a, step_losses(&stdout(&four)), "dp_shard=2,tp=2");
    for (args, needles) in [
        (vec!["--mesh", "cp=2"], vec!["`cp` is not supported yet"]),
        (
            vec!["--mesh", "tp=3"],
            vec!["4 query heads do not split over tp=3"],
        ),
        (
            vec!["--mesh", "dp_shard=2", "--link", "tp=1:5"],
            vec!["--link", "`tp` is not a dimension of the mesh"],
        ),
        (
            vec!["--mesh", "dp_shard=2", "--link", "dp_shard=0:5"],
            vec!["--link", "bandwidth must be a positive number"],
        ),
        (
            vec![
                "--mesh",
                "dp_shard=2",
                "--link",
                "dp_shard=1:5",
                "--launcher",
                "fake",
            ],
            vec!["--link emulates a network between threads"],
        ),
        (vec!["--mesh", "dp=2"], vec!["unknown mesh dimension `dp`"]),
        (
            vec!["--mesh", "dp_shard=3"],
            vec!["does not split evenly 3 ways"],
        ),
        (
            vec!["--mesh", "dp_shard=2", "--backend", "reference"],
            vec!["--mesh runs on cpu, wgpu and cuda"],
        ),
        (
            vec!["--mesh", "dp_shard=2", "--threads-per-rank", "0"],
            vec!["--threads-per-rank must be at least 1"],
        ),
        (vec!["--threads-per-rank", "1"], vec!["--mesh"]),
    ] {
        let o = graphtrain(&[&base[..], &args].concat());
        assert_clean_error(&o, &needles);
    }
}

/// `run --passes ac,async_tp`, the command the product is named by: without a mesh it trains
/// and says that `async_tp` had no tp dimension to act on; on `dp_shard=2,tp=2` with an emulated
/// link it pipelines (the gate reads `--link`'s tp entry) and trains to the same losses; a bad
/// option or a chunk count the shapes do not divide is refused naming the pass and the option.
#[test]
fn run_with_ac_and_async_tp_trains_with_and_without_tp() {
    let base = ["run", "--config", "tiny", "--steps", "3", "--data", "fixed"];
    let plain = graphtrain(&base);
    assert!(plain.status.success(), "{}", stderr(&plain));
    let o = graphtrain(&[&base[..], &["--passes", "ac,async_tp"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("pass async_tp"), "{out}");
    assert!(
        out.contains("declined: the graph has no mesh, so no tp dimension to act on"),
        "{out}"
    );
    assert_eq!(step_losses(&out), step_losses(&stdout(&plain)));
    let mesh = [&base[..], &["--mesh", "dp_shard=2,tp=2"]].concat();
    let without = graphtrain(&mesh);
    assert!(without.status.success(), "{}", stderr(&without));
    let o = graphtrain(&[&mesh[..], &["--passes", "ac,async_tp=chunks:2;gate:off"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("pipelined") && out.contains("over tp with their matmuls in 2 chunks"),
        "{out}"
    );
    assert_eq!(step_losses(&out), step_losses(&stdout(&without)));
    // tiny's matmuls are too small to hide anything behind: the gate declines every site, on
    // the link `--link` gives tp.
    let o = graphtrain(
        &[
            &mesh[..],
            &["--link", "tp=0.5:20", "--passes", "ac,async_tp"],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("declined: the cost gate predicts 2 chunks lose")
            && out.contains("on a 0.5 GB/s, 20 µs link"),
        "{out}"
    );
    for (option, needles) in [
        ("async_tp=chunks:0", vec!["async_tp", "`chunks:0`", ">= 2"]),
        ("async_tp=ring", vec!["async_tp", "unknown option `ring`"]),
        ("schedule", vec!["schedule", "needs a memory limit"]),
        ("schedule=memory:12MB", vec!["schedule", "KiB, MiB or GiB"]),
        ("bucket=bytes:10", vec!["`bucket` takes no option"]),
        (
            "async_tp=chunks:3;gate:off",
            vec![
                "(`async_tp`)",
                "option chunks:3",
                "which 3 chunks do not divide",
            ],
        ),
    ] {
        let o = graphtrain(&[&mesh[..], &["--passes", option]].concat());
        assert_clean_error(&o, &needles);
    }
}

#[test]
fn a_mesh_run_writes_one_timeline_per_rank() {
    let dir = scratch_dir("ranks");
    let base = dir.join("step.json");
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--mesh",
        "dp_shard=2",
        "--trace-out",
        base.to_str().unwrap(),
        "--trace-step",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        !base.exists(),
        "a mesh run writes per-rank files, not {}",
        base.display()
    );
    for rank in 0..2 {
        let path = dir.join(format!("step.rank{rank}.json"));
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}\n{}", path.display(), stdout(&o)));
        let trace: serde_json::Value = serde_json::from_str(&text).unwrap();
        let events = trace["traceEvents"].as_array().unwrap();
        // Lane 2 is the rank's communication thread: one event per collective, beside the
        // compute lanes' start and wait steps.
        let count = |name: &str, communication: bool| {
            events
                .iter()
                .filter(|e| e["ph"] == "X" && e["pid"] == rank)
                .filter(|e| (e["tid"] == 2) == communication)
                .filter(|e| e["args"]["kind"].as_str() == Some(name))
                .count()
        };
        let on_rank = |name: &str| count(name, false);
        assert!(on_rank("all_gather_start") > 0, "rank {rank}: no gather");
        let starts = on_rank("all_gather_start")
            + on_rank("reduce_scatter_start")
            + on_rank("all_reduce_start");
        assert_eq!(
            starts,
            on_rank("wait"),
            "rank {rank}: every start has its wait"
        );
        let transfers = count("all_gather_start", true)
            + count("reduce_scatter_start", true)
            + count("all_reduce_start", true);
        assert_eq!(
            transfers, starts,
            "rank {rank}: one transfer per collective"
        );
        let names = events
            .iter()
            .filter(|e| e["ph"] == "M" && e["pid"] == rank && e["tid"] == 2)
            .map(|e| e["args"]["name"].as_str().unwrap_or_default())
            .collect::<Vec<_>>();
        assert_eq!(names, ["communication"], "rank {rank}");
    }
}

#[test]
fn bench_and_metrics_on_a_mesh_report_each_ranks_waits() {
    let dir = scratch_dir("waits");
    let json = dir.join("bench.json");
    let o = graphtrain(&[
        "bench",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--mesh",
        "dp_replicate=2",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("ranks: 2 threads of 1 compute thread(s) each"),
        "{}",
        stdout(&o)
    );
    let summary: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let waits = summary["median_wait_s"].as_array().expect("median_wait_s");
    assert_eq!(waits.len(), 2, "{summary}");
    assert!(waits.iter().all(|w| w.as_f64().is_some_and(|s| s >= 0.0)));

    let metrics = dir.join("run.jsonl");
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--mesh",
        "dp_shard=2",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let steps: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &serde_json::Value| r["kind"] == "step")
        .collect();
    assert_eq!(steps.len(), 2);
    for s in &steps {
        assert_eq!(s["wait_s"].as_array().map(Vec::len), Some(2), "{s}");
    }
}

/// `search` on tiny: a few experiments write results.tsv and best.ron, which `run --pipeline`
/// takes; a second search on the same log resumes it, keeping the lines already there; a held
/// lock, an unknown proposer and a start outside the search space are refused.
#[test]
fn search_logs_resumes_and_refuses_bad_input() {
    let dir = scratch_dir("search");
    let log = dir.join("s");
    let _ = std::fs::remove_dir_all(&log);
    let log_arg = log.to_str().unwrap();
    let base = [
        "search",
        "--config",
        "tiny",
        "--passes",
        "none",
        "--log",
        log_arg,
        "--aa-every",
        "0",
    ];
    let o = graphtrain(&[&base[..], &["--experiments", "3"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    let first = std::fs::read_to_string(log.join("results.tsv")).unwrap();
    assert_eq!(first.lines().count(), 4, "{first}");
    assert!(first.starts_with("experiment\tproposer\tstatus"), "{first}");
    assert!(stdout(&o).contains("best pipeline: "), "{}", stdout(&o));
    let best = log.join("best.ron");
    let run = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "1",
        "--pipeline",
        best.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", stderr(&run));
    let o = graphtrain(&[&base[..], &["--experiments", "5"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("resuming the search") && stdout(&o).contains("after 3 experiments"),
        "{}",
        stdout(&o)
    );
    let second = std::fs::read_to_string(log.join("results.tsv")).unwrap();
    assert_eq!(second.lines().count(), 6, "{second}");
    assert!(second.starts_with(&first), "the logged lines changed");
    // A lock whose process lives (this test's) is respected.
    let me = std::process::id().to_string();
    std::fs::write(log.join("lock"), format!("{me}\n")).unwrap();
    let o = graphtrain(&[&base[..], &["--experiments", "6"]].concat());
    assert_clean_error(&o, &["another search holds", &format!("pid {me}")]);
    std::fs::remove_file(log.join("lock")).unwrap();
    let o = graphtrain(&[&base[..], &["--proposer", "genetic"]].concat());
    assert_clean_error(&o, &["unknown proposer `genetic`"]);
    let o = graphtrain(&[
        "search",
        "--config",
        "tiny",
        "--passes",
        "capture,cse",
        "--log",
        log_arg,
    ]);
    assert_clean_error(
        &o,
        &["--passes as a start of the search", "after the ones before"],
    );
}

/// A candidate that kills the worker compiling and timing it (an abort), or leaves it without
/// an answer (a hang, past `--worker-timeout`), is logged `crash` with what happened; a fresh
/// worker takes the next experiment, and the search ends normally.
#[test]
fn a_candidate_that_crashes_or_hangs_its_worker_is_logged_and_the_search_goes_on() {
    let dir = scratch_dir("search-crash");
    let log = dir.join("s");
    let _ = std::fs::remove_dir_all(&log);
    let counter = dir.join("asked");
    let _ = std::fs::remove_file(&counter);
    // Proposes `cse`, then `canonicalize`, then `dce`.
    let proposer = format!(
        "n=$(cat {c} 2>/dev/null || echo 0); echo $((n+1)) > {c}; \
         case $n in 0) echo cse;; 1) echo canonicalize;; *) echo dce;; esac",
        c = counter.display()
    );
    let o = Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args([
            "search",
            "--config",
            "tiny",
            "--passes",
            "none",
            "--log",
            log.to_str().unwrap(),
            "--experiments",
            "3",
            "--aa-every",
            "0",
            "--proposer",
            &proposer,
            "--worker-timeout",
            "20",
        ])
        .env(
            "GRAPHTRAIN_SEARCH_WORKER_FAULT",
            "abort:cse,hang:canonicalize",
        )
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let results = std::fs::read_to_string(log.join("results.tsv")).unwrap();
    let lines: Vec<Vec<&str>> = results
        .lines()
        .skip(1)
        .map(|l| l.split('\t').collect())
        .collect();
    assert_eq!(lines.len(), 3, "{results}");
    let (status, pipeline, why) = (2, 9, 10);
    assert_eq!(
        (lines[0][status], lines[0][pipeline]),
        ("crash", "cse"),
        "{results}"
    );
    assert!(
        lines[0][why].contains("the worker died (signal 6)"),
        "{results}"
    );
    assert_eq!(
        (lines[1][status], lines[1][pipeline]),
        ("crash", "canonicalize"),
        "{results}"
    );
    assert!(lines[1][why].contains("no answer in 20 s"), "{results}");
    assert_eq!(lines[2][pipeline], "dce", "{results}");
    assert!(
        ["keep", "discard", "duplicate"].contains(&lines[2][status]),
        "a fresh worker measured the third: {results}"
    );
    assert!(stdout(&o).contains("best pipeline: "), "{}", stdout(&o));
}

/// The pids of processes whose command line contains `needle`.
fn pids_running(needle: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
            String::from_utf8_lossy(&cmd)
                .contains(needle)
                .then_some(pid)
        })
        .collect()
}

/// A search killed with SIGKILL takes its worker with it, even one hung in a candidate.
#[test]
fn a_killed_search_leaves_no_worker_behind() {
    let dir = scratch_dir("search-orphan");
    let log = dir.join("s");
    let _ = std::fs::remove_dir_all(&log);
    let log_arg = log.to_str().unwrap().to_string();
    let mut search = Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args([
            "search", "--config", "tiny", "--passes", "none", "--log", &log_arg,
        ])
        .args([
            "--experiments",
            "2",
            "--aa-every",
            "0",
            "--proposer",
            "echo cse",
        ])
        .env("GRAPHTRAIN_SEARCH_WORKER_FAULT", "hang:cse")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let search_pid = search.id();
    let worker = |_: ()| {
        pids_running(&log_arg)
            .into_iter()
            .filter(|&p| p != search_pid)
            .collect::<Vec<_>>()
    };
    let started = std::time::Instant::now();
    while worker(()).is_empty() {
        assert!(started.elapsed().as_secs() < 60, "no worker started");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    search.kill().unwrap();
    search.wait().unwrap();
    let killed = std::time::Instant::now();
    while !worker(()).is_empty() {
        assert!(
            killed.elapsed().as_secs() < 10,
            "the worker outlived its search: {:?}",
            worker(())
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// On a mesh the search times the SPMD step on threads, with the collective passes in its
/// space; the found pipeline trains on that mesh. Another launcher is refused.
#[test]
fn search_on_a_mesh_searches_the_collective_passes_too() {
    let dir = scratch_dir("search-mesh");
    let log = dir.join("s");
    let _ = std::fs::remove_dir_all(&log);
    let base = [
        "search",
        "--config",
        "tiny",
        "--mesh",
        "dp_shard=2",
        "--passes",
        "bucket",
        "--log",
        log.to_str().unwrap(),
        "--aa-every",
        "0",
        "--experiments",
        "2",
    ];
    let o = graphtrain(&base);
    assert!(o.status.success(), "{}", stderr(&o));
    let results = std::fs::read_to_string(log.join("results.tsv")).unwrap();
    assert_eq!(results.lines().count(), 3, "{results}");
    // The start's pipeline has `bucket`, a mesh knob: neighbours keep or drop it.
    assert!(
        results.lines().skip(1).all(|l| !l.contains("\tinvalid\t")),
        "{results}"
    );
    let run = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--mesh",
        "dp_shard=2",
        "--steps",
        "1",
        "--pipeline",
        log.join("best.ron").to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", stderr(&run));
    let o = graphtrain(&[&base[..], &["--launcher", "fake"]].concat());
    assert_clean_error(&o, &["search on a mesh runs its ranks as threads"]);
    // The settings a search varies, set by hand: checked, and refused where they cannot apply.
    let run = ["run", "--config", "tiny", "--steps", "1"];
    let o = graphtrain(
        &[
            &run[..],
            &[
                "--mesh",
                "dp_shard=2",
                "--tuning",
                "threads_per_rank=1,gemm=avx2",
            ],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    for (tuning, needles) in [
        (
            "threads_per_rank=1",
            vec!["--tuning threads_per_rank", "needs --mesh"],
        ),
        (
            "gemm=avx9",
            vec!["--tuning", "widest, avx512, avx2 or scalar"],
        ),
        (
            "gemm=avx2 --backend reference",
            vec!["--tuning gemm", "the cpu backend's"],
        ),
        (
            "fusion.max_map_inputs=1",
            vec!["invalid fusion limits", "max_map_inputs = 1"],
        ),
        (
            "device_matmul=tiled",
            vec!["--tuning device_matmul", "the device backends'"],
        ),
        (
            "device_matmul=blocked",
            vec!["--tuning", "auto, tiled or per_output"],
        ),
        (
            "device_collectives=nccl",
            vec!["--tuning device_collectives", "through host memory"],
        ),
        (
            "device_collectives=gloo",
            vec!["--tuning", "auto, nccl or host"],
        ),
        (
            "device_graphs=off",
            vec!["--tuning device_graphs", "the device backends'"],
        ),
        ("device_graphs=maybe", vec!["--tuning", "on or off"]),
    ] {
        let mut args = run.to_vec();
        args.push("--tuning");
        args.extend(tuning.split(' '));
        let o = graphtrain(&args);
        assert_clean_error(&o, &needles);
    }
}

/// `--precision bf16-mixed` trains on cpu, its MFU against the bf16 peak where the cpu has one,
/// and on wgpu; an unknown precision is refused with the reason.
#[test]
fn bf16_mixed_trains_on_cpu_and_wgpu_and_refuses_an_unknown_precision() {
    let run = ["run", "--config", "tiny", "--steps", "2", "--data", "fixed"];
    let o = graphtrain(&[&run[..], &["--precision", "bf16-mixed"]].concat());
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(step_losses(&stdout(&o)).len(), 2, "{}", stdout(&o));
    let o = graphtrain(&[&run[..], &["--precision", "fp8"]].concat());
    assert_clean_error(&o, &["--precision", "unknown precision `fp8`"]);
    if !graphtrain::gate::device_backends_for_tests().is_empty() {
        let o = graphtrain(
            &[
                &run[..],
                &["--precision", "bf16-mixed", "--backend", "wgpu"],
            ]
            .concat(),
        );
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(step_losses(&stdout(&o)).len(), 2, "{}", stdout(&o));
    }
}

/// `graphtrain search` on the seeded synthetic objective, logging into `log`.
fn synthetic_search(log: &std::path::Path, objective: &str, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_graphtrain"));
    c.args([
        "search",
        "--config",
        "tiny",
        "--passes",
        "none",
        "--objective",
        objective,
        "--log",
        log.to_str().unwrap(),
    ])
    .args(extra);
    c
}

/// A search killed with SIGKILL in the middle of an experiment resumes from its log (taking
/// over the lock the killed process left) and logs exactly what an uninterrupted one does.
#[test]
fn a_killed_search_resumes_to_the_uninterrupted_log() {
    let dir = scratch_dir("search-kill");
    let (straight, killed) = (dir.join("straight"), dir.join("killed"));
    for d in [&straight, &killed] {
        let _ = std::fs::remove_dir_all(d);
    }
    let args = ["--experiments", "14", "--proposer", "evolution"];
    let o = synthetic_search(&straight, "synthetic:7", &args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let results =
        |d: &std::path::Path| std::fs::read_to_string(d.join("results.tsv")).unwrap_or_default();
    // Each timed pair takes 20 ms: an experiment lasts 0.3 to 3 s, so the kill lands inside one.
    let mut child = synthetic_search(&killed, "synthetic:7:20", &args)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while results(&killed).lines().count() < 5 {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the search ended ({status}) before it could be killed: make it longer");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the search logged nothing"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    std::thread::sleep(std::time::Duration::from_millis(150));
    child.kill().unwrap();
    assert!(!child.wait().unwrap().success());
    let logged = results(&killed).lines().count();
    assert!(
        logged < 15,
        "the search finished before the kill: {logged} lines"
    );
    assert!(
        killed.join("lock").exists(),
        "a killed search leaves its lock"
    );
    let o = synthetic_search(&killed, "synthetic:7", &args)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("resuming the search"), "{}", stdout(&o));
    assert_eq!(results(&straight), results(&killed));
    assert!(killed.join("progress.png").exists());
}

/// An external proposer: the example script drives a search; one that prints garbage, fails or
/// hangs has each experiment logged `invalid` with the reason, and the search goes on.
#[test]
fn external_proposers_are_run_and_their_failures_logged() {
    let dir = scratch_dir("search-proposer");
    let script = format!(
        "python3 {}/autoresearch/examples/propose.py",
        env!("CARGO_MANIFEST_DIR")
    );
    let cases: [(&str, &str, Option<&str>); 4] = [
        ("script", script.as_str(), None),
        (
            "garbage",
            "echo '%% nonsense'",
            Some("the proposer printed `%% nonsense`"),
        ),
        ("fails", "echo boom >&2; exit 4", Some("exited with")),
        ("hangs", "sleep 20", Some("did not answer within 1 s")),
    ];
    for (name, command, invalid) in cases {
        let log = dir.join(name);
        let _ = std::fs::remove_dir_all(&log);
        let o = synthetic_search(
            &log,
            "synthetic:3",
            &[
                "--experiments",
                "4",
                "--aa-every",
                "0",
                "--proposer",
                command,
                "--proposer-timeout",
                "1",
            ],
        )
        .output()
        .unwrap();
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let results = std::fs::read_to_string(log.join("results.tsv")).unwrap();
        let lines: Vec<&str> = results.lines().skip(1).collect();
        assert_eq!(lines.len(), 4, "{name}: {results}");
        match invalid {
            None => {
                // The script's first answers are the incumbent's untried neighbours, in knob order.
                assert!(lines[0].contains("\texternal\t"), "{results}");
                assert!(
                    lines.iter().all(|l| !l.contains("\tinvalid\t")),
                    "{results}"
                );
                assert!(
                    lines[0].ends_with("\tcanonicalize\t") || lines[0].contains("\tcanonicalize\t"),
                    "{results}"
                );
            }
            Some(reason) => assert!(
                lines
                    .iter()
                    .all(|l| l.contains("\tinvalid\t") && l.contains(reason)),
                "{name}: {results}"
            ),
        }
    }
}

/// `--memory-cap`: below every pipeline's peak, the search says so with the smallest peak it
/// found and writes no best pipeline; a malformed cap is refused.
#[test]
fn a_memory_cap_no_pipeline_meets_is_reported_with_the_smallest_peak() {
    let dir = scratch_dir("search-cap");
    let log = dir.join("s");
    let _ = std::fs::remove_dir_all(&log);
    let o = synthetic_search(
        &log,
        "synthetic:2",
        &["--experiments", "8", "--memory-cap", "1KiB"],
    )
    .output()
    .unwrap();
    assert_clean_error(
        &o,
        &[
            "no pipeline tried fits under --memory-cap",
            "the smallest predicted peak was",
        ],
    );
    assert!(!log.join("best.ron").exists());
    let results = std::fs::read_to_string(log.join("results.tsv")).unwrap();
    assert!(results.contains("\tover-cap\t"), "{results}");
    let o = synthetic_search(&dir.join("t"), "synthetic:2", &["--memory-cap", "12MB"])
        .output()
        .unwrap();
    assert_clean_error(&o, &["--memory-cap `12MB`", "KiB, MiB or GiB"]);
    let o = synthetic_search(&dir.join("v"), "synthetic:2", &["--min-effect", "1.5"])
        .output()
        .unwrap();
    assert_clean_error(&o, &["--min-effect 1.5"]);
    let o = synthetic_search(&dir.join("u"), "synthetic:x", &[])
        .output()
        .unwrap();
    assert_clean_error(&o, &["--objective `synthetic:x`"]);
}

/// `sim` on `this-cpu` (the default) measures this host first, the bf16 GEMM included, and
/// predicts a bf16-mixed step from it.
#[test]
fn sim_measures_this_cpu_in_f32_and_bf16() {
    let o = graphtrain(&["sim", "--config", "tiny", "--precision", "bf16-mixed"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let all = format!("{}{}", stdout(&o), stderr(&o));
    let rate = |label: &str| -> f64 {
        let at = all
            .find(label)
            .unwrap_or_else(|| panic!("no `{label}` in:\n{all}"));
        all[at + label.len()..]
            .split_whitespace()
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no rate after `{label}` in:\n{all}"))
    };
    assert!(rate("GEMM 1024^3") > 0.0, "{all}");
    assert!(rate("in bf16") > 0.0, "{all}");
    assert!(all.contains("sim: tiny on this-cpu"), "{all}");
}

/// `sim` predicts a step on a built-in GPU without one, refuses a mesh its nodes cannot hold
/// and unknown hardware, and names a bad field of a hardware file.
#[test]
fn sim_predicts_on_builtin_hardware_and_refuses_what_does_not_fit() {
    let o = graphtrain(&["sim", "--config", "tiny", "--hardware", "h100-sxm"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("sim: tiny on h100-sxm (1 rank(s))"), "{out}");
    assert!(out.contains("mfu") && out.contains("arena"), "{out}");
    let o = graphtrain(&[
        "sim",
        "--config",
        "tiny",
        "--mesh",
        "dp_shard=16",
        "--batch",
        "16",
        "--hardware",
        "h200",
    ]);
    assert_clean_error(&o, &["16 ranks", "--nodes 2"]);
    let o = graphtrain(&["sim", "--config", "tiny", "--hardware", "tpu-v9"]);
    assert_clean_error(&o, &["unknown hardware `tpu-v9`", "h100-sxm"]);
    // A hardware file with a bad value, or a field the description does not have: refused,
    // naming the file and the field (an unknown field is an error, not ignored).
    for (file, from, to) in [
        ("bad-hw.ron", "memory_gbps: 4800.0", "memory_gbps: -1.0"),
        (
            "extra-hw.ron",
            "memory_gib: 141.0,",
            "memory_gib: 141.0, nvlink_gen: 4,",
        ),
    ] {
        let path = temp_file(
            file,
            &include_str!("../src/sim/hardware/h200.ron").replace(from, to),
        );
        let o = graphtrain(&[
            "sim",
            "--config",
            "tiny",
            "--hardware",
            path.to_str().unwrap(),
        ]);
        let field = to.rsplit(", ").next().unwrap().split(':').next().unwrap();
        assert_clean_error(&o, &[file, field]);
    }
}

/// `search --objective sim:HARDWARE`: the loop searches passes for a machine it does not have,
/// each candidate's pairs simulated, its numerics gated on `tiny` on the search's mesh; a
/// `--link` (measured runs' emulation) is refused with it.
#[test]
fn search_with_the_simulator_as_objective() {
    let log = scratch_dir("sim-search");
    let o = graphtrain(&[
        "search",
        "--config",
        "tiny",
        "--mesh",
        "dp_shard=2",
        "--passes",
        "none",
        "--objective",
        "sim:h100-sxm",
        "--experiments",
        "6",
        "--log",
        log.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("objective: steps simulated on h100-sxm (1 node(s)); numerics checked on tiny on dp_shard=2"),
        "{out}"
    );
    let results = std::fs::read_to_string(log.join("results.tsv")).unwrap();
    assert!(results.lines().count() >= 6, "{results}");
    assert!(log.join("best.ron").exists());
    let o = graphtrain(&[
        "search",
        "--config",
        "tiny",
        "--mesh",
        "dp_shard=2",
        "--link",
        "dp_shard=1:20",
        "--objective",
        "sim:h200",
        "--experiments",
        "1",
        "--log",
        log.join("x").to_str().unwrap(),
    ]);
    assert_clean_error(&o, &["--objective sim uses the hardware's links"]);
}

/// `autoshard`: writes a plan `run --plan` trains with, says how it compares with the Llama
/// plan, explains its cost model, and refuses bad requests cleanly.
#[test]
fn autoshard_writes_a_plan_that_runs() {
    let plan = temp_file("autoshard-plan.ron", "");
    let mesh = ["--mesh", "dp_shard=2,tp=2"];
    let o = graphtrain(
        &[
            &["autoshard", "--config", "tiny", "--hardware", "h100-sxm"][..],
            &mesh,
            &["--out", plan.to_str().unwrap()],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("chosen plan: priced") && err.contains("Llama plan:  priced"),
        "{err}"
    );
    let text = std::fs::read_to_string(&plan).unwrap();
    assert!(text.contains("sequence_parallel"), "{text}");
    let o = graphtrain(
        &[
            &[
                "run",
                "--config",
                "tiny",
                "--steps",
                "2",
                "--plan",
                plan.to_str().unwrap(),
            ][..],
            &mesh,
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("step:  2 loss:"), "{}", stdout(&o));

    // A misspelled field in a plan is an error naming it, not a plan silently without it.
    let typo = temp_file(
        "typo-plan.ron",
        &text.replace("sequence_parallel", "sequence_paralel"),
    );
    let o = graphtrain(
        &[
            &[
                "run",
                "--config",
                "tiny",
                "--steps",
                "1",
                "--plan",
                typo.to_str().unwrap(),
            ][..],
            &mesh,
        ]
        .concat(),
    );
    assert_clean_error(&o, &["typo-plan.ron", "sequence_paralel"]);

    let o = graphtrain(&["passes", "explain", "autoshard"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("Cost model"), "{}", stdout(&o));

    let o = graphtrain(
        &[
            &[
                "autoshard",
                "--config",
                "tiny",
                "--hardware",
                "h100-sxm",
                "--fix",
                "*.wq.weight=tp",
            ][..],
            &mesh,
        ]
        .concat(),
    );
    assert_clean_error(&o, &["--fix", "is not DIM:PLACEMENT"]);
    let o = graphtrain(&[
        "autoshard",
        "--config",
        "tiny",
        "--hardware",
        "h100-sxm",
        "--mesh",
        "dp_shard=16",
        "--batch",
        "16",
    ]);
    assert_clean_error(&o, &["16 ranks", "--nodes 2"]);
    let o = graphtrain(
        &[
            &[
                "autoshard",
                "--config",
                "tiny",
                "--hardware",
                "h100-sxm",
                "--memory-limit",
                "1KiB",
            ][..],
            &mesh,
        ]
        .concat(),
    );
    assert_clean_error(
        &o,
        &[
            "no plan fits the memory limit 1.00 KiB",
            "smallest peak found",
        ],
    );
}

/// `autoshard --world N`: every mesh of N ranks solved, simulated with each pipeline, ranked,
/// and one named to run; a world the nodes cannot hold is refused.
#[test]
fn autoshard_ranks_the_meshes_of_a_world() {
    let plan = temp_file("survey-plan.ron", "");
    let o = graphtrain(&[
        "autoshard",
        "--config",
        "tiny",
        "--world",
        "2",
        "--hardware",
        "h100-sxm",
        "--survey-passes",
        "default;default,prefetch",
        "--out",
        plan.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for mesh in ["dp_shard=2 ", "tp=2 "] {
        assert!(out.contains(mesh), "{out}");
    }
    assert!(out.contains("would run: --mesh "), "{out}");
    assert!(std::fs::read_to_string(&plan)
        .unwrap()
        .contains("sequence_parallel"));
    let o = graphtrain(&[
        "autoshard",
        "--config",
        "tiny",
        "--world",
        "16",
        "--hardware",
        "h100-sxm",
    ]);
    assert_clean_error(&o, &["--world 16", "--nodes 2"]);
    let o = graphtrain(&["autoshard", "--config", "tiny", "--hardware", "h100-sxm"]);
    assert_clean_error(&o, &["--mesh"]);
}
