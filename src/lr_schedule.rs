//! The learning rate of each step. The train step reads `lr` as a graph input that the host
//! writes before every step (`graphtrain_ir::optim`), so a schedule is a function of the step
//! number alone and never changes the compiled graph: a resumed run continues it where it
//! stopped, and a run's steps have the same lr on every backend and rank.
//!
//! The shapes are torchtitan's and nanoGPT's: a linear warm-up from `peak / warmup` at step 1 to
//! `peak` at step `warmup`, then either the peak to the end (`Decay::None`) or a decay that
//! reaches `min_ratio × peak` at step `total` (linear, or half a cosine).

use std::fmt;

/// How the lr falls after the warm-up.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Decay {
    /// Stays at the peak.
    None,
    /// Falls in a straight line to the floor at the last step.
    Linear,
    /// Falls along half a cosine to the floor at the last step.
    Cosine,
}

/// The lr of every step `1..=total`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    /// The lr after the warm-up (the whole run's, without warm-up or decay).
    pub peak: f64,
    /// Steps of linear warm-up (0: none).
    pub warmup: u64,
    pub decay: Decay,
    /// The floor the decay reaches at `total`, as a fraction of `peak`.
    pub min_ratio: f64,
    /// The run's last step: where the decay ends.
    pub total: u64,
}

impl LrSchedule {
    /// `lr` at every step.
    pub fn constant(lr: f64) -> LrSchedule {
        LrSchedule {
            peak: lr,
            warmup: 0,
            decay: Decay::None,
            min_ratio: 1.0,
            total: 0,
        }
    }

    /// Whether every step gets the same lr.
    pub fn is_constant(&self) -> bool {
        self.warmup == 0 && (self.decay == Decay::None || self.min_ratio == 1.0)
    }

    /// Refuses a schedule that cannot mean what it says, naming the flag.
    pub fn check(&self) -> Result<(), String> {
        if !(self.peak > 0.0 && self.peak.is_finite()) {
            return Err(format!("--lr must be a positive number, got {}", self.peak));
        }
        if !(0.0..=1.0).contains(&self.min_ratio) {
            return Err(format!(
                "--lr-min-ratio must be in [0, 1] (a fraction of --lr), got {}",
                self.min_ratio
            ));
        }
        if self.decay != Decay::None && self.warmup >= self.total {
            return Err(format!(
                "--lr-decay {}: the decay runs from the end of the warm-up (step {}) to the last step ({}), which leaves it no step; give fewer --lr-warmup steps or more --steps",
                self.decay, self.warmup, self.total
            ));
        }
        Ok(())
    }

    /// The lr of step `step` (1-based, as `StepMetrics::step`). Past `total` the floor holds.
    pub fn at(&self, step: u64) -> f64 {
        if step <= self.warmup {
            // peak/warmup at step 1, the peak at step `warmup`: never a step of lr 0.
            return self.peak * step as f64 / self.warmup as f64;
        }
        let floor = self.peak * self.min_ratio;
        // Fraction of the decay done after this step: 1/len at the first step after the
        // warm-up, 1 at `total`.
        let len = self.total.saturating_sub(self.warmup).max(1);
        let done = ((step - self.warmup) as f64 / len as f64).min(1.0);
        match self.decay {
            Decay::None => self.peak,
            // peak - (peak - floor)·done
            Decay::Linear => self.peak - (self.peak - floor) * done,
            // floor + (peak - floor)·(1 + cos(π·done))/2
            Decay::Cosine => {
                floor + (self.peak - floor) * 0.5 * (1.0 + (std::f64::consts::PI * done).cos())
            }
        }
    }
}

impl fmt::Display for Decay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Decay::None => "none",
            Decay::Linear => "linear",
            Decay::Cosine => "cosine",
        })
    }
}

impl fmt::Display for LrSchedule {
    /// `0.001`, or `0.001, warm-up 100 steps, cosine to 0.1x at step 1000`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.peak)?;
        if self.warmup > 0 {
            write!(f, ", warm-up {} steps", self.warmup)?;
        }
        if self.decay != Decay::None {
            write!(
                f,
                ", {} to {}x at step {}",
                self.decay, self.min_ratio, self.total
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(warmup: u64, decay: Decay) -> LrSchedule {
        LrSchedule {
            peak: 1.0,
            warmup,
            decay,
            min_ratio: 0.1,
            total: 10,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn warm_up_climbs_in_equal_steps_to_the_peak() {
        let s = schedule(4, Decay::None);
        let lrs: Vec<f64> = (1..=6).map(|n| s.at(n)).collect();
        assert_eq!(lrs, [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]);
        assert!(!s.is_constant());
    }

    #[test]
    fn decays_end_at_the_floor_on_the_last_step() {
        for decay in [Decay::Linear, Decay::Cosine] {
            let s = schedule(2, decay);
            assert_eq!(s.at(2), 1.0, "{decay}: the warm-up ends at the peak");
            assert!(close(s.at(10), 0.1), "{decay}: {}", s.at(10));
            assert!(
                close(s.at(11), 0.1),
                "{decay}: past the end the floor holds"
            );
            let lrs: Vec<f64> = (2..=10).map(|n| s.at(n)).collect();
            assert!(lrs.windows(2).all(|w| w[1] < w[0]), "{decay}: {lrs:?}");
        }
        // Halfway through the decay (step 6 of warm-up 2, total 10): the mean of peak and floor
        // for both; a quarter of the way the cosine is still above the line.
        let (linear, cosine) = (schedule(2, Decay::Linear), schedule(2, Decay::Cosine));
        assert!(close(linear.at(6), 0.55) && close(cosine.at(6), 0.55));
        assert!(close(linear.at(4), 0.775), "{}", linear.at(4));
        assert!(cosine.at(4) > linear.at(4));
    }

    #[test]
    fn constant_is_the_peak_everywhere() {
        let s = LrSchedule::constant(3e-4);
        assert!(s.is_constant());
        assert!((1..5).all(|n| s.at(n) == 3e-4));
        assert_eq!(s.to_string(), "0.0003");
        s.check().unwrap();
    }

    #[test]
    fn impossible_schedules_name_the_flag() {
        let mut s = schedule(10, Decay::Cosine);
        assert!(s.check().unwrap_err().contains("--lr-warmup"));
        s.warmup = 2;
        s.min_ratio = 1.5;
        assert!(s.check().unwrap_err().contains("--lr-min-ratio"));
        s.min_ratio = 0.1;
        s.peak = f64::NAN;
        assert!(s.check().unwrap_err().contains("--lr must be a positive"));
        // Warm-up alone over the whole run is fine: no decay needs steps after it.
        schedule(10, Decay::None).check().unwrap();
    }
}
