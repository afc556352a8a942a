//! AdamW exactly as `torch.optim.AdamW` (single-tensor path), Loshchilov & Hutter 2019, Alg. 2
//! with Kingma & Ba 2015 bias correction:
//! `p ← p·(1 − lr·wd)`; `m ← lerp(m, g, 1−β1)`; `v ← β2·v + (1−β2)·g²`;
//! `p ← p − (lr / (1−β1ᵗ)) · m / (sqrt(v)/sqrt(1−β2ᵗ) + eps)`.

use super::swiglu::CHUNK;
use crate::dispatch_fma;
use crate::dtype::Elem;
use crate::kernels::{AdamWParams, Rounding};
use crate::numerics::rounding::noise;
use rayon::prelude::*;

/// One AdamW step on the f32 `params` (the master weights under mixed precision), reading
/// `grads · h.grad_scale`; with `out`, the updated weights are also rounded into 16-bit storage.
pub fn step<S: Elem, G: Elem>(
    h: AdamWParams,
    params: &mut [f32],
    grads: &[G],
    m: &mut [f32],
    v: &mut [f32],
    out: Option<(&mut [S], Rounding)>,
) {
    let n = params.len();
    assert!(
        grads.len() == n && m.len() == n && v.len() == n,
        "adamw lens"
    );
    let c = Consts::of(h);
    let Some((out, rounding)) = out else {
        params
            .par_chunks_mut(CHUNK)
            .zip(grads.par_chunks(CHUNK))
            .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
            .for_each(|((p, g), (m, v))| chunk(c, p, g, m, v));
        return;
    };
    assert_eq!(out.len(), n, "adamw params out len");
    params
        .par_chunks_mut(CHUNK)
        .zip(grads.par_chunks(CHUNK))
        .zip(m.par_chunks_mut(CHUNK).zip(v.par_chunks_mut(CHUNK)))
        .zip(out.par_chunks_mut(CHUNK))
        .enumerate()
        .for_each(|(ci, (((p, g), (m, v)), o))| {
            chunk(c, p, g, m, v);
            match rounding {
                Rounding::Nearest => S::store(p, o),
                Rounding::Stochastic { seed } => {
                    let base = (ci * CHUNK) as u64;
                    for (i, (o, p)) in o.iter_mut().zip(p.iter()).enumerate() {
                        *o = S::from_f32_stochastic(*p, noise(seed, h.step, base + i as u64));
                    }
                }
            }
        });
}

/// The step's scalars in f32, as torch computes them (f64 Python floats, then cast). `repr(C)`:
/// the CUDA kernel takes the same struct (`kernels/cuda/cu/adamw.cu`, `AdamConsts`).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C)]
pub(crate) struct Consts {
    decay: f32,
    w: f32,
    b2: f32,
    one_m_b2: f32,
    eps: f32,
    step_size: f32,
    bc2_sqrt: f32,
    grad_scale: f32,
}

impl Consts {
    pub(crate) fn of(h: AdamWParams) -> Consts {
        assert!(h.step >= 1, "adamw step is 1-based");
        let t = h.step.min(i32::MAX as u64) as i32;
        // torch computes the corrections as Python floats (f64), then uses them as scalars.
        let bc1 = 1.0 - h.beta1.powi(t);
        let bc2 = 1.0 - h.beta2.powi(t);
        Consts {
            decay: (1.0 - h.lr * h.weight_decay) as f32,
            w: (1.0 - h.beta1) as f32,
            b2: h.beta2 as f32,
            one_m_b2: (1.0 - h.beta2) as f32,
            eps: h.eps as f32,
            step_size: (h.lr / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            grad_scale: h.grad_scale,
        }
    }
}

#[inline(always)]
fn chunk_generic<const F: bool, G: Elem>(
    c: Consts,
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
) {
    let n = p.len();
    let (g, m, v) = (&g[..n], &mut m[..n], &mut v[..n]);
    for i in 0..n {
        let gi = g[i].to_f32() * c.grad_scale;
        let pi = p[i] * c.decay;
        // torch lerp: weight < 0.5 ? self + w·(end − self) : end − (end − self)·(1 − w)
        let mi = if c.w < 0.5 {
            m[i] + c.w * (gi - m[i])
        } else {
            gi - (gi - m[i]) * (1.0 - c.w)
        };
        let vi = v[i] * c.b2 + c.one_m_b2 * gi * gi;
        let denom = vi.sqrt() / c.bc2_sqrt + c.eps;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - c.step_size * (mi / denom);
    }
}
dispatch_fma!(fn chunk<G: Elem> => chunk_generic(c: Consts, p: &mut [f32], g: &[G], m: &mut [f32], v: &mut [f32]));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::cpu::simd::tiers::{agree, random, stored};
    use half::bf16;

    /// One chunk update from fixed states, gradients stored as `G`; the new states.
    fn run<G: Elem>(n: usize) -> Vec<f32> {
        let c = Consts {
            decay: 0.999,
            w: 0.1,
            b2: 0.95,
            one_m_b2: 0.05,
            eps: 1e-8,
            step_size: 3e-4,
            bc2_sqrt: 0.3,
            grad_scale: 0.5,
        };
        let g = stored::<G>(&random(n, 10, 1.0));
        let (mut p, mut m) = (random(n, 11, 1.0), random(n, 12, 0.1));
        let mut v: Vec<f32> = random(n, 13, 0.1).iter().map(|x| x * x).collect();
        chunk(c, &mut p, &g, &mut m, &mut v);
        [p, m, v].concat()
    }

    #[test]
    fn every_simd_tier_agrees() {
        agree("adamw f32 grads", 1e-5, || run::<f32>(1037));
        agree("adamw bf16 grads", 1e-5, || run::<bf16>(1037));
    }
}
