//! Settings that change how fast a step runs and never its graph: the lowering's fusion limits,
//! the cpu backend's GEMM kernel and map vector width, the device backends' matmul kernel, collectives and device
//! graphs, and the compute threads of each rank on a mesh. `--tuning`
//! sets them for `run`, `bench` and `search`; the search's setting knobs vary them, writing them
//! after a candidate's passes in the same `name=value` form (`cse,capture,gemm=avx2`).

use graphtrain_lowering::FusionLimits;
use graphtrain_runtime::options::{
    DeviceCollectives, DeviceGraphs, DeviceMatmul, GemmKernel, MapVector,
};

/// The settings `--tuning` and the search know, in the order a candidate lists them.
pub const SETTINGS: [&str; 9] = [
    "fusion.max_map_inputs",
    "fusion.max_expr_nodes",
    "fusion.converge_hops",
    "gemm",
    "map_vector",
    "device_matmul",
    "device_collectives",
    "device_graphs",
    "threads_per_rank",
];

/// Lowering and runtime settings; each unset one is the default.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Tuning {
    pub fusion: FusionLimits,
    /// The GEMM kernel (`GRAPHTRAIN_GEMM_KERNEL` when unset).
    pub gemm: Option<GemmKernel>,
    /// The lanes of the cpu backend's map kernels (the widest the cpu has when unset).
    pub map_vector: Option<MapVector>,
    /// The device backends' matmul kernel (tiled on `cuda`, one unit per output on `wgpu`,
    /// when unset).
    pub device_matmul: Option<DeviceMatmul>,
    /// How the device backends move collectives (NCCL on `cuda` with several ranks, through
    /// host memory otherwise, when unset).
    pub device_collectives: Option<DeviceCollectives>,
    /// Whether the device backends replay captured regions as device graphs (on when unset).
    pub device_graphs: Option<DeviceGraphs>,
    /// Compute threads of each rank (a mesh's `--threads-per-rank` when unset).
    pub threads_per_rank: Option<usize>,
}

impl Tuning {
    /// `name=value` entries, comma-separated (empty: every default); a later entry for the same
    /// setting wins. Values are checked here, limits against each other when the step lowers.
    pub fn parse(text: &str) -> Result<Tuning, String> {
        let mut t = Tuning::default();
        for entry in text.split(',').map(str::trim).filter(|e| !e.is_empty()) {
            let (name, value) = entry
                .split_once('=')
                .ok_or_else(|| format!("`{entry}`: a setting is `name=value`"))?;
            let count = || {
                value
                    .parse::<usize>()
                    .map_err(|_| format!("`{entry}`: `{name}` takes a whole number"))
            };
            match name {
                "fusion.max_map_inputs" => t.fusion.max_map_inputs = count()?,
                "fusion.max_expr_nodes" => t.fusion.max_expr_nodes = count()?,
                "fusion.converge_hops" => t.fusion.converge_hops = count()?,
                "gemm" => {
                    t.gemm = Some(GemmKernel::from_setting(value).ok_or_else(|| {
                        format!("`{entry}`: `gemm` takes {}", GemmKernel::SETTINGS)
                    })?)
                }
                "map_vector" => {
                    t.map_vector = Some(MapVector::from_setting(value).ok_or_else(|| {
                        format!("`{entry}`: `map_vector` takes {}", MapVector::SETTINGS)
                    })?)
                }
                "device_matmul" => {
                    t.device_matmul = Some(match value {
                        "auto" => DeviceMatmul::Auto,
                        "tiled" => DeviceMatmul::Tiled,
                        "per_output" => DeviceMatmul::PerOutput,
                        _ => {
                            return Err(format!(
                                "`{entry}`: `device_matmul` takes auto, tiled or per_output"
                            ))
                        }
                    })
                }
                "device_collectives" => {
                    t.device_collectives = Some(match value {
                        "auto" => DeviceCollectives::Auto,
                        "nccl" => DeviceCollectives::Nccl,
                        "host" => DeviceCollectives::Host,
                        _ => {
                            return Err(format!(
                                "`{entry}`: `device_collectives` takes auto, nccl or host"
                            ))
                        }
                    })
                }
                "device_graphs" => {
                    t.device_graphs = Some(match value {
                        "on" => DeviceGraphs::On,
                        "off" => DeviceGraphs::Off,
                        _ => return Err(format!("`{entry}`: `device_graphs` takes on or off")),
                    })
                }
                "threads_per_rank" => {
                    let n = count()?;
                    if n == 0 {
                        return Err(format!("`{entry}`: at least 1 thread"));
                    }
                    t.threads_per_rank = Some(n);
                }
                _ => {
                    return Err(format!(
                        "`{entry}`: unknown setting `{name}`; settings: {}",
                        SETTINGS.join(", ")
                    ))
                }
            }
        }
        Ok(t)
    }
}

/// A search candidate's text split into its pass list (`none` when it has no pass) and its
/// settings (empty when it has none).
pub fn split(candidate: &str) -> (String, String) {
    let (mut passes, mut settings) = (Vec::new(), Vec::new());
    for entry in candidate
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
    {
        let name = entry.split_once('=').map_or(entry, |(n, _)| n);
        if SETTINGS.contains(&name) {
            settings.push(entry);
        } else {
            passes.push(entry);
        }
    }
    let passes = if passes.is_empty() || passes == ["none"] {
        "none".to_string()
    } else {
        passes.join(",")
    };
    (passes, settings.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_split_from_passes() {
        let t =
            Tuning::parse("fusion.max_expr_nodes=16, gemm=avx2,threads_per_rank=2,map_vector=8")
                .unwrap();
        assert_eq!(t.fusion.max_expr_nodes, 16);
        assert_eq!(t.gemm, Some(GemmKernel::Avx2));
        assert_eq!(t.map_vector, Some(MapVector::Eight));
        assert_eq!(t.threads_per_rank, Some(2));
        assert_eq!(Tuning::parse("").unwrap(), Tuning::default());
        for (bad, why) in [
            ("gemm", "`name=value`"),
            ("gemm=avx9", "widest, avx512, avx2 or scalar"),
            ("map_vector=4", "widest, 8 or 16"),
            ("fusion.max_expr_nodes=many", "whole number"),
            ("threads_per_rank=0", "at least 1"),
            ("blocks=8", "unknown setting `blocks`"),
        ] {
            let e = Tuning::parse(bad).unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert_eq!(
            split("cse,capture=min:8,fusion.converge_hops=2,gemm=avx2"),
            (
                "cse,capture=min:8".to_string(),
                "fusion.converge_hops=2,gemm=avx2".to_string()
            )
        );
        assert_eq!(split("gemm=avx2"), ("none".into(), "gemm=avx2".into()));
        assert_eq!(split("none"), ("none".into(), String::new()));
    }
}
