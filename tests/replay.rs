//! Replay files for the PyTorch peer: `--dump-batches` holds exactly the batches trained on, as
//! [batch, seq+1] u32 blocks, and refuses batches it cannot represent; `--init-out` holds
//! exactly the initial parameters, under names the peer's `load_init` maps onto every one of its
//! parameters. With the peer's venv (`../shared/peers/torch/venv`, or GRAPHTRAIN_PEER_PYTHON),
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
