//! The log a search writes and resumes from, in its directory:
//! - `results.tsv`: one line per experiment (torchtitan's columns, plus the interval, the pair
//!   count and the candidate's fingerprint), written when the experiment ends;
//! - `samples.jsonl`: every experiment's raw step-time pairs;
//! - `lock`: held while a search runs; a second search on the same directory is refused (a lock
//!   whose process is gone, left by a killed search, is taken over).
//!
//! A search resumes from `results.tsv`: the experiments done, the incumbent (the last kept
//! pipeline), the fingerprints seen. Draws are keyed by (seed, experiment), so the rest of a
//! resumed search is what the uninterrupted one would have done. A line that does not parse is
//! refused with its number; nothing is overwritten.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

pub const HEADER: &str = "experiment\tproposer\tstatus\tratio\tlo\thi\tpairs\tpeak_bytes\tfingerprint\tpipeline\tdescription";

const FIELDS: usize = 11;

/// One experiment's line.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub experiment: usize,
    pub proposer: String,
    /// `keep`, `discard`, `unconfirmed`, `duplicate`, `invalid`, `numerics`, `over-cap`
    /// (predicted peak above `--memory-cap`), `filtered` (predicted slower, not timed), `crash`,
    /// or `aa` (the incumbent against itself; `description` says what the rule decided).
    pub status: String,
    pub ratio: f64,
    pub lo: f64,
    pub hi: f64,
    pub pairs: usize,
    /// The planner's predicted peak of the candidate's step (0: not predicted).
    pub peak_bytes: u64,
    pub fingerprint: String,
    pub pipeline: String,
    pub description: String,
}

impl Line {
    fn to_tsv(&self) -> String {
        let clean = |s: &str| s.replace(['\t', '\n'], " ");
        format!(
            "{}\t{}\t{}\t{:.4}\t{:.4}\t{:.4}\t{}\t{}\t{}\t{}\t{}",
            self.experiment,
            self.proposer,
            self.status,
            self.ratio,
            self.lo,
            self.hi,
            self.pairs,
            self.peak_bytes,
            clean(&self.fingerprint),
            clean(&self.pipeline),
            clean(&self.description)
        )
    }

    fn parse(text: &str, number: usize) -> Result<Line, String> {
        let f: Vec<&str> = text.split('\t').collect();
        let bad = |what: &str| format!("results.tsv line {number}: {what}: `{text}`");
        if f.len() != FIELDS {
            return Err(bad(&format!("not {FIELDS} tab-separated fields")));
        }
        let num = |s: &str| s.parse::<f64>().map_err(|_| bad("a ratio is not a number"));
        Ok(Line {
            experiment: f[0]
                .parse()
                .map_err(|_| bad("the experiment is not a number"))?,
            proposer: f[1].into(),
            status: f[2].into(),
            ratio: num(f[3])?,
            lo: num(f[4])?,
            hi: num(f[5])?,
            pairs: f[6]
                .parse()
                .map_err(|_| bad("the pair count is not a number"))?,
            peak_bytes: f[7]
                .parse()
                .map_err(|_| bad("the peak is not a number of bytes"))?,
            fingerprint: f[8].into(),
            pipeline: f[9].into(),
            description: f[10].into(),
        })
    }
}

/// A search's directory, locked while this value lives.
pub struct Journal {
    dir: PathBuf,
    pub lines: Vec<Line>,
}

impl Journal {
    /// Opens (or starts) the log in `dir` and takes its lock; reads what is there.
    pub fn open(dir: &Path) -> Result<Journal, String> {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
        let lock = dir.join("lock");
        let holder = std::fs::read_to_string(&lock).unwrap_or_default();
        if stale(holder.trim()) {
            // A search that was killed leaves its lock behind: its process is gone.
            let _ = std::fs::remove_file(&lock);
        }
        match OpenOptions::new().write(true).create_new(true).open(&lock) {
            Ok(mut f) => {
                let _ = writeln!(f, "{}", std::process::id());
            }
            Err(_) => {
                let holder = std::fs::read_to_string(&lock).unwrap_or_default();
                return Err(format!(
                    "another search holds `{}` (pid {}); remove the file if no search runs there",
                    lock.display(),
                    holder.trim()
                ));
            }
        }
        let mut journal = Journal {
            dir: dir.to_path_buf(),
            lines: Vec::new(),
        };
        // On error the journal drops here, releasing the lock.
        journal.lines = journal.read()?;
        Ok(journal)
    }

    fn results(&self) -> PathBuf {
        self.dir.join("results.tsv")
    }

    fn read(&self) -> Result<Vec<Line>, String> {
        read(&self.dir)
    }

    /// Appends an experiment's raw pairs, then its line (the line is the commit: a kill in
    /// between leaves samples of an experiment that will run again: of an experiment's entries in
    /// samples.jsonl, the last is the one its line counts).
    pub fn append(&mut self, line: Line, pairs: &[(f64, f64)]) -> Result<(), String> {
        let write = |path: PathBuf, text: String| -> Result<(), String> {
            let mut f = OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
                .map_err(|e| format!("cannot open `{}`: {e}", path.display()))?;
            f.write_all(text.as_bytes())
                .and_then(|_| f.sync_data())
                .map_err(|e| format!("cannot write `{}`: {e}", path.display()))
        };
        let samples = serde_json::json!({"experiment": line.experiment, "pairs": pairs});
        write(self.dir.join("samples.jsonl"), format!("{samples}\n"))?;
        let header = if self.results().exists() {
            String::new()
        } else {
            format!("{HEADER}\n")
        };
        write(self.results(), format!("{header}{}\n", line.to_tsv()))?;
        self.lines.push(line);
        Ok(())
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.dir.join("lock"));
    }
}

/// Whether the lock's holder `pid` is known to be gone (Linux: no `/proc/PID`). Anywhere else,
/// or for a lock that names no pid, the lock stands.
fn stale(pid: &str) -> bool {
    let Ok(pid) = pid.parse::<u32>() else {
        return false;
    };
    Path::new("/proc/self").exists()
        && pid != std::process::id()
        && !Path::new(&format!("/proc/{pid}")).exists()
}

/// The experiments logged in `dir` (without taking its lock: for reading a search that may
/// still run). A line that does not parse is refused with its number.
pub fn read(dir: &Path) -> Result<Vec<Line>, String> {
    let Ok(text) = std::fs::read_to_string(dir.join("results.tsv")) else {
        return Ok(Vec::new());
    };
    let mut lines = Vec::new();
    for (i, l) in text.lines().enumerate() {
        if i == 0 {
            if l != HEADER {
                return Err(format!("results.tsv line 1: not this log's header: `{l}`"));
            }
            continue;
        }
        let line = Line::parse(l, i + 1)?;
        if line.experiment != lines.len() {
            return Err(format!(
                "results.tsv line {}: experiment {} where {} was due",
                i + 1,
                line.experiment,
                lines.len()
            ));
        }
        lines.push(line);
    }
    Ok(lines)
}
