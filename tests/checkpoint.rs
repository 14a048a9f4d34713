//! Checkpoint and resume: a resumed run is bitwise identical to an uninterrupted one, on the
//! interpreter, on cpu and on wgpu (every loss, grad norm, parameter and optimizer-state
//! tensor); bad checkpoints (another run's, truncated, extended, foreign, format 1, a changed
//! byte anywhere in a tensor or the header) are refused with a clear error and left as they
//! were; the files are safetensors that Python reads; `--dump-batches` and `--init-out` write
//! what the PyTorch peer replays.

mod common;

use common::{compare_named, compare_values, Agree};
use graphtrain::checkpoint::{self, Checkpoint, RunIdentity};
use graphtrain::data::DataMode;
use graphtrain::gate;
use graphtrain::ir::optim::OptimConfig;
use graphtrain::ir::{HostTensor, InputKind};
use graphtrain::lr_schedule::LrSchedule;
use graphtrain::models::Llama3Config;
use graphtrain::passes::Pipeline;
use graphtrain::trainer::{TrainConfig, Trainer};
use graphtrain_lowering::Mode;
use graphtrain_runtime::Backend;
use std::path::PathBuf;
use std::process::Command;

fn tiny() -> Llama3Config {
    Llama3Config::builtin("tiny").unwrap()
}

fn trainer(seed: u64) -> Trainer {
    let cfg = TrainConfig {
        data: DataMode::Random.into(),
        seed,
        lr: LrSchedule::constant(1e-2),
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

/// A trainer for run `seed` whose steps run on `backend` (the interpreter's is the one
/// `Trainer::new` builds; the compiled ones are loaded with `use_backend`, fused).
fn trainer_on(backend: Backend, seed: u64) -> Trainer {
    let mut t = trainer(seed);
    if backend != Backend::Reference {
        t.use_backend(backend, Mode::Fused)
            .unwrap_or_else(|e| panic!("{backend}: {e}"));
    }
    t
}

/// Every parameter and optimizer-state tensor of `t`, by name, in the graph's order.
fn carried(t: &mut Trainer) -> Vec<(String, HostTensor)> {
    let names: Vec<String> = t
        .graph
        .inputs
        .iter()
        .filter(|i| i.kind != InputKind::Data)
        .map(|i| i.name.clone())
        .collect();
    names
        .into_iter()
        .map(|n| {
            let v = t.input_value(&n).expect("the input exists").clone();
            (n, v)
        })
        .collect()
}

/// A checkpoint's tensors with their names.
fn named(ckpt: &Checkpoint) -> Vec<(String, HostTensor)> {
    ckpt.header
        .tensors
        .iter()
        .map(|e| e.name.clone())
        .zip(ckpt.tensors.iter().cloned())
        .collect()
}

/// What `steps` more steps of `t` leave: losses, grad norms, and every carried tensor.
struct Rest {
    losses: Vec<f64>,
    grad_norms: Vec<f64>,
    state: Vec<(String, HostTensor)>,
}

fn continue_for(t: &mut Trainer, steps: usize) -> Rest {
    let (mut losses, mut grad_norms) = (Vec::new(), Vec::new());
    for _ in 0..steps {
        let m = t.step().unwrap();
        losses.push(m.loss);
        grad_norms.push(m.grad_norm);
    }
    Rest {
        losses,
        grad_norms,
        state: carried(t),
    }
}

/// Trains `N` steps on `backend`, checkpoints (through a file) and continues `M` steps; a fresh
/// trainer on the same backend restores the checkpoint and runs the same `M` steps. Both must
/// agree bit for bit: the restored tensors with the checkpoint, and then every loss, grad norm,
/// parameter and optimizer-state tensor. The comparison is not empty: the `M` steps after the
/// checkpoint moved every tensor.
fn assert_resume_is_bitwise(backend: Backend) {
    const N: usize = 3;
    const M: usize = 3;
    let mut straight = trainer_on(backend, 0);
    for _ in 0..N {
        straight.step().unwrap();
    }
    let path = temp(&format!("resume-{backend}.ckpt"));
    let saved = straight.checkpoint(run_id(0)).unwrap();
    checkpoint::save(&path, &saved).unwrap();
    let saved = named(&saved);
    let want = continue_for(&mut straight, M);

    let mut resumed = trainer_on(backend, 0);
    resumed
        .restore(checkpoint::load(&path).unwrap(), &run_id(0))
        .unwrap();
    assert_eq!(resumed.steps_done(), N as u64, "{backend}");
    // Through the file and into the trainer, every tensor keeps its bits.
    if let Err(e) = compare_named(&carried(&mut resumed), &saved, Agree::Bitwise) {
        panic!("{backend}: restored trainer vs the checkpoint it was given:\n{e}");
    }
    let got = continue_for(&mut resumed, M);
    assert_eq!(resumed.steps_done(), (N + M) as u64, "{backend}");

    let steps = [M];
    let errors: Vec<String> = [
        compare_values("loss", &steps, &got.losses, &want.losses, Agree::Bitwise),
        compare_values(
            "grad_norm",
            &steps,
            &got.grad_norms,
            &want.grad_norms,
            Agree::Bitwise,
        ),
        compare_named(&got.state, &want.state, Agree::Bitwise),
    ]
    .into_iter()
    .filter_map(Result::err)
    .collect();
    assert!(
        errors.is_empty(),
        "{backend}: resumed run vs uninterrupted run:\n{}",
        errors.join("\n")
    );
    for ((name, after), (_, before)) in want.state.iter().zip(&saved) {
        assert!(
            after.data.iter().zip(&before.data).any(|(a, b)| a != b),
            "{backend}: `{name}` did not change after the checkpoint"
        );
    }
}

#[test]
fn resuming_is_bitwise_identical_to_not_stopping() {
    assert_resume_is_bitwise(Backend::Reference);
}

/// The cpu backend updates parameters and state in place inside its arena: a checkpoint reads
/// them back, a restore writes them in, and the next steps are the same bits.
#[test]
fn resuming_on_cpu_is_bitwise_identical_to_not_stopping() {
    assert_resume_is_bitwise(Backend::Cpu);
}

#[test]
fn resuming_on_wgpu_is_bitwise_identical_to_not_stopping() {
    for backend in gate::device_backends_for_tests() {
        assert_resume_is_bitwise(backend);
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
    let err = checkpoint::load(&p).unwrap_err();
    assert!(err.contains("bytes appended"), "{err}");

    let foreign: [(&str, Vec<u8>, &str); 4] = [
        (
            "text.ckpt",
            b"step: 1 loss: 4.1\nstep: 2 loss: 4.0\n".to_vec(),
            "not a safetensors file",
        ),
        (
            "format1.ckpt",
            b"graphtrain-checkpoint 1\n\x10\0\0\0\0\0\0\0(run: ...)".to_vec(),
            "format 1 graphtrain checkpoint",
        ),
        (
            "plain.safetensors",
            safetensors::serialize(
                [(
                    "w",
                    safetensors::tensor::TensorView::new(
                        safetensors::Dtype::F32,
                        vec![1],
                        &[0u8; 4],
                    )
                    .unwrap(),
                )],
                None,
            )
            .unwrap(),
            "without `__metadata__`",
        ),
        (
            "other.safetensors",
            safetensors::serialize(
                [(
                    "w",
                    safetensors::tensor::TensorView::new(
                        safetensors::Dtype::F32,
                        vec![1],
                        &[0u8; 4],
                    )
                    .unwrap(),
                )],
                Some([("format".to_string(), "pt".to_string())].into()),
            )
            .unwrap(),
            "format `pt`",
        ),
    ];
    for (name, bytes, why) in foreign {
        let p = temp(name);
        std::fs::write(&p, bytes).unwrap();
        let err = checkpoint::load(&p).unwrap_err();
        assert!(
            err.contains(why) && err.contains(p.to_str().unwrap()),
            "{name}: {err}"
        );
    }
}

/// Each tensor's name and byte range in a checkpoint file.
type TensorRanges = Vec<(String, std::ops::Range<usize>)>;

/// A saved checkpoint's bytes and, per tensor, its name and byte range in the file.
fn saved_bytes(name: &str) -> (PathBuf, Vec<u8>, TensorRanges) {
    let path = temp(name);
    let mut t = trainer(0);
    t.step().unwrap();
    checkpoint::save(&path, &t.checkpoint(run_id(0)).unwrap()).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let ranges = header
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let o = &v["data_offsets"];
            let (a, b) = (o[0].as_u64().unwrap(), o[1].as_u64().unwrap());
            (k.clone(), 8 + n + a as usize..8 + n + b as usize)
        })
        .collect();
    (path, bytes, ranges)
}

/// One flipped bit in any tensor's data is refused, naming that tensor; the file is left as it
/// was.
#[test]
fn a_changed_byte_in_a_tensor_is_refused_naming_it() {
    let (path, bytes, ranges) = saved_bytes("flip-data.ckpt");
    assert!(ranges.len() > 10, "{ranges:?}");
    for (name, range) in &ranges {
        // Low mantissa bit of the middle element: the smallest change a value can have.
        let at = range.start + (range.len() / 2) / 4 * 4;
        let mut bad = bytes.clone();
        bad[at] ^= 1;
        std::fs::write(&path, &bad).unwrap();
        let err = checkpoint::load(&path).unwrap_err();
        assert!(
            err.contains(&format!("tensor `{name}`")) && err.contains("bytes changed"),
            "{name}: {err}"
        );
        assert_eq!(std::fs::read(&path).unwrap(), bad, "load changed the file");
    }
}

/// Every single-bit change in the length prefix or the JSON header (tensor names, shapes,
/// offsets, dtypes, every metadata entry) is refused.
#[test]
fn a_changed_byte_in_the_header_is_refused() {
    let (_, bytes, _) = saved_bytes("flip-header.ckpt");
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut accepted = Vec::new();
    for at in 0..8 + n {
        for bit in [0x01u8, 0x20] {
            let mut bad = bytes.clone();
            bad[at] ^= bit;
            if checkpoint::from_bytes(&bad).is_ok() {
                accepted.push(format!("byte {at} ({:?}) ^ {bit:#x}", bytes[at] as char));
            }
        }
    }
    assert!(accepted.is_empty(), "accepted: {accepted:?}");
    // The metadata checksum is what catches a change that leaves valid JSON and sense: the
    // step count, as a reader would see it.
    let text = String::from_utf8_lossy(&bytes[8..8 + n]).to_string();
    let changed = text.replacen("\"steps_done\":\"1\"", "\"steps_done\":\"2\"", 1);
    assert_ne!(changed, text);
    let mut bad = bytes[..8].to_vec();
    bad.extend_from_slice(changed.as_bytes());
    bad.extend_from_slice(&bytes[8 + n..]);
    let err = checkpoint::from_bytes(&bad).unwrap_err();
    assert!(err.contains("metadata changed"), "{err}");
}

/// The open metadata map comes back verbatim (a tokenizer's JSON has quotes, newlines and
/// non-ASCII), and the graph fingerprint and data position are recorded.
#[test]
fn extra_metadata_and_the_fingerprint_round_trip() {
    let path = temp("extra-meta.ckpt");
    let mut t = trainer(0);
    t.step().unwrap();
    t.step().unwrap();
    let mut ckpt = t.checkpoint(run_id(0)).unwrap();
    let tokenizer = "{\"model\": {\"vocab\": {\"é\": 0, \"\\n\": 1}}}\n\t end";
    ckpt.header
        .extra
        .insert("tokenizer.json".to_string(), tokenizer.to_string());
    ckpt.header.extra.insert("empty".to_string(), String::new());
    checkpoint::save(&path, &ckpt).unwrap();
    let back = checkpoint::load(&path).unwrap();
    assert_eq!(back, ckpt);
    assert_eq!(back.header.extra["tokenizer.json"], tokenizer);
    assert_eq!(back.header.fingerprint, t.fingerprint.to_string());
    assert_eq!(back.header.data_batches_consumed, 2);
}

/// A resume that fails on a bad checkpoint writes nothing, even when --checkpoint names the
/// same file.
#[test]
fn a_refused_resume_leaves_the_file_unchanged() {
    let ckpt = temp("refused.ckpt");
    let first = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    assert!(first.status.success());
    let mut bytes = std::fs::read(&ckpt).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&ckpt, &bytes).unwrap();
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "4",
        "--resume",
        ckpt.to_str().unwrap(),
        "--checkpoint",
        ckpt.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("bytes changed"),
        "{err}"
    );
    assert_eq!(std::fs::read(&ckpt).unwrap(), bytes);
}

/// Another pass pipeline over the same run resumes (state is matched by name) and says that
/// the graph differs.
#[test]
fn resuming_with_other_passes_prints_the_fingerprints() {
    let ckpt = temp("passes.ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let first = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--steps",
        "2",
        "--checkpoint",
        ckpt,
    ]);
    assert!(first.status.success());
    let saved = checkpoint::load(std::path::Path::new(ckpt)).unwrap();
    let same = graphtrain(&["run", "--config", "tiny", "--steps", "3", "--resume", ckpt]);
    assert!(same.status.success());
    assert!(!String::from_utf8_lossy(&same.stdout).contains("fingerprint"));
    let other = graphtrain(&[
        "run", "--config", "tiny", "--steps", "3", "--passes", "none", "--resume", ckpt,
    ]);
    let out = String::from_utf8_lossy(&other.stdout);
    assert!(
        other.status.success()
            && out.contains(&format!("fingerprint {}", saved.header.fingerprint))
            && out.contains("step:  3"),
        "{out}\n{}",
        String::from_utf8_lossy(&other.stderr)
    );
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
