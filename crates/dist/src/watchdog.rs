//! The communication watchdog (`--comm-timeout`): every wait on another rank — a collective,
//! a message, an operation in flight — has a deadline. A rank stuck alive (stopped with
//! SIGSTOP, deadlocked, blocked on a slow filesystem) would otherwise hold every other rank in
//! its next collective forever: MPI has no timeout of its own. Past the deadline the waiting
//! rank names itself, the operation, the group and the step in one line and takes the whole
//! job down, so a scheduler can restart it from the last checkpoint. This is PyTorch's NCCL
//! watchdog (`TORCH_NCCL_ASYNC_ERROR_HANDLING`, `timeout=` of `init_process_group`) for
//! ferrotron's backends.
//!
//! One thread per process watches every rank of the process (the threads backend runs several
//! ranks in one): a wait registers itself ([`watch`]) and unregisters when it returns (the
//! guard's drop), so an armed wait costs two short lock holds and no system call. The thread
//! wakes a few times per timeout; what it does on expiry is the launcher's choice
//! ([`start`]): under MPI, `MPI_Abort` (mpirun then ends every process, a stopped one
//! included), with threads, the process's exit.
//!
//! [`Watched`] puts any communicator under the watchdog, with the name of its group.

use crate::communicator::{Communicator, Pending, Region, Result, View, ViewMut};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What the job does when a wait expires: print `line` and end every rank. Never returns.
pub type Expire = fn(line: &str) -> !;

struct Wait {
    rank: usize,
    op: &'static str,
    /// A host synchronisation waiting on the GPU's queue (`op` names its site), not a call.
    on_gpu: bool,
    group: Arc<str>,
    since: Instant,
}

struct Shared {
    timeout: Duration,
    expire: Expire,
    next: u64,
    waits: HashMap<u64, Wait>,
    /// Each rank's current training step (0 before the first).
    steps: HashMap<usize, u64>,
    /// The first rank of this process that failed, its error, and when.
    failed: Option<(usize, String, Instant)>,
}

/// Waits (and ranks) the tables hold before they grow: a rank's thread waits on one operation
/// at a time, and a process runs at most a few hundred ranks as threads.
const WAITS: usize = 256;

static STATE: OnceLock<Mutex<Option<Shared>>> = OnceLock::new();

fn state() -> std::sync::MutexGuard<'static, Option<Shared>> {
    STATE
        .get_or_init(|| Mutex::new(None))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Arms the watchdog of this process with `timeout` and what to do on expiry (later calls
/// change both; the thread starts once). Before it is started, [`watch`] records nothing.
pub fn start(timeout: Duration, expire: Expire) {
    let mut s = state();
    let first = s.is_none();
    let (next, waits, steps, failed) = match s.take() {
        Some(old) => (old.next, old.waits, old.steps, old.failed),
        // Room for every rank thread of a process waiting at once: a wait armed on the step's
        // hot path then never grows the table (freed entries are reused in place).
        None => (
            0,
            HashMap::with_capacity(WAITS),
            HashMap::with_capacity(WAITS),
            None,
        ),
    };
    *s = Some(Shared {
        timeout,
        expire,
        next,
        waits,
        steps,
        failed,
    });
    drop(s);
    if first {
        std::thread::Builder::new()
            .name("comm watchdog".into())
            .spawn(watch_loop)
            .expect("spawn the communication watchdog");
    }
}

/// Records that `rank` of this process failed with `cause` (the first failure is kept). The
/// host communicators wake the ranks waiting on it with an error; a wait they do not end (on
/// the GPU's queue behind NCCL's work, in an NCCL call) ends the job [`AFTER_FAILURE`] later,
/// naming this failure, rather than at the full `comm_timeout`.
pub fn rank_failed(rank: usize, cause: &str) {
    if let Some(s) = state().as_mut() {
        s.failed
            .get_or_insert_with(|| (rank, cause.to_string(), Instant::now()));
    }
}

/// How long a wait may outlast another rank's failure before the job is taken down: the
/// ranks the host communicators wake return their errors well within it.
pub const AFTER_FAILURE: Duration = Duration::from_secs(3);

/// Records that `rank` is now training step `step` (named in a timeout's line).
pub fn set_step(rank: usize, step: u64) {
    if let Some(s) = state().as_mut() {
        s.steps.insert(rank, step);
    }
}

/// An armed wait: unregistered when dropped.
pub struct Guard(Option<u64>);

impl Drop for Guard {
    fn drop(&mut self) {
        if let (Some(id), Some(s)) = (self.0, state().as_mut()) {
            s.waits.remove(&id);
        }
    }
}

/// Arms a wait of `rank` in `op` on `group` until the guard is dropped.
pub fn watch(rank: usize, op: &'static str, group: &Arc<str>) -> Guard {
    Guard(arm(rank, op, false, group))
}

fn arm(rank: usize, op: &'static str, on_gpu: bool, group: &Arc<str>) -> Option<u64> {
    let mut s = state();
    let s = s.as_mut()?;
    let id = s.next;
    s.next += 1;
    s.waits.insert(
        id,
        Wait {
            rank,
            op,
            on_gpu,
            group: group.clone(),
            since: Instant::now(),
        },
    );
    Some(id)
}

thread_local! {
    /// This thread's rank and the names of its groups that run on its GPU (NCCL), once
    /// [`watch_gpu`] said so.
    static ON_GPU: std::cell::RefCell<Option<(usize, Arc<str>)>> = const { std::cell::RefCell::new(None) };
}

/// This thread's rank (`world_rank`) runs groups `groups` (`"dp"`, `"dp, tp"`) through NCCL on
/// its GPU, where a wait on a peer is not a call that blocks but work in the device's queue:
/// NCCL's calls return at once, and a stopped peer holds this rank in its next host
/// synchronisation (the loss or the gradient norm read back, the step's end), or in the next
/// NCCL call that blocks (joining a communicator; every call on the CUDA emulator). From now
/// on both are armed: each host synchronisation of the GPU's backend on this thread
/// ([`ferrotron_engine::kernels::watch_syncs`]), and each NCCL call ([`watch_on_gpu`]). As
/// PyTorch's NCCL watchdog, the deadline counts from when the wait began, so `comm_timeout`
/// must exceed a step's device time.
pub fn watch_gpu(world_rank: usize, groups: &str) {
    ON_GPU.with(|g| *g.borrow_mut() = Some((world_rank, groups.into())));
    ferrotron_engine::kernels::watch_syncs(Some(ferrotron_engine::kernels::SyncHook {
        arm: |site| on_gpu(site.name(), true),
        disarm: |id| drop(Guard(Some(id))),
    }));
}

/// This thread's rank has no group on its GPU (any more): its waits there are not armed.
pub fn unwatch_gpu() {
    ON_GPU.with(|g| *g.borrow_mut() = None);
    ferrotron_engine::kernels::watch_syncs(None);
}

/// Arms `op`, a call into NCCL, of the rank this thread runs (see [`watch_gpu`]); a guard that
/// watches nothing where the thread's rank has no groups on its GPU.
pub fn watch_on_gpu(op: &'static str) -> Guard {
    Guard(on_gpu(op, false))
}

fn on_gpu(op: &'static str, sync: bool) -> Option<u64> {
    ON_GPU.with(|g| {
        let g = g.borrow();
        let (rank, groups) = g.as_ref()?;
        arm(*rank, op, sync, groups)
    })
}

/// The line a rank prints when its wait expired.
pub fn timeout_line(rank: usize, op: &str, group: &str, step: u64, waited: Duration) -> String {
    format!(
        "rank {rank}: comm timeout: {op} on group {group} at step {step} got no answer within {:.0} s (comm_timeout): a rank of the group is stuck, stopped or dead; taking the job down — restart it from the last checkpoint",
        waited.as_secs_f64()
    )
}

impl Wait {
    /// The line of this wait, expired at `step` after `waited`.
    fn line(&self, step: u64, waited: Duration) -> String {
        timeout_line(self.rank, &self.what(), &self.group, step, waited)
    }

    /// The line of this wait at `step`, which rank `failed` (with `cause`) will not answer.
    fn orphan_line(&self, step: u64, failed: usize, cause: &str) -> String {
        format!(
            "rank {failed} failed: {cause}; rank {} still waits in {} on group {} at step {step}, which no failed rank answers: taking the job down",
            self.rank,
            self.what(),
            self.group
        )
    }

    fn what(&self) -> String {
        match self.on_gpu {
            true => format!("the GPU's queue (a {} wait behind NCCL's work)", self.op),
            false => self.op.to_string(),
        }
    }
}

fn watch_loop() {
    loop {
        let (tick, expired) = {
            let s = state();
            let Some(s) = s.as_ref() else { return };
            // Several looks per timeout: a wait is caught within a tenth of it (at most 1 s)
            // of its deadline.
            let tick = (s.timeout / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
            (tick, s.expired(Instant::now()).map(|line| (s.expire, line)))
        };
        if let Some((expire, line)) = expired {
            expire(&line);
        }
        std::thread::sleep(tick);
    }
}

impl Shared {
    /// The line of the wait that ends the job at `now`, if one does: the oldest past the
    /// deadline, else the oldest that outlasted another rank's failure by [`AFTER_FAILURE`]
    /// (no answer will come).
    fn expired(&self, now: Instant) -> Option<String> {
        let step_of = |w: &Wait| self.steps.get(&w.rank).copied().unwrap_or(0);
        let oldest = |of: &dyn Fn(&Wait) -> bool| {
            self.waits
                .values()
                .filter(|w| of(w))
                // Ties (waits armed in the same instant) go to the lowest rank, so the line
                // a job ends with does not depend on the table's hash order.
                .min_by_key(|w| (w.since, w.rank))
        };
        let late = oldest(&|w| now.saturating_duration_since(w.since) > self.timeout);
        if let Some(w) = late {
            return Some(w.line(step_of(w), self.timeout));
        }
        let (rank, cause, at) = self.failed.as_ref()?;
        if now.saturating_duration_since(*at) <= AFTER_FAILURE.min(self.timeout) {
            return None;
        }
        let w = oldest(&|w| w.rank != *rank)?;
        Some(w.orphan_line(step_of(w), *rank, cause))
    }
}

/// The expiry of a job whose ranks are threads of this process: the line, then the process's
/// exit (status 1), which ends every rank at once.
pub fn exit_process(line: &str) -> ! {
    eprintln!("error: {line}");
    std::process::exit(1)
}

/// A communicator under the watchdog, named by its group (`dp`, `tp`, `pp`, …), so a timeout
/// says which group hung. Every call that waits on other ranks is armed; the operations it
/// starts are armed when they are waited for.
pub struct Watched {
    inner: Box<dyn Communicator>,
    group: Arc<str>,
    /// The rank as the watchdog names it (its rank in the world).
    world_rank: usize,
}

impl Watched {
    pub fn new(inner: Box<dyn Communicator>, group: &str, world_rank: usize) -> Self {
        Watched {
            inner,
            group: group.into(),
            world_rank,
        }
    }

    fn watch(&self, op: &'static str) -> Guard {
        watch(self.world_rank, op, &self.group)
    }

    fn later(&self, op: &'static str, p: Pending) -> Pending {
        p.watched(self.world_rank, op, self.group.clone())
    }
}

impl Communicator for Watched {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn size(&self) -> usize {
        self.inner.size()
    }
    fn all_reduce_sum(&self, buf: ViewMut<'_, f32>) -> Result<()> {
        let _w = self.watch("all_reduce");
        self.inner.all_reduce_sum(buf)
    }
    fn reduce_scatter_sum(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let _w = self.watch("reduce_scatter");
        self.inner.reduce_scatter_sum(send, recv)
    }
    fn all_gather(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let _w = self.watch("all_gather");
        self.inner.all_gather(send, recv)
    }
    fn broadcast(&self, buf: ViewMut<'_, f32>, root: usize) -> Result<()> {
        let _w = self.watch("broadcast");
        self.inner.broadcast(buf, root)
    }
    fn all_to_all(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let _w = self.watch("all_to_all");
        self.inner.all_to_all(send, recv)
    }
    fn all_to_all_v(
        &self,
        send: View<'_, f32>,
        send_counts: &[usize],
        recv: ViewMut<'_, f32>,
        recv_counts: &[usize],
        message: &mut Region<f32>,
    ) -> Result<()> {
        let _w = self.watch("all_to_all_v");
        self.inner
            .all_to_all_v(send, send_counts, recv, recv_counts, message)
    }
    fn send(&self, buf: View<'_, f32>, dst: usize, tag: u32) -> Result<()> {
        let _w = self.watch("send");
        self.inner.send(buf, dst, tag)
    }
    fn send_start(&self, buf: Region<f32>, dst: usize, tag: u32) -> Pending {
        self.later("send", self.inner.send_start(buf, dst, tag))
    }
    fn recv(&self, buf: ViewMut<'_, f32>, src: usize, tag: u32) -> Result<()> {
        let _w = self.watch("recv");
        self.inner.recv(buf, src, tag)
    }
    fn barrier(&self) -> Result<()> {
        let _w = self.watch("barrier");
        self.inner.barrier()
    }
    fn all_reduce_start(&self, buf: Region<f32>) -> Pending {
        self.later("all_reduce", self.inner.all_reduce_start(buf))
    }
    fn reduce_scatter_start(&self, buf: Region<f32>) -> Pending {
        self.later("reduce_scatter", self.inner.reduce_scatter_start(buf))
    }
    fn all_gather_start(&self, buf: Region<f32>) -> Pending {
        self.later("all_gather", self.inner.all_gather_start(buf))
    }
    fn abort(&self, cause: &str) {
        self.inner.abort(cause)
    }
    fn split_group(&self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        self.split_named(members, &self.group)
    }
    fn split_named(&self, members: &[usize], name: &str) -> Result<Box<dyn Communicator>> {
        let _w = self.watch("split_group");
        let inner = self.inner.split_group(members)?;
        Ok(Box::new(Watched::new(inner, name, self.world_rank)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_engine::kernels::SyncSite;

    /// This process's armed waits of `rank`: (op, on the GPU, group).
    fn waits_of(rank: usize) -> Vec<(&'static str, bool, String)> {
        let s = state();
        let waits = s.as_ref().map(|s| s.waits.values());
        (waits.into_iter().flatten())
            .filter(|w| w.rank == rank)
            .map(|w| (w.op, w.on_gpu, w.group.to_string()))
            .collect()
    }

    #[test]
    fn a_ranks_gpu_waits_are_armed_once_its_groups_run_on_nccl() {
        // A deadline no test reaches; rank 907 is this test's alone.
        start(Duration::from_secs(24 * 3600), |line| panic!("{line}"));
        let counter = ferrotron_engine::kernels::device_ops::OpCounter::new();
        drop(counter.sync(SyncSite::GradNorm));
        let _unarmed = counter.sync(SyncSite::GradNorm);
        assert_eq!(waits_of(907), [], "no group on the GPU yet");
        drop(watch_on_gpu("data-parallel gradient sum"));

        watch_gpu(907, "dp, tp");
        let read = counter.sync(SyncSite::GradNorm);
        assert_eq!(waits_of(907), [("grad_norm", true, "dp, tp".into())]);
        drop(read);
        assert_eq!(waits_of(907), [], "disarmed with its guard");
        let call = watch_on_gpu("data-parallel gradient sum");
        assert_eq!(
            waits_of(907),
            [("data-parallel gradient sum", false, "dp, tp".into())]
        );
        drop(call);

        // Another thread (another rank of the threads launcher) is not this rank.
        let elsewhere = std::thread::spawn(move || {
            let _w = counter.sync(SyncSite::StreamSync);
            waits_of(907)
        });
        assert_eq!(elsewhere.join().unwrap(), []);
        unwatch_gpu();
        let _after = watch_on_gpu("data-parallel gradient sum");
        assert_eq!(waits_of(907), []);
    }

    #[test]
    fn a_wait_ends_the_job_past_its_deadline_or_past_another_ranks_failure() {
        let t0 = Instant::now();
        let wait = |rank, op, since| Wait {
            rank,
            op,
            on_gpu: false,
            group: "dp".into(),
            since,
        };
        let mut s = Shared {
            timeout: Duration::from_secs(60),
            expire: |line| panic!("{line}"),
            next: 2,
            waits: HashMap::from([(0, wait(0, "all_reduce", t0)), (1, wait(1, "send", t0))]),
            steps: HashMap::from([(0, 4), (1, 4)]),
            failed: None,
        };
        let at = |secs| t0 + Duration::from_secs(secs);
        assert_eq!(s.expired(at(59)), None, "within the deadline");
        // Both waits are late; the tie goes to the lowest rank, whatever the table's order.
        let late = s.expired(at(61)).expect("past the deadline");
        assert!(
            late.starts_with("rank 0: comm timeout: all_reduce on group dp at step 4"),
            "{late}"
        );

        // Rank 1 fails at 10 s: rank 0's wait ends the job once it outlasts that by 3 s.
        s.failed = Some((1, "out of memory".into(), at(10)));
        assert_eq!(
            s.expired(at(13)),
            None,
            "the failed rank's peers get time to return"
        );
        assert_eq!(
            s.expired(at(14)).as_deref(),
            Some("rank 1 failed: out of memory; rank 0 still waits in all_reduce on group dp at step 4, which no failed rank answers: taking the job down")
        );
        // The failed rank's own wait (a thread of it still waiting) does not count.
        s.waits.remove(&0);
        assert_eq!(s.expired(at(14)), None);
    }

    #[test]
    fn a_gpu_wait_names_its_site_and_the_groups_behind_it() {
        let wait = Wait {
            rank: 3,
            op: "stream_sync",
            on_gpu: true,
            group: "dp, tp".into(),
            since: Instant::now(),
        };
        assert_eq!(
            wait.line(5, Duration::from_secs(60)),
            "rank 3: comm timeout: the GPU's queue (a stream_sync wait behind NCCL's work) on group dp, tp at step 5 got no answer within 60 s (comm_timeout): a rank of the group is stuck, stopped or dead; taking the job down — restart it from the last checkpoint"
        );
        assert_eq!(
            wait.orphan_line(5, 1, "out of memory"),
            "rank 1 failed: out of memory; rank 3 still waits in the GPU's queue (a stream_sync wait behind NCCL's work) on group dp, tp at step 5, which no failed rank answers: taking the job down"
        );
    }
}
