//! The compute stream is each thread's per-thread default stream (`cuda::compute_stream`),
//! which CUDA graphs can capture: a copy queued on it from pageable memory takes the bytes
//! the host had when it was made (CUDA stages them), the kernels after it read them, and a
//! synchronous copy made on another thread (the offload tier's copy thread, a checkpoint),
//! which runs on the legacy default stream, waits for all of it. On the CUDA emulator the
//! per-thread stream's copies run late (when a launch, a synchronisation or legacy work
//! comes), so a missing order shows there as wrong bits.

use super::gpu;
use ferrotron_engine::kernels::cuda::{download, CudaAlloc};
use ferrotron_engine::kernels::host_copy::bytes;
use ferrotron_engine::kernels::*;
use std::ptr::NonNull;
use std::sync::Arc;

#[test]
fn queued_writes_are_staged_and_seen_by_later_work_and_other_threads() {
    let Some(k) = gpu() else { return };
    let g: &dyn Kernels<f32> = &k;
    let alloc: Arc<dyn DeviceAlloc> = Arc::new(CudaAlloc::new(k.gpu().ctx.clone(), k.baseline()));
    let n = 2000;
    let first: Vec<f32> = (0..n).map(|i| i as f32 * 0.25).collect();
    let mut src = first.clone();
    let mut a = DeviceBuf::<f32>::zeros(&alloc, n).unwrap();
    let mut sum = DeviceBuf::<f32>::zeros(&alloc, n).unwrap();
    let dst = NonNull::new(a.view_mut().as_mut_ptr().cast::<u8>()).unwrap();
    // SAFETY: `a` holds `n` f32 of the device's memory; `src` is pageable.
    unsafe { alloc.upload_queued(dst, bytes(&src)) };
    // The host changes its buffer at once: the queued copy took the bytes it had.
    src.iter_mut().for_each(|x| *x = -7.0);
    g.add_inplace(sum.view_mut(), a.view());
    g.add_inplace(sum.view_mut(), a.view());
    // A second write left queued (on the emulator it has not run yet): another thread's
    // synchronous copy (legacy stream) waits for this thread's queue.
    let second: Vec<f32> = (0..n).map(|i| 1.0 - i as f32).collect();
    // SAFETY: as above.
    unsafe { alloc.upload_queued(dst, bytes(&second)) };
    let (want_a, want_sum): (Vec<f32>, Vec<f32>) =
        (second.clone(), first.iter().map(|x| x + x).collect());
    let (got_a, got_sum) = std::thread::scope(|s| {
        s.spawn(|| (download(a.view()), download(sum.view())))
            .join()
            .expect("the reading thread")
    });
    assert_eq!(got_a, want_a, "the queued copies, read from another thread");
    assert_eq!(
        got_sum, want_sum,
        "the kernels between them, read from another thread"
    );
}
