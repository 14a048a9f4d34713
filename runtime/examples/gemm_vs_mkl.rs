//! Our GEMM and MKL's `SGEMM` in one process, on the same buffers, alternated every five calls,
//! so that both meet the same phases of a shared host (docs/benchmarks.md). MKL comes from
//! PyTorch's `libtorch_cpu.so`, loaded at run time; nothing links it.
//!
//! ```sh
//! TORCH_LIB=../shared/peers/torch/venv/lib/python3.11/site-packages/torch/lib \
//! LD_LIBRARY_PATH=$TORCH_LIB OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE \
//!   cargo run --release -p graphtrain-runtime --example gemm_vs_mkl [ROUNDS]
//! ```

use graphtrain_runtime::cpu::gemm::{sgemm, Layout};
use std::ffi::{c_char, c_int, c_void, CString};
use std::time::{Duration, Instant};

extern "C" {
    fn dlopen(file: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void;
}

/// Fortran `SGEMM`: column-major, every argument by reference.
type FortranSgemm = unsafe extern "C" fn(
    *const c_char,
    *const c_char,
    *const c_int,
    *const c_int,
    *const c_int,
    *const f32,
    *const f32,
    *const c_int,
    *const f32,
    *const c_int,
    *const f32,
    *mut f32,
    *const c_int,
);

fn load_mkl() -> FortranSgemm {
    let dir = std::env::var("TORCH_LIB").expect("set TORCH_LIB to torch's lib directory");
    let path = CString::new(format!("{dir}/libtorch_cpu.so")).unwrap();
    // SAFETY: plain dlopen/dlsym of a symbol with the declared Fortran signature.
    unsafe {
        let lib = dlopen(path.as_ptr(), 2 | 0x100); // RTLD_NOW | RTLD_GLOBAL
        assert!(
            !lib.is_null(),
            "cannot load {dir}/libtorch_cpu.so (set LD_LIBRARY_PATH too)"
        );
        let f = dlsym(lib, c"SGEMM".as_ptr());
        assert!(!f.is_null(), "no SGEMM in libtorch_cpu.so");
        std::mem::transmute::<*mut c_void, FortranSgemm>(f)
    }
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(30, |r| r.parse().expect("ROUNDS"));
    let mkl = load_mkl();
    let threads = graphtrain_runtime::cpu::pool::Pool::global().width();
    // (label, m, n, k, A stored transposed, B stored transposed): `peer`'s shapes, as in
    // `gemm_shapes`, and the square one of the speed target.
    for &(label, m, n, k, ta, tb) in &[
        (
            "x @ wT     2048x256x256",
            2048usize,
            256usize,
            256usize,
            false,
            true,
        ),
        ("x @ w1T    2048x768x256", 2048, 768, 256, false, true),
        ("h @ w2T    2048x256x768", 2048, 256, 768, false, true),
        ("dy @ w     2048x256x256", 2048, 256, 256, false, false),
        ("dy @ w2    2048x768x256", 2048, 768, 256, false, false),
        ("xT @ dy    256x256x2048", 256, 256, 2048, true, false),
        ("hT @ dy    768x256x2048", 768, 256, 2048, true, false),
        ("xT @ dy    256x768x2048", 256, 768, 2048, true, false),
        ("x @ headT  2048x2048x256", 2048, 2048, 256, false, true),
        ("square     1024^3", 1024, 1024, 1024, false, false),
    ] {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 104729) % 1000) as f32 * 1e-3)
            .collect();
        let mut c = vec![0f32; m * n];
        // A matrix of `rows x cols`, stored row-major or (trans) column-major.
        let layout = |rows: usize, cols: usize, trans: bool| Layout {
            row_stride: if trans { 1 } else { cols },
            col_stride: if trans { rows } else { 1 },
            batch_stride: 0,
        };
        let ours = |c: &mut [f32]| {
            // SAFETY: a, b, c hold m x k, k x n, m x n floats; c overlaps neither.
            unsafe {
                sgemm(
                    1,
                    m,
                    n,
                    k,
                    a.as_ptr(),
                    layout(m, k, ta),
                    b.as_ptr(),
                    layout(k, n, tb),
                    c.as_mut_ptr(),
                    threads,
                )
            }
        };
        // Row-major C = A B is column-major Cᵀ = Bᵀ Aᵀ. Row-major storage of a matrix is the
        // column-major storage of its transpose, so an operand stored row-major goes in as
        // "N" and one stored transposed as "T".
        let theirs = |c: &mut [f32]| {
            let (mi, ni, ki) = (m as c_int, n as c_int, k as c_int);
            let (one, zero) = (1.0f32, 0.0f32);
            let (op_b, ldb) = if tb { (c"T", ki) } else { (c"N", ni) };
            let (op_a, lda) = if ta { (c"T", mi) } else { (c"N", ki) };
            // SAFETY: the same buffers, described column-major.
            unsafe {
                mkl(
                    op_b.as_ptr(),
                    op_a.as_ptr(),
                    &ni,
                    &mi,
                    &ki,
                    &one,
                    b.as_ptr(),
                    &ldb,
                    a.as_ptr(),
                    &lda,
                    &zero,
                    c.as_mut_ptr(),
                    &ni,
                )
            }
        };
        // Both must compute the same product, or the timings compare nothing.
        let mut check = vec![0f32; m * n];
        ours(&mut c);
        theirs(&mut check);
        let worst = c
            .iter()
            .zip(&check)
            .map(|(x, y)| ((x - y) / y.abs().max(1.0)).abs())
            .fold(0.0f32, f32::max);
        assert!(
            worst < 1e-4,
            "{label}: ours and MKL differ by {worst} (relative)"
        );
        let gflops = |secs: f64| 2.0 * (m * n * k) as f64 * 5.0 / secs / 1e9;
        let time = |f: &dyn Fn(&mut [f32]), c: &mut [f32]| {
            f(c);
            let t = Instant::now();
            for _ in 0..5 {
                f(c);
            }
            let s = t.elapsed().as_secs_f64();
            // Let the other side's idle threads stop spinning before it runs.
            std::thread::sleep(Duration::from_millis(20));
            s
        };
        let (mut ro, mut rm, mut ratio) = (vec![], vec![], vec![]);
        for r in 0..rounds {
            let (o, t) = if r % 2 == 0 {
                let o = time(&ours, &mut c);
                (o, time(&theirs, &mut c))
            } else {
                let t = time(&theirs, &mut c);
                (time(&ours, &mut c), t)
            };
            ro.push(gflops(o));
            rm.push(gflops(t));
            ratio.push(t / o);
        }
        let lo = |v: &[f64]| v.iter().cloned().fold(f64::MAX, f64::min);
        let hi = |v: &[f64]| v.iter().cloned().fold(0.0, f64::max);
        println!(
            "{label}  {threads} thr  ours median {:.0} ({:.0}-{:.0})  MKL median {:.0} ({:.0}-{:.0})  ours/MKL speed per round: median {:.2}",
            median(&mut ro.clone()), lo(&ro), hi(&ro), median(&mut rm.clone()), lo(&rm), hi(&rm), median(&mut ratio)
        );
    }
}
