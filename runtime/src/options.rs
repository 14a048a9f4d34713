//! Settings an executor is given when it loads, instead of reading them from the process: each
//! rank of a run, each candidate of a search, gets its own. The CLI may fill them from
//! environment variables; nothing below it reads the environment.

pub use crate::cpu::gemm::GemmKernel;

/// How an executor times its steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Profile {
    /// Steps are not waited for one by one (the fast path).
    #[default]
    Off,
    /// Every step is waited for and timed, grouped by kind: slower, for finding where the time
    /// goes.
    ByKind,
    /// As `ByKind`, with every step other than a matmul on its own line, with what it does.
    EachStep,
}

impl Profile {
    /// `1` (or any other value) times by kind, `steps` each step: the values of the CLI's
    /// `GRAPHTRAIN_PROFILE`.
    /// The profile `GRAPHTRAIN_PROFILE` names: `1` by kind, `steps` one by one, `0` off;
    /// `None` for any other word.
    pub fn from_setting(value: &str) -> Option<Profile> {
        match value {
            "1" => Some(Profile::ByKind),
            "steps" => Some(Profile::EachStep),
            "0" => Some(Profile::Off),
            _ => None,
        }
    }
}

/// How many lanes the cpu backend's plain map kernels read at once (reductions keep 8, the
/// lanes their order of sums is written for). Each lane computes the same arithmetic at any
/// width: the bits do not depend on it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MapVector {
    /// One register of the widest vectors the cpu has: 16 with AVX-512, else 8.
    #[default]
    Widest,
    /// 8 lanes (one AVX2 register), to measure the difference.
    Eight,
    /// 16 lanes (one AVX-512 register); refused at load on a cpu without AVX-512.
    Sixteen,
}

impl MapVector {
    /// The values `--tuning map_vector=` takes.
    pub const SETTINGS: &'static str = "widest, 8 or 16";

    pub fn from_setting(value: &str) -> Option<MapVector> {
        match value {
            "widest" => Some(MapVector::Widest),
            "8" => Some(MapVector::Eight),
            "16" => Some(MapVector::Sixteen),
            _ => None,
        }
    }

    /// The lanes on this cpu, or why it cannot run them.
    pub fn lanes(self) -> Result<usize, String> {
        let avx512 = cpu_has_avx512();
        match self {
            MapVector::Widest => Ok(if avx512 { 16 } else { 8 }),
            MapVector::Eight => Ok(8),
            MapVector::Sixteen if avx512 => Ok(16),
            MapVector::Sixteen => {
                Err("map_vector=16 needs AVX-512, which this cpu does not have".into())
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn cpu_has_avx512() -> bool {
    is_x86_feature_detected!("avx512f")
}

#[cfg(not(target_arch = "x86_64"))]
fn cpu_has_avx512() -> bool {
    false
}

/// Which matmul kernel the device backends (`wgpu`, `cuda`) launch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceMatmul {
    /// Tiled on `cuda`; one unit per output on `wgpu`, whose usual device here is lavapipe,
    /// where a cube's barriers run on the CPU and cost more than the loads they save.
    #[default]
    Auto,
    /// 16 x 16 outputs per cube, operands staged in shared memory (`matmul_tiled_kernel`).
    Tiled,
    /// One unit per output (`matmul_kernel`).
    PerOutput,
}

/// How the device backends move a collective's data between ranks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceCollectives {
    /// NCCL on `cuda` with several ranks where there are as many GPUs as ranks (one machine);
    /// through host memory otherwise.
    #[default]
    Auto,
    /// NCCL, device memory to device memory (`cuda` only).
    Nccl,
    /// Read back to host memory, moved by the rank's communicator (threads or MPI), written
    /// back: correct on every device, as slow as two copies over the bus.
    Host,
}

/// Whether the device backends record the capture pass's regions as device graphs
/// (`device/graphs.rs`: CUDA graphs on `cuda`, cubecl's software graphs on `wgpu`) and replay
/// them, or dispatch every launch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceGraphs {
    #[default]
    On,
    Off,
}

/// What a loaded step may use and how it reports.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuntimeOptions {
    pub profile: Profile,
    /// Which GEMM kernel the cpu backend runs (the widest the cpu has by default; narrower ones
    /// for benchmarking them).
    pub gemm_kernel: GemmKernel,
    /// How many lanes the cpu backend's plain maps read at once.
    pub map_vector: MapVector,
    /// Which matmul kernel the device backends launch.
    pub device_matmul: DeviceMatmul,
    /// How the device backends move collectives.
    pub device_collectives: DeviceCollectives,
    /// Whether the device backends replay captured regions as device graphs.
    pub device_graphs: DeviceGraphs,
    /// The most bytes one device buffer may hold, below the device's own binding limit: an
    /// arena larger than that is split across buffers (to try the split on a device whose
    /// limit the program fits under). The device's limit when unset.
    pub device_buffer_bytes: Option<usize>,
    /// Which GPU a `cuda` rank opens, before wrapping around the GPUs present: the rank's
    /// index on its machine where the launcher says it (MPI), else the rank.
    pub device_index: Option<usize>,
    /// How long a wait for a collective of a process-spanning engine (MPI, NCCL) may take
    /// before it fails instead of hanging (300 s when unset).
    pub collective_timeout: Option<std::time::Duration>,
    /// Where a rank whose collective timed out writes its last collectives (the working
    /// directory when unset).
    pub flight_dir: Option<std::path::PathBuf>,
    /// Host memory a new allocation may use, instead of the OS's estimate of what is available
    /// (to share a machine, or to try the does-not-fit path).
    pub memory_limit_bytes: Option<usize>,
    /// Record the timeline of every run from the first (`Executor::take_timeline`); executors
    /// also turn it on and off later with `Executor::record_timeline`.
    pub timeline: bool,
}

impl RuntimeOptions {
    /// `collective_timeout`, or its default.
    pub fn collective_timeout(&self) -> std::time::Duration {
        self.collective_timeout
            .unwrap_or(std::time::Duration::from_secs(300))
    }

    /// Host memory a new allocation may use: the limit when one is set, else the OS's estimate
    /// of available memory (Linux `MemAvailable`); `None` when neither is known.
    pub fn available_memory_bytes(&self) -> Option<usize> {
        if let Some(limit) = self.memory_limit_bytes {
            return Some(limit);
        }
        let info = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kib: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib << 10)
    }
}
