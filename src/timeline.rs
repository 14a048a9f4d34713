//! A step's timeline as a Chrome trace-event file (`graphtrain run --trace-out FILE.json`),
//! which chrome://tracing and Perfetto open, and reading one back for `graphtrain plot --trace`.
//!
//! The file is `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}` with one
//! complete (`"ph": "X"`) event per Program step: `ts` and `dur` in microseconds from the start
//! of the step, `pid` the rank, `tid` the lane (`graphtrain_runtime::timeline::KERNELS`,
//! `HOST`, and on a mesh of threads `COMMUNICATION`: one event per collective, from when every
//! member had started it until its result was in place, named by its start node), `name` the
//! producing graph node as `module op #node`, `cat` its phase, and `args`
//! with the step index, step kind, node, op and module. Process and thread names are given as
//! metadata (`"ph": "M"`) events so a viewer labels the rows.
//!
//! Ranks write one file each: `trace_path(FILE, rank, world)` is FILE itself for a single
//! rank, `FILE.rankN.json` (the extension replaced) for a rank of a larger run.
//!
//! Refused on reading: a file that is not JSON, has no `traceEvents` array, or an `X` event
//! without a numeric `ts`/`dur`; the error names the event's index.

use graphtrain_runtime::timeline::{COMMUNICATION, HOST, KERNELS};
use graphtrain_runtime::Timeline;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// The file rank `rank` of a run of `world` ranks writes when asked for `base`.
pub fn trace_path(base: &Path, rank: u32, world: u32) -> PathBuf {
    if world <= 1 {
        return base.to_path_buf();
    }
    base.with_extension(format!("rank{rank}.json"))
}

/// Writes each rank's timeline of step `step` to its file for `base` (`trace_path`), and
/// returns the files: `timelines[i]` is rank `first + i`'s of a run of `world` ranks (an MPI
/// process writes its own rank's alone).
pub fn write_rank_traces(
    base: &Path,
    timelines: &[Timeline],
    step: u64,
    (first, world): (u32, u32),
) -> Result<Vec<PathBuf>, String> {
    let mut written = Vec::with_capacity(timelines.len());
    for (i, timeline) in timelines.iter().enumerate() {
        let rank = first + i as u32;
        let path = trace_path(base, rank, world);
        write_chrome_trace(&path, timeline, rank, step)?;
        written.push(path);
    }
    Ok(written)
}

fn lane_name(lane: u32) -> String {
    match lane {
        KERNELS => "kernels".to_string(),
        HOST => "host code".to_string(),
        COMMUNICATION => "communication".to_string(),
        other => format!("lane {other}"),
    }
}

fn micros(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// The trace-event document of `timeline`, recorded for training step `step` on `rank`.
pub fn chrome_trace(timeline: &Timeline, rank: u32, step: u64) -> Value {
    let mut events = vec![json!({
        "name": "process_name", "ph": "M", "pid": rank, "tid": 0,
        "args": {"name": format!("rank {rank}, step {step}")},
    })];
    let mut lanes: Vec<u32> = timeline.events.iter().map(|e| e.lane).collect();
    lanes.sort_unstable();
    lanes.dedup();
    for lane in lanes {
        events.push(json!({
            "name": "thread_name", "ph": "M", "pid": rank, "tid": lane,
            "args": {"name": lane_name(lane)},
        }));
    }
    for e in &timeline.events {
        events.push(json!({
            "name": e.label(),
            "cat": e.phase.map_or("none", |p| p.short()),
            "ph": "X",
            "ts": micros(e.start),
            "dur": micros(e.duration),
            "pid": rank,
            "tid": e.lane,
            "args": {
                "step": e.step,
                "kind": e.kind,
                "node": e.node,
                "op": e.op,
                "module": e.module,
            },
        }));
    }
    json!({
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "graphtrain",
            "training_step": step,
            "rank": rank,
            "run_total_us": micros(timeline.total),
        },
    })
}

/// Writes `timeline` to `path` as a Chrome trace.
pub fn write_chrome_trace(
    path: &Path,
    timeline: &Timeline,
    rank: u32,
    step: u64,
) -> Result<(), String> {
    let body = serde_json::to_string(&chrome_trace(timeline, rank, step))
        .map_err(|e| format!("cannot encode the trace: {e}"))?;
    std::fs::write(path, body).map_err(|e| format!("cannot write `{}`: {e}", path.display()))
}

/// One complete event read back.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceEvent {
    pub name: String,
    pub cat: String,
    /// Microseconds.
    pub ts: f64,
    pub dur: f64,
    pub pid: u64,
    pub tid: u64,
}

/// The complete events of a trace file (other phases are skipped).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceFile {
    pub events: Vec<TraceEvent>,
    /// Lane (`tid`) names given by `thread_name` metadata events.
    pub lane_names: std::collections::BTreeMap<u64, String>,
}

impl TraceFile {
    /// The lanes (`tid`s) that have events, in order.
    pub fn lanes(&self) -> Vec<u64> {
        let mut lanes: Vec<u64> = self.events.iter().map(|e| e.tid).collect();
        lanes.sort_unstable();
        lanes.dedup();
        lanes
    }
}

/// Reads the complete events of a Chrome trace file.
pub fn read_trace(path: &Path) -> Result<TraceFile, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    let doc: Value =
        serde_json::from_str(&text).map_err(|e| format!("{}: not JSON ({e})", path.display()))?;
    let list = doc
        .get("traceEvents")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            format!(
                "{}: not a Chrome trace: no `traceEvents` array",
                path.display()
            )
        })?;
    let mut events = Vec::new();
    let mut lane_names = std::collections::BTreeMap::new();
    for (i, e) in list.iter().enumerate() {
        let ph = e.get("ph").and_then(Value::as_str);
        if ph == Some("M") && e.get("name").and_then(Value::as_str) == Some("thread_name") {
            let name = e.pointer("/args/name").and_then(Value::as_str);
            if let (Some(tid), Some(name)) = (e.get("tid").and_then(Value::as_u64), name) {
                lane_names.insert(tid, name.to_string());
            }
        }
        if ph != Some("X") {
            continue;
        }
        let num = |field: &str| {
            e.get(field).and_then(Value::as_f64).ok_or_else(|| {
                format!(
                    "{}: traceEvents[{i}] is a complete event without a numeric `{field}`",
                    path.display()
                )
            })
        };
        let text = |field: &str| {
            e.get(field)
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_string()
        };
        events.push(TraceEvent {
            name: text("name"),
            cat: text("cat"),
            ts: num("ts")?,
            dur: num("dur")?,
            pid: e.get("pid").and_then(Value::as_u64).unwrap_or(0),
            tid: e.get("tid").and_then(Value::as_u64).unwrap_or(0),
        });
    }
    Ok(TraceFile { events, lane_names })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_files_sit_beside_the_base() {
        let base = Path::new("/tmp/x/step.json");
        assert_eq!(trace_path(base, 0, 1), base);
        assert_eq!(trace_path(base, 3, 8), Path::new("/tmp/x/step.rank3.json"));
    }

    #[test]
    fn bad_traces_are_refused_with_where() {
        let dir = std::env::temp_dir().join(format!("graphtrain-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("bad.json");
        for (body, want) in [
            ("{", "not JSON"),
            ("{\"events\": []}", "no `traceEvents`"),
            (
                "{\"traceEvents\": [{\"ph\": \"M\"}, {\"ph\": \"X\", \"ts\": 1}]}",
                "traceEvents[1] is a complete event without a numeric `dur`",
            ),
        ] {
            std::fs::write(&path, body).unwrap();
            let e = read_trace(&path).unwrap_err();
            assert!(e.contains(want), "{body}: {e}");
        }
    }
}
