//! The integer linear program `autoshard` solves, with CBC through good_lp.
//!
//! Variables (all binary): `x[c][k]`, class `c` takes candidate `k` (its placement on every
//! mesh dimension); `y[g][j]`, group `g` takes combination `j` of its classes' tensor-parallel
//! placements. Constraints: one candidate per class, one combination per group; a group's
//! combination agrees with its classes' candidates (for each class and each of its `tp`
//! placements, the combinations with that placement sum to the candidates with it); the memory
//! limit; each earlier proposal excluded (no-good cuts). Objective: the time (or, to find the
//! smallest memory, the bytes) the chosen candidates and combinations add to the base.

use good_lp::solvers::coin_cbc::coin_cbc;
use good_lp::{
    variable, Expression, ProblemVariables, ResolutionError, Solution, SolverModel, Variable,
};

/// What a choice adds to the base plan, by the cost model.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Delta {
    pub seconds: f64,
    pub bytes: f64,
}

pub struct ClassVars {
    /// Per candidate: the index of its `tp` placement among the class's, and what it adds.
    pub candidates: Vec<(usize, Delta)>,
    /// Candidates the user's fixed placements rule out.
    pub allowed: Vec<bool>,
}

pub struct GroupVars {
    /// The classes of the group, in the order of each combination's placements.
    pub classes: Vec<usize>,
    /// Per combination: each class's `tp` placement index, and what the combination adds.
    pub combos: Vec<(Vec<usize>, Delta)>,
}

pub struct Ilp<'a> {
    pub classes: &'a [ClassVars],
    pub groups: &'a [GroupVars],
    pub base: Delta,
    pub memory_limit: Option<f64>,
    /// Earlier proposals (a candidate per class), each excluded.
    pub excluded: &'a [Vec<usize>],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Minimize {
    Time,
    Memory,
}

/// The chosen candidate per class and the model's total, or `None` when no assignment
/// satisfies the constraints.
pub fn solve(ilp: &Ilp, minimize: Minimize) -> Result<Option<(Vec<usize>, Delta)>, String> {
    let mut vars = ProblemVariables::new();
    let x: Vec<Vec<Variable>> = ilp
        .classes
        .iter()
        .map(|c| {
            c.candidates
                .iter()
                .map(|_| vars.add(variable().binary()))
                .collect()
        })
        .collect();
    let y: Vec<Vec<Variable>> = ilp
        .groups
        .iter()
        .map(|g| {
            g.combos
                .iter()
                .map(|_| vars.add(variable().binary()))
                .collect()
        })
        .collect();
    let weight = |d: &Delta| match minimize {
        Minimize::Time => d.seconds,
        Minimize::Memory => d.bytes,
    };
    let mut objective = Expression::from(0.0);
    let mut memory = Expression::from(ilp.base.bytes);
    for (c, class) in ilp.classes.iter().enumerate() {
        for (k, (_, d)) in class.candidates.iter().enumerate() {
            objective += weight(d) * x[c][k];
            memory += d.bytes * x[c][k];
        }
    }
    for (g, group) in ilp.groups.iter().enumerate() {
        for (j, (_, d)) in group.combos.iter().enumerate() {
            objective += weight(d) * y[g][j];
            memory += d.bytes * y[g][j];
        }
    }
    let mut model = vars.minimise(objective).using(coin_cbc);
    model.set_log_level(0);
    for (c, class) in ilp.classes.iter().enumerate() {
        let one: Expression = x[c].iter().copied().sum();
        model = model.with(one.eq(1.0));
        for (k, allowed) in class.allowed.iter().enumerate() {
            if !allowed {
                model = model.with(Expression::from(x[c][k]).eq(0.0));
            }
        }
    }
    for (g, group) in ilp.groups.iter().enumerate() {
        let one: Expression = y[g].iter().copied().sum();
        model = model.with(one.eq(1.0));
        for (pos, &c) in group.classes.iter().enumerate() {
            let placements = ilp.classes[c].candidates.iter().map(|(t, _)| *t);
            let most = placements.max().unwrap_or(0);
            for t in 0..=most {
                let combos: Expression = group
                    .combos
                    .iter()
                    .enumerate()
                    .filter(|(_, (tp, _))| tp[pos] == t)
                    .map(|(j, _)| y[g][j])
                    .sum();
                let candidates: Expression = ilp.classes[c]
                    .candidates
                    .iter()
                    .enumerate()
                    .filter(|(_, (tp, _))| *tp == t)
                    .map(|(k, _)| x[c][k])
                    .sum();
                model = model.with(combos.eq(candidates));
            }
        }
    }
    if let Some(limit) = ilp.memory_limit {
        model = model.with(memory.leq(limit));
    }
    for chosen in ilp.excluded {
        let same: Expression = chosen.iter().enumerate().map(|(c, &k)| x[c][k]).sum();
        model = model.with(same.leq(chosen.len() as f64 - 1.0));
    }
    let solution = match model.solve() {
        Ok(s) => s,
        Err(ResolutionError::Infeasible) => return Ok(None),
        Err(e) => return Err(format!("the MILP solver (CBC) failed: {e}")),
    };
    // The binary set to 1 among `vars` (the largest value, against solver round-off).
    let taken = |vars: &[Variable]| {
        (0..vars.len()).max_by(|&a, &b| solution.value(vars[a]).total_cmp(&solution.value(vars[b])))
    };
    let mut total = ilp.base;
    let mut add = |d: &Delta| {
        total.seconds += d.seconds;
        total.bytes += d.bytes;
    };
    let mut chosen = Vec::with_capacity(ilp.classes.len());
    for (class, vars) in ilp.classes.iter().zip(&x) {
        let k = taken(vars).ok_or("a class without candidates")?;
        add(&class.candidates[k].1);
        chosen.push(k);
    }
    for (group, vars) in ilp.groups.iter().zip(&y) {
        let j = taken(vars).ok_or("a group without combinations")?;
        add(&group.combos[j].1);
    }
    Ok(Some((chosen, total)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(seconds: f64, bytes: f64) -> Delta {
        Delta { seconds, bytes }
    }

    /// Two classes of two `tp` placements each in one group: split together they save 5 s but
    /// take 100 bytes more; the second split alone costs 1 s; the first alone does not build.
    fn problem() -> (Vec<ClassVars>, Vec<GroupVars>) {
        let class = || ClassVars {
            candidates: vec![(0, d(0.0, 0.0)), (1, d(1.0, 0.0))],
            allowed: vec![true, true],
        };
        let group = GroupVars {
            classes: vec![0, 1],
            combos: vec![
                (vec![0, 0], d(0.0, 0.0)),
                (vec![0, 1], d(0.0, 0.0)),
                (vec![1, 1], d(-5.0, 100.0)),
            ],
        };
        (vec![class(), class()], vec![group])
    }

    fn solve_with(
        limit: Option<f64>,
        excluded: &[Vec<usize>],
        allowed: Option<Vec<bool>>,
    ) -> Option<(Vec<usize>, Delta)> {
        let (mut classes, groups) = problem();
        if let Some(a) = allowed {
            classes[1].allowed = a;
        }
        let ilp = Ilp {
            classes: &classes,
            groups: &groups,
            base: d(10.0, 1000.0),
            memory_limit: limit,
            excluded,
        };
        solve(&ilp, Minimize::Time).unwrap()
    }

    #[test]
    fn picks_the_cheapest_consistent_choice_under_the_constraints() {
        // Both split: 10 + 1 + 1 - 5.
        assert_eq!(
            solve_with(None, &[], None),
            Some((vec![1, 1], d(7.0, 1100.0)))
        );
        // The limit rules out the pair; the second alone costs more than neither.
        assert_eq!(
            solve_with(Some(1050.0), &[], None),
            Some((vec![0, 0], d(10.0, 1000.0)))
        );
        // An excluded proposal is not proposed again.
        assert_eq!(
            solve_with(None, &[vec![1, 1]], None),
            Some((vec![0, 0], d(10.0, 1000.0)))
        );
        assert_eq!(
            solve_with(None, &[vec![1, 1], vec![0, 0]], None),
            Some((vec![0, 1], d(11.0, 1000.0)))
        );
        // The first alone never builds, so nothing is left after these three.
        assert_eq!(
            solve_with(None, &[vec![1, 1], vec![0, 0], vec![0, 1]], None),
            None
        );
        // A fixed class: the second must stay unsplit, so the pair is out.
        assert_eq!(
            solve_with(None, &[], Some(vec![true, false])),
            Some((vec![0, 0], d(10.0, 1000.0)))
        );
        // Nothing fits under the base.
        assert_eq!(solve_with(Some(10.0), &[], None), None);
    }

    #[test]
    fn minimizing_memory_takes_the_fewest_bytes() {
        let (mut classes, groups) = problem();
        classes[0].candidates[1].1 = d(1.0, -300.0);
        let ilp = Ilp {
            classes: &classes,
            groups: &groups,
            base: d(10.0, 1000.0),
            memory_limit: None,
            excluded: &[],
        };
        let (chosen, total) = solve(&ilp, Minimize::Memory).unwrap().unwrap();
        assert_eq!(chosen, vec![1, 1]);
        assert_eq!(total.bytes, 800.0);
    }
}
