//! Shared test helpers: a deterministic RNG and error metrics.
#![allow(dead_code)]

pub mod fixture;

/// xorshift64* — deterministic, dependency-free.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
    pub fn below(&mut self, n: u32) -> u32 {
        (self.next_u64() % n as u64) as u32
    }
}

pub fn to64(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// max|got − want| / max(max|want|, floor): an error relative to the tensor's scale, so that
/// entries near zero do not blow up the metric.
pub fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "length mismatch");
    let scale = want.iter().fold(0.0f64, |a, &b| a.max(b.abs())).max(1e-12);
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f64, |a, (&g, &w)| a.max((g as f64 - w).abs()));
    diff / scale
}

#[track_caller]
pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    let e = rel_err(got, want);
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite values in result"
    );
    assert!(
        e <= tol,
        "{what}: relative error {e:.3e} > tolerance {tol:.1e}"
    );
}

/// Central finite differences of a scalar f64 function over every entry of `x`:
/// `(f(x + h e_i) − f(x − h e_i)) / 2h`. With f64 math and h = 1e-5 the truncation error is
/// O(h²)·f''' ≈ 1e-10 and the rounding error ≈ 1e-16/h ≈ 1e-11, far below the f32 kernel error.
pub fn fd_grad(x: &[f64], f: &mut dyn FnMut(&[f64]) -> f64) -> Vec<f64> {
    let h = 1e-5;
    let mut xp = x.to_vec();
    (0..x.len())
        .map(|i| {
            xp[i] = x[i] + h;
            let fp = f(&xp);
            xp[i] = x[i] - h;
            let fm = f(&xp);
            xp[i] = x[i];
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// `Σ a ⊙ b` in f64: the scalar "loss" whose gradient w.r.t. an op's output is `b`.
pub fn dot64(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The small dense Llama of the model-level tests: GQA (4 query, 2 key/value heads), 2 layers,
/// tied or untied head, with or without q/k/v bias.
pub fn dense_cfg(tie: bool, bias: bool) -> ferrotron_engine::model::LlamaConfig {
    ferrotron_engine::model::LlamaConfig {
        hidden: 64,
        intermediate: 96,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        layers: 2,
        vocab: 80,
        rope_theta: 10000.0,
        rms_eps: 1e-5,
        tie_embeddings: tie,
        qkv_bias: bias,
        max_pos: 64,
        moe: None,
    }
}
