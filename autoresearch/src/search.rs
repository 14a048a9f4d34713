//! The loop: propose, predict, gate, measure, decide, log; resumable from the log.
//!
//! Each experiment draws from its own stream (seed, experiment number). A built-in proposer's
//! candidate is drawn again (up to `TRIES` times) when it breaks a rule or runs a pipeline
//! already tried. Its optimized graph is then predicted: a fingerprint (many pipelines give the
//! same graph: measured once, logged `duplicate`), the planner's peak (above `memory_cap`:
//! `over-cap`, never timed), FLOPs and launches (the static pre-filter: more arithmetic and no
//! fewer launches than the incumbent is `filtered`, never timed). The numerics gate runs before any
//! timing; a failure is logged `numerics` and never kept. The keep rule decides on interleaved
//! pairs; a keep is confirmed on fresh pairs before the candidate becomes the incumbent (else
//! `unconfirmed`). While the incumbent itself is over the cap, the first candidate under it that
//! passes numerics is kept untimed: the search answers "the fastest that fits". Every `aa_every`
//! experiments the incumbent is measured against itself, and the log says whether the rule would
//! have kept it: the rule's false-keep rate, measured.

use crate::journal::{Journal, Line};
use crate::propose::{Proposer, State, Tried};
use crate::rng::Rng;
use crate::space::{Candidate, Space};
use crate::stats::{Decision, KeepRule, Verdict};

/// What is known of a candidate's optimized step before it runs.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Prediction {
    /// Equal graphs, equal fingerprints.
    pub fingerprint: String,
    /// The planner's peak memory of the step, in bytes.
    pub peak_bytes: u64,
    pub flops: f64,
    /// The steps its lowered program runs per train step (kernel launches and host steps).
    pub launches: usize,
}

/// Why an objective could not answer about a pipeline.
#[derive(Clone, Debug, PartialEq)]
pub enum Failure {
    /// The pipeline is at fault: it cannot be built (logged `invalid`) or it changes the
    /// numerics (`numerics`).
    Refused(String),
    /// What ran it died or stopped answering (logged `crash`); the search goes on.
    Crashed(String),
}

impl From<String> for Failure {
    fn from(why: String) -> Failure {
        Failure::Refused(why)
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused(why) | Failure::Crashed(why) => f.write_str(why),
        }
    }
}

/// What the search measures: graphtrain's CLI times steps on this machine; a simulator can
/// predict them instead.
pub trait Objective {
    /// Experiment `k` starts (a seeded fake timer keys its draws on it, so a resumed search
    /// draws what an uninterrupted one did).
    fn begin(&mut self, _experiment: usize) {}
    /// The static facts of the graph `pipeline` gives, or why the pipeline cannot be built.
    fn predict(&mut self, pipeline: &str) -> Result<Prediction, Failure>;
    /// `Ok` when `pipeline` trains as the unoptimized step does (bitwise for tier 1), else why.
    fn numerics(&mut self, pipeline: &str) -> Result<(), Failure>;
    /// `k` interleaved pairs of (incumbent step time, candidate step time), in seconds.
    fn pairs(
        &mut self,
        incumbent: &str,
        candidate: &str,
        k: usize,
    ) -> Result<Vec<(f64, f64)>, Failure>;
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
    /// The most a pipeline's predicted peak may be, in bytes.
    pub memory_cap: Option<u64>,
    /// Skip (log `filtered`) candidates predicted to do more arithmetic in no fewer launches.
    pub prefilter: bool,
}

/// How many draws an experiment may spend looking for an untried valid candidate.
const TRIES: usize = 64;

/// The pre-filter's margin: FLOPs within 1% of the incumbent's count as equal.
const FLOPS_MARGIN: f64 = 1.01;

/// What a search ended with.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    pub incumbent: String,
    pub incumbent_peak: u64,
    /// Whether the incumbent's predicted peak is within the cap (true without one).
    pub fits: bool,
    /// The smallest predicted peak among the pipelines tried, with its pipeline.
    pub smallest_peak: Option<(u64, String)>,
    pub kept: usize,
    /// A/A checks run and how many the rule would have kept.
    pub aa_runs: usize,
    pub aa_keeps: usize,
    /// Whether the proposer ran out of untried candidates.
    pub exhausted: bool,
}

/// The search's state, rebuilt from the log on resume.
struct Progress {
    incumbent: Candidate,
    predicted: Prediction,
    /// This experiment's candidate's prediction, which becomes `predicted` if it is kept.
    candidate_predicted: Option<Prediction>,
    /// The incumbent's estimated speed relative to the start.
    speed: f64,
    /// Pipelines tried, with their experiment (`None`: the start).
    tried: Vec<(String, Option<usize>)>,
    seen: Vec<String>,
    history: Vec<Tried>,
    smallest: Option<(u64, String)>,
}

impl Progress {
    fn note_peak(&mut self, peak: u64, pipeline: &str) {
        if peak > 0 && self.smallest.as_ref().is_none_or(|(p, _)| peak < *p) {
            self.smallest = Some((peak, pipeline.to_string()));
        }
    }

    /// Takes in one finished experiment's line.
    fn record(&mut self, space: &Space, l: &Line) -> Result<(), String> {
        if l.status == "aa" {
            return Ok(());
        }
        self.tried.push((l.pipeline.clone(), Some(l.experiment)));
        if !l.fingerprint.is_empty() {
            self.seen.push(l.fingerprint.clone());
        }
        self.note_peak(l.peak_bytes, &l.pipeline);
        let timed = matches!(l.status.as_str(), "keep" | "discard" | "unconfirmed");
        let speed = (timed && l.ratio.is_finite()).then_some(self.speed * l.ratio);
        if l.status == "keep" {
            self.incumbent = space.parse(&l.pipeline)?;
            // A keep under the cap is untimed: the speed estimate carries over.
            self.speed = speed.unwrap_or(self.speed);
        }
        self.history.push(Tried {
            experiment: l.experiment,
            status: l.status.clone(),
            pipeline: l.pipeline.clone(),
            ratio: l.ratio,
            speed,
        });
        Ok(())
    }
}

fn fits(cap: Option<u64>, peak: u64) -> bool {
    cap.is_none_or(|c| peak <= c)
}

impl Search {
    pub fn run(
        &self,
        journal: &mut Journal,
        proposer: &mut dyn Proposer,
        objective: &mut dyn Objective,
        mut progress: impl FnMut(&Line, &str),
    ) -> Result<Outcome, String> {
        let start = self.space.pipeline(&self.start);
        let start_predicted = objective
            .predict(&start)
            .map_err(|e| format!("the start `{start}`: {e}"))?;
        let mut p = Progress {
            incumbent: self.start.clone(),
            predicted: start_predicted.clone(),
            candidate_predicted: None,
            speed: 1.0,
            tried: vec![(start.clone(), None)],
            seen: vec![start_predicted.fingerprint.clone()],
            history: Vec::new(),
            smallest: None,
        };
        p.note_peak(start_predicted.peak_bytes, &start);
        for line in &journal.lines {
            p.record(&self.space, line)?;
        }
        if p.incumbent != self.start {
            let current = self.space.pipeline(&p.incumbent);
            p.predicted = objective
                .predict(&current)
                .map_err(|e| format!("the logged incumbent `{current}`: {e}"))?;
        }
        let mut exhausted = false;
        let proposer_name = proposer.name().to_string();
        for k in journal.lines.len()..self.experiments {
            if self
                .deadline
                .is_some_and(|d| std::time::Instant::now() >= d)
            {
                break;
            }
            objective.begin(k);
            let mut rng = Rng::new(self.seed, k as u64);
            let current = self.space.pipeline(&p.incumbent);
            let line = |status: &str,
                        v: Option<&Verdict>,
                        peak: u64,
                        fp: &str,
                        pipeline: &str,
                        why: String| Line {
                experiment: k,
                proposer: proposer_name.clone(),
                status: status.into(),
                ratio: v.map_or(f64::NAN, |v| v.ratio),
                lo: v.map_or(f64::NAN, |v| v.lo),
                hi: v.map_or(f64::NAN, |v| v.hi),
                pairs: v.map_or(0, |v| v.pairs),
                peak_bytes: peak,
                fingerprint: fp.into(),
                pipeline: pipeline.into(),
                description: why,
            };
            if self.aa_every > 0 && k % self.aa_every == self.aa_every - 1 {
                let measured = self
                    .rule
                    .decide(rng.next_u64(), |n| objective.pairs(&current, &current, n));
                let peak = p.predicted.peak_bytes;
                let (l, pairs) = match measured {
                    Ok((v, pairs)) => {
                        let said = match v.decision {
                            Decision::Keep => "the rule would have kept it (a false keep)",
                            _ => "the rule would not have kept it",
                        };
                        let why = format!("incumbent against itself: {said}");
                        (line("aa", Some(&v), peak, "", &current, why), pairs)
                    }
                    Err(f) => {
                        let why = format!("incumbent against itself: {f}");
                        (line("crash", None, peak, "", &current, why), Vec::new())
                    }
                };
                progress(&l, &current);
                journal.append(l, &pairs)?;
                continue;
            }
            let state = State {
                experiment: k,
                incumbent: &p.incumbent,
                incumbent_speed: p.speed,
                history: &p.history,
            };
            // A built-in proposer draws until it finds an untried valid candidate; an external
            // one is asked once, and what it answers is logged whatever it is.
            let proposed = if proposer.redraws() {
                let mut found = None;
                for _ in 0..TRIES {
                    let c = proposer.propose(&self.space, &state, &mut rng)?;
                    let pipeline = self.space.pipeline(&c);
                    if self.space.validate(&c).is_ok() && !p.tried.iter().any(|t| t.0 == pipeline) {
                        found = Some(c);
                        break;
                    }
                }
                match found {
                    Some(c) => Ok(c),
                    None => {
                        exhausted = true;
                        break;
                    }
                }
            } else {
                proposer
                    .propose(&self.space, &state, &mut rng)
                    .and_then(|c| self.space.validate(&c).map(|()| c))
            };
            let (l, pairs) = match proposed {
                Err(why) => (line("invalid", None, 0, "", "-", why), Vec::new()),
                Ok(candidate) => {
                    let pipeline = self.space.pipeline(&candidate);
                    match p.tried.iter().find(|t| t.0 == pipeline) {
                        Some((_, when)) => {
                            let why = match when {
                                Some(e) => format!("tried in experiment {e}"),
                                None => "the search's start".into(),
                            };
                            (line("duplicate", None, 0, "", &pipeline, why), Vec::new())
                        }
                        None => self.try_candidate(
                            &mut p, objective, &mut rng, &current, &candidate, &line,
                        )?,
                    }
                }
            };
            p.record(&self.space, &l)?;
            progress(&l, &self.space.pipeline(&p.incumbent));
            journal.append(l, &pairs)?;
            let kept = p.candidate_predicted.take();
            let now = self.space.pipeline(&p.incumbent);
            if now != current {
                p.predicted = match kept {
                    Some(x) => x,
                    None => objective.predict(&now).map_err(|e| e.to_string())?,
                };
            }
        }
        let aa: Vec<&Line> = journal.lines.iter().filter(|l| l.status == "aa").collect();
        Ok(Outcome {
            incumbent: self.space.pipeline(&p.incumbent),
            incumbent_peak: p.predicted.peak_bytes,
            fits: fits(self.memory_cap, p.predicted.peak_bytes),
            smallest_peak: p.smallest,
            kept: journal.lines.iter().filter(|l| l.status == "keep").count(),
            aa_runs: aa.len(),
            aa_keeps: aa
                .iter()
                .filter(|l| l.description.contains("false keep"))
                .count(),
            exhausted,
        })
    }

    /// One untried candidate through prediction, the cap, the pre-filter, numerics and timing.
    #[allow(clippy::type_complexity)]
    fn try_candidate(
        &self,
        p: &mut Progress,
        objective: &mut dyn Objective,
        rng: &mut Rng,
        current: &str,
        candidate: &Candidate,
        line: &dyn Fn(&str, Option<&Verdict>, u64, &str, &str, String) -> Line,
    ) -> Result<(Line, Vec<(f64, f64)>), String> {
        let pipeline = self.space.pipeline(candidate);
        let untimed = |l: Line| Ok((l, Vec::new()));
        let predicted = match objective.predict(&pipeline) {
            Err(Failure::Refused(why)) => {
                return untimed(line("invalid", None, 0, "", &pipeline, why))
            }
            Err(Failure::Crashed(why)) => {
                return untimed(line("crash", None, 0, "", &pipeline, why))
            }
            Ok(x) => x,
        };
        p.candidate_predicted = Some(predicted.clone());
        let (peak, fp) = (predicted.peak_bytes, predicted.fingerprint.as_str());
        if p.seen.iter().any(|s| s == fp) {
            let why = "a graph already measured".to_string();
            return untimed(line("duplicate", None, peak, fp, &pipeline, why));
        }
        let incumbent_fits = fits(self.memory_cap, p.predicted.peak_bytes);
        if let Some(cap) = self.memory_cap.filter(|&c| peak > c) {
            let why = format!("predicted peak {peak} bytes above the cap of {cap}");
            return untimed(line("over-cap", None, peak, fp, &pipeline, why));
        }
        let inc = &p.predicted;
        if self.prefilter
            && incumbent_fits
            && predicted.flops > inc.flops * FLOPS_MARGIN
            && predicted.launches >= inc.launches
        {
            let why = format!(
                "predicted slower: {:.3e} FLOPs against {:.3e}, {} launches against {}",
                predicted.flops, inc.flops, predicted.launches, inc.launches
            );
            return untimed(line("filtered", None, peak, fp, &pipeline, why));
        }
        match objective.numerics(&pipeline) {
            Ok(()) => {}
            Err(Failure::Refused(why)) => {
                return untimed(line("numerics", None, peak, fp, &pipeline, why))
            }
            Err(Failure::Crashed(why)) => {
                return untimed(line("crash", None, peak, fp, &pipeline, why))
            }
        }
        if !incumbent_fits {
            let why = format!(
                "fits under the cap (predicted peak {peak} bytes) where `{current}` ({} bytes) does not",
                inc.peak_bytes
            );
            return untimed(line("keep", None, peak, fp, &pipeline, why));
        }
        let measured = self
            .rule
            .decide(rng.next_u64(), |n| objective.pairs(current, &pipeline, n));
        let (v, mut pairs) = match measured {
            Err(f) => return untimed(line("crash", None, peak, fp, &pipeline, f.to_string())),
            Ok(x) => x,
        };
        if v.decision != Decision::Keep {
            let why = format!("against `{current}`");
            return Ok((line("discard", Some(&v), peak, fp, &pipeline, why), pairs));
        }
        let confirmed = self
            .rule
            .decide(rng.next_u64(), |n| objective.pairs(current, &pipeline, n));
        let (confirm, more) = match confirmed {
            Ok(x) => x,
            Err(f) => {
                let why = format!("kept at first, then while confirming: {f}");
                return Ok((line("crash", Some(&v), peak, fp, &pipeline, why), pairs));
            }
        };
        pairs.extend(more);
        let first = format!("{:.3} [{:.3}, {:.3}]", v.ratio, v.lo, v.hi);
        let l = if confirm.decision == Decision::Keep {
            let why = format!("over `{current}`, confirmed (first {first})");
            line("keep", Some(&confirm), peak, fp, &pipeline, why)
        } else {
            let why = format!("kept at first ({first}), not on fresh pairs");
            line("unconfirmed", Some(&confirm), peak, fp, &pipeline, why)
        };
        Ok((l, pairs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::propose::{Evolution, Neighbour, RandomSearch};
    use crate::synthetic::Synthetic;

    /// A known optimum (canonicalize, cse and capture on, the rest off): `ac` and `offload`
    /// slow the step and save memory, `dce` and `gather_bf16` give the graph without them,
    /// `egraph` fails numerics.
    fn fake(seed: u64) -> Synthetic {
        let mut f = Synthetic::flat(Space::builtin(false), seed, 0.05);
        f.set("canonicalize", "on", 0.95, 1.0, 1.0);
        f.set("cse", "on", 0.9, 1.0, 1.0);
        f.set("capture", "on", 0.8, 1.0, 1.0);
        for (choice, peak) in [("selective", 0.7), ("full", 0.4), ("budget:0.25", 0.8)] {
            f.set("ac", choice, 1.3, peak, 1.3);
        }
        f.set("offload", "tagged", 1.2, 0.9, 1.0);
        f.neutral.push(f.choice("dce", "on").0);
        // Off a mesh `gather_bf16` changes no graph either.
        f.neutral.push(f.choice("gather_bf16", "on").0);
        f.broken.push(f.choice("egraph", "on"));
        f
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
            memory_cap: None,
            prefilter: true,
        }
    }

    #[test]
    fn the_neighbour_search_finds_the_known_optimum_and_logs_every_kind() {
        let d = dir("optimum");
        let mut j = Journal::open(&d).unwrap();
        let out = search(40)
            .run(&mut j, &mut Neighbour, &mut fake(3), |_, _| {})
            .unwrap();
        // `dce` changes no graph here (a duplicate); every neighbour of the optimum was tried.
        assert_eq!(out.incumbent, "canonicalize,cse,capture", "{:?}", j.lines);
        assert!(out.exhausted);
        let statuses: Vec<&str> = j.lines.iter().map(|l| l.status.as_str()).collect();
        // `ac` does more work in as many launches: filtered, never timed.
        for s in ["keep", "discard", "numerics", "duplicate", "filtered", "aa"] {
            assert!(statuses.contains(&s), "{s} not in {statuses:?}");
        }
        assert_eq!(out.aa_keeps, 0);
        assert!(out.fits);
    }

    /// A search stopped after 12 experiments and resumed from its log writes the same
    /// results.tsv as one run straight through.
    #[test]
    fn a_resumed_search_logs_what_an_uninterrupted_one_does() {
        let (a, b) = (dir("straight"), dir("resumed"));
        for (d, parts) in [(&a, vec![24]), (&b, vec![12, 24])] {
            for n in parts {
                let mut j = Journal::open(d).unwrap();
                search(n)
                    .run(&mut j, &mut RandomSearch, &mut fake(5), |_, _| {})
                    .unwrap();
            }
        }
        let read = |d: &std::path::Path| std::fs::read_to_string(d.join("results.tsv")).unwrap();
        assert_eq!(read(&a), read(&b));
        assert_eq!(read(&a).lines().count(), 25);
    }

    #[test]
    fn under_a_memory_cap_the_fastest_pipeline_that_fits_is_found_or_the_smallest_peak_named() {
        let f = fake(2);
        let cap = (f.base_peak as f64 * 0.75) as u64;
        let d = dir("cap");
        let mut j = Journal::open(&d).unwrap();
        let mut s = search(90);
        s.memory_cap = Some(cap);
        let out = s
            .run(&mut j, &mut Evolution::default(), &mut fake(2), |_, _| {})
            .unwrap();
        let (_, best_time) = f.optimum(Some(cap)).unwrap();
        assert!(out.fits && out.incumbent_peak <= cap, "{out:?}");
        // Several pipelines tie for the fastest under the cap (`ac=selective`, or `ac=full`
        // with a free offload): any of them is the optimum.
        let found = f.true_time(&f.space.parse(&out.incumbent).unwrap());
        assert_eq!(found, best_time, "{}: {:?}", out.incumbent, j.lines);
        assert!(j.lines.iter().any(|l| l.status == "over-cap"));
        drop(j);
        let d = dir("cap-none");
        let mut j = Journal::open(&d).unwrap();
        s.memory_cap = Some(f.base_peak / 10);
        s.experiments = 20;
        let out = s
            .run(&mut j, &mut Neighbour, &mut fake(2), |_, _| {})
            .unwrap();
        assert!(!out.fits);
        let (peak, pipeline) = out.smallest_peak.unwrap();
        assert_eq!(peak, (f.base_peak as f64 * 0.4) as u64, "{pipeline}");
    }

    /// At the same budget, on five seeded synthetic objectives with known optima, the
    /// evolutionary search ends nearer the optimum than random search does, on average.
    #[test]
    fn evolution_beats_random_search_at_the_same_budget() {
        let gap = |proposer: &mut dyn Proposer, seed: u64| {
            let f = Synthetic::random(Space::builtin(false), seed, 0.1);
            let (_, best) = f.optimum(None).unwrap();
            let d = dir(&format!("cmp-{}-{seed}", proposer.name()));
            let mut j = Journal::open(&d).unwrap();
            let mut s = search(30);
            s.seed = seed;
            let out = s.run(&mut j, proposer, &mut f.clone(), |_, _| {}).unwrap();
            f.true_time(&f.space.parse(&out.incumbent).unwrap()) / best
        };
        let seeds = 0..5u64;
        let evolution: f64 = seeds
            .clone()
            .map(|s| gap(&mut Evolution::default(), s))
            .sum();
        let random: f64 = seeds.map(|s| gap(&mut RandomSearch, s)).sum();
        assert!(
            evolution < random,
            "mean gap to the optimum: evolution {} random {}",
            evolution / 5.0,
            random / 5.0
        );
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
        // A lock left by a process that is gone is taken over.
        let d = dir("stale");
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("lock"), "4000000000\n").unwrap();
        assert!(Journal::open(&d).is_ok());
    }
}
