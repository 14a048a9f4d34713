//! The buffer plan on real train steps: no two buffers live at the same time overlap, donated
//! outputs reuse their input's bytes, and the arena stays close to the liveness lower bound.

use graphtrain_ir::optim::{build_train_step, OptimConfig};
use graphtrain_ir::{DType, Graph};
use graphtrain_lowering::plan_buffers;
use graphtrain_models::Llama3Config;

fn step(name: &str) -> Graph {
    let cfg = Llama3Config::builtin(name).unwrap();
    build_train_step(
        cfg.trace(DType::F32).unwrap(),
        "loss",
        &OptimConfig::default(),
    )
    .unwrap()
    .graph
}

fn check(g: &Graph, alignment: usize) -> graphtrain_lowering::BufferPlan {
    let plan = plan_buffers(g, alignment);
    let b = &plan.buffers;
    for i in 0..b.len() {
        assert_eq!(b[i].offset % alignment, 0);
        assert!(b[i].offset + b[i].bytes <= plan.arena_bytes);
        for j in i + 1..b.len() {
            let live_together = b[i].live.0 <= b[j].live.1 && b[j].live.0 <= b[i].live.1;
            let apart =
                b[i].offset + b[i].bytes <= b[j].offset || b[j].offset + b[j].bytes <= b[i].offset;
            assert!(
                !live_together || apart || b[i].bytes == 0 || b[j].bytes == 0,
                "buffers {i} and {j} overlap while both live: {:?} {:?}",
                b[i],
                b[j]
            );
        }
    }
    for o in &g.outputs {
        if let Some(src) = o.donates {
            assert_eq!(
                plan.offset_of(o.value),
                plan.offset_of(src),
                "`{}` is not updated in place",
                o.name
            );
        }
    }
    // Every value that something defines has a buffer.
    for (v, _) in g.values.iter().enumerate() {
        assert!(plan.buffer_of[v].is_some(), "value {v} has no buffer");
    }
    assert!(plan.arena_bytes >= plan.lower_bound);
    plan
}

#[test]
fn tiny_plan_is_sound() {
    let plan = check(&step("tiny"), 64);
    println!("tiny: {plan}");
}

#[test]
fn peer_plan_is_sound_and_tight() {
    let plan = check(&step("peer"), 64);
    println!("peer: {plan}");
    // Greedy-by-size stays within 10% of the liveness lower bound on the train step.
    assert!(
        plan.arena_bytes as f64 <= 1.10 * plan.lower_bound as f64,
        "{plan}"
    );
}
