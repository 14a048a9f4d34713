//! Tells the tests whether this machine has a Vulkan driver for the wgpu backend (lavapipe, from
//! `scripts/setup.sh`, or a GPU's), so that where it has none `cargo test` reports the wgpu
//! halves as not run (an ignored test with the reason) rather than passing them silently. Metal
//! (macOS) and DX12 (Windows) need no driver file. The tests still ask wgpu for an adapter at
//! run time; this only decides what is reported.

use std::path::Path;

const ICD_DIRS: &[&str] = &[
    "/usr/share/vulkan/icd.d",
    "/usr/local/share/vulkan/icd.d",
    "/etc/vulkan/icd.d",
];

fn main() {
    println!("cargo::rustc-check-cfg=cfg(vulkan_driver_found)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=VK_ICD_FILENAMES");
    println!("cargo::rerun-if-env-changed=VK_DRIVER_FILES");
    for dir in ICD_DIRS {
        if Path::new(dir).exists() {
            println!("cargo::rerun-if-changed={dir}");
        }
    }
    let os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    let from_env = ["VK_ICD_FILENAMES", "VK_DRIVER_FILES"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    let icd_file = ICD_DIRS.iter().any(|dir| {
        std::fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.path().extension().is_some_and(|x| x == "json"))
        })
    });
    if os == "macos" || os == "windows" || from_env || icd_file {
        println!("cargo::rustc-cfg=vulkan_driver_found");
    }
}
