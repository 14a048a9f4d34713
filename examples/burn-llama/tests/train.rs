//! The burn-nn Llama trained by graphtrain and by burn itself, from the same weights on the same
//! batches: the loss curves agree, and the record graphtrain's run writes loads in burn and
//! gives the loss graphtrain computes next.

use burn::store::{BurnpackStore, ModuleSnapshot};
use burn::tensor::{Device, Int, Tensor, TensorData};
use graphtrain::data::DataSource;
use graphtrain_burn::llama::LlamaConfig;
use graphtrain_models::Llama3Config;
use std::path::Path;
use std::process::Command;

/// A Llama shape small enough for a test, without grouped-query heads (the burn model's).
fn config() -> Llama3Config {
    let mut cfg = Llama3Config::builtin("peer").unwrap();
    cfg.vocab_size = 64;
    cfg.dim = 32;
    cfg.n_layers = 2;
    cfg.n_heads = 4;
    cfg.n_kv_heads = 4;
    cfg.ffn_hidden = 64;
    cfg.batch = 2;
    cfg.seq_len = 16;
    cfg
}

fn run(config: &Path, extra: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_burn-llama"))
        .args([
            "--config",
            config.to_str().unwrap(),
            "--data",
            "fixed",
            "--lr",
            "3e-3",
        ])
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "{extra:?}: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step "))
        .map(|l| {
            let after = l.split("loss ").nth(1).unwrap();
            after.split_whitespace().next().unwrap().parse().unwrap()
        })
        .collect()
}

#[test]
fn graphtrain_and_burn_train_the_burn_model_alike_and_the_record_loads_in_burn() {
    let dir = std::env::temp_dir().join(format!("burn-llama-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = config();
    let config = dir.join("shape.ron");
    std::fs::write(&config, graphtrain::config::config_to_ron(&cfg)).unwrap();
    let record = dir.join("trained.bpk");

    let ours = losses(&run(
        &config,
        &["--steps", "20", "--record-out", record.to_str().unwrap()],
    ));
    let burns = losses(&run(&config, &["--steps", "20", "--peer", "burn"]));
    assert_eq!((ours.len(), burns.len()), (20, 20));
    for (step, (a, b)) in ours.iter().zip(&burns).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(
            rel < 1e-3,
            "step {}: graphtrain {a}, burn {b} ({rel:.1e})",
            step + 1
        );
    }
    assert!(ours[19] < 0.5 * ours[0], "the loss did not fall: {ours:?}");

    // The record holds the weights after 20 updates: burn's loss of them on the fixed batch is
    // the loss graphtrain reports at step 21.
    let shape = LlamaConfig::like(&cfg).unwrap();
    let device = Device::flex();
    let mut model = shape.init(&device);
    let applied = model
        .load_from(&mut BurnpackStore::from_file(&record))
        .unwrap();
    assert!(
        applied.errors.is_empty() && applied.missing.is_empty(),
        "{applied:?}"
    );
    let batch = DataSource::Fixed
        .batch(0, 0, cfg.batch, cfg.seq_len, cfg.vocab_size)
        .unwrap();
    let ints = |v: &[i64]| {
        Tensor::<2, Int>::from_data(
            TensorData::new(v.to_vec(), [cfg.batch, cfg.seq_len]),
            &device,
        )
    };
    let reloaded = model
        .loss(ints(&batch.tokens), ints(&batch.targets))
        .into_scalar::<f32>() as f64;
    let next = losses(&run(&config, &["--steps", "21"]))[20];
    assert!(
        ((reloaded - next) / next).abs() < 1e-4,
        "burn's loss of the record {reloaded}, graphtrain's step 21 {next}"
    );

    // The built-in plan on a 2 x 2 mesh (FSDP and tensor parallelism, ranks as threads): the
    // same losses within rounding.
    let meshed = losses(&run(
        &config,
        &["--steps", "5", "--mesh", "dp_shard=2,tp=2"],
    ));
    assert_eq!(meshed.len(), 5);
    for (step, (a, b)) in meshed.iter().zip(&ours).enumerate() {
        let rel = ((a - b) / b).abs();
        assert!(
            rel < 1e-4,
            "step {} on the mesh: {a} against one device's {b}",
            step + 1
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
