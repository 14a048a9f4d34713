//! Proposers: where the next candidate comes from. Each sees the search's state (the incumbent,
//! every experiment so far with its estimated speed) and draws from the experiment's own seeded
//! stream; the search skips candidates that break a rule or were tried already. None of them
//! grades a result: the search measures and decides.
//!
//! - `neighbour`: one knob of the incumbent changed (a local search; it stops when every
//!   neighbour was tried).
//! - `evolution`: a child of two of the fastest candidates measured (tournament selection,
//!   uniform crossover, mutation of about one knob), so it recombines what worked apart.
//! - `random`: every knob drawn uniformly, the baseline the others must beat at the same budget.
//! - an external command (`External`): given the state as JSON on stdin, it prints one pipeline.

use crate::rng::Rng;
use crate::space::{Candidate, Space};
use serde::Serialize;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// An experiment as proposers see it.
#[derive(Clone, Debug, Serialize)]
pub struct Tried {
    pub experiment: usize,
    pub status: String,
    pub pipeline: String,
    /// Candidate speed over the incumbent's at the time (NaN when not timed).
    pub ratio: f64,
    /// Estimated speed relative to the search's start: the kept ratios multiplied up to this
    /// experiment's incumbent, times this ratio. `None` when it was not timed.
    pub speed: Option<f64>,
}

/// What a proposer is told.
#[derive(Clone, Debug)]
pub struct State<'a> {
    pub experiment: usize,
    pub incumbent: &'a Candidate,
    /// The incumbent's estimated speed relative to the search's start.
    pub incumbent_speed: f64,
    pub history: &'a [Tried],
}

pub trait Proposer {
    fn name(&self) -> &str;
    /// The next candidate, or why there is none (logged as `invalid`).
    fn propose(
        &mut self,
        space: &Space,
        state: &State<'_>,
        rng: &mut Rng,
    ) -> Result<Candidate, String>;
    /// Whether the search may ask again when a proposal breaks a rule or was tried. Built-in
    /// draws are cheap; an external proposer is asked once per experiment and its every
    /// proposal is logged.
    fn redraws(&self) -> bool {
        true
    }
}

/// `c` with knob `k` set to another of its choices.
fn mutate_knob(space: &Space, c: &mut Candidate, k: usize, rng: &mut Rng) {
    let n = space.knobs[k].choices.len();
    c.0[k] = (c.0[k] + 1 + rng.below(n - 1)) % n;
}

/// One knob of the incumbent set to another of its choices.
pub struct Neighbour;

impl Proposer for Neighbour {
    fn name(&self) -> &str {
        "neighbour"
    }

    fn propose(
        &mut self,
        space: &Space,
        s: &State<'_>,
        rng: &mut Rng,
    ) -> Result<Candidate, String> {
        let mut c = s.incumbent.clone();
        mutate_knob(space, &mut c, rng.below(space.knobs.len()), rng);
        Ok(c)
    }
}

/// Every knob drawn uniformly: the baseline the other proposers must beat at the same budget.
pub struct RandomSearch;

impl Proposer for RandomSearch {
    fn name(&self) -> &str {
        "random"
    }

    fn propose(
        &mut self,
        space: &Space,
        _: &State<'_>,
        rng: &mut Rng,
    ) -> Result<Candidate, String> {
        Ok(Candidate(
            space
                .knobs
                .iter()
                .map(|k| rng.below(k.choices.len()))
                .collect(),
        ))
    }
}

/// A steady-state genetic search over the measured candidates.
pub struct Evolution {
    /// The fastest this many distinct candidates are the parents' pool.
    pub population: usize,
}

impl Default for Evolution {
    fn default() -> Self {
        Evolution { population: 6 }
    }
}

impl Proposer for Evolution {
    fn name(&self) -> &str {
        "evolution"
    }

    fn propose(
        &mut self,
        space: &Space,
        s: &State<'_>,
        rng: &mut Rng,
    ) -> Result<Candidate, String> {
        let mut pool: Vec<(Candidate, f64)> = vec![(s.incumbent.clone(), s.incumbent_speed)];
        for t in s.history {
            if let (Some(speed), Ok(c)) = (t.speed, space.parse(&t.pipeline)) {
                if !pool.iter().any(|(p, _)| *p == c) {
                    pool.push((c, speed));
                }
            }
        }
        pool.sort_by(|a, b| b.1.total_cmp(&a.1));
        pool.truncate(self.population.max(2));
        let n = space.knobs.len();
        if pool.len() < 2 {
            // Nothing to recombine yet: explore around the incumbent.
            let mut c = s.incumbent.clone();
            mutate_knob(space, &mut c, rng.below(n), rng);
            return Ok(c);
        }
        // Binary tournaments: the faster of two drawn at random.
        let pick = |rng: &mut Rng| {
            let (i, j) = (rng.below(pool.len()), rng.below(pool.len()));
            i.min(j)
        };
        let a = pick(rng);
        let mut b = pick(rng);
        if b == a {
            b = (a + 1) % pool.len();
        }
        let (pa, pb) = (&pool[a].0, &pool[b].0);
        let mut child = Candidate(
            (0..n)
                .map(|k| if rng.unit() < 0.5 { pa.0[k] } else { pb.0[k] })
                .collect(),
        );
        for k in 0..n {
            if rng.unit() < 1.0 / n as f64 {
                mutate_knob(space, &mut child, k, rng);
            }
        }
        if child == *pa || child == *pb {
            mutate_knob(space, &mut child, rng.below(n), rng);
        }
        Ok(child)
    }
}

/// A command that proposes: run with `sh -c`, given the state as one JSON document on stdin
/// (`experiment`, `incumbent`, `incumbent_speed`, `space`, `history`), it prints the next
/// pipeline in `--passes` form on the first line of its stdout. Whatever goes wrong (it hangs
/// past `timeout`, exits with an error, prints something that is no pipeline of the space) is
/// the experiment's `invalid` reason; the search goes on.
pub struct External {
    pub command: String,
    pub timeout: Duration,
}

/// How many of the latest experiments an external proposer is shown in full.
const HISTORY_SHOWN: usize = 200;

impl Proposer for External {
    fn name(&self) -> &str {
        "external"
    }

    fn redraws(&self) -> bool {
        false
    }

    fn propose(&mut self, space: &Space, s: &State<'_>, _: &mut Rng) -> Result<Candidate, String> {
        let shown = &s.history[s.history.len().saturating_sub(HISTORY_SHOWN)..];
        let state = serde_json::json!({
            "experiment": s.experiment,
            "incumbent": space.pipeline(s.incumbent),
            "incumbent_speed": s.incumbent_speed,
            "space": space,
            "history": shown,
        });
        let answer = run_with_timeout(&self.command, state.to_string(), self.timeout)?;
        let line = answer
            .lines()
            .map(str::trim)
            .find(|l| !l.is_empty())
            .ok_or("the proposer printed nothing")?;
        space
            .parse(line)
            .map_err(|e| format!("the proposer printed `{line}`: {e}"))
    }
}

/// Runs `command` under `sh -c` in its own process group with `input` on stdin; its stdout, or
/// why not. A command still running after `timeout` is killed with its children.
fn run_with_timeout(command: &str, input: String, timeout: Duration) -> Result<String, String> {
    use std::os::unix::process::CommandExt;
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(command)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|e| format!("cannot start the proposer `{command}`: {e}"))?;
    let mut stdin = child.stdin.take().expect("piped");
    // A proposer that does not read its input must not block us on a full pipe.
    std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    let drain = |mut r: Box<dyn Read + Send>| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = r.read_to_string(&mut s);
            let _ = tx.send(s);
        });
        rx
    };
    let out = drain(Box::new(child.stdout.take().expect("piped")));
    let err = drain(Box::new(child.stderr.take().expect("piped")));
    let stdout = match out.recv_timeout(timeout) {
        Ok(s) => s,
        Err(_) => {
            // The whole group: `sh` and whatever it started.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .status();
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!(
                "the proposer did not answer within {:.0} s (killed)",
                timeout.as_secs_f64()
            ));
        }
    };
    let status = child
        .wait()
        .map_err(|e| format!("the proposer could not be waited for: {e}"))?;
    if !status.success() {
        let stderr = err.recv_timeout(Duration::from_secs(1)).unwrap_or_default();
        let tail: Vec<&str> = stderr.lines().rev().take(3).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(format!(
            "the proposer exited with {status}: {}",
            tail.join(" / ")
        ));
    }
    Ok(stdout)
}

/// The built-in proposers' names.
pub const BUILT_IN: &[&str] = &["neighbour", "evolution", "random"];

/// A proposer by name, or a command (anything with a space or a `/` in it) run as `External`.
pub fn by_name(name: &str, timeout: Duration) -> Result<Box<dyn Proposer>, String> {
    match name {
        "neighbour" => Ok(Box::new(Neighbour)),
        "evolution" => Ok(Box::new(Evolution::default())),
        "random" => Ok(Box::new(RandomSearch)),
        command if command.contains([' ', '/']) => Ok(Box::new(External {
            command: command.to_string(),
            timeout,
        })),
        other => Err(format!(
            "unknown proposer `{other}`: built in are {}; a command (with a space or a `/` in it, \
e.g. `python3 autoresearch/examples/propose.py`) is run as an external proposer",
            BUILT_IN.join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state<'a>(incumbent: &'a Candidate, history: &'a [Tried]) -> State<'a> {
        State {
            experiment: 0,
            incumbent,
            incumbent_speed: 1.0,
            history,
        }
    }

    #[test]
    fn an_external_proposer_that_hangs_fails_or_prints_garbage_is_refused_with_the_reason() {
        let space = Space::builtin(false);
        let none = space.parse("none").unwrap();
        let s = state(&none, &[]);
        let mut rng = Rng::new(0, 0);
        let mut ask = |cmd: &str, secs: u64| {
            External {
                command: cmd.into(),
                timeout: Duration::from_secs(secs),
            }
            .propose(&space, &s, &mut rng)
        };
        let c = ask("cat >/dev/null; echo cse,capture", 10).unwrap();
        assert_eq!(space.pipeline(&c), "cse,capture");
        let e = ask("sleep 30", 1).unwrap_err();
        assert!(e.contains("did not answer within 1 s"), "{e}");
        let e = ask("echo bad >&2; exit 3", 10).unwrap_err();
        assert!(e.contains("exited with") && e.contains("bad"), "{e}");
        let e = ask("echo '{not a pipeline'", 10).unwrap_err();
        assert!(e.contains("printed `{not a pipeline`"), "{e}");
        let e = ask("echo offload", 10).unwrap_err();
        assert!(e.contains("`offload` needs `ac`"), "{e}");
        // The state arrives as JSON with the incumbent and the space.
        let c = ask(
            "grep -q '\"incumbent\":\"none\"' && grep -q '\"knobs\"' ; echo cse",
            10,
        );
        assert!(c.is_ok(), "{c:?}");
    }

    #[test]
    fn evolution_recombines_the_fastest_measured_candidates() {
        let space = Space::builtin(false);
        let none = space.parse("none").unwrap();
        let tried = |pipeline: &str, speed: f64| Tried {
            experiment: 0,
            status: "discard".into(),
            pipeline: pipeline.into(),
            ratio: speed,
            speed: Some(speed),
        };
        let history = [
            tried("cse", 1.1),
            tried("capture", 1.2),
            tried("ac=full", 0.7),
        ];
        let mut e = Evolution { population: 3 };
        let mut both = 0;
        for k in 0..200 {
            let c = e
                .propose(&space, &state(&none, &history), &mut Rng::new(1, k))
                .unwrap();
            let p = space.pipeline(&c);
            if p.contains("cse") && p.contains("capture") {
                both += 1;
            }
        }
        // Two good parents' traits combine often (a quarter of crossovers, before mutation).
        assert!(both > 20, "{both}");
        assert!(by_name("evolutoin", Duration::from_secs(1)).is_err());
    }
}
