//! Times full training steps (forward + backward + grad-norm clip + AdamW) of a Llama on the
//! CPU backend and reports GFLOP/s and MFU against the measured single-matmul peak, plus a
//! per-op breakdown.
//!
//! `cargo run --release -p ferrotron-engine --example train_step -- [small|smollm135m] [steps]`
//!
//! Presets and FLOP accounting match tests/reference/bench_pytorch.py so numbers compare 1:1:
//! dense = 6·N_matmul·tokens (q,k,v,o,gate,up,down per layer + lm_head, counted even if tied),
//! attention = 12·L·(H·D)·T²·B (full T×T, PaLM convention); "causal" halves the attention term.

use ferrotron_engine::kernels::{AdamWParams, CpuKernels, Kernels, Profiled, NO_PARAMS};
use ferrotron_engine::kernels::{AsView, AsViewMut};
use ferrotron_engine::model::{BatchShape, HeapPool, Llama, LlamaConfig};
use std::time::Instant;

fn preset(name: &str) -> (LlamaConfig, usize, usize) {
    let base = |vocab, hidden, inter, layers, heads, kv, tie| LlamaConfig {
        hidden,
        intermediate: inter,
        heads,
        kv_heads: kv,
        head_dim: hidden / heads,
        layers,
        vocab,
        rope_theta: 10000.0,
        rms_eps: 1e-5,
        tie_embeddings: tie,
        qkv_bias: false,
        max_pos: 2048,
        moe: None,
    };
    match name {
        "small" | "a" => (base(8192, 384, 1024, 6, 6, 2, false), 8, 256),
        "smollm135m" | "b" => (base(49152, 576, 1536, 30, 9, 3, true), 4, 256),
        other => panic!("unknown preset {other}: use small or smollm135m"),
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let name = args.first().map_or("small", |s| s.as_str());
    let steps: usize = args.get(1).map_or(5, |s| s.parse().expect("steps"));
    let (cfg, b, t) = preset(name);
    let model = Llama::new(cfg.clone());
    let np = model.num_params();
    let n = b * t;
    let (c, f, qd, kvd, v, l) = (
        cfg.hidden,
        cfg.intermediate,
        cfg.q_dim(),
        cfg.kv_dim(),
        cfg.vocab,
        cfg.layers,
    );
    let n_matmul = l * (c * qd + 2 * c * kvd + qd * c + 3 * c * f) + v * c;
    let dense = 6.0 * n_matmul as f64 * n as f64;
    let attention = 12.0 * (l * qd) as f64 * (t * t * b) as f64;
    let (full, causal) = (dense + attention, dense + attention / 2.0);
    println!(
        "preset {name}: params {np}, N_matmul {n_matmul}, B={b} T={t}, {:.2} GFLOP/step ({:.2} causal), rayon threads {}",
        full / 1e9,
        causal / 1e9,
        rayon::current_num_threads()
    );
    let peak0 = ferrotron_engine::measure_matmul_peak_gflops();

    let k = Profiled::new(CpuKernels::PLAIN);
    let kd: &dyn Kernels = &k;
    let mut params = model.params.init(1, 0.02);
    let (mut grads, mut m, mut vv) = (vec![0.0f32; np], vec![0.0f32; np], vec![0.0f32; np]);
    let tokens: Vec<u32> = (0..n).map(|i| ((i * 7919) % v) as u32).collect();
    let targets: Vec<u32> = (0..n).map(|i| ((i * 7919 + 13) % v) as u32).collect();
    let batch = BatchShape { b, t };
    let mut pool = HeapPool::new();
    let mut times = Vec::new();
    for step in 0..=steps {
        if step == 1 {
            k.reset(); // step 0 is warm-up
        }
        let t0 = Instant::now();
        grads.fill(0.0);
        let (acts, loss) = model.forward_train(
            kd, &mut pool, &params, &mut grads, batch, &tokens, &targets, n,
        );
        let t_fwd = t0.elapsed().as_secs_f64();
        model.backward(kd, &mut pool, &params, &mut grads, acts, &tokens);
        let t_bwd = t0.elapsed().as_secs_f64() - t_fwd;
        let norm = kd.sum_squares(grads.view()).sqrt();
        kd.scale(grads.view_mut(), (1.0 / (norm + 1e-6)).min(1.0) as f32);
        let h = AdamWParams {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            grad_scale: 1.0,
            step: step as u64 + 1,
        };
        kd.adamw_step(
            h,
            params.view_mut(),
            grads.view(),
            m.view_mut(),
            vv.view_mut(),
            NO_PARAMS,
        );
        let dt = t0.elapsed().as_secs_f64();
        if step > 0 {
            times.push(dt);
        }
        println!(
            "step {step}: loss {:.4}  {:.3}s (fwd {:.3}s, bwd {:.3}s)  {:.0} tok/s  {:.1} GFLOP/s",
            loss.mean(),
            dt,
            t_fwd,
            t_bwd,
            n as f64 / dt,
            full / dt / 1e9,
        );
    }
    let peak = peak0.max(ferrotron_engine::measure_matmul_peak_gflops());
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let med = times[times.len() / 2];
    println!("matmul peak (best of before/after): {peak:.1} GFLOP/s");
    println!(
        "median step {med:.3}s: {:.0} tok/s, {:.1} GFLOP/s, MFU {:.1}% (causal-attention FLOPs: {:.1}%), peak activations {:.1} MiB",
        n as f64 / med,
        full / med / 1e9,
        100.0 * full / med / 1e9 / peak,
        100.0 * causal / med / 1e9 / peak,
        pool.peak_bytes as f64 / (1u64 << 20) as f64
    );
    let rep = k.report();
    let total: f64 = rep.iter().map(|(_, o)| o.time.as_secs_f64()).sum();
    println!("per-op time over {steps} steps:");
    for (name, o) in rep {
        let s = o.time.as_secs_f64();
        println!(
            "  {name:24} {:6} calls {:8.3}s {:5.1}%",
            o.calls,
            s,
            100.0 * s / total
        );
    }
}
