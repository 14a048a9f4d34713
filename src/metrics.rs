//! The metrics log of a run (`graphtrain run --metrics FILE.jsonl`): one JSON object per line,
//! written and flushed as each step (or validation) finishes, so a crash loses nothing already
//! reported. `graphtrain plot` reads it back.
//!
//! # Schema `graphtrain.metrics/1`
//!
//! Every line is one object with a `kind`:
//!
//! - `"header"` (the first line, and again where a `--resume`d run appends):
//!   `{"kind":"header","schema":"graphtrain.metrics/1","resumed_after":null|N,"config":{...}}`.
//!   `config` is the run's settings (model, config, backend, data, seed, lr, optimizer, passes,
//!   the model configuration); readers must not depend on its fields.
//! - `"step"`: `{"kind":"step","step":N,"loss":X,"grad_norm":X,"tokens":N,"seconds":X,
//!   "tokens_per_s":X,"tflops":X,"mfu":X|null,"memory_bytes":N,"lr":X,"wall_s":X}`.
//!   `step` is 1-based; `seconds` is the step's own time, `wall_s` the time since this process
//!   started the run (it restarts at a resume header); `tflops` is the achieved TFLOP/s by
//!   6(N - N_emb) + 12·L·D·T FLOPs per token; `mfu` is a fraction (0.12 = 12%), `null` where the
//!   backend has no known peak; `memory_bytes` the executor's peak of live tensor bytes (on a
//!   mesh, the largest rank's); `lr` the learning rate of the step's update (its schedule's
//!   value at that step). A run on a mesh adds `"wait_s":[X,...]`: per rank, the seconds
//!   the step spent blocked in collective waits (for other ranks, or for the collective to
//!   finish).
//! - `"val"`: `{"kind":"val","step":N,"val_loss":X,"val_ppl":X}`: a validation after step N.
//!
//! A resumed run appends after the steps already there; steps past the checkpoint may then
//! appear twice, and readers keep the last record of a step. New fields may be added to a
//! record without a new schema version; a field's meaning never changes within one.
//!
//! Refused: appending to a file whose first line is not a header of this schema (it is not
//! this run's log), and non-finite numbers (JSON has none; the trainer stops at a non-finite
//! loss before anything is written).

use crate::trainer::StepMetrics;
use serde::{Deserialize, Serialize};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// The schema name in every header line.
pub const SCHEMA: &str = "graphtrain.metrics/1";

/// One line of the log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    Header(Header),
    Step(StepRecord),
    Val(ValRecord),
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub schema: String,
    /// The step the run resumed after, on a header a resumed run appended.
    pub resumed_after: Option<u64>,
    pub config: serde_json::Value,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct StepRecord {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
    pub tflops: f64,
    pub mfu: Option<f64>,
    pub memory_bytes: usize,
    pub lr: f64,
    pub wall_s: f64,
    /// On a mesh: per rank, seconds blocked in collective waits (for other ranks, or for the
    /// collective to finish).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wait_s: Vec<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValRecord {
    pub step: u64,
    pub val_loss: f64,
    pub val_ppl: f64,
}

/// What a step's line needs beyond the trainer's `StepMetrics`: the rates the CLI derives.
#[derive(Clone, Copy, Debug)]
pub struct StepRates {
    /// Achieved TFLOP/s.
    pub tflops: f64,
    /// Fraction of the peak, when one is known.
    pub mfu: Option<f64>,
}

/// Writes the log, one flushed line per record.
pub struct MetricsWriter {
    path: PathBuf,
    file: File,
    started: Instant,
}

impl MetricsWriter {
    /// Starts a new log at `path` (replacing any file there) with a header holding `config`.
    /// `started` is when the run began: `wall_s` counts from it.
    pub fn create(
        path: &Path,
        config: serde_json::Value,
        started: Instant,
    ) -> Result<Self, String> {
        let file = File::create(path).map_err(|e| cannot("create", path, e))?;
        let mut w = MetricsWriter {
            path: path.to_path_buf(),
            file,
            started,
        };
        w.header(config, None)?;
        Ok(w)
    }

    /// Continues the log at `path` for a run resumed after step `resumed_after`: a header is
    /// appended, then the new steps. A missing file is started fresh; a file that is not a log
    /// of this schema is refused rather than mixed into.
    pub fn append(
        path: &Path,
        config: serde_json::Value,
        resumed_after: u64,
        started: Instant,
    ) -> Result<Self, String> {
        if path.exists() {
            check_first_line(path)?;
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|e| cannot("open", path, e))?;
        let mut w = MetricsWriter {
            path: path.to_path_buf(),
            file,
            started,
        };
        w.header(config, Some(resumed_after))?;
        Ok(w)
    }

    fn header(
        &mut self,
        config: serde_json::Value,
        resumed_after: Option<u64>,
    ) -> Result<(), String> {
        self.write(&Record::Header(Header {
            schema: SCHEMA.to_string(),
            resumed_after,
            config,
        }))
    }

    /// Appends the line of one finished step.
    pub fn step(&mut self, m: &StepMetrics, rates: &StepRates) -> Result<(), String> {
        self.write(&Record::Step(StepRecord {
            step: m.step,
            loss: m.loss,
            grad_norm: m.grad_norm,
            tokens: m.tokens,
            seconds: m.seconds,
            tokens_per_s: m.tokens as f64 / m.seconds,
            tflops: rates.tflops,
            mfu: rates.mfu,
            memory_bytes: m.peak_bytes,
            lr: m.lr,
            wall_s: self.started.elapsed().as_secs_f64(),
            wait_s: m.wait_seconds.clone(),
        }))
    }

    /// Appends the line of a validation after `step` (`val_ppl` is `exp(loss)`).
    pub fn validation(&mut self, step: u64, loss: f64) -> Result<(), String> {
        self.write(&Record::Val(ValRecord {
            step,
            val_loss: loss,
            val_ppl: loss.exp(),
        }))
    }

    /// One record, one `write` of a whole line, then flushed: a reader never sees half a line
    /// of a step that finished.
    fn write(&mut self, record: &Record) -> Result<(), String> {
        let mut line = serde_json::to_string(record).map_err(|e| {
            format!(
                "{}: cannot encode a metrics record: {e}",
                self.path.display()
            )
        })?;
        line.push('\n');
        self.file
            .write_all(line.as_bytes())
            .and_then(|()| self.file.flush())
            .map_err(|e| cannot("write", &self.path, e))
    }
}

fn cannot(what: &str, path: &Path, e: std::io::Error) -> String {
    format!("cannot {what} `{}`: {e}", path.display())
}

/// Refuses to append to anything but a log of this schema.
fn check_first_line(path: &Path) -> Result<(), String> {
    let file = File::open(path).map_err(|e| cannot("read", path, e))?;
    let mut first = String::new();
    BufReader::new(file)
        .read_line(&mut first)
        .map_err(|e| cannot("read", path, e))?;
    if first.trim().is_empty() {
        // An empty file (a run that died before its header) holds nothing to keep apart.
        return Ok(());
    }
    parse_header(path, 1, &first).map(|_| ())
}

fn parse_header(path: &Path, line_no: usize, line: &str) -> Result<Header, String> {
    match parse_record(path, line_no, line)? {
        Record::Header(h) if h.schema == SCHEMA => Ok(h),
        Record::Header(h) => Err(format!(
            "{}:{line_no}: schema `{}`, this graphtrain reads `{SCHEMA}`",
            path.display(),
            h.schema
        )),
        _ => Err(format!(
            "{}:{line_no}: the first line must be a `header` record with schema `{SCHEMA}`",
            path.display()
        )),
    }
}

fn parse_record(path: &Path, line_no: usize, line: &str) -> Result<Record, String> {
    serde_json::from_str(line).map_err(|e| {
        format!(
            "{}:{line_no}: not a `{SCHEMA}` record ({e})",
            path.display()
        )
    })
}

/// A log read back: its first header, steps (the last record of each step, in step order) and
/// validations (likewise).
#[derive(Clone, Debug, PartialEq)]
pub struct MetricsLog {
    pub header: Header,
    pub steps: Vec<StepRecord>,
    pub vals: Vec<ValRecord>,
}

/// Reads a log. Errors name the file and line: an empty file, a line that is not JSON or not
/// a record, a first line that is not a header of this schema, a later header of another.
pub fn read(path: &Path) -> Result<MetricsLog, String> {
    let file = File::open(path).map_err(|e| cannot("read", path, e))?;
    let mut header = None;
    let mut steps = std::collections::BTreeMap::new();
    let mut vals = std::collections::BTreeMap::new();
    for (i, line) in BufReader::new(file).lines().enumerate() {
        let line_no = i + 1;
        let line = line.map_err(|e| format!("{}:{line_no}: cannot read: {e}", path.display()))?;
        if line.trim().is_empty() {
            continue;
        }
        if header.is_none() {
            header = Some(parse_header(path, line_no, &line)?);
            continue;
        }
        match parse_record(path, line_no, &line)? {
            Record::Header(_) => {
                parse_header(path, line_no, &line)?;
            }
            Record::Step(s) => {
                steps.insert(s.step, s);
            }
            Record::Val(v) => {
                vals.insert(v.step, v);
            }
        }
    }
    let header = header.ok_or_else(|| {
        format!(
            "{}: empty; a metrics log starts with a `{SCHEMA}` header line",
            path.display()
        )
    })?;
    Ok(MetricsLog {
        header,
        steps: steps.into_values().collect(),
        vals: vals.into_values().collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("graphtrain-metrics-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir.join(name)
    }

    fn metrics(step: u64, loss: f64) -> StepMetrics {
        StepMetrics {
            step,
            loss,
            grad_norm: 0.5,
            lr: 1e-3,
            peak_bytes: 1 << 20,
            wait_seconds: Vec::new(),
            peer_wait_seconds: Vec::new(),
            seconds: 0.25,
            tokens: 64,
        }
    }

    const RATES: StepRates = StepRates {
        tflops: 0.002,
        mfu: None,
    };

    #[test]
    fn each_line_is_on_disk_before_the_next_step() {
        let path = temp("flushed.jsonl");
        let mut w =
            MetricsWriter::create(&path, serde_json::json!({"seed": 3}), Instant::now()).unwrap();
        w.step(&metrics(1, 4.0), &RATES).unwrap();
        // Read while the writer is still open: what a crash right now would leave.
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["kind"], "header");
        assert_eq!(lines[0]["schema"], SCHEMA);
        assert_eq!(lines[0]["config"]["seed"], 3);
        assert_eq!(lines[1]["kind"], "step");
        assert_eq!(lines[1]["step"], 1);
        assert_eq!(lines[1]["tokens_per_s"], 256.0);
        assert_eq!(lines[1]["memory_bytes"], 1 << 20);
        assert!(lines[1]["mfu"].is_null());
        assert!(lines[1]["wall_s"].as_f64().unwrap() >= 0.0);
        drop(w);
    }

    #[test]
    fn resume_appends_and_the_reader_keeps_the_last_record_of_a_step() {
        let path = temp("resumed.jsonl");
        let mut w = MetricsWriter::create(&path, serde_json::json!({}), Instant::now()).unwrap();
        w.step(&metrics(1, 4.0), &RATES).unwrap();
        w.step(&metrics(2, 3.9), &RATES).unwrap();
        w.validation(2, 3.95).unwrap();
        drop(w);
        // Resumed from a checkpoint after step 1: step 2 runs again.
        let mut w = MetricsWriter::append(&path, serde_json::json!({}), 1, Instant::now()).unwrap();
        w.step(&metrics(2, 3.8), &RATES).unwrap();
        drop(w);
        let log = read(&path).unwrap();
        assert_eq!(log.header.resumed_after, None);
        assert_eq!(
            log.steps
                .iter()
                .map(|s| (s.step, s.loss))
                .collect::<Vec<_>>(),
            vec![(1, 4.0), (2, 3.8)]
        );
        assert_eq!(log.vals.len(), 1);
        assert!((log.vals[0].val_ppl - 3.95f64.exp()).abs() < 1e-12);
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().count(), 6);
        assert!(text.lines().nth(4).unwrap().contains("\"resumed_after\":1"));
    }

    #[test]
    fn a_new_run_starts_the_file_afresh() {
        let path = temp("fresh.jsonl");
        std::fs::write(&path, "old contents\n").unwrap();
        let w = MetricsWriter::create(&path, serde_json::json!({}), Instant::now()).unwrap();
        drop(w);
        assert_eq!(read(&path).unwrap().steps.len(), 0);
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
    }

    #[test]
    fn bad_logs_are_refused_with_the_line() {
        let path = temp("bad.jsonl");
        let cases = [
            ("", "empty"),
            ("not json\n", ":1: not a"),
            (
                "{\"kind\":\"header\",\"schema\":\"other/2\",\"resumed_after\":null,\"config\":{}}\n",
                ":1: schema `other/2`",
            ),
            (
                "{\"kind\":\"val\",\"step\":1,\"val_loss\":1.0,\"val_ppl\":2.7}\n",
                ":1: the first line must be a `header`",
            ),
            (
                "{\"kind\":\"header\",\"schema\":\"graphtrain.metrics/1\",\"resumed_after\":null,\"config\":{}}\n{\"kind\":\"step\",\"step\":1}\n",
                ":2: not a",
            ),
        ];
        for (body, want) in cases {
            std::fs::write(&path, body).unwrap();
            let e = read(&path).unwrap_err();
            assert!(e.contains(want), "{body:?}: {e}");
        }
        std::fs::write(&path, "not json\n").unwrap();
        let e = MetricsWriter::append(&path, serde_json::json!({}), 1, Instant::now())
            .err()
            .unwrap();
        assert!(e.contains(":1: not a"), "{e}");
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "not json\n");
    }
}
