//! The NCCL communicator (`--features cuda`, issue #33): the collectives and messages of the
//! [`Communicator`] trait on views of one GPU's memory, through NVIDIA's NCCL, which cudarc
//! loads at run time (`dynamic-loading`), so this builds without NCCL and a machine without it
//! runs the host communicators as before.
//!
//! - **Bootstrap**: rank 0 of an existing host communicator (threads or MPI) makes NCCL's
//!   unique id and broadcasts it to the group's ranks, which join the NCCL communicator with it
//!   (`ncclCommInitRank`), as llm.c shares its id through MPI. A sub-group is bootstrapped the
//!   same way over the host communicator's sub-group.
//! - **Streams**: NCCL runs on a communication stream of its own. Each call orders it after
//!   the work already on the compute stream (the calling thread's stream every kernel of the
//!   CUDA backend runs on: `compute_stream`) by an event, and the compute stream's next work after the
//!   collective by another: the host does not wait, and device work sees the result.
//! - **All-to-all** (even and uneven) is a group of sends and receives (`ncclGroupStart` …
//!   `ncclGroupEnd`), which NCCL runs as one operation, so no pair order is needed.
//! - The overlapped `*_start` collectives run on the host communicator the bootstrap came
//!   over, on host regions (a region of device memory is refused there, by its memory). A started send (`send_start`, a host
//!   buffer) is refused: its receiver would wait on NCCL.
//! - NCCL refuses two ranks on one GPU, so the GPU machine (one GPU) runs it at world size 1;
//!   ranks sharing a GPU use the host-staged communicator (`ferrotron_dist::Staged`).
//!
//! cudarc looks for NCCL as `libnccl.so` (and `.so.12`, …), while NCCL (PyTorch's
//! `nvidia-nccl` wheel, `nvidia/nccl/lib`, and Debian's `libnccl2`) installs `libnccl.so.2`:
//! a `libnccl.so` link to it in a directory on `LD_LIBRARY_PATH` lets cudarc find it
//! (`scripts/cuda_check.sh` makes one on the GPU machine).

use crate::communicator::{Memory, Pending, Region, Result, View, ViewMut};
use crate::device_collective::DeviceCollective;
use crate::device_p2p::DeviceP2p;
use crate::device_reduce::{DeviceReduce, Grads, Owned};
use crate::{watchdog, AsViewMut, CommError, Communicator};
use ferrotron_engine::kernels::cuda::cudarc::driver::{
    sys::CUevent_flags, CudaContext, CudaEvent, CudaStream,
};
use ferrotron_engine::kernels::cuda::cudarc::nccl::{result, sys};
use ferrotron_engine::model::tensor_parallel::TpOp;
use ferrotron_engine::model::DeviceOperands;
use ferrotron_plan::DType;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

const F32: sys::ncclDataType_t = sys::ncclDataType_t::ncclFloat32;
/// A pipeline message's bytes, whatever its elements.
const U8: sys::ncclDataType_t = sys::ncclDataType_t::ncclUint8;

/// Whether NCCL loads (cudarc's probe by name; nothing is created).
pub fn present() -> bool {
    // SAFETY: a dlopen probe, as cudarc does before its first call.
    unsafe { sys::is_culib_present() }
}

/// NCCL's version as `major * 10000 + minor * 100 + patch` (2.30.7: 23007).
pub fn version() -> std::result::Result<i32, String> {
    if !present() {
        return Err(MISSING.into());
    }
    result::get_nccl_version().map_err(|e| format!("{e:?}"))
}

const MISSING: &str = "NCCL not found: cudarc loads libnccl.so by name, and NCCL installs libnccl.so.2 (PyTorch: site-packages/nvidia/nccl/lib); put a libnccl.so link to it in a directory on LD_LIBRARY_PATH";

/// `what` failed with `e`, in words.
fn driver<E: std::fmt::Debug>(what: &str) -> impl FnOnce(E) -> String + '_ {
    move |e| format!("{what}: {e:?}")
}

/// A group of ranks, one GPU each, talking through NCCL.
pub struct Nccl {
    comm: sys::ncclComm_t,
    /// The host communicator of the same ranks: the bootstrap, the barrier, the overlapped
    /// collectives on host buffers, sub-groups.
    host: Box<dyn Communicator>,
    ctx: Arc<CudaContext>,
    /// NCCL's stream, and the compute stream it is ordered against.
    comm_stream: Arc<CudaStream>,
    compute: Arc<CudaStream>,
    /// Recorded on the compute stream before a call, on the communication stream after it.
    before: CudaEvent,
    after: CudaEvent,
    /// Recorded on the compute stream when context parallelism's ring block is ready.
    ring: CudaEvent,
    /// A pipeline edge's sends: recorded on the communication stream after each send from
    /// send buffer `j`, and whether one was.
    sent: Vec<(CudaEvent, bool)>,
    /// A pipeline edge's timing events on the compute stream: before and after each receive's
    /// wait, while a training step's work is timed (`timing`, from its start mark to the
    /// take); the stage's start and end marks. All made by `reserve`, before the first step.
    timed: Vec<CudaEvent>,
    waits: usize,
    timing: bool,
    marks: [Option<CudaEvent>; 2],
    marked: [bool; 2],
    aborted: AtomicBool,
}

// SAFETY: an NCCL communicator may be used from any thread, one at a time (the trait's rule:
// every call binds the context first); the handle is owned here and destroyed once.
unsafe impl Send for Nccl {}

impl Nccl {
    /// The NCCL communicator of `host`'s ranks, each on `ctx`'s GPU: a collective over `host`
    /// (every rank calls it). Fails on every rank, in one line, when NCCL is missing here.
    pub fn new(host: Box<dyn Communicator>, ctx: Arc<CudaContext>) -> Result<Nccl> {
        let (me, size) = (host.rank(), host.size());
        let fail = |host: &dyn Communicator, problem: String| {
            host.abort(&problem);
            CommError::Usage {
                rank: me,
                op: "nccl",
                problem,
            }
        };
        if !present() {
            return Err(fail(&*host, MISSING.into()));
        }
        // The 128-byte unique id, one byte per f32 (exact), from rank 0.
        let mut id = [0.0f32; 128];
        if me == 0 {
            let made = result::get_uniqueid()
                .map_err(|e| fail(&*host, format!("making NCCL's unique id: {e:?}")))?;
            for (f, &b) in id.iter_mut().zip(made.internal.iter()) {
                *f = b as u8 as f32;
            }
        }
        host.broadcast(id.view_mut(), 0)?;
        let mut unique = sys::ncclUniqueId { internal: [0; 128] };
        for (b, &f) in unique.internal.iter_mut().zip(id.iter()) {
            *b = f as u8 as std::ffi::c_char;
        }
        let setup = || -> std::result::Result<_, String> {
            ctx.bind_to_thread()
                .map_err(driver("binding the context"))?;
            let comm_stream = ctx.new_stream().map_err(driver("a stream for NCCL"))?;
            let flags = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
            let before = ctx.new_event(flags).map_err(driver("an event"))?;
            let after = ctx.new_event(flags).map_err(driver("an event"))?;
            let ring = ctx.new_event(flags).map_err(driver("an event"))?;
            let mut comm = std::mem::MaybeUninit::uninit();
            // Joining waits for every rank of the group.
            let _w = watchdog::watch_on_gpu("joining the NCCL communicator");
            // SAFETY: the context is bound; `comm` is written by a successful init.
            let comm = unsafe {
                result::comm_init_rank(comm.as_mut_ptr(), size as i32, unique, me as i32)
                    .map_err(driver("joining the NCCL communicator"))?;
                comm.assume_init()
            };
            Ok((comm, comm_stream, [before, after, ring]))
        };
        let (comm, comm_stream, [before, after, ring]) = setup().map_err(|e| fail(&*host, e))?;
        Ok(Nccl {
            comm,
            host,
            compute: ferrotron_engine::kernels::cuda::compute_stream::compute_stream(&ctx),
            ctx,
            comm_stream,
            before,
            after,
            ring,
            sent: Vec::new(),
            timed: Vec::new(),
            waits: 0,
            timing: false,
            marks: [None, None],
            marked: [false; 2],
            aborted: AtomicBool::new(false),
        })
    }

    fn usage(&self, op: &'static str, problem: String) -> CommError {
        CommError::usage(self.rank(), op, problem)
    }

    /// `mem` is this GPU's memory, else a usage error naming it.
    fn check(&self, mem: Memory, op: &'static str) -> Result<()> {
        let gpu = Memory::Device(self.ctx.ordinal() as u32);
        if mem == gpu {
            Ok(())
        } else {
            Err(self.usage(
                op,
                format!("the buffer is in {mem}, and this NCCL communicator runs on {gpu}"),
            ))
        }
    }

    fn failed(&self, op: &'static str, e: impl std::fmt::Debug) -> CommError {
        CommError::PeerFailed {
            rank: self.rank(),
            cause: format!("{op}: NCCL: {e:?}"),
        }
    }

    /// Runs `enqueue` (NCCL calls on the communication stream) ordered after the compute
    /// stream's work, and the compute stream's next work after it.
    fn ordered(
        &self,
        op: &'static str,
        enqueue: impl FnOnce(sys::cudaStream_t) -> std::result::Result<(), result::NcclError>,
    ) -> Result<()> {
        self.behind_compute(op, enqueue)?;
        self.compute_waits(op)
    }

    /// Runs `enqueue` on the communication stream after the compute stream's work so far;
    /// the compute stream goes on meanwhile.
    fn behind_compute(
        &self,
        op: &'static str,
        enqueue: impl FnOnce(sys::cudaStream_t) -> std::result::Result<(), result::NcclError>,
    ) -> Result<()> {
        if self.aborted.load(Ordering::Relaxed) {
            return Err(self.failed(op, "the communicator was aborted"));
        }
        self.ctx.bind_to_thread().map_err(|e| self.failed(op, e))?;
        // NCCL's calls return once queued; a wait for a peer shows at the next host
        // synchronisation, which the GPU's backend arms. Armed here too, for the calls that
        // wait (the emulator's, a group's end under some NCCL versions).
        let _w = watchdog::watch_on_gpu(op);
        self.before
            .record(&self.compute)
            .and_then(|()| self.comm_stream.wait(&self.before))
            .map_err(|e| self.failed(op, e))?;
        enqueue(self.comm_stream.cu_stream() as sys::cudaStream_t)
            .map_err(|e| self.failed(op, e))?;
        self.after
            .record(&self.comm_stream)
            .map_err(|e| self.failed(op, e))
    }

    /// The compute stream's next work runs after everything on the communication stream.
    fn compute_waits(&self, op: &'static str) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| self.failed(op, e))?;
        self.compute
            .wait(&self.after)
            .map_err(|e| self.failed(op, e))
    }

    /// `op`'s NCCL call on `stream`: `count` as NCCL counts (every element of an all-reduce,
    /// one rank's block of an all-gather's output and of a reduce-scatter's input).
    ///
    /// # Safety
    /// `send` and `recv` address the elements `op` reads and writes, of `dtype`, in this GPU's
    /// memory, left alone until the call has run (`send` may be `recv` for an all-reduce).
    unsafe fn call(
        &self,
        op: TpOp,
        (send, recv): (*const u8, *mut u8),
        count: usize,
        dtype: sys::ncclDataType_t,
        stream: sys::cudaStream_t,
    ) -> std::result::Result<(), result::NcclError> {
        let (s, r, comm, sum) = (
            send.cast(),
            recv.cast(),
            self.comm,
            sys::ncclRedOp_t::ncclSum,
        );
        match op {
            TpOp::AllReduce => result::all_reduce(s, r, count, dtype, sum, comm, stream),
            TpOp::AllGather => result::all_gather(s, r, count, dtype, comm, stream),
            TpOp::ReduceScatter => result::reduce_scatter(s, r, count, dtype, sum, comm, stream),
        }
        .map(drop)
    }

    /// Sends and receives as one NCCL group: `pairs` of (peer, send offset, send count, receive
    /// offset, receive count), in elements of `send` and `recv`.
    fn exchange(
        &self,
        op: &'static str,
        send: View<'_, f32>,
        mut recv: ViewMut<'_, f32>,
        pairs: impl Iterator<Item = (usize, usize, usize, usize, usize)>,
    ) -> Result<()> {
        let (s, r) = (send.as_ptr(), recv.as_mut_ptr());
        let comm = self.comm;
        self.ordered(op, |stream| {
            result::group_start()?;
            for (peer, so, sn, ro, rn) in pairs {
                // SAFETY: the offsets and counts lie within the views (checked by the caller),
                // which are this GPU's memory and stay borrowed for the call; the compute
                // stream waits for the group before reusing them.
                unsafe {
                    if sn > 0 {
                        result::send(s.add(so).cast(), sn, F32, peer as i32, comm, stream)?;
                    }
                    if rn > 0 {
                        result::recv(r.add(ro).cast(), rn, F32, peer as i32, comm, stream)?;
                    }
                }
            }
            result::group_end().map(drop)
        })
    }
}

/// Data parallelism's in-place gradient sums (`device_reduce.rs`): each started on the
/// communication stream behind the backward's kernels so far, all landed before the optimizer.
impl DeviceReduce for Nccl {
    fn start(&mut self, mut grads: Grads<'_>) -> Result<()> {
        const OP: &str = "data-parallel gradient sum";
        let Some(dtype) = nccl_type(grads.dtype) else {
            return Err(self.usage(OP, format!("{:?} gradients", grads.dtype)));
        };
        let (p, n, mem) = grads.raw();
        self.check(mem, OP)?;
        // SAFETY: `n` elements of `dtype` in this GPU's memory: gradients the backward has
        // finished with, which nothing touches before `land` orders the compute stream after.
        self.behind_compute(OP, |stream| unsafe {
            self.call(TpOp::AllReduce, (p.cast_const(), p), n, dtype, stream)
        })
    }

    fn start_owned(&mut self, parts: &mut dyn Iterator<Item = Owned<'_>>) -> Result<()> {
        self.owned(true, parts)
    }

    fn land(&mut self) -> Result<()> {
        self.compute_waits("data-parallel gradient sum")
    }

    fn broadcast_owned(&mut self, parts: &mut dyn Iterator<Item = Owned<'_>>) -> Result<()> {
        self.owned(false, parts)
    }
}

impl Nccl {
    /// ZeRO's segments, each with its owner, as one NCCL group on the communication stream
    /// behind the compute stream's work so far: with `sum`, each reduced into its owner's
    /// copy (in place, or into its shard), else each broadcast from its owner's copy (in
    /// place, or from its shard).
    fn owned(&self, sum: bool, parts: &mut dyn Iterator<Item = Owned<'_>>) -> Result<()> {
        let op = if sum {
            "ZeRO gradient sum"
        } else {
            "ZeRO weights' gather"
        };
        let (size, comm) = (self.size(), self.comm);
        let mut bad = None;
        self.behind_compute(op, |stream| {
            result::group_start()?;
            for Owned {
                part: mut g,
                owner: root,
                into,
            } in parts
            {
                let (p, n, mem) = g.raw();
                // The owner's sum lands in `into` where given (its shard), else in place; its
                // broadcast comes from there.
                let shard = match into {
                    Some(mut i) if root == self.rank() && i.bytes() == g.bytes() => i.raw().0,
                    _ => p,
                };
                let (s, r) = if sum { (p, shard) } else { (shard, p) };
                let checked = self.check(mem, op).and_then(|()| match nccl_type(g.dtype) {
                    Some(t) if root < size => Ok(t),
                    _ => Err(self.usage(
                        op,
                        format!("{:?} elements owned by rank {root} of {size}", g.dtype),
                    )),
                });
                let dtype = match checked {
                    Ok(t) => t,
                    Err(e) => {
                        bad.get_or_insert(e);
                        continue;
                    }
                };
                let (s, r) = (s.cast_const().cast(), r.cast());
                // SAFETY: `n` elements of `dtype` of this GPU's memory, left alone by the
                // device's work until the compute stream waits for the group (`land`, or the
                // broadcast's own wait).
                unsafe {
                    match sum {
                        true => result::reduce(
                            s,
                            r,
                            n,
                            dtype,
                            sys::ncclRedOp_t::ncclSum,
                            root as i32,
                            comm,
                            stream,
                        )?,
                        false => result::broadcast(s, r, n, dtype, root as i32, comm, stream)?,
                    };
                }
            }
            result::group_end().map(drop)
        })?;
        bad.map_or(Ok(()), Err)
    }
}

/// NCCL's type of `d`, where this communicator sums it (f32, bf16).
fn nccl_type(d: DType) -> Option<sys::ncclDataType_t> {
    match d {
        DType::F32 => Some(F32),
        DType::Bf16 => Some(sys::ncclDataType_t::ncclBfloat16),
        _ => None,
    }
}

/// The model groups' collectives on the activations where they lie
/// (`device_collective.rs`), each in the compute stream's order.
impl DeviceCollective for Nccl {
    fn takes(&self, dtype: DType) -> bool {
        nccl_type(dtype).is_some()
    }

    fn run(&self, op: TpOp, x: DeviceOperands) -> Result<()> {
        const OP: &str = "tensor-parallel collective";
        let Some(dtype) = nccl_type(x.dtype) else {
            return Err(self.usage(OP, format!("{:?} elements", x.dtype)));
        };
        self.check(x.memory, OP)?;
        // SAFETY: the model's views of this GPU's memory (`DeviceOperands::of`), borrowed by
        // the caller for the call; the compute stream waits for it before its next work.
        self.ordered(OP, |stream| unsafe {
            self.call(op, (x.send, x.recv), x.count, dtype, stream)
        })
    }

    fn all_to_all_v(
        &self,
        send: View<'_, f32>,
        send_counts: &[usize],
        recv: ViewMut<'_, f32>,
        recv_counts: &[usize],
    ) -> Result<()> {
        // The communicator's own (one group of sends and receives); no host message buffer.
        let mut none = Region::default();
        Communicator::all_to_all_v(self, send, send_counts, recv, recv_counts, &mut none)
    }

    fn ring_ready(&self) -> Result<()> {
        const OP: &str = "context-parallel ring";
        self.ctx.bind_to_thread().map_err(|e| self.failed(OP, e))?;
        self.ring
            .record(&self.compute)
            .map_err(|e| self.failed(OP, e))
    }

    fn ring_pass(&self, send: *const f32, recv: *mut f32, n: usize) -> Result<()> {
        const OP: &str = "context-parallel ring";
        if self.aborted.load(Ordering::Relaxed) {
            return Err(self.failed(OP, "the communicator was aborted"));
        }
        let (me, size, comm) = (self.rank(), self.size(), self.comm);
        let (next, prev) = ((me + 1) % size, (me + size - 1) % size);
        self.ctx.bind_to_thread().map_err(|e| self.failed(OP, e))?;
        // After the block was written, beside the compute issued since.
        self.comm_stream
            .wait(&self.ring)
            .map_err(|e| self.failed(OP, e))?;
        let stream = self.comm_stream.cu_stream() as sys::cudaStream_t;
        let _w = watchdog::watch_on_gpu(OP);
        // SAFETY: `n` f32 each of this GPU's memory, left alone by the device's work until the
        // compute stream has waited for the group (the caller's contract).
        let group = || unsafe {
            result::group_start()?;
            result::send(send.cast(), n, F32, next as i32, comm, stream)?;
            result::recv(recv.cast(), n, F32, prev as i32, comm, stream)?;
            result::group_end().map(drop)
        };
        group().map_err(|e| self.failed(OP, e))?;
        self.after
            .record(&self.comm_stream)
            .map_err(|e| self.failed(OP, e))?;
        self.compute_waits(OP)
    }
}

/// One direction of a pipeline edge: this two-rank communicator's stream carries its messages
/// to (or from) the other rank, in bytes (NCCL's `ncclUint8`: no arithmetic, any element type).
impl DeviceP2p for Nccl {
    fn reserve(&mut self, slots: usize, receives: usize) -> Result<()> {
        const OP: &str = "pipeline events";
        self.ctx.bind_to_thread().map_err(|e| self.failed(OP, e))?;
        let made = |timed: bool| {
            let flags = (!timed).then_some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
            self.ctx.new_event(flags).map_err(|e| self.failed(OP, e))
        };
        let sent = (0..slots).map(|_| made(false).map(|e| (e, false)));
        let sent = sent.collect::<Result<Vec<_>>>()?;
        let timed = (0..2 * receives)
            .map(|_| made(true))
            .collect::<Result<Vec<_>>>()?;
        let marks = [Some(made(true)?), Some(made(true)?)];
        (self.sent, self.timed, self.marks) = (sent, timed, marks);
        Ok(())
    }

    fn send_via(&mut self, src: *const u8, via: *mut u8, slot: usize, bytes: usize) -> Result<()> {
        const OP: &str = "pipeline send";
        if slot >= self.sent.len() {
            let problem = format!("send buffer {slot} of {} reserved", self.sent.len());
            return Err(self.usage(OP, problem));
        }
        let (peer, comm) = (1 - self.rank(), self.comm);
        self.ctx.bind_to_thread().map_err(|e| self.failed(OP, e))?;
        // The buffer's last message has gone before the copy overwrites it.
        if let (e, true) = &self.sent[slot] {
            self.compute.wait(e).map_err(|e| self.failed(OP, e))?;
        }
        // SAFETY: `bytes` of this GPU's memory each (the caller's views, the planned buffer).
        unsafe {
            ferrotron_engine::kernels::cuda::cudarc::driver::result::memcpy_dtod_async(
                via as u64,
                src as u64,
                bytes,
                self.compute.cu_stream(),
            )
        }
        .map_err(|e| self.failed(OP, e))?;
        // SAFETY: `via` holds `bytes` until this slot's next send waits for the event below.
        self.behind_compute(OP, |stream| unsafe {
            result::send(
                via.cast_const().cast(),
                bytes,
                U8,
                peer as i32,
                comm,
                stream,
            )
            .map(drop)
        })?;
        self.sent[slot].1 = true;
        let recorded = self.sent[slot].0.record(&self.comm_stream);
        recorded.map_err(|e| self.failed(OP, e))
    }

    fn recv_into(&mut self, dst: *mut u8, bytes: usize) -> Result<()> {
        const OP: &str = "pipeline receive";
        let (peer, comm) = (1 - self.rank(), self.comm);
        // The compute stream's wait, timed from before the receive is issued (nothing runs on
        // the compute stream between the two events but the wait); a step's receives beyond
        // the reserved ones (none in a training step's program) are not timed.
        let at = 2 * self.waits;
        let timed = self.timing && at + 2 <= self.timed.len();
        let record = |s: &Self, i: usize| match timed {
            true => s.timed[i].record(&s.compute).map_err(|e| s.failed(OP, e)),
            false => Ok(()),
        };
        self.ctx.bind_to_thread().map_err(|e| self.failed(OP, e))?;
        record(self, at)?;
        // SAFETY: `bytes` of this GPU's memory, which the compute stream reads only after it.
        self.ordered(OP, |stream| unsafe {
            result::recv(dst.cast(), bytes, U8, peer as i32, comm, stream).map(drop)
        })?;
        record(self, at + 1)?;
        self.waits += timed as usize;
        Ok(())
    }

    fn settle(&mut self) -> Result<()> {
        const OP: &str = "pipeline send";
        self.ctx.bind_to_thread().map_err(|e| self.failed(OP, e))?;
        for (e, _) in self.sent.iter().filter(|s| s.1) {
            self.compute.wait(e).map_err(|e| self.failed(OP, e))?;
        }
        Ok(())
    }

    fn mark(&mut self, end: bool) -> Result<()> {
        const OP: &str = "pipeline bubble";
        self.ctx.bind_to_thread().map_err(|e| self.failed(OP, e))?;
        let Some(e) = &self.marks[end as usize] else {
            return Err(self.usage(OP, "no events reserved".into()));
        };
        e.record(&self.compute).map_err(|e| self.failed(OP, e))?;
        self.marked[end as usize] = true;
        // A training step's work starts: its receives are timed until the take.
        if !end {
            (self.waits, self.timing) = (0, true);
        }
        Ok(())
    }

    fn take_times(&mut self) -> Result<(f64, f64)> {
        const OP: &str = "pipeline bubble";
        let secs = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map(|ms| ms as f64 / 1e3);
        let mut waited = 0.0;
        for pair in self.timed[..2 * self.waits].chunks(2) {
            waited += secs(&pair[0], &pair[1]).map_err(|e| self.failed(OP, e))?;
        }
        (self.waits, self.timing) = (0, false);
        let span = match (&self.marks, self.marked) {
            ([Some(a), Some(b)], [true, true]) => secs(a, b).map_err(|e| self.failed(OP, e))?,
            _ => 0.0,
        };
        self.marked = [false; 2];
        Ok((waited, span))
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        if !self.aborted.swap(true, Ordering::Relaxed) {
            // SAFETY: made in `new`, destroyed once; nothing to report at teardown.
            unsafe {
                let _ = self.ctx.bind_to_thread();
                let _ = self.comm_stream.synchronize();
                let _ = result::comm_destroy(self.comm);
            }
        }
    }
}

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        self.host.rank()
    }

    fn size(&self) -> usize {
        self.host.size()
    }

    fn all_reduce_sum(&self, mut buf: ViewMut<'_, f32>) -> Result<()> {
        self.check(buf.memory(), "all_reduce_sum")?;
        let (p, n) = (buf.as_mut_ptr().cast::<u8>(), buf.len());
        // SAFETY: in place on `n` elements of this GPU's memory, borrowed until the compute
        // stream has waited for the sum.
        self.ordered("all_reduce_sum", |stream| unsafe {
            self.call(TpOp::AllReduce, (p.cast_const(), p), n, F32, stream)
        })
    }

    fn reduce_scatter_sum(&self, send: View<'_, f32>, mut recv: ViewMut<'_, f32>) -> Result<()> {
        const OP: &str = "reduce_scatter_sum";
        self.check(send.memory(), OP)?;
        self.check(recv.memory(), OP)?;
        let m = recv.len();
        if send.len() != self.size() * m {
            return Err(self.usage(
                OP,
                format!(
                    "send has {} elements, expected size {} × recv {m}",
                    send.len(),
                    self.size()
                ),
            ));
        }
        let io = (send.as_ptr().cast(), recv.as_mut_ptr().cast());
        // SAFETY: `send` holds size × m elements, `recv` m, both this GPU's memory.
        self.ordered(OP, |stream| unsafe {
            self.call(TpOp::ReduceScatter, io, m, F32, stream)
        })
    }

    fn all_gather(&self, send: View<'_, f32>, mut recv: ViewMut<'_, f32>) -> Result<()> {
        const OP: &str = "all_gather";
        self.check(send.memory(), OP)?;
        self.check(recv.memory(), OP)?;
        let m = send.len();
        if recv.len() != self.size() * m {
            return Err(self.usage(
                OP,
                format!("recv has {} elements, expected size × {m}", recv.len()),
            ));
        }
        let io = (send.as_ptr().cast(), recv.as_mut_ptr().cast());
        // SAFETY: `send` holds m elements, `recv` size × m, both this GPU's memory.
        self.ordered(OP, |stream| unsafe {
            self.call(TpOp::AllGather, io, m, F32, stream)
        })
    }

    fn broadcast(&self, mut buf: ViewMut<'_, f32>, root: usize) -> Result<()> {
        self.check(buf.memory(), "broadcast")?;
        if root >= self.size() {
            return Err(self.usage(
                "broadcast",
                format!("root {root} is not in a group of {}", self.size()),
            ));
        }
        let (p, n, comm) = (buf.as_mut_ptr(), buf.len(), self.comm);
        self.ordered("broadcast", |stream| {
            // SAFETY: in place on `n` elements of this GPU's memory.
            unsafe {
                result::broadcast(
                    p.cast_const().cast(),
                    p.cast(),
                    n,
                    F32,
                    root as i32,
                    comm,
                    stream,
                )
            }
            .map(drop)
        })
    }

    fn all_to_all(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        const OP: &str = "all_to_all";
        self.check(send.memory(), OP)?;
        self.check(recv.memory(), OP)?;
        let size = self.size();
        if !send.len().is_multiple_of(size) || recv.len() != send.len() {
            return Err(self.usage(
                OP,
                format!(
                    "send {} and recv {} must be equal and divisible by {size}",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        let b = send.len() / size;
        self.exchange(OP, send, recv, (0..size).map(|j| (j, j * b, b, j * b, b)))
    }

    fn all_to_all_v(
        &self,
        send: View<'_, f32>,
        send_counts: &[usize],
        recv: ViewMut<'_, f32>,
        recv_counts: &[usize],
        _message: &mut Region<f32>,
    ) -> Result<()> {
        const OP: &str = "all_to_all_v";
        self.check(send.memory(), OP)?;
        self.check(recv.memory(), OP)?;
        let (me, size) = (self.rank(), self.size());
        let (s, r) = (
            send_counts.iter().sum::<usize>(),
            recv_counts.iter().sum::<usize>(),
        );
        if send_counts.len() != size || recv_counts.len() != size {
            return Err(self.usage(
                OP,
                format!(
                    "{} send and {} receive counts for a group of {size}",
                    send_counts.len(),
                    recv_counts.len()
                ),
            ));
        }
        if s > send.len() || r > recv.len() {
            return Err(self.usage(
                OP,
                format!(
                    "counts of {s} to send and {r} to receive exceed the buffers ({}, {})",
                    send.len(),
                    recv.len()
                ),
            ));
        }
        if send_counts[me] != recv_counts[me] {
            return Err(self.usage(
                OP,
                format!(
                    "this rank sends itself {} elements but expects {}",
                    send_counts[me], recv_counts[me]
                ),
            ));
        }
        // Each peer's block offsets as running sums: nothing allocated (the experts' exchanges
        // run this every layer).
        let counts = send_counts.iter().zip(recv_counts).enumerate();
        let pairs = counts.scan((0, 0), |(so, ro), (j, (&sn, &rn))| {
            let pair = (j, *so, sn, *ro, rn);
            (*so, *ro) = (*so + sn, *ro + rn);
            Some(pair)
        });
        self.exchange(OP, send, recv, pairs)
    }

    /// To another rank: NCCL sends to this rank only inside a group (the all-to-all), where
    /// the matching receive is enqueued with it; alone it would wait forever.
    fn send(&self, buf: View<'_, f32>, dst: usize, _tag: u32) -> Result<()> {
        self.check(buf.memory(), "send")?;
        self.peer(dst, "send", "destination")?;
        let (p, n, comm) = (buf.as_ptr(), buf.len(), self.comm);
        self.ordered("send", |stream| {
            // SAFETY: `n` elements of this GPU's memory.
            unsafe { result::send(p.cast(), n, F32, dst as i32, comm, stream) }.map(drop)
        })
    }

    fn send_start(&self, buf: Region<f32>, _dst: usize, _tag: u32) -> Pending {
        let e = self.usage(
            "send_start",
            format!(
                "a started send of {} host elements: NCCL sends device views (send), which its receiver waits on",
                buf.len()
            ),
        );
        Pending::refused(e)
    }

    /// NCCL matches messages by order between two ranks, not by tag.
    fn recv(&self, mut buf: ViewMut<'_, f32>, src: usize, _tag: u32) -> Result<()> {
        self.check(buf.memory(), "recv")?;
        self.peer(src, "recv", "source")?;
        let (p, n, comm) = (buf.as_mut_ptr(), buf.len(), self.comm);
        self.ordered("recv", |stream| {
            // SAFETY: `n` elements of this GPU's memory.
            unsafe { result::recv(p.cast(), n, F32, src as i32, comm, stream) }.map(drop)
        })
    }

    /// Every rank's NCCL work so far finished, then the host group's barrier.
    fn barrier(&self) -> Result<()> {
        let _w = watchdog::watch_on_gpu("barrier");
        self.ctx
            .bind_to_thread()
            .and_then(|()| self.comm_stream.synchronize())
            .map_err(|e| self.failed("barrier", e))?;
        self.host.barrier()
    }

    super::host_side::overlapped_on_host!(host);

    /// The host group learns of the failure; NCCL's work in flight is aborted, so a rank
    /// waiting in a collective returns.
    fn abort(&self, cause: &str) {
        self.host.abort(cause);
        if !self.aborted.swap(true, Ordering::Relaxed) {
            // SAFETY: the communicator made in `new`, aborted once (and then never destroyed).
            unsafe {
                let _ = self.ctx.bind_to_thread();
                let _ = result::comm_abort(self.comm);
            }
        }
    }

    fn split_group(&self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        let host = self.host.split_group(members)?;
        Ok(Box::new(Nccl::new(host, self.ctx.clone())?))
    }

    fn split_named(&self, members: &[usize], name: &str) -> Result<Box<dyn Communicator>> {
        let host = self.host.split_named(members, name)?;
        Ok(Box::new(Nccl::new(host, self.ctx.clone())?))
    }
}

impl Nccl {
    /// `peer` is another rank of the group (see [`Nccl::send`]).
    fn peer(&self, peer: usize, op: &'static str, what: &str) -> Result<()> {
        if peer >= self.size() {
            Err(self.usage(
                op,
                format!("{what} {peer} is not in a group of {}", self.size()),
            ))
        } else if peer == self.rank() {
            Err(self.usage(
                op,
                format!(
                    "{what} {peer} is this rank: NCCL messages itself only within an all-to-all"
                ),
            ))
        } else {
            Ok(())
        }
    }
}
