//! What the simulator knows of a machine: peak compute per precision, memory bandwidth and
//! capacity, per-kind efficiencies, launch cost, and the links between devices (inside a node,
//! between nodes, to host memory). Read from RON; the built-in GPUs (`h100-sxm`, `h200`,
//! `a100-sxm`) are files beside this one, each figure with its datasheet source in a comment.
//! This machine's CPU is not a file: `calibrate` measures it (`sim::calibrate`).

use serde::{Deserialize, Serialize};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// Ranks are threads or processes sharing one host's cores (and its memory bandwidth).
    Cpu,
    /// One rank per device.
    Gpu,
}

/// Fractions of the peak each kind of work reaches.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Efficiency {
    /// Of the peak FLOP rate, for GEMMs.
    pub matmul: f64,
    /// Of the peak FLOP rate, for attention (its products and softmax in one kernel).
    pub attention: f64,
    /// Of the bf16 peak, for bf16 attention (bf16-mixed's); absent (`None`), the same fraction
    /// as `attention` (what a flash-attention kernel reaches on a GPU's tensor cores). A cpu's
    /// calibration measures it: its tiles leave a bf16 attention's softmax a larger share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attention_bf16: Option<f64>,
    /// Of the memory bandwidth, for everything bound by bytes (maps, copies, reductions,
    /// AdamW, cross-entropy, gathers).
    pub memory: f64,
}

/// A link: what one member sends per second, and a fixed cost per collective.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkSpec {
    pub gbps: f64,
    pub latency_us: f64,
}

impl LinkSpec {
    /// Seconds to send `bytes` over this link (one message).
    pub fn seconds(&self, bytes: f64) -> f64 {
        self.latency_us * 1e-6 + bytes / (self.gbps * 1e9)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Hardware {
    pub name: String,
    pub kind: Kind,
    /// Peak GFLOP/s of one device (all cores of the host, for `Cpu`) in f32 and in bf16.
    pub peak_gflops_f32: f64,
    pub peak_gflops_bf16: f64,
    pub memory_gbps: f64,
    pub memory_gib: f64,
    /// Fixed cost of one kernel launch (one Program step).
    pub launch_us: f64,
    pub efficiency: Efficiency,
    /// Devices per node: a mesh larger than this spans nodes and its outer dimensions cross
    /// `inter_node`. For `Cpu`, the host's cores (ranks beyond it share them).
    pub gpus_per_node: usize,
    pub intra_node: LinkSpec,
    pub inter_node: LinkSpec,
    /// To host memory (offload and reload).
    pub host_link: LinkSpec,
}

const BUILTIN: [(&str, &str); 3] = [
    ("h100-sxm", include_str!("hardware/h100-sxm.ron")),
    ("h200", include_str!("hardware/h200.ron")),
    ("a100-sxm", include_str!("hardware/a100-sxm.ron")),
];

/// The names `--hardware` takes besides a file.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|(n, _)| *n).collect()
}

impl Hardware {
    /// Refuses `world` ranks on `nodes` nodes of GPUs that cannot hold them: "`world` ranks and
    /// ... hold ...: give --nodes N".
    pub fn check_fits(&self, world: usize, nodes: usize) -> Result<(), String> {
        if self.kind == Kind::Gpu && world > nodes * self.gpus_per_node {
            return Err(format!(
                "{world} ranks and {nodes} node(s) of {} `{}` hold {}: give --nodes {}",
                self.gpus_per_node,
                self.name,
                nodes * self.gpus_per_node,
                world.div_ceil(self.gpus_per_node)
            ));
        }
        Ok(())
    }

    /// The memory one of `world` ranks has: a device's, or a cpu host's shared by its ranks.
    pub fn memory_per_rank(&self, world: usize) -> f64 {
        let bytes = self.memory_gib * (1u64 << 30) as f64;
        match self.kind {
            Kind::Gpu => bytes,
            Kind::Cpu => bytes / world as f64,
        }
    }

    /// A built-in description by name, or a RON file's.
    pub fn load(name_or_file: &str) -> Result<Hardware, String> {
        if let Some((_, src)) = BUILTIN.iter().find(|(n, _)| *n == name_or_file) {
            return Hardware::parse(src, name_or_file);
        }
        let path = std::path::Path::new(name_or_file);
        if !path.exists() {
            return Err(format!(
                "unknown hardware `{name_or_file}`: not a built-in ({}, or `this-cpu`, measured \
now) and no such file",
                builtin_names().join(", ")
            ));
        }
        let src = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        Hardware::parse(&src, &path.display().to_string())
    }

    /// Parses and checks a description; `origin` names it in errors.
    pub fn parse(src: &str, origin: &str) -> Result<Hardware, String> {
        let h: Hardware = ron::from_str(src).map_err(|e| format!("{origin}: {e}"))?;
        h.check().map_err(|e| format!("{origin}: {e}"))?;
        Ok(h)
    }

    fn check(&self) -> Result<(), String> {
        let positive = [
            ("peak_gflops_f32", self.peak_gflops_f32),
            ("peak_gflops_bf16", self.peak_gflops_bf16),
            ("memory_gbps", self.memory_gbps),
            ("memory_gib", self.memory_gib),
            ("intra_node.gbps", self.intra_node.gbps),
            ("inter_node.gbps", self.inter_node.gbps),
            ("host_link.gbps", self.host_link.gbps),
        ];
        for (what, x) in positive {
            if !(x.is_finite() && x > 0.0) {
                return Err(format!("`{what}` must be a positive number, not {x}"));
            }
        }
        let fractions = [
            ("efficiency.matmul", self.efficiency.matmul),
            ("efficiency.attention", self.efficiency.attention),
            ("efficiency.memory", self.efficiency.memory),
        ]
        .into_iter()
        .chain(
            self.efficiency
                .attention_bf16
                .map(|x| ("efficiency.attention_bf16", x)),
        );
        for (what, x) in fractions {
            if !(x > 0.0 && x <= 1.0) {
                return Err(format!("`{what}` must be in (0, 1], not {x}"));
            }
        }
        let latencies = [
            ("launch_us", self.launch_us),
            ("intra_node.latency_us", self.intra_node.latency_us),
            ("inter_node.latency_us", self.inter_node.latency_us),
            ("host_link.latency_us", self.host_link.latency_us),
        ];
        for (what, x) in latencies {
            if !(x.is_finite() && x >= 0.0) {
                return Err(format!("`{what}` must be a number >= 0, not {x}"));
            }
        }
        if self.gpus_per_node == 0 {
            return Err("`gpus_per_node` must be at least 1".into());
        }
        Ok(())
    }

    pub fn to_ron(&self) -> String {
        ron::ser::to_string_pretty(self, ron::ser::PrettyConfig::default())
            .expect("a Hardware always serializes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_builtin_descriptions_parse_and_round_trip() {
        for name in builtin_names() {
            let h = Hardware::load(name).unwrap();
            assert_eq!(h.name, name);
            assert_eq!(Hardware::parse(&h.to_ron(), name).unwrap(), h);
        }
    }

    #[test]
    fn bad_descriptions_name_the_field() {
        let h100 = include_str!("hardware/h100-sxm.ron");
        let bad = h100.replace("memory: 0.8", "memory: 1.5");
        let e = Hardware::parse(&bad, "x.ron").unwrap_err();
        assert!(
            e.contains("x.ron") && e.contains("efficiency.memory"),
            "{e}"
        );
        let bad = h100.replace("memory: 0.8", "memory: 0.8, attention_bf16: Some(0.0)");
        let e = Hardware::parse(&bad, "z.ron").unwrap_err();
        assert!(e.contains("efficiency.attention_bf16"), "{e}");
        let e = Hardware::parse(&h100.replace("gpus_per_node: 8", "gpus_per_node: 0"), "y")
            .unwrap_err();
        assert!(e.contains("gpus_per_node"), "{e}");
        let e = Hardware::load("tpu-v9").unwrap_err();
        assert!(e.contains("unknown hardware `tpu-v9`"), "{e}");
    }
}
