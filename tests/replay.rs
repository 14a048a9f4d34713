//! Replay files for the PyTorch peer: `--dump-batches` holds exactly the batches trained on, as
//! [batch, seq+1] u32 blocks, and refuses batches it cannot represent; `--init-out` holds
//! exactly the initial parameters, under names the peer's `load_init` maps onto every one of its
//! parameters, and `--init` starts a run from such a file (or a checkpoint's parameters). With the peer's venv (`../shared/peers/torch/venv`, or GRAPHTRAIN_PEER_PYTHON),
//! Python reads checkpoints and init files, and the peer loads the init file.

use graphtrain::checkpoint;
use graphtrain::data::{batch, Batch, DataMode};
use graphtrain::ir::optim::OptimConfig;
use graphtrain::lr_schedule::LrSchedule;
use graphtrain::models::Llama3Config;
use graphtrain::passes::Pipeline;
use graphtrain::replay::batch_rows;
use graphtrain::trainer::{TrainConfig, Trainer};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("graphtrain-replay-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn graphtrain(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(o: &std::process::Output) {
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

/// Name -> (shape, values) of a safetensors file's F32 tensors.
fn read_f32(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

/// Writes F32 tensors (name, shape, little-endian bytes) as a safetensors file.
fn write_f32(path: &Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) {
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, s, b)| {
            let v = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, s.clone(), b)
                .unwrap();
            (n.clone(), v)
        })
        .collect();
    std::fs::write(path, safetensors::serialize(views, None).unwrap()).unwrap();
}

#[test]
fn batch_rows_are_tokens_plus_the_last_target_and_bad_batches_are_refused() {
    let b = batch(DataMode::Random, 7, 3, 2, 5, 100);
    let rows = batch_rows(&b, 2, 5).unwrap();
    assert_eq!(rows.len(), 2 * 6);
    for r in 0..2 {
        let row = &rows[r * 6..(r + 1) * 6];
        for i in 0..5 {
            assert_eq!(row[i] as i64, b.tokens[r * 5 + i]);
            assert_eq!(row[i + 1] as i64, b.targets[r * 5 + i]);
        }
    }
    let shifted_wrong = Batch {
        tokens: b.tokens.clone(),
        targets: b.targets.iter().map(|t| (t + 1) % 100).collect(),
    };
    let err = batch_rows(&shifted_wrong, 2, 5).unwrap_err();
    assert!(
        err.contains("row 0: target 0") && err.contains("not the tokens shifted by one"),
        "{err}"
    );
    let mut negative = Batch {
        tokens: b.tokens.clone(),
        targets: b.targets.clone(),
    };
    negative.tokens[6] = -1;
    negative.targets[5] = -1;
    let err = batch_rows(&negative, 2, 5).unwrap_err();
    assert!(err.contains("token id -1 at row 1, column 1"), "{err}");
    let err = batch_rows(&b, 3, 5).unwrap_err();
    assert!(err.contains("[3, 5] needs 15"), "{err}");
}

/// The dump holds one block per trained step, each the batch the trainer used; the init file
/// holds every parameter with its initial value, before any update.
#[test]
fn dumped_batches_and_initial_weights_are_exact() {
    let cfg = Llama3Config::builtin("tiny").unwrap();
    let (batches, init) = (temp("tiny.batches"), temp("tiny-init.safetensors"));
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--data",
        "random",
        "--seed",
        "5",
        "--steps",
        "3",
        "--dump-batches",
        batches.to_str().unwrap(),
        "--init-out",
        init.to_str().unwrap(),
    ]);
    ok(&o);
    let bytes = std::fs::read(&batches).unwrap();
    let block = cfg.batch * (cfg.seq_len + 1);
    assert_eq!(bytes.len(), 3 * block * 4);
    let ids: Vec<u32> = bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    for step in 0..3 {
        let b = batch(
            DataMode::Random,
            5,
            step,
            cfg.batch,
            cfg.seq_len,
            cfg.vocab_size,
        );
        // Built here rather than with `batch_rows`, so a wrong block layout shows.
        let seq = cfg.seq_len;
        let want: Vec<u32> = (0..cfg.batch)
            .flat_map(|r| {
                let row = &b.tokens[r * seq..(r + 1) * seq];
                row.iter()
                    .chain([&b.targets[(r + 1) * seq - 1]])
                    .map(|&t| t as u32)
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(
            &ids[step as usize * block..(step as usize + 1) * block],
            want.as_slice(),
            "step {}",
            step + 1
        );
    }

    let mut fresh = Trainer::new(
        &cfg,
        TrainConfig {
            data: DataMode::Random.into(),
            seed: 5,
            lr: LrSchedule::constant(1e-3),
            optim: OptimConfig::default(),
        },
        &Pipeline::new(Vec::new()),
    )
    .unwrap();
    let want = fresh.parameters().unwrap();
    let got = read_f32(&init);
    assert_eq!(got.len(), want.len());
    for (name, t) in &want {
        let (shape, values) = got
            .get(name)
            .unwrap_or_else(|| panic!("`{name}` is missing"));
        assert_eq!(shape, &t.ty.shape, "{name}");
        assert!(
            values.iter().zip(&t.data).all(|(&a, &b)| a as f64 == b),
            "{name} differs"
        );
    }

    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--resume",
        batches.to_str().unwrap(),
        "--init-out",
        init.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("cannot be used with"),
        "{err}"
    );
}

/// The losses (full precision) of a `run --metrics` file, step by step.
fn metric_losses(path: &Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| l.contains(r#""kind":"step""#))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["loss"].as_f64().unwrap()
        })
        .collect()
}

/// `--init` starts from a file's parameters: an `--init-out` file gives back its run's losses
/// bit for bit and another seed's file other losses; a checkpoint's parameters (not its
/// optimizer state or step count) give, on the same fixed batch, the loss the checkpointed run's
/// next step had; BF16 weights are widened exactly (the run's `--init-out` is the file's values);
/// a file of another model, a missing, extra or non-finite tensor and a file that is no
/// safetensors are refused with the tensor's name or the reason.
#[test]
fn init_starts_from_a_files_parameters_and_refuses_a_wrong_file() {
    let path = |name: &str| temp(&format!("init-{name}"));
    let p = |name: &str| path(name).to_str().unwrap().to_string();
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--config", "tiny", "--data", "fixed"];
        args.extend_from_slice(extra);
        graphtrain(&args)
    };
    let (w1, w2, m) = (p("w1.safetensors"), p("w2.safetensors"), p("m.jsonl"));
    ok(&run(&[
        "--seed",
        "1",
        "--steps",
        "3",
        "--init-out",
        &w1,
        "--metrics",
        &m,
    ]));
    let seed1 = metric_losses(Path::new(&m));
    ok(&run(&["--seed", "2", "--steps", "1", "--init-out", &w2]));
    ok(&run(&[
        "--seed",
        "1",
        "--steps",
        "3",
        "--init",
        &w1,
        "--metrics",
        &m,
    ]));
    assert_eq!(metric_losses(Path::new(&m)), seed1, "seed 1's own weights");
    let o = run(&[
        "--seed",
        "1",
        "--steps",
        "1",
        "--init",
        &w2,
        "--metrics",
        &m,
    ]);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stdout).contains("initial parameters from"));
    assert_ne!(
        metric_losses(Path::new(&m))[0],
        seed1[0],
        "seed 2's weights"
    );

    // A checkpoint after 3 steps: its weights, fresh optimizer state, step 1.
    let ckpt = p("c.ckpt");
    ok(&run(&["--seed", "1", "--steps", "4", "--metrics", &m]));
    let four = metric_losses(Path::new(&m));
    ok(&run(&[
        "--seed",
        "1",
        "--steps",
        "3",
        "--checkpoint",
        &ckpt,
    ]));
    ok(&run(&[
        "--seed",
        "1",
        "--steps",
        "2",
        "--init",
        &ckpt,
        "--metrics",
        &m,
    ]));
    let from_ckpt = metric_losses(Path::new(&m));
    assert_eq!(
        from_ckpt[0], four[3],
        "the checkpoint's weights on step 4's batch"
    );
    assert_ne!(from_ckpt[1], four[3], "and a step taken from them");

    // BF16: the seed-1 weights rounded to bf16 (kept in the high halves), read back widened.
    let weights = read_f32(Path::new(&w1));
    let halves: Vec<(String, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(name, (shape, values))| {
            let bytes = values
                .iter()
                .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
                .collect();
            (name.clone(), shape.clone(), bytes)
        })
        .collect();
    let write = |file: &str, tensors: &[(String, safetensors::Dtype, Vec<usize>, Vec<u8>)]| {
        let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
            .iter()
            .map(|(n, d, s, b)| {
                let view = safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap();
                (n.clone(), view)
            })
            .collect();
        std::fs::write(path(file), safetensors::serialize(views, None).unwrap()).unwrap();
        p(file)
    };
    let bf16: Vec<_> = halves
        .iter()
        .map(|(n, s, b)| (n.clone(), safetensors::Dtype::BF16, s.clone(), b.clone()))
        .collect();
    let (bf16_file, back) = (write("bf16.safetensors", &bf16), p("back.safetensors"));
    ok(&run(&[
        "--steps",
        "1",
        "--init",
        &bf16_file,
        "--init-out",
        &back,
    ]));
    for (name, (_, values)) in read_f32(Path::new(&back)) {
        let want = &weights[&name].1;
        assert!(
            values
                .iter()
                .zip(want)
                .all(|(v, w)| v.to_bits() == w.to_bits() & 0xFFFF_0000),
            "{name} is not its bf16 halves widened"
        );
    }

    // On text, a checkpoint's tokenizer tokenizes the new text.
    let show = graphtrain(&["config", "show", "tiny"]);
    ok(&show);
    let ron = String::from_utf8_lossy(&show.stdout).replace("vocab_size: 64", "vocab_size: 300");
    let (cfg300, cache) = (p("tiny300.ron"), p("cache"));
    std::fs::write(&cfg300, ron).unwrap();
    let words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran"];
    let text = |n: usize, k: usize| -> String {
        (0..n)
            .map(|i| words[(i * k + i / 3) % 8])
            .collect::<Vec<_>>()
            .join(" ")
    };
    let (first, second, text_ckpt) = (p("first.txt"), p("second.txt"), p("text.ckpt"));
    std::fs::write(&first, text(6000, 3)).unwrap();
    std::fs::write(&second, text(3000, 5)).unwrap();
    let on_text = |data: &str, extra: &[&str]| {
        let mut args = vec![
            "run",
            "--config",
            &cfg300,
            "--data",
            data,
            "--data-cache",
            &cache,
        ];
        args.extend_from_slice(extra);
        graphtrain(&args)
    };
    ok(&on_text(
        &first,
        &["--steps", "1", "--checkpoint", &text_ckpt],
    ));
    let o = on_text(&second, &["--steps", "1", "--init", &text_ckpt]);
    ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("tokenizer: the one in") && out.contains("init-tokenizers"),
        "{out}"
    );

    // Wrong files, each refused by name.
    let mut missing = bf16.clone();
    let gone = missing.pop().unwrap().0;
    let mut extra = bf16.clone();
    extra.push((
        "layers.9.attention.wq.weight".into(),
        safetensors::Dtype::BF16,
        vec![1],
        vec![0, 0],
    ));
    let mut non_finite = bf16.clone();
    non_finite[0].3[2..4].copy_from_slice(&0x7fc0u16.to_le_bytes());
    let not_safetensors = temp("init-not.safetensors");
    std::fs::write(&not_safetensors, b"not a tensor file").unwrap();
    for (file, needles) in [
        (
            write("missing.safetensors", &missing),
            vec![format!("no tensor `{gone}`")],
        ),
        (
            write("extra.safetensors", &extra),
            vec![
                "`layers.9.attention.wq.weight`".into(),
                "not a parameter".into(),
            ],
        ),
        (
            write("nan.safetensors", &non_finite),
            vec![
                format!("`{}`", bf16[0].0),
                "element 1".into(),
                "finite".into(),
            ],
        ),
        (
            not_safetensors.to_str().unwrap().to_string(),
            vec!["not a safetensors file".into()],
        ),
    ] {
        let o = run(&["--steps", "1", "--init", &file]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{file} was accepted");
        assert!(!err.contains("panicked"), "{err}");
        for n in &needles {
            assert!(err.contains(n.as_str()), "{file}: `{n}` not in: {err}");
        }
    }
    let o = graphtrain(&[
        "run",
        "--config",
        "small",
        "--backend",
        "reference",
        "--steps",
        "0",
        "--init",
        &w1,
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("tok_embeddings.weight")
            && err.contains("is f32[64,32]"),
        "{err}"
    );
}

/// A Hugging Face Llama model folder (`config.json` and safetensors shards under transformers'
/// names, with a RoPE buffer older versions saved) trains as `--config DIR --init DIR`: the
/// losses of the same weights under the graph's names, bit for bit. What transformers itself
/// computes from such a folder: `transformers_computes_the_same_loss_from_a_llama_folder`.
#[test]
fn a_hugging_face_llama_folder_is_a_config_and_initial_weights() {
    let dir = temp("hf-llama");
    std::fs::create_dir_all(&dir).unwrap();
    let config = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
  "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 64, "rms_norm_eps": 1e-05,
  "rope_theta": 10000.0, "max_position_embeddings": 16, "hidden_act": "silu",
  "tie_word_embeddings": false, "rope_scaling": null, "torch_dtype": "float32"}"#;
    std::fs::write(dir.join("config.json"), config).unwrap();
    let d = dir.to_str().unwrap();
    let (w, m) = (temp("hf-w.safetensors"), temp("hf-m.jsonl"));
    let common = [
        "run", "--config", d, "--batch", "2", "--data", "fixed", "--seed", "3",
    ];
    let run = |extra: &[&str]| {
        let mut args = common.to_vec();
        args.extend_from_slice(extra);
        graphtrain(&args)
    };
    let (w_s, m_s) = (w.to_str().unwrap(), m.to_str().unwrap());
    ok(&run(&["--steps", "2", "--init-out", w_s, "--metrics", m_s]));
    let want = metric_losses(&m);
    // The graph's names back to transformers', in two shard files.
    let to_hf = |name: &str| -> String {
        let renames = [
            ("tok_embeddings.weight", "model.embed_tokens.weight"),
            ("norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
        ];
        if let Some((_, hf)) = renames.iter().find(|(ours, _)| *ours == name) {
            return hf.to_string();
        }
        let parts = [
            ("attention.wq", "self_attn.q_proj"),
            ("attention.wk", "self_attn.k_proj"),
            ("attention.wv", "self_attn.v_proj"),
            ("attention.wo", "self_attn.o_proj"),
            ("feed_forward.w1", "mlp.gate_proj"),
            ("feed_forward.w3", "mlp.up_proj"),
            ("feed_forward.w2", "mlp.down_proj"),
            ("attention_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
        ];
        let (ours, hf) = parts.iter().find(|(o, _)| name.contains(o)).unwrap();
        format!("model.{}", name.replace(ours, hf))
    };
    let weights = read_f32(&w);
    /// A tensor as written: name, shape, F32 bytes.
    type Written = (String, Vec<usize>, Vec<u8>);
    let mut shards: [Vec<Written>; 2] = Default::default();
    for (i, (name, (shape, values))) in weights.iter().enumerate() {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        shards[i % 2].push((to_hf(name), shape.clone(), bytes));
    }
    shards[0].push((
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        vec![4],
        vec![0; 16],
    ));
    for (k, shard) in shards.iter().enumerate() {
        write_f32(
            &dir.join(format!("model-0000{}-of-00002.safetensors", k + 1)),
            shard,
        );
    }
    ok(&run(&["--steps", "2", "--init", d, "--metrics", m_s]));
    assert_eq!(metric_losses(&m), want, "the folder's weights");
    let shown = graphtrain(&["config", "show", d]);
    ok(&shown);
    let ron = String::from_utf8_lossy(&shown.stdout);
    assert!(
        ron.contains("rope_layout: Half") && ron.contains("seq_len: 16"),
        "{ron}"
    );

    // A config it cannot train, and a tensor that is no Llama's, are refused by name.
    std::fs::write(
        dir.join("config.json"),
        config.replace(
            r#""rope_scaling": null"#,
            r#""rope_scaling": {"rope_type": "llama3"}"#,
        ),
    )
    .unwrap();
    let o = run(&["--steps", "1"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("rope_scaling"), "{err}");
    std::fs::write(dir.join("config.json"), config).unwrap();
    let stray = dir.join("model-00002-of-00002.safetensors");
    let views = vec![(
        "model.layers.0.mlp.up_proj.bias".to_string(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![1], &[0u8; 4]).unwrap(),
    )];
    std::fs::write(&stray, safetensors::serialize(views, None).unwrap()).unwrap();
    let o = run(&["--steps", "1", "--init", d]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("`model.layers.0.mlp.up_proj.bias` is no tensor"),
        "{err}"
    );
}

/// `graphtrain export` writes a checkpoint as a Hugging Face Llama folder that reads back as
/// `--config DIR --init DIR`: `tiny` (Meta's interleaved RoPE, grouped-query heads) exported
/// with q and k rows in `rotate_half`'s order and read back as a `Half` model gives the loss the
/// checkpointed run's next step had, to f32 rounding (the attention sums run in another order;
/// q and k are scaled up so that attention is far from uniform and a wrong order shows). The
/// optimizer state stays behind; bf16 export rounds to nearest even.
#[test]
fn an_exported_checkpoint_reads_back_as_a_hugging_face_folder() {
    let p = |name: &str| {
        temp(&format!("export-{name}"))
            .to_str()
            .unwrap()
            .to_string()
    };
    let (w, big, ckpt, m, dir) = (p("w.st"), p("big.st"), p("c.ckpt"), p("m.jsonl"), p("hf"));
    let tiny = |extra: &[&str]| {
        let mut args = vec!["run", "--config", "tiny", "--data", "fixed", "--seed", "1"];
        args.extend_from_slice(extra);
        graphtrain(&args)
    };
    ok(&tiny(&["--steps", "1", "--init-out", &w]));
    // Larger q and k: attention far from uniform.
    let views: Vec<(String, Vec<usize>, Vec<u8>)> = read_f32(Path::new(&w))
        .into_iter()
        .map(|(name, (shape, values))| {
            let scale = if name.contains(".wq.") || name.contains(".wk.") {
                12.0
            } else {
                1.0
            };
            let bytes = values
                .iter()
                .flat_map(|v| (v * scale).to_le_bytes())
                .collect();
            (name, shape, bytes)
        })
        .collect();
    write_f32(Path::new(&big), &views);
    ok(&tiny(&["--steps", "3", "--init", &big, "--metrics", &m]));
    let losses = metric_losses(Path::new(&m));
    ok(&tiny(&[
        "--steps",
        "2",
        "--init",
        &big,
        "--checkpoint",
        &ckpt,
    ]));
    let o = graphtrain(&["export", &ckpt, "--out", &dir]);
    ok(&o);
    assert!(String::from_utf8_lossy(&o.stdout).contains("model.safetensors (21 tensors, float32)"));
    let config = std::fs::read_to_string(Path::new(&dir).join("config.json")).unwrap();
    assert!(config.contains(r#""num_key_value_heads": 2"#), "{config}");
    let o = graphtrain(&[
        "run",
        "--config",
        &dir,
        "--init",
        &dir,
        "--batch",
        "2",
        "--data",
        "fixed",
        "--seed",
        "1",
        "--steps",
        "1",
        "--metrics",
        &m,
    ]);
    ok(&o);
    let back = metric_losses(Path::new(&m))[0];
    let rel = (back - losses[2]).abs() / losses[2];
    assert!(
        rel < 1e-6,
        "read back {back}, the run's step 3 {}: {rel:e} apart",
        losses[2]
    );
    assert!(
        (losses[2] - losses[0]).abs() / losses[0] > 1e-3,
        "the step moved the loss too little to tell"
    );

    // bf16: each value of the f32 export rounded to nearest even.
    let f32s = read_f32(&Path::new(&dir).join("model.safetensors"));
    let o = graphtrain(&["export", &ckpt, "--out", &dir, "--dtype", "bf16"]);
    ok(&o);
    let bytes = std::fs::read(Path::new(&dir).join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let nearest_even = |x: f32| {
        let b = x.to_bits();
        ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
    };
    for (name, (shape, values)) in &f32s {
        let t = st.tensor(name).unwrap();
        assert_eq!(
            (t.dtype(), t.shape()),
            (safetensors::Dtype::BF16, shape.as_slice())
        );
        let halves = t
            .data()
            .chunks_exact(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]));
        assert!(
            halves.zip(values).all(|(h, &v)| h == nearest_even(v)),
            "{name}"
        );
    }
}

/// The peer's `load_init` renames torchtitan's names (`TITAN_NAMES` in llama_step.py) and needs
/// every parameter of its model, no more, with its shape; this mirrors both for the `peer`
/// config.
#[test]
fn the_peer_config_init_file_maps_onto_every_peer_parameter() {
    let init = temp("peer-init.safetensors");
    ok(&graphtrain(&[
        "run",
        "--config",
        "peer",
        "--backend",
        "reference",
        "--steps",
        "0",
        "--init-out",
        init.to_str().unwrap(),
    ]));
    const TITAN_NAMES: [(&str, &str); 4] = [
        ("tok_embeddings.", "tok_emb."),
        (".attention_norm.", ".attn_norm."),
        (".attention.", ".attn."),
        (".feed_forward.", ".ffn."),
    ];
    let renamed: BTreeMap<String, Vec<usize>> = read_f32(&init)
        .into_iter()
        .map(|(mut name, (shape, _))| {
            for (a, b) in TITAN_NAMES {
                name = match name.strip_prefix(a) {
                    Some(rest) => format!("{b}{rest}"),
                    None => name.replace(a, b),
                };
            }
            (name, shape)
        })
        .collect();
    // llama_step.py's defaults: vocab 2048, dim 256, 4 layers, ffn 768; nn.Linear is [out, in].
    let (v, d, f) = (2048, 256, 768);
    let mut want = BTreeMap::from([
        ("tok_emb.weight".to_string(), vec![v, d]),
        ("norm.weight".to_string(), vec![d]),
        ("output.weight".to_string(), vec![v, d]),
    ]);
    for l in 0..4 {
        let p = |s: &str| format!("layers.{l}.{s}.weight");
        want.insert(p("attn_norm"), vec![d]);
        want.insert(p("ffn_norm"), vec![d]);
        for w in ["wq", "wk", "wv", "wo"] {
            want.insert(p(&format!("attn.{w}")), vec![d, d]);
        }
        want.insert(p("ffn.w1"), vec![f, d]);
        want.insert(p("ffn.w3"), vec![f, d]);
        want.insert(p("ffn.w2"), vec![d, f]);
    }
    assert_eq!(renamed, want);
}

/// The Python the peer uses: GRAPHTRAIN_PEER_PYTHON, else ../shared/peers/torch/venv.
fn peer_python() -> PathBuf {
    std::env::var_os("GRAPHTRAIN_PEER_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/peers/torch/venv/bin/python")
        })
}

/// Reads a safetensors file with numpy alone (as llama_step.py's `read_safetensors` does) and
/// prints, per tensor, its name, dtype, shape and first and last values.
const NUMPY_READER: &str = r#"
import json, sys
import numpy as np
raw = open(sys.argv[1], "rb").read()
n = int.from_bytes(raw[:8], "little")
header = json.loads(raw[8:8 + n])
for name, info in sorted(header.items()):
    if name == "__metadata__":
        continue
    b, e = info["data_offsets"]
    dt = {"F32": "<f4", "F64": "<f8"}[info["dtype"]]
    a = np.frombuffer(raw[8 + n + b:8 + n + e], dtype=dt).reshape(info["shape"])
    flat = a.reshape(-1)
    print(name, info["dtype"], list(a.shape), repr(float(flat[0])), repr(float(flat[-1])))
"#;

#[test]
#[ignore = "needs the PyTorch peer's venv: ../shared/peers/torch/install.sh (or GRAPHTRAIN_PEER_PYTHON with numpy)"]
fn python_reads_checkpoints_with_numpy() {
    let python = peer_python();
    assert!(
        python.exists(),
        "{} does not exist: run ../shared/peers/torch/install.sh or set GRAPHTRAIN_PEER_PYTHON",
        python.display()
    );
    let path = temp("for-python.ckpt");
    ok(&graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--checkpoint",
        path.to_str().unwrap(),
    ]));
    let o = Command::new(&python)
        .args(["-c", NUMPY_READER, path.to_str().unwrap()])
        .output()
        .unwrap();
    ok(&o);
    let ckpt = checkpoint::load(&path).unwrap();
    let mut want: Vec<String> = ckpt
        .header
        .tensors
        .iter()
        .zip(&ckpt.tensors)
        .map(|(e, t)| {
            let dtype = if e.ty.dtype == graphtrain::ir::DType::F32 {
                "F32"
            } else {
                "F64"
            };
            format!(
                "{} {dtype} {:?} {:?} {:?}",
                e.name,
                e.ty.shape,
                t.data[0],
                t.data[t.data.len() - 1]
            )
        })
        .collect();
    want.sort();
    let got: Vec<String> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(str::to_string)
        .collect();
    assert!(got.len() > 10, "{got:?}");
    assert_eq!(
        got.iter().map(|l| normalize(l)).collect::<Vec<_>>(),
        want.iter().map(|l| normalize(l)).collect::<Vec<_>>()
    );
}

/// Python and Rust print lists and floats slightly differently (`[2, 3]` vs `[2, 3]`, `1e-05`
/// vs `1e-5`): compare the parsed fields.
fn normalize(line: &str) -> String {
    line.split_whitespace()
        .map(|w| {
            match w
                .trim_matches(|c| c == '[' || c == ']' || c == ',')
                .parse::<f64>()
            {
                Ok(v) if w.contains('.') || w.contains('e') => format!("{v:e}"),
                _ => w.to_string(),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The peer's own `load_init` accepts the `peer` config's init file (needs torch).
#[test]
#[ignore = "needs the PyTorch peer's venv: ../shared/peers/torch/install.sh"]
fn the_peer_loads_the_init_file() {
    let python = peer_python();
    let peer_dir = std::env::var_os("GRAPHTRAIN_PEER_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/peers/torch"));
    assert!(
        python.exists() && peer_dir.join("llama_step.py").exists(),
        "needs {} and {}/llama_step.py",
        python.display(),
        peer_dir.display()
    );
    let init = temp("peer-init-torch.safetensors");
    ok(&graphtrain(&[
        "run",
        "--config",
        "peer",
        "--backend",
        "reference",
        "--steps",
        "0",
        "--init-out",
        init.to_str().unwrap(),
    ]));
    let script = r#"
import sys
sys.path.insert(0, sys.argv[1])
import llama_step as ls
m = ls.Llama(2048, 256, 4, 8, 768, 256)
ls.load_init(m, sys.argv[2])
print("loaded", repr(float(m.layers[0].attn.wq.weight[0, 1])))
"#;
    let o = Command::new(&python)
        .args([
            "-c",
            script,
            peer_dir.to_str().unwrap(),
            init.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    ok(&o);
    let got = read_f32(&init)["layers.0.attention.wq.weight"].1[1];
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(
        out.trim()
            .strip_prefix("loaded ")
            .unwrap()
            .parse::<f64>()
            .unwrap(),
        got as f64,
        "{out}"
    );
}

/// transformers' own forward from a Llama folder gives graphtrain's loss, and from a folder
/// `graphtrain export` wrote (interleaved RoPE) graphtrain's next-step loss
/// (`scripts/vs_transformers.py`: untied and tied embeddings, grouped-query heads, within 1e-5).
#[test]
#[ignore = "needs a Python with torch, numpy and transformers: the peer's venv plus `pip install transformers` (or GRAPHTRAIN_PEER_PYTHON)"]
fn transformers_computes_the_same_loss_from_a_llama_folder() {
    let python = peer_python();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/vs_transformers.py");
    let o = Command::new(&python)
        .arg(&script)
        .arg(env!("CARGO_BIN_EXE_graphtrain"))
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", python.display()));
    ok(&o);
    let out = String::from_utf8_lossy(&o.stdout);
    assert_eq!(out.matches("relative difference").count(), 3, "{out}");
}
