//! The MPI backend (feature `mpi`): one process per rank, launched by `mpirun`. Each call is
//! the matching MPI call, through a small C shim (`csrc/ft_mpi.c`, compiled with `mpicc`'s
//! flags) so that nothing here depends on an implementation's handle types or on bindgen.
//!
//! Semantics, against the threads backend's:
//! - Results are the same collectives' results. Sums: MPI fixes neither the order nor the
//!   grouping of a reduction; Open MPI picks an algorithm from the group size and the message
//!   size, so for a fixed world size and buffer length a run is reproducible and every rank
//!   gets the same bits (what the tests check), but the bits may differ from the rank-order
//!   sum of the threads backend by rounding (within 1e-6 relative for well-conditioned sums).
//! - `send` never blocks (as the threads backend's mailboxes): it starts an `MPI_Isend` of a
//!   copy and completes it later (on a later `send`, or when the communicator is dropped,
//!   which waits for the receiver to take every message sent).
//! - `recv` of a message whose length is not `buf.len()` consumes the message and returns
//!   [`CommError::Usage`], as the threads backend does.
//! - Length mismatches *between ranks* in a collective are not checked (that would cost a
//!   round trip per call): MPI reports a truncation, which aborts the job, or the result is
//!   undefined. Argument checks that need no communication return `Usage` as in threads.
//! - `all_reduce_start` is an `MPI_Iallreduce` in place on the buffer the [`Pending`] owns.
//!   Open MPI has no progress thread by default: the reduction advances inside MPI calls
//!   (any later collective, `Pending::is_done`, `Pending::wait`), so a caller overlapping it
//!   with compute should poll `is_done` now and then. Dropping a `Pending` waits for it.
//! - Faults: MPI's default error handler aborts the job on any MPI error; `abort` and a panic
//!   (through the communicator's `Drop`) call `MPI_Abort` after printing
//!   `rank R failed: cause` on stderr, and `mpirun` takes every rank down and exits non-zero.
//!   A rank that dies (signal, exit without `MPI_Finalize`) is caught by `mpirun` likewise.
//!   A panic on a thread that holds no communicator aborts nothing: whoever joins that thread
//!   must call `abort`. A rank ends normally by calling [`finalize`] (every rank, after
//!   dropping its communicators); a process that exits without it (an error returned from
//!   `main`, `std::process::exit`) calls `MPI_Abort` at exit, naming its rank — finalising
//!   there would wait for ranks that wait for it, and hang the job.
//!   There is no [`CommError::Timeout`]: a rank that hangs alive is caught by the watchdog
//!   (`crate::watchdog`, `--comm-timeout`), which calls [`abort_job`] from its own thread.
//! - Threads: MPI is initialised with `MPI_THREAD_MULTIPLE` when the library offers it
//!   (Debian's Open MPI does), at least `MPI_THREAD_SERIALIZED`. A communicator is `Send` and
//!   not `Sync`: it can move to another thread, but one communicator is never used by two
//!   threads at once.

use crate::communicator::{
    host, host_mut, host_region, CommError, Communicator, Completion, Pending, Region, Result,
    View, ViewMut,
};
use crate::shapes;
use std::cell::{Cell, RefCell};
use std::ffi::{c_char, c_int, c_void, CString};

mod ffi {
    use std::ffi::{c_char, c_int, c_void};
    extern "C" {
        pub fn ft_init(provided: *mut c_int) -> c_int;
        pub fn ft_finalize() -> c_int;
        pub fn ft_thread_serialized() -> c_int;
        pub fn ft_thread_multiple() -> c_int;
        pub fn ft_world() -> *mut c_void;
        pub fn ft_rank(c: *mut c_void, r: *mut c_int) -> c_int;
        pub fn ft_size(c: *mut c_void, s: *mut c_int) -> c_int;
        pub fn ft_tag_ub(ub: *mut c_int) -> c_int;
        pub fn ft_create_group(
            parent: *mut c_void,
            members: *const c_int,
            n: c_int,
            tag: c_int,
            out: *mut *mut c_void,
        ) -> c_int;
        pub fn ft_comm_free(c: *mut c_void);
        pub fn ft_allreduce(c: *mut c_void, buf: *mut f32, n: c_int) -> c_int;
        pub fn ft_reduce_scatter(
            c: *mut c_void,
            send: *const f32,
            recv: *mut f32,
            block: c_int,
        ) -> c_int;
        pub fn ft_allgather(c: *mut c_void, send: *const f32, recv: *mut f32, n: c_int) -> c_int;
        pub fn ft_bcast(c: *mut c_void, buf: *mut f32, n: c_int, root: c_int) -> c_int;
        pub fn ft_alltoall(c: *mut c_void, send: *const f32, recv: *mut f32, block: c_int)
            -> c_int;
        pub fn ft_barrier(c: *mut c_void) -> c_int;
        pub fn ft_iallreduce(
            c: *mut c_void,
            buf: *mut f32,
            n: c_int,
            req: *mut *mut c_void,
        ) -> c_int;
        pub fn ft_ireduce_scatter(
            c: *mut c_void,
            buf: *mut f32,
            block: c_int,
            req: *mut *mut c_void,
        ) -> c_int;
        pub fn ft_iallgather(
            c: *mut c_void,
            buf: *mut f32,
            block: c_int,
            req: *mut *mut c_void,
        ) -> c_int;
        pub fn ft_isend(
            c: *mut c_void,
            buf: *const f32,
            n: c_int,
            dst: c_int,
            tag: c_int,
            req: *mut *mut c_void,
        ) -> c_int;
        pub fn ft_wait(req: *mut c_void) -> c_int;
        pub fn ft_test(req: *mut c_void, done: *mut c_int) -> c_int;
        pub fn ft_recv(
            c: *mut c_void,
            buf: *mut f32,
            n: c_int,
            src: c_int,
            tag: c_int,
            got: *mut c_int,
        ) -> c_int;
        pub fn ft_abort(msg: *const c_char, code: c_int);
    }
}

pub use crate::launch::launched_by_mpirun;

/// Ends MPI for this process (`MPI_Finalize`): every rank calls it at the end of a successful
/// run, after dropping its communicators (which completes their sends). Without it, the exit
/// takes the job down as a failure. Later calls do nothing.
pub fn finalize() -> Result<()> {
    // SAFETY: a plain call; the shim does nothing if MPI is not running.
    check(unsafe { ffi::ft_finalize() }, 0, "finalize")
}

/// `MPI_Abort` on the world after printing `msg`: every rank of the job goes down (the
/// watchdog's expiry under MPI: callable from any thread at `MPI_THREAD_MULTIPLE`).
pub fn abort_job(msg: &str) -> ! {
    let msg = CString::new(msg.replace('\0', " ")).expect("no NUL left");
    // SAFETY: a valid C string; ft_abort does not return.
    unsafe { ffi::ft_abort(msg.as_ptr() as *const c_char, 1) };
    unreachable!("MPI_Abort returned")
}

/// A rank's view of one group (the world or a sub-group) as an MPI communicator.
pub struct MpiComm {
    /// The shim's boxed `MPI_Comm`.
    comm: *mut c_void,
    world_rank: usize,
    rank: usize,
    size: usize,
    tag_ub: u32,
    /// Sends started and not yet known complete, with the copies they read from.
    sends: RefCell<Vec<(*mut c_void, Vec<f32>)>>,
    _not_sync: Cell<()>,
}

// SAFETY: MPI runs at MPI_THREAD_SERIALIZED or better (checked in `world`), so any thread
// may make MPI calls; the raw handles are owned by this value, and it is not `Sync`, so one
// communicator is used by one thread at a time.
unsafe impl Send for MpiComm {}

fn check(rc: c_int, rank: usize, op: &'static str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(CommError::Usage {
            rank,
            op,
            problem: format!("MPI error code {rc}"),
        })
    }
}

impl MpiComm {
    /// Initialises MPI (once per process; see [`finalize`]) and returns this process's
    /// world communicator.
    pub fn world() -> Result<MpiComm> {
        let mut provided: c_int = 0;
        // SAFETY: plain calls into the shim with valid out-pointers.
        unsafe {
            check(ffi::ft_init(&mut provided), 0, "init")?;
            if provided < ffi::ft_thread_serialized() {
                return Err(CommError::Usage {
                    rank: 0,
                    op: "init",
                    problem: format!(
                        "the MPI library gives thread level {provided}, below \
                         MPI_THREAD_SERIALIZED"
                    ),
                });
            }
            let mut ub: c_int = 0;
            check(ffi::ft_tag_ub(&mut ub), 0, "init")?;
            let comm = Self::wrap(ffi::ft_world(), None, ub.max(0) as u32)?;
            Ok(comm)
        }
    }

    /// Whether MPI runs at `MPI_THREAD_MULTIPLE` (different communicators may then be used by
    /// different threads at the same time).
    pub fn thread_multiple() -> bool {
        let mut provided: c_int = 0;
        // SAFETY: MPI is initialised by `world` before any communicator exists.
        unsafe { ffi::ft_init(&mut provided) == 0 && provided >= ffi::ft_thread_multiple() }
    }

    /// # Safety
    /// `comm` is a boxed communicator from the shim, owned by the result.
    unsafe fn wrap(comm: *mut c_void, world_rank: Option<usize>, tag_ub: u32) -> Result<Self> {
        let (mut r, mut s): (c_int, c_int) = (0, 0);
        check(ffi::ft_rank(comm, &mut r), 0, "init")?;
        check(ffi::ft_size(comm, &mut s), r as usize, "init")?;
        Ok(MpiComm {
            comm,
            world_rank: world_rank.unwrap_or(r as usize),
            rank: r as usize,
            size: s as usize,
            tag_ub,
            sends: RefCell::new(Vec::new()),
            _not_sync: Cell::new(()),
        })
    }

    /// This rank's rank in the world.
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }

    fn usage(&self, op: &'static str, problem: String) -> CommError {
        CommError::usage(self.world_rank, op, problem)
    }

    fn count(&self, op: &'static str, n: usize) -> Result<c_int> {
        c_int::try_from(n).map_err(|_| self.usage(op, format!("{n} elements is over MPI's int")))
    }

    fn check(&self, rc: c_int, op: &'static str) -> Result<()> {
        check(rc, self.world_rank, op)
    }

    /// The sub-group of this group's ranks `members` (indices in this group, in the order
    /// of their ranks in the sub-group; every member calls `split` with the same list, and
    /// this rank must be in it). Only the members take part (`MPI_Comm_create_group`).
    pub fn split(&self, members: &[usize]) -> Result<MpiComm> {
        let mut ranks = Vec::with_capacity(members.len());
        for &m in members {
            if m >= self.size {
                return Err(self.usage(
                    "split",
                    format!("member {m} is not in a group of {}", self.size),
                ));
            }
            if ranks.contains(&(m as c_int)) {
                return Err(self.usage("split", format!("member {m} is listed twice")));
            }
            ranks.push(m as c_int);
        }
        if !members.contains(&self.rank) {
            return Err(self.usage("split", format!("this rank is not among {members:?}")));
        }
        // The tag tells apart groups created at the same time from this communicator.
        let tag = members.iter().fold(2_166_136_261u32, |h, &m| {
            (h ^ m as u32).wrapping_mul(16_777_619)
        }) % self.tag_ub.max(1);
        let mut out: *mut c_void = std::ptr::null_mut();
        // SAFETY: `ranks` outlives the call; `out` receives a boxed communicator we own.
        unsafe {
            self.check(
                ffi::ft_create_group(
                    self.comm,
                    ranks.as_ptr(),
                    ranks.len() as c_int,
                    tag as c_int,
                    &mut out,
                ),
                "split",
            )?;
            MpiComm::wrap(out, Some(self.world_rank), self.tag_ub)
        }
    }

    /// Forgets the sends that have completed.
    /// Starts a non-blocking collective `f(comm, buf, count, &req)` in place on `buf`; on
    /// completion the first `shift` elements move to block `rank` (see `reduce_scatter_start`).
    fn start(
        &self,
        op: &'static str,
        mut buf: Region<f32>,
        count: usize,
        shift: usize,
        f: unsafe extern "C" fn(*mut c_void, *mut f32, c_int, *mut *mut c_void) -> c_int,
    ) -> Pending {
        let rank = self.world_rank;
        let n = match host_region(&buf, rank, op).and_then(|()| self.count(op, count)) {
            Ok(n) => n,
            Err(e) => return Pending::refused(e),
        };
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: the buffer moves into the MpiPending with the request, which does not let
        // it go before the request completes; a region's elements do not move with it.
        let rc = unsafe { f(self.comm, buf.as_mut_ptr(), n, &mut req) };
        if let Err(e) = self.check(rc, op) {
            return Pending::refused(e);
        }
        Pending::from_completion(Box::new(MpiPending {
            req,
            buf: std::mem::take(&mut buf),
            rank,
            shift: shift * self.rank,
            block: shift,
        }))
    }

    /// Starts sending `buf` to `dst` with `tag`; the caller keeps `buf` alive and unmoved in
    /// memory until the request completes.
    fn isend(&self, buf: &[f32], dst: usize, tag: u32) -> Result<*mut c_void> {
        shapes::member(self.size, dst, "destination").map_err(|e| self.usage("send", e))?;
        if tag > self.tag_ub {
            return Err(self.usage(
                "send",
                format!("tag {tag} is over MPI_TAG_UB {}", self.tag_ub),
            ));
        }
        let n = self.count("send", buf.len())?;
        let mut req: *mut c_void = std::ptr::null_mut();
        // SAFETY: the caller keeps `buf`'s heap block alive until the request completes.
        self.check(
            unsafe {
                ffi::ft_isend(
                    self.comm,
                    buf.as_ptr(),
                    n,
                    dst as c_int,
                    tag as c_int,
                    &mut req,
                )
            },
            "send",
        )?;
        Ok(req)
    }

    fn reap_sends(&self) -> Result<()> {
        let mut sends = self.sends.borrow_mut();
        let mut err = Ok(());
        sends.retain(|(req, _)| {
            let mut done: c_int = 0;
            // SAFETY: `req` is a live request (freed by the shim once it reports done).
            let rc = unsafe { ffi::ft_test(*req, &mut done) };
            if rc != 0 {
                err = self.check(rc, "send");
            }
            done == 0
        });
        err
    }
}

impl Communicator for MpiComm {
    fn split_group(&self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split(members)?))
    }
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&self, buf: ViewMut<'_, f32>) -> Result<()> {
        let buf = host_mut(buf, self.world_rank, "all_reduce_sum")?;
        let n = self.count("all_reduce_sum", buf.len())?;
        // SAFETY: `buf` holds n elements for the duration of the blocking call.
        self.check(
            unsafe { ffi::ft_allreduce(self.comm, buf.as_mut_ptr(), n) },
            "all_reduce_sum",
        )
    }

    fn reduce_scatter_sum(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let send = host(send, self.world_rank, "reduce_scatter_sum")?;
        let recv = host_mut(recv, self.world_rank, "reduce_scatter_sum")?;
        let b = recv.len();
        shapes::reduce_scatter(self.size, send.len(), b)
            .map_err(|e| self.usage("reduce_scatter_sum", e))?;
        let bn = self.count("reduce_scatter_sum", b)?;
        // SAFETY: send holds p·b elements and recv b, for the blocking call.
        self.check(
            unsafe { ffi::ft_reduce_scatter(self.comm, send.as_ptr(), recv.as_mut_ptr(), bn) },
            "reduce_scatter_sum",
        )
    }

    fn all_gather(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let send = host(send, self.world_rank, "all_gather")?;
        let recv = host_mut(recv, self.world_rank, "all_gather")?;
        shapes::all_gather(self.size, send.len(), recv.len())
            .map_err(|e| self.usage("all_gather", e))?;
        let n = self.count("all_gather", send.len())?;
        self.count("all_gather", recv.len())?;
        // SAFETY: send holds n elements and recv size·n.
        self.check(
            unsafe { ffi::ft_allgather(self.comm, send.as_ptr(), recv.as_mut_ptr(), n) },
            "all_gather",
        )
    }

    fn broadcast(&self, buf: ViewMut<'_, f32>, root: usize) -> Result<()> {
        let buf = host_mut(buf, self.world_rank, "broadcast")?;
        shapes::member(self.size, root, "root").map_err(|e| self.usage("broadcast", e))?;
        let n = self.count("broadcast", buf.len())?;
        // SAFETY: buf holds n elements.
        self.check(
            unsafe { ffi::ft_bcast(self.comm, buf.as_mut_ptr(), n, root as c_int) },
            "broadcast",
        )
    }

    fn all_to_all(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let send = host(send, self.world_rank, "all_to_all")?;
        let recv = host_mut(recv, self.world_rank, "all_to_all")?;
        let p = self.size;
        shapes::all_to_all(p, send.len(), recv.len()).map_err(|e| self.usage("all_to_all", e))?;
        let b = self.count("all_to_all", send.len() / p)?;
        self.count("all_to_all", send.len())?;
        // SAFETY: send and recv hold p·b elements each.
        self.check(
            unsafe { ffi::ft_alltoall(self.comm, send.as_ptr(), recv.as_mut_ptr(), b) },
            "all_to_all",
        )
    }

    fn send(&self, buf: View<'_, f32>, dst: usize, tag: u32) -> Result<()> {
        let buf = host(buf, self.world_rank, "send")?;
        self.reap_sends()?;
        let copy = buf.to_vec();
        let req = self.isend(&copy, dst, tag)?;
        self.sends.borrow_mut().push((req, copy));
        Ok(())
    }

    fn send_start(&self, buf: Region<f32>, dst: usize, tag: u32) -> Pending {
        let sent = host_region(&buf, self.world_rank, "send_start")
            .and_then(|()| self.isend(&buf, dst, tag));
        match sent {
            Ok(req) => Pending::from_completion(Box::new(MpiPending {
                req,
                buf,
                rank: self.rank,
                shift: 0,
                block: 0,
            })),
            Err(e) => Pending::refused(e),
        }
    }

    fn recv(&self, buf: ViewMut<'_, f32>, src: usize, tag: u32) -> Result<()> {
        let buf = host_mut(buf, self.world_rank, "recv")?;
        shapes::member(self.size, src, "source").map_err(|e| self.usage("recv", e))?;
        if tag > self.tag_ub {
            return Err(self.usage(
                "recv",
                format!("tag {tag} is over MPI_TAG_UB {}", self.tag_ub),
            ));
        }
        let n = self.count("recv", buf.len())?;
        let mut got: c_int = 0;
        // SAFETY: buf holds n elements; the shim writes there only a message of exactly n.
        self.check(
            unsafe {
                ffi::ft_recv(
                    self.comm,
                    buf.as_mut_ptr(),
                    n,
                    src as c_int,
                    tag as c_int,
                    &mut got,
                )
            },
            "recv",
        )?;
        shapes::message(src, tag, got as usize, buf.len()).map_err(|e| self.usage("recv", e))?;
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        // SAFETY: a plain blocking call.
        self.check(unsafe { ffi::ft_barrier(self.comm) }, "barrier")
    }

    fn all_reduce_start(&self, buf: Region<f32>) -> Pending {
        let n = buf.len();
        self.start("all_reduce_sum", buf, n, 0, ffi::ft_iallreduce)
    }

    fn reduce_scatter_start(&self, buf: Region<f32>) -> Pending {
        if let Err(e) = shapes::blocks(self.size, buf.len()) {
            let e = self.usage("reduce_scatter_start", e);
            return Pending::refused(e);
        }
        // MPI leaves the sum in the first block; `wait` moves it to block `rank`.
        let b = buf.len() / self.size;
        self.start("reduce_scatter_sum", buf, b, b, ffi::ft_ireduce_scatter)
    }

    fn all_gather_start(&self, buf: Region<f32>) -> Pending {
        if let Err(e) = shapes::blocks(self.size, buf.len()) {
            let e = self.usage("all_gather_start", e);
            return Pending::refused(e);
        }
        let b = buf.len() / self.size;
        self.start("all_gather", buf, b, 0, ffi::ft_iallgather)
    }

    fn abort(&self, cause: &str) {
        abort_job(&format!("rank {} failed: {cause}", self.world_rank));
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort("panicked");
        }
        for (req, buf) in self.sends.get_mut().drain(..) {
            // SAFETY: a live request; its buffer is freed only after it completes.
            unsafe { ffi::ft_wait(req) };
            drop(buf);
        }
        // SAFETY: we own the boxed communicator (the shim never frees MPI_COMM_WORLD).
        unsafe { ffi::ft_comm_free(self.comm) };
    }
}

/// A non-blocking collective in flight and the buffer it works on in place.
struct MpiPending {
    /// Null once completed.
    req: *mut c_void,
    buf: Region<f32>,
    rank: usize,
    /// Where the first `block` elements of the result belong (a reduce-scatter's block).
    shift: usize,
    block: usize,
}

// SAFETY: the request is owned by this value alone, and MPI runs at MPI_THREAD_SERIALIZED or
// better, so it may be tested or waited on from any thread.
unsafe impl Send for MpiPending {}

impl Completion for MpiPending {
    fn test(&mut self) -> bool {
        if self.req.is_null() {
            return true;
        }
        let mut done: c_int = 0;
        // SAFETY: a live request; the shim frees it once done.
        let rc = unsafe { ffi::ft_test(self.req, &mut done) };
        if rc != 0 || done != 0 {
            self.req = std::ptr::null_mut();
        }
        self.req.is_null()
    }

    fn wait(mut self: Box<Self>) -> Result<Region<f32>> {
        if !self.req.is_null() {
            let req = std::mem::replace(&mut self.req, std::ptr::null_mut());
            // SAFETY: a live request; the shim frees it.
            check(unsafe { ffi::ft_wait(req) }, self.rank, "wait")?;
        }
        let mut buf = std::mem::take(&mut self.buf);
        buf.copy_within(0..self.block, self.shift);
        Ok(buf)
    }
}

impl Drop for MpiPending {
    fn drop(&mut self) {
        if !self.req.is_null() {
            // SAFETY: MPI may still write into `buf`: wait before it is freed.
            unsafe { ffi::ft_wait(self.req) };
        }
    }
}
