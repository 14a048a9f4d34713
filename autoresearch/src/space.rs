//! The search space: which passes run, in what order, with what options. Each knob is one pass
//! at a fixed place in the pipeline, off or on with one of its options; a candidate picks one
//! choice per knob. Constraints between passes are data (`Rule`), checked before anything runs.

use serde::{Deserialize, Serialize};

/// One pass at its place in the pipeline: `choices[i]` is `off`, `on` (no option) or an option;
/// the first after `off` is the pass's default (what a bare name in a pipeline means).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Knob {
    pub pass: String,
    pub choices: Vec<String>,
}

/// A constraint between knobs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Rule {
    /// `pass` (in any choice but `off`) needs `needs` on.
    Requires { pass: String, needs: String },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Space {
    pub knobs: Vec<Knob>,
    pub rules: Vec<Rule>,
}

/// A choice index per knob.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Candidate(pub Vec<usize>);

fn knob(pass: &str, choices: &[&str]) -> Knob {
    Knob {
        pass: pass.into(),
        choices: choices.iter().map(|c| c.to_string()).collect(),
    }
}

impl Space {
    /// graphtrain's passes for one device, and with `mesh` the collective passes too. The order
    /// is the pipeline's: the e-graph before activation checkpointing (its hashconsing would
    /// merge recompute copies back), capture last.
    pub fn builtin(mesh: bool) -> Space {
        let mut knobs = vec![
            knob("canonicalize", &["off", "on"]),
            knob("cse", &["off", "on"]),
            knob("egraph", &["off", "on"]),
            knob("dce", &["off", "on"]),
            knob(
                "ac",
                &[
                    "off",
                    "selective",
                    "full",
                    "budget:0.25",
                    "budget:0.5",
                    "budget:0.75",
                ],
            ),
            knob("offload", &["off", "tagged", "tagged;prefetch:2"]),
        ];
        if mesh {
            knobs.extend([
                knob("keep_gathered", &["off", "all", "last:1"]),
                knob("bucket", &["off", "on"]),
                knob("prefetch", &["off", "nodes:32", "nodes:96"]),
                knob("async_tp", &["off", "on"]),
            ]);
        }
        knobs.push(knob("capture", &["off", "on", "min:8"]));
        Space {
            knobs,
            rules: vec![Rule::Requires {
                pass: "offload".into(),
                needs: "ac".into(),
            }],
        }
    }

    /// Checks the space itself: choices, rules naming its knobs, and every pass known.
    pub fn check(&self, known: impl Fn(&str) -> bool) -> Result<(), String> {
        for k in &self.knobs {
            if !known(&k.pass) {
                return Err(format!(
                    "the search space names an unknown pass `{}`",
                    k.pass
                ));
            }
            if k.choices.first().map(String::as_str) != Some("off") || k.choices.len() < 2 {
                return Err(format!(
                    "knob `{}`: the first choice must be `off`, and there must be another",
                    k.pass
                ));
            }
        }
        for r in &self.rules {
            let Rule::Requires { pass, needs } = r;
            for p in [pass, needs] {
                if !self.knobs.iter().any(|k| &k.pass == p) {
                    return Err(format!("a rule names `{p}`, which is no knob"));
                }
            }
        }
        Ok(())
    }

    /// The pipeline a candidate runs, as `--passes` takes it (`none` when every knob is off).
    pub fn pipeline(&self, c: &Candidate) -> String {
        let parts: Vec<String> = self
            .knobs
            .iter()
            .zip(&c.0)
            .filter(|(k, &i)| k.choices[i] != "off")
            .map(|(k, &i)| match k.choices[i].as_str() {
                "on" => k.pass.clone(),
                option => format!("{}={option}", k.pass),
            })
            .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(",")
        }
    }

    /// Whether `c` picks a choice per knob and breaks no rule; why not otherwise.
    pub fn validate(&self, c: &Candidate) -> Result<(), String> {
        if c.0.len() != self.knobs.len() {
            return Err(format!(
                "a candidate picks {} choices for {} knobs",
                c.0.len(),
                self.knobs.len()
            ));
        }
        for (k, &i) in self.knobs.iter().zip(&c.0) {
            if i >= k.choices.len() {
                return Err(format!("knob `{}` has no choice {i}", k.pass));
            }
        }
        let on = |pass: &str| {
            self.knobs
                .iter()
                .zip(&c.0)
                .any(|(k, &i)| k.pass == pass && k.choices[i] != "off")
        };
        for r in &self.rules {
            let Rule::Requires { pass, needs } = r;
            if on(pass) && !on(needs) {
                return Err(format!("`{pass}` needs `{needs}`"));
            }
        }
        Ok(())
    }

    /// The candidate running `pipeline` (`none`, or passes of this space in its order).
    pub fn parse(&self, pipeline: &str) -> Result<Candidate, String> {
        let mut c = Candidate(vec![0; self.knobs.len()]);
        if pipeline.trim() == "none" {
            return Ok(c);
        }
        let mut next = 0;
        for item in pipeline.split(',').map(str::trim) {
            let (pass, choice) = match item.split_once('=') {
                Some((p, o)) => (p, o),
                None => (item, "on"),
            };
            let at = self.knobs[next..]
                .iter()
                .position(|k| k.pass == pass)
                .map(|i| i + next)
                .ok_or_else(|| {
                    format!("`{item}`: not a knob of the search space after the ones before it")
                })?;
            let choices = &self.knobs[at].choices;
            // A bare name is the pass with its default option: `on`, or the first after `off`.
            let choice = if choice == "on" && !choices.iter().any(|c| c == "on") {
                choices[1].as_str()
            } else {
                choice
            };
            let i = choices.iter().position(|ch| ch == choice).ok_or_else(|| {
                format!("`{item}`: `{pass}` takes {:?} here", self.knobs[at].choices)
            })?;
            c.0[at] = i;
            next = at + 1;
        }
        self.validate(&c)?;
        Ok(c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelines_round_trip_and_rules_hold() {
        let s = Space::builtin(false);
        s.check(|_| true).unwrap();
        let c = s
            .parse("canonicalize,cse,dce,ac=full,offload=tagged,capture")
            .unwrap();
        assert_eq!(
            s.pipeline(&c),
            "canonicalize,cse,dce,ac=full,offload=tagged,capture"
        );
        assert_eq!(s.pipeline(&s.parse("none").unwrap()), "none");
        let e = s.parse("offload=tagged").unwrap_err();
        assert!(e.contains("`offload` needs `ac`"), "{e}");
        assert!(s
            .parse("capture,cse")
            .unwrap_err()
            .contains("after the ones before"));
        assert!(s.parse("ac=half").unwrap_err().contains("takes"));
        let e = s.check(|p| p != "egraph").unwrap_err();
        assert!(e.contains("unknown pass `egraph`"), "{e}");
    }
}
