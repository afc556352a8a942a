//! The CUDA backend against the CPU backend (which the golden fixtures check against
//! PyTorch): every op the dense model uses, fp32 and bf16, then whole training steps of the
//! model with every recompute policy; the mixture-of-experts ops and a MoE model's steps in
//! `cuda_backend/moe.rs`. Needs a GPU: skips with a message where the driver or a
//! GPU is missing (CI has neither; run it on the GPU machine: scripts/cuda_check.sh).
//!
//! Tolerances, relative to each tensor's largest entry (`common::rel_err`): fp32 1e-5 for
//! elementwise and per-row ops and 1e-4 for products and attention (different summation
//! orders and FMA contraction); bf16 2e-2 (one bf16 rounding, 2^-8, either way, plus
//! products of rounded operands).
#![cfg(feature = "cuda")]

mod common;
// This binary's allocator counts the host's heap allocations where a test asks (`hot_path`).
#[path = "common/counting.rs"]
mod counting;
// The mixture-of-experts ops and a MoE model's step, in this binary so the GPU kit's op stage
// runs them with the rest.
#[path = "cuda_backend/moe.rs"]
mod moe;
// fp8 products against the CPU's fp8 path.
#[path = "cuda_backend/fp8.rs"]
mod fp8;
// Weights uploaded ahead on the copy stream, seen once awaited.
#[path = "cuda_backend/copy_stream.rs"]
mod copy_stream;
// The compute stream (each thread's per-thread default stream) against the synchronous copies.
#[path = "cuda_backend/compute_stream.rs"]
mod compute_stream;
// Work captured into a CUDA graph and replayed on new ids (the trainer's --cuda-graph).
#[path = "cuda_backend/captured.rs"]
mod captured;
// A micro-batch on the GPU, eager or replayed, allocates nothing on the host.
#[path = "cuda_backend/hot_path.rs"]
mod hot_path;

use common::{assert_close, to64, Rng};
use ferrotron_engine::dtype::Elem;
use ferrotron_engine::kernels::cuda::{download, skip, upload, CudaKernels, CudaPool, DeviceBlock};
use ferrotron_engine::kernels::*;
use ferrotron_engine::kernels::{View, ViewMut};
use ferrotron_engine::model::{
    BatchShape, GradBuf, GradsDone, HeapPool, Llama, Recompute, Whole, WholeParams,
};
use half::bf16;

fn gpu() -> Option<CudaKernels> {
    match CudaKernels::open(0) {
        Ok(k) => Some(k),
        Err(e) => {
            skip::unavailable(&e.to_string());
            None
        }
    }
}

/// Device copies of test tensors, each `at` elements into its own allocation with `at` guard
/// elements (all bits set) on either side: at `at = 0` a fresh allocation, 256-byte aligned;
/// at an odd `at`, as the trainer's weights sit at element offsets of one flat buffer, only
/// element-aligned (which cuBLASLt must be told, `gemm::alignment`). A kernel that writes past
/// its view changes a guard, which [`same`] checks.
struct On<'k> {
    k: &'k CudaKernels,
    at: usize,
}

/// A test tensor on the device, `at` elements into `block`.
struct Dev {
    block: DeviceBlock,
    at: usize,
    elem: usize,
}

const GUARD: u8 = 0xff;

impl On<'_> {
    fn up<T: Copy>(&self, host: &[T]) -> Dev {
        let elem = size_of::<T>();
        let guard = vec![GUARD; self.at * elem];
        // SAFETY: the host tensor's bytes, read as bytes.
        let bytes =
            unsafe { std::slice::from_raw_parts(host.as_ptr().cast::<u8>(), size_of_val(host)) };
        let all: Vec<u8> = [&guard[..], bytes, &guard[..]].concat();
        let block = upload(&self.k.gpu().ctx, &all).expect("upload");
        Dev {
            block,
            at: self.at,
            elem,
        }
    }
}

impl Dev {
    fn view<T>(&self, len: usize) -> View<'_, T> {
        assert_eq!(
            size_of::<T>(),
            self.elem,
            "a test tensor viewed as another type"
        );
        self.block.view::<T>(self.at + len).slice(self.at..)
    }

    fn view_mut<T>(&mut self, len: usize) -> ViewMut<'_, T> {
        assert_eq!(
            size_of::<T>(),
            self.elem,
            "a test tensor viewed as another type"
        );
        self.block.view_mut::<T>(self.at + len).slice_mut(self.at..)
    }

    /// Whether the guards on either side are as uploaded.
    #[track_caller]
    fn guards_intact(&self, what: &str) {
        let bytes: Vec<u8> = download(self.block.view::<u8>(self.block.bytes()));
        let g = self.at * self.elem;
        let (before, after) = (&bytes[..g], &bytes[bytes.len() - g..]);
        assert!(
            before.iter().chain(after).all(|&b| b == GUARD),
            "{what}: a kernel wrote outside its view (offset {} elements)",
            self.at
        );
    }
}

fn f32s<S: Elem>(x: &[S]) -> Vec<f32> {
    x.iter().map(|v| v.to_f32()).collect()
}

fn stored<S: Elem>(x: &[f32]) -> Vec<S> {
    x.iter().map(|&v| S::from_f32(v)).collect()
}

#[track_caller]
fn same<S: Elem>(what: &str, got: &Dev, want: &[S], tol: f64) {
    let g: Vec<S> = download(got.view(want.len()));
    assert_close(what, &f32s(&g), &to64(&f32s(want)), tol);
    got.guards_intact(what);
}

/// Two device tensors of `len` elements hold the same bits (a fused kernel against the ops
/// it fuses).
#[track_caller]
fn same_bits<S: Elem>(what: &str, got: &Dev, want: &Dev, len: usize) {
    let bits = |d: &Dev| -> Vec<u32> {
        let v: Vec<S> = download(d.view(len));
        v.iter().map(|x| x.to_f32().to_bits()).collect()
    };
    let (g, w) = (bits(got), bits(want));
    if let Some(i) = (0..len).find(|&i| g[i] != w[i]) {
        panic!(
            "{what}: element {i} is {} where the unfused ops give {}",
            f32::from_bits(g[i]),
            f32::from_bits(w[i])
        );
    }
}

/// Every dense op once, on the CPU and on the GPU, from the same inputs.
fn ops<S: Elem>(k: &CudaKernels, at: usize, tol: f64, tol_product: f64) {
    let t = format!("{} at +{at}", std::any::type_name::<S>());
    let on = On { k, at };
    let cpu = CpuKernels::PLAIN;
    let c: &dyn Kernels<S> = &cpu;
    let g: &dyn Kernels<S> = k;
    let mut rng = Rng::new(7);
    let mut r = |n: usize, s: f32| stored::<S>(&rng.vec(n, s));

    // Products, with a bias and with `+=`, and the LM head's.
    let s = MatmulShape {
        n: 37,
        in_features: 96,
        out_features: 80,
        ragged: false,
    };
    let (x, w, b, dy) = (
        r(37 * 96, 1.0),
        r(80 * 96, 0.2),
        r(80, 0.5),
        r(37 * 80, 1.0),
    );
    let (dx, dw, db) = (d(&on, &x), d(&on, &w), d(&on, &b));
    let ddy = d(&on, &dy);
    for acc in [Accum::Overwrite, Accum::Add] {
        let mut y = r(37 * 80, 1.0);
        let mut gy = on.up(&y);
        c.matmul_forward(s, x.view(), w.view(), Some(b.view()), y.view_mut(), acc);
        g.matmul_forward(
            s,
            dx.view(x.len()),
            dw.view(w.len()),
            Some(db.view(80)),
            gy.view_mut(y.len()),
            acc,
        );
        same(&format!("{t} matmul_forward {acc:?}"), &gy, &y, tol_product);

        let mut gx = r(x.len(), 1.0);
        let mut ggx = on.up(&gx);
        c.matmul_backward_input(s, dy.view(), w.view(), gx.view_mut(), acc);
        g.matmul_backward_input(
            s,
            ddy.view(dy.len()),
            dw.view(w.len()),
            ggx.view_mut(gx.len()),
            acc,
        );
        same(
            &format!("{t} matmul_backward_input {acc:?}"),
            &ggx,
            &gx,
            tol_product,
        );
    }
    // The weight gradient and the bias's, over fewer rows than the bias sum's slices and over
    // more (several rows a slice).
    let (xb, dyb) = (r(300 * 96, 1.0), r(300 * 80, 1.0));
    let (dxb, ddyb) = (d(&on, &xb), d(&on, &dyb));
    for rows in [37, 300] {
        let sw = MatmulShape { n: rows, ..s };
        let (xr, dyr) = (&xb[..rows * 96], &dyb[..rows * 80]);
        let (mut gw, mut gb) = (r(w.len(), 0.1), r(80, 0.1));
        let (mut ggw, mut ggb) = (on.up(&gw), on.up(&gb));
        c.matmul_backward_weight(
            sw,
            dyr.view(),
            xr.view(),
            gw.view_mut(),
            Some(gb.view_mut()),
        );
        g.matmul_backward_weight(
            sw,
            ddyb.view(dyr.len()),
            dxb.view(xr.len()),
            ggw.view_mut(gw.len()),
            Some(ggb.view_mut(80)),
        );
        let what = format!("{t} {rows} rows: matmul_backward_weight");
        same(&what, &ggw, &gw, tol_product);
        same(&format!("{what} bias"), &ggb, &gb, tol_product);
    }

    let mut logits = vec![0f32; 37 * 80];
    let mut gl = on.up(&logits);
    c.head_forward(s, x.view(), w.view(), logits.view_mut());
    g.head_forward(
        s,
        dx.view(x.len()),
        dw.view(w.len()),
        gl.view_mut(logits.len()),
    );
    same(&format!("{t} head_forward"), &gl, &logits, tol_product);
    let dl: Vec<f32> = f32s(&dy);
    let gdl = on.up(&dl);
    let (mut hw, mut hx) = (r(w.len(), 0.1), r(x.len(), 0.0));
    let (mut ghw, mut ghx) = (on.up(&hw), on.up(&hx));
    c.head_backward_weight(s, dl.view(), x.view(), hw.view_mut());
    g.head_backward_weight(
        s,
        gdl.view(dl.len()),
        dx.view(x.len()),
        ghw.view_mut(hw.len()),
    );
    same(&format!("{t} head_backward_weight"), &ghw, &hw, tol_product);
    c.head_backward_input(s, dl.view(), w.view(), hx.view_mut());
    g.head_backward_input(
        s,
        gdl.view(dl.len()),
        dw.view(w.len()),
        ghx.view_mut(hx.len()),
    );
    same(&format!("{t} head_backward_input"), &ghx, &hx, tol_product);

    // RMSNorm, over fewer rows than the weight gradient's slices and over more (several rows a
    // slice, the last slices empty).
    for rows in [29, 300] {
        let ns = NormShape {
            n: rows,
            c: 300,
            eps: 1e-5,
        };
        let (nx, nw, ndy) = (r(rows * 300, 2.0), r(300, 1.0), r(rows * 300, 1.0));
        let (dnx, dnw, dndy) = (d(&on, &nx), d(&on, &nw), d(&on, &ndy));
        let (mut out, mut rstd) = (r(nx.len(), 0.0), vec![0f32; rows]);
        let (mut gout, mut grstd) = (on.up(&out), on.up(&rstd));
        c.rmsnorm_forward(ns, nx.view(), nw.view(), out.view_mut(), rstd.view_mut());
        g.rmsnorm_forward(
            ns,
            dnx.view(nx.len()),
            dnw.view(300),
            gout.view_mut(out.len()),
            grstd.view_mut(rows),
        );
        same(
            &format!("{t} {rows} rows: rmsnorm_forward"),
            &gout,
            &out,
            tol,
        );
        same(
            &format!("{t} {rows} rows: rmsnorm rstd"),
            &grstd,
            &rstd,
            1e-5,
        );
        // The residual add fused with the norm: against the CPU's add and norm, and the bits
        // of the GPU's own add_inplace then rmsnorm_forward.
        let (len, res) = (nx.len(), r(nx.len(), 1.0));
        let dres = d(&on, &res);
        let (mut sum, mut fout, mut frstd) = (nx.clone(), r(len, 0.0), vec![0f32; rows]);
        c.add_rmsnorm_forward(
            ns,
            sum.view_mut(),
            res.view(),
            nw.view(),
            fout.view_mut(),
            frstd.view_mut(),
        );
        let fused = [on.up(&nx), on.up(&fout), on.up(&frstd)];
        let [mut gsum, mut gout2, mut grstd2] = fused;
        g.add_rmsnorm_forward(
            ns,
            gsum.view_mut(len),
            dres.view(len),
            dnw.view(300),
            gout2.view_mut(len),
            grstd2.view_mut(rows),
        );
        let what = format!("{t} {rows} rows: add_rmsnorm_forward");
        same(&format!("{what} sum"), &gsum, &sum, tol);
        same(&format!("{what} out"), &gout2, &fout, tol);
        same(&format!("{what} rstd"), &grstd2, &frstd, 1e-5);
        let [mut usum, mut uout, mut urstd] = [on.up(&nx), on.up(&fout), on.up(&frstd)];
        g.add_inplace(usum.view_mut(len), dres.view(len));
        g.rmsnorm_forward(
            ns,
            usum.view(len),
            dnw.view(300),
            uout.view_mut(len),
            urstd.view_mut(rows),
        );
        same_bits::<S>(&format!("{what} sum"), &gsum, &usum, len);
        same_bits::<S>(&format!("{what} out"), &gout2, &uout, len);
        same_bits::<f32>(&format!("{what} rstd"), &grstd2, &urstd, rows);
        for acc in [Accum::Overwrite, Accum::Add] {
            let (mut ndx, mut ndw) = (r(nx.len(), 1.0), r(300, 0.1));
            let (mut gndx, mut gndw) = (on.up(&ndx), on.up(&ndw));
            c.rmsnorm_backward(
                ns,
                ndy.view(),
                nx.view(),
                nw.view(),
                rstd.view(),
                ndx.view_mut(),
                acc,
                ndw.view_mut(),
            );
            g.rmsnorm_backward(
                ns,
                dndy.view(ndy.len()),
                dnx.view(nx.len()),
                dnw.view(300),
                grstd.view(rows),
                gndx.view_mut(ndx.len()),
                acc,
                gndw.view_mut(300),
            );
            same(
                &format!("{t} {rows} rows: rmsnorm_backward dx {acc:?}"),
                &gndx,
                &ndx,
                tol,
            );
            same(
                &format!("{t} {rows} rows: rmsnorm_backward dw {acc:?}"),
                &gndw,
                &ndw,
                tol_product,
            );
        }
    }

    // RoPE there and back.
    let rs = RopeShape {
        b: 2,
        t: 17,
        heads: 3,
        head_dim: 64,
    };
    let table = RopeTable::new(64, 32, 10_000.0);
    let mut rx = r(2 * 17 * 3 * 64, 1.0);
    let mut grx = on.up(&rx);
    c.rope_forward(rs, &table, rx.view_mut());
    g.rope_forward(rs, &table, grx.view_mut(rx.len()));
    same(&format!("{t} rope_forward"), &grx, &rx, tol);
    c.rope_backward(rs, &table, rx.view_mut());
    g.rope_backward(rs, &table, grx.view_mut(rx.len()));
    same(&format!("{t} rope_backward"), &grx, &rx, tol);

    // Attention with grouped queries, a head dim below and at the kernel's largest.
    attention::<S>(
        k,
        at,
        tol_product,
        &[(4, 2, 64, 33), (2, 1, 128, 33), (3, 3, 48, 33)],
    );

    // SwiGLU, elementwise ops.
    // Not a multiple of eight: the vector kernels' element-wise tail runs too.
    let n = 1003;
    let (ga, up, dh) = (r(n, 3.0), r(n, 1.0), r(n, 1.0));
    let (gga, gup, gdh) = (d(&on, &ga), d(&on, &up), d(&on, &dh));
    let mut h = r(n, 0.0);
    let mut gh = on.up(&h);
    c.swiglu_forward(ga.view(), up.view(), h.view_mut());
    g.swiglu_forward(gga.view(n), gup.view(n), gh.view_mut(n));
    same(&format!("{t} swiglu_forward"), &gh, &h, tol);
    let (mut dga, mut dup) = (r(n, 0.0), r(n, 0.0));
    let (mut gdga, mut gdup) = (on.up(&dga), on.up(&dup));
    c.swiglu_backward(
        dh.view(),
        ga.view(),
        up.view(),
        dga.view_mut(),
        dup.view_mut(),
    );
    g.swiglu_backward(
        gdh.view(n),
        gga.view(n),
        gup.view(n),
        gdga.view_mut(n),
        gdup.view_mut(n),
    );
    same(&format!("{t} swiglu_backward dgate"), &gdga, &dga, tol);
    same(&format!("{t} swiglu_backward dup"), &gdup, &dup, tol);
    c.add(ga.view(), up.view(), h.view_mut());
    g.add(gga.view(n), gup.view(n), gh.view_mut(n));
    same(&format!("{t} add"), &gh, &h, tol);
    c.add_inplace(h.view_mut(), dh.view());
    g.add_inplace(gh.view_mut(n), gdh.view(n));
    same(&format!("{t} add_inplace"), &gh, &h, tol);
    c.copy(up.view(), h.view_mut());
    g.copy(gup.view(n), gh.view_mut(n));
    same(&format!("{t} copy"), &gh, &h, 0.0);
    c.scale(h.view_mut(), 0.37);
    g.scale(gh.view_mut(n), 0.37);
    same(&format!("{t} scale"), &gh, &h, tol);
    // The GPU squares and adds in f64; the CPU adds its squares in f32 lanes within a 16k
    // chunk (`cpu::elementwise::sum_squares`: relative error ~1e-7·√chunk), so they agree to
    // f32's rounding, not f64's (the CUDA emulator measured 4.4e-9 here; 1e-12 could never
    // hold). One element too many or too few would be off by ~1/n, far more.
    let want = c.sum_squares(ga.view());
    let got = g.sum_squares(gga.view(n));
    assert!(
        (got - want).abs() <= 1e-6 * want,
        "{t} sum_squares: {got} vs {want}"
    );
    // More elements than the kernel's grid takes four at a time (1056 blocks of 256), with a
    // tail: against f64 on the host, which the GPU's f64 sums follow to ~1e-15 and which one
    // element more or less (~1e-6 of the sum) would miss by far (the CPU backend's f32 lanes
    // drift 3e-6 here).
    let long = stored::<S>(&rng_vec(1_100_003));
    let want: f64 = f32s(&long).iter().map(|&v| v as f64 * v as f64).sum();
    let got = g.sum_squares(d(&on, &long).view(long.len()));
    assert!(
        (got - want).abs() <= 1e-9 * want,
        "{t} sum_squares of {}: {got} vs {want}",
        long.len()
    );
    // Weighted, over several tensors read back once (the gradient norm under tensor
    // parallelism: a replicated norm's share), an empty one among them: against f64 on the
    // host, and the same partials for one tensor of weight 1 as `sum_squares`.
    let gl = d(&on, &long);
    let parts = [(&long[..], 0.5), (&long[..0], 3.0), (&long[..1001], 1.0)];
    let want: f64 = parts
        .iter()
        .map(|(p, w)| w * f32s(p).iter().map(|&v| v as f64 * v as f64).sum::<f64>())
        .sum();
    let views = parts.map(|(p, w)| (gl.view::<S>(long.len()).slice(..p.len()), w));
    let got = g.sum_squares_weighted(Weighted::new(&mut views.into_iter()));
    assert!(
        (got - want).abs() <= 1e-9 * want,
        "{t} sum_squares_weighted: {got} vs {want}"
    );
    let one = g.sum_squares_weighted(Weighted::new(&mut [(gga.view(n), 1.0)].into_iter()));
    assert_eq!(
        one,
        g.sum_squares(gga.view(n)),
        "{t} sum_squares_weighted of one"
    );
    let none = g.sum_squares_weighted(Weighted::new(&mut std::iter::empty()));
    assert_eq!(none, 0.0, "{t} sum_squares_weighted of nothing");
    let master = rng_vec(n);
    let gmaster = on.up(&master);
    c.round_params(master.view(), h.view_mut());
    g.round_params(gmaster.view(n), gh.view_mut(n));
    same(&format!("{t} round_params"), &gh, &h, 0.0);

    // Embedding, with repeated tokens; its backward into a table.
    let (vocab, cdim) = (50, 24);
    let mut trng = Rng::new(3);
    let tokens: Vec<u32> = (0..64).map(|_| trng.below(vocab as u32)).collect();
    let gt = on.up(&tokens);
    let wte = r(vocab * cdim, 1.0);
    let gwte = on.up(&wte);
    let mut e = r(64 * cdim, 0.0);
    let mut ge = on.up(&e);
    c.embedding_forward(tokens.view(), wte.view(), cdim, e.view_mut());
    g.embedding_forward(
        gt.view(64),
        gwte.view(wte.len()),
        cdim,
        ge.view_mut(e.len()),
    );
    same(&format!("{t} embedding_forward"), &ge, &e, 0.0);
    let de = r(64 * cdim, 1.0);
    let gde = on.up(&de);
    let mut dwte = r(wte.len(), 0.1);
    let mut gdwte = on.up(&dwte);
    c.embedding_backward(tokens.view(), de.view(), cdim, dwte.view_mut());
    g.embedding_backward(
        gt.view(64),
        gde.view(de.len()),
        cdim,
        gdwte.view_mut(dwte.len()),
    );
    same(&format!("{t} embedding_backward"), &gdwte, &dwte, tol);
    // Grouped from the caller's host copy of the ids (`host_ids`, issue #32), at an offset
    // into them: the same gradient, added a second time.
    g.host_ids(gt.view(64), &tokens);
    c.embedding_backward(
        tokens[8..].view(),
        de[8 * cdim..].view(),
        cdim,
        dwte.view_mut(),
    );
    g.embedding_backward(
        gt.view::<u32>(64).slice(8..),
        gde.view::<S>(de.len()).slice(8 * cdim..),
        cdim,
        gdwte.view_mut(dwte.len()),
    );
    same(
        &format!("{t} embedding_backward from host ids"),
        &gdwte,
        &dwte,
        tol,
    );

    // Cross-entropy with an ignored row, loss only and with its gradient. A row of 1004 logits
    // is 125 vectors of eight and four more (fresh views: both paths of the row's loop; at an
    // odd offset, the element-wise one).
    let ce = CeShape {
        rows: 9,
        vocab: 1004,
    };
    let mut targets: Vec<u32> = (0..9).map(|_| trng.below(1004)).collect();
    targets[4] = IGNORE_INDEX;
    let gtg = on.up(&targets);
    assert_eq!(
        Kernels::<S>::count_targets(k, gtg.view(9), 1004),
        8,
        "{t} count_targets"
    );
    // From the caller's copy, at an offset past the ignored row.
    Kernels::<S>::host_ids(k, gtg.view(9), &targets);
    assert_eq!(
        Kernels::<S>::count_targets(k, gtg.view::<u32>(9).slice(5..), 1004),
        4,
        "{t} count_targets from host ids"
    );
    for scale in [None, Some(0.125f32)] {
        let mut z = rng_vec(9 * 1004)
            .iter()
            .map(|x| x * 8.0)
            .collect::<Vec<f32>>();
        let mut gz = on.up(&z);
        let (mut l, mut gl) = (vec![0f32; 9], on.up(&[0f32; 9]));
        let want = c.cross_entropy(ce, z.view_mut(), targets.view(), l.view_mut(), scale);
        // The GPU keeps the loss on the device (issue #32) and returns 0: what it returns plus
        // what `take_loss` reads back is the value.
        let got = g.cross_entropy(ce, gz.view_mut(z.len()), gtg.view(9), gl.view_mut(9), scale)
            + g.take_loss();
        assert!(
            (got - want).abs() <= 1e-5 * want.abs(),
            "{t} cross_entropy: {got} vs {want}"
        );
        same(&format!("{t} cross_entropy losses"), &gl, &l, 1e-5);
        same(
            &format!("{t} cross_entropy dlogits {scale:?}"),
            &gz,
            &z,
            1e-5,
        );
    }

    // The vocabulary-parallel cross-entropy of two ranks, each holding 502 of the 1004 logits
    // of every row (the targets: on either rank, one ignored): each rank's statistics, then
    // from both ranks' the losses and the gradient of its slice.
    let z = rng_vec(9 * 1004)
        .iter()
        .map(|x| x * 8.0)
        .collect::<Vec<f32>>();
    let (ranks, part) = (2, 502);
    let shard = |r: usize| CeShardShape {
        rows: 9,
        vocab: part,
        first: r * part,
        full_vocab: 1004,
    };
    let slice = |r: usize| -> Vec<f32> {
        (0..9)
            .flat_map(|i| z[i * 1004 + r * part..i * 1004 + (r + 1) * part].to_vec())
            .collect()
    };
    for scale in [None, Some(0.125f32)] {
        let keep = scale.is_some();
        let (mut all, mut gall) = (vec![0f32; ranks * 27], Vec::new());
        let (mut zs, mut gzs) = (Vec::new(), Vec::new());
        for r in 0..ranks {
            let (mut zr, mut st) = (slice(r), vec![0f32; 27]);
            let (mut gzr, mut gst) = (on.up(&zr), on.up(&st));
            c.ce_shard_stats(shard(r), zr.view_mut(), targets.view(), st.view_mut(), keep);
            g.ce_shard_stats(
                shard(r),
                gzr.view_mut(zr.len()),
                gtg.view(9),
                gst.view_mut(27),
                keep,
            );
            same(
                &format!("{t} ce_shard_stats rank {r} {scale:?}"),
                &gst,
                &st,
                1e-5,
            );
            same(
                &format!("{t} ce_shard_stats logits rank {r} {scale:?}"),
                &gzr,
                &zr,
                1e-5,
            );
            all[r * 27..(r + 1) * 27].copy_from_slice(&st);
            gall.extend(st);
            zs.push(zr);
            gzs.push(gzr);
        }
        let gall = on.up(&gall);
        for (r, (zr, gzr)) in zs.iter_mut().zip(&mut gzs).enumerate() {
            let (mut l, mut gl) = (vec![0f32; 9], on.up(&[0f32; 9]));
            let (s, n) = (shard(r), zr.len());
            let want = c.ce_shard_finish(
                s,
                zr.view_mut(),
                targets.view(),
                all.view(),
                r,
                l.view_mut(),
                scale,
            );
            let got = g.ce_shard_finish(
                s,
                gzr.view_mut(n),
                gtg.view(9),
                gall.view(54),
                r,
                gl.view_mut(9),
                scale,
            ) + g.take_loss();
            assert!(
                (got - want).abs() <= 1e-5 * want.abs(),
                "{t} ce_shard_finish rank {r}: {got} vs {want}"
            );
            same(
                &format!("{t} ce_shard_finish losses rank {r} {scale:?}"),
                &gl,
                &l,
                1e-5,
            );
            same(
                &format!("{t} ce_shard_finish dlogits rank {r} {scale:?}"),
                gzr,
                zr,
                1e-5,
            );
        }
    }
}

/// The LM head's 16-bit copy of the logit gradients, which a 16-bit backend's cross-entropy
/// writes in the same pass (issue #32: no rounding pass per head product), is the rounding the
/// head makes of f32 gradients, and is what the head's products take: after a kernel changes
/// the f32 gradients behind it (which the model never does), the products are still those of
/// the cross-entropy's gradients rounded in a buffer of their own, bit for bit. Once the head's
/// forward rewrites the logits, the copy is not taken for them. (Everything is allocated
/// first: an allocation, like a copy into the device, drops the copy; so does another test's,
/// the epoch being the process's, and then the copy's use is not checked: the kit and
/// `cuda_emulated.sh` run the tests one at a time.)
#[test]
fn the_cross_entropys_16_bit_gradient_copy_is_the_heads_rounding() {
    let Some(k) = gpu() else { return };
    let g: &dyn Kernels<bf16, f32> = &k;
    let on = On { k: &k, at: 0 };
    let (rows, vocab, c) = (9, 1004, 24);
    let mut rng = Rng::new(31);
    let z = rng.vec(rows * vocab, 8.0);
    let targets: Vec<u32> = (0..rows as u32).map(|i| i * 97 % vocab as u32).collect();
    let (mut gz, gt, ones) = (on.up(&z), on.up(&targets), on.up(&vec![1f32; z.len()]));
    let mut gl = on.up(&vec![0f32; rows]);
    let (w, x) = (
        stored::<bf16>(&rng.vec(vocab * c, 0.1)),
        stored::<bf16>(&rng.vec(rows * c, 1.0)),
    );
    let (gw, gx) = (on.up(&w), on.up(&x));
    let s = MatmulShape {
        n: rows,
        in_features: c,
        out_features: vocab,
        ragged: false,
    };
    let mut outs: Vec<(Dev, Dev)> = (0..4)
        .map(|_| {
            (
                on.up(&vec![bf16::ZERO; rows * c]),
                on.up(&vec![0f32; vocab * c]),
            )
        })
        .collect();
    let mut heads = |dl: View<'_, f32>, out: usize| {
        let (dx, dw) = &mut outs[out];
        g.head_backward_input(s, dl, gw.view(w.len()), dx.view_mut(rows * c));
        g.head_backward_weight(s, dl, gx.view(x.len()), dw.view_mut(vocab * c));
        (
            download::<bf16>(dx.view(rows * c)),
            download::<f32>(dw.view(vocab * c)),
        )
    };
    let ce = CeShape { rows, vocab };
    let dz = gz.view_mut(z.len());
    let epoch = || {
        let o = ferrotron_engine::kernels::cuda::OPS.read();
        o.writes + o.copies + o.syncs[SyncSite::Alloc as usize]
    };
    g.cross_entropy(ce, dz, gt.view(rows), gl.view_mut(rows), Some(0.5));
    let before = epoch();
    let dl: Vec<f32> = download(gz.view(z.len()));
    let g32: &dyn Kernels<f32> = &k;
    g32.add_inplace(gz.view_mut(z.len()), ones.view(z.len()));
    let from_copy = heads(gz.view(z.len()), 0);
    let undisturbed = epoch() == before;
    // The forward writes new logits where the gradients were: their products round them.
    g.head_forward(s, gx.view(x.len()), gw.view(w.len()), gz.view_mut(z.len()));
    let after = heads(gz.view(z.len()), 1);
    let logits: Vec<f32> = download(gz.view(z.len()));
    let elsewhere = on.up(&dl);
    assert!(
        from_copy.0.iter().any(|v| v.to_f32() != 0.0),
        "a gradient flowed"
    );
    let rounded = heads(elsewhere.view(dl.len()), 2);
    match undisturbed {
        true => assert!(
            from_copy == rounded,
            "the products take the cross-entropy's copy, its rounding"
        ),
        false => eprintln!(
            "another test copied into the device meanwhile: the copy's use is not checked"
        ),
    }
    let fresh = on.up(&logits);
    let again = heads(fresh.view(logits.len()), 3);
    assert!(
        after == again,
        "after the forward the products round the new logits"
    );
    g.take_loss();
}

fn rng_vec(n: usize) -> Vec<f32> {
    Rng::new(n as u64).vec(n, 1.0)
}

fn d<T: Copy>(on: &On<'_>, host: &[T]) -> Dev {
    on.up(host)
}

/// Attention forward and backward on the GPU against the CPU, for each (heads, kv heads, head
/// dim, t) with b = 2; the GPU's o, lse, dq, dk and dv of each, for comparing the kernels.
fn attention<S: Elem>(
    k: &CudaKernels,
    at: usize,
    tol: f64,
    shapes: &[(usize, usize, usize, usize)],
) -> Vec<Vec<f32>> {
    let t = format!("{} at +{at}", std::any::type_name::<S>());
    let on = On { k, at };
    let cpu = CpuKernels::PLAIN;
    let c: &dyn Kernels<S> = &cpu;
    let g: &dyn Kernels<S> = k;
    let mut rng = Rng::new(11);
    let mut r = |n: usize, s: f32| stored::<S>(&rng.vec(n, s));
    let mut got = Vec::new();
    for &(heads, kv, hd, len) in shapes {
        let a = AttnShape {
            b: 2,
            t: len,
            heads,
            kv_heads: kv,
            head_dim: hd,
        };
        let (q, kk, v, dout) = (
            r(a.q_len(), 1.0),
            r(a.kv_len(), 1.0),
            r(a.kv_len(), 1.0),
            r(a.q_len(), 1.0),
        );
        let (gq, gk, gv, gdo) = (d(&on, &q), d(&on, &kk), d(&on, &v), d(&on, &dout));
        let (mut o, mut lse) = (r(a.q_len(), 0.0), vec![0f32; a.lse_len()]);
        let (mut go, mut glse) = (on.up(&o), on.up(&lse));
        c.attention_forward(
            a,
            q.view(),
            kk.view(),
            v.view(),
            o.view_mut(),
            lse.view_mut(),
        );
        g.attention_forward(
            a,
            gq.view(q.len()),
            gk.view(kk.len()),
            gv.view(v.len()),
            go.view_mut(o.len()),
            glse.view_mut(lse.len()),
        );
        let what = format!("{t} attention H{heads} KV{kv} D{hd} T{len}");
        same(&format!("{what} o"), &go, &o, tol);
        same(&format!("{what} lse"), &glse, &lse, 1e-5);
        let (mut dq, mut dk, mut dv) = (r(q.len(), 0.0), r(kk.len(), 0.0), r(v.len(), 0.0));
        let (mut gdq, mut gdk, mut gdv) = (on.up(&dq), on.up(&dk), on.up(&dv));
        c.attention_backward(
            a,
            q.view(),
            kk.view(),
            v.view(),
            o.view(),
            lse.view(),
            dout.view(),
            dq.view_mut(),
            dk.view_mut(),
            dv.view_mut(),
        );
        g.attention_backward(
            a,
            gq.view(q.len()),
            gk.view(kk.len()),
            gv.view(v.len()),
            go.view(o.len()),
            glse.view(lse.len()),
            gdo.view(dout.len()),
            gdq.view_mut(dq.len()),
            gdk.view_mut(dk.len()),
            gdv.view_mut(dv.len()),
        );
        same(&format!("{what} dq"), &gdq, &dq, tol);
        same(&format!("{what} dk"), &gdk, &dk, tol);
        same(&format!("{what} dv"), &gdv, &dv, tol);
        let host = |x: &Dev, n: usize| f32s(&download::<S>(x.view(n)));
        got.extend([
            host(&go, o.len()),
            download::<f32>(glse.view(lse.len())),
            host(&gdq, dq.len()),
            host(&gdk, dk.len()),
            host(&gdv, dv.len()),
        ]);
    }
    got
}

/// The tensor-core attention (16-bit storage, head dims 64 and 128) against the CPU and
/// against the plain kernels it replaces, over several 64-row tiles, a ragged last tile and
/// grouped queries, at fresh and odd offsets.
fn tensor_core_attention<S: Elem>(k: &CudaKernels) {
    let shapes = [(4, 2, 64, 100), (2, 1, 128, 130), (8, 8, 64, 64)];
    for at in [0, 3] {
        k.use_plain_attention(true);
        let plain = attention::<S>(k, at, 2e-2, &shapes);
        k.use_plain_attention(false);
        let flash = attention::<S>(k, at, 2e-2, &shapes);
        for (i, (f, p)) in flash.iter().zip(&plain).enumerate() {
            let what = format!("{} at +{at}: output {i}", std::any::type_name::<S>());
            assert_close(&format!("{what}, tensor cores vs plain"), f, &to64(p), 2e-2);
        }
    }
}

#[test]
fn tensor_core_attention_follows_the_plain_kernels() {
    let Some(k) = gpu() else { return };
    tensor_core_attention::<bf16>(&k);
    tensor_core_attention::<half::f16>(&k);
}

/// AdamW: fp32 in place, and bf16 parameters rounded to nearest and stochastically (the same
/// counter-based noise as the CPU: a rounding differs only where the f32 update itself does).
fn adamw<S: Elem, G: Elem>(k: &CudaKernels, at: usize) {
    let on = On { k, at };
    let n = 3003; // (not a multiple of eight: the vector kernel's tail too)
    let h = AdamWParams {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.1,
        step: 3,
        grad_scale: 0.5,
    };
    let mut rng = Rng::new(5);
    let grads: Vec<G> = rng.vec(n, 1.0).iter().map(|&x| G::from_f32(x)).collect();
    let gg = on.up(&grads);
    for rounding in [Rounding::Nearest, Rounding::Stochastic { seed: 9 }] {
        let (mut p, mut m, mut v) = (
            rng.vec(n, 1.0),
            rng.vec(n, 0.1),
            rng.vec(n, 0.01).iter().map(|x| x.abs()).collect::<Vec<_>>(),
        );
        let (mut gp, mut gm, mut gv) = (on.up(&p), on.up(&m), on.up(&v));
        let mut out = vec![S::default(); n];
        let mut gout = on.up(&out);
        let cpu = CpuKernels::PLAIN;
        let c: &dyn Kernels<S, G> = &cpu;
        let g: &dyn Kernels<S, G> = k;
        c.adamw_step(
            h,
            p.view_mut(),
            grads.view(),
            m.view_mut(),
            v.view_mut(),
            Some((out.view_mut(), rounding)),
        );
        g.adamw_step(
            h,
            gp.view_mut(n),
            gg.view(n),
            gm.view_mut(n),
            gv.view_mut(n),
            Some((gout.view_mut(n), rounding)),
        );
        let what = format!("adamw {} at +{at} {rounding:?}", std::any::type_name::<S>());
        same(&format!("{what} master"), &gp, &p, 1e-6);
        same(&format!("{what} m"), &gm, &m, 1e-6);
        same(&format!("{what} v"), &gv, &v, 1e-6);
        // A 16-bit rounding differs only where the f32 update itself does: on a GPU NVRTC
        // contracts a * b + c into one FMA (`--fmad=true`, its default), so the master may
        // differ from the CPU's in its last bit, and a copy "differs" only past that, which an
        // f32 copy (the master itself) never does and a flipped bf16 rounding (2^-8) always does.
        let got: Vec<S> = download(gout.view(n));
        let differ = got
            .iter()
            .zip(&out)
            .filter(|(a, b)| {
                let (a, b) = (a.to_f32(), b.to_f32());
                (a - b).abs() > 1e-6 * b.abs().max(1.0)
            })
            .count();
        assert!(
            differ <= n / 100,
            "{what}: {differ} of {n} rounded parameters differ from the CPU's"
        );
    }
}

#[test]
fn every_dense_op_follows_the_cpu() {
    let Some(k) = gpu() else { return };
    eprintln!("GPU: {} ({})", k.gpu().name, k.gpu().arch);
    // Fresh allocations, then views at an odd element offset.
    for at in [0, 3] {
        ops::<f32>(&k, at, 1e-5, 1e-4);
        ops::<bf16>(&k, at, 2e-2, 2e-2);
        adamw::<f32, f32>(&k, at);
        adamw::<bf16, bf16>(&k, at);
        adamw::<bf16, f32>(&k, at);
    }
}

/// A bias is added in the product's epilogue (`CUBLASLT_EPILOGUE_BIAS`) where it is 16-byte
/// aligned: the product and its bias rounded to bf16 once, as the CPU rounds them. An unaligned
/// bias takes its own pass after the product, which rounds twice. Both follow the CPU, and
/// they differ where the double rounding shows (on the emulator, whose products sum in one
/// order, in nothing else): a forward that never used the epilogue would give the same bits
/// both ways. A bias cuBLASLt declines when the product is enqueued (the emulator declines
/// one under 32 bytes; a GPU's cuBLASLt may take it) is added by its kernel, the next time
/// too (the refusal remembered): on the emulator, the unaligned bias's bits.
#[test]
fn an_aligned_bias_is_added_in_the_products_epilogue() {
    let Some(k) = gpu() else { return };
    let (n, i, o) = (37, 96, 80);
    let s = MatmulShape {
        n,
        in_features: i,
        out_features: o,
        ragged: false,
    };
    let mut rng = Rng::new(11);
    let mut r = |len: usize, scale: f32| stored::<bf16>(&rng.vec(len, scale));
    let (x, w, b) = (r(n * i, 1.0), r(o * i, 0.2), r(o, 0.5));
    let mut want = vec![bf16::ZERO; n * o];
    let cpu: &dyn Kernels<bf16> = &CpuKernels::PLAIN;
    cpu.matmul_forward(
        s,
        x.view(),
        w.view(),
        Some(b.view()),
        want.view_mut(),
        Accum::Overwrite,
    );
    let g: &dyn Kernels<bf16> = &k;
    let aligned = On { k: &k, at: 0 };
    let (dx, dw) = (aligned.up(&x), aligned.up(&w));
    let bias_at = |at: usize| On { k: &k, at }.up(&b);
    let forward = |db: &Dev| {
        let mut y = aligned.up(&vec![bf16::ZERO; n * o]);
        g.matmul_forward(
            s,
            dx.view(x.len()),
            dw.view(w.len()),
            Some(db.view(o)),
            y.view_mut(n * o),
            Accum::Overwrite,
        );
        same(
            &format!("bf16 matmul_forward, bias at +{}", db.at),
            &y,
            &want,
            2e-2,
        );
        download::<bf16>(y.view(n * o))
    };
    // One element in: 2-byte aligned, not 16.
    let (epilogue, own_pass) = (forward(&bias_at(0)), forward(&bias_at(1)));
    let differ = epilogue
        .iter()
        .zip(&own_pass)
        .filter(|(a, b)| a != b)
        .count();
    assert!(
        differ > 0,
        "the aligned bias gave the unaligned one's bits in all {} outputs: not added in the epilogue",
        n * o
    );
    // 16 bytes in: offered to the epilogue.
    let (emulated, declined) = (k.gpu().name.contains("emulator"), bias_at(8));
    for _ in 0..2 {
        let late = forward(&declined);
        assert!(
            !emulated || late == own_pass,
            "a bias declined when enqueued: not its kernel's bits"
        );
    }
}

/// Ring attention's steps (context parallelism's `attention_forward_ring` and
/// `attention_backward_ring`, `cu/ring_attention.cu`) against the CPU's, for each rank of a
/// zigzag split over two ranks against each rank's key/value block (its own, the one before
/// it in the sequence, the one after): the forward overwriting and merging into the running
/// output, the backward adding into dq, dk and dv. Head dim 40 (two lanes' worth, a partial
/// one) at an odd offset, and 64.
#[test]
fn ring_attention_steps_follow_the_cpu() {
    let Some(k) = gpu() else { return };
    for (at, d) in [(0, 64), (3, 40)] {
        ring::<f32>(&k, at, d, 1e-5);
        ring::<bf16>(&k, at, d, 1e-5);
    }
}

fn ring<S: Elem>(k: &CudaKernels, at: usize, d: usize, tol: f64) {
    let t = format!("{} at +{at}, head dim {d}", std::any::type_name::<S>());
    let on = On { k, at };
    let cpu = CpuKernels::PLAIN;
    let c: &dyn Kernels<S> = &cpu;
    let g: &dyn Kernels<S> = k;
    let mut rng = Rng::new(29);
    let a = AttnShape {
        b: 2,
        t: 12,
        heads: 4,
        kv_heads: 2,
        head_dim: d,
    };
    let (ql, kvl, ll) = (a.q_len(), a.kv_len(), a.lse_len());
    let q = stored::<S>(&rng.vec(ql, 1.0));
    let d_o = stored::<S>(&rng.vec(ql, 1.0));
    let (gq, gdo) = (on.up(&q), on.up(&d_o));
    for (qr, kr) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        let part = |rank| SeqPart { rank, ranks: 2 };
        let s = RingShape {
            attn: a,
            q: part(qr),
            kv: part(kr),
        };
        let w = format!("{t}, queries of rank {qr}, block of rank {kr}");
        let (kk, vv) = (rng.vec(kvl, 1.0), rng.vec(kvl, 1.0));
        let (gk, gv) = (on.up(&kk), on.up(&vv));
        // A first step, then this block merged into it (the rank's own block first, as the
        // ring goes: every query sees a key of it).
        let own = RingShape { kv: part(qr), ..s };
        let (ko, vo) = (rng.vec(kvl, 1.0), rng.vec(kvl, 1.0));
        let (gko, gvo) = (on.up(&ko), on.up(&vo));
        let (mut o, mut lse) = (vec![0f32; ql], vec![0f32; ll]);
        let (mut go, mut gl) = (on.up(&o), on.up(&lse));
        c.attention_forward_ring(
            own,
            q.view(),
            ko.view(),
            vo.view(),
            o.view_mut(),
            lse.view_mut(),
            true,
        );
        g.attention_forward_ring(
            own,
            gq.view(ql),
            gko.view(kvl),
            gvo.view(kvl),
            go.view_mut(ql),
            gl.view_mut(ll),
            true,
        );
        same(&format!("{w}: first o"), &go, &o, tol);
        same(&format!("{w}: first lse"), &gl, &lse, tol);
        c.attention_forward_ring(
            s,
            q.view(),
            kk.view(),
            vv.view(),
            o.view_mut(),
            lse.view_mut(),
            false,
        );
        g.attention_forward_ring(
            s,
            gq.view(ql),
            gk.view(kvl),
            gv.view(kvl),
            go.view_mut(ql),
            gl.view_mut(ll),
            false,
        );
        same(&format!("{w}: merged o"), &go, &o, tol);
        same(&format!("{w}: merged lse"), &gl, &lse, tol);
        // The backward from the final output (stored), adding into running gradients.
        let o_s = stored::<S>(&o);
        let go_s = on.up(&o_s);
        let (mut dq, mut dk, mut dv) = (rng.vec(ql, 0.1), rng.vec(kvl, 0.1), rng.vec(kvl, 0.1));
        let (mut gdq, mut gdk, mut gdv) = (on.up(&dq), on.up(&dk), on.up(&dv));
        c.attention_backward_ring(
            s,
            q.view(),
            kk.view(),
            vv.view(),
            o_s.view(),
            lse.view(),
            d_o.view(),
            dq.view_mut(),
            dk.view_mut(),
            dv.view_mut(),
        );
        g.attention_backward_ring(
            s,
            gq.view(ql),
            gk.view(kvl),
            gv.view(kvl),
            go_s.view(ql),
            gl.view(ll),
            gdo.view(ql),
            gdq.view_mut(ql),
            gdk.view_mut(kvl),
            gdv.view_mut(kvl),
        );
        same(&format!("{w}: dq"), &gdq, &dq, 1e-4);
        same(&format!("{w}: dk"), &gdk, &dk, 1e-4);
        same(&format!("{w}: dv"), &gdv, &dv, 1e-4);
    }
}

/// Ops over zero rows (an expert no token was routed to, an empty micro-batch shard) write
/// nothing: no block is launched to touch a row that is not there, and no product runs.
fn zero_rows<S: Elem>(k: &CudaKernels) {
    let t = std::any::type_name::<S>();
    let on = On { k, at: 2 };
    let g: &dyn Kernels<S> = k;
    let mut rng = Rng::new(13);
    let mut r = |n: usize| stored::<S>(&rng.vec(n, 1.0));
    let s = MatmulShape {
        n: 0,
        in_features: 32,
        out_features: 16,
        ragged: false,
    };
    let (x, dy, mut y, mut dx) = (
        on.up::<S>(&[]),
        on.up::<S>(&[]),
        on.up::<S>(&[]),
        on.up::<S>(&[]),
    );
    let (w, dw0) = (r(16 * 32), r(16 * 32));
    let (gw, mut gdw) = (on.up(&w), on.up(&dw0));
    for acc in [Accum::Overwrite, Accum::Add] {
        g.matmul_forward(s, x.view(0), gw.view(w.len()), None, y.view_mut(0), acc);
        g.matmul_backward_input(s, dy.view(0), gw.view(w.len()), dx.view_mut(0), acc);
    }
    g.matmul_backward_weight(s, dy.view(0), x.view(0), gdw.view_mut(w.len()), None);
    same(
        &format!("{t} zero rows: weight gradient unchanged"),
        &gdw,
        &dw0,
        0.0,
    );
    for (what, b) in [("matmul_forward", &y), ("matmul_backward_input", &dx)] {
        b.guards_intact(&format!("{t} zero rows: {what}"));
    }
    let ns = NormShape {
        n: 0,
        c: 32,
        eps: 1e-5,
    };
    let nw = on.up(&r(32));
    let (mut out, mut rstd) = (on.up::<S>(&[]), on.up::<f32>(&[]));
    g.rmsnorm_forward(
        ns,
        x.view(0),
        nw.view(32),
        out.view_mut(0),
        rstd.view_mut(0),
    );
    out.guards_intact(&format!("{t} zero rows: rmsnorm_forward"));
    rstd.guards_intact(&format!("{t} zero rows: rmsnorm rstd"));
    g.swiglu_forward(x.view(0), dy.view(0), out.view_mut(0));
    out.guards_intact(&format!("{t} zero rows: swiglu_forward"));
    let ce = CeShape {
        rows: 0,
        vocab: 100,
    };
    let (mut z, tg, mut l) = (on.up::<f32>(&[]), on.up::<u32>(&[]), on.up::<f32>(&[]));
    let loss = g.cross_entropy(ce, z.view_mut(0), tg.view(0), l.view_mut(0), Some(1.0));
    assert_eq!(loss, 0.0, "{t} zero rows: cross_entropy");
    l.guards_intact(&format!("{t} zero rows: cross_entropy losses"));
    z.guards_intact(&format!("{t} zero rows: cross_entropy logits"));
    // Attention over an empty sequence, at a head dim the tensor-core kernels take in 16 bits.
    let a = AttnShape {
        b: 2,
        t: 0,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
    };
    let (mut o, mut lse) = (on.up::<S>(&[]), on.up::<f32>(&[]));
    g.attention_forward(
        a,
        x.view(0),
        x.view(0),
        x.view(0),
        o.view_mut(0),
        lse.view_mut(0),
    );
    let (mut dq, mut dk, mut dv) = (on.up::<S>(&[]), on.up::<S>(&[]), on.up::<S>(&[]));
    g.attention_backward(
        a,
        x.view(0),
        x.view(0),
        x.view(0),
        o.view(0),
        lse.view(0),
        dy.view(0),
        dq.view_mut(0),
        dk.view_mut(0),
        dv.view_mut(0),
    );
    for (what, b) in [("o", &o), ("dq", &dq), ("dk", &dk), ("dv", &dv)] {
        b.guards_intact(&format!("{t} zero rows: attention {what}"));
    }
    lse.guards_intact(&format!("{t} zero rows: attention lse"));
}

#[test]
fn ops_over_zero_rows_write_nothing() {
    let Some(k) = gpu() else { return };
    zero_rows::<f32>(&k);
    zero_rows::<bf16>(&k);
}

/// Loss sums of a training micro-batch and an evaluation, and the gradients: on the CPU, or on
/// the GPU with every parameter, gradient, activation and token id in device memory.
fn step<S: Elem>(
    model: &Llama,
    k: Option<&CudaKernels>,
    params: &[S],
    tokens: &[u32],
    targets: &[u32],
) -> (f64, f64, Vec<S>) {
    let batch = BatchShape { b: 2, t: 24 };
    let nt = targets.iter().filter(|&&t| t != IGNORE_INDEX).count();
    let done = &mut |_: GradsDone, _: &mut dyn GradBuf<S>| {};
    match k {
        None => {
            let cpu = CpuKernels::PLAIN;
            let mut grads = vec![S::from_f32(0.0); model.num_params()];
            let mut pool = HeapPool::new();
            let src = &mut WholeParams::host(params);
            let g = &mut Whole::host(&mut grads);
            let (acts, loss) = model
                .forward_train_scaled(&cpu, &mut pool, src, g, batch, tokens, targets, nt, 1.0);
            model.backward_notify(&cpu, &mut pool, src, g, acts, tokens, done);
            let eval = model.forward_eval_from(&cpu, &mut pool, src, batch, tokens, targets);
            (loss.sum, eval.sum, grads)
        }
        Some(k) => {
            let on = On { k, at: 0 };
            let (p, tok, tgt) = (on.up(params), on.up(tokens), on.up(targets));
            let mut gr = on.up(&vec![S::from_f32(0.0); model.num_params()]);
            let mut pool = CudaPool::new(&k.gpu().ctx);
            let (tok, tgt) = (
                tok.view::<u32>(tokens.len()),
                tgt.view::<u32>(targets.len()),
            );
            let src = &mut WholeParams(p.view::<S>(params.len()));
            let g = &mut Whole(gr.view_mut(params.len()));
            let (acts, loss) =
                model.forward_train_scaled(k, &mut pool, src, g, batch, &tok, &tgt, nt, 1.0);
            // The loss the GPU kept on itself, read back once (issue #32).
            let loss = loss.sum + Kernels::<S>::take_loss(k);
            model.backward_notify(k, &mut pool, src, g, acts, &tok, done);
            let eval = model.forward_eval_from(k, &mut pool, src, batch, &tok, &tgt);
            let eval = eval.sum + Kernels::<S>::take_loss(k);
            drop(pool);
            (loss, eval, download(gr.view(params.len())))
        }
    }
}

#[test]
fn training_steps_follow_the_cpu() {
    let Some(k) = gpu() else { return };
    let mut rng = Rng::new(11);
    let tokens: Vec<u32> = (0..48).map(|_| rng.below(80)).collect();
    let mut targets: Vec<u32> = (0..48).map(|_| rng.below(80)).collect();
    targets[5] = IGNORE_INDEX;
    for (tie, bias) in [(true, true), (false, false)] {
        for rc in [Recompute::None, Recompute::Selective, Recompute::Full] {
            let model = Llama::new(common::dense_cfg(tie, bias)).with_recompute(rc);
            let what = format!("fp32 tied {tie} bias {bias} {rc:?}");
            let params = model.params.init(3, 0.1);
            let want = step::<f32>(&model, None, &params, &tokens, &targets);
            let got = step::<f32>(&model, Some(&k), &params, &tokens, &targets);
            assert!(
                (got.0 - want.0).abs() <= 1e-5 * want.0,
                "{what}: loss {} vs {}",
                got.0,
                want.0
            );
            assert!(
                (got.1 - want.1).abs() <= 1e-5 * want.1,
                "{what}: eval loss {} vs {}",
                got.1,
                want.1
            );
            assert_close(&format!("{what}: gradients"), &got.2, &to64(&want.2), 1e-4);
        }
    }
    let model = Llama::new(common::dense_cfg(false, true)).with_recompute(Recompute::Selective);
    let params: Vec<bf16> = stored(&model.params.init(3, 0.1));
    let want = step::<bf16>(&model, None, &params, &tokens, &targets);
    let got = step::<bf16>(&model, Some(&k), &params, &tokens, &targets);
    assert!(
        (got.0 - want.0).abs() <= 2e-2 * want.0,
        "bf16: loss {} vs {}",
        got.0,
        want.0
    );
    assert_close(
        "bf16: gradients",
        &f32s(&got.2),
        &to64(&f32s(&want.2)),
        5e-2,
    );
}

#[test]
fn a_host_buffer_handed_to_the_gpu_is_refused_naming_the_op() {
    let Some(k) = gpu() else { return };
    let (mut acc, x) = (vec![1.0f32; 4], vec![2.0f32; 4]);
    let err = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Kernels::<f32>::add_inplace(&k, acc.view_mut(), x.view())
    }))
    .expect_err("a host slice must be refused");
    let msg = err.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("op add_inplace was handed host memory on the CUDA backend"),
        "{msg}"
    );
}
