//! oneDNN's products against the portable gemm crate's, through the `Kernels` interface: every
//! linear-layer op (forward with bias, input and weight gradients, overwrite and accumulate,
//! the LM head's mixed f32 × 16-bit products) on odd and model-like shapes, for f32 and bf16
//! storage. Skipped, with the reason printed, where libdnnl.so.2 cannot be loaded.
//!
//! Tolerance: both kernels compute exactly the same f32 products (bf16 × bf16 is exact in f32)
//! and differ only in the order of the f32 sums: `1e-5` of the output's largest magnitude
//! (reductions of up to 1,300 terms of magnitude ≤ 1 here, so an order change moves a sum by a
//! few f32 ulps of its terms' total). A 16-bit output is rounded once from two such f32 sums,
//! which may fall on either side of a rounding boundary: one bf16 ulp (`2^-7` relative) more.

mod common;

use common::Rng;
use ferrotron_engine::kernels::cpu::onednn::{self, Dt, Product};
use ferrotron_engine::kernels::{Accum, CpuKernels, Elem, Gemm, Kernels, MatmulShape};
use ferrotron_engine::kernels::{AsView, AsViewMut};
use half::bf16;

const PORTABLE: CpuKernels = CpuKernels::PLAIN.with_gemm(Gemm::Portable);
const ONEDNN: CpuKernels = CpuKernels::PLAIN.with_gemm(Gemm::Onednn);

/// Prints why and returns `false` when oneDNN is not there.
fn available() -> bool {
    match onednn::library() {
        Ok(lib) => {
            eprintln!("oneDNN {} (isa {})", lib.version, onednn::isa_name(lib.isa));
            true
        }
        Err(why) => {
            eprintln!("skipped: {why}");
            false
        }
    }
}

/// `got` and `want` agree to `1e-5` of `want`'s largest magnitude, plus one ulp of `T` (zero
/// for f32) of each element.
fn assert_agree<T: Elem>(what: &str, got: &[T], want: &[T]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let ulp = if T::as_f32(want).is_some() {
        0.0
    } else {
        1.0 / 128.0
    };
    let scale = want
        .iter()
        .fold(0.0f64, |m, v| m.max(v.to_f32().abs() as f64));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let (g, w) = (g.to_f32() as f64, w.to_f32() as f64);
        let tol = 1e-5 * scale + ulp * w.abs().max(g.abs());
        assert!(
            (g - w).abs() <= tol,
            "{what}: element {i}: onednn {g} vs portable {w} (tolerance {tol})"
        );
    }
}

fn rand<T: Elem>(rng: &mut Rng, n: usize) -> Vec<T> {
    rng.vec(n, 1.0).into_iter().map(T::from_f32).collect()
}

/// Every matmul op of `Kernels<S, G>` on both kernels, compared.
fn compare<S: Elem, G: Elem>(rng: &mut Rng, (n, i, o): (usize, usize, usize)) {
    let s = MatmulShape {
        n,
        in_features: i,
        out_features: o,
        ragged: false,
    };
    let tag = |op: &str| format!("{op} {n}x{i}->{o} {:?}/{:?}", S::DTYPE, G::DTYPE);
    let (x, w, b, dy): (Vec<S>, Vec<S>, Vec<S>, Vec<S>) = (
        rand(rng, n * i),
        rand(rng, o * i),
        rand(rng, o),
        rand(rng, n * o),
    );
    let dlogits: Vec<f32> = rng.vec(n * o, 1.0);
    let kernels: [&dyn Kernels<S, G>; 2] = [&ONEDNN, &PORTABLE];
    let (y0, dx0, dw0): (Vec<S>, Vec<S>, Vec<G>) =
        (rand(rng, n * o), rand(rng, n * i), rand(rng, o * i));
    let db0: Vec<G> = rand(rng, o);
    let run = |k: &dyn Kernels<S, G>| {
        let mut out = Vec::new();
        for accum in [Accum::Overwrite, Accum::Add] {
            let mut y = y0.clone();
            k.matmul_forward(s, x.view(), w.view(), Some(b.view()), y.view_mut(), accum);
            let mut y_nb = y0.clone();
            k.matmul_forward(s, x.view(), w.view(), None, y_nb.view_mut(), accum);
            let mut dx = dx0.clone();
            k.matmul_backward_input(s, dy.view(), w.view(), dx.view_mut(), accum);
            out.push((y, y_nb, dx));
        }
        let (mut dw, mut db) = (dw0.clone(), db0.clone());
        k.matmul_backward_weight(s, dy.view(), x.view(), dw.view_mut(), Some(db.view_mut()));
        let mut logits = vec![0.0f32; n * o];
        k.head_forward(s, x.view(), w.view(), logits.view_mut());
        let mut hdx = dx0.clone();
        k.head_backward_input(s, dlogits.view(), w.view(), hdx.view_mut());
        let mut hdw = dw0.clone();
        k.head_backward_weight(s, dlogits.view(), x.view(), hdw.view_mut());
        (out, dw, db, logits, hdx, hdw)
    };
    let (got, want) = (run(kernels[0]), run(kernels[1]));
    for ((g, w), accum) in got.0.iter().zip(&want.0).zip(["=", "+="]) {
        assert_agree(&tag(&format!("forward y {accum} (bias)")), &g.0, &w.0);
        assert_agree(&tag(&format!("forward y {accum}")), &g.1, &w.1);
        assert_agree(&tag(&format!("backward_input dx {accum}")), &g.2, &w.2);
    }
    assert_agree(&tag("backward_weight dw"), &got.1, &want.1);
    assert_agree(&tag("backward_weight dbias"), &got.2, &want.2);
    assert_agree(&tag("head_forward logits"), &got.3, &want.3);
    assert_agree(&tag("head_backward_input dx"), &got.4, &want.4);
    assert_agree(&tag("head_backward_weight dw"), &got.5, &want.5);
}

/// Odd sizes (1, primes, not multiples of any vector width), the default model's layer shapes
/// with few tokens, a reduction over 1,300 terms, and random shapes.
fn shapes(rng: &mut Rng) -> Vec<(usize, usize, usize)> {
    let mut v = vec![
        (1, 1, 1),
        (7, 5, 3),
        (1, 384, 1024),
        (33, 64, 48),
        (130, 96, 200),
        (257, 384, 128),
        (64, 1024, 384),
        (40, 1300, 70),
    ];
    for _ in 0..6 {
        v.push((
            1 + rng.below(300) as usize,
            1 + rng.below(300) as usize,
            1 + rng.below(300) as usize,
        ));
    }
    v
}

#[test]
fn onednn_f32_products_match_the_portable_ones() {
    if !available() {
        return;
    }
    let mut rng = Rng::new(181);
    for shape in shapes(&mut rng) {
        compare::<f32, f32>(&mut rng, shape);
    }
}

#[test]
fn onednn_bf16_products_match_the_portable_ones() {
    if !available() {
        return;
    }
    let mut rng = Rng::new(182);
    for shape in shapes(&mut rng) {
        compare::<bf16, bf16>(&mut rng, shape);
        compare::<bf16, f32>(&mut rng, shape);
    }
}

/// Where the CPU has the instructions `auto` selects oneDNN for, it has a fast (non-reference)
/// implementation of the model's products, transposed operands included: otherwise `auto`
/// would silently stay on the gemm crate.
#[test]
fn onednn_runs_the_model_products_where_auto_selects_it() {
    let Ok(lib) = onednn::library() else {
        return assert!(!available());
    };
    let product = |(m, n, k), lhs, rhs, dt, accumulate| Product {
        m,
        n,
        k,
        lhs,
        rhs,
        dst: (n, 1),
        inputs: dt,
        output: dt,
        bias: false,
        accumulate,
    };
    for (dt, isa) in [
        (Dt::F32, onednn::ISA_AVX512_CORE),
        (Dt::Bf16, onednn::ISA_AVX512_CORE_BF16),
    ] {
        if !lib.has(isa) {
            eprintln!(
                "{dt:?}: not selected on this CPU ({})",
                onednn::isa_name(lib.isa)
            );
            continue;
        }
        // y = x·Wᵀ, dx = dy·W, dW += dyᵀ·x for 2048 tokens, 384 -> 1024.
        let (n, i, o) = (2048, 384, 1024);
        for p in [
            product((n, o, i), (i, 1), (1, i), dt, false),
            product((n, i, o), (o, 1), (i, 1), dt, false),
            product((o, i, n), (1, o), (i, 1), dt, true),
        ] {
            let imp = lib.implementation(&p);
            eprintln!("{p:?}: {imp:?}");
            assert!(imp.is_some(), "{p:?}: no fast oneDNN implementation");
        }
    }
}
