//! GFLOP/s of the default model's linear layers (ferrotron-12m: hidden 384, kv 128, ffn 1024,
//! vocab 8192; 2048 tokens, LM-head chunks of 1024) on each GEMM kernel, f32 and bf16 storage,
//! forward / input gradient / weight gradient, through the `Kernels` interface (so bf16 on the
//! portable path includes its staging). Kernels alternate within every repetition; medians.
//! `cargo run --release -p ferrotron-engine --example gemm_bench [reps]`
//! (`DNNL_VERBOSE=1` makes oneDNN print the implementation of every product.)

use ferrotron_engine::kernels::{Accum, CpuKernels, Elem, Gemm, Kernels, MatmulShape};
use half::bf16;
use std::time::Instant;

const SHAPES: &[(&str, usize, usize, usize)] = &[
    ("q/o 384->384", 2048, 384, 384),
    ("k/v 384->128", 2048, 384, 128),
    ("gate/up 384->1024", 2048, 384, 1024),
    ("down 1024->384", 2048, 1024, 384),
    ("lm head 384->8192", 1024, 384, 8192),
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Median GFLOP/s of forward, input gradient and weight gradient for each backend, in order.
fn bench<S: Elem>(s: MatmulShape, backends: &[Gemm], reps: usize) -> Vec<[f64; 3]> {
    let (n, i, o) = (s.n, s.in_features, s.out_features);
    let v = |len: usize, f: f32| -> Vec<S> {
        (0..len)
            .map(|j| S::from_f32(((j % 97) as f32 - 48.0) * f))
            .collect()
    };
    let (x, w, dy) = (v(n * i, 1e-2), v(o * i, 1e-2), v(n * o, 1e-2));
    let (mut y, mut dx, mut dw) = (v(n * o, 0.0), v(n * i, 0.0), v(o * i, 0.0));
    let flops = 2.0 * (n * i * o) as f64;
    let mut times = vec![[Vec::new(), Vec::new(), Vec::new()]; backends.len()];
    for r in 0..=reps {
        for (b, &g) in backends.iter().enumerate() {
            let k: &dyn Kernels<S, S> = &CpuKernels::PLAIN.with_gemm(g);
            for (op, t) in times[b].iter_mut().enumerate() {
                let t0 = Instant::now();
                match op {
                    0 => k.matmul_forward(s, &x, &w, None, &mut y, Accum::Overwrite),
                    1 => k.matmul_backward_input(s, &dy, &w, &mut dx, Accum::Overwrite),
                    _ => k.matmul_backward_weight(s, &dy, &x, &mut dw, None),
                }
                // The first repetition creates oneDNN's primitives and warms caches.
                if r > 0 {
                    t.push(t0.elapsed().as_secs_f64());
                }
            }
        }
    }
    std::hint::black_box((&y, &dx, &dw));
    times
        .into_iter()
        .map(|t| t.map(|t| flops / median(t) / 1e9))
        .collect()
}

fn main() {
    let reps = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(9);
    println!(
        "rayon threads: {}; auto = {}",
        rayon::current_num_threads(),
        Gemm::Auto.describe()
    );
    let backends = [Gemm::Portable, Gemm::Onednn];
    println!(
        "{:>6} {:>20} {:>6} {:>10} {:>10} {:>7}",
        "dtype", "shape (n=tokens)", "op", "portable", "onednn", "ratio"
    );
    for &(name, n, i, o) in SHAPES {
        let s = MatmulShape {
            n,
            in_features: i,
            out_features: o,
        };
        for (dtype, r) in [
            ("f32", bench::<f32>(s, &backends, reps)),
            ("bf16", bench::<bf16>(s, &backends, reps)),
        ] {
            for (op, j) in ["fwd", "dx", "dw"].iter().zip(0..3) {
                println!(
                    "{dtype:>6} {name:>20} {op:>6} {:>10.1} {:>10.1} {:>6.2}x",
                    r[0][j],
                    r[1][j],
                    r[1][j] / r[0][j]
                );
            }
        }
    }
}
