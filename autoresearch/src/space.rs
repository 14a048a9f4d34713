//! The search space: which passes run, in what order, with what options, and the lowering and
//! runtime settings the step runs with. Each pass knob is one pass at a fixed place in the
//! pipeline, off or on with one of its options; each setting knob (after the passes) is one
//! setting, `default` or a value. A candidate picks one choice per knob; its text is the pass
//! list followed by `setting=value` for each setting away from its default. Constraints between
//! passes are data (`Rule`), checked before anything runs.

use serde::{Deserialize, Serialize};

/// One pass at its place in the pipeline: `choices[i]` is `off`, `on` (no option) or an option;
/// the first after `off` is the pass's default (what a bare name in a pipeline means). Or, with
/// `setting`, a lowering or runtime setting named `pass`: `choices[0]` is `default`, the others
/// its values. Choice 0 is always the knob left alone.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Knob {
    pub pass: String,
    pub choices: Vec<String>,
    #[serde(default)]
    pub setting: bool,
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
        setting: false,
    }
}

fn setting(name: &str, values: &[&str]) -> Knob {
    Knob {
        pass: name.into(),
        choices: std::iter::once("default")
            .chain(values.iter().copied())
            .map(String::from)
            .collect(),
        setting: true,
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
            // Before `ac`, which may recompute attention's operands in backward.
            knob("attention_stats", &["off", "on"]),
            // The default pipeline's; it changes only meshes under mixed precision (elsewhere
            // both choices give one fingerprint, and the search measures it once).
            knob("gather_bf16", &["off", "on"]),
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
        // After `async_tp`, whose patterns look for one matmul per weight.
        knobs.push(knob("merge_matmuls", &["off", "on", "any"]));
        knobs.push(knob("capture", &["off", "on", "min:8"]));
        Space {
            knobs,
            rules: vec![Rule::Requires {
                pass: "offload".into(),
                needs: "ac".into(),
            }],
        }
    }

    /// `builtin(mesh)` and the settings graphtrain's cpu backend is tuned by: fusion limits of
    /// the lowering, the GEMM kernel, the maps' vector width, and on a mesh the compute threads of each rank.
    pub fn builtin_with_settings(mesh: bool) -> Space {
        let mut space = Space::builtin(mesh);
        space.knobs.extend([
            setting("fusion.max_expr_nodes", &["16", "96"]),
            setting("fusion.converge_hops", &["2", "12"]),
            setting("gemm", &["avx2"]),
            setting("map_vector", &["8"]),
        ]);
        if mesh {
            space.knobs.push(setting("threads_per_rank", &["1", "2"]));
        }
        space
    }

    /// Checks the space itself: choices, rules naming its knobs, every pass known (`known`)
    /// and every setting after the passes.
    pub fn check(&self, known: impl Fn(&str) -> bool) -> Result<(), String> {
        let mut settings = false;
        for k in &self.knobs {
            let what = if k.setting { "setting" } else { "pass" };
            if !known(&k.pass) {
                return Err(format!(
                    "the search space names an unknown {what} `{}`",
                    k.pass
                ));
            }
            let first = if k.setting { "default" } else { "off" };
            if k.choices.first().map(String::as_str) != Some(first) || k.choices.len() < 2 {
                return Err(format!(
                    "knob `{}`: the first choice must be `{first}`, and there must be another",
                    k.pass
                ));
            }
            if settings && !k.setting {
                return Err(format!(
                    "knob `{}`: passes come before settings in the space",
                    k.pass
                ));
            }
            settings |= k.setting;
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
            .filter(|(_, &i)| i != 0)
            .map(|(k, &i)| match k.choices[i].as_str() {
                "on" if !k.setting => k.pass.clone(),
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
                .any(|(k, &i)| k.pass == pass && i != 0)
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
            let choice = if self.knobs[at].setting {
                choice
            } else if choice == "on" && !choices.iter().any(|c| c == "on") {
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

    #[test]
    fn settings_follow_the_passes_and_round_trip() {
        let s = Space::builtin_with_settings(true);
        s.check(|_| true).unwrap();
        let text = "cse,bucket,capture,fusion.max_expr_nodes=16,gemm=avx2,threads_per_rank=2";
        assert_eq!(s.pipeline(&s.parse(text).unwrap()), text);
        assert_eq!(
            s.pipeline(&s.parse("fusion.converge_hops=2").unwrap()),
            "fusion.converge_hops=2"
        );
        // A setting's value is never implied: a bare name is refused.
        assert!(s.parse("gemm").unwrap_err().contains("takes"));
        assert!(s
            .parse("gemm=avx2,cse")
            .unwrap_err()
            .contains("after the ones before"));
        let mut misplaced = s.clone();
        misplaced.knobs.swap(0, s.knobs.len() - 1);
        let e = misplaced.check(|_| true).unwrap_err();
        assert!(
            e.contains("first choice must be `off`") || e.contains("passes come before"),
            "{e}"
        );
    }
}
