//! The pass manager: an ordered pipeline from `--passes a,b=opt,c` or a RON pipeline file, run
//! with verification after every pass (on by default in tests and debug builds), per-pass timing
//! and node-count diff, and an optional dump of the graph text after each pass.

use crate::pass::{Pass, PassReport, Tier};
use crate::registry::Registry;
use graphtrain_ir::{text, verify, Graph};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The tier-1 passes run when the user names none. `gather_bf16` acts only on meshes under
/// mixed precision. `capture` comes last so that every node the earlier passes leave is
/// tagged: on cpu its regions are replayed as bound launch lists.
pub const DEFAULT_PIPELINE: &[&str] = &[
    "canonicalize",
    "cse",
    "dce",
    "attention_stats",
    "gather_bf16",
    "capture",
];

/// One pipeline entry: a pass name and its optional option string.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PassSpec {
    pub name: String,
    #[serde(default)]
    pub option: Option<String>,
}

/// A pipeline as written by the user, before the passes are built.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PipelineSpec {
    pub passes: Vec<PassSpec>,
}

impl PipelineSpec {
    pub fn default_pipeline() -> Self {
        PipelineSpec {
            passes: DEFAULT_PIPELINE
                .iter()
                .map(|n| PassSpec {
                    name: n.to_string(),
                    option: None,
                })
                .collect(),
        }
    }

    /// Parses `a,b=opt,c`. `default` expands to the default pipeline and `none` to nothing.
    pub fn parse_list(list: &str) -> Result<Self, String> {
        let mut passes = Vec::new();
        for (i, item) in list.split(',').enumerate() {
            let item = item.trim();
            if item.is_empty() {
                return Err(format!("--passes `{list}`: entry {} is empty", i + 1));
            }
            let (name, option) = match item.split_once('=') {
                Some((n, o)) if !o.is_empty() => (n.trim(), Some(o.trim().to_string())),
                Some((n, _)) => {
                    return Err(format!(
                        "--passes: `{item}` has an empty option after `{n}=`"
                    ))
                }
                None => (item, None),
            };
            match (name, &option) {
                ("default", None) => passes.extend(Self::default_pipeline().passes),
                ("none", None) => {}
                _ => passes.push(PassSpec {
                    name: name.to_string(),
                    option,
                }),
            }
        }
        Ok(PipelineSpec { passes })
    }

    /// Reads a RON pipeline file: `(passes: [(name: "cse"), (name: "ac", option: Some("full"))])`.
    pub fn from_ron_file(path: &Path) -> Result<Self, String> {
        let src = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read pipeline file `{}`: {e}", path.display()))?;
        ron::from_str(&src).map_err(|e| format!("pipeline file `{}`: {e}", path.display()))
    }

    /// Drops every entry of pass `name`; an unknown name, or one not in the pipeline, is an error.
    pub fn disable(&mut self, name: &str, registry: &Registry) -> Result<(), String> {
        registry.require(name)?;
        let before = self.passes.len();
        self.passes.retain(|p| p.name != name);
        if self.passes.len() == before {
            let names: Vec<&str> = self.passes.iter().map(|p| p.name.as_str()).collect();
            return Err(format!(
                "--disable-pass {name}: `{name}` is not in the pipeline ({})",
                if names.is_empty() {
                    "empty".to_string()
                } else {
                    names.join(", ")
                }
            ));
        }
        Ok(())
    }

    /// Builds every pass; the first bad name or option is an error that lists what exists.
    pub fn build(&self, registry: &Registry) -> Result<Pipeline, String> {
        let passes = self
            .passes
            .iter()
            .map(|p| registry.build(&p.name, p.option.as_deref()))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pipeline::new(passes))
    }
}

/// A pass broke the graph, or failed.
#[derive(Clone, Debug, PartialEq)]
pub struct PipelineError {
    pub pass: String,
    pub index: usize,
    pub message: String,
}

impl fmt::Display for PipelineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "pass {} (`{}`): {}",
            self.index + 1,
            self.pass,
            self.message
        )
    }
}

impl std::error::Error for PipelineError {}

/// What one pass did inside a pipeline run.
#[derive(Clone, Debug)]
pub struct PassRecord {
    pub pass: String,
    pub tier: Tier,
    pub time: Duration,
    pub nodes_before: usize,
    pub nodes_after: usize,
    pub report: PassReport,
}

impl fmt::Display for PassRecord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let delta = self.nodes_after as i64 - self.nodes_before as i64;
        write!(
            f,
            "{:<14} {:>9.3} ms  nodes {} -> {} ({:+})",
            self.pass,
            self.time.as_secs_f64() * 1e3,
            self.nodes_before,
            self.nodes_after,
            delta
        )?;
        if self.report.changes.is_empty() {
            f.write_str("  no change")?;
        } else {
            write!(f, "  {}", self.report.changes.join("; "))?;
        }
        if !self.report.declined.is_empty() {
            write!(f, "  ({} declined)", self.report.declined.len())?;
        }
        Ok(())
    }
}

pub struct Pipeline {
    pub passes: Vec<Box<dyn Pass>>,
    /// Run the verifier after every pass (default: on in debug builds).
    pub verify_each: bool,
    /// Write `NN-<pass>.gt` here after every pass (`00-input.gt` first).
    pub dump_dir: Option<PathBuf>,
}

impl Pipeline {
    pub fn new(passes: Vec<Box<dyn Pass>>) -> Self {
        Pipeline {
            passes,
            verify_each: cfg!(debug_assertions),
            dump_dir: None,
        }
    }

    /// The tier of the whole pipeline: tier 2 if any pass is.
    pub fn tier(&self) -> Tier {
        if self.passes.iter().any(|p| p.tier() == Tier::Changing) {
            Tier::Changing
        } else {
            Tier::Preserving
        }
    }

    pub fn names(&self) -> Vec<&str> {
        self.passes.iter().map(|p| p.name()).collect()
    }

    /// Runs every pass in order. The verifier error of a broken graph names the pass.
    pub fn run(&self, graph: &Graph) -> Result<(Graph, Vec<PassRecord>), PipelineError> {
        let mut g = graph.clone();
        let mut records = Vec::with_capacity(self.passes.len());
        self.dump(0, "input", &g)?;
        for (i, pass) in self.passes.iter().enumerate() {
            let err = |message: String| PipelineError {
                pass: pass.name().to_string(),
                index: i,
                message,
            };
            let _span = tracing::info_span!("pass", name = pass.name(), index = i).entered();
            let t0 = Instant::now();
            let (next, report) = pass.run(&g).map_err(|e| err(e.message))?;
            let time = t0.elapsed();
            if self.verify_each {
                verify(&next)
                    .map_err(|e| err(format!("left a graph the verifier rejects: {e}")))?;
            }
            records.push(PassRecord {
                pass: pass.name().to_string(),
                tier: pass.tier(),
                time,
                nodes_before: g.nodes.len(),
                nodes_after: next.nodes.len(),
                report,
            });
            g = next;
            self.dump(i + 1, pass.name(), &g)?;
        }
        Ok((g, records))
    }

    fn dump(&self, index: usize, name: &str, g: &Graph) -> Result<(), PipelineError> {
        let Some(dir) = &self.dump_dir else {
            return Ok(());
        };
        let fail = |e: std::io::Error| PipelineError {
            pass: name.to_string(),
            index: index.saturating_sub(1),
            message: format!("cannot write the dump to `{}`: {e}", dir.display()),
        };
        std::fs::create_dir_all(dir).map_err(fail)?;
        std::fs::write(dir.join(format!("{index:02}-{name}.gt")), text::print(g)).map_err(fail)
    }
}
