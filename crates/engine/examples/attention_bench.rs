//! Causal attention forward/backward throughput (FLOPs counted as 4·D per visible (q, k) pair
//! forward, 2× that backward — recompute not counted), in f32 and with bf16 storage, on each
//! SIMD tier the CPU has (AVX2: the gemm crate's tile products; AVX-512: the tile kernel of
//! `cpu/tile_gemm.rs`), the tiers alternating within every repetition so that a noisy
//! neighbour hits both alike; best of `reps`.
//! `cargo run --release -p ferrotron-engine --example attention_bench -- [reps]`

use ferrotron_engine::dtype::Elem;
use ferrotron_engine::kernels::cpu::simd::{limit_tier, Tier};
use ferrotron_engine::kernels::{AsView, AsViewMut};
use ferrotron_engine::kernels::{AttnShape, CpuKernels, Kernels};
use half::bf16;
use std::time::Instant;

/// Best forward and backward seconds of `s` in storage `S` per tier, over `reps` rounds.
fn time<S: Elem>(s: AttnShape, tiers: &[Tier], reps: usize) -> Vec<(f64, f64)> {
    let k: &dyn Kernels<S> = &CpuKernels::PLAIN;
    let fill = |n: usize, m: usize, step: f32| -> Vec<S> {
        (0..n)
            .map(|i| S::from_f32(((i % m) as f32 - (m / 2) as f32) * step))
            .collect()
    };
    let (q, kk, v) = (
        fill(s.q_len(), 13, 0.05),
        fill(s.kv_len(), 11, 0.05),
        fill(s.kv_len(), 7, 0.1),
    );
    let (mut o, mut lse) = (vec![S::default(); s.q_len()], vec![0.0; s.lse_len()]);
    let (mut dq, mut dk, mut dv) = (
        vec![S::default(); s.q_len()],
        vec![S::default(); s.kv_len()],
        vec![S::default(); s.kv_len()],
    );
    let mut best = vec![(f64::INFINITY, f64::INFINITY); tiers.len()];
    for _ in 0..reps {
        for (&tier, best) in tiers.iter().zip(best.iter_mut()) {
            limit_tier(tier);
            let t0 = Instant::now();
            k.attention_forward(
                s,
                q.view(),
                kk.view(),
                v.view(),
                o.view_mut(),
                lse.view_mut(),
            );
            best.0 = best.0.min(t0.elapsed().as_secs_f64());
            let t0 = Instant::now();
            k.attention_backward(
                s,
                q.view(),
                kk.view(),
                v.view(),
                o.view(),
                lse.view(),
                o.view(),
                dq.view_mut(),
                dk.view_mut(),
                dv.view_mut(),
            );
            best.1 = best.1.min(t0.elapsed().as_secs_f64());
        }
    }
    limit_tier(Tier::Avx512);
    best
}

fn main() {
    let reps = std::env::args()
        .nth(1)
        .map_or(7, |a| a.parse().expect("reps: a number"));
    let tiers: Vec<Tier> = [Tier::Avx2, Tier::Avx512]
        .into_iter()
        .filter(|t| t.supported())
        .collect();
    println!("tiers: {tiers:?} (ratios: the last over the first)");
    for &(b, t, h, kv, d) in &[
        (8usize, 256usize, 6usize, 2usize, 64usize),
        (4, 256, 9, 3, 64),
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
        let pairs = (b * h * t * (t + 1) / 2) as f64;
        let fwd_flops = 4.0 * d as f64 * pairs;
        for (storage, best) in [
            ("f32", time::<f32>(s, &tiers, reps)),
            ("bf16", time::<bf16>(s, &tiers, reps)),
        ] {
            let rate = |(f, b): (f64, f64)| (fwd_flops / f / 1e9, 2.0 * fwd_flops / b / 1e9);
            let cells: Vec<String> = tiers
                .iter()
                .zip(&best)
                .map(|(tier, &tb)| {
                    let (f, b) = rate(tb);
                    format!("{tier:?} fwd {f:.1} bwd {b:.1} GFLOP/s")
                })
                .collect();
            let (first, last) = (best[0], best[best.len() - 1]);
            println!(
                "B={b} T={t} H={h} KV={kv} D={d} {storage}: {} | fwd {:.2}× bwd {:.2}×",
                cells.join(", "),
                first.0 / last.0,
                first.1 / last.1
            );
        }
    }
}
