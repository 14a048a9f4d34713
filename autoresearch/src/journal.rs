//! The log a search writes and resumes from, in its directory:
//! - `results.tsv`: one line per experiment (torchtitan's columns, plus the interval, the pair
//!   count and the candidate's fingerprint), written when the experiment ends;
//! - `samples.jsonl`: every experiment's raw step-time pairs;
//! - `lock`: held while a search runs; a second search on the same directory is refused.
//!
//! A search resumes from `results.tsv`: the experiments done, the incumbent (the last kept
//! pipeline), the fingerprints seen. Draws are keyed by (seed, experiment), so the rest of a
//! resumed search is what the uninterrupted one would have done. A line that does not parse is
//! refused with its number; nothing is overwritten.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const HEADER: &str =
    "experiment\tproposer\tstatus\tratio\tlo\thi\tpairs\tfingerprint\tpipeline\tdescription";

/// One experiment's line.
#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub experiment: usize,
    pub proposer: String,
    /// `keep`, `discard`, `unconfirmed`, `duplicate`, `invalid`, `numerics`, `crash`, or `aa`
    /// (the incumbent against itself; `ratio` says what the rule decided in `description`).
    pub status: String,
    pub ratio: f64,
    pub lo: f64,
    pub hi: f64,
    pub pairs: usize,
    pub fingerprint: String,
    pub pipeline: String,
    pub description: String,
}

impl Line {
    fn to_tsv(&self) -> String {
        let clean = |s: &str| s.replace(['\t', '\n'], " ");
        format!(
            "{}\t{}\t{}\t{:.4}\t{:.4}\t{:.4}\t{}\t{}\t{}\t{}",
            self.experiment,
            self.proposer,
            self.status,
            self.ratio,
            self.lo,
            self.hi,
            self.pairs,
            clean(&self.fingerprint),
            clean(&self.pipeline),
            clean(&self.description)
        )
    }

    fn parse(text: &str, number: usize) -> Result<Line, String> {
        let f: Vec<&str> = text.split('\t').collect();
        let bad = |what: &str| format!("results.tsv line {number}: {what}: `{text}`");
        if f.len() != 10 {
            return Err(bad("not 10 tab-separated fields"));
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
            fingerprint: f[7].into(),
            pipeline: f[8].into(),
            description: f[9].into(),
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
        let Ok(text) = std::fs::read_to_string(self.results()) else {
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

    /// Appends an experiment's raw pairs, then its line (the line is the commit: a kill in
    /// between leaves samples of an experiment that will run again, which `samples_of` skips).
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

/// Whether `path` exists as a file (for callers checking a log before opening it).
pub fn exists(path: &Path) -> bool {
    File::open(path).is_ok()
}
