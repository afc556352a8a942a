//! The compute stream: where every kernel, cuBLASLt product and queued copy of the backend
//! runs, and what the NCCL, copy and offload streams order themselves against by events.
//!
//! It is the calling thread's **per-thread default stream** (`CU_STREAM_PER_THREAD`), not the
//! legacy default stream (the null stream), for CUDA graphs (#32 item 5): CUDA refuses to
//! capture the legacy stream, whose work synchronises implicitly with every other blocking
//! stream of the context. A per-thread stream can be captured, and it is one stream per host
//! thread with no handle to pass around: a rank's kernels are launched by its own thread (a
//! thread rank's, or the process's under MPI), so ranks sharing one GPU as threads no longer
//! queue behind each other's work either.
//!
//! What still runs on the legacy stream is ordered against the compute stream all the same,
//! because a per-thread stream is a *blocking* stream: legacy work waits for the work queued
//! before it there, and the compute stream's later work waits for it (CUDA's "implicit
//! synchronization" of the legacy stream). The `DeviceAlloc` copies that other threads make
//! (the offload tier's copy thread, checkpoints) rely on it and stay synchronous; the
//! backend's own reads and writes during a step go on the compute stream ([`write_queued`],
//! [`read_after`], [`zero_queued`]; the batch's ids and the gradients' zeroing through
//! `DeviceAlloc::upload_queued` and `zero_queued`), so a dense step leaves nothing on the
//! legacy stream (`device_ops.legacy`).

use cudarc::driver::{result, CudaContext, CudaStream};
use std::sync::Arc;

/// The compute stream of the calling thread on `ctx`'s device.
pub fn compute_stream(ctx: &Arc<CudaContext>) -> Arc<CudaStream> {
    ctx.per_thread_stream()
}

/// `host` written to device address `at` behind the work queued before it on `stream`.
/// From pageable memory CUDA stages the bytes before the call returns, so `host` may change
/// at once; the host does not wait for the device.
///
/// # Safety
/// `at` holds `host`'s bytes in `stream`'s context, which is bound to this thread, and no
/// work queued on another stream writes or reads them unordered with this copy; `host` is
/// pageable memory (from page-locked memory the copy would read it when it runs).
pub unsafe fn write_queued<T>(stream: &CudaStream, at: u64, host: &[T], what: &str) {
    // SAFETY: the caller's.
    unsafe { result::memcpy_htod_async(at, host, stream.cu_stream()) }.unwrap_or_else(|e| {
        panic!(
            "CUDA {what}: copying {} bytes to the GPU: {e:?}",
            size_of_val(host)
        )
    });
}

/// `out` read from device address `at` once the work queued before it on `stream` has run:
/// the host waits (one host synchronisation, which the caller counts by its site).
///
/// # Safety
/// `at` holds `out`'s bytes in `stream`'s context, which is bound to this thread.
pub unsafe fn read_after<T>(stream: &CudaStream, out: &mut [T], at: u64, what: &str) {
    let n = size_of_val(out);
    // SAFETY: the caller's. Into pageable memory the copy has landed when the call returns;
    // the stream's synchronisation makes it so into any memory.
    unsafe { result::memcpy_dtoh_async(out, at, stream.cu_stream()) }
        .and_then(|()| stream.synchronize())
        .unwrap_or_else(|e| panic!("CUDA {what}: copying {n} bytes from the GPU: {e:?}"));
}

/// `bytes` at device address `at` set to zero behind the work queued before it on `stream`.
///
/// # Safety
/// `at` holds `bytes` in `stream`'s context, which is bound to this thread.
pub unsafe fn zero_queued(stream: &CudaStream, at: u64, bytes: usize, what: &str) {
    // SAFETY: the caller's.
    unsafe { result::memset_d8_async(at, 0, bytes, stream.cu_stream()) }
        .unwrap_or_else(|e| panic!("CUDA {what}: zeroing {bytes} bytes: {e:?}"));
}
