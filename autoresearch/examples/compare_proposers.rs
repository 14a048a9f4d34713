//! The proposers at the same budget on seeded synthetic objectives with known optima: for each
//! seed and proposer, how far the search's final pipeline is from the optimum (its true step
//! time over the optimum's; 1.000 is the optimum) and how many pairs it timed.
//!
//! `cargo run --release -p graphtrain-autoresearch --example compare_proposers -- [EXPERIMENTS] [SEEDS]`

use graphtrain_autoresearch::journal::Journal;
use graphtrain_autoresearch::propose::{by_name, BUILT_IN};
use graphtrain_autoresearch::search::Search;
use graphtrain_autoresearch::space::Space;
use graphtrain_autoresearch::synthetic::Synthetic;
use std::time::Duration;

fn main() -> Result<(), String> {
    let mut args = std::env::args().skip(1);
    let experiments: usize = args
        .next()
        .map_or(Ok(30), |a| a.parse())
        .map_err(|e| format!("EXPERIMENTS: {e}"))?;
    let seeds: u64 = args
        .next()
        .map_or(Ok(5), |a| a.parse())
        .map_err(|e| format!("SEEDS: {e}"))?;
    println!(
        "{experiments} experiments per search; gap = final pipeline's true step time / optimum's"
    );
    println!(
        "{:>4}  {:>20}  {:>20}  {:>20}",
        "seed", BUILT_IN[0], BUILT_IN[1], BUILT_IN[2]
    );
    let mut sums = [0.0; 3];
    for seed in 0..seeds {
        let f = Synthetic::random(Space::builtin(false), seed, 0.1);
        let (_, best) = f.optimum(None).ok_or("no valid candidate")?;
        let mut row = format!("{seed:>4}");
        for (i, name) in BUILT_IN.iter().enumerate() {
            let dir = std::env::temp_dir().join(format!(
                "compare-proposers-{}-{name}-{seed}",
                std::process::id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            let mut journal = Journal::open(&dir)?;
            let space = Space::builtin(false);
            let search = Search {
                start: space.parse("none")?,
                space,
                rule: Default::default(),
                seed,
                experiments,
                aa_every: 0,
                deadline: None,
                memory_cap: None,
                prefilter: true,
            };
            let out = search.run(
                &mut journal,
                by_name(name, Duration::from_secs(1))?.as_mut(),
                &mut f.clone(),
                |_, _| {},
            )?;
            let gap = f.true_time(&f.space.parse(&out.incumbent)?) / best;
            let pairs: usize = journal.lines.iter().map(|l| l.pairs).sum();
            sums[i] += gap;
            row += &format!("  {gap:>9.3} {pairs:>5} pairs");
            drop(journal);
            let _ = std::fs::remove_dir_all(&dir);
        }
        println!("{row}");
    }
    let n = seeds as f64;
    println!(
        "mean  {:>20.3}  {:>20.3}  {:>20.3}",
        sums[0] / n,
        sums[1] / n,
        sums[2] / n
    );
    Ok(())
}
