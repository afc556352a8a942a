//! Device memory: one allocation ([`DeviceBlock`]), views of it tagged with the device, a
//! [`CudaPool`] that places the model's buffers in device memory, and copies to and from the
//! host.

use super::OPS;
use crate::kernels::{Memory, SyncSite, View, ViewMut};
use crate::model::{BufName, BufferPool, BUF_ALIGN};
use cudarc::driver::{result, CudaContext};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// One device allocation, zero-filled, freed on drop.
pub struct DeviceBlock {
    ctx: Arc<CudaContext>,
    ptr: u64,
    bytes: usize,
}

// SAFETY: a device address and the context it belongs to; every use binds the context first.
unsafe impl Send for DeviceBlock {}
unsafe impl Sync for DeviceBlock {}

impl DeviceBlock {
    /// `bytes` of zeroed device memory (at least one byte, so the address is never null).
    pub fn new(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DeviceBlock, String> {
        let n = bytes.max(1);
        ctx.bind_to_thread().map_err(|e| format!("{e:?}"))?;
        let _w = OPS.sync(SyncSite::Alloc);
        OPS.write();
        // SAFETY: the context is bound; the memory is set before it is handed out.
        let ptr = unsafe {
            let p = result::malloc_sync(n).map_err(|e| {
                format!("cannot allocate {n} bytes of GPU memory ({e:?}): the plan does not fit this GPU")
            })?;
            OPS.legacy();
            result::memset_d8_sync(p, 0, n).map_err(|e| format!("{e:?}"))?;
            p
        };
        Ok(DeviceBlock {
            ctx: ctx.clone(),
            ptr,
            bytes,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn ordinal(&self) -> u32 {
        self.ctx.ordinal() as u32
    }

    /// The block as `len` elements of `T`.
    pub fn view<T>(&self, len: usize) -> View<'_, T> {
        assert!(
            len * size_of::<T>() <= self.bytes.max(1),
            "view past the block"
        );
        // SAFETY: within the block, which outlives the view; tagged as device memory, so the
        // host never reads it through the view.
        unsafe { View::from_raw_parts(nn(self.ptr), len, Memory::Device(self.ordinal())) }
    }

    pub fn view_mut<T>(&mut self, len: usize) -> ViewMut<'_, T> {
        assert!(
            len * size_of::<T>() <= self.bytes.max(1),
            "view past the block"
        );
        // SAFETY: as `view`, and unique through `&mut self`.
        unsafe { ViewMut::from_raw_parts(nn(self.ptr), len, Memory::Device(self.ordinal())) }
    }
}

fn nn<T>(p: u64) -> NonNull<T> {
    NonNull::new(p as usize as *mut T).expect("a device allocation is never at address 0")
}

impl Drop for DeviceBlock {
    fn drop(&mut self) {
        // The ids the host noted there (`Kernels::host_ids`) go with the memory.
        super::backend::host_ids::forget(self.ptr, self.bytes() as u64);
        // SAFETY: allocated in `new`, freed once; errors at teardown have nowhere to go.
        unsafe {
            let _ = self.ctx.bind_to_thread();
            let _w = OPS.sync(SyncSite::Alloc);
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// `host` copied to a new device block.
pub fn upload<T: Copy>(ctx: &Arc<CudaContext>, host: &[T]) -> Result<DeviceBlock, String> {
    let b = DeviceBlock::new(ctx, std::mem::size_of_val(host))?;
    OPS.write();
    OPS.legacy();
    // SAFETY: the block holds exactly `host`'s bytes.
    unsafe { result::memcpy_htod_sync(b.ptr, host) }.map_err(|e| format!("{e:?}"))?;
    Ok(b)
}

/// Makes GPU `ordinal`'s primary context (the one [`super::CudaKernels::open`] uses) current on
/// this thread. A raw copy needs a current context and, unlike cudarc's own calls, does not
/// bind one: on a thread that has launched nothing yet (a rank's thread, a checkpoint writer)
/// it would fail, or copy in another context. The contexts are kept for the process, so
/// binding again is one driver call.
pub fn bind(ordinal: u32) -> Result<(), String> {
    static CONTEXTS: Mutex<Vec<(u32, Arc<CudaContext>)>> = Mutex::new(Vec::new());
    let mut all = CONTEXTS.lock().unwrap_or_else(|e| e.into_inner());
    let ctx = match all.iter().find(|(o, _)| *o == ordinal) {
        Some((_, c)) => c.clone(),
        None => {
            let c =
                CudaContext::new(ordinal as usize).map_err(|e| format!("GPU {ordinal}: {e:?}"))?;
            all.push((ordinal, c.clone()));
            c
        }
    };
    drop(all);
    ctx.bind_to_thread()
        .map_err(|e| format!("GPU {ordinal}: {e:?}"))
}

/// A device view's elements, on the host (a synchronous copy, on the legacy default stream:
/// it waits for the work queued before it on every thread's compute stream). For tests and
/// tools: the backend's own reads name their site ([`download_into`]).
pub fn download<T: Copy + Default>(v: View<'_, T>) -> Vec<T> {
    let mut out = Vec::new();
    download_into(SyncSite::OtherDownload, v, &mut out);
    out
}

/// [`download`] into `out` (resized to the view's length), reusing its capacity: for a copy
/// made on every call of an op. Counted as a host synchronisation at `site` ([`OPS`]).
pub fn download_into<T: Copy + Default>(site: SyncSite, v: View<'_, T>, out: &mut Vec<T>) {
    let Memory::Device(ordinal) = v.memory() else {
        panic!("download of {}", v.memory());
    };
    out.clear();
    out.resize(v.len(), T::default());
    if out.is_empty() {
        return;
    }
    bind(ordinal).unwrap_or_else(|e| panic!("copying {} elements from the GPU: {e}", v.len()));
    let _w = OPS.sync(site);
    OPS.legacy();
    // SAFETY: the view's bytes are device memory of its length.
    unsafe { result::memcpy_dtoh_sync(out, v.as_ptr() as u64) }
        .unwrap_or_else(|e| panic!("copying {} elements from the GPU: {e:?}", v.len()));
}

/// A pool whose buffers are device memory: each a block of its own, kept until the pool is
/// dropped (as `DevicePool`, its host emulation, does). For tests and tools; the trainer
/// places buffers in its planned arena instead.
pub struct CudaPool {
    ctx: Arc<CudaContext>,
    blocks: Vec<DeviceBlock>,
}

impl CudaPool {
    pub fn new(ctx: &Arc<CudaContext>) -> CudaPool {
        CudaPool {
            ctx: ctx.clone(),
            blocks: Vec::new(),
        }
    }
}

impl BufferPool for CudaPool {
    fn did_alloc(&mut self, _: BufName, _: u64) {}
    fn did_free(&mut self, _: BufName, _: u64) {}
    fn place(&mut self, name: BufName, bytes: u64) -> Option<NonNull<u8>> {
        // cuMemAlloc aligns to 256 bytes at least, more than BUF_ALIGN.
        const _: () = assert!(BUF_ALIGN <= 256);
        let b = DeviceBlock::new(&self.ctx, bytes as usize)
            .unwrap_or_else(|e| panic!("GPU buffer {name:?}: {e}"));
        let p = nn(b.ptr);
        self.blocks.push(b);
        Some(p)
    }
    fn memory(&self) -> Memory {
        Memory::Device(self.ctx.ordinal() as u32)
    }
}

/// The GPU's memory as the trainer's device state lives in it (`DeviceAlloc`).
#[derive(Debug)]
pub struct CudaAlloc {
    pub ctx: Arc<CudaContext>,
    /// Bytes allocated through it now, and the most since the last reset.
    live: AtomicU64,
    peak: AtomicU64,
    /// The most bytes ever allocated through it, and the driver's count of the device's memory
    /// in use at that moment: the device's own reading of the run's peak.
    high: AtomicU64,
    driver_at_high: AtomicU64,
    /// The device's memory in use by the driver's count when the backend opened it, before
    /// its own workspace (the context, the loaded kernels, other processes): the zero of
    /// [`Self::driver_used`], so that the reading covers everything the plan does.
    baseline: u64,
    /// The last block freed (address, bytes), kept for the next request of its exact size.
    /// The activation arena's region is given back at each step's end, so that the update
    /// runs in the memory the plan leaves it, and asked for again at the next step's start;
    /// `cuMemFree` and `cuMemAlloc` each synchronise the device, two host round trips a step
    /// (issue #32), where a reused block costs a memset. A request of another size releases
    /// the spare first, so the device never holds it beside a block the plan did not expect.
    spare: Mutex<Option<(u64, usize)>>,
    /// The copy stream of [`DeviceAlloc::upload_ahead`], made at its first use.
    ahead: Mutex<Option<CopyStream>>,
    /// The compute stream's handle (`compute_stream`: the calling thread's, resolved by the
    /// driver at each use), made once: a handle per call would be a heap allocation in the step.
    compute: Arc<cudarc::driver::CudaStream>,
}

/// A stream for host-to-device copies beside the compute stream (`compute_stream`: the one
/// every kernel runs on), non-blocking so that neither waits for the other but by events:
/// `issued`, recorded on the compute stream before each copy (the copy waits for the work that
/// may still read its destination), and `landed`, recorded on the copy stream after it (the
/// compute stream waits for it at [`DeviceAlloc::await_uploads`]).
struct CopyStream {
    stream: Arc<cudarc::driver::CudaStream>,
    issued: cudarc::driver::CudaEvent,
    landed: cudarc::driver::CudaEvent,
    /// Copies started since the compute stream last waited for them.
    unawaited: bool,
}

impl std::fmt::Debug for CopyStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CopyStream {{ unawaited: {} }}", self.unawaited)
    }
}

impl CopyStream {
    fn new(ctx: &Arc<CudaContext>) -> Result<CopyStream, String> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING);
        let what = |e| format!("a copy stream for the parameters: {e:?}");
        Ok(CopyStream {
            stream: ctx.new_stream().map_err(what)?,
            issued: ctx.new_event(flags).map_err(what)?,
            landed: ctx.new_event(flags).map_err(what)?,
            unawaited: false,
        })
    }
}

/// The device's memory in use, by the driver's count (`cuMemGetInfo`: total − free).
pub fn in_use(ctx: &CudaContext) -> Option<u64> {
    ctx.bind_to_thread().ok()?;
    let (free, total) = result::mem_get_info().ok()?;
    Some((total - free) as u64)
}

impl CudaAlloc {
    /// The allocator of `ctx`, whose driver counted `baseline` bytes in use before the backend
    /// allocated anything (`CudaKernels::baseline`).
    pub fn new(ctx: Arc<CudaContext>, baseline: u64) -> CudaAlloc {
        CudaAlloc {
            live: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            high: AtomicU64::new(0),
            driver_at_high: AtomicU64::new(0),
            baseline,
            spare: Mutex::new(None),
            ahead: Mutex::new(None),
            compute: super::compute_stream::compute_stream(&ctx),
            ctx,
        }
    }

    /// The spare block if it is exactly `bytes`, zeroed as a new one is.
    fn reuse(&self, bytes: usize) -> Option<NonNull<u8>> {
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        let (p, _) = spare.take_if(|s| s.1 == bytes)?;
        drop(spare);
        // Zeroed on the caller's compute stream, behind its work so far: the spare is the
        // activation arena's region, given back at a step's end by the thread that runs the
        // steps and asked for again by it at the next step's start, so the work that last used
        // it and the work that uses it next are that stream's (nothing of a step is left on
        // the legacy stream, which CUDA graphs cannot capture).
        // SAFETY: the spare is a live block of `bytes`, owned by this allocator.
        unsafe { crate::kernels::DeviceAlloc::zero_queued(self, nn(p), bytes) };
        Some(nn(p))
    }

    /// Gives the spare block back to the driver, if there is one.
    fn release_spare(&self) {
        let spare = self.spare.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some((p, _)) = spare {
            let _ = self.ctx.bind_to_thread();
            let _w = OPS.sync(SyncSite::Alloc);
            // SAFETY: the spare was allocated by `alloc` and is owned by nobody else.
            let _ = unsafe { result::free_sync(p) };
        }
    }
}

impl Drop for CudaAlloc {
    fn drop(&mut self) {
        self.release_spare();
    }
}

impl crate::kernels::DeviceAlloc for CudaAlloc {
    fn memory(&self) -> Memory {
        Memory::Device(self.ctx.ordinal() as u32)
    }
    fn alloc(&self, bytes: usize) -> Result<NonNull<u8>, String> {
        let p = match self.reuse(bytes) {
            Some(p) => p,
            None => {
                self.release_spare();
                let b = DeviceBlock::new(&self.ctx, bytes)?;
                // Owned by the caller from here: `free` returns it.
                let p = nn(b.ptr);
                std::mem::forget(b);
                p
            }
        };
        let now = self.live.fetch_add(bytes as u64, Relaxed) + bytes as u64;
        self.peak.fetch_max(now, Relaxed);
        // The driver asked at each new high-water mark only (a few times a run): read at a
        // step's end instead, it missed the activations freed by then. (Found by the CUDA
        // emulator: the kit's memory stage read 9 MiB for a 46 MiB peak.)
        if now > self.high.fetch_max(now, Relaxed) {
            if let Some(used) = in_use(&self.ctx) {
                self.driver_at_high.store(used, Relaxed);
            }
        }
        Ok(p)
    }
    unsafe fn free(&self, p: NonNull<u8>, bytes: usize) {
        self.live.fetch_sub(bytes as u64, Relaxed);
        // The ids the host noted there (`Kernels::host_ids`) go with the memory.
        super::backend::host_ids::forget(p.as_ptr() as u64, bytes as u64);
        let mut spare = self.spare.lock().unwrap_or_else(|e| e.into_inner());
        if spare.is_none() {
            *spare = Some((p.as_ptr() as u64, bytes));
            return;
        }
        drop(spare);
        let _ = self.ctx.bind_to_thread();
        let _w = OPS.sync(SyncSite::Alloc);
        let _ = result::free_sync(p.as_ptr() as u64);
    }
    fn peak(&self) -> Option<u64> {
        Some(self.peak.load(Relaxed))
    }
    fn reset_peak(&self) {
        self.peak.store(self.live.load(Relaxed), Relaxed);
    }
    unsafe fn upload(&self, dst: NonNull<u8>, src: &[u8]) {
        let _ = self.ctx.bind_to_thread();
        OPS.write();
        OPS.legacy();
        result::memcpy_htod_sync(dst.as_ptr() as u64, src)
            .unwrap_or_else(|e| panic!("copying {} bytes to the GPU: {e:?}", src.len()));
    }
    unsafe fn upload_queued(&self, dst: NonNull<u8>, src: &[u8]) {
        let _ = self.ctx.bind_to_thread();
        OPS.write();
        // SAFETY: the caller's (`dst` holds `src`'s bytes; `src` is pageable, staged now).
        unsafe {
            super::compute_stream::write_queued(&self.compute, dst.as_ptr() as u64, src, "upload")
        }
    }
    unsafe fn zero_queued(&self, p: NonNull<u8>, bytes: usize) {
        let _ = self.ctx.bind_to_thread();
        OPS.write();
        // SAFETY: the caller's (`p` holds `bytes`).
        unsafe {
            super::compute_stream::zero_queued(&self.compute, p.as_ptr() as u64, bytes, "zero")
        }
    }
    unsafe fn upload_ahead(&self, dst: NonNull<u8>, src: &[u8]) {
        let _ = self.ctx.bind_to_thread();
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        if ahead.is_none() {
            *ahead = Some(CopyStream::new(&self.ctx).unwrap_or_else(|e| panic!("{e}")));
        }
        let c = ahead.as_mut().expect("made above");
        OPS.copy();
        let compute = &self.compute;
        let n = src.len();
        let queued = c
            .issued
            .record(compute)
            .and_then(|()| c.stream.wait(&c.issued))
            .and_then(|()| {
                result::memcpy_htod_async(dst.as_ptr() as u64, src, c.stream.cu_stream())
            })
            .and_then(|()| c.landed.record(&c.stream));
        queued.unwrap_or_else(|e| panic!("copying {n} bytes to the GPU ahead: {e:?}"));
        c.unawaited = true;
    }
    fn copies_ahead(&self) -> bool {
        true
    }
    fn await_uploads(&self) {
        let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        let Some(c) = ahead.as_mut().filter(|c| c.unawaited) else {
            return;
        };
        let _ = self.ctx.bind_to_thread();
        self.compute
            .wait(&c.landed)
            .unwrap_or_else(|e| panic!("ordering the GPU's work after its copies: {e:?}"));
        c.unawaited = false;
    }
    fn settle_uploads(&self) {
        let ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = ahead.as_ref() {
            let _ = self.ctx.bind_to_thread();
            let _w = OPS.sync(SyncSite::StreamSync);
            c.stream
                .synchronize()
                .unwrap_or_else(|e| panic!("waiting for the GPU's copies: {e:?}"));
        }
    }
    unsafe fn download(&self, dst: &mut [u8], src: NonNull<u8>) {
        let _ = self.ctx.bind_to_thread();
        let n = dst.len();
        let _w = OPS.sync(SyncSite::StateDownload);
        OPS.legacy();
        result::memcpy_dtoh_sync(dst, src.as_ptr() as u64)
            .unwrap_or_else(|e| panic!("copying {n} bytes from the GPU: {e:?}"));
    }
    unsafe fn zero(&self, p: NonNull<u8>, bytes: usize) {
        let _ = self.ctx.bind_to_thread();
        OPS.write();
        OPS.legacy();
        result::memset_d8_sync(p.as_ptr() as u64, 0, bytes)
            .unwrap_or_else(|e| panic!("zeroing {bytes} bytes of GPU memory: {e:?}"));
    }
    fn alloc_pinned(&self, bytes: usize) -> Option<Result<NonNull<u8>, String>> {
        let bytes = bytes.max(1);
        let _ = self.ctx.bind_to_thread();
        // SAFETY: a fresh allocation of `bytes`, zeroed before anything reads it; flags 0:
        // page-locked for this context, the one that copies.
        let p = unsafe { result::malloc_host(bytes, 0) }
            .map_err(|e| format!("page-locked host memory of {bytes} bytes: {e:?}"))
            .map(|p| {
                // SAFETY: `bytes` writable bytes at `p`.
                unsafe { std::ptr::write_bytes(p.cast::<u8>(), 0, bytes) };
                nn(p as u64)
            });
        Some(p)
    }
    unsafe fn free_pinned(&self, p: NonNull<u8>, _: usize) {
        let _ = self.ctx.bind_to_thread();
        // An error at teardown has nowhere to go.
        let _ = result::free_host(p.as_ptr().cast());
    }
    fn keeps_regions(&self) -> bool {
        true
    }
    fn driver_used(&self) -> Option<u64> {
        let at_high = match self.driver_at_high.load(Relaxed) {
            0 => in_use(&self.ctx)?,
            used => used,
        };
        Some(at_high.saturating_sub(self.baseline))
    }
    fn ops(&self) -> Option<crate::kernels::DeviceOps> {
        Some(OPS.read())
    }
}
