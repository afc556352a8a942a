//! Mixed-precision kernels (16-bit storage, f32 math, round on store) at the kernel level.
//!
//! The contract (`ferrotron_engine::dtype`): a kernel widens its 16-bit inputs exactly, computes
//! in f32 and rounds each output once (round to nearest even). So against a reference computed
//! in f64 from the *rounded* inputs the only errors allowed are
//! - one rounding of the output: at most half an ulp, i.e. `2^-8·|ref|` for bf16 (8 significant
//!   bits) and `2^-11·|ref|` for f16 (11 bits), and
//! - f32 accumulation, bounded here by `ACC·Σ|terms|` with `ACC = 2^-20`: with f32 outputs the
//!   measured error is 25–70× below it (worst error / bound 0.014–0.04), while accumulating a
//!   reduction in 16 bits (error ≈ 2^-9·√k·|partial sum|) would exceed it by orders of
//!   magnitude. With 16-bit outputs the worst error / bound is 0.88–0.995: the rounding term
//!   is what binds, and it is exact (the error of one round-to-nearest reaches half an ulp).
//!
//! Products of two bf16 (or f16, or fp8) values are exact in f32, so the reference sees exactly
//! what the kernel multiplies. What is checked:
//! (a) matmul forward / backward-input / backward-weight for bf16 and f16, on shapes that take
//!     the staged path through several column panels, several row tiles and (weight gradient)
//!     two depth chunks;
//! (b) the weight gradient into f32 (`Kernels<bf16, f32>`) is not rounded to bf16 at all;
//! (c) rmsnorm, swiglu, rope and attention, forward and backward, in bf16 match the same
//!     kernels in f32 on the widened inputs within one bf16 rounding;
//! (d) the embedding backward into bf16 sums a token's rows in f32 and rounds once (bit-exact);
//! (e) the fp8 matmul equals an explicit per-tensor-current-scaling quantise-dequantise
//!     reference (`numerics::fp8`);
//! (f) AdamW into bf16 parameters: stochastic rounding is deterministic, nearest rounding is
//!     `bf16::from_f32(master)`, and `grad_scale` equals scaling the gradients.

mod common;

use common::Rng;
use ferrotron_engine::kernels::cpu::staged_gemm::{tiling, MAX_DEPTH as STAGED_MAX_DEPTH};
use ferrotron_engine::kernels::{
    Accum, AdamWParams, AttnShape, CpuKernels, Elem, Kernels, MatmulShape, NormShape, RopeShape,
    RopeTable, Rounding,
};
use ferrotron_engine::kernels::{AsView, AsViewMut};
use ferrotron_engine::numerics::fp8::{amax, round_trip, scale_for, Fp8Format};
use ferrotron_plan::DType;
use half::{bf16, f16};
use rayon::prelude::*;

/// Bound on f32 accumulation error, relative to `Σ|terms|` (see the module docs).
const ACC: f64 = 1.0 / (1u64 << 20) as f64;
/// Half an ulp, relative: bf16 has 8 significant bits.
const BF16_HALF_ULP: f64 = 1.0 / 256.0;

// ---------------------------------------------------------------- helpers

/// `rng.vec(n, scale)` rounded to `S`.
fn rand_vec<S: Elem>(rng: &mut Rng, n: usize, scale: f32) -> Vec<S> {
    rng.vec(n, scale).into_iter().map(S::from_f32).collect()
}

fn widen<S: Elem>(x: &[S]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

fn widen64<S: Elem>(x: &[S]) -> Vec<f64> {
    x.iter().map(|v| v.to_f32() as f64).collect()
}

/// Half an ulp relative to the value, for the output type.
/// (0 for f32, whose own rounding is covered by the accumulation term.)
fn half_ulp<S: Elem>() -> f64 {
    match S::DTYPE {
        DType::F32 => 0.0,
        DType::Bf16 => BF16_HALF_ULP,
        DType::F16 => 1.0 / 2048.0, // 11 significant bits
        d => panic!("no storage type {d:?}"),
    }
}

/// `rows[m, k]` (row-major) of the f64 operand whose element (i, p) is `f(i, p)`.
fn materialise(m: usize, k: usize, f: impl Fn(usize, usize) -> f64 + Sync) -> Vec<f64> {
    let mut out = vec![0.0; m * k];
    out.par_chunks_mut(k)
        .enumerate()
        .for_each(|(i, row)| row.iter_mut().enumerate().for_each(|(p, x)| *x = f(i, p)));
    out
}

/// The f64 product `Σ_{p in range} a[i, p]·b[j, p]` for every (i, j) (`a` is `[m, k]`, `b` is
/// `[n, k]`, both row-major), with `Σ|terms|` alongside.
fn dot_ref(
    a: &[f64],
    b: &[f64],
    m: usize,
    n: usize,
    k: usize,
    range: std::ops::Range<usize>,
) -> (Vec<f64>, Vec<f64>) {
    let mut val = vec![0.0; m * n];
    let mut abs = vec![0.0; m * n];
    val.par_chunks_mut(n)
        .zip(abs.par_chunks_mut(n))
        .enumerate()
        .for_each(|(i, (vr, ar))| {
            let ai = &a[i * k + range.start..i * k + range.end];
            for j in 0..n {
                let bj = &b[j * k + range.start..j * k + range.end];
                let (mut s, mut sa) = (0.0f64, 0.0f64);
                for (x, y) in ai.iter().zip(bj) {
                    let t = x * y;
                    s += t;
                    sa += t.abs();
                }
                vr[j] = s;
                ar[j] = sa;
            }
        });
    (val, abs)
}

/// Asserts `|got − want| ≤ rel·(|want| + |inter|) + ACC·absum` elementwise, where `inter` is an
/// intermediate value also rounded into the destination (depth chunks), and returns the worst
/// `error / bound`.
#[track_caller]
fn check_bound<S: Elem>(
    what: &str,
    got: &[S],
    want: &[f64],
    absum: &[f64],
    inter: Option<&[f64]>,
) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let rel = half_ulp::<S>();
    let mut worst = 0.0f64;
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let g = g.to_f32() as f64;
        assert!(g.is_finite(), "{what}[{i}]: not finite");
        let mid = inter.map_or(0.0, |m| m[i].abs());
        let bound = rel * (w.abs() + mid) + ACC * absum[i];
        let err = (g - w).abs();
        assert!(
            err <= bound,
            "{what}[{i}]: got {g}, want {w} (err {err:.3e} > bound {bound:.3e})"
        );
        worst = worst.max(err / bound);
    }
    eprintln!("{what}: worst error / bound {worst:.3}");
    worst
}

// ---------------------------------------------------------------- (a) staged matmul

/// Forward / backward-input shape: too large for one staged call in every direction (the
/// forward and the input gradient come in several tiles).
const FWD: MatmulShape = MatmulShape {
    n: 640,
    in_features: 384,
    out_features: 3000,
    ragged: false,
};
/// Weight-gradient shape: a reduction over n = 9000 > STAGED_MAX_DEPTH tokens (two depth
/// chunks of 4500), each too large for one staged call.
const BWW: MatmulShape = MatmulShape {
    n: 9000,
    in_features: 256,
    out_features: 640,
    ragged: false,
};

/// The shapes really exercise the staged path's blocking: several row tiles or column panels
/// when everything is 16-bit, and two depth chunks in the weight gradient.
#[test]
fn staged_shapes_cover_the_blocking() {
    let all = [true; 3];
    let (n, i, o) = (FWD.n, FWD.in_features, FWD.out_features);
    assert!(tiling(n, o, i, all).calls(n, o) > 1, "forward: one call");
    assert!(
        tiling(n, i, o, all).calls(n, i) > 1,
        "backward input: one call"
    );
    let (n, i, o) = (BWW.n, BWW.in_features, BWW.out_features);
    assert!(n > STAGED_MAX_DEPTH && n <= 2 * STAGED_MAX_DEPTH);
    let t = tiling(o, i, n.div_ceil(2), all);
    assert!(t.calls(o, i) > 1, "weight gradient chunk: one call ({t:?})");
}

fn matmul_forward_case<S: Elem>(seed: u64, with_bias_add: bool) {
    let k: &dyn Kernels<S> = &CpuKernels::PLAIN;
    let s = FWD;
    let (n, i, o) = (s.n, s.in_features, s.out_features);
    let mut rng = Rng::new(seed);
    let x: Vec<S> = rand_vec(&mut rng, n * i, 1.0);
    let w: Vec<S> = rand_vec(&mut rng, o * i, 0.5);
    let b: Vec<S> = rand_vec(&mut rng, o, 2.0);
    let y0: Vec<S> = rand_vec(&mut rng, n * o, 4.0);
    let (x64, w64) = (widen64(&x), widen64(&w));
    let (mut want, mut absum) = dot_ref(&x64, &w64, n, o, i, 0..i);
    let mut y = y0.clone();
    if with_bias_add {
        k.matmul_forward(
            s,
            x.view(),
            w.view(),
            Some(b.view()),
            y.view_mut(),
            Accum::Add,
        );
        for (r, (wr, ar)) in want.chunks_mut(o).zip(absum.chunks_mut(o)).enumerate() {
            for c in 0..o {
                let extra = y0[r * o + c].to_f32() as f64 + b[c].to_f32() as f64;
                wr[c] += extra;
                ar[c] += extra.abs();
            }
        }
    } else {
        k.matmul_forward(s, x.view(), w.view(), None, y.view_mut(), Accum::Overwrite);
    }
    let tag = if with_bias_add { "bias, add" } else { "plain" };
    check_bound(
        &format!("{:?} matmul_forward ({tag})", S::DTYPE),
        &y,
        &want,
        &absum,
        None,
    );
}

fn matmul_backward_input_case<S: Elem>(seed: u64, accum: Accum) {
    let k: &dyn Kernels<S> = &CpuKernels::PLAIN;
    let s = FWD;
    let (n, i, o) = (s.n, s.in_features, s.out_features);
    let mut rng = Rng::new(seed);
    let dy: Vec<S> = rand_vec(&mut rng, n * o, 1.0);
    let w: Vec<S> = rand_vec(&mut rng, o * i, 0.5);
    let dx0: Vec<S> = rand_vec(&mut rng, n * i, 4.0);
    // dx[r, c] = Σ_j dy[r, j]·W[j, c]: rows of dy against rows of Wᵀ.
    let wt = materialise(i, o, |c, j| w[j * i + c].to_f32() as f64);
    let (mut want, mut absum) = dot_ref(&widen64(&dy), &wt, n, i, o, 0..o);
    let mut dx = dx0.clone();
    k.matmul_backward_input(s, dy.view(), w.view(), dx.view_mut(), accum);
    if accum == Accum::Add {
        for ((wv, av), d0) in want.iter_mut().zip(absum.iter_mut()).zip(&dx0) {
            *wv += d0.to_f32() as f64;
            *av += d0.to_f32().abs() as f64;
        }
    }
    check_bound(
        &format!("{:?} matmul_backward_input ({accum:?})", S::DTYPE),
        &dx,
        &want,
        &absum,
        None,
    );
}

/// What `matmul_backward_weight` produced on [`BWW`] and its f64 references.
struct Bww<G> {
    dw: Vec<G>,
    dw_want: Vec<f64>,
    dw_abs: Vec<f64>,
    /// dW after the first depth chunk (rounded into a 16-bit destination too).
    dw_inter: Vec<f64>,
    db: Vec<G>,
    db_want: Vec<f64>,
    db_abs: Vec<f64>,
}

/// dW += dyᵀ·x and dbias += Σ dy on [`BWW`], from nonzero initial gradients of type `G`.
fn matmul_backward_weight_run<S: Elem, G: Elem>(seed: u64) -> Bww<G> {
    let k: &dyn Kernels<S, G> = &CpuKernels::PLAIN;
    let s = BWW;
    let (n, i, o) = (s.n, s.in_features, s.out_features);
    let mut rng = Rng::new(seed);
    let dy: Vec<S> = rand_vec(&mut rng, n * o, 1.0);
    let x: Vec<S> = rand_vec(&mut rng, n * i, 1.0);
    let dw0: Vec<G> = rand_vec(&mut rng, o * i, 8.0);
    let db0: Vec<G> = rand_vec(&mut rng, o, 8.0);
    let dyt = materialise(o, n, |r, p| dy[p * o + r].to_f32() as f64);
    let xt = materialise(i, n, |c, p| x[p * i + c].to_f32() as f64);
    // The staged gemm splits the depth into `parts` equal chunks and rounds a 16-bit
    // destination after each; the first chunk's partial sum is the intermediate value.
    let parts = n.div_ceil(STAGED_MAX_DEPTH);
    let kb = n.div_ceil(parts);
    assert_eq!(parts, 2);
    let (p1, a1) = dot_ref(&dyt, &xt, o, i, n, 0..kb);
    let (p2, a2) = dot_ref(&dyt, &xt, o, i, n, kb..n);
    let d0 = widen64(&dw0);
    let inter: Vec<f64> = d0.iter().zip(&p1).map(|(a, b)| a + b).collect();
    let want: Vec<f64> = inter.iter().zip(&p2).map(|(a, b)| a + b).collect();
    let absum: Vec<f64> = (0..o * i).map(|e| d0[e].abs() + a1[e] + a2[e]).collect();
    let mut db_want = widen64(&db0);
    let mut db_abs: Vec<f64> = db_want.iter().map(|v| v.abs()).collect();
    for r in 0..n {
        for j in 0..o {
            let v = dy[r * o + j].to_f32() as f64;
            db_want[j] += v;
            db_abs[j] += v.abs();
        }
    }
    let (mut dw, mut db) = (dw0, db0);
    k.matmul_backward_weight(s, dy.view(), x.view(), dw.view_mut(), Some(db.view_mut()));
    Bww {
        dw,
        dw_want: want,
        dw_abs: absum,
        dw_inter: inter,
        db,
        db_want,
        db_abs,
    }
}

fn matmul_backward_weight_case<S: Elem>(seed: u64) {
    let r = matmul_backward_weight_run::<S, S>(seed);
    let t = format!("{:?}", S::DTYPE);
    check_bound(
        &format!("{t} matmul_backward_weight dW (2 depth chunks)"),
        &r.dw,
        &r.dw_want,
        &r.dw_abs,
        Some(&r.dw_inter),
    );
    check_bound(
        &format!("{t} matmul_backward_weight dbias"),
        &r.db,
        &r.db_want,
        &r.db_abs,
        None,
    );
}

#[test]
fn bf16_matmul_forward_one_rounding() {
    matmul_forward_case::<bf16>(1, false);
    matmul_forward_case::<bf16>(2, true);
}

#[test]
fn f16_matmul_forward_one_rounding() {
    matmul_forward_case::<f16>(3, false);
    matmul_forward_case::<f16>(4, true);
}

#[test]
fn bf16_matmul_backward_input_one_rounding() {
    matmul_backward_input_case::<bf16>(5, Accum::Overwrite);
    matmul_backward_input_case::<bf16>(6, Accum::Add);
}

#[test]
fn f16_matmul_backward_input_one_rounding() {
    matmul_backward_input_case::<f16>(7, Accum::Overwrite);
    matmul_backward_input_case::<f16>(8, Accum::Add);
}

#[test]
fn bf16_matmul_backward_weight_rounds_once_per_depth_chunk() {
    matmul_backward_weight_case::<bf16>(9);
}

#[test]
fn f16_matmul_backward_weight_rounds_once_per_depth_chunk() {
    matmul_backward_weight_case::<f16>(10);
}

// ---------------------------------------------------------------- (b) f32 gradients

/// With `G = f32` the weight gradient (starting from f32 values that bf16 cannot represent)
/// accumulates in f32 across both depth chunks and is never rounded to bf16: its error is
/// f32-accumulation sized, far below what one bf16 rounding of the result would cost
/// (measured: 3e-5 against 0.5 for max |dW| ≈ 150; rounding only the initial values to bf16
/// would already cost up to 2^-9·8 = 0.016, so the 100× margin catches that too).
#[test]
fn bf16_matmul_backward_weight_into_f32_grads_is_not_rounded() {
    let Bww {
        dw,
        dw_want: want,
        dw_abs: absum,
        db,
        db_want,
        db_abs,
        ..
    } = matmul_backward_weight_run::<bf16, f32>(11);
    let err = |got: &[f32], want: &[f64]| {
        got.iter()
            .zip(want)
            .fold(0.0f64, |m, (&g, &w)| m.max((g as f64 - w).abs()))
    };
    let ours = err(&dw, &want);
    let as_bf16: Vec<f32> = want
        .iter()
        .map(|&w| bf16::from_f32(w as f32).to_f32())
        .collect();
    let bf16_once = err(&as_bf16, &want);
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    eprintln!(
        "f32 dW: max err {ours:.3e}, one bf16 rounding {bf16_once:.3e} (max |dW| {scale:.1})"
    );
    assert!(
        ours * 100.0 < bf16_once,
        "f32 dW error {ours:.3e} not far below one bf16 rounding {bf16_once:.3e}"
    );
    check_bound("f32 matmul_backward_weight dW", &dw, &want, &absum, None);
    check_bound(
        "f32 matmul_backward_weight dbias",
        &db,
        &db_want,
        &db_abs,
        None,
    );
    let db_ours = err(&db, &db_want);
    let db_bf16 = db_want.iter().fold(0.0f64, |m, &w| {
        m.max((bf16::from_f32(w as f32).to_f32() as f64 - w).abs())
    });
    assert!(
        db_ours * 100.0 < db_bf16,
        "f32 dbias error {db_ours:.3e} not far below one bf16 rounding {db_bf16:.3e}"
    );
}

// ---------------------------------------------------------------- (c) other kernels

/// `|bf16 result − f32 result| ≤ 2^-8·|f32 result| + 1e-5·max|f32 result|`: one bf16
/// rounding of the output; the absolute term covers f32 reassociation (attention's gemm sees
/// contiguous staged tiles in bf16 and strided ones in f32).
#[track_caller]
fn check_one_rounding(what: &str, got: &[bf16], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs() as f64));
    let mut worst = 0.0f64;
    for (i, (g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f32() as f64, w as f64);
        assert!(g.is_finite(), "{what}[{i}]: not finite");
        let bound = BF16_HALF_ULP * w.abs() + 1e-5 * scale;
        let err = (g - w).abs();
        assert!(
            err <= bound,
            "{what}[{i}]: bf16 {g} vs f32 {w} (err {err:.3e} > {bound:.3e})"
        );
        worst = worst.max(err / bound);
    }
    eprintln!("{what}: worst error / bound {worst:.3}");
}

const KB: &dyn Kernels<bf16> = &CpuKernels::PLAIN;
const KF: &dyn Kernels = &CpuKernels::PLAIN;

#[test]
fn bf16_rmsnorm_matches_f32_within_one_rounding() {
    let s = NormShape {
        n: 37,
        c: 200,
        eps: 1e-5,
    };
    let mut rng = Rng::new(20);
    let x: Vec<bf16> = rand_vec(&mut rng, s.n * s.c, 2.0);
    let w: Vec<bf16> = rand_vec(&mut rng, s.c, 1.5);
    let dy: Vec<bf16> = rand_vec(&mut rng, s.n * s.c, 1.0);
    let dx0: Vec<bf16> = rand_vec(&mut rng, s.n * s.c, 1.0);
    let dw0: Vec<bf16> = rand_vec(&mut rng, s.c, 3.0);
    let (xf, wf, dyf) = (widen(&x), widen(&w), widen(&dy));

    let (mut out, mut rstd) = (vec![bf16::ZERO; s.n * s.c], vec![0.0f32; s.n]);
    KB.rmsnorm_forward(s, x.view(), w.view(), out.view_mut(), rstd.view_mut());
    let (mut outf, mut rstdf) = (vec![0.0f32; s.n * s.c], vec![0.0f32; s.n]);
    KF.rmsnorm_forward(s, xf.view(), wf.view(), outf.view_mut(), rstdf.view_mut());
    check_one_rounding("rmsnorm out", &out, &outf);
    assert_eq!(rstd, rstdf, "rstd is f32 in both");

    for accum in [Accum::Overwrite, Accum::Add] {
        let (mut dx, mut dw) = (dx0.clone(), dw0.clone());
        KB.rmsnorm_backward(
            s,
            dy.view(),
            x.view(),
            w.view(),
            rstd.view(),
            dx.view_mut(),
            accum,
            dw.view_mut(),
        );
        let (mut dxf, mut dwf) = (widen(&dx0), widen(&dw0));
        KF.rmsnorm_backward(
            s,
            dyf.view(),
            xf.view(),
            wf.view(),
            rstd.view(),
            dxf.view_mut(),
            accum,
            dwf.view_mut(),
        );
        check_one_rounding(&format!("rmsnorm dx ({accum:?})"), &dx, &dxf);
        check_one_rounding(&format!("rmsnorm dw ({accum:?})"), &dw, &dwf);
    }
}

#[test]
fn bf16_swiglu_matches_f32_within_one_rounding() {
    let n = 50_000; // several parallel chunks
    let mut rng = Rng::new(21);
    let gate: Vec<bf16> = rand_vec(&mut rng, n, 6.0);
    let up: Vec<bf16> = rand_vec(&mut rng, n, 2.0);
    let dh: Vec<bf16> = rand_vec(&mut rng, n, 1.0);
    let (gf, uf, dhf) = (widen(&gate), widen(&up), widen(&dh));
    let mut h = vec![bf16::ZERO; n];
    KB.swiglu_forward(gate.view(), up.view(), h.view_mut());
    let mut hf = vec![0.0f32; n];
    KF.swiglu_forward(gf.view(), uf.view(), hf.view_mut());
    check_one_rounding("swiglu h", &h, &hf);
    let (mut dg, mut du) = (vec![bf16::ZERO; n], vec![bf16::ZERO; n]);
    KB.swiglu_backward(
        dh.view(),
        gate.view(),
        up.view(),
        dg.view_mut(),
        du.view_mut(),
    );
    let (mut dgf, mut duf) = (vec![0.0f32; n], vec![0.0f32; n]);
    KF.swiglu_backward(
        dhf.view(),
        gf.view(),
        uf.view(),
        dgf.view_mut(),
        duf.view_mut(),
    );
    check_one_rounding("swiglu dgate", &dg, &dgf);
    check_one_rounding("swiglu dup", &du, &duf);
}

#[test]
fn bf16_rope_matches_f32_within_one_rounding() {
    let s = RopeShape {
        b: 2,
        t: 24,
        heads: 3,
        head_dim: 32,
    };
    let table = RopeTable::new(s.head_dim, 32, 10000.0);
    let mut rng = Rng::new(22);
    let x: Vec<bf16> = rand_vec(&mut rng, s.b * s.t * s.heads * s.head_dim, 3.0);
    let mut y = x.clone();
    KB.rope_forward(s, &table, y.view_mut());
    let mut yf = widen(&x);
    KF.rope_forward(s, &table, yf.view_mut());
    check_one_rounding("rope forward", &y, &yf);
    let mut d = x.clone();
    KB.rope_backward(s, &table, d.view_mut());
    let mut df = widen(&x);
    KF.rope_backward(s, &table, df.view_mut());
    check_one_rounding("rope backward", &d, &df);
}

#[test]
fn bf16_attention_matches_f32_within_one_rounding() {
    // T = 100 crosses the 64-row/64-key blocks; (H, KV) = (4, 2) is GQA.
    let s = AttnShape {
        b: 2,
        t: 100,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
    };
    let mut rng = Rng::new(23);
    let q: Vec<bf16> = rand_vec(&mut rng, s.q_len(), 1.5);
    let k: Vec<bf16> = rand_vec(&mut rng, s.kv_len(), 1.5);
    let v: Vec<bf16> = rand_vec(&mut rng, s.kv_len(), 1.0);
    let d_o: Vec<bf16> = rand_vec(&mut rng, s.q_len(), 1.0);
    let (qf, kf, vf, dof) = (widen(&q), widen(&k), widen(&v), widen(&d_o));

    let (mut o, mut lse) = (vec![bf16::ZERO; s.q_len()], vec![0.0f32; s.lse_len()]);
    KB.attention_forward(
        s,
        q.view(),
        k.view(),
        v.view(),
        o.view_mut(),
        lse.view_mut(),
    );
    let (mut of, mut lsef) = (vec![0.0f32; s.q_len()], vec![0.0f32; s.lse_len()]);
    KF.attention_forward(
        s,
        qf.view(),
        kf.view(),
        vf.view(),
        of.view_mut(),
        lsef.view_mut(),
    );
    check_one_rounding("attention o", &o, &of);
    let lse_err = lse
        .iter()
        .zip(&lsef)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs() / b.abs().max(1.0)));
    assert!(
        lse_err < 1e-5,
        "attention lse (f32 in both) differs by {lse_err:.2e}"
    );

    // Backward from the same saved state: the f32 kernel gets the bf16 forward's o (widened)
    // and lse, so only the rounding of dq/dk/dv differs.
    let (mut dq, mut dk, mut dv) = (
        vec![bf16::ZERO; s.q_len()],
        vec![bf16::ZERO; s.kv_len()],
        vec![bf16::ZERO; s.kv_len()],
    );
    KB.attention_backward(
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
    let (mut dqf, mut dkf, mut dvf) = (
        vec![0.0f32; s.q_len()],
        vec![0.0f32; s.kv_len()],
        vec![0.0f32; s.kv_len()],
    );
    KF.attention_backward(
        s,
        qf.view(),
        kf.view(),
        vf.view(),
        widen(&o).view(),
        lse.view(),
        dof.view(),
        dqf.view_mut(),
        dkf.view_mut(),
        dvf.view_mut(),
    );
    check_one_rounding("attention dq", &dq, &dqf);
    check_one_rounding("attention dk", &dk, &dkf);
    check_one_rounding("attention dv", &dv, &dvf);
}

// ---------------------------------------------------------------- (d) embedding backward

/// A token repeated 200 times: its gradient row is the f32 sum of its 200 rows (in position
/// order, starting from the gradient already there) rounded to bf16 once, bit for bit.
/// Rounding after every occurrence would give a different result (checked, so the test can
/// tell the two apart).
#[test]
fn bf16_embedding_backward_sums_in_f32_and_rounds_once() {
    let (vocab, c) = (50, 150); // c spans three 64-column blocks, the last one ragged
    let hot = 7u32;
    let mut rng = Rng::new(30);
    let mut tokens: Vec<u32> = (0..300)
        .map(|_| loop {
            let t = rng.below(vocab as u32);
            if t != hot {
                break t;
            }
        })
        .collect();
    // 200 occurrences of `hot` spread over the 300 positions.
    let mut placed = 0;
    while placed < 200 {
        let p = rng.below(300) as usize;
        if tokens[p] != hot {
            tokens[p] = hot;
            placed += 1;
        }
    }
    let dout: Vec<bf16> = rand_vec(&mut rng, tokens.len() * c, 1.0);
    let dwte0: Vec<bf16> = rand_vec(&mut rng, vocab * c, 0.5);
    let mut dwte = dwte0.clone();
    KB.embedding_backward(tokens.view(), dout.view(), c, dwte.view_mut());

    let mut once_differs_from_each = 0;
    for t in 0..vocab {
        for j in 0..c {
            let mut acc = dwte0[t * c + j].to_f32();
            let mut each = dwte0[t * c + j];
            for (n, &tok) in tokens.iter().enumerate() {
                if tok as usize == t {
                    acc += dout[n * c + j].to_f32();
                    each = bf16::from_f32(each.to_f32() + dout[n * c + j].to_f32());
                }
            }
            let want = bf16::from_f32(acc);
            assert_eq!(
                dwte[t * c + j].to_bits(),
                want.to_bits(),
                "dwte[{t}, {j}]: {} vs f32 sum rounded once {}",
                dwte[t * c + j],
                want
            );
            if t == hot as usize && each != want {
                once_differs_from_each += 1;
            }
        }
    }
    eprintln!(
        "embedding: {once_differs_from_each}/{c} entries of the hot row differ from \
         per-occurrence rounding"
    );
    assert!(
        once_differs_from_each > c / 4,
        "per-occurrence rounding should differ on many entries of the hot row"
    );
}

// ---------------------------------------------------------------- (e) fp8 matmul

/// Per-tensor current scaling: `q = round_trip(x·s)/s` with `s = scale_for(fmt, amax(x))`.
fn quantise(fmt: Fp8Format, x: &[f32]) -> Vec<f64> {
    let s = scale_for(fmt, amax(x));
    x.iter()
        .map(|&v| (round_trip(fmt, v * s) / s) as f64)
        .collect()
}

/// `CpuKernels::FP8` matmuls equal the explicit quantise-dequantise reference multiplied in
/// f64 (e4m3 for weights and activations, e5m2 for the output gradient; the bias and dbias are
/// not quantised). With f32 storage the only other error is f32 accumulation; with bf16 storage
/// one more rounding of the output.
fn fp8_matmul_case<S: Elem>(seed: u64) {
    let k: &dyn Kernels<S> = &CpuKernels::FP8;
    let s = MatmulShape {
        n: 300,
        in_features: 256,
        out_features: 200,
        ragged: false,
    };
    let (n, i, o) = (s.n, s.in_features, s.out_features);
    let t = format!("{:?}", S::DTYPE);
    let mut rng = Rng::new(seed);
    // Magnitudes that are not powers of two, so the scales are non-trivial, and a spread of
    // sizes within each tensor, so rounding reaches the subnormal range of e4m3 too.
    let mut spread = |len: usize, scale: f32| -> Vec<S> {
        (0..len)
            .map(|e| S::from_f32(rng.uniform() * scale * (1 + e % 7) as f32 / 7.0))
            .collect()
    };
    let x = spread(n * i, 3.7);
    let w = spread(o * i, 0.09);
    let b = spread(o, 1.3);
    let dy = spread(n * o, 0.013);
    let (xf, wf, dyf) = (widen(&x), widen(&w), widen(&dy));
    let (qx, qw, qdy) = (
        quantise(Fp8Format::E4M3, &xf),
        quantise(Fp8Format::E4M3, &wf),
        quantise(Fp8Format::E5M2, &dyf),
    );
    // The quantisation is far from a no-op.
    let moved = |q: &[f64], x: &[f32]| q.iter().zip(x).filter(|(a, b)| **a != **b as f64).count();
    assert!(moved(&qx, &xf) > xf.len() / 2 && moved(&qw, &wf) > wf.len() / 2);
    assert!(moved(&qdy, &dyf) > dyf.len() / 2);

    // Forward with bias.
    let (mut want, mut absum) = dot_ref(&qx, &qw, n, o, i, 0..i);
    for r in 0..n {
        for c in 0..o {
            want[r * o + c] += b[c].to_f32() as f64;
            absum[r * o + c] += b[c].to_f32().abs() as f64;
        }
    }
    let mut y = vec![S::from_f32(0.0); n * o];
    k.matmul_forward(
        s,
        x.view(),
        w.view(),
        Some(b.view()),
        y.view_mut(),
        Accum::Overwrite,
    );
    check_bound(&format!("{t} fp8 matmul_forward"), &y, &want, &absum, None);
    // Against the unquantised product most outputs would fail that bound (the comparison
    // really sees the quantisation).
    let (plain, _) = dot_ref(&widen64(&x), &widen64(&w), n, o, i, 0..i);
    let outside = (0..n * o)
        .filter(|&e| {
            let p = plain[e] + b[e % o].to_f32() as f64;
            (p - want[e]).abs() > half_ulp::<S>() * want[e].abs() + ACC * absum[e]
        })
        .count();
    assert!(
        outside > n * o / 2,
        "{t}: only {outside}/{} outputs tell fp8 from the unquantised product",
        n * o
    );

    // Input gradient: dx = q(dy)·q(W).
    let qwt = materialise(i, o, |c, j| qw[j * i + c]);
    let (want, absum) = dot_ref(&qdy, &qwt, n, i, o, 0..o);
    let mut dx = vec![S::from_f32(0.0); n * i];
    k.matmul_backward_input(s, dy.view(), w.view(), dx.view_mut(), Accum::Overwrite);
    check_bound(
        &format!("{t} fp8 matmul_backward_input"),
        &dx,
        &want,
        &absum,
        None,
    );

    // Weight gradient: dW = q(dy)ᵀ·q(x); dbias = Σ dy unquantised.
    let qdyt = materialise(o, n, |r, p| qdy[p * o + r]);
    let qxt = materialise(i, n, |c, p| qx[p * i + c]);
    let (want, absum) = dot_ref(&qdyt, &qxt, o, i, n, 0..n);
    let (mut dw, mut db) = (vec![S::from_f32(0.0); o * i], vec![S::from_f32(0.0); o]);
    k.matmul_backward_weight(s, dy.view(), x.view(), dw.view_mut(), Some(db.view_mut()));
    check_bound(
        &format!("{t} fp8 matmul_backward_weight"),
        &dw,
        &want,
        &absum,
        None,
    );
    let mut db_want = vec![0.0f64; o];
    let mut db_abs = vec![0.0f64; o];
    for r in 0..n {
        for c in 0..o {
            db_want[c] += dyf[r * o + c] as f64;
            db_abs[c] += dyf[r * o + c].abs() as f64;
        }
    }
    check_bound(
        &format!("{t} fp8 dbias (unquantised)"),
        &db,
        &db_want,
        &db_abs,
        None,
    );
}

#[test]
fn fp8_matmul_matches_explicit_quantisation_f32() {
    fp8_matmul_case::<f32>(40);
}

#[test]
fn fp8_matmul_matches_explicit_quantisation_bf16() {
    fp8_matmul_case::<bf16>(41);
}

// ---------------------------------------------------------------- (f) adamw into bf16

/// 40 000 elements: three of AdamW's 16 Ki parallel chunks, the last one ragged.
const ADAM_N: usize = 40_000;

struct AdamState<G> {
    master: Vec<f32>,
    grads: Vec<G>,
    m: Vec<f32>,
    v: Vec<f32>,
    params: Vec<bf16>,
}

impl<G: Elem> AdamState<G> {
    fn new(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let master = rng.vec(ADAM_N, 1.0);
        let params = master.iter().map(|&x| bf16::from_f32(x)).collect();
        AdamState {
            master,
            grads: rand_vec(&mut rng, ADAM_N, 0.5),
            m: rng.vec(ADAM_N, 0.01),
            v: rng.vec(ADAM_N, 1e-4).iter().map(|x| x.abs()).collect(),
            params,
        }
    }
    fn clone_state(&self) -> Self {
        AdamState {
            master: self.master.clone(),
            grads: self.grads.clone(),
            m: self.m.clone(),
            v: self.v.clone(),
            params: self.params.clone(),
        }
    }
    fn step(&mut self, k: &dyn Kernels<bf16, G>, h: AdamWParams, r: Rounding) {
        k.adamw_step(
            h,
            self.master.view_mut(),
            self.grads.view(),
            self.m.view_mut(),
            self.v.view_mut(),
            Some((self.params.view_mut(), r)),
        );
    }
}

fn adam_h(step: u64, grad_scale: f32) -> AdamWParams {
    AdamWParams {
        lr: 3e-3,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step,
        grad_scale,
    }
}

fn bits(p: &[bf16]) -> Vec<u16> {
    p.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn adamw_bf16_params_rounding() {
    let k: &dyn Kernels<bf16> = &CpuKernels::PLAIN;
    let init = AdamState::<bf16>::new(50);

    // Nearest: the parameters are exactly the rounded master weights.
    let mut a = init.clone_state();
    a.step(k, adam_h(3, 1.0), Rounding::Nearest);
    for (p, &w) in a.params.iter().zip(&a.master) {
        assert_eq!(
            p.to_bits(),
            bf16::from_f32(w).to_bits(),
            "nearest: {p} vs {w}"
        );
    }

    // Stochastic: deterministic (two runs identical), the master weights are unaffected, each
    // parameter is one of the two bf16 neighbours of its master weight, and the rounding is
    // really stochastic (many differ from round-to-nearest; another seed differs).
    let sr = Rounding::Stochastic { seed: 1234 };
    let (mut b, mut c) = (init.clone_state(), init.clone_state());
    b.step(k, adam_h(3, 1.0), sr);
    c.step(k, adam_h(3, 1.0), sr);
    assert_eq!(
        bits(&b.params),
        bits(&c.params),
        "stochastic rounding not deterministic"
    );
    assert_eq!(
        b.master, a.master,
        "rounding mode changed the master weights"
    );
    let mut off_nearest = 0;
    for (p, &w) in b.params.iter().zip(&b.master) {
        let (pf, down) = (p.to_f32(), toward_zero(w));
        let up = next_away(down);
        assert!(
            pf == down.to_f32() || pf == up.to_f32(),
            "stochastic {pf} is not a neighbour of {w} ({down}, {up})"
        );
        off_nearest += usize::from(p.to_bits() != bf16::from_f32(w).to_bits());
    }
    eprintln!("adamw stochastic: {off_nearest}/{ADAM_N} differ from round-to-nearest");
    assert!(
        off_nearest > ADAM_N / 10,
        "stochastic rounding looks like nearest"
    );
    let mut d = init.clone_state();
    d.step(k, adam_h(3, 1.0), Rounding::Stochastic { seed: 1235 });
    assert_ne!(bits(&d.params), bits(&b.params), "the seed has no effect");
}

/// The bf16 value with the larger magnitude next to `x` (same sign).
fn next_away(x: bf16) -> bf16 {
    bf16::from_bits(x.to_bits() + 1)
}

/// Truncation toward zero: the lower-magnitude bf16 neighbour of `x`.
fn toward_zero(x: f32) -> bf16 {
    bf16::from_bits((x.to_bits() >> 16) as u16)
}

fn grad_scale_case<G: Elem>(k: &dyn Kernels<bf16, G>) {
    let init = AdamState::<G>::new(51);
    let mut a = init.clone_state();
    a.step(k, adam_h(2, 0.5), Rounding::Nearest);
    let mut b = init.clone_state();
    // Halving is exact in bf16 and f32 for these magnitudes.
    b.grads = b
        .grads
        .iter()
        .map(|g| G::from_f32(g.to_f32() * 0.5))
        .collect();
    b.step(k, adam_h(2, 1.0), Rounding::Nearest);
    let eq = |x: &[f32], y: &[f32]| x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
    assert!(eq(&a.master, &b.master), "{:?}: master differs", G::DTYPE);
    assert!(
        eq(&a.m, &b.m) && eq(&a.v, &b.v),
        "{:?}: moments differ",
        G::DTYPE
    );
    assert_eq!(
        bits(&a.params),
        bits(&b.params),
        "{:?}: params differ",
        G::DTYPE
    );
    // And the scale mattered.
    let mut c = init.clone_state();
    c.step(k, adam_h(2, 1.0), Rounding::Nearest);
    assert!(!eq(&a.m, &c.m), "grad_scale had no effect");
}

#[test]
fn adamw_grad_scale_equals_scaled_grads() {
    grad_scale_case::<bf16>(&CpuKernels::PLAIN);
    grad_scale_case::<f32>(&CpuKernels::PLAIN);
}
