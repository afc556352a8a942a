//! Attention alone on the GPU: forward, then backward, of the CUDA backend's causal
//! grouped-query attention in bf16 at the shapes of SmolLM-135M, Llama-3.2-1B and a head dim of
//! 128, seq 2048: #32's acceptance holds it within 1.5× of PyTorch's SDPA (flash) at the same
//! shape (`tests/reference/bench_sdpa.py`; `scripts/bench_gpu.sh` runs both and the ratio).
//! FLOPs: 4·D per visible (query, key) pair forward, causal pairs counted once; the backward
//! 2.5× that (its five products to the forward's two, FlashAttention-2's convention).
//! One JSON line per shape; times are medians of `reps` after one warm-up.
//!
//! `cargo run --release -p ferrotron-engine --features cuda --example cuda_attention_bench -- [flash|plain] [reps] [small]`
//! (`plain`: the one-warp-per-row kernels the tensor-core ones replaced; `small`: one short
//! shape, which the CUDA emulator runs in CI so that the kit's binary is known to work.)

use ferrotron_engine::kernels::cuda::{upload, CudaKernels, DeviceBlock};
use ferrotron_engine::kernels::{AttnShape, Kernels};
use half::bf16;
use std::time::Instant;

/// (name, b, t, heads, kv heads, head dim).
type Shape = (&'static str, usize, usize, usize, usize, usize);

/// bench_sdpa.py's shapes.
const SHAPES: [Shape; 3] = [
    ("smollm-135m", 8, 2048, 9, 3, 64),
    ("llama-3.2-1b", 4, 2048, 32, 8, 64),
    ("head-dim-128", 4, 2048, 16, 8, 128),
];
const SMALL: [Shape; 1] = [("small", 1, 130, 4, 2, 64)];

fn device(k: &CudaKernels, n: usize, m: usize, step: f32) -> DeviceBlock {
    let host: Vec<bf16> = (0..n)
        .map(|i| bf16::from_f32(((i % m) as f32 - (m / 2) as f32) * step))
        .collect();
    // SAFETY: bf16 values read as their bytes.
    let bytes = unsafe { std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), n * 2) };
    upload(&k.gpu().ctx, bytes).unwrap_or_else(|e| panic!("upload: {e}"))
}

fn median(mut x: Vec<f64>) -> f64 {
    x.sort_by(f64::total_cmp);
    x[x.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let kernel = args.next().unwrap_or_else(|| "flash".into());
    let reps: usize = args
        .next()
        .map_or(10, |a| a.parse().expect("reps: a number"));
    let shapes: &[Shape] = match args.next().as_deref() {
        Some("small") => &SMALL,
        _ => &SHAPES,
    };
    let k = CudaKernels::open(0).unwrap_or_else(|e| {
        eprintln!("error: {e}");
        std::process::exit(2)
    });
    k.use_plain_attention(match kernel.as_str() {
        "flash" => false,
        "plain" => true,
        other => {
            eprintln!("error: kernel `{other}`: flash or plain");
            std::process::exit(2)
        }
    });
    let g: &dyn Kernels<bf16> = &k;
    for &(name, b, t, heads, kv_heads, head_dim) in shapes {
        let s = AttnShape {
            b,
            t,
            heads,
            kv_heads,
            head_dim,
        };
        let (q, kk, v, d_o) = (
            device(&k, s.q_len(), 13, 0.05),
            device(&k, s.kv_len(), 11, 0.05),
            device(&k, s.kv_len(), 7, 0.1),
            device(&k, s.q_len(), 5, 0.1),
        );
        let (mut o, mut dq, mut dk, mut dv) = (
            device(&k, s.q_len(), 1, 0.0),
            device(&k, s.q_len(), 1, 0.0),
            device(&k, s.kv_len(), 1, 0.0),
            device(&k, s.kv_len(), 1, 0.0),
        );
        let mut lse =
            DeviceBlock::new(&k.gpu().ctx, s.lse_len() * 4).unwrap_or_else(|e| panic!("lse: {e}"));
        let (mut fwd, mut bwd) = (Vec::new(), Vec::new());
        for rep in 0..=reps {
            g.synchronize();
            let t0 = Instant::now();
            g.attention_forward(
                s,
                q.view(s.q_len()),
                kk.view(s.kv_len()),
                v.view(s.kv_len()),
                o.view_mut(s.q_len()),
                lse.view_mut(s.lse_len()),
            );
            g.synchronize();
            let t1 = Instant::now();
            g.attention_backward(
                s,
                q.view(s.q_len()),
                kk.view(s.kv_len()),
                v.view(s.kv_len()),
                o.view(s.q_len()),
                lse.view(s.lse_len()),
                d_o.view(s.q_len()),
                dq.view_mut(s.q_len()),
                dk.view_mut(s.kv_len()),
                dv.view_mut(s.kv_len()),
            );
            g.synchronize();
            if rep > 0 {
                fwd.push((t1 - t0).as_secs_f64());
                bwd.push(t1.elapsed().as_secs_f64());
            }
        }
        let (f, bw) = (median(fwd), median(bwd));
        let pairs = (b * heads * t * (t + 1) / 2) as f64;
        let flops = 4.0 * head_dim as f64 * pairs;
        println!(
            "{{\"impl\": \"ferrotron-{kernel}\", \"shape\": \"{name}\", \"b\": {b}, \"t\": {t}, \"heads\": {heads}, \"kv_heads\": {kv_heads}, \"head_dim\": {head_dim}, \"fwd_ms\": {:.3}, \"bwd_ms\": {:.3}, \"fwd_tflops\": {:.1}, \"fwd_bwd_tflops\": {:.1}}}",
            f * 1e3,
            bw * 1e3,
            flops / f / 1e12,
            3.5 * flops / (f + bw) / 1e12
        );
    }
}
