//! Ranks as processes: `mpirun --oversubscribe -np N graphtrain run ... --launcher mpi` against
//! the threads launcher on the same mesh (`tiny`, fixed data, 5 steps): the same losses and
//! every parameter and AdamW tensor of the checkpoint bit for bit, on `dp_shard=2`, `tp=2` and
//! `dp_shard=2,tp=2`. Sharded checkpoints resume across launchers and meshes, and only what
//! their manifest commits counts. A rank stopped with SIGSTOP makes the other stop within the collective
//! timeout, naming the collective and writing its last collectives; ranks started with
//! different configs are refused before step 1. On wgpu, MPI ranks match the threads
//! launcher's wgpu ranks.
//!
//! These need OpenMPI's `mpirun` (scripts/setup.sh installs it) and run as root only with
//! OpenMPI's consent variables, which the tests set.
#![cfg(feature = "mpi")]

use graphtrain::{checkpoint, sharded};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_graphtrain");

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("graphtrain-mpi-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// `mpirun` with OpenMPI's consent to run as root and to put more ranks than cores.
fn mpirun(np: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args(["--oversubscribe", "-np", &np.to_string()])
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1");
    c
}

/// One `mpirun` job at a time: each already puts more ranks than cores on this machine, and
/// one of them measures a timeout.
static ONE_JOB: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_job() -> std::sync::MutexGuard<'static, ()> {
    ONE_JOB.lock().unwrap_or_else(|p| p.into_inner())
}

fn output(mut c: Command) -> Output {
    c.output()
        .unwrap_or_else(|e| panic!("cannot start {c:?}: {e} (scripts/setup.sh installs OpenMPI)"))
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The `step:` lines' losses and gradient norms, as printed.
fn step_lines(out: &str) -> Vec<String> {
    out.lines()
        .filter_map(|l| l.split("step:").nth(1))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            format!("{} {} {}", words[0], words[2], words[4])
        })
        .collect()
}

/// `run` of `tiny` on fixed data for `steps` steps on `mesh`.
fn train_args<'a>(steps: &'a str, mesh: &'a str) -> Vec<&'a str> {
    vec![
        "run", "--config", "tiny", "--data", "fixed", "--steps", steps, "--mesh", mesh,
    ]
}

/// Five steps on `mesh`, checkpointed to `ckpt`.
fn run_args<'a>(mesh: &'a str, ckpt: &'a Path) -> Vec<&'a str> {
    let mut args = train_args("5", mesh);
    args.extend(["--checkpoint", ckpt.to_str().unwrap()]);
    args
}

#[test]
fn mpi_ranks_train_bitwise_as_the_threads_engine() {
    let _job = one_job();
    let dir = scratch("bitwise");
    // The last: every overlap pass on four ranks (async TP ungated: the gate would see shared
    // memory and decline tiny's sites).
    // Mixed precision: FSDP gathers bf16 weights and scatters bf16 gradients, TP gathers bf16
    // activations; MPI moves those in 2 bytes an element, and still the threads' bits.
    // Micro-batches: each rank reads its rows of every micro-batch from the batch.
    let overlap = "ac,bucket,prefetch=nodes:96,async_tp=gate:off";
    let split: &[&str] = &["--batch", "4", "--micro-batches", "2"];
    for (mesh, np, passes, precision, extra) in [
        ("dp_shard=2", 2, "default", "f32", &[][..]),
        ("tp=2", 2, "default", "f32", &[]),
        ("dp_shard=2,tp=2", 4, "default", "f32", &[]),
        ("dp_shard=2,tp=2", 4, overlap, "f32", &[]),
        ("dp_shard=2,tp=2", 4, "default", "bf16-mixed", &[]),
        ("dp_shard=2,tp=2", 4, "default", "f32", split),
    ] {
        let name = format!("{mesh}-{np}-{}-{precision}-{}", passes.len(), extra.len());
        let threads_ckpt = dir.join(format!("{name}-threads.safetensors"));
        let mpi_ckpt = dir.join(format!("{name}-mpi.safetensors"));
        let threads = output({
            let mut c = Command::new(BIN);
            c.args(run_args(mesh, &threads_ckpt)).args([
                "--threads-per-rank",
                "1",
                "--passes",
                passes,
                "--precision",
                precision,
            ]);
            c.args(extra);
            c
        });
        assert!(threads.status.success(), "{}", text(&threads.stderr));
        let mpi = output({
            let mut c = mpirun(np);
            c.arg(BIN).args(run_args(mesh, &mpi_ckpt)).args([
                "--launcher",
                "mpi",
                "--passes",
                passes,
                "--precision",
                precision,
            ]);
            c.args(extra);
            c
        });
        assert!(
            mpi.status.success(),
            "{mesh}: {}\n{}",
            text(&mpi.stdout),
            text(&mpi.stderr)
        );
        let (a, b) = (
            step_lines(&text(&threads.stdout)),
            step_lines(&text(&mpi.stdout)),
        );
        assert_eq!(a.len(), 5, "{mesh}: {}", text(&threads.stdout));
        // Rank 0 alone prints: five lines, not five per rank.
        assert_eq!(
            a, b,
            "{mesh} {passes} {precision} {extra:?}: the step lines differ"
        );
        // The MPI run's checkpoint is sharded (a directory of rank files and a manifest);
        // assembled, it is the threads run's, bit for bit.
        assert!(mpi_ckpt.join("manifest.json").is_file(), "{mesh} {passes}");
        let (ta, tb) = (
            checkpoint::load(&threads_ckpt).unwrap(),
            sharded::load(&mpi_ckpt).unwrap(),
        );
        assert_eq!(ta.header.tensors, tb.header.tensors, "{mesh}");
        for ((entry, x), y) in ta.header.tensors.iter().zip(&ta.tensors).zip(&tb.tensors) {
            let bits = |t: &graphtrain::ir::HostTensor| {
                t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            assert!(
                bits(x) == bits(y),
                "{mesh} {passes}: `{}` differs",
                entry.name
            );
        }
    }
}

/// On wgpu each MPI rank stages its collectives through host memory: the same step lines as
/// the threads launcher's wgpu ranks.
#[test]
fn mpi_ranks_on_wgpu_train_as_the_threads_engine_on_wgpu() {
    if graphtrain::gate::device_backends_for_tests().is_empty() {
        return; // `backends::the_wgpu_halves_run_here` reports why wgpu is not run
    }
    let _job = one_job();
    let mut args = train_args("3", "dp_shard=2");
    args.extend(["--backend", "wgpu"]);
    let threads = output({
        let mut c = Command::new(BIN);
        c.args(&args);
        c
    });
    assert!(threads.status.success(), "{}", text(&threads.stderr));
    let mpi = output({
        let mut c = mpirun(2);
        c.arg(BIN).args(&args).args(["--launcher", "mpi"]);
        c
    });
    assert!(mpi.status.success(), "{}", text(&mpi.stderr));
    let (a, b) = (
        step_lines(&text(&threads.stdout)),
        step_lines(&text(&mpi.stdout)),
    );
    assert_eq!(a.len(), 3, "{}", text(&threads.stdout));
    assert_eq!(a, b, "wgpu dp_shard=2: the step lines differ");
}

#[test]
fn ranks_built_differently_are_refused_before_step_one() {
    let _job = one_job();
    let dir = scratch("agree");
    let ckpt = dir.join("c.safetensors");
    let mut c = mpirun(1);
    c.arg(BIN)
        .args(run_args("dp_shard=2", &ckpt))
        .args(["--launcher", "mpi", "--lr", "0.001"])
        .args([":", "-np", "1", BIN])
        .args(run_args("dp_shard=2", &ckpt))
        .args(["--launcher", "mpi", "--lr", "0.002"]);
    let o = output(c);
    assert!(!o.status.success(), "{}", text(&o.stdout));
    let err = text(&o.stderr);
    assert!(
        err.contains("rank(s) [1] built another train step than rank 0")
            && err.contains("stopping before step 1"),
        "{err}"
    );
    assert!(!text(&o.stdout).contains("step:"), "{}", text(&o.stdout));
    assert!(!ckpt.exists(), "nothing is written");
}

/// The pids of the job's `graphtrain` processes, by MPI rank.
fn rank_pids() -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmd) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if !text(&cmd).starts_with(BIN) {
            continue;
        }
        let Ok(env) = std::fs::read(entry.path().join("environ")) else {
            continue;
        };
        let rank = text(&env)
            .split('\0')
            .find_map(|v| v.strip_prefix("OMPI_COMM_WORLD_RANK="))
            .and_then(|r| r.parse().ok());
        if let Some(rank) = rank {
            out.push((rank, pid));
        }
    }
    out
}

#[test]
fn a_stopped_rank_stops_the_other_within_the_timeout_naming_the_collective() {
    let _job = one_job();
    let dir = scratch("stuck");
    let mut c = mpirun(2);
    c.arg(BIN)
        .args(train_args("1000000", "dp_shard=2"))
        .args(["--launcher", "mpi"])
        .env("GRAPHTRAIN_COLLECTIVE_TIMEOUT_S", "3")
        .env("GRAPHTRAIN_FLIGHT_DIR", &dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let job = c.spawn().expect("mpirun starts");
    // Wait until both ranks run, then stop rank 1 mid-training.
    let t = Instant::now();
    let victim = loop {
        let pids = rank_pids();
        if let Some(&(_, pid)) = pids.iter().find(|(r, _)| *r == 1) {
            if pids.len() == 2 {
                std::thread::sleep(Duration::from_secs(2));
                break pid;
            }
        }
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "the ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    let stopped = Command::new("kill")
        .args(["-STOP", &victim.to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    let stopped_at = Instant::now();
    let out = job.wait_with_output().unwrap();
    let waited = stopped_at.elapsed();
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        waited < Duration::from_secs(30),
        "the job took {waited:?} to end"
    );
    assert!(
        err.contains("error: rank 0:")
            && err.contains("did not finish within 3 s")
            && err.contains("collective #"),
        "{err}"
    );
    let record = std::fs::read_to_string(dir.join("graphtrain-rank0-collectives.txt"))
        .unwrap_or_else(|e| panic!("no flight record: {e}\n{err}"));
    assert!(
        record.lines().last().unwrap().ends_with("not finished"),
        "{record}"
    );
}

/// Checkpoints hold whole tensors, so they move between launchers and meshes: one device's
/// after 3 steps resumes on 2 MPI ranks (`dp_shard=2`), and that run's after 5 resumes on 4
/// threads (`dp_shard=2,tp=2`); every step line matches the uninterrupted one-device run.
#[test]
fn checkpoints_resume_across_launchers_and_meshes() {
    let _job = one_job();
    let dir = scratch("resume");
    let one = dir.join("one.safetensors");
    let base = |steps: &'static str| {
        vec![
            "run", "--config", "tiny", "--data", "fixed", "--steps", steps,
        ]
    };
    let whole = output({
        let mut c = Command::new(BIN);
        c.args(base("7"));
        c
    });
    assert!(whole.status.success(), "{}", text(&whole.stderr));
    let want = step_lines(&text(&whole.stdout));
    assert_eq!(want.len(), 7);
    let first = output({
        let mut c = Command::new(BIN);
        c.args(base("3"))
            .args(["--checkpoint", one.to_str().unwrap()]);
        c
    });
    assert!(first.status.success(), "{}", text(&first.stderr));
    let mpi_ckpt = dir.join("mpi.safetensors");
    let second = output({
        let mut c = mpirun(2);
        c.arg(BIN).args(base("5")).args([
            "--mesh",
            "dp_shard=2",
            "--launcher",
            "mpi",
            "--resume",
            one.to_str().unwrap(),
            "--checkpoint",
            mpi_ckpt.to_str().unwrap(),
        ]);
        c
    });
    assert!(second.status.success(), "{}", text(&second.stderr));
    let third = output({
        let mut c = Command::new(BIN);
        c.args(base("7")).args([
            "--mesh",
            "dp_shard=2,tp=2",
            "--resume",
            mpi_ckpt.to_str().unwrap(),
        ]);
        c
    });
    assert!(third.status.success(), "{}", text(&third.stderr));
    let got: Vec<String> = [&first, &second, &third]
        .iter()
        .flat_map(|o| step_lines(&text(&o.stdout)))
        .collect();
    assert_eq!(got, want, "resumed across launchers and meshes");
}

/// A sharded checkpoint is what its manifest commits: rank files of a later save that never got
/// its manifest (a crash mid-save) change nothing, and rank files without any manifest, or a
/// damaged rank file, are refused, naming why.
#[test]
fn only_what_the_manifest_commits_is_a_sharded_checkpoint() {
    let _job = one_job();
    let dir = scratch("commit");
    let ckpt = dir.join("ckpt");
    let job = output({
        let mut c = mpirun(2);
        c.arg(BIN)
            .args(train_args("2", "dp_shard=2"))
            .args(["--launcher", "mpi", "--checkpoint"])
            .arg(&ckpt);
        c
    });
    assert!(job.status.success(), "{}", text(&job.stderr));
    let committed = sharded::load(&ckpt).unwrap();
    assert_eq!(committed.header.steps_done, 2);
    // A later save that died after rank 0 wrote its file: no manifest names it.
    let partial = ckpt.join(sharded::folder(3));
    std::fs::create_dir_all(&partial).unwrap();
    std::fs::copy(
        ckpt.join(sharded::folder(2)).join("rank-0.safetensors"),
        partial.join("rank-0.safetensors"),
    )
    .unwrap();
    assert_eq!(sharded::load(&ckpt).unwrap(), committed);
    // A damaged rank file is refused by its checksums.
    let rank1 = ckpt.join(sharded::folder(2)).join("rank-1.safetensors");
    let mut bytes = std::fs::read(&rank1).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&rank1, &bytes).unwrap();
    let e = sharded::load(&ckpt).unwrap_err();
    assert!(e.contains("rank-1.safetensors"), "{e}");
    // Rank files without a manifest are not a checkpoint.
    std::fs::remove_file(ckpt.join("manifest.json")).unwrap();
    let e = sharded::load(&ckpt).unwrap_err();
    assert!(
        e.contains("without their manifest are not a checkpoint"),
        "{e}"
    );
}

/// The step a sharded checkpoint's manifest commits, if there is one.
fn committed_step(ckpt: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(ckpt.join("manifest.json")).ok()?;
    let manifest: serde_json::Value = serde_json::from_str(&text).ok()?;
    manifest["steps_done"].as_u64()
}

/// SIGKILL one of two ranks while a save is under way: rank 1 is stopped as soon as a later
/// step's folder appears and, if the manifest still names the earlier save, killed (else let go
/// and caught at the next save). OpenMPI ends the job; the manifest still commits the earlier
/// save whole, the later folder is left uncommitted and never read, and the run resumes.
#[test]
fn a_rank_killed_mid_save_leaves_the_last_committed_checkpoint() {
    let _job = one_job();
    let dir = scratch("killed");
    let ckpt = dir.join("ckpt");
    let mut c = mpirun(2);
    c.arg(BIN)
        .args(train_args("1000000", "dp_shard=2"))
        .args([
            "--launcher",
            "mpi",
            "--checkpoint-every",
            "1",
            "--checkpoint",
        ])
        .arg(&ckpt)
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut job = c.spawn().expect("mpirun starts");
    let signal = |sig: &str, pid: u32| {
        let sent = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .unwrap();
        assert!(sent.success(), "kill {sig} {pid}");
    };
    let t = Instant::now();
    let committed = loop {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no save was caught under way"
        );
        std::thread::sleep(Duration::from_millis(1));
        let Some(step) = committed_step(&ckpt) else {
            continue;
        };
        if step < 2 || !ckpt.join(sharded::folder(step + 1)).exists() {
            continue;
        }
        // The next save has begun. Stop rank 1; if the save did not commit before it stopped,
        // it cannot commit now (the commit needs every rank's word): kill rank 1 mid-save.
        let pids = rank_pids();
        let &(_, pid) = pids.iter().find(|(r, _)| *r == 1).expect("rank 1 runs");
        signal("-STOP", pid);
        std::thread::sleep(Duration::from_millis(200));
        if committed_step(&ckpt) == Some(step) {
            signal("-KILL", pid);
            break step;
        }
        signal("-CONT", pid);
    };
    let status = job.wait().unwrap();
    assert!(!status.success(), "the job went on after rank 1 died");
    let after = sharded::load(&ckpt).unwrap_or_else(|e| panic!("no checkpoint left: {e}"));
    assert_eq!(
        after.header.steps_done, committed,
        "the committed save changed"
    );
    assert!(
        ckpt.join(sharded::folder(committed + 1)).exists(),
        "the save under way left its folder, uncommitted"
    );
    let on = format!("{}", committed + 1);
    let resumed = output({
        let mut c = Command::new(BIN);
        c.args([
            "run", "--config", "tiny", "--data", "fixed", "--steps", &on, "--resume",
        ])
        .arg(&ckpt);
        c
    });
    assert!(resumed.status.success(), "{}", text(&resumed.stderr));
    assert_eq!(step_lines(&text(&resumed.stdout)).len(), 1);
}

/// Resharding on load: a sharded checkpoint of four MPI ranks (`dp_shard=2,tp=2`) resumes on
/// one rank and on four FSDP ranks (`dp_shard=4`), each continuing as the uninterrupted
/// one-device run does (the step lines, to their printed digits).
#[test]
fn a_four_rank_checkpoint_resumes_on_one_rank_and_on_dp_shard_4() {
    let _job = one_job();
    let dir = scratch("reshard");
    // tiny with 4 rows, so that dp_shard=4 has one each.
    let config = dir.join("tiny4.ron");
    let shown = output({
        let mut c = Command::new(BIN);
        c.args(["config", "show", "tiny"]);
        c
    });
    let body = text(&shown.stdout).replace("batch: 2,", "batch: 4,");
    assert!(body.contains("batch: 4,"), "{body}");
    std::fs::write(&config, body).unwrap();
    let base = |steps: &'static str| -> Vec<String> {
        [
            "run",
            "--config",
            config.to_str().unwrap(),
            "--data",
            "fixed",
            "--steps",
            steps,
        ]
        .map(String::from)
        .to_vec()
    };
    let whole = output({
        let mut c = Command::new(BIN);
        c.args(base("7"));
        c
    });
    assert!(whole.status.success(), "{}", text(&whole.stderr));
    let want = step_lines(&text(&whole.stdout));
    let ckpt = dir.join("ckpt");
    let four = output({
        let mut c = mpirun(4);
        c.arg(BIN).args(base("4")).args([
            "--mesh",
            "dp_shard=2,tp=2",
            "--launcher",
            "mpi",
            "--checkpoint",
            ckpt.to_str().unwrap(),
        ]);
        c
    });
    assert!(four.status.success(), "{}", text(&four.stderr));
    assert_eq!(step_lines(&text(&four.stdout)), want[..4]);
    for mesh in [None, Some("dp_shard=4")] {
        let resumed = output({
            let mut c = Command::new(BIN);
            c.args(base("7")).args(["--resume", ckpt.to_str().unwrap()]);
            if let Some(mesh) = mesh {
                c.args(["--mesh", mesh]);
            }
            c
        });
        assert!(
            resumed.status.success(),
            "{mesh:?}: {}",
            text(&resumed.stderr)
        );
        assert_eq!(
            step_lines(&text(&resumed.stdout)),
            want[4..],
            "resumed on {mesh:?}"
        );
    }
}

/// `--trace-out` under MPI: each process writes its own rank's timeline to the file a threads
/// run gives that rank (`FILE.rankN.json`), with the same Program steps.
#[test]
fn each_mpi_rank_writes_its_own_timeline() {
    let _job = one_job();
    let dir = scratch("mpi-trace");
    let base = dir.join("t.json");
    let mut args = train_args("2", "dp_shard=2");
    args.extend(["--trace-out", base.to_str().unwrap()]);
    let mpi = output({
        let mut c = mpirun(2);
        c.arg(BIN).args(&args).args(["--launcher", "mpi"]);
        c
    });
    assert!(mpi.status.success(), "{}", text(&mpi.stderr));
    let mut events = Vec::new();
    for rank in 0..2 {
        let path = dir.join(format!("t.rank{rank}.json"));
        let trace = graphtrain::timeline::read_trace(&path)
            .unwrap_or_else(|e| panic!("rank {rank}'s timeline: {e}"));
        assert!(!trace.events.is_empty(), "rank {rank}: no events");
        assert!(
            trace.events.iter().all(|e| e.pid == rank as u64),
            "rank {rank}'s file holds another rank's events"
        );
        events.push(trace.events.len());
    }
    assert!(!base.exists(), "an MPI rank wrote the one-rank file name");
    assert_eq!(events[0], events[1], "the ranks run the same Program");
}

/// Validation and sampling under MPI: every rank gathers the weights (a collective) and runs
/// the same forward pass; rank 0 prints what the threads launcher prints, digit for digit.
#[test]
fn mpi_ranks_validate_and_sample_as_the_threads_engine() {
    let _job = one_job();
    let dir = scratch("mpi-text");
    let corpus = dir.join("corpus.txt");
    let words = [
        "the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far",
    ];
    let body: Vec<&str> = (0..20_000)
        .map(|i| words[(i * 7 + i / 3) % words.len()])
        .collect();
    std::fs::write(&corpus, body.join(" ")).unwrap();
    let shown = output({
        let mut c = Command::new(BIN);
        c.args(["config", "show", "tiny"]);
        c
    });
    let config = dir.join("tiny320.ron");
    std::fs::write(
        &config,
        text(&shown.stdout).replace("vocab_size: 64", "vocab_size: 320"),
    )
    .unwrap();
    let cache = dir.join("cache");
    let args = [
        "run",
        "--config",
        config.to_str().unwrap(),
        "--data",
        corpus.to_str().unwrap(),
        "--vocab-size",
        "300",
        "--data-cache",
        cache.to_str().unwrap(),
        "--steps",
        "2",
        "--val-every",
        "1",
        "--val-batches",
        "2",
        "--sample-tokens",
        "8",
        "--mesh",
        "dp_shard=2",
    ];
    let printed = |out: &Output| -> Vec<String> {
        text(&out.stdout)
            .lines()
            .skip_while(|l| !l.starts_with("val:"))
            .filter(|l| l.starts_with("val:") || !l.starts_with("step:"))
            .map(str::to_string)
            .collect()
    };
    let threads = output({
        let mut c = Command::new(BIN);
        c.args(args);
        c
    });
    assert!(threads.status.success(), "{}", text(&threads.stderr));
    let mpi = output({
        let mut c = mpirun(2);
        c.arg(BIN).args(args).args(["--launcher", "mpi"]);
        c
    });
    assert!(mpi.status.success(), "{}", text(&mpi.stderr));
    let want = printed(&threads);
    assert_eq!(
        want.iter().filter(|l| l.starts_with("val:")).count(),
        2,
        "{want:?}"
    );
    assert!(
        want.iter().any(|l| l.starts_with("sample (8 tokens")),
        "{want:?}"
    );
    assert_eq!(printed(&mpi), want);
}

/// Replay dumps under MPI: the ranks gather the initial weights together and rank 0 writes
/// them and every step's whole batch (each rank read only its block), byte for byte the files a
/// threads run writes.
#[test]
fn mpi_ranks_write_the_replay_files_of_the_threads_engine() {
    let _job = one_job();
    let dir = scratch("mpi-replay");
    let files = |who: &str| {
        (
            dir.join(format!("{who}.safetensors")),
            dir.join(format!("{who}.bin")),
        )
    };
    let run = |who: &str, mpi: bool| {
        let (init, batches) = files(who);
        let mut c = if mpi { mpirun(4) } else { Command::new(BIN) };
        if mpi {
            c.arg(BIN);
        }
        c.args(train_args("3", "dp_shard=2,tp=2")).args([
            "--init-out",
            init.to_str().unwrap(),
            "--dump-batches",
            batches.to_str().unwrap(),
        ]);
        if mpi {
            c.args(["--launcher", "mpi"]);
        }
        let out = output(c);
        assert!(out.status.success(), "{who}: {}", text(&out.stderr));
    };
    run("threads", false);
    run("mpi", true);
    for (a, b) in [
        (files("threads").0, files("mpi").0),
        (files("threads").1, files("mpi").1),
    ] {
        let (a_bytes, b_bytes) = (std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
        assert!(!a_bytes.is_empty());
        assert!(
            a_bytes == b_bytes,
            "{} differs from {}",
            b.display(),
            a.display()
        );
    }
}

/// `--init` under `mpirun`: each rank cuts its part of another seed's initial weights, and the
/// job trains bit for bit as the threads engine does from the same file (and not as from its
/// own seed's).
#[test]
fn mpi_ranks_start_from_an_init_file_as_the_threads_engine() {
    let _job = one_job();
    let init = scratch("init").join("seed7.safetensors");
    let mut c = Command::new(BIN);
    c.args([
        "run",
        "--config",
        "tiny",
        "--seed",
        "7",
        "--steps",
        "1",
        "--init-out",
    ])
    .arg(&init);
    let out = output(c);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let run = |mpi: bool, with_init: bool| {
        let mut c = if mpi { mpirun(4) } else { Command::new(BIN) };
        if mpi {
            c.arg(BIN);
        }
        c.args(train_args("3", "dp_shard=2,tp=2"));
        if mpi {
            c.args(["--launcher", "mpi"]);
        }
        if with_init {
            c.arg("--init").arg(&init);
        }
        let out = output(c);
        assert!(out.status.success(), "{}", text(&out.stderr));
        step_lines(&text(&out.stdout))
    };
    let threads = run(false, true);
    assert_eq!(threads.len(), 3);
    assert_eq!(run(true, true), threads, "MPI ranks from the init file");
    assert_ne!(run(false, false), threads, "the seed's own weights");
}

/// A plan `autoshard` chose (squeezed under a memory limit, so it splits weights) runs under
/// `mpirun` bit for bit as on threads, like any plan.
#[test]
fn an_autoshard_plan_trains_under_mpi_as_on_threads() {
    let _job = one_job();
    let dir = scratch("autoshard");
    let plan = dir.join("plan.ron");
    let mesh = "dp_shard=2,tp=2";
    let solved = output({
        let mut c = Command::new(BIN);
        c.args([
            "autoshard",
            "--config",
            "tiny",
            "--mesh",
            mesh,
            "--hardware",
            "h100-sxm",
            "--memory-limit",
            "200KiB",
            "--out",
            plan.to_str().unwrap(),
        ]);
        c
    });
    assert!(solved.status.success(), "{}", text(&solved.stderr));
    let plan_text = std::fs::read_to_string(&plan).unwrap();
    assert!(plan_text.contains("Shard"), "{plan_text}");
    let mut args = train_args("5", mesh);
    args.extend(["--plan", plan.to_str().unwrap()]);
    let threads = output({
        let mut c = Command::new(BIN);
        c.args(&args);
        c
    });
    assert!(threads.status.success(), "{}", text(&threads.stderr));
    let mpi = output({
        let mut c = mpirun(4);
        c.arg(BIN).args(&args).args(["--launcher", "mpi"]);
        c
    });
    assert!(
        mpi.status.success(),
        "{}\n{}",
        text(&mpi.stdout),
        text(&mpi.stderr)
    );
    let (a, b) = (
        step_lines(&text(&threads.stdout)),
        step_lines(&text(&mpi.stdout)),
    );
    assert_eq!(a.len(), 5, "{}", text(&threads.stdout));
    assert_eq!(
        a, b,
        "the autoshard plan's step lines differ between threads and MPI"
    );
}
