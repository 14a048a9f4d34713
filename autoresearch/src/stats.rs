//! The keep rule: is the candidate faster than the incumbent, on this machine, beyond noise?
//!
//! Both steps run in the same process, in interleaved pairs (which one goes first alternates), so
//! the machine's slow drift hits both alike; each pair gives a speed ratio (incumbent step time
//! over candidate step time; above 1 is faster). On the logs of the ratios the rule takes a 10%
//! trimmed mean (outliers, a step preempted by the OS, do not decide) and a bootstrap 95% interval
//! of it. At fixed looks (after `looks[0]`, `looks[1]`, ... pairs) a clear loser (interval wholly
//! below 1) stops early; after the last look the candidate is kept iff the interval lies wholly
//! above 1 and the estimate clears `min_effect`. Stopping early only to reject cannot add false
//! keeps. The search confirms every keep on fresh pairs before believing it.
//!
//! The rule's error is measured, not assumed: tests run it on synthetic timings with slow drift,
//! 15% noise and outliers (false keeps with no effect, keeps at a 10% effect), and a search runs
//! the incumbent against itself now and then and logs how often that would have been kept.

use crate::rng::Rng;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct KeepRule {
    /// Pair counts at which the evidence is looked at; the last is the most a candidate gets.
    pub looks: Vec<usize>,
    /// The smallest speedup worth keeping (0.02: 2%).
    pub min_effect: f64,
    /// Bootstrap resamples per interval.
    pub resamples: usize,
}

impl Default for KeepRule {
    fn default() -> Self {
        KeepRule {
            looks: vec![16, 32, 48, 64],
            min_effect: 0.02,
            resamples: 2000,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Decision {
    Keep,
    Reject,
    /// More pairs are needed (only before the last look).
    Undecided,
}

/// What the pairs so far say.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// Estimated speed ratio (candidate over incumbent speed; above 1 is faster).
    pub ratio: f64,
    /// Bootstrap 95% interval of the ratio.
    pub lo: f64,
    pub hi: f64,
    pub pairs: usize,
    pub decision: Decision,
}

/// The 10% trimmed mean of `x` (sorted in place).
fn trimmed_mean(x: &mut [f64]) -> f64 {
    x.sort_by(f64::total_cmp);
    let cut = x.len() / 10;
    let kept = &x[cut..x.len() - cut];
    kept.iter().sum::<f64>() / kept.len() as f64
}

impl KeepRule {
    /// The verdict on `pairs` of (incumbent step time, candidate step time); `seed` fixes the
    /// bootstrap's draws.
    pub fn verdict(&self, pairs: &[(f64, f64)], seed: u64) -> Verdict {
        let logs: Vec<f64> = pairs.iter().map(|(a, b)| (a / b).ln()).collect();
        let n = logs.len();
        let last = *self.looks.last().expect("a rule has looks");
        if n == 0 || logs.iter().any(|x| !x.is_finite()) {
            return Verdict {
                ratio: f64::NAN,
                lo: f64::NAN,
                hi: f64::NAN,
                pairs: n,
                decision: if n >= last {
                    Decision::Reject
                } else {
                    Decision::Undecided
                },
            };
        }
        let estimate = trimmed_mean(&mut logs.clone());
        let mut rng = Rng::new(seed, n as u64);
        let mut means: Vec<f64> = (0..self.resamples)
            .map(|_| {
                let mut sample: Vec<f64> = (0..n).map(|_| logs[rng.below(n)]).collect();
                trimmed_mean(&mut sample)
            })
            .collect();
        means.sort_by(f64::total_cmp);
        let at =
            |q: f64| means[((q * (means.len() - 1) as f64).round() as usize).min(means.len() - 1)];
        let (lo, hi) = (at(0.025).exp(), at(0.975).exp());
        let ratio = estimate.exp();
        let decision = if hi < 1.0 {
            Decision::Reject
        } else if n < last {
            Decision::Undecided
        } else if lo > 1.0 && ratio >= 1.0 + self.min_effect {
            Decision::Keep
        } else {
            Decision::Reject
        };
        Verdict {
            ratio,
            lo,
            hi,
            pairs: n,
            decision,
        }
    }

    /// Runs the looks: `more(k)` returns `k` more pairs; stops at the first decision.
    pub fn decide<E>(
        &self,
        seed: u64,
        mut more: impl FnMut(usize) -> Result<Vec<(f64, f64)>, E>,
    ) -> Result<(Verdict, Vec<(f64, f64)>), E> {
        let mut pairs = Vec::new();
        for &look in &self.looks {
            let need = look.saturating_sub(pairs.len());
            pairs.extend(more(need)?);
            let v = self.verdict(&pairs, seed);
            if v.decision != Decision::Undecided {
                return Ok((v, pairs));
            }
        }
        unreachable!("the last look always decides")
    }
}

/// Step times with a known effect, for testing the rule: a slow drift of the machine's speed
/// (shared by the two steps of a pair), independent noise per step, and rare outliers.
#[derive(Clone, Debug)]
pub struct SyntheticTimer {
    pub rng: Rng,
    /// The incumbent's step time.
    pub base: f64,
    /// The candidate is this much faster (0.10: its step takes 1/1.10 of the incumbent's).
    pub effect: f64,
    /// Relative standard deviation of each step's time.
    pub noise: f64,
    /// Amplitude of the slow drift (0.2: the machine's speed wanders within ±20%).
    pub drift: f64,
    /// Probability that a step is an outlier, taking 2 to 4 times as long.
    pub outliers: f64,
    t: u64,
}

impl SyntheticTimer {
    pub fn new(seed: u64, effect: f64, noise: f64) -> SyntheticTimer {
        SyntheticTimer {
            rng: Rng::new(seed, 0x5157),
            base: 0.3,
            effect,
            noise,
            drift: 0.2,
            outliers: 0.02,
            t: 0,
        }
    }

    fn step(&mut self, mean: f64) -> f64 {
        self.t += 1;
        let drift = 1.0 + self.drift * (self.t as f64 / 40.0).sin();
        let noisy = (1.0 + self.noise * self.rng.normal()).max(0.2);
        let outlier = if self.rng.unit() < self.outliers {
            2.0 + 2.0 * self.rng.unit()
        } else {
            1.0
        };
        mean * drift * noisy * outlier
    }

    /// `k` interleaved pairs of (incumbent, candidate) step times.
    pub fn pairs(&mut self, k: usize) -> Vec<(f64, f64)> {
        let candidate = self.base / (1.0 + self.effect);
        (0..k)
            .map(|_| (self.step(self.base), self.step(candidate)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The share of `trials` experiments the rule keeps, at `effect` under `noise`.
    fn keep_rate(effect: f64, noise: f64, trials: u64) -> f64 {
        let rule = KeepRule::default();
        let kept = (0..trials)
            .filter(|&seed| {
                let mut timer = SyntheticTimer::new(seed, effect, noise);
                let (v, _) = rule
                    .decide(seed, |k| Ok::<_, String>(timer.pairs(k)))
                    .unwrap();
                v.decision == Decision::Keep
            })
            .count();
        kept as f64 / trials as f64
    }

    #[test]
    fn no_effect_is_kept_under_five_percent_of_the_time() {
        let rate = keep_rate(0.0, 0.15, 400);
        assert!(rate < 0.05, "false keeps {rate}");
    }

    #[test]
    fn a_ten_percent_effect_under_fifteen_percent_noise_is_kept_at_least_four_times_in_five() {
        let rate = keep_rate(0.10, 0.15, 200);
        assert!(rate >= 0.8, "keeps {rate}");
    }

    #[test]
    fn a_slower_candidate_stops_at_the_first_look_and_a_tiny_gain_is_not_kept() {
        let rule = KeepRule::default();
        let mut timer = SyntheticTimer::new(7, -0.3, 0.05);
        let (v, pairs) = rule.decide(7, |k| Ok::<_, String>(timer.pairs(k))).unwrap();
        assert_eq!((v.decision, pairs.len()), (Decision::Reject, 16), "{v:?}");
        // A real 1% gain measured very precisely is below the minimum effect.
        let mut timer = SyntheticTimer::new(8, 0.01, 0.001);
        timer.drift = 0.0;
        timer.outliers = 0.0;
        let (v, _) = rule.decide(8, |k| Ok::<_, String>(timer.pairs(k))).unwrap();
        assert!(v.lo > 1.0 && v.decision == Decision::Reject, "{v:?}");
    }

    #[test]
    fn a_non_finite_time_is_never_kept() {
        let rule = KeepRule::default();
        let pairs = vec![(1.0, f64::NAN); 64];
        assert_eq!(rule.verdict(&pairs, 0).decision, Decision::Reject);
    }
}
