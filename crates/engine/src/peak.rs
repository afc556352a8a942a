//! Measured sgemm throughput: the denominator of MFU on this machine, on the GEMM kernel the
//! trainer's products use (`Gemm::Auto`: oneDNN or the gemm crate).

use crate::kernels::cpu::gemm_select::{sgemm, Gemm};
use std::time::Instant;

/// GFLOP/s of `y[m,n] = x[m,k]·Wᵀ` (W `[n,k]`, the `nn.Linear` layout the model uses), best of
/// `reps` runs after one warm-up. FLOPs = 2·m·n·k.
pub fn sgemm_gflops(m: usize, n: usize, k: usize, reps: usize) -> f64 {
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i % 97) as f32 - 48.0) * 1e-2)
        .collect();
    let w: Vec<f32> = (0..n * k)
        .map(|i| ((i % 89) as f32 - 44.0) * 1e-2)
        .collect();
    let mut y = vec![0.0f32; m * n];
    let mut best = f64::INFINITY;
    for r in 0..=reps {
        let t0 = Instant::now();
        sgemm(
            Gemm::Auto,
            (m, n, k),
            &mut y,
            (n, 1),
            (&x, (k, 1)),
            (&w, (1, k)),
            false,
        );
        let dt = t0.elapsed().as_secs_f64();
        if r > 0 {
            best = best.min(dt);
        }
    }
    std::hint::black_box(&y);
    2.0 * (m * n * k) as f64 / best / 1e9
}

/// Peak single-matmul throughput (GFLOP/s) on all rayon threads: the best of a few large
/// square and model-like shapes. Takes about a second; the trainer uses it for MFU.
pub fn measure_matmul_peak_gflops() -> f64 {
    [(1024, 1024, 1024), (2048, 2048, 2048), (2048, 1536, 512)]
        .iter()
        .map(|&(m, n, k)| sgemm_gflops(m, n, k, 3))
        .fold(0.0, f64::max)
}
