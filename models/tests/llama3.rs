//! The traced Llama 3 train step: its text form is snapshotted for `tiny`, and every built-in
//! config traces, verifies, round-trips through the text format and RON, and has the expected
//! parameter count.

use graphtrain_ir::optim::{build_train_step, OptimConfig};
use graphtrain_ir::stats::GraphStats;
use graphtrain_ir::{ron_io, text, verify, DType, Graph};
use graphtrain_models::{Llama3Config, LLAMA3_CONFIGS};

fn train_step(name: &str) -> Graph {
    let cfg = Llama3Config::builtin(name).unwrap();
    cfg.validate().unwrap();
    let traced = cfg.trace(DType::F32).unwrap();
    build_train_step(traced, "loss", &OptimConfig::default())
        .unwrap()
        .graph
}

#[test]
fn tiny_train_step_snapshot() {
    let g = train_step("tiny");
    verify(&g).unwrap();
    insta::assert_snapshot!(text::print(&g));
}

#[test]
fn every_config_verifies_and_round_trips() {
    for name in LLAMA3_CONFIGS {
        let cfg = Llama3Config::builtin(name).unwrap();
        let g = train_step(name);
        verify(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(
            g.is_canonical(),
            "{name}: traced graph is not canonically numbered"
        );
        let printed = text::print(&g);
        let parsed = text::parse(&printed).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(parsed == g, "{name}: parse(print(g)) != g");
        if *name != "405b" {
            let back = ron_io::from_ron(&ron_io::to_ron(&g)).unwrap();
            assert!(back == g, "{name}: RON round trip differs");
        }
        let stats = GraphStats::of(&g);
        assert_eq!(
            stats.param_count,
            cfg.num_params(),
            "{name}: parameter count"
        );
    }
}

#[test]
fn llama3_8b_has_8b_parameters() {
    let cfg = Llama3Config::builtin("8b").unwrap();
    // Meta reports 8.03B for Llama 3.1 8B.
    assert_eq!(cfg.num_params(), 8_030_261_248);
}

#[test]
fn bad_config_fields_are_refused() {
    let mut cfg = Llama3Config::builtin("tiny").unwrap();
    cfg.n_kv_heads = 3;
    assert!(cfg.validate().unwrap_err().contains("n_kv_heads"));
    cfg.n_kv_heads = 2;
    cfg.dim = 30;
    assert!(cfg.validate().unwrap_err().contains("divisible"));
}
