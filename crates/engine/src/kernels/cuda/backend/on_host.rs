//! The multi-rank op the GPU has no kernels for yet — ring attention (context parallelism) —
//! runs on the host: its operands are downloaded, the CPU backend's kernel runs on them, and
//! what it wrote goes back up. Correct to the CPU's bits and slow, but it lets `--device cuda
//! --cp N` run, on one GPU with host-staged ranks, and be checked against one rank, instead of
//! panicking mid-step. Device kernels replace it (issue #33), checked against it, as the
//! vocabulary-parallel cross-entropy's did (`cu/vocab_parallel_ce.cu`).
//!
//! The host copies live in buffers the backend keeps ([`HostBuffers`]), grown to the largest
//! call and reused: a ring step or a cross-entropy chunk allocates nothing on the host after
//! the first (the copies themselves, and their synchronisations, remain: `SyncSite::OnHost`).

use super::*;
use crate::kernels::cuda::memory::bind;
use std::any::{Any, TypeId};

/// Host buffers kept from call to call, in sets of `N` of one element type, by the op's name.
/// A set is taken out for a call and put back after it, so the lock is not held while the CPU
/// kernel runs; a second thread meanwhile (ranks sharing the backend) starts a set of its own.
#[derive(Default)]
pub(super) struct HostBuffers(HashMap<(TypeId, &'static str), Box<dyn Any + Send>>);

type Set<T, const N: usize> = Box<[Vec<T>; N]>;

impl HostBuffers {
    fn take<T: Send + 'static, const N: usize>(&mut self, op: &'static str) -> Set<T, N> {
        let key = (TypeId::of::<[Vec<T>; N]>(), op);
        (self.0.remove(&key))
            .and_then(|b| b.downcast().ok())
            .unwrap_or_else(|| Box::new(std::array::from_fn(|_| Vec::new())))
    }

    fn put<T: Send + 'static, const N: usize>(&mut self, op: &'static str, set: Set<T, N>) {
        self.0.insert((TypeId::of::<[Vec<T>; N]>(), op), set);
    }
}

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
    OPS.write();
    let mut dst = dst;
    // SAFETY: `dst` is device memory of `src.len()` elements, borrowed uniquely.
    unsafe { result::memcpy_htod_sync(dst.as_mut_ptr() as u64, src) }
        .unwrap_or_else(|e| panic!("copying {} elements to the GPU: {e:?}", src.len()));
}

/// A device view read into a kept host buffer.
fn read<T: Copy + Default>(v: View<'_, T>, into: &mut Vec<T>) {
    download_into(SyncSite::OnHost, v, into);
}

/// The CPU backend, for the ops run on the host.
fn cpu<S: Elem, G: Elem>() -> &'static dyn Kernels<S, G> {
    &CpuKernels::PLAIN
}

impl CudaKernels {
    /// Sets `op`'s `N` buffers of `T` from the kept ones.
    fn host_set<T: Send + 'static, const N: usize>(&self, op: &'static str) -> Set<T, N> {
        lock(&self.host).take(op)
    }

    fn keep<T: Send + 'static, const N: usize>(&self, op: &'static str, set: Set<T, N>) {
        lock(&self.host).put(op, set)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn ring_forward_on_host<S: Elem, G: Elem>(
        &self,
        s: RingShape,
        q: View<'_, S>,
        k: View<'_, f32>,
        v: View<'_, f32>,
        o: ViewMut<'_, f32>,
        lse: ViewMut<'_, f32>,
        first: bool,
    ) {
        let op = "ring forward";
        let mut qs = self.host_set::<S, 1>(op);
        let mut fs = self.host_set::<f32, 4>(op);
        let [qh] = &mut *qs;
        let [kh, vh, oh, lh] = &mut *fs;
        read(q, qh);
        read(k, kh);
        read(v, vh);
        // The running output and log-sum-exp are read too (merged with this block's).
        read(o.as_view(), oh);
        read(lse.as_view(), lh);
        let (qv, kv, vv) = (qh.view(), kh.view(), vh.view());
        cpu::<S, G>().attention_forward_ring(s, qv, kv, vv, oh.view_mut(), lh.view_mut(), first);
        upload_into(o, oh);
        upload_into(lse, lh);
        self.keep(op, qs);
        self.keep(op, fs);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn ring_backward_on_host<S: Elem, G: Elem>(
        &self,
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
        let op = "ring backward";
        let mut ss = self.host_set::<S, 3>(op);
        let mut fs = self.host_set::<f32, 6>(op);
        let [qh, oh, doh] = &mut *ss;
        let [kh, vh, lh, gq, gk, gv] = &mut *fs;
        read(q, qh);
        read(o, oh);
        read(d_o, doh);
        read(k, kh);
        read(v, vh);
        read(lse, lh);
        // The gradients are added into.
        read(dq.as_view(), gq);
        read(dk.as_view(), gk);
        read(dv.as_view(), gv);
        cpu::<S, G>().attention_backward_ring(
            s,
            qh.view(),
            kh.view(),
            vh.view(),
            oh.view(),
            lh.view(),
            doh.view(),
            gq.view_mut(),
            gk.view_mut(),
            gv.view_mut(),
        );
        upload_into(dq, gq);
        upload_into(dk, gk);
        upload_into(dv, gv);
        self.keep(op, ss);
        self.keep(op, fs);
    }
}

#[cfg(test)]
mod tests {
    use super::HostBuffers;

    #[test]
    fn cuda_host_buffers_are_kept_per_op_type_and_count() {
        let mut h = HostBuffers::default();
        let mut a = h.take::<f32, 2>("op");
        a[0].resize(1000, 1.0);
        let kept = a[0].as_ptr();
        h.put("op", a);
        // Another element type, another count or another op: a set of its own.
        assert!(h.take::<u32, 2>("op").iter().all(|v| v.capacity() == 0));
        assert!(h.take::<f32, 3>("op").iter().all(|v| v.capacity() == 0));
        assert!(h.take::<f32, 2>("other").iter().all(|v| v.capacity() == 0));
        // The same: the same allocation back, its contents as left.
        let b = h.take::<f32, 2>("op");
        assert_eq!((b[0].as_ptr(), b[0].len()), (kept, 1000));
        // Taken out, not shared: a second take meanwhile gets a fresh set.
        assert_eq!(h.take::<f32, 2>("op")[0].capacity(), 0);
    }
}
