//! A seeded synthetic objective with a known optimum, for testing the search and comparing
//! proposers where real timings would take hours and could not be repeated: each knob choice
//! scales the step time, the peak memory and the FLOPs by a fixed factor, a few pairs of choices
//! interact, one knob changes no graph (a fingerprint shared with `off`), some choices fail the
//! numerics gate, and the timer adds drift, noise and outliers keyed by (seed, experiment), so a
//! resumed search draws what an uninterrupted one did.

use crate::rng::Rng;
use crate::search::{Failure, Objective, Prediction};
use crate::space::{Candidate, Space};
use crate::stats::SyntheticTimer;
use std::time::Duration;

/// A (knob, choice) pair.
pub type Choice = (usize, usize);

#[derive(Clone, Debug)]
pub struct Synthetic {
    pub space: Space,
    /// Step-time factor per knob and choice (`off` is 1).
    pub time: Vec<Vec<f64>>,
    pub peak: Vec<Vec<f64>>,
    /// FLOPs and node-count factor per knob and choice (recomputation adds both).
    pub work: Vec<Vec<f64>>,
    /// When both choices are picked, the time is scaled by the factor too.
    pub interactions: Vec<(Choice, Choice, f64)>,
    /// Knobs whose choices give the graph of `off`.
    pub neutral: Vec<usize>,
    /// Choices that fail the numerics gate.
    pub broken: Vec<Choice>,
    pub base_peak: u64,
    /// Relative noise of each step's time.
    pub noise: f64,
    /// Wall-clock time each timed pair takes (to test a kill in the middle of an experiment).
    pub delay: Duration,
    seed: u64,
    timer: SyntheticTimer,
}

const BASE_FLOPS: f64 = 1e12;
const BASE_LAUNCHES: f64 = 1000.0;

impl Synthetic {
    /// Every choice neutral; `set` and the fields give it effects.
    pub fn flat(space: Space, seed: u64, noise: f64) -> Synthetic {
        let ones = |space: &Space| -> Vec<Vec<f64>> {
            space
                .knobs
                .iter()
                .map(|k| vec![1.0; k.choices.len()])
                .collect()
        };
        Synthetic {
            time: ones(&space),
            peak: ones(&space),
            work: ones(&space),
            space,
            interactions: Vec::new(),
            neutral: Vec::new(),
            broken: Vec::new(),
            base_peak: 1 << 30,
            noise,
            delay: Duration::ZERO,
            seed,
            timer: SyntheticTimer::new(seed, 0.0, noise),
        }
    }

    /// The (knob, choice) of `pass=choice`.
    pub fn choice(&self, pass: &str, choice: &str) -> Choice {
        let k = self
            .space
            .knobs
            .iter()
            .position(|k| k.pass == pass)
            .unwrap_or_else(|| panic!("no knob `{pass}`"));
        let i = self.space.knobs[k]
            .choices
            .iter()
            .position(|c| c == choice)
            .unwrap_or_else(|| panic!("`{pass}` has no choice `{choice}`"));
        (k, i)
    }

    /// Sets the time, peak and work factors of `pass=choice`.
    pub fn set(&mut self, pass: &str, choice: &str, time: f64, peak: f64, work: f64) {
        let (k, i) = self.choice(pass, choice);
        self.time[k][i] = time;
        self.peak[k][i] = peak;
        self.work[k][i] = work;
    }

    /// Effects drawn from `seed`: times within about ±15% per choice, `ac` trading memory for
    /// recomputation, `offload` saving a little memory, three interactions, one neutral knob and
    /// one broken choice.
    pub fn random(space: Space, seed: u64, noise: f64) -> Synthetic {
        let mut s = Synthetic::flat(space, seed, noise);
        let mut rng = Rng::new(seed, 0x5EA4C4);
        let knobs = s.space.knobs.len();
        for k in 0..knobs {
            for i in 1..s.space.knobs[k].choices.len() {
                s.time[k][i] = (0.08 * rng.normal()).exp().clamp(0.8, 1.25);
                match s.space.knobs[k].pass.as_str() {
                    "ac" => {
                        s.peak[k][i] = 0.4 + 0.4 * rng.unit();
                        s.work[k][i] = 1.15 + 0.2 * rng.unit();
                        // Recomputation costs time, less than its share of the work.
                        s.time[k][i] = s.work[k][i].sqrt() * (0.03 * rng.normal()).exp();
                    }
                    "offload" => s.peak[k][i] = 0.8 + 0.15 * rng.unit(),
                    _ => s.peak[k][i] = (0.03 * rng.normal()).exp(),
                }
            }
        }
        let any_choice = |rng: &mut Rng, space: &Space| {
            let k = rng.below(knobs);
            (k, 1 + rng.below(space.knobs[k].choices.len() - 1))
        };
        for _ in 0..3 {
            let a = any_choice(&mut rng, &s.space);
            let b = any_choice(&mut rng, &s.space);
            if a.0 != b.0 {
                s.interactions
                    .push((a, b, (0.1 * rng.normal()).exp().clamp(0.8, 1.25)));
            }
        }
        let plain: Vec<usize> = (0..knobs)
            .filter(|&k| !matches!(s.space.knobs[k].pass.as_str(), "ac" | "offload"))
            .collect();
        if !plain.is_empty() {
            let k = plain[rng.below(plain.len())];
            s.neutral.push(k);
            s.time[k].iter_mut().for_each(|t| *t = 1.0);
            s.peak[k].iter_mut().for_each(|t| *t = 1.0);
        }
        let broken = any_choice(&mut rng, &s.space);
        if !s.neutral.contains(&broken.0) {
            s.broken.push(broken);
        }
        s
    }

    fn product(&self, c: &Candidate, table: &[Vec<f64>]) -> f64 {
        c.0.iter().enumerate().map(|(k, &i)| table[k][i]).product()
    }

    /// The candidate's mean step time, without noise (1 for all knobs off).
    pub fn true_time(&self, c: &Candidate) -> f64 {
        let picked = |(k, i): Choice| c.0[k] == i;
        self.product(c, &self.time)
            * self
                .interactions
                .iter()
                .filter(|(a, b, _)| picked(*a) && picked(*b))
                .map(|x| x.2)
                .product::<f64>()
    }

    fn passes_numerics(&self, c: &Candidate) -> bool {
        !self.broken.iter().any(|&(k, i)| c.0[k] == i)
    }

    /// The fastest valid candidate that passes numerics and fits `cap`, by enumeration.
    pub fn optimum(&self, cap: Option<u64>) -> Option<(Candidate, f64)> {
        let sizes: Vec<usize> = self.space.knobs.iter().map(|k| k.choices.len()).collect();
        let total: usize = sizes.iter().product();
        (0..total)
            .map(|mut n| {
                Candidate(
                    sizes
                        .iter()
                        .map(|&s| {
                            let i = n % s;
                            n /= s;
                            i
                        })
                        .collect(),
                )
            })
            .filter(|c| self.space.validate(c).is_ok() && self.passes_numerics(c))
            .filter(|c| cap.is_none_or(|cap| self.peak_bytes(c) <= cap))
            .map(|c| {
                let t = self.true_time(&c);
                (c, t)
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }

    pub fn peak_bytes(&self, c: &Candidate) -> u64 {
        (self.base_peak as f64 * self.product(c, &self.peak)) as u64
    }

    fn parse(&self, pipeline: &str) -> Result<Candidate, String> {
        let mut c = self.space.parse(pipeline)?;
        for &k in &self.neutral {
            c.0[k] = 0;
        }
        Ok(c)
    }
}

impl Objective for Synthetic {
    fn begin(&mut self, experiment: usize) {
        let stream = self
            .seed
            .wrapping_mul(1_000_003)
            .wrapping_add(experiment as u64);
        self.timer = SyntheticTimer::new(stream, 0.0, self.noise);
    }

    fn predict(&mut self, pipeline: &str) -> Result<Prediction, Failure> {
        let c = self.parse(pipeline)?;
        let work = self.product(&c, &self.work);
        Ok(Prediction {
            fingerprint: self.space.pipeline(&c),
            peak_bytes: self.peak_bytes(&c),
            flops: BASE_FLOPS * work,
            launches: (BASE_LAUNCHES * work) as usize,
        })
    }

    fn numerics(&mut self, pipeline: &str) -> Result<(), Failure> {
        let c = self.parse(pipeline)?;
        match self.broken.iter().find(|&&(k, i)| c.0[k] == i) {
            Some(&(k, i)) => Err(Failure::Refused(format!(
                "`{}={}` changed the loss at step 1 (synthetic)",
                self.space.knobs[k].pass, self.space.knobs[k].choices[i]
            ))),
            None => Ok(()),
        }
    }

    fn pairs(&mut self, a: &str, b: &str, k: usize) -> Result<Vec<(f64, f64)>, Failure> {
        let (ta, tb) = (
            self.true_time(&self.parse(a)?),
            self.true_time(&self.parse(b)?),
        );
        std::thread::sleep(self.delay * k as u32);
        let base = self.timer.base;
        Ok(self
            .timer
            .pairs(k)
            .into_iter()
            .map(|(x, y)| (x / base * ta, y / base * tb))
            .collect())
    }
}
