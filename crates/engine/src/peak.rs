//! Measured matmul throughput: the denominator of MFU on this machine, on the GEMM kernel the
//! trainer's products use (`Gemm::Auto`: oneDNN or the gemm crate).

use crate::dtype::Elem;
use crate::kernels::{Accum, CpuKernels, Kernels, MatmulShape};
use crate::kernels::{AsView, AsViewMut};
use std::time::Instant;

/// GFLOP/s of `y[m,n] = x[m,k]·Wᵀ` (W `[n,k]`, the `nn.Linear` layout the model uses) with
/// operands and output stored as `S`, as a layer's forward runs it, best of `reps` runs after
/// one warm-up. FLOPs = 2·m·n·k.
pub fn matmul_gflops<S: Elem>(m: usize, n: usize, k: usize, reps: usize) -> f64 {
    let x: Vec<S> = (0..m * k)
        .map(|i| S::from_f32(((i % 97) as f32 - 48.0) * 1e-2))
        .collect();
    let w: Vec<S> = (0..n * k)
        .map(|i| S::from_f32(((i % 89) as f32 - 44.0) * 1e-2))
        .collect();
    let mut y = vec![S::default(); m * n];
    let s = MatmulShape {
        n: m,
        in_features: k,
        out_features: n,
        ragged: false,
    };
    let kernels: &dyn Kernels<S> = &CpuKernels::PLAIN;
    let mut best = f64::INFINITY;
    for r in 0..=reps {
        let t0 = Instant::now();
        kernels.matmul_forward(s, x.view(), w.view(), None, y.view_mut(), Accum::Overwrite);
        let dt = t0.elapsed().as_secs_f64();
        if r > 0 {
            best = best.min(dt);
        }
    }
    std::hint::black_box(&y);
    2.0 * (m * n * k) as f64 / best / 1e9
}

/// [`matmul_gflops`] in f32.
pub fn sgemm_gflops(m: usize, n: usize, k: usize, reps: usize) -> f64 {
    matmul_gflops::<f32>(m, n, k, reps)
}

/// Peak single-matmul throughput (GFLOP/s) on all rayon threads with operands stored as `S`:
/// the best of a few large square and model-like shapes. Takes about a second; the trainer
/// uses it for MFU (bf16 where bf16 products run on oneDNN, else f32).
pub fn measure_matmul_peak_gflops_of<S: Elem>() -> f64 {
    [(1024, 1024, 1024), (2048, 2048, 2048), (2048, 1536, 512)]
        .iter()
        .map(|&(m, n, k)| matmul_gflops::<S>(m, n, k, 3))
        .fold(0.0, f64::max)
}

/// [`measure_matmul_peak_gflops_of`] in f32.
pub fn measure_matmul_peak_gflops() -> f64 {
    measure_matmul_peak_gflops_of::<f32>()
}
