//! Data parallelism: every rank holds the whole model, runs its own slice of the global batch,
//! and the ranks sum their gradients before the (identical) optimizer step.
//!
//! The sum is bucketed and overlapped with the backward, as PyTorch DDP does (Li et al. 2020,
//! "PyTorch Distributed", §3.2.3): on the last micro-batch of a step, each time the backward
//! reports gradients final ([`GradsDone`]: a layer, the final norm, the embedding), they are
//! copied into the current bucket; a full bucket's all-reduce starts at once and runs while
//! the backward goes on. Two buckets are in flight at most (the plan's `dp.grad_buckets`, two
//! of `--bucket-mb`): before a third starts, the oldest is waited for and its sums written
//! back. Earlier micro-batches of gradient accumulation are not reduced (their gradients only
//! accumulate locally; `no_sync` in DDP). Buckets are f32 whatever the gradient type, so the
//! sum over ranks is taken in f32 and rounded once.
//!
//! The loss is normalised over the global number of target tokens (every rank divides by it),
//! so the summed gradient is the gradient of the global mean loss: no division after the sum.

use anyhow::{anyhow, Result};
use ferrotron_dist::{Communicator, Pending};
use ferrotron_engine::model::{GradsDone, ParamTable};
use ferrotron_engine::Elem;
use std::collections::VecDeque;
use std::ops::Range;

/// A bucket: its f32 sums and the gradient pieces they are (range in the flat gradients,
/// offset in the bucket).
struct Bucket {
    buf: Vec<f32>,
    pieces: Vec<(Range<usize>, usize)>,
    /// Elements filled.
    used: usize,
}

impl Bucket {
    fn new(len: usize) -> Self {
        Bucket {
            buf: vec![0.0; len],
            // At most one piece per tensor reported (a layer has at most 12), and few layers
            // fit one bucket of a model worth reducing; more only grow it once.
            pieces: Vec::with_capacity(64),
            used: 0,
        }
    }
}

/// A bucket whose all-reduce is running (its buffer is the communicator's meanwhile).
struct InFlight {
    pending: Pending,
    pieces: Vec<(Range<usize>, usize)>,
}

pub struct DataParallel {
    comm: Box<dyn Communicator>,
    /// Elements per bucket.
    bucket_len: usize,
    /// The bucket being filled, and the one free for filling (two in all, both allocated with
    /// the gradients and reused every step).
    filling: Option<Bucket>,
    spare: Vec<Bucket>,
    in_flight: VecDeque<InFlight>,
    /// Gradient elements put into buckets this step (a check that every gradient was).
    reduced: usize,
    /// The first error of a collective, reported when the step finishes.
    error: Option<String>,
    /// Every rank's peak bytes as f32 halves (reused every step).
    mem: Vec<f32>,
    /// Bytes this rank sent into all-reduces this step (the measured communication volume).
    pub bytes_reduced: u64,
}

impl DataParallel {
    /// The reduction of `bucket_len` (the plan's bucket, in f32 elements) for gradients over
    /// `comm`. The buckets are allocated by [`DataParallel::allocate`], with the gradients.
    pub fn new(comm: Box<dyn Communicator>, bucket_len: usize) -> Self {
        let mem = vec![0.0; 4 * comm.size()];
        DataParallel {
            comm,
            bucket_len: bucket_len.max(1),
            filling: None,
            spare: Vec::with_capacity(2),
            in_flight: VecDeque::with_capacity(2),
            reduced: 0,
            error: None,
            mem,
            bytes_reduced: 0,
        }
    }

    /// The two buckets (as the plan allocates `dp.grad_buckets` with the gradients).
    pub fn allocate(&mut self) {
        self.filling = Some(Bucket::new(self.bucket_len));
        self.spare = vec![Bucket::new(self.bucket_len)];
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    /// The gradient ranges a backward report makes final.
    pub fn ranges<'a>(done: &GradsDone<'a>) -> impl Iterator<Item = Range<usize>> + 'a {
        let (one, layer) = match *done {
            GradsDone::FinalNorm(r) | GradsDone::Embedding(r) => (Some(r.clone()), None),
            GradsDone::Layer(_, idx) => (None, Some(idx)),
        };
        one.into_iter()
            .chain(layer.into_iter().flat_map(|l| l.ranges().cloned()))
    }

    /// Gradients `range` are final on this rank: into the buckets, starting full ones. Sums
    /// that have arrived meanwhile are written back into `grads`.
    pub fn add<G: Elem>(&mut self, grads: &mut [G], mut range: Range<usize>) {
        // MPI progresses a started reduction only inside MPI calls: look in on the running
        // ones as the backward reports (a no-op for the threads backend's own worker).
        for f in &self.in_flight {
            f.pending.is_done();
        }
        while !range.is_empty() {
            // No bucket: a collective failed and took one with it; finish reports it.
            let Some(b) = self.filling.as_mut() else {
                return;
            };
            let take = range.len().min(self.bucket_len - b.used);
            let piece = range.start..range.start + take;
            for (d, s) in b.buf[b.used..b.used + take]
                .iter_mut()
                .zip(&grads[piece.clone()])
            {
                *d = s.to_f32();
            }
            b.pieces.push((piece, b.used));
            b.used += take;
            self.reduced += take;
            range.start += take;
            if b.used == self.bucket_len {
                self.launch(grads);
            }
        }
    }

    /// Starts the all-reduce of the bucket being filled; the spare one becomes the filling one.
    fn launch<G: Elem>(&mut self, grads: &mut [G]) {
        if self.filling.as_ref().is_none_or(|b| b.used == 0) {
            return;
        }
        if self.spare.is_empty() {
            // Both buckets are busy: the oldest must land before this one can go.
            self.land_oldest(grads);
        }
        let Some(mut b) = std::mem::replace(&mut self.filling, self.spare.pop()) else {
            return;
        };
        // The communicator reduces the whole buffer: a partly filled bucket sends only its
        // pieces (truncate keeps the capacity, so the buffer is reused without allocating).
        b.buf.truncate(b.used);
        self.bytes_reduced += 4 * b.used as u64;
        let pending = self.comm.all_reduce_start(b.buf);
        self.in_flight.push_back(InFlight {
            pending,
            pieces: b.pieces,
        });
    }

    /// Waits for the oldest bucket, writes its sums back into `grads` and makes it spare.
    fn land_oldest<G: Elem>(&mut self, grads: &mut [G]) {
        let Some(InFlight {
            pending,
            mut pieces,
        }) = self.in_flight.pop_front()
        else {
            return;
        };
        match pending.wait() {
            Ok(mut buf) => {
                for (r, at) in &pieces {
                    for (g, s) in grads[r.clone()].iter_mut().zip(&buf[*at..*at + r.len()]) {
                        *g = G::from_f32(*s);
                    }
                }
                buf.resize(self.bucket_len, 0.0);
                pieces.clear();
                let spare = Bucket {
                    buf,
                    pieces,
                    used: 0,
                };
                match self.filling {
                    // After a failure took the filling bucket: fill this one.
                    None => self.filling = Some(spare),
                    Some(_) => self.spare.push(spare),
                }
            }
            Err(e) => {
                self.error.get_or_insert(e.to_string());
            }
        }
    }

    /// Ends the step's reduction: the gradients the backward does not report (an untied LM
    /// head, complete since the head's forward: [`unreported`]) go into the last bucket, every
    /// bucket lands, and every gradient must have been summed exactly once.
    pub fn finish<G: Elem>(&mut self, grads: &mut [G], rest: Option<Range<usize>>) -> Result<()> {
        if let Some(r) = rest {
            self.add(grads, r);
        }
        self.launch(grads);
        while !self.in_flight.is_empty() {
            self.land_oldest(grads);
        }
        let reduced = std::mem::take(&mut self.reduced);
        if let Some(e) = self.error.take() {
            return Err(anyhow!("data-parallel gradient all-reduce: {e}"));
        }
        if reduced != grads.len() {
            return Err(anyhow!(
                "internal: {reduced} of {} gradients were all-reduced",
                grads.len()
            ));
        }
        Ok(())
    }

    /// The loss sum and target count of every rank, summed (each rank reports the same).
    pub fn sum_loss(&self, sum: f64, count: usize) -> Result<(f64, usize)> {
        let mut v = [sum as f32, count as f32];
        self.comm
            .all_reduce_sum(&mut v)
            .map_err(|e| anyhow!("data-parallel loss all-reduce: {e}"))?;
        Ok((v[0] as f64, v[1] as usize))
    }

    /// Every rank's `(planned, measured)` bytes, rank order (exact: each u64 travels as two
    /// 24-bit halves, which f32 holds exactly).
    pub fn gather_mem(&mut self, planned: u64, measured: u64) -> Result<Vec<(u64, u64)>> {
        let split = |b: u64| [(b >> 24) as f32, (b & 0xFF_FFFF) as f32];
        let [a, b] = split(planned);
        let [c, d] = split(measured);
        let mine = [a, b, c, d];
        self.comm
            .all_gather(&mine, &mut self.mem)
            .map_err(|e| anyhow!("data-parallel memory all-gather: {e}"))?;
        let join = |h: f32, l: f32| ((h as u64) << 24) | l as u64;
        Ok(self
            .mem
            .chunks(4)
            .map(|c| (join(c[0], c[1]), join(c[2], c[3])))
            .collect())
    }
}

/// The parameter tensor of `table` the backward does not report (an untied LM head).
pub fn unreported(table: &ParamTable) -> Option<Range<usize>> {
    (table.lm_head != table.embed).then(|| table.lm_head.clone())
}
