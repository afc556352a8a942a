//! The threads backend: ranks as threads of one process, for one machine and for tests.
//!
//! A group's collectives meet in a shared exchange: every rank deposits its contribution, the
//! last to arrive opens the round, every rank computes its result from all contributions (in
//! rank order, so every rank and every run get the same bits), and the last to leave closes
//! it. Each communicator owns a worker thread that runs its collectives one after the other,
//! so a collective started without waiting (`all_reduce_start`) keeps its place in the
//! rank's order, as MPI requires, while the caller goes on computing. Point-to-point messages
//! go through mailboxes keyed by (source, destination, tag).
//!
//! Faults: a rank that returns an error calls `abort`, and a rank that panics aborts from its
//! communicator's `Drop`; every other rank's waiting call then fails within a poll interval
//! with [`CommError::PeerFailed`] naming it. A rank that stops without a word is caught by the
//! timeout.

use super::internals::BackendInternals;
use crate::communicator::{
    host, host_mut, host_region, CommError, Communicator, Pending, Region, Result, View, ViewMut,
};
use crate::shapes;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How often a waiting rank looks for a failed peer.
const POLL: Duration = Duration::from_millis(50);

type Slots = Vec<Option<Region<f32>>>;
/// Messages in flight, by (source world rank, destination world rank, tag), oldest first.
/// A message in a mailbox, and (from `send_start`) where its buffer goes back to once read.
type Letter = (Region<f32>, Option<mpsc::SyncSender<Result<Region<f32>>>>);
type Mailboxes = HashMap<(usize, usize, u32), VecDeque<Letter>>;

#[derive(Default)]
struct Round {
    slots: Slots,
    arrived: usize,
    left: usize,
    /// Members that have taken their own buffer back after everyone left.
    taken: usize,
    open: bool,
}

/// One group's meeting point.
struct Exchange {
    members: Vec<usize>,
    round: Mutex<Round>,
    cv: Condvar,
}

/// Called on every thread that works for a rank (its communicator workers), with the rank.
type ThreadTag = Arc<dyn Fn(usize) + Send + Sync>;

struct WorldShared {
    timeout: Duration,
    /// Tags a rank's communicator worker as the rank's (per-rank memory accounting: what the
    /// worker allocates or frees is the rank's).
    tag: ThreadTag,
    failed: Mutex<Option<(usize, String)>>,
    groups: Mutex<HashMap<Vec<usize>, Arc<Exchange>>>,
    mail: Mutex<Mailboxes>,
    mail_cv: Condvar,
}

impl WorldShared {
    fn failure(&self) -> Option<CommError> {
        let f = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        f.as_ref().map(|(rank, cause)| CommError::PeerFailed {
            rank: *rank,
            cause: cause.clone(),
        })
    }

    fn exchange(&self, members: &[usize]) -> Arc<Exchange> {
        let mut g = self.groups.lock().unwrap_or_else(|e| e.into_inner());
        g.entry(members.to_vec())
            .or_insert_with(|| {
                Arc::new(Exchange {
                    members: members.to_vec(),
                    round: Mutex::new(Round {
                        slots: members.iter().map(|_| None).collect(),
                        ..Round::default()
                    }),
                    cv: Condvar::new(),
                })
            })
            .clone()
    }

    /// Waits on `cv` until `ready` holds, a peer has failed, or the timeout passes.
    fn wait<'a, T>(
        &self,
        cv: &Condvar,
        mut guard: MutexGuard<'a, T>,
        rank: usize,
        op: &'static str,
        mut ready: impl FnMut(&T) -> bool,
    ) -> Result<MutexGuard<'a, T>> {
        let start = Instant::now();
        while !ready(&guard) {
            if let Some(e) = self.failure() {
                return Err(e);
            }
            if start.elapsed() > self.timeout {
                return Err(CommError::Timeout {
                    rank,
                    op,
                    ms: self.timeout.as_millis() as u64,
                });
            }
            guard = cv
                .wait_timeout(guard, POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(guard)
    }
}

/// One round of a collective: deposits `mine` as member `me`'s contribution and returns what
/// `result` computes from all of them.
fn meet<R>(
    world: &WorldShared,
    ex: &Exchange,
    me: usize,
    rank: usize,
    op: &'static str,
    mine: Region<f32>,
    result: impl FnOnce(&mut Slots) -> R,
) -> Result<(R, Region<f32>)> {
    let n = ex.members.len();
    let g = ex.round.lock().unwrap_or_else(|e| e.into_inner());
    // Wait for the previous round to be over for everyone.
    let mut g = world.wait(&ex.cv, g, rank, op, |r| !r.open)?;
    g.slots[me] = Some(mine);
    g.arrived += 1;
    if g.arrived == n {
        g.open = true;
        ex.cv.notify_all();
    }
    let mut g = world.wait(&ex.cv, g, rank, op, |r| r.open)?;
    let out = result(&mut g.slots);
    g.left += 1;
    if g.left == n {
        ex.cv.notify_all();
    }
    // Every rank has read every slot: each takes its own buffer back (so a rank's memory
    // comes home to it, and an in-place collective returns its result in it).
    let mut g = world.wait(&ex.cv, g, rank, op, |r| r.left == n)?;
    let own = g.slots[me].take().unwrap_or_default();
    g.taken += 1;
    if g.taken == n {
        // Every slot is empty again: the next round reuses them.
        (g.arrived, g.left, g.taken, g.open) = (0, 0, 0, false);
        ex.cv.notify_all();
    }
    Ok((out, own))
}

/// Elements summed at once by [`sum_in_place`] and [`sum_own_block`]: a stack buffer of 1 KiB,
/// so each slot's host slice is taken once per chunk, not per element (a region's `Deref`
/// checks its memory: 130 instructions an element of two slots, 113 over plain `Vec`s;
/// chunked the sums vectorise: 9; callgrind, docs/BENCHMARKS.md).
const SUM_CHUNK: usize = 256;

/// `out[j] = 0 + s₀[at + j] + s₁[at + j] + …` over the slots in slot order: the same
/// additions, in the same order, as a fold per element, so every rank and every run get the
/// same bits (the leading `0 +` turns a −0 into +0, as the fold does).
fn sum_slots(slots: &Slots, at: usize, out: &mut [f32]) {
    out.fill(0.0);
    for s in slots.iter().flatten() {
        let part = &s.host()[at..at + out.len()];
        out.iter_mut().zip(part).for_each(|(o, x)| *o += x);
    }
}

/// The in-place sum: member `me` sums its share of the elements over every slot, in slot
/// order, and writes the sum into every slot (each member owns a disjoint share, so no
/// element is read after it is written). No buffer is allocated (the chunk is on the stack).
fn sum_in_place(slots: &mut Slots, me: usize) {
    let n = slots.len();
    let len = slots.iter().flatten().map(|s| s.len()).next().unwrap_or(0);
    let share = len.div_ceil(n.max(1));
    let (lo, hi) = ((me * share).min(len), ((me + 1) * share).min(len));
    let mut sum = [0.0f32; SUM_CHUNK];
    for at in (lo..hi).step_by(SUM_CHUNK) {
        let sum = &mut sum[..SUM_CHUNK.min(hi - at)];
        sum_slots(slots, at, sum);
        for s in slots.iter_mut().flatten() {
            s.host_mut()[at..at + sum.len()].copy_from_slice(sum);
        }
    }
}

/// The in-place reduce-scatter: member `me` writes the sum of block `me` (slot order) into
/// block `me` of its own slot. Every other member reads only its own block of that slot, so
/// nothing is read after it is written, and nothing is allocated.
fn sum_own_block(slots: &mut Slots, me: usize, b: usize) {
    let (lo, hi) = (me * b, (me + 1) * b);
    let mut sum = [0.0f32; SUM_CHUNK];
    for at in (lo..hi).step_by(SUM_CHUNK) {
        let sum = &mut sum[..SUM_CHUNK.min(hi - at)];
        sum_slots(slots, at, sum);
        if let Some(own) = slots[me].as_mut() {
            own.host_mut()[at..at + sum.len()].copy_from_slice(sum);
        }
    }
}

/// The in-place all-gather: member `me` copies block `j` of slot `j` into its own slot, for
/// every `j` (block `j` of slot `j` is never written: each member writes only the other
/// blocks of its own slot).
fn gather_blocks(slots: &mut Slots, me: usize, b: usize) {
    let Some(mut own) = slots[me].take() else {
        return;
    };
    for (j, s) in slots.iter().enumerate() {
        if let Some(s) = s {
            own[j * b..(j + 1) * b].copy_from_slice(&s[j * b..(j + 1) * b]);
        }
    }
    slots[me] = Some(own);
}

type Job = Box<dyn FnOnce(&WorldShared, &Exchange) + Send>;

/// A rank's view of one group (the world or a sub-group).
pub struct ThreadComm {
    world: Arc<WorldShared>,
    /// This rank's world rank and its index in the group.
    world_rank: usize,
    me: usize,
    members: Vec<usize>,
    jobs: Option<mpsc::Sender<Job>>,
    worker: Option<std::thread::JoinHandle<()>>,
}

/// Creates `size` ranks; returns each rank's world communicator (hand each to its thread).
pub fn world(size: usize, timeout: Duration) -> Vec<ThreadComm> {
    world_tagged(size, timeout, Arc::new(|_| {}))
}

fn world_tagged(size: usize, timeout: Duration, tag: ThreadTag) -> Vec<ThreadComm> {
    let shared = Arc::new(WorldShared {
        timeout,
        tag,
        failed: Mutex::new(None),
        groups: Mutex::new(HashMap::new()),
        mail: Mutex::new(HashMap::new()),
        mail_cv: Condvar::new(),
    });
    let all: Vec<usize> = (0..size).collect();
    (0..size)
        .map(|r| ThreadComm::new(shared.clone(), r, &all))
        .collect()
}

/// Runs `f(rank, comm)` on `size` threads, one per rank; returns each rank's result. A rank
/// whose `f` fails or panics takes the others down (see the module comment).
pub fn run<T: Send + 'static>(
    size: usize,
    timeout: Duration,
    f: impl Fn(usize, ThreadComm) -> std::result::Result<T, String> + Send + Sync + 'static,
) -> Vec<std::result::Result<T, String>> {
    run_tagged(size, timeout, |_| {}, f)
}

/// As [`run`], calling `tag(rank)` first on each thread that works for a rank: the rank's own
/// thread and its communicators' workers (so a per-rank allocator can charge them to it).
pub fn run_tagged<T: Send + 'static>(
    size: usize,
    timeout: Duration,
    tag: impl Fn(usize) + Send + Sync + 'static,
    f: impl Fn(usize, ThreadComm) -> std::result::Result<T, String> + Send + Sync + 'static,
) -> Vec<std::result::Result<T, String>> {
    let f = Arc::new(f);
    let tag: ThreadTag = Arc::new(tag);
    let handles: Vec<_> = world_tagged(size, timeout, tag.clone())
        .into_iter()
        .enumerate()
        .map(|(r, comm)| {
            let (f, tag) = (f.clone(), tag.clone());
            std::thread::Builder::new()
                .name(format!("rank {r}"))
                .spawn(move || {
                    tag(r);
                    let world = comm.world.clone();
                    let out = f(r, comm);
                    if let Err(e) = &out {
                        let mut failed = world.failed.lock().unwrap_or_else(|e| e.into_inner());
                        failed.get_or_insert((r, e.clone()));
                        crate::watchdog::rank_failed(r, e);
                    }
                    out
                })
                .expect("spawn a rank thread")
        })
        .collect();
    handles
        .into_iter()
        .enumerate()
        .map(|(r, h)| {
            h.join()
                .unwrap_or_else(|_| Err(format!("rank {r} panicked")))
        })
        .collect()
}

impl ThreadComm {
    fn new(world: Arc<WorldShared>, world_rank: usize, members: &[usize]) -> Self {
        let me = members
            .iter()
            .position(|&m| m == world_rank)
            .expect("a rank is a member of its own group");
        let ex = world.exchange(members);
        let (tx, rx) = mpsc::channel::<Job>();
        let w = world.clone();
        let worker = std::thread::Builder::new()
            .name(format!("rank {world_rank} comm"))
            .spawn(move || {
                (w.tag)(world_rank);
                for job in rx {
                    job(&w, &ex);
                }
            })
            .expect("spawn a communicator thread");
        ThreadComm {
            world,
            world_rank,
            me,
            members: members.to_vec(),
            jobs: Some(tx),
            worker: Some(worker),
        }
    }

    /// This rank's rank in the world.
    pub fn world_rank(&self) -> usize {
        self.world_rank
    }

    /// The sub-group of this group's ranks `members` (indices in this group; every member
    /// calls `split` with the same list, and this rank must be in it).
    pub fn split(&self, members: &[usize]) -> Result<ThreadComm> {
        let usage = |problem: String| CommError::Usage {
            rank: self.world_rank,
            op: "split",
            problem,
        };
        let mut world_ranks = Vec::with_capacity(members.len());
        for &m in members {
            let w = *self.members.get(m).ok_or_else(|| {
                usage(format!(
                    "member {m} is not in a group of {}",
                    self.members.len()
                ))
            })?;
            world_ranks.push(w);
        }
        if !world_ranks.contains(&self.world_rank) {
            return Err(usage(format!("this rank is not among {members:?}")));
        }
        Ok(ThreadComm::new(
            self.world.clone(),
            self.world_rank,
            &world_ranks,
        ))
    }

    /// Runs `op` on the worker (after every collective started before it); the receiver gets
    /// its result: the buffer `result` returns, or with `None` the rank's own buffer `mine`,
    /// which `result` rewrote in place.
    fn submit(
        &self,
        name: &'static str,
        mine: Region<f32>,
        result: impl FnOnce(&mut Slots, usize) -> Option<Region<f32>> + Send + 'static,
    ) -> Pending {
        // The job's box, its queue's blocks and the completion channel: the backend's own
        // (`internals`), as a real MPI's requests are.
        let _internals = BackendInternals::enter();
        let (tx, rx) = mpsc::channel();
        let (me, rank) = (self.me, self.world_rank);
        // Every collective but broadcast needs the same length from every rank.
        let equal = name != "broadcast";
        let job: Job = Box::new(move |w, ex| {
            let r = meet(w, ex, me, rank, name, mine, |s| {
                // Compared in place: the lengths are collected only for the error's message.
                let mut lens = s.iter().flatten().map(|s| s.len());
                let first = lens.next();
                if equal && lens.any(|l| Some(l) != first) {
                    let lens: Vec<usize> = s.iter().flatten().map(|s| s.len()).collect();
                    return Err(CommError::Usage {
                        rank,
                        op: name,
                        problem: format!("ranks passed different lengths {lens:?}"),
                    });
                }
                Ok(result(s, me))
            });
            let _ = tx.send(r.and_then(|(x, own)| x.map(|out| out.unwrap_or(own))));
        });
        if let Some(jobs) = &self.jobs {
            let _ = jobs.send(job);
        }
        Pending::new(rx, self.world.timeout, rank)
    }

    /// Starts an in-place collective on `buf` cut into one block per member: `f(slots, me,
    /// block length)` computes member `me`'s result.
    fn blocks_start(
        &self,
        op: &'static str,
        name: &'static str,
        buf: Region<f32>,
        f: fn(&mut Slots, usize, usize),
    ) -> Pending {
        if let Err(e) = host_region(&buf, self.world_rank, op) {
            return self.failed(e);
        }
        if let Err(e) = shapes::blocks(self.size(), buf.len()) {
            return self.failed(self.usage(op, e));
        }
        let b = buf.len() / self.size();
        self.submit(name, buf, move |s, me| {
            f(s, me, b);
            None
        })
    }

    /// An operation refused before it started.
    fn failed(&self, e: CommError) -> Pending {
        let (tx, rx) = mpsc::channel();
        let _ = tx.send(Err(e));
        Pending::new(rx, self.world.timeout, self.world_rank)
    }

    /// Puts a letter in the mailbox of (this rank, world rank `to`, `tag`).
    fn post(&self, to: usize, tag: u32, letter: Letter) {
        let mut mail = self.world.mail.lock().unwrap_or_else(|e| e.into_inner());
        mail.entry((self.world_rank, to, tag))
            .or_default()
            .push_back(letter);
        self.world.mail_cv.notify_all();
    }

    fn usage(&self, op: &'static str, problem: String) -> CommError {
        CommError::usage(self.world_rank, op, problem)
    }

    /// A collective on a copy of `send`, its result copied into `out`.
    fn blocking(
        &self,
        name: &'static str,
        send: &[f32],
        out: &mut [f32],
        result: impl FnOnce(&Slots, usize) -> Vec<f32> + Send + 'static,
    ) -> Result<()> {
        let r = self
            .submit(name, send.to_vec().into(), |s, me| {
                Some(result(s, me).into())
            })
            .wait()?;
        if r.len() != out.len() {
            return Err(self.usage(
                name,
                format!("result has {} elements, the buffer {}", r.len(), out.len()),
            ));
        }
        out.copy_from_slice(&r);
        Ok(())
    }
}

// Each operation marks what it allocates (its copies of the caller's buffer, its job) as the
// backend's own (`internals`): an MPI library's calls allocate inside as well.
impl Communicator for ThreadComm {
    fn split_group(&self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        Ok(Box::new(self.split(members)?))
    }
    fn rank(&self) -> usize {
        self.me
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce_sum(&self, buf: ViewMut<'_, f32>) -> Result<()> {
        let _internals = BackendInternals::enter();
        let buf = host_mut(buf, self.world_rank, "all_reduce_sum")?;
        let out = self.submit("all_reduce_sum", buf.to_vec().into(), |s, me| {
            sum_in_place(s, me);
            None
        });
        let r = out.wait()?;
        buf.copy_from_slice(&r);
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let _internals = BackendInternals::enter();
        let send = host(send, self.world_rank, "reduce_scatter_sum")?;
        let recv = host_mut(recv, self.world_rank, "reduce_scatter_sum")?;
        let b = recv.len();
        shapes::reduce_scatter(self.size(), send.len(), b)
            .map_err(|e| self.usage("reduce_scatter_sum", e))?;
        // In place on a copy this rank allocates and frees: a result allocated by the worker
        // and freed here would charge one rank's memory to another (`alloc::set_rank`).
        let r = self.reduce_scatter_start(send.to_vec().into()).wait()?;
        recv.copy_from_slice(&r[self.me * b..(self.me + 1) * b]);
        Ok(())
    }

    fn all_gather(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let _internals = BackendInternals::enter();
        let send = host(send, self.world_rank, "all_gather")?;
        let recv = host_mut(recv, self.world_rank, "all_gather")?;
        shapes::all_gather(self.size(), send.len(), recv.len())
            .map_err(|e| self.usage("all_gather", e))?;
        // In place on this rank's own buffer, as `reduce_scatter_sum`.
        let (n, me) = (send.len(), self.me);
        let mut buf = vec![0.0; recv.len()];
        buf[me * n..(me + 1) * n].copy_from_slice(send);
        recv.copy_from_slice(&self.all_gather_start(buf.into()).wait()?);
        Ok(())
    }

    fn broadcast(&self, buf: ViewMut<'_, f32>, root: usize) -> Result<()> {
        let _internals = BackendInternals::enter();
        let buf = host_mut(buf, self.world_rank, "broadcast")?;
        shapes::member(self.size(), root, "root").map_err(|e| self.usage("broadcast", e))?;
        let mine = if self.me == root {
            buf.to_vec().into()
        } else {
            Region::default()
        };
        let n = buf.len();
        let r = self
            .submit("broadcast", mine, move |s, _| {
                Some(s[root].as_deref().unwrap_or_default().to_vec().into())
            })
            .wait()?;
        if r.len() != n {
            return Err(self.usage(
                "broadcast",
                format!("root sent {} elements, this rank expects {n}", r.len()),
            ));
        }
        buf.copy_from_slice(&r);
        Ok(())
    }

    fn all_to_all(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) -> Result<()> {
        let _internals = BackendInternals::enter();
        let send = host(send, self.world_rank, "all_to_all")?;
        let recv = host_mut(recv, self.world_rank, "all_to_all")?;
        let p = self.size();
        shapes::all_to_all(p, send.len(), recv.len()).map_err(|e| self.usage("all_to_all", e))?;
        let b = send.len() / p;
        self.blocking("all_to_all", send, recv, move |s, me| {
            s.iter()
                .flatten()
                .flat_map(|v| v[me * b..(me + 1) * b].to_vec())
                .collect()
        })
    }

    fn send(&self, buf: View<'_, f32>, dst: usize, tag: u32) -> Result<()> {
        let _internals = BackendInternals::enter();
        let buf = host(buf, self.world_rank, "send")?;
        shapes::member(self.size(), dst, "destination").map_err(|e| self.usage("send", e))?;
        let to = self.members[dst];
        if let Some(e) = self.world.failure() {
            return Err(e);
        }
        self.post(to, tag, (buf.to_vec().into(), None));
        Ok(())
    }

    fn send_start(&self, buf: Region<f32>, dst: usize, tag: u32) -> Pending {
        let _internals = BackendInternals::enter();
        if let Err(e) = host_region(&buf, self.world_rank, "send_start") {
            return self.failed(e);
        }
        if let Err(e) = shapes::member(self.size(), dst, "destination") {
            return self.failed(self.usage("send", e));
        }
        if let Some(e) = self.world.failure() {
            return self.failed(e);
        }
        // A one-place channel: created (and freed) by this rank's thread, and the reader's
        // send into it allocates nothing, so per-rank memory accounting stays exact.
        let (tx, rx) = mpsc::sync_channel(1);
        self.post(self.members[dst], tag, (buf, Some(tx)));
        Pending::new(rx, self.world.timeout, self.world_rank)
    }

    fn recv(&self, buf: ViewMut<'_, f32>, src: usize, tag: u32) -> Result<()> {
        let _internals = BackendInternals::enter();
        let buf = host_mut(buf, self.world_rank, "recv")?;
        shapes::member(self.size(), src, "source").map_err(|e| self.usage("recv", e))?;
        let from = self.members[src];
        let key = (from, self.world_rank, tag);
        let mail = self.world.mail.lock().unwrap_or_else(|e| e.into_inner());
        let mut mail =
            self.world
                .wait(&self.world.mail_cv, mail, self.world_rank, "recv", |m| {
                    m.get(&key).is_some_and(|q| !q.is_empty())
                })?;
        let (msg, back) = mail
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
            .expect("waited for a message");
        drop(mail);
        let fits = shapes::message(src, tag, msg.len(), buf.len());
        if fits.is_ok() {
            buf.copy_from_slice(&msg);
        }
        // The sender's buffer goes back to it (its `send_start` completes).
        if let Some(back) = back {
            let _ = back.send(Ok(msg));
        }
        fits.map_err(|e| self.usage("recv", e))
    }

    fn barrier(&self) -> Result<()> {
        let _internals = BackendInternals::enter();
        self.submit("barrier", Region::default(), |_, _| None)
            .wait()
            .map(drop)
    }

    fn all_reduce_start(&self, buf: Region<f32>) -> Pending {
        if let Err(e) = host_region(&buf, self.world_rank, "all_reduce_start") {
            return self.failed(e);
        }
        // In place: the caller's buffer comes back holding the sum (the hot path of data
        // parallelism allocates nothing).
        self.submit("all_reduce_sum", buf, |s, me| {
            sum_in_place(s, me);
            None
        })
    }

    fn reduce_scatter_start(&self, buf: Region<f32>) -> Pending {
        self.blocks_start(
            "reduce_scatter_start",
            "reduce_scatter_sum",
            buf,
            sum_own_block,
        )
    }

    fn all_gather_start(&self, buf: Region<f32>) -> Pending {
        self.blocks_start("all_gather_start", "all_gather", buf, gather_blocks)
    }

    fn abort(&self, cause: &str) {
        let mut failed = self.world.failed.lock().unwrap_or_else(|e| e.into_inner());
        failed.get_or_insert((self.world_rank, cause.to_string()));
        drop(failed);
        crate::watchdog::rank_failed(self.world_rank, cause);
        self.world.mail_cv.notify_all();
        for ex in self
            .world
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            ex.cv.notify_all();
        }
    }
}

impl Drop for ThreadComm {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.abort("panicked");
        }
        // Closing the queue ends the worker once the collectives already started are done.
        self.jobs.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}
