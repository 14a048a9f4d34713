//! Checkpoint and resume: a resumed run is bitwise identical to an uninterrupted one, and bad
//! checkpoints (another run's, truncated, foreign) are refused with a clear error.

use graphtrain::checkpoint::{self, RunIdentity};
use graphtrain::data::DataMode;
use graphtrain::ir::optim::OptimConfig;
use graphtrain::models::Llama3Config;
use graphtrain::passes::Pipeline;
use graphtrain::trainer::{TrainConfig, Trainer};
use std::path::PathBuf;
use std::process::Command;

fn tiny() -> Llama3Config {
    Llama3Config::builtin("tiny").unwrap()
}

fn trainer(seed: u64) -> Trainer {
    let cfg = TrainConfig {
        data: DataMode::Random,
        seed,
        lr: 1e-2,
        optim: OptimConfig::default(),
    };
    Trainer::new(&tiny(), cfg, &Pipeline::new(Vec::new())).unwrap()
}

fn run_id(seed: u64) -> RunIdentity {
    RunIdentity::new(&tiny(), seed, DataMode::Random, &OptimConfig::default())
}

fn temp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("graphtrain-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

#[test]
fn resuming_is_bitwise_identical_to_not_stopping() {
    let mut straight = trainer(0);
    let losses: Vec<u64> = (0..6)
        .map(|_| straight.step().unwrap().loss.to_bits())
        .collect();

    let mut first = trainer(0);
    for _ in 0..3 {
        first.step().unwrap();
    }
    let path = temp("resume.ckpt");
    checkpoint::save(&path, &first.checkpoint(run_id(0)).unwrap()).unwrap();

    let mut resumed = trainer(0);
    resumed
        .restore(checkpoint::load(&path).unwrap(), &run_id(0))
        .unwrap();
    assert_eq!(resumed.steps_done(), 3);
    let rest: Vec<u64> = (0..3)
        .map(|_| resumed.step().unwrap().loss.to_bits())
        .collect();
    assert_eq!(rest, losses[3..]);
    let names: Vec<String> = straight
        .graph
        .inputs
        .iter()
        .map(|i| i.name.clone())
        .filter(|n| n.contains("weight"))
        .collect();
    for name in names {
        let a = straight.input_value(&name).unwrap().clone();
        assert_eq!(&a, resumed.input_value(&name).unwrap(), "{name}");
    }
}

#[test]
fn another_runs_checkpoint_is_refused() {
    let path = temp("other.ckpt");
    checkpoint::save(&path, &trainer(0).checkpoint(run_id(0)).unwrap()).unwrap();
    let err = trainer(1)
        .restore(checkpoint::load(&path).unwrap(), &run_id(1))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("different run") && err.contains("--seed (checkpoint 0, now 1)"),
        "{err}"
    );
}

#[test]
fn truncated_and_foreign_files_are_refused() {
    let path = temp("whole.ckpt");
    checkpoint::save(&path, &trainer(0).checkpoint(run_id(0)).unwrap()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    for cut in [0, 10, 30, bytes.len() / 2, bytes.len() - 1] {
        let p = temp("cut.ckpt");
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let err = checkpoint::load(&p).unwrap_err();
        assert!(
            err.contains("not a usable graphtrain checkpoint"),
            "cut {cut}: {err}"
        );
    }
    let p = temp("extra.ckpt");
    let mut more = bytes.clone();
    more.push(0);
    std::fs::write(&p, more).unwrap();
    assert!(checkpoint::load(&p)
        .unwrap_err()
        .contains("unexpected bytes"));
}

fn graphtrain(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args(args)
        .output()
        .unwrap()
}

fn step_lines(o: &std::process::Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stdout)
        .lines()
        .filter(|l| l.starts_with("step:"))
        .map(|l| l.split(" memory:").next().unwrap().to_string())
        .collect()
}

#[test]
fn cli_checkpoint_and_resume() {
    let ckpt = temp("cli.ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let straight = graphtrain(&["run", "--config", "tiny", "--steps", "5"]);
    assert!(straight.status.success());
    let first = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "3",
        "--checkpoint",
        ckpt,
    ]);
    assert!(
        first.status.success(),
        "{}",
        String::from_utf8_lossy(&first.stderr)
    );
    let second = graphtrain(&["run", "--config", "tiny", "--steps", "5", "--resume", ckpt]);
    assert!(
        second.status.success(),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    let mut joined = step_lines(&first);
    joined.extend(step_lines(&second));
    assert_eq!(joined, step_lines(&straight));

    let wrong = graphtrain(&[
        "run", "--config", "tiny", "--steps", "5", "--seed", "3", "--resume", ckpt,
    ]);
    let err = String::from_utf8_lossy(&wrong.stderr);
    assert!(
        !wrong.status.success() && err.contains("--seed (checkpoint 0, now 3)"),
        "{err}"
    );
}

/// On the interpreter a failed step's update is never kept, so the state before it is saved.
#[test]
fn a_failing_run_keeps_its_last_good_state() {
    let ckpt = temp("diverged.ckpt");
    let o = graphtrain(&[
        "run",
        "--backend",
        "reference",
        "--config",
        "tiny",
        "--steps",
        "10",
        "--lr",
        "1e30",
        "--data",
        "fixed",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && err.contains("loss is")
            && err.contains("saved the state after step"),
        "{err}"
    );
    let saved = checkpoint::load(&ckpt).unwrap();
    assert!(saved
        .tensors
        .iter()
        .all(|t| t.data.iter().all(|v| v.is_finite())));
}

/// On the cpu backend the update happens in place before the loss is known: the run refuses to
/// overwrite the last checkpoint with the diverged state.
#[test]
fn a_failing_compiled_run_does_not_overwrite_its_checkpoint() {
    let ckpt = temp("diverged-cpu.ckpt");
    let o = graphtrain(&[
        "run",
        "--backend",
        "cpu",
        "--config",
        "tiny",
        "--steps",
        "10",
        "--lr",
        "1e30",
        "--data",
        "fixed",
        "--checkpoint-every",
        "1",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("loss is") && err.contains("not saving"),
        "{err}"
    );
    let saved = checkpoint::load(&ckpt).unwrap();
    assert!(saved
        .tensors
        .iter()
        .all(|t| t.data.iter().all(|v| v.is_finite())));
}
