//! The loop: propose, gate, measure, decide, log; resumable from the log.
//!
//! Each experiment draws from its own stream (seed, experiment number). A candidate is skipped
//! (and drawn again, up to `TRIES` times) when it breaks a rule or runs a pipeline already tried;
//! its optimized graph's fingerprint is then compared with every one seen (many pipelines give
//! the same graph: measured once, logged `duplicate`). The numerics gate runs before any timing;
//! a failure is logged `numerics` and never kept. The keep rule decides on interleaved pairs; a
//! keep is confirmed on fresh pairs before the candidate becomes the incumbent (else
//! `unconfirmed`). Every `aa_every` experiments the incumbent is measured against itself, and the
//! log says whether the rule would have kept it: the rule's false-keep rate, measured.

use crate::journal::{Journal, Line};
use crate::propose::Proposer;
use crate::rng::Rng;
use crate::space::{Candidate, Space};
use crate::stats::{Decision, KeepRule, Verdict};

/// What the search measures: graphtrain's CLI times steps on this machine; a simulator can
/// predict them instead.
pub trait Objective {
    /// A fingerprint of the graph `pipeline` gives (equal graphs, equal fingerprints), or why
    /// the pipeline cannot be built.
    fn fingerprint(&mut self, pipeline: &str) -> Result<String, String>;
    /// `Ok` when `pipeline` trains as the unoptimized step does (bitwise for tier 1), else why.
    fn numerics(&mut self, pipeline: &str) -> Result<(), String>;
    /// `k` interleaved pairs of (incumbent step time, candidate step time), in seconds.
    fn pairs(
        &mut self,
        incumbent: &str,
        candidate: &str,
        k: usize,
    ) -> Result<Vec<(f64, f64)>, String>;
}

pub struct Search {
    pub space: Space,
    pub rule: KeepRule,
    pub seed: u64,
    /// Experiments in all, counting those already in the log.
    pub experiments: usize,
    /// Every this many experiments, an A/A check instead of a candidate (0: never).
    pub aa_every: usize,
    /// Where a search with an empty log starts.
    pub start: Candidate,
    /// No experiment starts after this (the one under way finishes).
    pub deadline: Option<std::time::Instant>,
}

/// How many draws an experiment may spend looking for an untried valid candidate.
const TRIES: usize = 64;

/// What a search ended with.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub incumbent: String,
    pub kept: usize,
    /// A/A checks run and how many the rule would have kept.
    pub aa_runs: usize,
    pub aa_keeps: usize,
    /// Whether the proposer ran out of untried candidates.
    pub exhausted: bool,
}

impl Search {
    pub fn run(
        &self,
        journal: &mut Journal,
        proposer: &mut dyn Proposer,
        objective: &mut dyn Objective,
        mut progress: impl FnMut(&Line, &str),
    ) -> Result<Outcome, String> {
        let mut incumbent = self.start.clone();
        let mut tried: Vec<String> = vec![self.space.pipeline(&incumbent)];
        let mut seen: Vec<String> = Vec::new();
        for line in &journal.lines {
            tried.push(line.pipeline.clone());
            if !line.fingerprint.is_empty() {
                seen.push(line.fingerprint.clone());
            }
            if line.status == "keep" {
                incumbent = self.space.parse(&line.pipeline)?;
            }
        }
        let start_fp = objective.fingerprint(&self.space.pipeline(&self.start))?;
        seen.push(start_fp);
        let mut exhausted = false;
        let proposer_name = proposer.name().to_string();
        for k in journal.lines.len()..self.experiments {
            if self
                .deadline
                .is_some_and(|d| std::time::Instant::now() >= d)
            {
                break;
            }
            let mut rng = Rng::new(self.seed, k as u64);
            let current = self.space.pipeline(&incumbent);
            let line =
                |status: &str, v: Option<&Verdict>, fp: &str, pipeline: &str, why: String| Line {
                    experiment: k,
                    proposer: proposer_name.clone(),
                    status: status.into(),
                    ratio: v.map_or(f64::NAN, |v| v.ratio),
                    lo: v.map_or(f64::NAN, |v| v.lo),
                    hi: v.map_or(f64::NAN, |v| v.hi),
                    pairs: v.map_or(0, |v| v.pairs),
                    fingerprint: fp.into(),
                    pipeline: pipeline.into(),
                    description: why,
                };
            if self.aa_every > 0 && k % self.aa_every == self.aa_every - 1 {
                let (v, pairs) = self
                    .rule
                    .decide(rng.next_u64(), |n| objective.pairs(&current, &current, n))?;
                let said = match v.decision {
                    Decision::Keep => "the rule would have kept it (a false keep)",
                    _ => "the rule would not have kept it",
                };
                let l = line(
                    "aa",
                    Some(&v),
                    "",
                    &current,
                    format!("incumbent against itself: {said}"),
                );
                progress(&l, &current);
                journal.append(l, &pairs)?;
                continue;
            }
            let mut candidate = None;
            for _ in 0..TRIES {
                let c = proposer.propose(&self.space, &incumbent, &mut rng);
                if self.space.validate(&c).is_ok() && !tried.contains(&self.space.pipeline(&c)) {
                    candidate = Some(c);
                    break;
                }
            }
            let Some(candidate) = candidate else {
                exhausted = true;
                break;
            };
            let pipeline = self.space.pipeline(&candidate);
            tried.push(pipeline.clone());
            let l = match objective.fingerprint(&pipeline) {
                Err(why) => line("invalid", None, "", &pipeline, why),
                Ok(fp) if seen.contains(&fp) => line(
                    "duplicate",
                    None,
                    &fp,
                    &pipeline,
                    "a graph already measured".into(),
                ),
                Ok(fp) => {
                    seen.push(fp.clone());
                    match objective.numerics(&pipeline) {
                        Err(why) => line("numerics", None, &fp, &pipeline, why),
                        Ok(()) => {
                            let measured = self.rule.decide(rng.next_u64(), |n| {
                                objective.pairs(&current, &pipeline, n)
                            });
                            match measured {
                                Err(why) => line("crash", None, &fp, &pipeline, why),
                                Ok((v, pairs)) if v.decision != Decision::Keep => {
                                    let l = line(
                                        "discard",
                                        Some(&v),
                                        &fp,
                                        &pipeline,
                                        format!("against `{current}`"),
                                    );
                                    progress(&l, &current);
                                    journal.append(l, &pairs)?;
                                    continue;
                                }
                                Ok((v, mut pairs)) => {
                                    let confirm = self.rule.decide(rng.next_u64(), |n| {
                                        objective.pairs(&current, &pipeline, n)
                                    })?;
                                    pairs.extend(confirm.1);
                                    let l = if confirm.0.decision == Decision::Keep {
                                        incumbent = candidate.clone();
                                        line("keep", Some(&confirm.0), &fp, &pipeline, format!("over `{current}`, confirmed (first {:.3} [{:.3}, {:.3}])", v.ratio, v.lo, v.hi))
                                    } else {
                                        line("unconfirmed", Some(&confirm.0), &fp, &pipeline, format!("kept at first ({:.3} [{:.3}, {:.3}]), not on fresh pairs", v.ratio, v.lo, v.hi))
                                    };
                                    progress(&l, &self.space.pipeline(&incumbent));
                                    journal.append(l, &pairs)?;
                                    continue;
                                }
                            }
                        }
                    }
                }
            };
            progress(&l, &current);
            journal.append(l, &[])?;
        }
        let aa: Vec<&Line> = journal.lines.iter().filter(|l| l.status == "aa").collect();
        Ok(Outcome {
            incumbent: self.space.pipeline(&incumbent),
            kept: journal.lines.iter().filter(|l| l.status == "keep").count(),
            aa_runs: aa.len(),
            aa_keeps: aa
                .iter()
                .filter(|l| l.description.contains("false keep"))
                .count(),
            exhausted,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::propose::{Neighbour, RandomSearch};
    use crate::stats::SyntheticTimer;
    use std::collections::HashMap;

    /// A seeded objective with a known optimum (canonicalize, cse and capture on, the rest off):
    /// each pass that is on changes the step time by a fixed factor (`ac` and `offload` slow
    /// it, `dce` gives the same graph); `egraph` fails numerics; the timer adds drift, noise and
    /// outliers.
    struct Fake {
        timer: SyntheticTimer,
        space: Space,
        /// Pipelines whose numerics "fail".
        broken: Vec<String>,
    }

    impl Fake {
        fn new(seed: u64) -> Fake {
            Fake {
                timer: SyntheticTimer::new(seed, 0.0, 0.05),
                space: Space::builtin(false),
                broken: vec!["egraph".into()],
            }
        }

        fn time(&self, pipeline: &str) -> f64 {
            let factors: HashMap<&str, f64> = [
                ("canonicalize", 0.95),
                ("cse", 0.9),
                ("capture", 0.8),
                ("ac", 1.3),
                ("offload", 1.2),
            ]
            .into();
            pipeline
                .split(',')
                .map(|p| p.split('=').next().unwrap())
                .map(|p| factors.get(p).copied().unwrap_or(1.0))
                .product()
        }
    }

    impl Objective for Fake {
        fn fingerprint(&mut self, pipeline: &str) -> Result<String, String> {
            // dce alone changes nothing here: its graph is the one without it.
            let c = self.space.parse(pipeline)?;
            Ok(self
                .space
                .pipeline(&c)
                .replace("dce,", "")
                .replace(",dce", ""))
        }

        fn numerics(&mut self, pipeline: &str) -> Result<(), String> {
            match self.broken.iter().find(|b| pipeline.contains(b.as_str())) {
                Some(b) => Err(format!("`{b}` changed the loss at step 1")),
                None => Ok(()),
            }
        }

        fn pairs(&mut self, a: &str, b: &str, k: usize) -> Result<Vec<(f64, f64)>, String> {
            let (ta, tb) = (self.time(a), self.time(b));
            Ok(self
                .timer
                .pairs(k)
                .into_iter()
                .map(|(x, y)| (x * ta, y * tb))
                .collect())
        }
    }

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("autoresearch-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn search(experiments: usize) -> Search {
        let space = Space::builtin(false);
        Search {
            start: space.parse("none").unwrap(),
            space,
            rule: KeepRule::default(),
            seed: 3,
            experiments,
            aa_every: 5,
            deadline: None,
        }
    }

    #[test]
    fn the_neighbour_search_finds_the_known_optimum_and_logs_every_kind() {
        let d = dir("optimum");
        let mut j = Journal::open(&d).unwrap();
        let out = search(30)
            .run(&mut j, &mut Neighbour, &mut Fake::new(1), |_, _| {})
            .unwrap();
        // `dce` changes no graph here (a duplicate); every neighbour of the optimum was tried.
        assert_eq!(out.incumbent, "canonicalize,cse,capture", "{:?}", j.lines);
        assert!(out.exhausted);
        let statuses: Vec<&str> = j.lines.iter().map(|l| l.status.as_str()).collect();
        for s in ["keep", "discard", "numerics", "aa"] {
            assert!(statuses.contains(&s), "{statuses:?}");
        }
        assert_eq!(out.aa_keeps, 0);
    }

    /// A search stopped after 12 experiments and resumed from its log writes the same
    /// results.tsv as one run straight through.
    #[test]
    fn a_resumed_search_logs_what_an_uninterrupted_one_does() {
        let (a, b) = (dir("straight"), dir("resumed"));
        {
            let mut j = Journal::open(&a).unwrap();
            search(24)
                .run(&mut j, &mut RandomSearch, &mut Fake::new(5), |_, _| {})
                .unwrap();
        }
        {
            let mut j = Journal::open(&b).unwrap();
            search(12)
                .run(&mut j, &mut RandomSearch, &mut Fake::new(5), |_, _| {})
                .unwrap();
        }
        // The resumed half gets a fresh timer whose draws continue where the log's left off:
        // the timer's state is not in the log, so the fake replays the first half's draws.
        let mut fake = Fake::new(5);
        let done: usize = std::fs::read_to_string(b.join("samples.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["pairs"]
                    .as_array()
                    .unwrap()
                    .len()
            })
            .sum();
        fake.timer.pairs(done);
        {
            let mut j = Journal::open(&b).unwrap();
            search(24)
                .run(&mut j, &mut RandomSearch, &mut fake, |_, _| {})
                .unwrap();
        }
        let read = |d: &std::path::Path| std::fs::read_to_string(d.join("results.tsv")).unwrap();
        assert_eq!(read(&a), read(&b));
        assert_eq!(read(&a).lines().count(), 25);
    }

    #[test]
    fn a_held_lock_and_a_corrupt_line_are_refused() {
        let d = dir("lock");
        let j = Journal::open(&d).unwrap();
        let e = Journal::open(&d).err().unwrap();
        assert!(e.contains("another search holds"), "{e}");
        drop(j);
        std::fs::write(
            d.join("results.tsv"),
            format!("{}\n0\tneighbour\tkeep\tx\n", crate::journal::HEADER),
        )
        .unwrap();
        let e = Journal::open(&d).err().unwrap();
        assert!(e.contains("results.tsv line 2"), "{e}");
        assert!(d.join("results.tsv").exists());
    }
}
