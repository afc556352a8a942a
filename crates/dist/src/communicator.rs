//! The collectives every backend provides, on `f32` buffers (16-bit gradients are widened by
//! the caller, as reductions accumulate in f32 anyway). The blocking collectives and
//! point-to-point messages take device-neutral views ([`View`], [`ViewMut`], the same ones the
//! engine's kernels take), so a GPU communicator (NCCL) is one more backend reading device
//! views; the host backends (threads, MPI) read host views and answer a view of device memory
//! with [`CommError::Usage`] naming it. An operation in flight (`*_start`) owns its buffer
//! while the collective runs: a [`Region`] (an owned span of some memory, such as a planned
//! place in the rank's arena, or a `Vec`), moved in and handed back by [`Pending::wait`]; a
//! host backend answers a region of device memory likewise. Every rank of a group must call the
//! same collectives in the same order (MPI's rule). Every rank gets bit-identical results and a
//! run is reproducible: the threads backend sums in rank order; MPI (Open MPI, as the MPI tests
//! check) picks its reduction order from the group size and buffer length (fixed for a given
//! run shape, but not rank order, so its sums can differ from the threads backend's by
//! rounding).

use std::time::Duration;

pub use ferrotron_view::{AsView, AsViewMut, Memory, Region, View, ViewMut};

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommError {
    /// Another rank failed or left: the job cannot go on.
    #[error("rank {rank} failed: {cause}")]
    PeerFailed { rank: usize, cause: String },
    /// Nobody answered in time (a rank stuck or dead without a word).
    #[error(
        "rank {rank}: no answer from the group within {:.1} s in {op} (a rank died or hangs)",
        *ms as f64 / 1000.0
    )]
    Timeout {
        rank: usize,
        op: &'static str,
        ms: u64,
    },
    /// A call whose arguments cannot work (lengths, ranks).
    #[error("rank {rank}: {op}: {problem}")]
    Usage {
        rank: usize,
        op: &'static str,
        problem: String,
    },
}

impl CommError {
    /// A call `op` on `rank` whose arguments cannot work, and why.
    pub fn usage(rank: usize, op: &'static str, problem: String) -> Self {
        CommError::Usage { rank, op, problem }
    }
}

pub type Result<T> = std::result::Result<T, CommError>;

/// A group of ranks that can talk.
pub trait Communicator: Send {
    /// This rank's index in the group.
    fn rank(&self) -> usize;
    /// Ranks in the group.
    fn size(&self) -> usize;
    /// Every rank's `buf` replaced by the element-wise sum over ranks.
    fn all_reduce_sum(&self, buf: ViewMut<'_, f32>) -> Result<()>;
    /// The sum over ranks of `send` (size × `recv.len()` elements), of which this rank keeps
    /// block `rank` in `recv`.
    fn reduce_scatter_sum(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()>;
    /// Every rank's `send` (equal lengths), concatenated in rank order into `recv`.
    fn all_gather(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()>;
    /// `root`'s `buf` into every rank's `buf`.
    fn broadcast(&self, buf: ViewMut<'_, f32>, root: usize) -> Result<()>;
    /// Block `j` of this rank's `send` goes to rank `j`, which puts it at block `rank` of its
    /// `recv` (equal block sizes).
    fn all_to_all(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()>;
    /// Blocks of different sizes (expert parallelism's token dispatch): the first
    /// `send_counts[0]` elements of `send` go to rank 0, the next `send_counts[1]` to rank 1,
    /// …; from rank i come `recv_counts[i]` elements, placed in rank order at the start of
    /// `recv`. Each pair of ranks exchanges once, pairs in one global order with the lower
    /// rank sending first, so no send waits on a rank that is itself sending. A block leaves
    /// in `message` (a started send, handed back once received): reused for every block and
    /// every call, it allocates nothing once it holds the largest block (a planned one does
    /// from the start).
    fn all_to_all_v(
        &self,
        send: View<'_, f32>,
        send_counts: &[usize],
        recv: ViewMut<'_, f32>,
        recv_counts: &[usize],
        message: &mut Region<f32>,
    ) -> Result<()> {
        /// Tag of the exchange ("EP").
        const TAG: u32 = 0x4550;
        let (me, size) = (self.rank(), self.size());
        // This default stages blocks through a host `message`: host views only (a device
        // backend overrides it with its own exchange).
        let send = host(send, me, "all_to_all_v")?;
        let recv = host_mut(recv, me, "all_to_all_v")?;
        crate::shapes::all_to_all_v(size, (send.len(), send_counts), (recv.len(), recv_counts))
            .and_then(|()| match send_counts[me] == recv_counts[me] {
                true => Ok(()),
                false => Err(format!(
                    "this rank sends itself {} elements but expects {}",
                    send_counts[me], recv_counts[me]
                )),
            })
            .map_err(|problem| CommError::Usage {
                rank: me,
                op: "all_to_all_v",
                problem,
            })?;
        // Each peer's block starts where the blocks before it end: running offsets, so the
        // exchange allocates nothing of its own per call.
        let (mut so, mut ro) = (0, 0);
        for p in 0..size {
            let out = &send[so..so + send_counts[p]];
            let into = &mut recv[ro..ro + recv_counts[p]];
            (so, ro) = (so + send_counts[p], ro + recv_counts[p]);
            if p == me {
                into.copy_from_slice(out);
                continue;
            }
            message.fit(out.len());
            message.copy_from_slice(out);
            let letter = std::mem::take(message);
            *message = if me < p {
                let sent = self.send_start(letter, p, TAG);
                self.recv(into.into(), p, TAG)?;
                sent.wait()?
            } else {
                self.recv(into.into(), p, TAG)?;
                self.send_start(letter, p, TAG).wait()?
            };
        }
        Ok(())
    }
    /// `buf` to rank `dst`, matched by its `recv` with the same `tag`.
    fn send(&self, buf: View<'_, f32>, dst: usize, tag: u32) -> Result<()>;
    /// Starts sending `buf` to rank `dst` (matched by its `recv` with `tag`) and returns at
    /// once; `Pending::wait` hands the buffer back when it may be reused. A pipeline stage
    /// sends from a few planned buffers this way and allocates nothing per message. Messages
    /// from one rank to another with one tag are received in the order they were sent.
    fn send_start(&self, buf: Region<f32>, dst: usize, tag: u32) -> Pending;
    /// A message from rank `src` with `tag`, of exactly `buf.len()` elements.
    fn recv(&self, buf: ViewMut<'_, f32>, src: usize, tag: u32) -> Result<()>;
    fn barrier(&self) -> Result<()>;
    /// Starts an all-reduce of `buf` that completes while this rank goes on computing (the
    /// overlap of gradient buckets with the backward); `Pending::wait` returns the buffer.
    fn all_reduce_start(&self, buf: Region<f32>) -> Pending;
    /// Starts a reduce-scatter in place (ZeRO's gradient reduction): `buf` is `size` equal
    /// blocks; when `Pending::wait` returns it, its block `rank` holds the sum over ranks of
    /// that block (the other blocks are unspecified).
    fn reduce_scatter_start(&self, buf: Region<f32>) -> Pending;
    /// Starts an all-gather in place (ZeRO's parameter gathering): `buf` is `size` equal
    /// blocks of which this rank filled block `rank`; when `Pending::wait` returns it, every
    /// block holds its rank's.
    fn all_gather_start(&self, buf: Region<f32>) -> Pending;
    /// Marks this rank failed with `cause`: every other rank's next or current call returns
    /// [`CommError::PeerFailed`] naming it, instead of waiting forever.
    fn abort(&self, cause: &str);
    /// The sub-group of this group's ranks `members` (indices in this group, in their order
    /// in the sub-group; every member calls it with the same list): a tensor- or data-parallel
    /// group of the rank grid.
    fn split_group(&self, members: &[usize]) -> Result<Box<dyn Communicator>>;
    /// [`Communicator::split_group`], naming the sub-group (`tp`, `dp`, …) for whoever reports
    /// on it (the watchdog's timeout line); a backend that keeps no names ignores `name`.
    fn split_named(&self, members: &[usize], name: &str) -> Result<Box<dyn Communicator>> {
        let _ = name;
        self.split_group(members)
    }
}

/// The host slice of `v`, or a [`CommError::Usage`] naming its memory: what a host backend
/// (threads, MPI) answers a view of device memory with.
pub fn host<'a>(v: View<'a, f32>, rank: usize, op: &'static str) -> Result<&'a [f32]> {
    v.try_host().map_err(|m| off_host(m, rank, op))
}

/// [`host`], writable.
pub fn host_mut<'a>(v: ViewMut<'a, f32>, rank: usize, op: &'static str) -> Result<&'a mut [f32]> {
    v.try_host_mut().map_err(|m| off_host(m, rank, op))
}

/// `Ok` for a region of host memory, else the [`CommError::Usage`] a host backend's started
/// operation ends with (handed back by its [`Pending`]).
pub fn host_region(buf: &Region<f32>, rank: usize, op: &'static str) -> Result<()> {
    match buf.memory() {
        Memory::Host => Ok(()),
        m => Err(off_host(m, rank, op)),
    }
}

fn off_host(m: Memory, rank: usize, op: &'static str) -> CommError {
    CommError::Usage {
        rank,
        op,
        problem: format!(
            "the buffer is in {m}, which this host communicator cannot read (use a device communicator)"
        ),
    }
}

/// How a backend's operation in flight completes (the MPI backend's requests; the threads
/// backend uses a channel from its worker instead).
pub trait Completion: Send {
    /// Whether it has finished; may advance it (MPI progresses only inside MPI calls).
    fn test(&mut self) -> bool;
    /// Waits for it; returns its buffer.
    fn wait(self: Box<Self>) -> Result<Region<f32>>;
}

/// An operation refused before it started ([`Pending::refused`]).
struct Refused(Option<CommError>);

impl Completion for Refused {
    fn test(&mut self) -> bool {
        true
    }
    fn wait(mut self: Box<Self>) -> Result<Region<f32>> {
        Err(self.0.take().expect("waited once"))
    }
}

/// An operation in flight.
pub struct Pending {
    inner: Inner,
    /// Who waits for it, in what, on which group: armed with the watchdog while waiting.
    watch: Option<(usize, &'static str, std::sync::Arc<str>)>,
}

enum Inner {
    Channel(Channel),
    Backend(std::cell::RefCell<Box<dyn Completion>>),
}

struct Channel {
    rx: std::sync::mpsc::Receiver<Result<Region<f32>>>,
    done: std::cell::RefCell<Option<Result<Region<f32>>>>,
    timeout: Duration,
    rank: usize,
}

impl Pending {
    pub(crate) fn new(
        rx: std::sync::mpsc::Receiver<Result<Region<f32>>>,
        timeout: Duration,
        rank: usize,
    ) -> Self {
        Pending {
            inner: Inner::Channel(Channel {
                rx,
                done: std::cell::RefCell::new(None),
                timeout,
                rank,
            }),
            watch: None,
        }
    }

    /// An operation that a backend completes itself.
    pub fn from_completion(c: Box<dyn Completion>) -> Self {
        Pending {
            inner: Inner::Backend(std::cell::RefCell::new(c)),
            watch: None,
        }
    }

    /// An operation refused before it started: its wait returns `e`.
    pub fn refused(e: CommError) -> Self {
        Self::from_completion(Box::new(Refused(Some(e))))
    }

    /// The same operation, its wait armed with the watchdog as `rank`'s `op` on `group`.
    pub fn watched(mut self, rank: usize, op: &'static str, group: std::sync::Arc<str>) -> Self {
        self.watch = Some((rank, op, group));
        self
    }

    /// Waits for the operation; returns its buffer.
    pub fn wait(self) -> Result<Region<f32>> {
        let _armed = self
            .watch
            .as_ref()
            .map(|(rank, op, group)| crate::watchdog::watch(*rank, op, group));
        match self.inner {
            Inner::Channel(c) => c.wait(),
            Inner::Backend(c) => c.into_inner().wait(),
        }
    }

    /// Whether it has finished (then `wait` returns at once).
    pub fn is_done(&self) -> bool {
        match &self.inner {
            Inner::Channel(c) => c.is_done(),
            Inner::Backend(c) => c.borrow_mut().test(),
        }
    }
}

impl Channel {
    fn gone(&self) -> CommError {
        CommError::PeerFailed {
            rank: self.rank,
            cause: "its communicator shut down".into(),
        }
    }

    fn wait(self) -> Result<Region<f32>> {
        // The channel's waiting (its waker's entry) is the backend's own (`internals`).
        let _internals = crate::backends::internals::BackendInternals::enter();
        if let Some(r) = self.done.borrow_mut().take() {
            return r;
        }
        // The worker enforces the group's timeout itself; this one only guards against a
        // worker that vanished.
        match self.rx.recv_timeout(self.timeout + Duration::from_secs(5)) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(CommError::Timeout {
                rank: self.rank,
                op: "wait",
                ms: self.timeout.as_millis() as u64,
            }),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(self.gone()),
        }
    }

    fn is_done(&self) -> bool {
        let _internals = crate::backends::internals::BackendInternals::enter();
        let mut done = self.done.borrow_mut();
        if done.is_none() {
            match self.rx.try_recv() {
                Ok(r) => *done = Some(r),
                Err(std::sync::mpsc::TryRecvError::Empty) => return false,
                Err(std::sync::mpsc::TryRecvError::Disconnected) => *done = Some(Err(self.gone())),
            }
        }
        true
    }
}
