//! Causal attention forward/backward throughput (FLOPs counted as 4·D per visible (q, k) pair
//! forward, 2× that backward — recompute not counted).
//! `cargo run --release -p ferrotron-engine --example attention_bench`

use ferrotron_engine::kernels::{AttnShape, CpuKernels, Kernels};
use std::time::Instant;

fn main() {
    let k: &dyn Kernels = &CpuKernels::PLAIN;
    for &(b, t, h, kv, d) in &[
        (8usize, 256usize, 6usize, 2usize, 64usize),
        (4, 256, 8, 4, 64),
        (1, 1024, 8, 4, 64),
        (2, 512, 12, 12, 64),
    ] {
        let s = AttnShape {
            b,
            t,
            heads: h,
            kv_heads: kv,
            head_dim: d,
        };
        let q: Vec<f32> = (0..s.q_len())
            .map(|i| ((i % 13) as f32 - 6.0) * 0.05)
            .collect();
        let kk: Vec<f32> = (0..s.kv_len())
            .map(|i| ((i % 11) as f32 - 5.0) * 0.05)
            .collect();
        let v: Vec<f32> = (0..s.kv_len())
            .map(|i| ((i % 7) as f32 - 3.0) * 0.1)
            .collect();
        let (mut o, mut lse) = (vec![0.0; s.q_len()], vec![0.0; s.lse_len()]);
        let (mut dq, mut dk, mut dv) = (
            vec![0.0; s.q_len()],
            vec![0.0; s.kv_len()],
            vec![0.0; s.kv_len()],
        );
        let pairs = (b * h * t * (t + 1) / 2) as f64;
        let fwd_flops = 4.0 * d as f64 * pairs;
        let (mut tf, mut tb) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..5 {
            let t0 = Instant::now();
            k.attention_forward(s, &q, &kk, &v, &mut o, &mut lse);
            tf = tf.min(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            k.attention_backward(s, &q, &kk, &v, &o, &lse, &o, &mut dq, &mut dk, &mut dv);
            tb = tb.min(t0.elapsed().as_secs_f64());
        }
        println!(
            "B={b} T={t} H={h} KV={kv} D={d}: fwd {:.2} ms {:.1} GFLOP/s, bwd {:.2} ms {:.1} GFLOP/s",
            tf * 1e3,
            fwd_flops / tf / 1e9,
            tb * 1e3,
            2.0 * fwd_flops / tb / 1e9
        );
    }
}
