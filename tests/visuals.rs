//! What a run shows, end to end through the binary: the metrics log (`run --metrics`), the
//! charts (`plot`), the Chrome trace of a step (`run --trace-out`), Graphviz (`trace --dot`,
//! `passes apply --dot`) and the tracing spans (`RUST_LOG`).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn graphtrain(args: &[&str]) -> Output {
    graphtrain_env(args, &[])
}

fn graphtrain_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_graphtrain"));
    c.args(args).env_remove("RUST_LOG");
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().expect("the binary runs")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn ok(o: &Output) -> String {
    assert!(o.status.success(), "failed:\n{}", text(&o.stderr));
    text(&o.stdout)
}

fn clean_error(o: &Output, needles: &[&str]) {
    let err = text(&o.stderr);
    assert!(
        !o.status.success(),
        "expected failure:\n{}",
        text(&o.stdout)
    );
    assert!(!err.contains("panicked"), "panic:\n{err}");
    for n in needles {
        assert!(err.contains(n), "stderr lacks `{n}`:\n{err}");
    }
}

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("graphtrain-vis-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn json_lines(p: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).expect("each line is JSON"))
        .collect()
}

/// The `loss:` figures of the metric lines.
fn printed_losses(stdout: &str) -> Vec<String> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step:"))
        .map(|l| l.split_whitespace().nth(3).unwrap().to_string())
        .collect()
}

#[test]
fn a_run_logs_every_step_and_a_resumed_run_appends() {
    let d = dir("metrics");
    let (log, ckpt) = (d.join("m.jsonl"), d.join("c.ckpt"));
    let base = ["run", "--config", "tiny", "--data", "fixed"];
    let first = ok(&graphtrain(
        &[
            &base[..],
            &[
                "--steps",
                "2",
                "--metrics",
                s(&log),
                "--checkpoint",
                s(&ckpt),
            ],
        ]
        .concat(),
    ));
    let lines = json_lines(&log);
    assert_eq!(lines.len(), 3, "a header and two steps");
    assert_eq!(lines[0]["kind"], "header");
    assert_eq!(lines[0]["schema"], "graphtrain.metrics/1");
    assert_eq!(lines[0]["config"]["config"], "tiny");
    assert!(lines[0]["config"]["model_config"]["dim"].as_u64().is_some());
    let logged: Vec<String> = lines[1..]
        .iter()
        .map(|l| format!("{:.4}", l["loss"].as_f64().unwrap()))
        .collect();
    assert_eq!(
        logged,
        printed_losses(&first),
        "the log holds what was printed"
    );
    for (i, l) in lines[1..].iter().enumerate() {
        assert_eq!(l["kind"], "step");
        assert_eq!(l["step"], i as u64 + 1);
        for key in [
            "grad_norm",
            "seconds",
            "tokens_per_s",
            "tflops",
            "lr",
            "wall_s",
        ] {
            assert!(l[key].as_f64().unwrap() > 0.0, "{key} in {l}");
        }
        assert!(l["memory_bytes"].as_u64().unwrap() > 0);
        assert!(l["mfu"].is_null() || l["mfu"].as_f64().unwrap() > 0.0);
    }

    let resumed = ok(&graphtrain(
        &[
            &base[..],
            &["--steps", "3", "--metrics", s(&log), "--resume", s(&ckpt)],
        ]
        .concat(),
    ));
    let lines = json_lines(&log);
    assert_eq!(lines.len(), 5, "appended: a resume header and step 3");
    assert_eq!(lines[3]["kind"], "header");
    assert_eq!(lines[3]["resumed_after"], 2);
    assert_eq!(lines[4]["step"], 3);
    assert_eq!(
        vec![format!("{:.4}", lines[4]["loss"].as_f64().unwrap())],
        printed_losses(&resumed)
    );

    // A fresh run starts the file again.
    ok(&graphtrain(
        &[&base[..], &["--steps", "1", "--metrics", s(&log)]].concat(),
    ));
    assert_eq!(json_lines(&log).len(), 2);
}

#[test]
fn plots_are_written_as_svg_and_png_and_bad_logs_are_refused_by_line() {
    let d = dir("plot");
    let log = d.join("m.jsonl");
    // Three steps of `tiny` logged to `log`, with `flags`.
    let run = |log: &Path, flags: &[&str]| {
        let base = [
            "run",
            "--config",
            "tiny",
            "--steps",
            "3",
            "--metrics",
            s(log),
        ];
        ok(&graphtrain(&[&base[..], flags].concat()))
    };
    run(&log, &[]);
    let svg = d.join("loss.svg");
    let out = ok(&graphtrain(&["plot", s(&log), "--out", s(&svg)]));
    assert!(out.contains("3 steps"), "{out}");
    let body = std::fs::read_to_string(&svg).unwrap();
    assert!(body.starts_with("<svg"), "{}", &body[..100.min(body.len())]);
    for caption in ["loss", "tokens/s", "memory"] {
        assert!(body.contains(caption), "no `{caption}` panel");
    }
    assert!(
        !body.contains("learning rate"),
        "a constant lr has no panel"
    );
    // A scheduled lr has one.
    let scheduled = d.join("scheduled.jsonl");
    run(&scheduled, &["--lr-warmup", "2"]);
    ok(&graphtrain(&["plot", s(&scheduled), "--out", s(&svg)]));
    let body = std::fs::read_to_string(&svg).unwrap();
    assert!(body.contains("learning rate"), "no learning-rate panel");
    let png = d.join("loss.png");
    ok(&graphtrain(&["plot", s(&log), "--out", s(&png)]));
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        bytes.len() > 10_000,
        "{} bytes: nothing drawn?",
        bytes.len()
    );

    let bad = d.join("bad.jsonl");
    for (body, needles) in [
        ("", vec!["bad.jsonl", "empty"]),
        ("step 1 loss 2\n", vec!["bad.jsonl:1:", "not a `graphtrain.metrics/1` record"]),
        (
            "{\"kind\":\"header\",\"schema\":\"graphtrain.metrics/0\",\"resumed_after\":null,\"config\":{}}\n",
            vec!["bad.jsonl:1:", "schema `graphtrain.metrics/0`"],
        ),
    ] {
        std::fs::write(&bad, body).unwrap();
        clean_error(
            &graphtrain(&["plot", s(&bad), "--out", s(&d.join("x.svg"))]),
            &needles,
        );
    }
    // Valid log, but the header only.
    let header_only = std::fs::read_to_string(&log).unwrap();
    std::fs::write(&bad, header_only.lines().next().unwrap()).unwrap();
    clean_error(
        &graphtrain(&["plot", s(&bad), "--out", s(&d.join("x.svg"))]),
        &["no `step` record"],
    );
    clean_error(
        &graphtrain(&["plot", s(&log), "--out", s(&d.join("x.pdf"))]),
        &[".svg or .png"],
    );
}

/// The module paths of the cpu Program's graph for `tiny`, as the executor names its steps.
fn program_modules() -> std::collections::HashSet<String> {
    use graphtrain::ir::optim::OptimConfig;
    let cfg = graphtrain::models::Llama3Config::builtin("tiny").unwrap();
    let traced =
        graphtrain::trainer::build_step(&cfg, graphtrain::ir::DType::F32, &OptimConfig::default())
            .unwrap();
    traced
        .step
        .graph
        .nodes
        .iter()
        .map(|n| n.meta.module.clone())
        .collect()
}

#[test]
fn a_traced_step_is_a_chrome_trace_named_from_the_graph() {
    let d = dir("trace");
    let trace = d.join("step.json");
    let out = ok(&graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "3",
        "--trace-out",
        s(&trace),
        "--trace-step",
        "2",
    ]));
    assert!(out.contains("wrote the timeline of step 2"), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("step:")).count(), 3);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(doc["otherData"]["training_step"], 2);
    let events = doc["traceEvents"].as_array().unwrap();
    let complete: Vec<&serde_json::Value> = events.iter().filter(|e| e["ph"] == "X").collect();
    assert!(complete.len() > 20, "{} events", complete.len());
    let modules = program_modules();
    let mut named = 0;
    let mut end_of_last = 0.0f64;
    for e in &complete {
        assert_eq!(e["pid"], 0);
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        assert!(dur >= 0.0 && ts >= 0.0);
        // Steps run one after another: none starts before the one before it ended.
        assert!(ts + 1.0 >= end_of_last, "{e}");
        end_of_last = ts + dur;
        let module = e["args"]["module"].as_str().unwrap();
        assert!(
            modules.contains(module),
            "`{module}` is no module of the graph"
        );
        if !module.is_empty() {
            named += 1;
            assert!(e["name"].as_str().unwrap().starts_with(module), "{e}");
        }
        assert!(["fwd", "loss", "bwd", "opt", "none"].contains(&e["cat"].as_str().unwrap()));
    }
    assert!(
        named * 2 > complete.len(),
        "most steps have a module: {named}"
    );
    assert!(
        complete.iter().any(|e| e["tid"] == 1),
        "host code has its lane"
    );
    assert!(events
        .iter()
        .any(|e| e["ph"] == "M" && e["name"] == "thread_name"));

    let lanes = d.join("lanes.svg");
    let out = ok(&graphtrain(&[
        "plot",
        "--trace",
        s(&trace),
        "--out",
        s(&lanes),
    ]));
    assert!(out.contains(&format!("{} events", complete.len())), "{out}");
    let svg = std::fs::read_to_string(&lanes).unwrap();
    for label in ["lane 0", "kernels", "lane 1", "host code"] {
        assert!(svg.contains(label), "no `{label}` beside the rows");
    }
    let png = d.join("lanes.png");
    ok(&graphtrain(&[
        "plot",
        "--trace",
        s(&trace),
        "--out",
        s(&png),
    ]));
    assert_eq!(&std::fs::read(&png).unwrap()[..4], b"\x89PNG");

    clean_error(
        &graphtrain(&[
            "run",
            "--config",
            "tiny",
            "--steps",
            "2",
            "--trace-out",
            s(&trace),
            "--trace-step",
            "3",
        ]),
        &["--trace-step 3", "1..=2"],
    );
    clean_error(
        &graphtrain(&[
            "run",
            "--config",
            "tiny",
            "--steps",
            "1",
            "--backend",
            "reference",
            "--trace-out",
            s(&trace),
        ]),
        &["--trace-out", "records no timeline"],
    );
    std::fs::write(d.join("bad.json"), "{\"traceEvents\": 3}").unwrap();
    clean_error(
        &graphtrain(&[
            "plot",
            "--trace",
            s(&d.join("bad.json")),
            "--out",
            s(&lanes),
        ]),
        &["bad.json", "traceEvents"],
    );
}

#[test]
fn bench_writes_the_timeline_of_one_more_step() {
    let d = dir("bench-trace");
    let trace = d.join("bench.json");
    let out = ok(&graphtrain(&[
        "bench",
        "--config",
        "tiny",
        "--warmup",
        "1",
        "--steps",
        "2",
        "--trace-out",
        s(&trace),
    ]));
    assert!(out.contains("wrote the timeline of step 4"), "{out}");
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(doc["otherData"]["training_step"], 4);
}

#[test]
fn graphviz_of_a_trace_and_of_a_pass() {
    let d = dir("dot");
    let (dot, graph) = (d.join("step.dot"), d.join("step.txt"));
    ok(&graphtrain(&[
        "trace",
        "--config",
        "tiny",
        "--passes",
        "none",
        "--out",
        s(&graph),
        "--dot",
        s(&dot),
    ]));
    let body = std::fs::read_to_string(&dot).unwrap();
    assert!(body.starts_with("digraph "));
    assert_eq!(body.matches('{').count(), body.matches('}').count());
    assert!(body.contains("label=\"layers.0\""), "a cluster per layer");
    assert!(body.contains("label=\"layers.0.attention\""));
    for color in ["#cfe2ff", "#fff3bf", "#ffd8a8", "#d3f9d8"] {
        assert!(body.contains(color), "phase colour {color} unused");
    }

    let applied = d.join("cse.dot");
    let o = graphtrain(&[
        "passes",
        "apply",
        "--pass",
        "canonicalize",
        "--pass",
        "cse",
        s(&graph),
        "--out",
        s(&d.join("after.txt")),
        "--dot",
        s(&applied),
    ]);
    ok(&o);
    let body = std::fs::read_to_string(&applied).unwrap();
    assert!(body.contains("nodes new (red border)"), "{}", &body[..300]);
    assert!(
        body.contains("removed by the pass"),
        "cse removes duplicates in tiny's step"
    );
}

#[test]
fn rust_log_shows_compile_stages_and_steps() {
    let o = graphtrain_env(
        &["run", "--config", "tiny", "--steps", "1"],
        &[(
            "RUST_LOG",
            "graphtrain=info,graphtrain_runtime=info,graphtrain_passes=info",
        )],
    );
    ok(&o);
    let err = text(&o.stderr);
    for span in [
        "trace", "autodiff", "verify", "passes", "pass", "legalize", "lower", "load", "step",
    ] {
        assert!(
            err.lines()
                .any(|l| l.contains(&format!(" {span}")) && l.contains("close")),
            "no closing `{span}` span:\n{err}"
        );
    }
    let quiet = graphtrain(&["run", "--config", "tiny", "--steps", "1"]);
    ok(&quiet);
    assert!(
        !text(&quiet.stderr).contains("close"),
        "spans off without RUST_LOG"
    );
}
