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

/// One bucket: its gradient pieces (range in the flat gradients, offset in the bucket).
#[derive(Debug, Default)]
struct Pieces(Vec<(Range<usize>, usize)>);

/// A bucket whose all-reduce is running.
struct InFlight {
    pending: Pending,
    pieces: Pieces,
}

pub struct DataParallel {
    comm: Box<dyn Communicator>,
    /// Elements per bucket.
    bucket_len: usize,
    /// The bucket being filled, and the buckets free for filling (two in all).
    filling: Vec<f32>,
    filling_pieces: Pieces,
    spare: Vec<Vec<f32>>,
    in_flight: VecDeque<InFlight>,
    /// Gradient elements put into buckets this step (a check that every gradient was).
    reduced: usize,
    /// The first error of a collective, reported when the step finishes.
    error: Option<String>,
    /// Bytes this rank sent into all-reduces this step (the measured communication volume).
    pub bytes_reduced: u64,
}

impl DataParallel {
    /// The reduction of `bucket_len` (the plan's bucket, in f32 elements) for gradients over
    /// `comm`. The buckets are allocated by [`DataParallel::allocate`], with the gradients.
    pub fn new(comm: Box<dyn Communicator>, bucket_len: usize) -> Self {
        // Pieces per bucket: at most one per tensor range reported (layers, norm, embedding,
        // head) plus the splits of ranges larger than a bucket.
        let pieces = || Pieces(Vec::with_capacity(64));
        DataParallel {
            comm,
            bucket_len: bucket_len.max(1),
            filling: Vec::new(),
            filling_pieces: pieces(),
            spare: Vec::new(),
            in_flight: VecDeque::with_capacity(2),
            reduced: 0,
            error: None,
            bytes_reduced: 0,
        }
    }

    /// The two buckets (as the plan allocates `dp.grad_buckets` with the gradients).
    pub fn allocate(&mut self) {
        self.filling = vec![0.0; self.bucket_len];
        self.spare = vec![vec![0.0; self.bucket_len]];
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    /// The gradient ranges a backward report makes final.
    pub fn ranges<'a>(done: &GradsDone<'a>) -> impl Iterator<Item = Range<usize>> + 'a {
        let (one, layer) = match *done {
            GradsDone::FinalNorm(r) | GradsDone::Embedding(r) => (Some(r.clone()), None),
            GradsDone::Layer(_, idx) => (None, Some(idx)),
        };
        let layer = layer.into_iter().flat_map(|l| {
            [
                &l.ln1, &l.wq, &l.wk, &l.wv, &l.wo, &l.ln2, &l.wg, &l.wu, &l.wd,
            ]
            .into_iter()
            .cloned()
            .chain([&l.bq, &l.bk, &l.bv].into_iter().flatten().cloned())
        });
        one.into_iter().chain(layer)
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
            let used = self.filled();
            let take = range.len().min(self.bucket_len - used);
            let piece = range.start..range.start + take;
            let dst = &mut self.filling[used..used + take];
            for (d, s) in dst.iter_mut().zip(&grads[piece.clone()]) {
                *d = s.to_f32();
            }
            self.filling_pieces.0.push((piece, used));
            self.reduced += take;
            range.start += take;
            if used + take == self.bucket_len {
                self.launch(grads);
            }
        }
    }

    fn filled(&self) -> usize {
        self.filling_pieces.0.iter().map(|(r, _)| r.len()).sum()
    }

    /// Starts the all-reduce of the bucket being filled.
    fn launch<G: Elem>(&mut self, grads: &mut [G]) {
        let used = self.filled();
        if used == 0 {
            return;
        }
        if self.spare.is_empty() {
            // Both buckets are busy: the oldest must land before this one can go.
            self.land_oldest(grads);
        }
        let Some(next) = self.spare.pop() else {
            // Only after a failed collective (its bucket is lost): stop reducing.
            self.filling_pieces.0.clear();
            return;
        };
        let mut bucket = std::mem::replace(&mut self.filling, next);
        // The communicator reduces the whole buffer: a partly filled bucket sends only its
        // pieces (truncate keeps the capacity, so the buffer is reused without allocating).
        bucket.truncate(used);
        self.bytes_reduced += 4 * used as u64;
        let pieces = std::mem::replace(&mut self.filling_pieces, Pieces(Vec::with_capacity(64)));
        let pending = self.comm.all_reduce_start(bucket);
        self.in_flight.push_back(InFlight { pending, pieces });
    }

    /// Waits for the oldest bucket and writes its sums back into `grads`.
    fn land_oldest<G: Elem>(&mut self, grads: &mut [G]) {
        let Some(f) = self.in_flight.pop_front() else {
            return;
        };
        match f.pending.wait() {
            Ok(mut buf) => {
                for (r, at) in &f.pieces.0 {
                    for (g, s) in grads[r.clone()].iter_mut().zip(&buf[*at..*at + r.len()]) {
                        *g = G::from_f32(*s);
                    }
                }
                buf.resize(self.bucket_len, 0.0);
                self.spare.push(buf);
            }
            Err(e) => {
                self.error.get_or_insert(e.to_string());
            }
        }
    }

    /// Ends the step's reduction: the gradients not reported during the backward (an untied
    /// LM head, complete since the head's forward) go into the last bucket, every bucket lands,
    /// and every gradient must have been summed exactly once.
    pub fn finish<G: Elem>(&mut self, grads: &mut [G], rest: &[Range<usize>]) -> Result<()> {
        for r in rest {
            self.add(grads, r.clone());
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
    pub fn gather_mem(&self, planned: u64, measured: u64) -> Result<Vec<(u64, u64)>> {
        let split = |b: u64| [(b >> 24) as f32, (b & 0xFF_FFFF) as f32];
        let [a, b] = split(planned);
        let [c, d] = split(measured);
        let mine = [a, b, c, d];
        let mut all = vec![0.0f32; 4 * self.size()];
        self.comm
            .all_gather(&mine, &mut all)
            .map_err(|e| anyhow!("data-parallel memory all-gather: {e}"))?;
        let join = |h: f32, l: f32| ((h as u64) << 24) | l as u64;
        Ok(all
            .chunks(4)
            .map(|c| (join(c[0], c[1]), join(c[2], c[3])))
            .collect())
    }

    /// Stops every rank (a failed rank's error, so the others do not wait for it).
    pub fn abort(&self, cause: &str) {
        self.comm.abort(cause);
    }
}

/// The parameter tensors of `table` the backward does not report (an untied LM head).
pub fn unreported(table: &ParamTable) -> Vec<Range<usize>> {
    if table.lm_head == table.embed {
        vec![]
    } else {
        vec![table.lm_head.clone()]
    }
}
