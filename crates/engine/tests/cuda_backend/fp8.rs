//! fp8 layer products on the GPU (`--precision fp8`, issue #32 item 4) against the CPU's fp8
//! path (`CpuKernels::FP8`: e4m3 weights and activations, e5m2 gradients, per-tensor current
//! scaling). Both quantise to the same codes (`cu/fp8.cu` is `numerics::fp8` bit for bit), so
//! the products differ only in the order of their f32 sums, and then in one rounding of a
//! 16-bit output: 1e-4 relative to the largest entry for f32 outputs, 1e-2 (2^-8 either way,
//! and the sums' order) for bf16 ones. A dense shape and a ragged one (the CPU's pieces of
//! 256, 32, 8 and 4 rows: per-piece scales, weight gradients padded to 16 tokens), on fresh
//! allocations: the trainer's operands of an fp8 run are 16-byte aligned (its widths are
//! multiples of 16, which it checks), and Hopper's fp8 kernels may not take less.

use super::{f32s, gpu, same, stored, On};
use crate::common::{rel_err, to64, Rng};
use ferrotron_engine::dtype::Elem;
use ferrotron_engine::kernels::cpu::FP8_HYBRID;
use ferrotron_engine::kernels::cuda::{download, CudaKernels};
use ferrotron_engine::kernels::*;
use half::bf16;

fn products<S: Elem, G: Elem>(k: &CudaKernels, s: MatmulShape, at: usize) {
    let t = format!(
        "fp8 {}/{} n {} at +{at}",
        std::any::type_name::<S>(),
        std::any::type_name::<G>(),
        s.n
    );
    let (n, i, o) = (s.n, s.in_features, s.out_features);
    let on = On { k, at };
    let (fp8, plain) = (CpuKernels::FP8, CpuKernels::PLAIN);
    let c: &dyn Kernels<S, G> = &fp8;
    let g: &dyn Kernels<S, G> = k;
    let mut rng = Rng::new(23);
    let mut r = |len: usize, scale: f32| stored::<S>(&rng.vec(len, scale));
    // Gradients far from 1, as a loss's are: the scales carry them into e5m2's range.
    let (x, w, dy) = (r(n * i, 1.0), r(o * i, 0.2), r(n * o, 1e-4));
    let (gx, gw, gdy) = (on.up(&x), on.up(&w), on.up(&dy));
    let out_tol = if S::DTYPE.bytes() == 4 { 1e-4 } else { 1e-2 };
    for acc in [Accum::Overwrite, Accum::Add] {
        let y0 = r(n * o, 1.0);
        let (mut y, mut gy) = (y0.clone(), on.up(&y0));
        c.matmul_forward(s, x.view(), w.view(), None, y.view_mut(), acc);
        g.matmul_forward(
            s,
            gx.view(n * i),
            gw.view(o * i),
            None,
            gy.view_mut(n * o),
            acc,
        );
        same(&format!("{t} forward {acc:?}"), &gy, &y, out_tol);
        if acc == Accum::Overwrite {
            // The products are fp8's, not the storage type's: the plain product is farther
            // from them than the tolerance.
            let mut exact = y0.clone();
            let p: &dyn Kernels<S, G> = &plain;
            p.matmul_forward(s, x.view(), w.view(), None, exact.view_mut(), acc);
            let got: Vec<S> = download(gy.view(n * o));
            let e = rel_err(&f32s(&got), &to64(&f32s(&exact)));
            assert!(
                e > 2.0 * out_tol,
                "{t}: the fp8 forward is within {e:.1e} of the plain one"
            );
        }

        let dx0 = r(n * i, 1e-4);
        let (mut dx, mut gdx) = (dx0.clone(), on.up(&dx0));
        c.matmul_backward_input(s, dy.view(), w.view(), dx.view_mut(), acc);
        g.matmul_backward_input(s, gdy.view(n * o), gw.view(o * i), gdx.view_mut(n * i), acc);
        same(&format!("{t} backward input {acc:?}"), &gdx, &dx, out_tol);
    }
    let grad_tol = if G::DTYPE.bytes() == 4 { 1e-4 } else { 1e-2 };
    let dw0: Vec<G> = stored(&Rng::new(29).vec(o * i, 1e-3));
    let (mut dw, mut gdw) = (dw0.clone(), on.up(&dw0));
    c.matmul_backward_weight(s, dy.view(), x.view(), dw.view_mut(), None);
    g.matmul_backward_weight(
        s,
        gdy.view(n * o),
        gx.view(n * i),
        gdw.view_mut(o * i),
        None,
    );
    same(&format!("{t} backward weight"), &gdw, &dw, grad_tol);
}

#[test]
fn fp8_products_follow_the_cpus_fp8_path() {
    let Some(mut k) = gpu() else { return };
    k.set_fp8(Some(FP8_HYBRID));
    for (n, ragged) in [(48, false), (300, true)] {
        let s = MatmulShape {
            n,
            in_features: 32,
            out_features: 64,
            ragged,
        };
        products::<bf16, bf16>(&k, s, 0);
        products::<bf16, f32>(&k, s, 0);
    }
}
