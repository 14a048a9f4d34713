//! Proposers: where the next candidate comes from. Each draws from the experiment's own seeded
//! stream; the search skips candidates that break a rule or were tried already.

use crate::rng::Rng;
use crate::space::{Candidate, Space};

pub trait Proposer {
    fn name(&self) -> &str;
    fn propose(&mut self, space: &Space, incumbent: &Candidate, rng: &mut Rng) -> Candidate;
}

/// One knob of the incumbent set to another of its choices.
pub struct Neighbour;

impl Proposer for Neighbour {
    fn name(&self) -> &str {
        "neighbour"
    }

    fn propose(&mut self, space: &Space, incumbent: &Candidate, rng: &mut Rng) -> Candidate {
        let mut c = incumbent.clone();
        let k = rng.below(space.knobs.len());
        let n = space.knobs[k].choices.len();
        c.0[k] = (c.0[k] + 1 + rng.below(n - 1)) % n;
        c
    }
}

/// Every knob drawn uniformly: the baseline the other proposers must beat at the same budget.
pub struct RandomSearch;

impl Proposer for RandomSearch {
    fn name(&self) -> &str {
        "random"
    }

    fn propose(&mut self, space: &Space, _: &Candidate, rng: &mut Rng) -> Candidate {
        Candidate(
            space
                .knobs
                .iter()
                .map(|k| rng.below(k.choices.len()))
                .collect(),
        )
    }
}

/// A proposer by name.
pub fn by_name(name: &str) -> Result<Box<dyn Proposer>, String> {
    match name {
        "neighbour" => Ok(Box::new(Neighbour)),
        "random" => Ok(Box::new(RandomSearch)),
        other => Err(format!(
            "unknown proposer `{other}`; known: neighbour, random"
        )),
    }
}
