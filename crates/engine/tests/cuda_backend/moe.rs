//! The mixture-of-experts ops on the GPU against the CPU backend (`cpu/moe_routing.rs`):
//! routing with and without renormalisation and a capacity, a tie between two experts, views at
//! an odd offset, every storage type, zero rows, and a MoE model's training step.
//!
//! Tolerances: the router's choices, and every op on routed rows (copies, scalings, weighted
//! sums, dots), equal the CPU's exactly (`cu/moe.cu` sums in the CPU's order, with no FMA
//! contraction). The router's probabilities, load sums and logit gradients go through `expf`,
//! whose CUDA version is within 2 ulp of the host's: 1e-5 relative to each tensor's largest
//! entry.

use super::{f32s, gpu, same, stored, On};
use crate::common::{assert_close, to64, Rng};
use ferrotron_engine::dtype::Elem;
use ferrotron_engine::kernels::cuda::{download, CudaAlloc, CudaKernels};
use ferrotron_engine::kernels::*;
use ferrotron_engine::model::{Llama, LlamaConfig, MoeConfig, Recompute};
use half::{bf16, f16};
use std::sync::Arc;

/// Through `expf` (see the module's note).
const ROUTER_TOL: f64 = 1e-5;

fn route(tokens: usize, width: usize, norm_topk: bool, capacity: Option<usize>) -> RouteShape {
    RouteShape {
        tokens,
        experts: 6,
        top_k: 2,
        width,
        norm_topk,
        capacity,
    }
}

/// Router logits (6 experts) with ties: token 0's two largest are equal, and token 1's second
/// and third (the lower expert goes first).
fn logits(rng: &mut Rng, tokens: usize) -> Vec<f32> {
    let mut l = rng.vec(tokens * 6, 3.0);
    if tokens > 1 {
        (l[1], l[4]) = (5.0, 5.0);
        l[6..12].copy_from_slice(&[4.0, -1.0, 1.0, -2.0, 0.5, 1.0]);
    }
    l
}

/// Every MoE op once on the CPU and on the GPU for storage type `S`, views `at` elements into
/// their allocations.
fn moe_ops<S: Elem>(k: &CudaKernels, at: usize) {
    let t = format!("{} at +{at}", std::any::type_name::<S>());
    let on = On { k, at };
    let cpu = CpuKernels::PLAIN;
    let c: &dyn Kernels<S> = &cpu;
    let g: &dyn Kernels<S> = k;
    let mut rng = Rng::new(21);
    let (n, e, w) = (37, 6, 40);
    for (norm, cap) in [(true, None), (false, None), (true, Some(9))] {
        let s = route(n, w, norm, cap);
        let what = format!("{t} norm {norm} capacity {cap:?}");
        let z = logits(&mut rng, n);
        let gz = on.up(&z);
        // The running sums of an earlier layer, added to.
        let mut load: Vec<f32> = rng.vec(2 * e, 1.0).iter().map(|x| x.abs()).collect();
        let (mut weights, mut index) = (vec![0f32; n * 2], vec![0u32; n * 2]);
        let (mut gw, mut gi, mut gl) = (on.up(&weights), on.up(&index), on.up(&load));
        c.router_forward(
            s,
            z.view(),
            weights.view_mut(),
            index.view_mut(),
            load.view_mut(),
        );
        g.router_forward(
            s,
            gz.view(z.len()),
            gw.view_mut(weights.len()),
            gi.view_mut(index.len()),
            gl.view_mut(load.len()),
        );
        assert_eq!(
            download(gi.view::<u32>(index.len())),
            index,
            "{what}: router choices"
        );
        gi.guards_intact(&format!("{what} router index"));
        assert_eq!(
            index[..4],
            [1, 4, 0, 2],
            "{what}: a tie goes to the lower expert"
        );
        if cap.is_some() {
            assert!(
                index.iter().any(|&x| x & DROPPED != 0),
                "{what}: the capacity drops no copy; the test needs one"
            );
        }
        same(&format!("{what} router weights"), &gw, &weights, ROUTER_TOL);
        same(&format!("{what} router load"), &gl, &load, ROUTER_TOL);

        // Its backward, with no gradient for the dropped copies' weights (as the model has).
        let dw: Vec<f32> = rng
            .vec(n * 2, 1.0)
            .iter()
            .zip(&index)
            .map(|(&d, &x)| if x & DROPPED != 0 { 0.0 } else { d })
            .collect();
        let aux: Vec<f32> = rng.vec(e, 0.01);
        let (gdw, gaux) = (on.up(&dw), on.up(&aux));
        let mut dl = vec![0f32; n * e];
        let mut gdl = on.up(&rng.vec(n * e, 1.0));
        c.router_backward(
            s,
            z.view(),
            index.view(),
            dw.view(),
            aux.view(),
            dl.view_mut(),
        );
        g.router_backward(
            s,
            gz.view(z.len()),
            gi.view(index.len()),
            gdw.view(dw.len()),
            gaux.view(e),
            gdl.view_mut(dl.len()),
        );
        same(&format!("{what} router_backward"), &gdl, &dl, ROUTER_TOL);

        // The routed rows: as many as the copies no capacity dropped.
        let routed = index.iter().filter(|&&x| x & DROPPED == 0).count();
        let x = stored::<S>(&rng.vec(n * w, 1.0));
        let gx = on.up(&x);
        let mut rows = stored::<S>(&rng.vec(routed * w, 1.0));
        let mut grows = on.up(&rows);
        c.permute(s, index.view(), x.view(), rows.view_mut());
        g.permute(
            s,
            gi.view(index.len()),
            gx.view(x.len()),
            grows.view_mut(rows.len()),
        );
        same(&format!("{what} permute"), &grows, &rows, 0.0);

        // The weighted sums from the CPU's weights (the GPU's are compared above): exact.
        let rows = stored::<S>(&rng.vec(routed * w, 1.0));
        let (grows, gcw) = (on.up(&rows), on.up(&weights));
        for weighted in [true, false] {
            for acc in [Accum::Overwrite, Accum::Add] {
                let mut y = stored::<S>(&rng.vec(n * w, 1.0));
                let mut gy = on.up(&y);
                let wt = weighted.then(|| weights.view());
                c.unpermute(s, index.view(), wt, rows.view(), y.view_mut(), acc);
                let gwt = weighted.then(|| gcw.view(weights.len()));
                g.unpermute(
                    s,
                    gi.view(index.len()),
                    gwt,
                    grows.view(rows.len()),
                    gy.view_mut(y.len()),
                    acc,
                );
                let op = format!("{what} unpermute weighted {weighted} {acc:?}");
                same(&op, &gy, &y, 0.0);
            }
        }

        let mut sr = rows.clone();
        let mut gsr = on.up(&sr);
        c.scale_rows(s, index.view(), weights.view(), sr.view_mut());
        g.scale_rows(
            s,
            gi.view(index.len()),
            gcw.view(weights.len()),
            gsr.view_mut(sr.len()),
        );
        same(&format!("{what} scale_rows"), &gsr, &sr, 0.0);

        let b = stored::<S>(&rng.vec(routed * w, 1.0));
        let gb = on.up(&b);
        // Entries of dropped copies are left as they were.
        let mut dots = rng.vec(n * 2, 1.0);
        let mut gdots = on.up(&dots);
        c.row_dot(s, index.view(), rows.view(), b.view(), dots.view_mut());
        g.row_dot(
            s,
            gi.view(index.len()),
            grows.view(rows.len()),
            gb.view(b.len()),
            gdots.view_mut(dots.len()),
        );
        same(&format!("{what} row_dot"), &gdots, &dots, 0.0);
    }
}

/// Expert parallelism's row ops once on the CPU and on the GPU: each routed copy's weight
/// gathered into row order and scattered back (a capacity drops some copies, whose entries
/// are left as they were), and the per-row dots and scalings of rows that arrive in order.
fn expert_parallel_ops<S: Elem>(k: &CudaKernels, at: usize) {
    let what = format!("{} at +{at}", std::any::type_name::<S>());
    let on = On { k, at };
    let cpu = CpuKernels::PLAIN;
    let c: &dyn Kernels<S> = &cpu;
    let g: &dyn Kernels<S> = k;
    let mut rng = Rng::new(23);
    let (n, e, w) = (29, 6, 24);
    let s = route(n, 1, true, Some(7));
    let (mut weights, mut index, mut load) =
        (vec![0f32; n * 2], vec![0u32; n * 2], vec![0f32; 2 * e]);
    let z = logits(&mut rng, n);
    c.router_forward(
        s,
        z.view(),
        weights.view_mut(),
        index.view_mut(),
        load.view_mut(),
    );
    let routed = index.iter().filter(|&&x| x & DROPPED == 0).count();
    assert!(
        routed < n * 2,
        "{what}: the capacity drops no copy; the test needs one"
    );
    let (gi, gw) = (on.up(&index), on.up(&weights));
    let mut rows = rng.vec(routed, 1.0);
    let mut grows = on.up(&rows);
    c.gather_copies(s, index.view(), weights.view(), rows.view_mut());
    g.gather_copies(
        s,
        gi.view(index.len()),
        gw.view(weights.len()),
        grows.view_mut(routed),
    );
    same(&format!("{what} gather_copies"), &grows, &rows, 0.0);
    assert!(
        rows.iter().all(|r| weights.contains(r)),
        "{what}: gathered a weight"
    );
    let back = rng.vec(routed, 1.0);
    let mut values = rng.vec(n * 2, 1.0);
    let (gback, mut gvalues) = (on.up(&back), on.up(&values));
    c.scatter_copies(s, index.view(), back.view(), values.view_mut());
    g.scatter_copies(
        s,
        gi.view(index.len()),
        gback.view(routed),
        gvalues.view_mut(n * 2),
    );
    same(&format!("{what} scatter_copies"), &gvalues, &values, 0.0);
    let kept = values.iter().filter(|v| back.contains(v)).count();
    assert_eq!(
        kept, routed,
        "{what}: every routed row scattered, no dropped copy"
    );

    let rows = 11;
    let (a, b) = (
        stored::<S>(&rng.vec(rows * w, 1.0)),
        stored::<S>(&rng.vec(rows * w, 1.0)),
    );
    let (ga, gb) = (on.up(&a), on.up(&b));
    let mut dots = rng.vec(rows, 1.0);
    let mut gdots = on.up(&dots);
    c.dot_each_row(w, a.view(), b.view(), dots.view_mut());
    g.dot_each_row(w, ga.view(a.len()), gb.view(b.len()), gdots.view_mut(rows));
    same(&format!("{what} dot_each_row"), &gdots, &dots, 0.0);
    let scales = rng.vec(rows, 2.0);
    let mut x = a.clone();
    let (gs, mut gx) = (on.up(&scales), on.up(&x));
    c.scale_each_row(w, scales.view(), x.view_mut());
    g.scale_each_row(w, gs.view(rows), gx.view_mut(x.len()));
    same(&format!("{what} scale_each_row"), &gx, &x, 0.0);
    assert!(x != a, "{what}: the scaling changed the rows");
}

#[test]
fn every_moe_op_follows_the_cpu() {
    let Some(k) = gpu() else { return };
    eprintln!("GPU: {} ({})", k.gpu().name, k.gpu().arch);
    for at in [0, 3] {
        expert_parallel_ops::<f32>(&k, at);
        expert_parallel_ops::<bf16>(&k, at);
        moe_ops::<f32>(&k, at);
        moe_ops::<bf16>(&k, at);
        moe_ops::<f16>(&k, at);
    }
}

/// No tokens, and tokens whose every copy a capacity of 0 drops: the router keeps the running
/// sums (and counts the choices), the row ops write nothing, the weighted sum writes zeros.
fn moe_zero_rows<S: Elem>(k: &CudaKernels) {
    let t = std::any::type_name::<S>();
    let on = On { k, at: 2 };
    let cpu = CpuKernels::PLAIN;
    let c: &dyn Kernels<S> = &cpu;
    let g: &dyn Kernels<S> = k;
    let mut rng = Rng::new(17);
    let (e, w) = (6, 16);
    for n in [0, 5] {
        let s = route(n, w, true, Some(0));
        let what = format!("{t} zero rows of {n} tokens");
        let z = logits(&mut rng, n);
        let gz = on.up(&z);
        let mut load = rng.vec(2 * e, 1.0);
        let (mut weights, mut index) = (vec![0f32; n * 2], vec![0u32; n * 2]);
        let (mut gw, mut gi, mut gl) = (on.up(&weights), on.up(&index), on.up(&load));
        c.router_forward(
            s,
            z.view(),
            weights.view_mut(),
            index.view_mut(),
            load.view_mut(),
        );
        g.router_forward(
            s,
            gz.view(z.len()),
            gw.view_mut(weights.len()),
            gi.view_mut(index.len()),
            gl.view_mut(load.len()),
        );
        assert!(index.iter().all(|&x| x & DROPPED != 0), "{what}: {index:?}");
        assert_eq!(download(gi.view::<u32>(index.len())), index, "{what}");
        same(&format!("{what}: router load"), &gl, &load, ROUTER_TOL);
        let x = stored::<S>(&rng.vec(n * w, 1.0));
        let gx = on.up(&x);
        let mut rows = on.up::<S>(&[]);
        g.permute(s, gi.view(index.len()), gx.view(x.len()), rows.view_mut(0));
        rows.guards_intact(&format!("{what}: permute"));
        g.scale_rows(
            s,
            gi.view(index.len()),
            gw.view(weights.len()),
            rows.view_mut(0),
        );
        rows.guards_intact(&format!("{what}: scale_rows"));
        let dots = rng.vec(n * 2, 1.0);
        let mut gdots = on.up(&dots);
        g.row_dot(
            s,
            gi.view(index.len()),
            rows.view(0),
            rows.view(0),
            gdots.view_mut(dots.len()),
        );
        same(&format!("{what}: row_dot"), &gdots, &dots, 0.0);
        let y0 = stored::<S>(&rng.vec(n * w, 1.0));
        let mut gy = on.up(&y0);
        let wt = Some(gw.view(weights.len()));
        g.unpermute(
            s,
            gi.view(index.len()),
            wt,
            rows.view(0),
            gy.view_mut(n * w),
            Accum::Add,
        );
        same(&format!("{what}: unpermute +="), &gy, &y0, 0.0);
        let wt = Some(gw.view(weights.len()));
        g.unpermute(
            s,
            gi.view(index.len()),
            wt,
            rows.view(0),
            gy.view_mut(n * w),
            Accum::Overwrite,
        );
        let zeros = vec![S::from_f32(0.0); n * w];
        same(&format!("{what}: unpermute ="), &gy, &zeros, 0.0);
    }
}

#[test]
fn moe_ops_over_zero_rows_write_nothing() {
    let Some(k) = gpu() else { return };
    moe_zero_rows::<f32>(&k);
    moe_zero_rows::<bf16>(&k);
}

/// The tiny Mixtral of the engine's MoE tests on the small dense model's attention.
fn moe_cfg() -> LlamaConfig {
    LlamaConfig {
        moe: Some(MoeConfig {
            experts: 4,
            top_k: 2,
            norm_topk: true,
            aux_loss_coef: 0.05,
        }),
        ..crate::common::dense_cfg(false, false)
    }
}

#[test]
fn a_mixture_of_experts_trains_as_on_the_cpu() {
    let Some(k) = gpu() else { return };
    let mut rng = Rng::new(19);
    let tokens: Vec<u32> = (0..48).map(|_| rng.below(80)).collect();
    let targets: Vec<u32> = (0..48).map(|_| rng.below(80)).collect();
    for (rc, cf) in [
        (Recompute::None, None),
        (Recompute::Selective, None),
        (Recompute::None, Some(1.0)),
    ] {
        let model = Llama::new(moe_cfg())
            .with_recompute(rc)
            .with_capacity_factor(cf);
        let what = format!("moe fp32 {rc:?} capacity factor {cf:?}");
        let params = model.params.init(3, 0.1);
        let want = super::step::<f32>(&model, None, &params, &tokens, &targets);
        // The router's statistics in device memory, as the trainer keeps them.
        let on_gpu = model.clone();
        let alloc: Arc<dyn DeviceAlloc> =
            Arc::new(CudaAlloc::new(k.gpu().ctx.clone(), k.baseline()));
        on_gpu.moe_on_device(HostCopy::new(alloc)).unwrap();
        let got = super::step::<f32>(&on_gpu, Some(&k), &params, &tokens, &targets);
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
    let model = Llama::new(moe_cfg());
    let params: Vec<bf16> = stored(&model.params.init(3, 0.1));
    let want = super::step::<bf16>(&model, None, &params, &tokens, &targets);
    let on_gpu = model.clone();
    let alloc: Arc<dyn DeviceAlloc> = Arc::new(CudaAlloc::new(k.gpu().ctx.clone(), k.baseline()));
    on_gpu.moe_on_device(HostCopy::new(alloc)).unwrap();
    let got = super::step::<bf16>(&on_gpu, Some(&k), &params, &tokens, &targets);
    assert!(
        (got.0 - want.0).abs() <= 2e-2 * want.0,
        "moe bf16: loss {} vs {}",
        got.0,
        want.0
    );
    assert_close(
        "moe bf16: gradients",
        &f32s(&got.2),
        &to64(&f32s(&want.2)),
        5e-2,
    );
}
