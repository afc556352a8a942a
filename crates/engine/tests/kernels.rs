//! Every CPU kernel against a naive f64 reference written here; every backward against central
//! finite differences of that reference (or, for large cases, its analytic gradient, itself
//! checked by finite differences on a small case).
//!
//! Tolerances are relative to the tensor's max magnitude (see `common::rel_err`):
//! forward 1e-5 (f32 rounding over reductions of ≤ a few hundred terms; 2e-5 where a fast exp
//! is involved), backward 1e-4.

mod common;
use common::*;
use ferrotron_engine::kernels::{
    Accum, AdamWParams, AttnShape, CeShape, CpuKernels, Kernels, MatmulShape, NormShape, RopeShape,
    RopeTable, IGNORE_INDEX, NO_PARAMS,
};
use ferrotron_engine::kernels::{AsView, AsViewMut};

use ferrotron_engine::kernels::cpu::matmul::{sgemm, MAX_DEPTH};

const K: &dyn Kernels = &CpuKernels::PLAIN;

// ---------------------------------------------------------------- matmul

fn matmul_ref(x: &[f64], w: &[f64], b: Option<&[f64]>, n: usize, i: usize, o: usize) -> Vec<f64> {
    let mut y = vec![0.0; n * o];
    for r in 0..n {
        for c in 0..o {
            let mut s = b.map_or(0.0, |b| b[c]);
            for k in 0..i {
                s += x[r * i + k] * w[c * i + k];
            }
            y[r * o + c] = s;
        }
    }
    y
}

/// `sgemm` as one fused multiply-add chain per output element, in depth order, over the same
/// depth chunks `sgemm_raw` cuts (each chunk's sum added into dst): the order that holds on
/// every CPU when no gemm call reduces over more than 512 terms.
fn sgemm_fixed_order(a: &[f32], b: &[f32], dst: &mut [f32], (m, n, k): (usize, usize, usize)) {
    let fma = ferrotron_engine::kernels::cpu::simd::has_avx2_fma();
    let parts = k.div_ceil(MAX_DEPTH);
    let kb = k.div_ceil(parts);
    for i in 0..m {
        for j in 0..n {
            let mut k0 = 0;
            while k0 < k {
                let mut s = 0.0f32;
                for p in k0..(k0 + kb).min(k) {
                    let (x, y) = (a[i * k + p], b[p * n + j]);
                    s = if fma { x.mul_add(y, s) } else { x * y + s };
                }
                dst[i * n + j] += s;
                k0 += kb;
            }
        }
    }
}

#[test]
fn sgemm_sums_in_the_same_order_on_every_cpu() {
    // Bit-exact, not approximately equal: the trajectory of a training run must not depend on
    // which CPU runs it (a fp8 loss curve moved by 0.05 nats between an AVX2 EPYC and an
    // AVX-512 Xeon when gemm chose its depth blocks from the cache size). Depths above
    // MAX_DEPTH exercise the chunking; the products are large enough (m·n > 256) for gemm's
    // packed micro-kernels.
    let mut rng = Rng::new(21);
    for &(m, n, k, accumulate) in &[
        (70, 90, 1300, false),
        (48, 40, 700, true),
        (64, 96, 512, false),
    ] {
        let a = rng.vec(m * k, 1.0);
        let b = rng.vec(k * n, 1.0);
        let init = if accumulate {
            rng.vec(m * n, 1.0)
        } else {
            vec![0.0; m * n]
        };
        let mut want = init.clone();
        sgemm_fixed_order(&a, &b, &mut want, (m, n, k));
        let mut got = init;
        sgemm(
            m,
            n,
            k,
            &mut got,
            (n, 1),
            &a,
            (k, 1),
            &b,
            (n, 1),
            accumulate,
            true,
        );
        let differ = got
            .iter()
            .zip(&want)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "{m}x{n}x{k}: {differ} elements differ from the fixed order"
        );
    }
}

#[test]
fn matmul_forward_matches_naive() {
    let mut rng = Rng::new(1);
    // The last shape is wide enough to be cut into column blocks (see `sgemm_raw`).
    for &(n, i, o, bias) in &[
        (7, 5, 3, false),
        (33, 64, 48, true),
        (130, 96, 200, true),
        (40, 600, 2000, true),
    ] {
        let s = MatmulShape {
            n,
            in_features: i,
            out_features: o,
            ragged: false,
        };
        let x = rng.vec(n * i, 1.0);
        let w = rng.vec(o * i, 0.5);
        let b = rng.vec(o, 1.0);
        let bias64 = to64(&b);
        let want = matmul_ref(&to64(&x), &to64(&w), bias.then_some(&bias64[..]), n, i, o);
        let mut y = vec![f32::NAN; n * o];
        K.matmul_forward(
            s,
            x.view(),
            w.view(),
            bias.then_some(b.view()),
            y.view_mut(),
            Accum::Overwrite,
        );
        assert_close("matmul y", &y, &want, 1e-5);
        // Accumulate mode adds onto a residual.
        let resid = rng.vec(n * o, 1.0);
        let mut y2 = resid.clone();
        K.matmul_forward(
            s,
            x.view(),
            w.view(),
            bias.then_some(b.view()),
            y2.view_mut(),
            Accum::Add,
        );
        let want2: Vec<f64> = want
            .iter()
            .zip(&resid)
            .map(|(a, r)| a + *r as f64)
            .collect();
        assert_close("matmul y (+resid)", &y2, &want2, 1e-5);
    }
}

#[test]
fn matmul_backward_matches_finite_differences() {
    let mut rng = Rng::new(2);
    let (n, i, o) = (6, 5, 4);
    let s = MatmulShape {
        n,
        in_features: i,
        out_features: o,
        ragged: false,
    };
    let x = rng.vec(n * i, 1.0);
    let w = rng.vec(o * i, 1.0);
    let b = rng.vec(o, 1.0);
    let dy = rng.vec(n * o, 1.0);
    let (x64, w64, b64, dy64) = (to64(&x), to64(&w), to64(&b), to64(&dy));
    let gx = fd_grad(&x64, &mut |x| {
        dot64(&matmul_ref(x, &w64, Some(&b64), n, i, o), &dy64)
    });
    let gw = fd_grad(&w64, &mut |w| {
        dot64(&matmul_ref(&x64, w, Some(&b64), n, i, o), &dy64)
    });
    let gb = fd_grad(&b64, &mut |b| {
        dot64(&matmul_ref(&x64, &w64, Some(b), n, i, o), &dy64)
    });
    // Parameter grads accumulate onto existing contents; dx overwrites or accumulates.
    let w0 = rng.vec(o * i, 1.0);
    let b0 = rng.vec(o, 1.0);
    let x0 = rng.vec(n * i, 1.0);
    let (mut dw, mut db, mut dx) = (w0.clone(), b0.clone(), vec![f32::NAN; n * i]);
    K.matmul_backward(
        s,
        dy.view(),
        x.view(),
        w.view(),
        Some((dx.view_mut(), Accum::Overwrite)),
        dw.view_mut(),
        Some(db.view_mut()),
    );
    let plus = |g: &[f64], base: &[f32]| -> Vec<f64> {
        g.iter().zip(base).map(|(a, b)| a + *b as f64).collect()
    };
    assert_close("dx", &dx, &gx, 1e-4);
    assert_close("dW (accumulated)", &dw, &plus(&gw, &w0), 1e-4);
    assert_close("dbias (accumulated)", &db, &plus(&gb, &b0), 1e-4);
    let mut dx2 = x0.clone();
    let mut dw2 = vec![0.0; o * i];
    K.matmul_backward(
        s,
        dy.view(),
        x.view(),
        w.view(),
        Some((dx2.view_mut(), Accum::Add)),
        dw2.view_mut(),
        None,
    );
    assert_close("dx (accumulated)", &dx2, &plus(&gx, &x0), 1e-4);
    assert_close("dW", &dw2, &gw, 1e-4);
}

#[test]
fn matmul_backward_large_matches_naive() {
    let mut rng = Rng::new(3);
    let (n, i, o) = (150, 70, 90);
    let s = MatmulShape {
        n,
        in_features: i,
        out_features: o,
        ragged: false,
    };
    let x = rng.vec(n * i, 1.0);
    let w = rng.vec(o * i, 1.0);
    let dy = rng.vec(n * o, 1.0);
    let mut dx = vec![0.0; n * i];
    let mut dw = vec![0.0; o * i];
    let mut db = vec![0.0; o];
    K.matmul_backward(
        s,
        dy.view(),
        x.view(),
        w.view(),
        Some((dx.view_mut(), Accum::Overwrite)),
        dw.view_mut(),
        Some(db.view_mut()),
    );
    let (x64, w64, dy64) = (to64(&x), to64(&w), to64(&dy));
    let mut gx = vec![0.0; n * i];
    let mut gw = vec![0.0; o * i];
    let mut gb = vec![0.0; o];
    for r in 0..n {
        for c in 0..o {
            gb[c] += dy64[r * o + c];
            for k in 0..i {
                gx[r * i + k] += dy64[r * o + c] * w64[c * i + k];
                gw[c * i + k] += dy64[r * o + c] * x64[r * i + k];
            }
        }
    }
    assert_close("dx", &dx, &gx, 1e-5);
    assert_close("dW", &dw, &gw, 1e-5);
    assert_close("dbias", &db, &gb, 1e-5);
}

/// Reductions longer than `MAX_DEPTH` (the LM head's input gradient reduces over the
/// vocabulary, the weight gradient over the tokens) are cut into depth chunks accumulated in
/// order; products tall enough to need row blocks too. Both accumulate modes.
#[test]
fn matmul_long_reductions_match_naive() {
    use ferrotron_engine::kernels::cpu::matmul::MAX_DEPTH;
    let mut rng = Rng::new(11);
    let (n, i, o) = (2 * MAX_DEPTH + 77, 9, 2 * MAX_DEPTH + 301);
    let s = MatmulShape {
        n,
        in_features: i,
        out_features: o,
        ragged: false,
    };
    let x = rng.vec(n * i, 1.0);
    let w = rng.vec(o * i, 1.0);
    let dy = rng.vec(n * o, 1.0);
    let dx0 = rng.vec(n * i, 1.0);
    let dw0 = rng.vec(o * i, 1.0);
    let (x64, w64, dy64) = (to64(&x), to64(&w), to64(&dy));
    let mut gx = vec![0.0; n * i];
    let mut gw = vec![0.0; o * i];
    for r in 0..n {
        for c in 0..o {
            let g = dy64[r * o + c];
            for k in 0..i {
                gx[r * i + k] += g * w64[c * i + k];
                gw[c * i + k] += g * x64[r * i + k];
            }
        }
    }
    let mut dx = dx0.clone();
    K.matmul_backward_input(s, dy.view(), w.view(), dx.view_mut(), Accum::Overwrite);
    assert_close("dx overwrite", &dx, &gx, 1e-5);
    let mut dx = dx0.clone();
    K.matmul_backward_input(s, dy.view(), w.view(), dx.view_mut(), Accum::Add);
    let gx_add: Vec<f64> = gx.iter().zip(&dx0).map(|(g, d)| g + *d as f64).collect();
    assert_close("dx add", &dx, &gx_add, 1e-5);
    let mut dw = dw0.clone();
    K.matmul_backward_weight(s, dy.view(), x.view(), dw.view_mut(), None);
    let gw_add: Vec<f64> = gw.iter().zip(&dw0).map(|(g, d)| g + *d as f64).collect();
    assert_close("dW", &dw, &gw_add, 1e-5);
}

// ---------------------------------------------------------------- rmsnorm

fn rmsnorm_ref(x: &[f64], w: &[f64], c: usize, eps: f64) -> Vec<f64> {
    x.chunks(c)
        .flat_map(|r| {
            let ms = r.iter().map(|v| v * v).sum::<f64>() / c as f64;
            let rs = 1.0 / (ms + eps).sqrt();
            r.iter()
                .zip(w)
                .map(move |(v, wi)| v * rs * wi)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn rmsnorm_forward_and_backward() {
    let mut rng = Rng::new(4);
    for &(n, c, eps) in &[(5, 7, 1e-6f32), (37, 130, 1e-5)] {
        let s = NormShape { n, c, eps };
        let x = rng.vec(n * c, 2.0);
        let w = rng.vec(c, 1.5);
        let dy = rng.vec(n * c, 1.0);
        let (x64, w64, dy64) = (to64(&x), to64(&w), to64(&dy));
        let mut out = vec![0.0; n * c];
        let mut rstd = vec![0.0; n];
        K.rmsnorm_forward(s, x.view(), w.view(), out.view_mut(), rstd.view_mut());
        assert_close(
            "rmsnorm out",
            &out,
            &rmsnorm_ref(&x64, &w64, c, eps as f64),
            1e-5,
        );
        let want_rstd: Vec<f64> = x64
            .chunks(c)
            .map(|r| 1.0 / (r.iter().map(|v| v * v).sum::<f64>() / c as f64 + eps as f64).sqrt())
            .collect();
        assert_close("rmsnorm rstd", &rstd, &want_rstd, 1e-5);

        let gx = fd_grad(&x64, &mut |x| {
            dot64(&rmsnorm_ref(x, &w64, c, eps as f64), &dy64)
        });
        let gw = fd_grad(&w64, &mut |w| {
            dot64(&rmsnorm_ref(&x64, w, c, eps as f64), &dy64)
        });
        let dw0 = rng.vec(c, 1.0);
        let mut dw = dw0.clone();
        let mut dx = vec![f32::NAN; n * c];
        K.rmsnorm_backward(
            s,
            dy.view(),
            x.view(),
            w.view(),
            rstd.view(),
            dx.view_mut(),
            Accum::Overwrite,
            dw.view_mut(),
        );
        assert_close("rmsnorm dx", &dx, &gx, 1e-4);
        let gw_acc: Vec<f64> = gw.iter().zip(&dw0).map(|(a, b)| a + *b as f64).collect();
        assert_close("rmsnorm dw (accumulated)", &dw, &gw_acc, 1e-4);
        let base = rng.vec(n * c, 1.0);
        let mut dx2 = base.clone();
        K.rmsnorm_backward(
            s,
            dy.view(),
            x.view(),
            w.view(),
            rstd.view(),
            dx2.view_mut(),
            Accum::Add,
            dw.view_mut(),
        );
        let gx_acc: Vec<f64> = gx.iter().zip(&base).map(|(a, b)| a + *b as f64).collect();
        assert_close("rmsnorm dx (accumulated)", &dx2, &gx_acc, 1e-4);
    }
}

// ---------------------------------------------------------------- rope

/// HF `apply_rotary_pos_emb`: `x·cos + rotate_half(x)·sin`, `rotate_half([a,b]) = [-b, a]`,
/// `inv_freq_i = theta^(-2i/D)`, angle = pos·inv_freq (all in f64 here).
fn rope_ref(x: &[f64], b: usize, t: usize, h: usize, d: usize, theta: f64) -> Vec<f64> {
    let mut y = x.to_vec();
    let half = d / 2;
    for bi in 0..b {
        for p in 0..t {
            for hi in 0..h {
                let base = ((bi * t + p) * h + hi) * d;
                for i in 0..d {
                    let f = i % half;
                    let ang = p as f64 * theta.powf(-2.0 * f as f64 / d as f64);
                    let rot = if i < half {
                        -x[base + i + half]
                    } else {
                        x[base + i - half]
                    };
                    y[base + i] = x[base + i] * ang.cos() + rot * ang.sin();
                }
            }
        }
    }
    y
}

#[test]
fn rope_forward_and_backward() {
    let mut rng = Rng::new(5);
    let (b, t, h, d, theta) = (2, 9, 3, 8, 10000.0f32);
    let s = RopeShape {
        b,
        t,
        heads: h,
        head_dim: d,
    };
    let table = RopeTable::new(d, 16, theta);
    let x = rng.vec(b * t * h * d, 1.0);
    let mut y = x.clone();
    K.rope_forward(s, &table, y.view_mut());
    // The table is computed in f32 like HF (angle = f32(pos)·f32(inv_freq)), hence 1e-5 vs f64.
    assert_close(
        "rope fwd",
        &y,
        &rope_ref(&to64(&x), b, t, h, d, theta as f64),
        1e-5,
    );
    let dy = rng.vec(x.len(), 1.0);
    let dy64 = to64(&dy);
    let g = fd_grad(&to64(&x), &mut |x| {
        dot64(&rope_ref(x, b, t, h, d, theta as f64), &dy64)
    });
    let mut dx = dy.clone();
    K.rope_backward(s, &table, dx.view_mut());
    assert_close("rope bwd", &dx, &g, 1e-4);
    // Round trip: backward is the inverse rotation.
    K.rope_backward(s, &table, y.view_mut());
    assert_close("rope roundtrip", &y, &to64(&x), 1e-6);
}

// ---------------------------------------------------------------- attention

/// Naive causal GQA attention with the full T×T softmax, f64.
fn attn_ref(s: AttnShape, q: &[f64], k: &[f64], v: &[f64]) -> (Vec<f64>, Vec<f64>) {
    let (b, t, h, kv, d) = (s.b, s.t, s.heads, s.kv_heads, s.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let mut o = vec![0.0; q.len()];
    let mut lse = vec![0.0; b * h * t];
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / kv);
            for i in 0..t {
                let qi = &q[((bi * t + i) * h + hi) * d..][..d];
                let sc: Vec<f64> = (0..=i)
                    .map(|j| {
                        let kj = &k[((bi * t + j) * kv + kh) * d..][..d];
                        qi.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() * scale
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                lse[(bi * h + hi) * t + i] = m + z.ln();
                for (j, sj) in sc.iter().enumerate() {
                    let p = (sj - m).exp() / z;
                    let vj = &v[((bi * t + j) * kv + kh) * d..][..d];
                    for e in 0..d {
                        o[((bi * t + i) * h + hi) * d + e] += p * vj[e];
                    }
                }
            }
        }
    }
    (o, lse)
}

/// Analytic gradients of the naive attention (explicit P, dP, dS = P⊙(dP − rowsum(P⊙dP))).
fn attn_ref_backward(s: AttnShape, q: &[f64], k: &[f64], v: &[f64], d_o: &[f64]) -> [Vec<f64>; 3] {
    let (b, t, h, kv, d) = (s.b, s.t, s.heads, s.kv_heads, s.head_dim);
    let scale = 1.0 / (d as f64).sqrt();
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    for bi in 0..b {
        for hi in 0..h {
            let kh = hi / (h / kv);
            let qo = |i: usize| ((bi * t + i) * h + hi) * d;
            let ko = |j: usize| ((bi * t + j) * kv + kh) * d;
            for i in 0..t {
                let sc: Vec<f64> = (0..=i)
                    .map(|j| (0..d).map(|e| q[qo(i) + e] * k[ko(j) + e]).sum::<f64>() * scale)
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = sc.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = sc.iter().map(|x| (x - m).exp() / z).collect();
                let dp: Vec<f64> = (0..=i)
                    .map(|j| (0..d).map(|e| d_o[qo(i) + e] * v[ko(j) + e]).sum())
                    .collect();
                let row: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                for j in 0..=i {
                    let ds = p[j] * (dp[j] - row) * scale;
                    for e in 0..d {
                        dv[ko(j) + e] += p[j] * d_o[qo(i) + e];
                        dq[qo(i) + e] += ds * k[ko(j) + e];
                        dk[ko(j) + e] += ds * q[qo(i) + e];
                    }
                }
            }
        }
    }
    [dq, dk, dv]
}

fn attn_case(s: AttnShape, seed: u64) -> [Vec<f32>; 4] {
    let mut rng = Rng::new(seed);
    [
        rng.vec(s.q_len(), 1.5),
        rng.vec(s.kv_len(), 1.5),
        rng.vec(s.kv_len(), 1.0),
        rng.vec(s.q_len(), 1.0),
    ]
}

#[test]
fn attention_forward_matches_naive_softmax() {
    // T = 70 crosses the 64-key block and leaves a partial 4-row query block; D = 12 and 20
    // exercise the non-multiple-of-16 tails; (H, KV) = (4, 2) and (3, 1) exercise GQA/MQA.
    for (i, s) in [
        AttnShape {
            b: 2,
            t: 70,
            heads: 4,
            kv_heads: 2,
            head_dim: 12,
        },
        AttnShape {
            b: 1,
            t: 133,
            heads: 3,
            kv_heads: 1,
            head_dim: 20,
        },
        AttnShape {
            b: 1,
            t: 5,
            heads: 2,
            kv_heads: 2,
            head_dim: 64,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let [q, k, v, _] = attn_case(s, 10 + i as u64);
        let (o_ref, lse_ref) = attn_ref(s, &to64(&q), &to64(&k), &to64(&v));
        let mut o = vec![f32::NAN; s.q_len()];
        let mut lse = vec![f32::NAN; s.lse_len()];
        K.attention_forward(
            s,
            q.view(),
            k.view(),
            v.view(),
            o.view_mut(),
            lse.view_mut(),
        );
        assert_close("attn o", &o, &o_ref, 2e-5);
        assert_close("attn lse", &lse, &lse_ref, 2e-5);
    }
}

#[test]
fn attention_reference_backward_matches_finite_differences() {
    // Validates the analytic reference used by the large-case test below.
    let s = AttnShape {
        b: 1,
        t: 6,
        heads: 2,
        kv_heads: 1,
        head_dim: 4,
    };
    let [q, k, v, d_o] = attn_case(s, 20);
    let (q, k, v, d_o) = (to64(&q), to64(&k), to64(&v), to64(&d_o));
    let [dq, dk, dv] = attn_ref_backward(s, &q, &k, &v, &d_o);
    let f = |q: &[f64], k: &[f64], v: &[f64]| dot64(&attn_ref(s, q, k, v).0, &d_o);
    let gq = fd_grad(&q, &mut |x| f(x, &k, &v));
    let gk = fd_grad(&k, &mut |x| f(&q, x, &v));
    let gv = fd_grad(&v, &mut |x| f(&q, &k, x));
    for (name, a, b) in [("dq", &dq, &gq), ("dk", &dk, &gk), ("dv", &dv, &gv)] {
        let e = a
            .iter()
            .zip(b.iter())
            .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
        assert!(e < 1e-8, "reference {name} off by {e}");
    }
}

#[test]
fn attention_backward_matches_finite_differences() {
    let s = AttnShape {
        b: 2,
        t: 11,
        heads: 4,
        kv_heads: 2,
        head_dim: 6,
    };
    let [q, k, v, d_o] = attn_case(s, 21);
    let (q64, k64, v64, do64) = (to64(&q), to64(&k), to64(&v), to64(&d_o));
    let f = |q: &[f64], k: &[f64], v: &[f64]| dot64(&attn_ref(s, q, k, v).0, &do64);
    let gq = fd_grad(&q64, &mut |x| f(x, &k64, &v64));
    let gk = fd_grad(&k64, &mut |x| f(&q64, x, &v64));
    let gv = fd_grad(&v64, &mut |x| f(&q64, &k64, x));
    let mut o = vec![0.0; s.q_len()];
    let mut lse = vec![0.0; s.lse_len()];
    K.attention_forward(
        s,
        q.view(),
        k.view(),
        v.view(),
        o.view_mut(),
        lse.view_mut(),
    );
    let (mut dq, mut dk, mut dv) = (
        vec![f32::NAN; s.q_len()],
        vec![f32::NAN; s.kv_len()],
        vec![f32::NAN; s.kv_len()],
    );
    K.attention_backward(
        s,
        q.view(),
        k.view(),
        v.view(),
        o.view(),
        lse.view(),
        d_o.view(),
        dq.view_mut(),
        dk.view_mut(),
        dv.view_mut(),
    );
    assert_close("attn dq", &dq, &gq, 1e-4);
    assert_close("attn dk", &dk, &gk, 1e-4);
    assert_close("attn dv", &dv, &gv, 1e-4);
}

#[test]
fn attention_backward_large_matches_naive_analytic() {
    for (i, s) in [
        AttnShape {
            b: 2,
            t: 70,
            heads: 4,
            kv_heads: 2,
            head_dim: 12,
        },
        AttnShape {
            b: 1,
            t: 133,
            heads: 6,
            kv_heads: 2,
            head_dim: 32,
        },
    ]
    .into_iter()
    .enumerate()
    {
        let [q, k, v, d_o] = attn_case(s, 30 + i as u64);
        let [gq, gk, gv] = attn_ref_backward(s, &to64(&q), &to64(&k), &to64(&v), &to64(&d_o));
        let mut o = vec![0.0; s.q_len()];
        let mut lse = vec![0.0; s.lse_len()];
        K.attention_forward(
            s,
            q.view(),
            k.view(),
            v.view(),
            o.view_mut(),
            lse.view_mut(),
        );
        let (mut dq, mut dk, mut dv) = (
            vec![f32::NAN; s.q_len()],
            vec![f32::NAN; s.kv_len()],
            vec![f32::NAN; s.kv_len()],
        );
        K.attention_backward(
            s,
            q.view(),
            k.view(),
            v.view(),
            o.view(),
            lse.view(),
            d_o.view(),
            dq.view_mut(),
            dk.view_mut(),
            dv.view_mut(),
        );
        assert_close("attn dq", &dq, &gq, 1e-4);
        assert_close("attn dk", &dk, &gk, 1e-4);
        assert_close("attn dv", &dv, &gv, 1e-4);
    }
}

// ---------------------------------------------------------------- swiglu

fn swiglu_ref(g: &[f64], u: &[f64]) -> Vec<f64> {
    g.iter()
        .zip(u)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect()
}

#[test]
fn swiglu_forward_and_backward() {
    let mut rng = Rng::new(6);
    let n = 40_000; // > one parallel chunk
    let g = rng.vec(n, 6.0);
    let u = rng.vec(n, 2.0);
    let mut h = vec![0.0; n];
    K.swiglu_forward(g.view(), u.view(), h.view_mut());
    assert_close("swiglu h", &h, &swiglu_ref(&to64(&g), &to64(&u)), 2e-6);
    // Backward by finite differences on a small slice (the op is elementwise).
    let m = 300;
    let dh = rng.vec(m, 1.0);
    let (g64, u64_, dh64) = (to64(&g[..m]), to64(&u[..m]), to64(&dh));
    let gg = fd_grad(&g64, &mut |x| dot64(&swiglu_ref(x, &u64_), &dh64));
    let gu = fd_grad(&u64_, &mut |x| dot64(&swiglu_ref(&g64, x), &dh64));
    let (mut dg, mut du) = (vec![f32::NAN; m], vec![f32::NAN; m]);
    K.swiglu_backward(
        dh.view(),
        g.view().slice(..m),
        u.view().slice(..m),
        dg.view_mut(),
        du.view_mut(),
    );
    assert_close("swiglu dgate", &dg, &gg, 1e-5);
    assert_close("swiglu dup", &du, &gu, 1e-5);
}

// ---------------------------------------------------------------- embedding

#[test]
fn embedding_forward_and_backward() {
    let mut rng = Rng::new(7);
    let (vocab, c, n) = (11, 70, 50); // repeated tokens exercise the scatter-add
    let wte = rng.vec(vocab * c, 1.0);
    let tokens: Vec<u32> = (0..n).map(|_| rng.below(vocab as u32)).collect();
    let mut out = vec![0.0; n * c];
    K.embedding_forward(tokens.view(), wte.view(), c, out.view_mut());
    for (r, &t) in tokens.iter().enumerate() {
        assert_eq!(
            &out[r * c..(r + 1) * c],
            &wte[t as usize * c..(t as usize + 1) * c]
        );
    }
    let dout = rng.vec(n * c, 1.0);
    let base = rng.vec(vocab * c, 1.0);
    let mut dwte = base.clone();
    K.embedding_backward(tokens.view(), dout.view(), c, dwte.view_mut());
    let mut want = to64(&base);
    for (r, &t) in tokens.iter().enumerate() {
        for e in 0..c {
            want[t as usize * c + e] += dout[r * c + e] as f64;
        }
    }
    assert_close("embedding dwte", &dwte, &want, 1e-6);
}

// ---------------------------------------------------------------- elementwise

#[test]
fn elementwise_ops() {
    let mut rng = Rng::new(8);
    let n = 50_001;
    let a = rng.vec(n, 1.0);
    let b = rng.vec(n, 1.0);
    let mut out = vec![0.0; n];
    K.add(a.view(), b.view(), out.view_mut());
    let want: Vec<f64> = a
        .iter()
        .zip(&b)
        .map(|(x, y)| *x as f64 + *y as f64)
        .collect();
    assert_close("add", &out, &want, 1e-7);
    let mut acc = a.clone();
    K.add_inplace(acc.view_mut(), b.view());
    assert_close("add_inplace", &acc, &want, 1e-7);
    let mut c = vec![0.0; n];
    K.copy(a.view(), c.view_mut());
    assert_eq!(c, a);
    K.scale(c.view_mut(), 0.5);
    assert_close(
        "scale",
        &c,
        &a.iter().map(|x| *x as f64 * 0.5).collect::<Vec<_>>(),
        1e-7,
    );
    let ss = K.sum_squares(a.view());
    let want_ss: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    assert!(
        ((ss - want_ss) / want_ss).abs() < 1e-6,
        "sum_squares {ss} vs {want_ss}"
    );
    let mut bf = vec![half::bf16::ZERO; n];
    Kernels::<half::bf16>::round_params(&CpuKernels::PLAIN, a.view(), bf.view_mut());
    let back: Vec<f32> = bf.iter().map(|x| x.to_f32()).collect();
    // bf16 keeps 8 significant bits: round-to-nearest error ≤ half an ulp ≤ 2^-8 relative.
    for (x, y) in a.iter().zip(&back) {
        assert!(
            (x - y).abs() <= x.abs() * (1.0 / 256.0) + 1e-30,
            "bf16 roundtrip {x} -> {y}"
        );
    }
}

// ---------------------------------------------------------------- cross-entropy

fn ce_ref(z: &[f64], targets: &[u32], v: usize) -> Vec<f64> {
    z.chunks(v)
        .zip(targets)
        .map(|(r, &t)| {
            if t as usize >= v {
                return 0.0;
            }
            let m = r.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + r.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            lse - r[t as usize]
        })
        .collect()
}

#[test]
fn cross_entropy_loss_and_gradient() {
    let mut rng = Rng::new(9);
    let (rows, v) = (9, 37);
    let s = CeShape { rows, vocab: v };
    let logits = rng.vec(rows * v, 8.0);
    let mut targets: Vec<u32> = (0..rows).map(|_| rng.below(v as u32)).collect();
    targets[3] = IGNORE_INDEX;
    targets[6] = (-100i32) as u32; // PyTorch's ignore_index, cast
    let z64 = to64(&logits);
    let want = ce_ref(&z64, &targets, v);
    // Forward only: logits untouched.
    let mut z = logits.clone();
    let mut losses = vec![f32::NAN; rows];
    let sum = K.cross_entropy(s, z.view_mut(), targets.view(), losses.view_mut(), None);
    assert_eq!(z, logits);
    assert_close("ce losses", &losses, &want, 2e-6);
    assert!(
        (sum - want.iter().sum::<f64>()).abs() < 1e-4,
        "ce sum {sum}"
    );
    // With gradient: d(scale·Σ loss)/dz.
    let scale = 1.0 / 7.0;
    let mut z = logits.clone();
    let sum2 = K.cross_entropy(
        s,
        z.view_mut(),
        targets.view(),
        losses.view_mut(),
        Some(scale),
    );
    assert!((sum2 - sum).abs() < 1e-9);
    let g = fd_grad(&z64, &mut |x| {
        ce_ref(x, &targets, v).iter().sum::<f64>() * scale as f64
    });
    assert_close("ce dlogits", &z, &g, 1e-5);
    assert!(
        z[3 * v..4 * v].iter().all(|&x| x == 0.0),
        "ignored row must get zero grad"
    );
}

#[test]
fn cross_entropy_large_vocab_rows() {
    let mut rng = Rng::new(19);
    let (rows, v) = (4, 50_257);
    let logits = rng.vec(rows * v, 10.0);
    let targets: Vec<u32> = (0..rows).map(|_| rng.below(v as u32)).collect();
    let want = ce_ref(&to64(&logits), &targets, v);
    let mut z = logits.clone();
    let mut losses = vec![0.0; rows];
    K.cross_entropy(
        CeShape { rows, vocab: v },
        z.view_mut(),
        targets.view(),
        losses.view_mut(),
        Some(1.0),
    );
    assert_close("ce losses (V=50257)", &losses, &want, 1e-5);
    // Each gradient row sums to zero (softmax sums to one, minus the one-hot).
    for r in z.chunks(v) {
        let s: f64 = r.iter().map(|x| *x as f64).sum();
        assert!(s.abs() < 1e-5, "dlogits row sum {s}");
    }
}

// ---------------------------------------------------------------- adamw

#[test]
fn adamw_matches_torch_formula() {
    let mut rng = Rng::new(11);
    let n = 20_000;
    let h0 = AdamWParams {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        grad_scale: 1.0,
        step: 0,
    };
    let mut p = rng.vec(n, 1.0);
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let (mut p64, mut m64, mut v64) = (to64(&p), vec![0.0f64; n], vec![0.0f64; n]);
    for step in 1..=5u64 {
        let g = rng.vec(n, 0.1);
        let h = AdamWParams { step, ..h0 };
        K.adamw_step(
            h,
            p.view_mut(),
            g.view(),
            m.view_mut(),
            v.view_mut(),
            NO_PARAMS,
        );
        // torch.optim.AdamW (Loshchilov & Hutter 2019), in f64.
        let (bc1, bc2) = (
            1.0 - h.beta1.powi(step as i32),
            1.0 - h.beta2.powi(step as i32),
        );
        for i in 0..n {
            let gi = g[i] as f64;
            p64[i] *= 1.0 - h.lr * h.weight_decay;
            m64[i] = h.beta1 * m64[i] + (1.0 - h.beta1) * gi;
            v64[i] = h.beta2 * v64[i] + (1.0 - h.beta2) * gi * gi;
            p64[i] -= h.lr / bc1 * m64[i] / (v64[i].sqrt() / bc2.sqrt() + h.eps);
        }
    }
    assert_close("adamw m", &m, &m64, 1e-5);
    assert_close("adamw v", &v, &v64, 1e-5);
    // Parameters moved by ~5·lr; compare the update itself so the tolerance means something.
    let p_init = Rng::new(11).vec(n, 1.0);
    let du: Vec<f32> = p.iter().zip(&p_init).map(|(a, b)| a - b).collect();
    let du64: Vec<f64> = p64
        .iter()
        .zip(&p_init)
        .map(|(a, b)| a - *b as f64)
        .collect();
    assert_close("adamw update", &du, &du64, 1e-3);
}
