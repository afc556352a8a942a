//! The device's copies of an offloaded update, overlapped with AdamW on the host.
//!
//! ZeRO-Offload (Ren et al., USENIX ATC 2021, §4.2) hides the trips between the device and the
//! host behind computation. The update here runs bucket by bucket (`offload.rs`): while the
//! host updates bucket i, a copy thread brings bucket i + 1's gradients down and takes bucket
//! i − 1's new weights up, so the update costs about the larger of the copies and the host's
//! AdamW, not their sum. Two slots of staging take turns, page-locked where the device has
//! such memory (`HostBuf::pinned`), and each is handed between the threads by value: a slot
//! is only ever touched by the thread that holds it. The thread and its bounded queues are
//! made once, with the states, so that a step allocates nothing. The copies and the update
//! read and write the same elements as the update without overlap did, so the trajectory is
//! the same bit for bit.

use super::host_tier::HostBuf;
use super::offload::typed;
use super::step::OptRun;
use ferrotron_engine::kernels::host_copy::{bytes, bytes_mut};
use ferrotron_engine::kernels::{DeviceAlloc, ViewMut};
use ferrotron_engine::Elem;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};

/// Slots of staging: one bucket being updated while the other is copied.
pub(super) const SLOTS: usize = 2;

/// One bucket's gradients and weights on the host: f32 words, viewed as the gradient and
/// weight types.
pub(super) struct Slot {
    grads: HostBuf<f32>,
    params: HostBuf<f32>,
}

impl Slot {
    /// A slot of `bucket` elements of `g`-byte gradients and `s`-byte weights, in `dev`'s
    /// page-locked memory where it has some.
    pub(super) fn new(bucket: usize, (g, s): (usize, usize), dev: &Arc<dyn DeviceAlloc>) -> Slot {
        Slot {
            grads: HostBuf::pinned((bucket * g).div_ceil(4), dev),
            params: HostBuf::pinned((bucket * s).div_ceil(4), dev),
        }
    }

    /// Host bytes of a slot, as [`Slot::new`] takes them.
    pub(super) fn bytes(bucket: usize, (g, s): (usize, usize)) -> u64 {
        4 * ((bucket * g).div_ceil(4) + (bucket * s).div_ceil(4)) as u64
    }

    /// The bucket's `len` gradients and weights, as their types.
    pub(super) fn views<G: Elem, S: Elem>(
        &mut self,
        len: usize,
    ) -> (ViewMut<'_, G>, ViewMut<'_, S>) {
        (typed(&mut self.grads, len), typed(&mut self.params, len))
    }
}

/// One run's part inside a bucket of the states: the run, the offset of the part in it, its
/// length, and where it sits in the bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Part {
    pub run: usize,
    pub off: usize,
    pub len: usize,
    pub at: usize,
}

/// The parts of `runs` inside the states' bucket `lo..hi`, in order.
pub(super) fn parts(runs: &[OptRun], lo: usize, hi: usize) -> impl Iterator<Item = Part> + '_ {
    runs.iter().enumerate().filter_map(move |(run, r)| {
        let (start, end) = (r.at.max(lo), (r.at + r.params.len()).min(hi));
        (start < end).then(|| Part {
            run,
            off: start - r.at,
            len: end - start,
            at: start - lo,
        })
    })
}

/// Where one run's gradients and weights start in the device's memory.
#[derive(Clone, Copy, Debug)]
pub(super) struct RunAddrs {
    pub grads: usize,
    pub weights: usize,
}

/// A step's runs and their addresses, as the copy thread reads them: raw, because the
/// thread outlives the step; valid until the step's [`Copying`] is dropped, which waits for
/// the thread to finish with them.
#[derive(Clone, Copy)]
struct StepRuns {
    runs: *const OptRun,
    addrs: *const RunAddrs,
    len: usize,
    /// The weights come down too (no master weights: the update is of the stored weights).
    weights_down: bool,
}

// SAFETY: read-only plain data, read by the copy thread only while the step that lent it
// waits (`Copying`'s drop).
unsafe impl Send for StepRuns {}

impl StepRuns {
    fn runs(&self) -> &[OptRun] {
        // SAFETY: see the type.
        unsafe { std::slice::from_raw_parts(self.runs, self.len) }
    }

    fn addrs(&self) -> &[RunAddrs] {
        // SAFETY: see the type.
        unsafe { std::slice::from_raw_parts(self.addrs, self.len) }
    }
}

/// What the copy thread is asked.
enum Job {
    /// Bucket `lo..hi` down into a free slot.
    Down(StepRuns, usize, usize),
    /// A slot's weights up to bucket `lo..hi`, which frees the slot.
    Up(StepRuns, usize, usize, Slot),
    /// A slot back to the free ones, not copied.
    Free(Slot),
    /// Report when everything asked before is done.
    Flush,
}

enum Reply {
    Filled(Slot),
    Flushed,
}

/// A queue from one thread to another, its room allocated up front: sending and waiting
/// allocate nothing (std's channels allocate a waiter the first time a thread blocks, which
/// would put an allocation on a step's path some steps and not others). Closed, a receiver
/// gets what is left, then `None`.
struct Mailbox<T> {
    state: Mutex<(VecDeque<T>, bool)>,
    ready: Condvar,
}

impl<T> Mailbox<T> {
    fn new(room: usize) -> Arc<Mailbox<T>> {
        Arc::new(Mailbox {
            state: Mutex::new((VecDeque::with_capacity(room), false)),
            ready: Condvar::new(),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (VecDeque<T>, bool)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `x`; `false` once the queue is closed.
    fn send(&self, x: T) -> bool {
        let mut s = self.lock();
        if s.1 {
            return false;
        }
        debug_assert!(s.0.len() < s.0.capacity(), "a mailbox past its room");
        s.0.push_back(x);
        self.ready.notify_one();
        true
    }

    fn recv(&self) -> Option<T> {
        let mut s = self.lock();
        loop {
            if let Some(x) = s.0.pop_front() {
                return Some(x);
            }
            if s.1 {
                return None;
            }
            s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn close(&self) {
        self.lock().1 = true;
        self.ready.notify_all();
    }
}

/// Closes a mailbox when dropped: the copy thread's replies, however the thread ends (a
/// panic included), so the step waiting on them is told rather than left waiting.
struct Closes<T>(Arc<Mailbox<T>>);

impl<T> Drop for Closes<T> {
    fn drop(&mut self) {
        self.0.close();
    }
}

/// The copy thread of a rank's offloaded updates, started once (a thread and its queues,
/// their room allocated up front: a step allocates nothing), and the buckets' geometry.
pub(super) struct CopyThread {
    jobs: Arc<Mailbox<Job>>,
    replies: Arc<Mailbox<Reply>>,
    thread: Option<std::thread::JoinHandle<()>>,
    n: usize,
    bucket: usize,
    slots: usize,
}

/// Messages in flight at most: a step asks each slot down once ahead, then one up and one
/// down per bucket, and a flush; the replies are the slots and the flush's.
const QUEUE: usize = 2 * SLOTS + 2;

impl CopyThread {
    /// The thread copying between `dev` and `slots` for states of `n` elements in buckets of
    /// `bucket`, of `g`-byte gradients and `s`-byte weights.
    pub(super) fn start(
        dev: Arc<dyn DeviceAlloc>,
        slots: Vec<Slot>,
        (g, s): (usize, usize),
        n: usize,
        bucket: usize,
    ) -> Result<CopyThread, String> {
        let (jobs, replies) = (Mailbox::new(QUEUE), Mailbox::new(QUEUE));
        let (asked, reply) = (jobs.clone(), Closes(replies.clone()));
        let count = slots.len();
        let thread = std::thread::Builder::new()
            .name("offload-copies".into())
            .spawn(move || {
                let mut free = slots;
                while let Some(job) = asked.recv() {
                    let sent = match job {
                        Job::Down(r, lo, hi) => {
                            let mut slot = free.pop().expect("a slot is free for each bucket");
                            down(&*dev, r, (g, s), lo, hi, &mut slot);
                            reply.0.send(Reply::Filled(slot))
                        }
                        Job::Up(r, lo, hi, slot) => {
                            up(&*dev, r, s, lo, hi, &slot);
                            free.push(slot);
                            true
                        }
                        Job::Free(slot) => {
                            free.push(slot);
                            true
                        }
                        Job::Flush => reply.0.send(Reply::Flushed),
                    };
                    if !sent {
                        break;
                    }
                }
            })
            .map_err(|e| format!("the offload copy thread: {e}"))?;
        Ok(CopyThread {
            jobs,
            replies,
            thread: Some(thread),
            n,
            bucket,
            slots: count,
        })
    }

    /// The copies of one update over `runs` (at `addrs` in the device's memory), bucket by
    /// bucket: the first buckets are asked down at once.
    pub(super) fn begin<'a>(
        &'a mut self,
        runs: &'a [OptRun],
        addrs: &'a [RunAddrs],
        weights_down: bool,
    ) -> Copying<'a> {
        assert_eq!(runs.len(), addrs.len(), "an address per run");
        let r = StepRuns {
            runs: runs.as_ptr(),
            addrs: addrs.as_ptr(),
            len: runs.len(),
            weights_down,
        };
        let mut c = Copying {
            t: self,
            runs: r,
            next: 0,
            _lent: std::marker::PhantomData,
        };
        for _ in 0..c.t.slots {
            c.ask_down();
        }
        c
    }

    fn send(&self, job: Job) {
        if !self.jobs.send(job) {
            panic!("internal: the offload copy thread stopped");
        }
    }

    fn reply(&self) -> Reply {
        (self.replies.recv()).expect("internal: the offload copy thread stopped")
    }
}

impl Drop for CopyThread {
    fn drop(&mut self) {
        // Its queue closed, the thread ends once the queue is empty.
        self.jobs.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// One update's copies under way ([`CopyThread::begin`]); dropped, it waits for them all, so
/// what the thread reads of the step outlives its reading.
pub(super) struct Copying<'a> {
    t: &'a mut CopyThread,
    runs: StepRuns,
    /// The first element of the next bucket to ask down.
    next: usize,
    _lent: std::marker::PhantomData<&'a [OptRun]>,
}

impl Copying<'_> {
    fn ask_down(&mut self) {
        let (n, bucket) = (self.t.n, self.t.bucket);
        if self.next < n {
            let hi = (self.next + bucket).min(n);
            self.t.send(Job::Down(self.runs, self.next, hi));
            self.next = hi;
        }
    }

    /// The slot of the next bucket, its gradients (and weights) down.
    pub(super) fn next(&mut self) -> Slot {
        match self.t.reply() {
            Reply::Filled(slot) => slot,
            Reply::Flushed => unreachable!("no flush is asked while buckets are"),
        }
    }

    /// The bucket `lo..hi` is updated in `slot`: its weights go up, and the bucket after the
    /// next one comes down into the slot then free.
    pub(super) fn updated(&mut self, lo: usize, hi: usize, slot: Slot) {
        self.t.send(Job::Up(self.runs, lo, hi, slot));
        self.ask_down();
    }
}

impl Drop for Copying<'_> {
    fn drop(&mut self) {
        if !self.t.jobs.send(Job::Flush) {
            return;
        }
        // A bucket brought down and never updated (an update that stopped early): its slot
        // goes back to the free ones.
        while let Some(Reply::Filled(slot)) = self.t.replies.recv() {
            self.t.jobs.send(Job::Free(slot));
        }
    }
}

/// The gradients of bucket `lo..hi` (and its weights, without master weights) into `slot`,
/// as bytes: `g` of a gradient, `s` of a weight.
fn down(
    dev: &dyn DeviceAlloc,
    r: StepRuns,
    (g, s): (usize, usize),
    lo: usize,
    hi: usize,
    slot: &mut Slot,
) {
    let (runs, addrs) = (r.runs(), r.addrs());
    for p in parts(runs, lo, hi) {
        let a = addrs[p.run];
        // SAFETY: each run's gradients and weights are at least `p.off + p.len` elements of
        // the device's memory at its addresses (`RunAddrs`, taken from its views), which
        // nothing else reads or writes while the update runs; the slot holds the bucket.
        unsafe {
            dev.download(
                &mut bytes_mut(&mut slot.grads)[p.at * g..(p.at + p.len) * g],
                at(a.grads + p.off * g),
            );
            if r.weights_down {
                dev.download(
                    &mut bytes_mut(&mut slot.params)[p.at * s..(p.at + p.len) * s],
                    at(a.weights + p.off * s),
                );
            }
        }
    }
}

/// The updated weights of bucket `lo..hi` from `slot` to the device (`s` bytes a weight).
fn up(dev: &dyn DeviceAlloc, r: StepRuns, s: usize, lo: usize, hi: usize, slot: &Slot) {
    let (runs, addrs) = (r.runs(), r.addrs());
    for p in parts(runs, lo, hi) {
        let w = &bytes(&slot.params)[p.at * s..(p.at + p.len) * s];
        // SAFETY: as in `down`.
        unsafe { dev.upload(at(addrs[p.run].weights + p.off * s), w) };
    }
}

fn at(addr: usize) -> std::ptr::NonNull<u8> {
    std::ptr::NonNull::new(addr as *mut u8).expect("a device address is not null")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(at: usize, len: usize) -> OptRun {
        OptRun {
            params: 100..100 + len,
            at,
            weights: 1000 + at,
            decay: true,
            replicated: false,
        }
    }

    #[test]
    fn buckets_come_down_and_go_up_through_two_slots() {
        use ferrotron_engine::kernels::{DeviceBuf, EmulatedDevice};
        let dev: Arc<dyn DeviceAlloc> = Arc::new(EmulatedDevice { ordinal: 0 });
        // Two runs over 10 elements of f32 states, buckets of 4: three buckets, the last short.
        let (n, bucket) = (10, 4);
        let runs = [run(0, 6), run(6, 4)];
        let grads: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let g = DeviceBuf::from_host(&dev, &grads).unwrap();
        let mut w = DeviceBuf::<f32>::zeros(&dev, 1000 + n).unwrap();
        let base = w.view_mut().as_mut_ptr() as usize;
        let addrs: Vec<RunAddrs> = (runs.iter())
            .map(|r| RunAddrs {
                grads: g.view().as_ptr() as usize + 4 * r.at,
                weights: base + 4 * r.weights,
            })
            .collect();
        let slots = (0..SLOTS).map(|_| Slot::new(bucket, (4, 4), &dev));
        let mut t = CopyThread::start(dev.clone(), slots.collect(), (4, 4), n, bucket).unwrap();
        // An update that stops after its first bucket (the disk tier failing to read the
        // next) leaves the second one's slot filled and not taken: it goes back...
        let mut c = t.begin(&runs, &addrs, false);
        let slot = c.next();
        c.updated(0, bucket, slot);
        drop(c);
        // ... and the next one runs whole: each bucket's gradients down, the weights up.
        for round in 1..=2 {
            let mut c = t.begin(&runs, &addrs, false);
            for lo in (0..n).step_by(bucket) {
                let hi = (lo + bucket).min(n);
                let mut slot = c.next();
                let (gs, mut ws) = slot.views::<f32, f32>(hi - lo);
                assert_eq!(gs.as_view().host(), &grads[lo..hi], "bucket {lo}..{hi}");
                for (x, y) in ws.rb().host_mut().iter_mut().zip(&grads[lo..hi]) {
                    *x = round as f32 * 10.0 + y;
                }
                c.updated(lo, hi, slot);
            }
            drop(c);
            let want: Vec<f32> = grads.iter().map(|y| round as f32 * 10.0 + y).collect();
            assert_eq!(&w.to_host()[1000..], &want[..], "round {round}");
        }
    }

    #[test]
    fn a_bucket_cuts_runs_at_its_edges() {
        let runs = [run(0, 5), run(5, 3), run(8, 10)];
        let got: Vec<Part> = parts(&runs, 4, 10).collect();
        let part = |run, off, len, at| Part { run, off, len, at };
        assert_eq!(got, [part(0, 4, 1, 0), part(1, 0, 3, 1), part(2, 0, 2, 4)]);
        assert_eq!(parts(&runs, 18, 20).count(), 0);
        // Every element of the states falls in exactly one part of one bucket.
        let total: usize = (0..18)
            .step_by(4)
            .flat_map(|lo| parts(&runs, lo, (lo + 4).min(18)))
            .map(|p| p.len)
            .sum();
        assert_eq!(total, 18);
    }
}
