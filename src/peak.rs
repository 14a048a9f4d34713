//! The peak f32 throughput MFU is reported against, and how it was derived.
//!
//! On `cpu` the peak is that of the machine the step runs on, from what the OS says about it:
//! threads the backend uses x clock x f32 FLOP per cycle per core of the widest FMA the cpu
//! has. The project's machines are not all alike (the same 2-vCPU slot has been a Xeon with
//! AVX-512 and an EPYC with AVX2 only, at half the FLOP per cycle), so a constant would report
//! half the MFU on one of them. The clock is the higher of the one the OS states and the one
//! measured here: a VM states its host's nominal clock (2.45 GHz on the EPYC) while the cores
//! run faster (2.9 GHz), which overstated MFU by a fifth. So MFU errs low, never high.
//! `--peak-gflops` replaces the derivation where it is wrong (a Xeon with one 512-bit FMA unit
//! per core, a clock the VM hides). Device backends have no peak yet unless given one: it
//! depends on which GPU (or lavapipe) they found.

/// A peak and the sentence that says where it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Peak {
    pub gflops: f64,
    pub source: String,
}

/// What the derivation needs to know about the cpu.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuFacts {
    /// Threads the cpu backend runs on (its pool's width).
    pub threads: usize,
    /// Clock in GHz: cpufreq's base or boost frequency where the OS gives one, else the one
    /// `/proc/cpuinfo` reports (on a VM, usually the host's nominal clock).
    pub ghz: Option<f64>,
    /// Where `ghz` came from, for the source sentence.
    pub clock_source: &'static str,
    /// The clock chains of dependent adds and multiplies agreed on, on this thread
    /// (`measured_ghz`); `None` where they disagree.
    pub measured_ghz: Option<f64>,
    /// `/proc/cpuinfo`'s vendor id (`GenuineIntel`, `AuthenticAMD`, ...).
    pub vendor: String,
    /// `/proc/cpuinfo`'s cpu family (AMD: 25 is Zen 3 and Zen 4, 26 is Zen 5).
    pub family: Option<u32>,
    pub avx512f: bool,
    /// AVX2 with FMA.
    pub avx2_fma: bool,
    pub avx: bool,
}

/// f32 FLOP per cycle per core and the unit that gives them, for the widest vector the cpu has.
/// Two vector FMA pipes per core is what every x86 core with AVX2 or AVX-512 since Haswell has;
/// they are 512 bits wide on Intel's AVX-512 cores and AMD's Zen 5 (family 26: an EPYC of that
/// family ran `peer`'s step at 244 GFLOP/s on 2 cores, above the 8-lane peak), 256 bits on
/// Zen 4, which splits 512-bit instructions, and on some Xeon Silver/Bronze parts with one
/// 512-bit pipe (not visible from here: `--peak-gflops`).
fn flops_per_cycle(f: &CpuFacts) -> (f64, &'static str) {
    let wide_pipes = match f.vendor.as_str() {
        "GenuineIntel" => true,
        "AuthenticAMD" => f.family.is_some_and(|family| family >= 26),
        _ => false,
    };
    if f.avx512f && wide_pipes {
        (64.0, "2 AVX-512 FMA pipes x 16 lanes x 2")
    } else if f.avx512f || f.avx2_fma {
        (32.0, "2 FMA pipes x 8 lanes x 2")
    } else if f.avx {
        (16.0, "an 8-lane add and an 8-lane multiply")
    } else {
        (8.0, "a 4-lane add and a 4-lane multiply")
    }
}

/// The cpu's peak from `facts`, `None` where the OS states no clock. The measured clock
/// replaces the stated one where it is higher.
pub fn cpu_peak(facts: &CpuFacts) -> Option<Peak> {
    let stated = facts.ghz?;
    let (ghz, clock) = match facts.measured_ghz {
        Some(measured) if measured > stated => (
            measured,
            format!("measured; {} says {stated:.2}", facts.clock_source),
        ),
        _ => (stated, facts.clock_source.to_string()),
    };
    let (per_cycle, unit) = flops_per_cycle(facts);
    let gflops = facts.threads as f64 * ghz * per_cycle;
    Some(Peak {
        gflops,
        source: format!(
            "{} thread{} x {ghz:.2} GHz ({clock}) x {per_cycle} FLOP/cycle ({unit})",
            facts.threads,
            if facts.threads == 1 { "" } else { "s" },
        ),
    })
}

/// The highest clock any x86-64 core has shipped at is about 6.2 GHz: a measurement above this
/// is a fault of the measurement, never the cpu.
const CLOCK_CEILING_GHZ: f64 = 6.5;

/// The clock this thread's core runs at, in GHz, or `None` when the measurement is not
/// plausible. Two chains of dependent instructions are timed by the wall clock, the fastest of
/// `TRIES` tries each (time the VM's host takes away only makes a try slower): register-to-register
/// adds (one cycle each) and multiplies (three cycles each on every x86-64 core since 2011).
/// They must agree: a core that runs one of them faster than its latency (Golden Cove and its
/// successors fold `add reg, imm` at rename, which made an immediate-add chain read 20 GHz on a
/// 2.3-2.6 GHz Xeon) gives two clocks that differ. Where they disagree (a busy host can also slow
/// one more than the other) the stated clock stands, and `bench` says which clock it used. It is
/// the scalar clock: a core that slows down for wide vectors (some Xeons under AVX-512) computes
/// vectors below it, so the peak errs high and MFU low there.
#[cfg(target_arch = "x86_64")]
pub fn measured_ghz() -> Option<f64> {
    // Tries alternate between the chains, so a slow spell of the host slows both alike.
    let (mut add, mut multiply) = (0.0f64, 0.0f64);
    for _ in 0..TRIES {
        add = add.max(chain_ghz(Chain::Add).unwrap_or(0.0));
        multiply = multiply.max(chain_ghz(Chain::Multiply).unwrap_or(0.0));
    }
    agreeing_clock(Some(add), Some(multiply))
}

/// Tries per chain; the fastest counts.
#[cfg(target_arch = "x86_64")]
const TRIES: usize = 8;

/// The clock two independent measurements give, when they agree within 10% and stay below
/// `CLOCK_CEILING_GHZ`: the higher of the two, since lost time only ever slows a try down.
pub fn agreeing_clock(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    let (a, b) = (a?, b?);
    let (low, high) = (a.min(b), a.max(b));
    (low > 0.0 && high < CLOCK_CEILING_GHZ && high <= low * 1.1).then_some(high)
}

#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum Chain {
    Add,
    Multiply,
}

/// One try of one chain: 8 dependent instructions per loop iteration, 1.25 million iterations
/// (10 million cycles of adds, 30 million of multiplies: 3-15 ms).
#[cfg(target_arch = "x86_64")]
fn chain_ghz(chain: Chain) -> Option<f64> {
    const ITERATIONS: u64 = 1_250_000;
    let cycles_per_instruction = match chain {
        Chain::Add => 1.0,
        Chain::Multiply => 3.0,
    };
    let cycles = 8.0 * ITERATIONS as f64 * cycles_per_instruction;
    let start = std::time::Instant::now();
    let mut x: u64 = 1;
    let mut n: u64 = ITERATIONS;
    // An operand the compiler cannot see, so neither chain has an immediate to fold.
    let y: u64 = std::hint::black_box(3);
    // Eight dependent `OP x, y` per iteration, then the loop counter.
    macro_rules! chain_loop {
        ($op:literal) => {
            std::arch::asm!(
                "2:",
                concat!($op, " {x}, {y}"),
                concat!($op, " {x}, {y}"),
                concat!($op, " {x}, {y}"),
                concat!($op, " {x}, {y}"),
                concat!($op, " {x}, {y}"),
                concat!($op, " {x}, {y}"),
                concat!($op, " {x}, {y}"),
                concat!($op, " {x}, {y}"),
                "dec {n}",
                "jnz 2b",
                x = inout(reg) x,
                n = inout(reg) n,
                y = in(reg) y,
                options(nomem, nostack),
            )
        };
    }
    // SAFETY: register arithmetic only: no memory, no stack.
    unsafe {
        match chain {
            Chain::Add => chain_loop!("add"),
            Chain::Multiply => chain_loop!("imul"),
        }
    };
    std::hint::black_box((x, n));
    let seconds = start.elapsed().as_secs_f64();
    (seconds > 0.0).then(|| cycles / seconds / 1e9)
}

#[cfg(not(target_arch = "x86_64"))]
pub fn measured_ghz() -> Option<f64> {
    None
}

/// The facts of the cpu this process runs on. Off Linux, or off x86_64, the clock is unknown
/// (so there is no peak without `--peak-gflops`).
pub fn cpu_facts() -> CpuFacts {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |key: &str| {
        cpuinfo.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        })
    };
    let cpufreq_ghz = |file: &str| {
        std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu0/cpufreq/{file}"))
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .map(|khz| khz / 1e6)
    };
    // intel_pstate's base frequency is the sustained clock. Other drivers give only the
    // boost clock, which overstates the peak a little (so MFU errs low); `/proc/cpuinfo`'s
    // is the current clock on bare metal, which can be far below it at idle, and the host's
    // nominal one on a VM, where the other two are rarely exposed.
    let reported = field("cpu MHz")
        .and_then(|s| s.parse::<f64>().ok())
        .map(|mhz| mhz / 1e3);
    let (ghz, clock_source) = [
        (cpufreq_ghz("base_frequency"), "cpufreq base frequency"),
        (cpufreq_ghz("cpuinfo_max_freq"), "cpufreq boost frequency"),
        (reported, "/proc/cpuinfo"),
    ]
    .into_iter()
    .find_map(|(g, source)| g.filter(|g| *g > 0.0).map(|g| (Some(g), source)))
    .unwrap_or((None, "unknown"));
    #[cfg(target_arch = "x86_64")]
    let (avx512f, avx2_fma, avx) = (
        is_x86_feature_detected!("avx512f"),
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
        is_x86_feature_detected!("avx"),
    );
    #[cfg(not(target_arch = "x86_64"))]
    let (avx512f, avx2_fma, avx) = (false, false, false);
    // Elsewhere the FLOP per cycle are not derived (NEON cores differ in pipes): no peak.
    let ghz = if cfg!(target_arch = "x86_64") {
        ghz
    } else {
        None
    };
    CpuFacts {
        threads: graphtrain_runtime::cpu::pool::Pool::global().width(),
        ghz,
        clock_source,
        measured_ghz: measured_ghz(),
        vendor: field("vendor_id").unwrap_or_default(),
        family: field("cpu family").and_then(|f| f.parse().ok()),
        avx512f,
        avx2_fma,
        avx,
    }
}

/// The peak MFU is reported against on `backend`: `given` (`--peak-gflops`) where set, else
/// the cpu's derived peak on `cpu`, else none.
pub fn peak(backend: &str, given: Option<f64>) -> Option<Peak> {
    if let Some(gflops) = given {
        return Some(Peak {
            gflops,
            source: "given with --peak-gflops".to_string(),
        });
    }
    (backend == "cpu").then(|| cpu_peak(&cpu_facts())).flatten()
}

/// The peak `mfu` is reported against for a step in `precision`: `peak` for f32; for
/// bf16-mixed on `cpu`, the peak of the unit its matmuls run on (`kernel` as the GEMM picks):
/// AMX tiles, 16 times the f32 peak (a `tdpbf16ps` is 16 x 16 x 32 multiply-adds, one issued
/// every 16 cycles per core: 1,024 FLOP per cycle against AVX-512's 64); AVX512_BF16, twice
/// (one `vdpbf16ps` does two multiply-adds per f32 lane, in the FMA pipes); else the f32 peak
/// (the bf16 matmuls then run as f32 FMAs). Every FLOP of the step counts against it, attention
/// and the other f32 work included, as torch's and Megatron's MFU do: under AMX, where the
/// matmuls' peak is far above the rest's, MFU is small by construction.
pub fn peak_in(
    backend: &str,
    given: Option<f64>,
    precision: graphtrain_ir::autocast::Precision,
    kernel: graphtrain_runtime::GemmKernel,
) -> Option<Peak> {
    use graphtrain_runtime::cpu::{gemm_amx, gemm_bf16};
    use graphtrain_runtime::GemmKernel;
    let f32_peak = peak(backend, given)?;
    if precision == graphtrain_ir::autocast::Precision::F32 || given.is_some() {
        return Some(f32_peak);
    }
    let bf16_kernel = matches!(kernel, GemmKernel::Widest | GemmKernel::Avx512);
    if backend == "cpu" && kernel == GemmKernel::Widest && gemm_amx::available() {
        Some(Peak {
            gflops: 16.0 * f32_peak.gflops,
            source: format!(
                "bf16: 16 x the f32 peak, {} (AMX: a tdpbf16ps does 16 x 16 x 32 bf16 products per 16 cycles per core)",
                f32_peak.source
            ),
        })
    } else if backend == "cpu" && bf16_kernel && gemm_bf16::available() {
        Some(Peak {
            gflops: 2.0 * f32_peak.gflops,
            source: format!(
                "bf16: 2 x the f32 peak, {} (AVX512_BF16: a vdpbf16ps does 2 bf16 products per f32 lane)",
                f32_peak.source
            ),
        })
    } else {
        Some(Peak {
            gflops: f32_peak.gflops,
            source: format!(
                "{} (the f32 peak: without AVX512_BF16 the bf16 matmuls run as f32 FMAs)",
                f32_peak.source
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(vendor: &str, avx512f: bool, avx2_fma: bool) -> CpuFacts {
        CpuFacts {
            threads: 2,
            ghz: Some(2.6),
            clock_source: "/proc/cpuinfo",
            measured_ghz: None,
            vendor: vendor.to_string(),
            family: Some(if vendor == "AuthenticAMD" { 25 } else { 6 }),
            avx512f,
            avx2_fma,
            avx: avx2_fma,
        }
    }

    #[test]
    fn peaks_of_the_machine_types_seen() {
        // The Xeon DESIGN.md measured: 2 x 2.6 GHz x 64 = 332.8 GFLOP/s, its stated peak.
        let xeon = cpu_peak(&facts("GenuineIntel", true, true)).unwrap();
        assert!((xeon.gflops - 332.8).abs() < 1e-9, "{xeon:?}");
        assert_eq!(
            xeon.source,
            "2 threads x 2.60 GHz (/proc/cpuinfo) x 64 FLOP/cycle (2 AVX-512 FMA pipes x 16 lanes x 2)"
        );
        // An EPYC (Zen 3, AVX2) at the same clock: half of it.
        let epyc = cpu_peak(&facts("AuthenticAMD", false, true)).unwrap();
        assert!((epyc.gflops - 166.4).abs() < 1e-9, "{epyc:?}");
        // Zen 4 has AVX-512 on 256-bit pipes: no more FLOP per cycle than AVX2.
        let zen4 = cpu_peak(&facts("AuthenticAMD", true, true)).unwrap();
        assert_eq!(zen4.gflops, epyc.gflops);
        // Zen 5 (family 26) has 512-bit pipes: as the Xeon.
        let mut zen5 = facts("AuthenticAMD", true, true);
        zen5.family = Some(26);
        assert_eq!(cpu_peak(&zen5).unwrap().gflops, xeon.gflops);
        // Without FMA: separate add and multiply pipes, and no AVX at all.
        let mut old = facts("GenuineIntel", false, false);
        old.avx = true;
        assert!((cpu_peak(&old).unwrap().gflops - 83.2).abs() < 1e-9);
        old.avx = false;
        assert!((cpu_peak(&old).unwrap().gflops - 41.6).abs() < 1e-9);
    }

    #[test]
    fn a_measured_clock_above_the_stated_one_replaces_it() {
        // The EPYC VM: /proc/cpuinfo states 2.45 GHz, the cores ran at 2.9.
        let mut epyc = facts("AuthenticAMD", false, true);
        epyc.ghz = Some(2.45);
        epyc.measured_ghz = Some(2.9);
        let p = cpu_peak(&epyc).unwrap();
        assert!((p.gflops - 185.6).abs() < 1e-9, "{p:?}");
        assert_eq!(
            p.source,
            "2 threads x 2.90 GHz (measured; /proc/cpuinfo says 2.45) x 32 FLOP/cycle (2 FMA \
pipes x 8 lanes x 2)"
        );
        // Measured lower (a busy host, a slow try): the stated clock stands.
        epyc.measured_ghz = Some(2.0);
        assert!((cpu_peak(&epyc).unwrap().gflops - 156.8).abs() < 1e-9);
        // Without a stated clock there is still no peak: one short measurement alone is not
        // trusted to state it.
        epyc.ghz = None;
        epyc.measured_ghz = Some(2.9);
        assert_eq!(cpu_peak(&epyc), None);
    }

    #[test]
    fn an_implausible_clock_measurement_is_refused() {
        // The Xeon whose immediate-add chain read 20.17 GHz while multiplies read the truth.
        assert_eq!(agreeing_clock(Some(20.17), Some(3.4)), None);
        // Both fooled alike, beyond any x86 clock: refused all the same.
        assert_eq!(agreeing_clock(Some(9.0), Some(9.1)), None);
        assert_eq!(agreeing_clock(None, Some(3.4)), None);
        // Agreeing within 10%: the higher, as lost time only slows a try down.
        assert_eq!(agreeing_clock(Some(3.36), Some(3.43)), Some(3.43));
        assert_eq!(agreeing_clock(Some(2.9), Some(2.0)), None);
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_clock_measurement_gives_a_clock() {
        // Not a speed check: only that the measurement is a clock at all (a broken loop count
        // or unit would be off by orders of magnitude), whatever else the machine is doing.
        // A busy host may make the two chains disagree, and then the measurement is refused:
        // that may happen, a wrong clock may not.
        let ghz = (0..3)
            .find_map(|_| measured_ghz())
            .expect("three measurements refused in a row");
        assert!((0.2..10.0).contains(&ghz), "{ghz} GHz");
    }

    #[test]
    fn unknown_clock_gives_no_peak_and_a_given_peak_wins() {
        let mut f = facts("GenuineIntel", true, true);
        f.ghz = None;
        assert_eq!(cpu_peak(&f), None);
        let given = peak("wgpu", Some(1000.0)).unwrap();
        assert_eq!(given.gflops, 1000.0);
        assert_eq!(given.source, "given with --peak-gflops");
        assert_eq!(peak("reference", None), None);
        assert_eq!(peak("wgpu", None), None);
    }
}
