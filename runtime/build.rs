//! Tells the tests which SIMD paths this machine runs, so that a test of a path the cpu lacks is
//! reported by `cargo test` as ignored, with the reason, instead of passing without running.
//! The kernels themselves choose their path at run time (`is_x86_feature_detected!`); only the
//! tests read these cfgs. Where the build machine is not the test machine (cross builds), no cfg
//! is set and those tests say they were not run.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(host_has_avx2)");
    println!("cargo::rustc-check-cfg=cfg(host_has_avx512f)");
    println!("cargo::rerun-if-changed=build.rs");
    let native = std::env::var("HOST").ok() == std::env::var("TARGET").ok();
    #[cfg(target_arch = "x86_64")]
    if native {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            println!("cargo::rustc-cfg=host_has_avx2");
        }
        if is_x86_feature_detected!("avx512f") {
            println!("cargo::rustc-cfg=host_has_avx512f");
        }
    }
    let _ = native;
}
