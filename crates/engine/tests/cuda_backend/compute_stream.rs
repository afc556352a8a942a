//! The compute stream is each thread's per-thread default stream (`cuda::compute_stream`),
//! which CUDA graphs can capture: a copy queued on it from pageable memory takes the bytes
//! the host had when it was made (CUDA stages them), the kernels after it read them, and a
//! synchronous copy made on another thread (the offload tier's copy thread, a checkpoint),
//! which runs on the legacy default stream, waits for all of it. On the CUDA emulator the
//! per-thread stream's copies run late (when a launch, a synchronisation or legacy work
//! comes), so a missing order shows there as wrong bits. The stream can be captured into a
//! CUDA graph and replayed.

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

/// `y += x·Wᵀ` (cuBLASLt), `z += y`, `z *= 0.5`: a few of the backend's ops, products and
/// kernels, with no host synchronisation between them.
fn sequence(
    g: &dyn Kernels<f32>,
    s: MatmulShape,
    x: View<'_, f32>,
    w: View<'_, f32>,
    mut y: ViewMut<'_, f32>,
    mut z: ViewMut<'_, f32>,
) {
    g.matmul_forward(s, x, w, None, y.rb(), Accum::Add);
    g.add_inplace(z.rb(), y.as_view());
    g.scale(z, 0.5);
}

/// The compute stream can be captured into a CUDA graph (#32 item 5): the sequence above,
/// captured once, does nothing until the graph is launched, and each launch on new inputs
/// gives what the same ops give run one by one, bit for bit (on a GPU and on the emulator,
/// whose capture keeps each launch's arguments by value and refuses what CUDA refuses).
#[test]
fn a_captured_sequence_replays_the_eager_bits_on_new_inputs() {
    use ferrotron_engine::kernels::cuda::cudarc::driver::sys;
    let Some(k) = gpu() else { return };
    let g: &dyn Kernels<f32> = &k;
    let alloc: Arc<dyn DeviceAlloc> = Arc::new(CudaAlloc::new(k.gpu().ctx.clone(), k.baseline()));
    let s = MatmulShape {
        n: 24,
        in_features: 40,
        out_features: 32,
        ragged: false,
    };
    let buf = |len| DeviceBuf::<f32>::zeros(&alloc, len).unwrap();
    let (mut x, mut w) = (
        buf(s.n * s.in_features),
        buf(s.out_features * s.in_features),
    );
    let (mut y, mut z) = (buf(s.n * s.out_features), buf(s.n * s.out_features));
    let input = |seed: f32, len: usize| -> Vec<f32> {
        (0..len)
            .map(|i| (i as f32 * 0.37 + seed).sin() * 0.5)
            .collect()
    };
    w.copy_from_host(&input(3.0, s.out_features * s.in_features));
    // Eager: each input, from zeroed outputs.
    let mut eager = Vec::new();
    for seed in [1.0, 2.0] {
        x.copy_from_host(&input(seed, s.n * s.in_features));
        y.zero();
        z.zero();
        sequence(g, s, x.view(), w.view(), y.view_mut(), z.view_mut());
        eager.push((download(y.view()), download(z.view())));
    }
    // Captured once (nothing runs), then launched on each input.
    y.zero();
    z.zero();
    let stream = k.gpu().stream.clone();
    let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    stream
        .begin_capture(mode)
        .expect("the compute stream can be captured");
    sequence(g, s, x.view(), w.view(), y.view_mut(), z.view_mut());
    let graph = (stream.end_capture(sys::CUgraphInstantiate_flags(0)))
        .expect("the capture ends")
        .expect("a graph");
    assert!(
        download(z.view()).iter().all(|&v| v == 0.0),
        "a capture runs nothing"
    );
    for (seed, (ey, ez)) in [1.0, 2.0].into_iter().zip(&eager) {
        x.copy_from_host(&input(seed, s.n * s.in_features));
        y.zero();
        z.zero();
        graph.launch().expect("the graph launches");
        assert_eq!(
            &download(y.view()),
            ey,
            "the product, replayed (input {seed})"
        );
        assert_eq!(
            &download(z.view()),
            ez,
            "the kernels, replayed (input {seed})"
        );
    }
}
