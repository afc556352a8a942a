//! Per-shape GFLOP/s of the model's linear layers in each direction (forward, backward input,
//! backward weight), as the kernels call them.
//! `cargo run --release -p ferrotron-engine --example shape_bench -- [reps]`
use ferrotron_engine::kernels::{Accum, CpuKernels, Kernels, MatmulShape};
use std::time::Instant;

fn best(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut b = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        b = b.min(t.elapsed().as_secs_f64());
    }
    b
}

fn main() {
    let reps: usize = std::env::args().nth(1).map_or(5, |s| s.parse().unwrap());
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    let shapes = [
        ("q      2048x384->384", 2048, 384, 384),
        ("kv     2048x384->128", 2048, 384, 128),
        ("qkv    2048x384->640", 2048, 384, 640),
        ("o      2048x384->384", 2048, 384, 384),
        ("gate   2048x384->1024", 2048, 384, 1024),
        ("gateup 2048x384->2048", 2048, 384, 2048),
        ("down   2048x1024->384", 2048, 1024, 384),
        ("lm     1024x384->8192", 1024, 384, 8192),
    ];
    println!(
        "{:>24} {:>8} {:>8} {:>8}  (GFLOP/s fwd, bwd_in, bwd_w)",
        "shape", "fwd", "bwd_in", "bwd_w"
    );
    for (name, n, i, o) in shapes {
        let s = MatmulShape {
            n,
            in_features: i,
            out_features: o,
        };
        let x = vec![0.01f32; n * i];
        let w = vec![0.01f32; o * i];
        let mut y = vec![0.0f32; n * o];
        let mut dx = vec![0.0f32; n * i];
        let mut dw = vec![0.0f32; o * i];
        let fl = 2.0 * (n * i * o) as f64 / 1e9;
        let tf = best(reps, || {
            k.matmul_forward(s, &x, &w, None, &mut y, Accum::Overwrite)
        });
        let ti = best(reps, || {
            k.matmul_backward_input(s, &y, &w, &mut dx, Accum::Overwrite)
        });
        let tw = best(reps, || k.matmul_backward_weight(s, &y, &x, &mut dw, None));
        println!(
            "{name:>24} {:>8.1} {:>8.1} {:>8.1}",
            fl / tf,
            fl / ti,
            fl / tw
        );
    }
}
