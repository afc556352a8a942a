//! The multi-rank ops the GPU has no kernels for yet — ring attention (context parallelism)
//! and the vocabulary-parallel cross-entropy (tensor parallelism) — run on the host: their
//! operands are downloaded, the CPU backend's kernel runs on them, and what it wrote goes back
//! up. Correct to the CPU's bits and slow (a step's logits chunk crosses PCIe twice), but it
//! lets `--device cuda --tp N` and `--cp N` run, on one GPU with host-staged ranks, and be
//! checked against one rank, instead of panicking mid-step. Device kernels replace them
//! (issue #33), each checked against these.

use super::*;
use crate::kernels::cuda::memory::bind;

/// `src` written into the device view `dst` (of the same length).
fn upload_into<T: Copy>(dst: ViewMut<'_, T>, src: &[T]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "upload of {} into {}",
        src.len(),
        dst.len()
    );
    let Memory::Device(ordinal) = dst.memory() else {
        panic!("upload into {}", dst.memory());
    };
    if src.is_empty() {
        return;
    }
    bind(ordinal).unwrap_or_else(|e| panic!("copying {} elements to the GPU: {e}", src.len()));
    let mut dst = dst;
    // SAFETY: `dst` is device memory of `src.len()` elements, borrowed uniquely.
    unsafe { result::memcpy_htod_sync(dst.as_mut_ptr() as u64, src) }
        .unwrap_or_else(|e| panic!("copying {} elements to the GPU: {e:?}", src.len()));
}

/// The CPU backend, for the ops run on the host.
fn cpu<S: Elem, G: Elem>() -> &'static dyn Kernels<S, G> {
    &CpuKernels::PLAIN
}

#[allow(clippy::too_many_arguments)]
pub(super) fn attention_forward_ring<S: Elem, G: Elem>(
    s: RingShape,
    q: View<'_, S>,
    k: View<'_, f32>,
    v: View<'_, f32>,
    o: ViewMut<'_, f32>,
    lse: ViewMut<'_, f32>,
    first: bool,
) {
    let (q, k, v) = (download(q), download(k), download(v));
    // The running output and log-sum-exp are read too (merged with this block's).
    let (mut oh, mut lh) = (download(o.as_view()), download(lse.as_view()));
    let (qv, kv, vv) = (q.view(), k.view(), v.view());
    cpu::<S, G>().attention_forward_ring(s, qv, kv, vv, oh.view_mut(), lh.view_mut(), first);
    upload_into(o, &oh);
    upload_into(lse, &lh);
}

#[allow(clippy::too_many_arguments)]
pub(super) fn attention_backward_ring<S: Elem, G: Elem>(
    s: RingShape,
    q: View<'_, S>,
    k: View<'_, f32>,
    v: View<'_, f32>,
    o: View<'_, S>,
    lse: View<'_, f32>,
    d_o: View<'_, S>,
    dq: ViewMut<'_, f32>,
    dk: ViewMut<'_, f32>,
    dv: ViewMut<'_, f32>,
) {
    let (q, k, v, o) = (download(q), download(k), download(v), download(o));
    let (lse, d_o) = (download(lse), download(d_o));
    // The gradients are added into.
    let mut g = [dq.as_view(), dk.as_view(), dv.as_view()].map(download);
    let [gq, gk, gv] = &mut g;
    cpu::<S, G>().attention_backward_ring(
        s,
        q.view(),
        k.view(),
        v.view(),
        o.view(),
        lse.view(),
        d_o.view(),
        gq.view_mut(),
        gk.view_mut(),
        gv.view_mut(),
    );
    let [gq, gk, gv] = g;
    upload_into(dq, &gq);
    upload_into(dk, &gk);
    upload_into(dv, &gv);
}

pub(super) fn ce_shard_stats<S: Elem, G: Elem>(
    s: CeShardShape,
    logits: ViewMut<'_, f32>,
    targets: View<'_, u32>,
    stats: ViewMut<'_, f32>,
    keep_exp: bool,
) {
    let (mut z, t) = (download(logits.as_view()), download(targets));
    let mut st = download(stats.as_view());
    cpu::<S, G>().ce_shard_stats(s, z.view_mut(), t.view(), st.view_mut(), keep_exp);
    if keep_exp {
        upload_into(logits, &z);
    }
    upload_into(stats, &st);
}

#[allow(clippy::too_many_arguments)]
pub(super) fn ce_shard_finish<S: Elem, G: Elem>(
    s: CeShardShape,
    logits: ViewMut<'_, f32>,
    targets: View<'_, u32>,
    all: View<'_, f32>,
    rank: usize,
    losses: ViewMut<'_, f32>,
    dlogits_scale: Option<f32>,
) -> f64 {
    let (mut z, t, all) = (download(logits.as_view()), download(targets), download(all));
    let mut l = download(losses.as_view());
    let sum = cpu::<S, G>().ce_shard_finish(
        s,
        z.view_mut(),
        t.view(),
        all.view(),
        rank,
        l.view_mut(),
        dlogits_scale,
    );
    if dlogits_scale.is_some() {
        upload_into(logits, &z);
    }
    upload_into(losses, &l);
    sum
}
