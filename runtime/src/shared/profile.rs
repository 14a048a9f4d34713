//! The profile both executors keep when `RuntimeOptions::profile` asks for one: every step
//! waited for and timed, grouped by what it does, reported slowest first.

use graphtrain_lowering::{Program, Step, View};
use std::time::Duration;

/// One profile entry: what (`profile_key`), time, launches, FLOPs per launch.
pub(crate) type ProfileEntry = (String, Duration, usize, f64);

/// The profile, slowest entries first, `shown` of them.
pub(crate) fn profile_report(p: &mut [ProfileEntry], shown: usize) -> String {
    p.sort_by_key(|e| std::cmp::Reverse(e.1));
    let total: Duration = p.iter().map(|e| e.1).sum();
    let mut out = format!(
        "profile over all runs but the first (each step waited for): {:.3}s\n",
        total.as_secs_f64()
    );
    for (k, d, n, flops) in p.iter().take(shown) {
        let rate = if *flops > 0.0 {
            format!(
                "  {:.0} GFLOP/s",
                flops * *n as f64 / d.as_secs_f64().max(1e-12) / 1e9
            )
        } else {
            String::new()
        };
        out += &format!(
            "  {:>8.3}s {:>5.1}% {:>7} launches  {k}{rate}\n",
            d.as_secs_f64(),
            100.0 * d.as_secs_f64() / total.as_secs_f64().max(1e-12),
            n
        );
    }
    out
}

/// Groups steps for the profile: matmuls by shape and operand layout (with their FLOPs, so
/// the report can give GFLOP/s), other steps by kind and size class.
pub(crate) fn profile_key(p: &Program, s: &Step) -> (String, f64) {
    if let Step::Matmul {
        a,
        b,
        batch,
        m,
        n,
        k,
        ..
    } = s
    {
        // A view is read transposed when its rows are not contiguous.
        let t = |v: &View| if v.strides[2] == 1 { "" } else { "^T" };
        let flops = 2.0 * (*batch * *m * *n * *k) as f64;
        return (
            format!("matmul [{batch}] {m}x{k}{} @ {k}x{n}{}", t(a), t(b)),
            flops,
        );
    }
    let n = p.graph.ty(s.writes()).numel();
    let class = match n {
        0..=4095 => "<4K",
        4096..=262_143 => "4K-256K",
        262_144..=2_097_151 => "256K-2M",
        _ => ">=2M",
    };
    (format!("{} {class} elems", s.kind()), 0.0)
}
