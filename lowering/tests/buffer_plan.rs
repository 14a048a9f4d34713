//! The buffer plan on real train steps: no two buffers live at the same time overlap, donated
//! outputs reuse their input's bytes, and the arena stays close to the liveness lower bound;
//! planned in windows (a device whose buffers hold less than the arena), no buffer crosses a
//! window's edge.

use graphtrain_ir::autocast::{autocast, Precision};
use graphtrain_ir::optim::{build_train_step, OptimConfig};
use graphtrain_ir::{DType, Graph};
use graphtrain_lowering::program::kept_composite;
use graphtrain_lowering::{lower, plan_buffers, BufferPlan, Mode};
use graphtrain_models::Llama3Config;

fn step(name: &str) -> Graph {
    step_in(name, Precision::F32)
}

fn step_in(name: &str, precision: Precision) -> Graph {
    let cfg = Llama3Config::builtin(name).unwrap();
    let mut forward = cfg.trace(DType::F32).unwrap();
    forward.graph = autocast(&forward.graph, precision).unwrap();
    build_train_step(forward, "loss", &OptimConfig::default())
        .unwrap()
        .graph
}

fn check(g: &Graph, alignment: usize) -> BufferPlan {
    let plan = plan_buffers(g, alignment);
    check_placement(&plan, alignment);
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

/// Buffers aligned, inside the arena, apart while both live, and each inside one window when
/// the plan has windows.
fn check_placement(plan: &BufferPlan, alignment: usize) {
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
        if let (Some(w), true) = (plan.window, b[i].bytes > 0) {
            assert_eq!(
                b[i].offset / w,
                (b[i].offset + b[i].bytes - 1) / w,
                "buffer {i} crosses a window's edge: {:?}",
                b[i]
            );
        }
    }
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

/// `peer`'s lowered step (225 MiB) planned again in 64 MiB windows, as a device whose buffers
/// hold 64 MiB needs it: sound, every buffer inside one window, and no more than a window's
/// worth larger than the plan in one piece. A window smaller than its largest value is refused,
/// naming the value.
#[test]
fn peer_plans_in_windows_of_a_device_buffer() {
    let kept = |op: &graphtrain_ir::Op| op.is_composite() && !kept_composite(op);
    let primitives = graphtrain_ir::decompose::decompose(&step("peer"), &kept).unwrap();
    let mut program = lower(&primitives, Mode::Fused).unwrap();
    let whole = program.plan.arena_bytes;
    let window = 64 << 20;
    program.plan_in_windows(window).unwrap();
    let plan = &program.plan;
    println!("peer: {plan} (in one piece: {whole} bytes)");
    assert_eq!(plan.window, Some(window));
    check_placement(plan, plan.alignment);
    assert!(plan.arena_bytes > 3 * window, "{plan}");
    assert!(plan.arena_bytes <= whole + window, "{plan}");
    let refused = program.plan_in_windows(1 << 20).unwrap_err();
    assert!(
        refused.contains("is larger than one buffer of 1.00 MiB"),
        "{refused}"
    );
}

/// `peer`'s bf16-mixed step with its bf16 products stored in 2 bytes (the cpu backend's
/// Program): sound, each buffer as large as its values' bytes (2 an element for the values
/// stored so), and the arena smaller than with every value in a 4-byte slot.
#[test]
fn peer_bf16_products_in_two_bytes_plan_soundly_and_smaller() {
    let kept = |op: &graphtrain_ir::Op| op.is_composite() && !kept_composite(op);
    let primitives =
        graphtrain_ir::decompose::decompose(&step_in("peer", Precision::Bf16Mixed), &kept).unwrap();
    let mut program = lower(&primitives, Mode::Fused).unwrap();
    let in_slots = program.plan.arena_bytes;
    let chosen = program.store_bf16_in_two_bytes();
    let plan = &program.plan;
    println!(
        "peer bf16-mixed: {chosen} values in 2 bytes; {plan} (in 4-byte slots: {in_slots} bytes)"
    );
    assert!(chosen > 0);
    check_placement(plan, plan.alignment);
    for b in &plan.buffers {
        for v in &b.values {
            assert!(
                b.bytes >= program.value_bytes(*v),
                "{v:?} needs {} bytes, its buffer holds {}",
                program.value_bytes(*v),
                b.bytes
            );
            if program.is_two_byte(*v) {
                assert_eq!(program.value_bytes(*v), 2 * program.graph.ty(*v).numel());
            }
        }
    }
    assert!(plan.arena_bytes < in_slots, "{plan}");
}
