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
//!
//! **ZeRO-1** (Rajbhandari et al. 2020, §5.1, P_os) shards the optimizer states and the fp32
//! master weights: every bucket is cut into `dp` equal blocks and rank r owns block r of each
//! ([`Shard`]). A bucket is then reduce-scattered instead of all-reduced, so each rank receives
//! only the sums it updates; after AdamW has updated its blocks, the ranks all-gather the
//! parameters bucket by bucket ([`DataParallel::all_gather`]). The volume per rank is the
//! all-reduce's (a reduce-scatter plus an all-gather, §7.2.1).
//!
//! The buckets and shards are the planner's (`ferrotron_plan::dp_layout`: lengths from the
//! plan, laid out once over the order in which the backward reports gradients final,
//! [`report_order`]); [`DataParallel::add`] checks every report against that layout.

use crate::device_reduce::{grads_of, DeviceAdd, DeviceReduce, Owned};
use crate::group::Group;
use crate::small_sums::{gather_mem, gather_small, SmallSums};
use crate::{Communicator, Pending, Region};
use anyhow::{anyhow, bail, Result};
use ferrotron_engine::kernels::host_copy::{add_f32, read_f32, write_f32, HostCopy};
use ferrotron_engine::model::{GradBuf, GradsDone, ParamTable, Unit};
use ferrotron_engine::Elem;
use ferrotron_plan::comm::{bytes_per_rank, Collective};
use ferrotron_plan::dp_layout::BucketLayout;
pub use ferrotron_plan::dp_layout::{Piece, Segment, Shard};
use ferrotron_plan::DType;
use std::cell::{RefCell, RefMut};
use std::collections::VecDeque;
use std::ops::Range;
use std::time::{Duration, Instant};

/// How the gradients are cut into buckets (the plan's `StateLens::bucket`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buckets {
    /// Buckets of this many f32 elements, in report order (`--bucket-mb`).
    Fixed(usize),
    /// One bucket per unit of the model (ZeRO-3), the largest of this many f32 elements.
    Units(usize),
}

/// Where a bucket's sums land: back into the gradients the backward wrote (without ZeRO every
/// sum, under ZeRO-1 this rank's blocks), or under ZeRO-2 added into this rank's shard of the
/// reduced gradients (the backward's windows are reused by then).
pub struct Sums<'a, 'b, G> {
    pub grads: &'a mut (dyn GradBuf<G> + 'b),
    /// ZeRO-2: this rank's reduced gradients, summed over the step's micro-batches.
    pub shard: Option<ferrotron_engine::kernels::ViewMut<'a, G>>,
}

/// What a ZeRO-1 all-gather reads from this rank and writes on every rank.
pub trait Gather {
    /// This rank's values of `seg` into `out`.
    fn own(&self, seg: &Segment, out: &mut [f32]);
    /// Every rank's values of the parameter range `r`.
    fn put(&mut self, r: Range<usize>, values: &[f32]);
}

/// What [`DataParallel::counters`] saves.
#[derive(Debug, Clone, Copy)]
pub struct Counters {
    bytes: f64,
    spans: usize,
    exposed: Duration,
}

/// Expert parallelism's routed experts: their gradient ranges (sorted) and their own
/// reduction over the ranks holding the same experts (none when no other rank does).
struct Experts {
    ranges: Vec<Range<usize>>,
    inner: Option<Box<DataParallel>>,
}

/// The routed experts' parameter ranges of `table` (the ones it holds), sorted.
pub fn expert_ranges(table: &ParamTable) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = each_expert_range(table).collect();
    out.sort_by_key(|r| r.start);
    out
}

/// The routed experts' parameter ranges of `table` (the ones it holds), layer by layer and
/// expert by expert, each expert's three in offset order (the inventory's order, so sorted
/// as [`expert_ranges`] is), without allocating: for a sum over them every step.
pub fn each_expert_range(table: &ParamTable) -> impl Iterator<Item = Range<usize>> + '_ {
    table
        .layers
        .iter()
        .filter_map(|l| l.moe.as_ref())
        .flat_map(|m| &m.experts)
        .flat_map(|e| {
            let mut three = [e.gate.clone(), e.up.clone(), e.down.clone()];
            three.sort_unstable_by_key(|r| r.start);
            three
        })
        .filter(|r| !r.is_empty())
}

/// A bucket's f32 buffer, reused every step: a span of the plan's `dp.grad_buckets`.
struct Bucket {
    buf: Region<f32>,
    /// The bucket of the layout it is filling.
    index: usize,
    /// Its next piece.
    next: usize,
}

/// A bucket whose reduction is running (its buffer is the communicator's meanwhile).
struct InFlight {
    pending: Pending,
    index: usize,
    name: &'static str,
    start: Instant,
}

/// A collective of this step: started, waited for from `waited` (the rank blocked), landed.
#[derive(Debug, Clone, Copy)]
pub struct CommSpan {
    pub name: &'static str,
    pub start: Instant,
    pub waited: Instant,
    pub end: Instant,
}

pub struct DataParallel {
    /// The communicator, the bytes this rank sent (as the ring algorithms send them:
    /// `ferrotron_plan::comm::bytes_per_rank`, the planner's formula) and the first error of
    /// a collective, reported when the step finishes.
    group: Group,
    /// Elements per bucket.
    bucket_len: usize,
    layout: BucketLayout,
    /// ZeRO-1: this rank's blocks (`None`: buckets are all-reduced, every rank updates all).
    shard: Option<Shard>,
    /// The bucket being filled, and the one free for filling (two in all, both allocated with
    /// the gradients and reused every step).
    filling: Option<Bucket>,
    spare: Vec<Bucket>,
    in_flight: VecDeque<InFlight>,
    /// The bucket the next report goes into once the filling one is full.
    next_bucket: usize,
    /// Gradient elements put into buckets this step (a check that every gradient was).
    reduced: usize,
    /// An untied LM head: its gradient is final once the head's forward has run, and goes
    /// into the buckets with the final norm's.
    untied_head: Option<Range<usize>>,
    /// Expert parallelism: the routed experts' gradients, reduced apart.
    experts: Option<Experts>,
    /// ZeRO-3: one bucket per unit ([`Buckets::Units`]), and its all-gather buffer (one unit,
    /// padded) and the bucket gathering in it.
    per_unit: bool,
    gather: Region<f32>,
    gathering: Option<(usize, Pending, Instant)>,
    /// Every rank's few values of the step's small collectives (loss, gradient norm, peak
    /// bytes), reused every step.
    small: RefCell<Region<f32>>,
    /// This step's collectives (the trace's communication track), and the time the rank spent
    /// blocked on them: the communication the backward did not hide.
    pub spans: Vec<CommSpan>,
    pub exposed: Duration,
    /// On a device (`--device emulated`): the copies between its gradients and the buckets,
    /// which stage the reduction through the host (`device_ranks`).
    device: Option<HostCopy>,
    /// On GPUs with NCCL: the gradients summed in place on the device instead
    /// (`device_reduce.rs`), the buckets unused.
    in_place: Option<Box<dyn DeviceReduce>>,
    /// ZeRO-1/2 on NCCL: every rank's segments (parameters, owner, offset in the owner's
    /// shard), by their start.
    owners: Vec<(Range<usize>, usize, usize)>,
    /// Where this group's blocks start in a rank's shard: past the dense blocks for the
    /// experts' replicas under expert parallelism, else 0.
    shard_base: usize,
    /// ZeRO-2/3 on NCCL with gradient accumulation: each segment is summed in place into its
    /// owner's window, which this adds into the owner's shard.
    accumulate: Option<DeviceAdd>,
}

impl DataParallel {
    /// The reduction of the gradients of `table` over `comm` in the plan's buckets
    /// (`ferrotron_plan::dp_layout::StateLens::bucket`), reduce-scattered into shards of the
    /// plan's `shard` elements when given (ZeRO-1/2/3). The buckets are allocated by
    /// [`DataParallel::allocate`], with the gradients.
    pub fn new(
        comm: Box<dyn Communicator>,
        table: &ParamTable,
        buckets: Buckets,
        shard: Option<u64>,
    ) -> Result<Self> {
        Self::of(comm, table, buckets, shard, &|_| true)
    }

    /// Expert parallelism (`--ep`): the dense gradients summed over `dense` (every dp × ep
    /// replica), in buckets of `dense_len`; the routed experts' over `experts` (the dp ranks
    /// holding the same experts; `None` when there is one), in buckets of `experts_len`.
    /// With `shards` (ZeRO-1: the plan's dense and experts' shards) each group shards what it
    /// reduces, as Megatron-Core's distributed optimizer shards the dense states over the
    /// data-parallel group and the experts' over the expert-data-parallel group: a rank's
    /// states are its dense blocks, then its blocks of its experts (offset past the dense ones).
    pub fn expert_parallel(
        dense: Box<dyn Communicator>,
        experts: Option<Box<dyn Communicator>>,
        table: &ParamTable,
        (dense_len, experts_len): (usize, usize),
        shards: Option<(u64, u64)>,
    ) -> Result<Self> {
        let ranges = expert_ranges(table);
        let is_expert =
            |r: &Range<usize>| ranges.binary_search_by_key(&r.start, |x| x.start).is_ok();
        let mut dp = Self::of(
            dense,
            table,
            Buckets::Fixed(dense_len),
            shards.map(|s| s.0),
            &|r| !is_expert(r),
        )?;
        let base = dp.shard.as_ref().map_or(0, |s| s.len);
        let inner = match experts {
            Some(c) => {
                let (b, s) = (Buckets::Fixed(experts_len), shards.map(|s| s.1));
                let mut inner = Self::of(c, table, b, s, &is_expert)?;
                if let Some(s) = inner.shard.as_mut() {
                    s.segments.iter_mut().for_each(|g| g.at += base);
                }
                inner.shard_base = base;
                Some(Box::new(inner))
            }
            None => None,
        };
        dp.experts = Some(Experts { ranges, inner });
        Ok(dp)
    }

    /// The reduction of the gradients `keep` selects.
    fn of(
        comm: Box<dyn Communicator>,
        table: &ParamTable,
        buckets: Buckets,
        shard: Option<u64>,
        keep: &dyn Fn(&Range<usize>) -> bool,
    ) -> Result<Self> {
        let (rank, ranks) = (comm.rank(), comm.size());
        let blocks = if shard.is_some() { ranks } else { 1 };
        let (layout, bucket_len) = match buckets {
            Buckets::Fixed(len) => {
                let order: Vec<_> = report_order(table)
                    .into_iter()
                    .filter(|r| !r.is_empty() && keep(r))
                    .collect();
                (BucketLayout::fixed(&order, len, blocks), len.max(1))
            }
            Buckets::Units(len) => {
                let groups: Vec<_> = unit_groups(table).into_iter().map(|g| g.1).collect();
                (BucketLayout::per_unit(&groups, blocks), len)
            }
        };
        if let Some(k) = layout.len.iter().position(|&n| n > bucket_len) {
            bail!(
                "internal: data-parallel bucket {k} holds {} elements, the plan's buckets {bucket_len}",
                layout.len[k]
            );
        }
        let shard = match shard {
            Some(n) => Some(Shard::planned(&layout, rank, ranks, n).map_err(anyhow::Error::msg)?),
            None => None,
        };
        Ok(DataParallel {
            small: RefCell::new(vec![0.0; 4 * ranks].into()),
            group: Group::new(comm),
            bucket_len,
            layout,
            shard,
            filling: None,
            spare: Vec::with_capacity(2),
            in_flight: VecDeque::with_capacity(2),
            next_bucket: 0,
            reduced: 0,
            untied_head: unreported(table),
            per_unit: matches!(buckets, Buckets::Units(_)),
            gather: Region::default(),
            gathering: None,
            spans: Vec::new(),
            exposed: Duration::ZERO,
            experts: None,
            device: None,
            in_place: None,
            owners: Vec::new(),
            shard_base: 0,
            accumulate: None,
        })
    }

    /// The two buckets, as the plan allocates `comm.dp.grad_buckets` with the gradients: the
    /// buffer's two halves, each handed to the communicator and back; and ZeRO-3's all-gather
    /// buffer (the plan's `comm.zero3.gather`). `planned(name, parts)` is the plan's buffer
    /// `name` in `parts` equal spans (the rank's resident region, at the plan's offsets).
    pub fn allocate(&mut self, planned: &mut dyn FnMut(&str, usize) -> Vec<Region<f32>>) {
        self.allocate_as("comm.dp.grad_buckets", planned)
    }

    /// [`DataParallel::allocate`] from the plan's buffer `buckets` (the experts' reduction has
    /// its own: `comm.dp.expert_grad_buckets`).
    fn allocate_as(
        &mut self,
        buckets: &str,
        planned: &mut dyn FnMut(&str, usize) -> Vec<Region<f32>>,
    ) {
        if let Some(inner) = self.experts.as_mut().and_then(|x| x.inner.as_mut()) {
            inner.allocate_as("comm.dp.expert_grad_buckets", planned);
        }
        if self.per_unit {
            self.gather = planned("comm.zero3.gather", 1).remove(0);
            assert_eq!(
                self.gather.len(),
                self.bucket_len,
                "internal: the plan's gather buffer"
            );
        }
        let spans = planned(buckets, 2);
        assert!(
            spans.iter().all(|s| s.len() == self.bucket_len),
            "internal: the plan's `{buckets}` is not two buckets of {}",
            self.bucket_len
        );
        let mut spans = spans.into_iter();
        let mut bucket = || Bucket {
            buf: spans.next().expect("two spans"),
            index: 0,
            next: 0,
        };
        self.filling = Some(bucket());
        self.spare = vec![bucket()];
        // Each bucket's reduction and all-gather, a few micro-batches' worth: kept between
        // steps, so the spans allocate nothing once the first steps have run.
        self.spans = Vec::with_capacity(4 * self.layout.pieces.len() + 8);
    }

    /// The gradients and weights live on a device: the buckets copy from and to it.
    pub fn on_device(&mut self, copy: HostCopy) {
        if let Some(inner) = self.experts.as_mut().and_then(|x| x.inner.as_mut()) {
            inner.on_device(copy.clone());
        }
        self.device = Some(copy);
    }

    /// The gradients (f32 or bf16, on a GPU of this rank's own) are summed in place by `reduce`
    /// (NCCL over the same ranks) instead of through the host's buckets: all of them, or under
    /// ZeRO each segment into its owner's copy or shard (and the updated weights gathered from
    /// the owners: ZeRO-1 and 2 after the update, [`DataParallel::gather_in_place`]; ZeRO-3
    /// unit by unit as the model asks, [`DataParallel::gather_unit_in_place`]); under expert
    /// parallelism refused where the experts have replicas unless their own group sums in
    /// place ([`DataParallel::experts_in_place`], first: with ZeRO-1 each group's segments
    /// into their owners' copies, as Megatron-Core's distributed optimizer shards the experts'
    /// states over the expert-data-parallel group).
    pub fn reduce_in_place(&mut self, reduce: Box<dyn DeviceReduce>) -> Result<()> {
        // Under expert parallelism the dense gradients are summed in place; the routed
        // experts' where no other rank holds them (no replicas to sum over), or where their
        // replicas' group sums in place too (`experts_in_place`, first).
        let inner = self.experts.as_ref().and_then(|x| x.inner.as_ref());
        if inner.is_some_and(|i| i.in_place.is_none()) {
            bail!("internal: the experts' replicas are summed in place first (experts_in_place)");
        }
        if self.shard.is_some() {
            let (ranks, base) = (self.group.size(), self.shard_base);
            self.owners = (0..ranks)
                .flat_map(|r| {
                    let s = Shard::new(&self.layout, r, ranks);
                    s.segments
                        .into_iter()
                        .map(move |g| (g.params, r, base + g.at))
                })
                .filter(|(p, ..)| !p.is_empty())
                .collect();
            self.owners.sort_by_key(|(p, ..)| p.start);
        }
        self.in_place = Some(reduce);
        Ok(())
    }

    /// Expert parallelism over data-parallel replicas: the group of the ranks holding this
    /// rank's experts (`None` where no other rank does).
    pub fn experts_group(&self) -> Option<&Group> {
        let inner = self.experts.as_ref()?.inner.as_ref()?;
        Some(&inner.group)
    }

    /// The routed experts' gradients summed in place over their replicas by `reduce` (NCCL over
    /// [`Self::experts_group`]), as the dense ones are by [`Self::reduce_in_place`] after it.
    pub fn experts_in_place(&mut self, reduce: Box<dyn DeviceReduce>) -> Result<()> {
        match self.experts.as_mut().and_then(|x| x.inner.as_mut()) {
            Some(inner) => inner.reduce_in_place(reduce),
            None => bail!("internal: no experts' replicas to sum in place"),
        }
    }

    /// ZeRO-2/3 on NCCL with gradient accumulation: each micro-batch's sums land in place in
    /// the owner's window and `add` adds them into its shard (NCCL's reduce would overwrite
    /// the shard's sum of the earlier micro-batches).
    pub fn accumulate_with(&mut self, add: DeviceAdd) {
        self.accumulate = Some(add);
    }

    /// ZeRO-1 on NCCL: every rank's weights `params` of each segment become its owner's, in
    /// place on the device, before the next forward (the host does not wait); `false` where
    /// the host's all-gather serves instead ([`DataParallel::gather_updated`]).
    pub fn gather_in_place<S: Elem>(
        &mut self,
        mut params: ferrotron_engine::kernels::ViewMut<'_, S>,
    ) -> Result<bool> {
        // The experts' segments from their owners among the experts' replicas first.
        if let Some(inner) = self.experts.as_mut().and_then(|x| x.inner.as_mut()) {
            let experts = inner.gather_in_place(params.rb())?;
            self.group.sent(inner.group.bytes.take());
            let dense = self.in_place.is_some() && !self.owners.is_empty() && !self.per_unit;
            if experts != dense {
                bail!("internal: the experts' weights and the dense ones gathered apart");
            }
        }
        // ZeRO-3 gathers nothing after the update (`gather_updated`).
        if self.owners.is_empty() || self.per_unit {
            return Ok(false);
        }
        let Some(reduce) = self.in_place.as_mut() else {
            return Ok(false);
        };
        let (p, width) = (self.group.size() as u64, S::DTYPE.bytes() as f64);
        let bytes = width * params.len() as f64;
        self.group
            .sent(bytes_per_rank(Collective::AllGather, bytes, p));
        let base = params.as_mut_ptr();
        let memory = params.memory();
        let mut parts = self.owners.iter().filter_map(|(r, owner, _)| {
            // SAFETY: each segment lies inside `params`, borrowed for the call; segments do
            // not overlap.
            let v = unsafe { view_at(base, r.start, r.len(), memory) };
            grads_of(v).map(|part| Owned {
                part,
                owner: *owner,
                into: None,
            })
        });
        (reduce.broadcast_owned(&mut parts))
            .and_then(|()| reduce.land())
            .map_err(|e| anyhow!("ZeRO-1 weights' gather: {e}"))?;
        Ok(true)
    }

    /// Whether ZeRO-3's units are gathered on the device ([`Self::gather_unit_in_place`])
    /// rather than through the host's gather buffer ([`Self::gather_start`]).
    pub fn gathers_in_place(&self) -> bool {
        self.per_unit && self.in_place.is_some() && !self.owners.is_empty()
    }

    /// ZeRO-3 on NCCL: starts gathering the weights of one unit (`unit`, every parameter of
    /// it) into its window (`windows`, where `place` puts a parameter range) from each
    /// segment's owner's `shard`, on the communication stream behind the compute stream's
    /// work so far (which may still read the window's last unit);
    /// [`Self::land_in_place`] orders the compute stream after it.
    pub fn gather_unit_in_place<S: Elem>(
        &mut self,
        unit: Range<usize>,
        shard: ferrotron_engine::kernels::View<'_, S>,
        mut windows: ferrotron_engine::kernels::ViewMut<'_, S>,
        place: &dyn Fn(&Range<usize>) -> Range<usize>,
    ) -> Result<()> {
        let Some(reduce) = self.in_place.as_mut() else {
            bail!("internal: ZeRO-3's gathers on the device need its communicator");
        };
        let (p, width) = (self.group.size() as u64, S::DTYPE.bytes() as f64);
        let bytes = width * unit.len() as f64;
        self.group
            .sent(bytes_per_rank(Collective::AllGather, bytes, p));
        let (me, wlen, wmem) = (self.group.rank(), windows.len(), windows.memory());
        let (base, sbase, slen) = (windows.as_mut_ptr(), shard.as_ptr().cast_mut(), shard.len());
        let mut parts = owners_in(&self.owners, unit).filter_map(|(r, owner, at)| {
            let w = place(r);
            assert!(w.end <= wlen, "internal: a segment past the ZeRO-3 windows");
            // SAFETY: each segment's place lies inside the windows (asserted), which the
            // caller borrows for the call; segments do not overlap. The owner's shard is only
            // read (a broadcast's source), inside the shard (the plan's offsets).
            let part = grads_of(unsafe { view_at(base, w.start, r.len(), wmem) })?;
            let into = (*owner == me).then(|| {
                assert!(at + r.len() <= slen, "internal: a segment past the shard");
                grads_of(unsafe { view_at(sbase, *at, r.len(), shard.memory()) })
            });
            Some(Owned {
                part,
                owner: *owner,
                into: into.flatten(),
            })
        });
        reduce
            .broadcast_owned(&mut parts)
            .map_err(|e| anyhow!("ZeRO-3 parameter gather: {e}"))
    }

    /// ZeRO-3 on NCCL: the compute stream's next work runs after the gathers started.
    pub fn land_in_place(&mut self) -> Result<()> {
        match self.in_place.as_mut() {
            Some(reduce) => (reduce.land()).map_err(|e| anyhow!("ZeRO-3 parameter gather: {e}")),
            None => Ok(()),
        }
    }

    /// The copies to and from the device the gradients live on (`None`: the host).
    pub fn device_copy(&self) -> Option<&HostCopy> {
        self.device.as_ref()
    }

    /// The data-parallel group (its communicator, bytes sent, first failure).
    pub fn group(&self) -> &Group {
        &self.group
    }

    pub fn size(&self) -> usize {
        self.group.size()
    }

    /// Under expert parallelism, this rank's place among the ranks holding its experts (0
    /// when no other rank does, and without expert parallelism).
    pub fn expert_rank(&self) -> (usize, usize) {
        match self.experts.as_ref().and_then(|x| x.inner.as_ref()) {
            Some(inner) => (inner.rank(), inner.size()),
            None => (0, 1),
        }
    }

    pub fn rank(&self) -> usize {
        self.group.rank()
    }

    /// Waits for every rank (outside the step: a merged trace).
    pub fn barrier(&self) -> Result<()> {
        self.group
            .comm
            .barrier()
            .map_err(|e| anyhow!("data-parallel barrier: {e}"))
    }

    /// This rank's ZeRO-1 shard (`None` without ZeRO; under expert parallelism, of the dense
    /// gradients).
    pub fn shard(&self) -> Option<&Shard> {
        self.shard.as_ref()
    }

    /// Under expert parallelism with ZeRO-1, this rank's shard of its experts among their
    /// data-parallel replicas (its segments' offsets follow the dense shard's); `None` without
    /// replicas (the rank holds its experts' states whole) or without ZeRO.
    pub fn expert_shard(&self) -> Option<&Shard> {
        let inner = self.experts.as_ref()?.inner.as_ref()?;
        inner.shard.as_ref()
    }

    /// The gradient ranges a backward report makes final (with the final norm's, an untied
    /// LM head's, final since the head's forward).
    pub fn ranges<'a>(&self, done: &GradsDone<'a>) -> impl Iterator<Item = Range<usize>> + 'a {
        let (one, two, layer) = match *done {
            GradsDone::FinalNorm(r) => (Some(r.clone()), self.untied_head.clone(), None),
            GradsDone::Embedding(r) => (Some(r.clone()), None, None),
            GradsDone::Layer(_, idx) => (None, None, Some(idx)),
        };
        one.into_iter()
            .chain(two)
            .chain(layer.into_iter().flat_map(|l| l.ranges().cloned()))
    }

    /// Gradients `range` are final on this rank: into their bucket, starting it once full.
    /// Sums that have arrived meanwhile are written back into `grads`.
    pub fn add<G: Elem>(&mut self, sums: &mut Sums<G>, mut range: Range<usize>) {
        if let Some(x) = self.experts.as_mut() {
            let mine = x
                .ranges
                .binary_search_by_key(&range.start, |r| r.start)
                .is_ok();
            if mine && !range.is_empty() {
                // Held by this rank alone without data-parallel replicas: nothing to sum.
                if let Some(inner) = x.inner.as_mut() {
                    inner.add(sums, range);
                }
                return;
            }
        }
        if self.in_place.is_some() {
            return self.add_in_place(sums, range);
        }
        // MPI progresses a started reduction only inside MPI calls: look in on the running
        // ones as the backward reports (a no-op for the threads backend's own worker).
        for f in &self.in_flight {
            f.pending.is_done();
        }
        self.poll();
        while !range.is_empty() {
            // No bucket: a collective failed and took one with it; finish reports it.
            let Some(b) = self.filling.as_mut() else {
                return;
            };
            let expected = self.layout.pieces.get(b.index).and_then(|p| p.get(b.next));
            let Some((piece, at)) = expected.cloned() else {
                let e = format!("gradients {range:?} arrived after the last bucket");
                self.group.fail(FAILED, e);
                return;
            };
            if piece.start != range.start || piece.end > range.end {
                let e = format!("gradients {range:?} arrived where the buckets expect {piece:?}");
                self.group.fail(FAILED, e);
                return;
            }
            let dst = &mut b.buf[at..at + piece.len()];
            read_f32(self.device.as_ref(), sums.grads.slice(piece.clone()), dst);
            b.next += 1;
            self.reduced += piece.len();
            range.start = piece.end;
            if b.next == self.layout.pieces[b.index].len() {
                self.launch(sums);
            }
        }
    }

    /// Starts the in-place sum of gradients `range` on the device; the bytes are its
    /// all-reduce's (ZeRO-1: its reduce-scatter's), in the gradients' type.
    fn add_in_place<G: Elem>(&mut self, sums: &mut Sums<G>, range: Range<usize>) {
        if !self.owners.is_empty() {
            return self.add_owned(sums, range);
        }
        let Some(reduce) = self.in_place.as_mut() else {
            return;
        };
        let Some(grads) = grads_of(sums.grads.slice_mut(range.clone())) else {
            let e = "the in-place device sum takes f32 or bf16 gradients".to_string();
            self.group.fail(FAILED, e);
            return;
        };
        let p = self.group.size() as u64;
        let bytes = grads.bytes() as f64;
        self.group
            .sent(bytes_per_rank(Collective::AllReduce, bytes, p));
        match reduce.start(grads) {
            Ok(()) => self.reduced += range.len(),
            Err(e) => self.group.fail(FAILED, e),
        }
    }

    /// ZeRO-1/2 on NCCL: starts summing each segment of gradients `range` into its owner's
    /// copy (ZeRO-1, in place) or shard (ZeRO-2, whose window the compute stream then waits
    /// for before it is cleared and reused).
    fn add_owned<G: Elem>(&mut self, sums: &mut Sums<G>, range: Range<usize>) {
        if !matches!(G::DTYPE, DType::F32 | DType::Bf16) {
            let e = "the in-place device sum takes f32 or bf16 gradients".to_string();
            self.group.fail(FAILED, e);
            return;
        }
        let (p, width) = (self.group.size() as u64, G::DTYPE.bytes() as f64);
        let bytes = width * range.len() as f64;
        self.group
            .sent(bytes_per_rank(Collective::ReduceScatter, bytes, p));
        let mut g = sums.grads.slice_mut(range.clone());
        let (base, memory) = (g.as_mut_ptr(), g.memory());
        let shard = sums
            .shard
            .as_mut()
            .map(|s| (s.as_mut_ptr(), s.len(), s.memory()));
        let me = self.group.rank();
        // With gradient accumulation the sums land in the window, then are added to the shard.
        let (shard, add_to) = match &self.accumulate {
            Some(_) => (None, shard),
            None => (shard, None),
        };
        let mut parts = owners_in(&self.owners, range.clone()).filter_map(|(r, owner, at)| {
            // SAFETY: each segment lies inside `range`, whose view is borrowed for the call;
            // segments do not overlap; an owner's offset lies inside its shard (the plan's).
            let v = unsafe { view_at(base, r.start - range.start, r.len(), memory) };
            let into = match shard {
                Some((s, len, m)) if *owner == me => {
                    assert!(at + r.len() <= len, "internal: a segment past the shard");
                    grads_of(unsafe { view_at(s, *at, r.len(), m) })
                }
                _ => None,
            };
            grads_of::<G>(v).map(|part| Owned {
                part,
                owner: *owner,
                into,
            })
        });
        let Some(reduce) = self.in_place.as_mut() else {
            return;
        };
        let started = reduce.start_owned(&mut parts);
        // ZeRO-2: the window is cleared and reused by the next unit: the sums first.
        let landed = started.and_then(|()| match sums.shard.is_some() {
            true => reduce.land(),
            false => Ok(()),
        });
        if let Err(e) = landed {
            return self.group.fail(FAILED, e);
        }
        // This rank's segments' sums, in its window, into its shard.
        if let (Some(add), Some((s, len, m))) = (&self.accumulate, add_to) {
            let mine = owners_in(&self.owners, range.clone()).filter(|(_, owner, _)| *owner == me);
            for (r, _, at) in mine {
                assert!(at + r.len() <= len, "internal: a segment past the shard");
                // SAFETY: as above: the segment inside `range`'s view, its place in the shard.
                let (acc, x) = unsafe {
                    let x = view_at(base, r.start - range.start, r.len(), memory);
                    (view_at(s, *at, r.len(), m), x)
                };
                if let (Some(acc), Some(x)) = (grads_of::<G>(acc), grads_of::<G>(x)) {
                    add(acc, x);
                }
            }
        }
        self.reduced += range.len();
    }

    /// Starts the reduction of the full bucket; the spare one becomes the filling one.
    fn launch<G: Elem>(&mut self, sums: &mut Sums<G>) {
        if self.spare.is_empty() {
            // Both buckets are busy: the oldest must land before this one can go.
            self.land_oldest(sums);
        }
        let Some(mut b) = std::mem::replace(&mut self.filling, self.spare.pop()) else {
            return;
        };
        let index = b.index;
        self.next_bucket = index + 1;
        if let Some(f) = self.filling.as_mut() {
            (f.index, f.next) = (self.next_bucket, 0);
        }
        // The communicator reduces the whole buffer: the last bucket sends only its pieces
        // (ZeRO-1: padded with zeros to whole blocks), in place in its span.
        b.buf.set_len(self.layout.used(index).min(b.buf.len()));
        b.buf.resize(self.layout.len[index], 0.0);
        let (p, bytes) = (self.group.size() as u64, 4.0 * b.buf.len() as f64);
        let (start, c) = (Instant::now(), self.reduction());
        self.group.sent(bytes_per_rank(c, bytes, p));
        let comm = &self.group.comm;
        let (pending, name) = match c {
            Collective::ReduceScatter => (comm.reduce_scatter_start(b.buf), "reduce-scatter"),
            _ => (comm.all_reduce_start(b.buf), "all-reduce"),
        };
        self.in_flight.push_back(InFlight {
            pending,
            index,
            name,
            start,
        });
    }

    /// Waits for the oldest bucket, writes its sums back into `grads` (ZeRO-1: this rank's
    /// block) and makes it spare.
    fn land_oldest<G: Elem>(&mut self, sums: &mut Sums<G>) {
        let Some(InFlight {
            pending,
            index,
            name,
            start,
        }) = self.in_flight.pop_front()
        else {
            return;
        };
        let waited = Instant::now();
        let landed = pending.wait();
        landed_now(&mut self.spans, &mut self.exposed, name, start, waited);
        match landed {
            Ok(mut buf) => {
                let dev = self.device.as_ref();
                let put = |g: ferrotron_engine::kernels::ViewMut<'_, G>, at: usize| {
                    let n = g.len();
                    write_f32(dev, &buf[at..at + n], g);
                };
                match (&self.shard, sums.shard.as_mut()) {
                    (Some(s), Some(shard)) => {
                        for seg in &s.segments[s.of_bucket[index].clone()] {
                            let sum = &buf[seg.in_bucket..seg.in_bucket + seg.params.len()];
                            let to = shard.rb().slice_mut(seg.at..seg.at + sum.len());
                            add_f32(dev, sum, to);
                        }
                    }
                    (Some(s), None) => {
                        for seg in &s.segments[s.of_bucket[index].clone()] {
                            put(sums.grads.slice_mut(seg.params.clone()), seg.in_bucket);
                        }
                    }
                    (None, _) => {
                        for (r, at) in &self.layout.pieces[index] {
                            put(sums.grads.slice_mut(r.clone()), *at);
                        }
                    }
                }
                buf.resize(self.bucket_len, 0.0);
                let spare = Bucket {
                    buf,
                    index: self.next_bucket,
                    next: 0,
                };
                match self.filling {
                    // After a failure took the filling bucket: fill this one.
                    None => self.filling = Some(spare),
                    Some(_) => self.spare.push(spare),
                }
            }
            Err(e) => self.group.fail(FAILED, e),
        }
    }

    /// Ends the micro-batch's reduction: every bucket lands, and every gradient must have
    /// been summed exactly once.
    pub fn finish<G: Elem>(&mut self, sums: &mut Sums<G>) -> Result<()> {
        if let Some(inner) = self.experts.as_mut().and_then(|x| x.inner.as_mut()) {
            inner.finish(sums)?;
            // One account of the step's communication.
            self.group.sent(inner.group.bytes.take());
            self.exposed += std::mem::take(&mut inner.exposed);
            self.spans.append(&mut inner.spans);
        }
        while !self.in_flight.is_empty() {
            self.land_oldest(sums);
        }
        if let Some(Err(e)) = self.in_place.as_mut().map(|r| r.land()) {
            self.group.fail(FAILED, e);
        }
        let reduced = std::mem::take(&mut self.reduced);
        self.next_bucket = 0;
        if let Some(f) = self.filling.as_mut() {
            (f.index, f.next) = (0, 0);
        }
        self.group.check()?;
        let total: usize = self.layout.pieces.iter().flatten().map(|p| p.0.len()).sum();
        if reduced != total {
            bail!("internal: {reduced} of {total} gradients were reduced");
        }
        Ok(())
    }

    /// ZeRO-1's all-gather, bucket by bucket: [`Gather::own`] fills this rank's block of a
    /// bucket from a segment of its shard; [`Gather::put`] receives every piece of the bucket,
    /// every rank's block (the updated parameters after the optimizer step; the full optimizer
    /// states for a checkpoint). Uses a gradient bucket, idle once the step's sums have landed.
    pub fn all_gather(&mut self, io: &mut dyn Gather) -> Result<()> {
        if let Some(inner) = self.experts.as_mut().and_then(|x| x.inner.as_mut()) {
            inner.all_gather(io)?;
            self.group.sent(inner.group.bytes.take());
            self.exposed += std::mem::take(&mut inner.exposed);
            self.spans.append(&mut inner.spans);
        }
        let Some(shard) = &self.shard else {
            return Ok(());
        };
        let Some(b) = self.filling.as_mut() else {
            bail!("internal: the data-parallel buckets are not allocated");
        };
        let p = self.group.size() as u64;
        for (k, pieces) in self.layout.pieces.iter().enumerate() {
            let mut buf = std::mem::take(&mut b.buf);
            buf.set_len(0);
            buf.resize(self.layout.len[k], 0.0);
            for seg in &shard.segments[shard.of_bucket[k].clone()] {
                io.own(
                    seg,
                    &mut buf[seg.in_bucket..seg.in_bucket + seg.params.len()],
                );
            }
            let bytes = 4.0 * buf.len() as f64;
            self.group
                .sent(bytes_per_rank(Collective::AllGather, bytes, p));
            let start = Instant::now();
            let gathered = self.group.comm.all_gather_start(buf).wait();
            landed_now(
                &mut self.spans,
                &mut self.exposed,
                "all-gather",
                start,
                start,
            );
            let buf = gathered.map_err(|e| anyhow!("ZeRO all-gather: {e}"))?;
            for (r, at) in pieces {
                io.put(r.clone(), &buf[*at..at + r.len()]);
            }
            b.buf = buf;
        }
        b.buf.resize(self.bucket_len, 0.0);
        Ok(())
    }

    /// After the optimizer step: under ZeRO-1 and 2 every rank updated its blocks, and the
    /// ranks gather the others' ([`DataParallel::all_gather`]); ZeRO-3 gathers each unit when
    /// it is next needed, and without a shard every rank updated everything.
    pub fn gather_updated(&mut self, io: &mut dyn Gather) -> Result<()> {
        match self.per_unit {
            true => Ok(()),
            false => self.all_gather(io),
        }
    }

    /// ZeRO-3: starts the all-gather of bucket `k` (one unit's parameters) in the gather
    /// buffer, where `own` puts this rank's block from its shard. One runs at a time: it is
    /// waited for ([`DataParallel::gather_wait`]) before the next starts.
    pub fn gather_start(&mut self, k: usize, own: &mut dyn FnMut(&Segment, &mut [f32])) {
        let Some(shard) = &self.shard else {
            return;
        };
        let mut buf = std::mem::take(&mut self.gather);
        buf.set_len(0);
        buf.resize(self.layout.len[k], 0.0);
        for seg in &shard.segments[shard.of_bucket[k].clone()] {
            own(
                seg,
                &mut buf[seg.in_bucket..seg.in_bucket + seg.params.len()],
            );
        }
        let p = self.group.size() as u64;
        let bytes = 4.0 * buf.len() as f64;
        self.group
            .sent(bytes_per_rank(Collective::AllGather, bytes, p));
        let pending = self.group.comm.all_gather_start(buf);
        self.gathering = Some((k, pending, Instant::now()));
    }

    /// ZeRO-3: waits for the running all-gather; returns the pieces of its bucket (parameter
    /// range, offset) and the gathered values.
    pub fn gather_wait(&mut self) -> Result<(&[Piece], &[f32])> {
        let Some((k, pending, start)) = self.gathering.take() else {
            bail!("internal: no ZeRO-3 all-gather is running");
        };
        let waited = Instant::now();
        let landed = pending.wait();
        landed_now(
            &mut self.spans,
            &mut self.exposed,
            "all-gather",
            start,
            waited,
        );
        self.gather = landed.map_err(|e| anyhow!("ZeRO-3 parameter all-gather: {e}"))?;
        Ok((&self.layout.pieces[k], &self.gather[..]))
    }

    /// Advances a running ZeRO-3 all-gather (MPI progresses only inside MPI calls).
    pub fn poll(&self) {
        if let Some((_, p, _)) = &self.gathering {
            p.is_done();
        }
        if let Some(inner) = self.experts.as_ref().and_then(|x| x.inner.as_ref()) {
            inner.poll();
        }
    }

    /// The step's communication so far (bytes, collectives, exposed time): communication
    /// outside a step (an evaluation, a checkpoint's gathers) is undone from them with
    /// [`DataParallel::set_counters`].
    pub fn counters(&self) -> Counters {
        Counters {
            bytes: self.group.bytes.get(),
            spans: self.spans.len(),
            exposed: self.exposed,
        }
    }

    pub fn set_counters(&mut self, c: Counters) {
        self.group.bytes.set(c.bytes);
        self.exposed = c.exposed;
        self.spans.truncate(c.spans);
    }

    /// How buckets are reduced: all-reduced, or reduce-scattered into shards (ZeRO).
    fn reduction(&self) -> Collective {
        match self.shard {
            Some(_) => Collective::ReduceScatter,
            None => Collective::AllReduce,
        }
    }

    /// The loss sum and target count of every rank, summed (each rank reports the same).
    pub fn sum_loss(&mut self, sum: f64, count: usize) -> Result<(f64, usize)> {
        let mut small = self.small.borrow_mut();
        let all = gather_small(
            self.group.comm.as_ref(),
            &mut small,
            &[sum as f32, count as f32],
            "data-parallel loss",
        )?;
        let (sum, count) = all
            .chunks(2)
            .fold((0.0, 0.0), |(s, c), x| (s + x[0], c + x[1]));
        Ok((sum as f64, count as usize))
    }

    /// Every rank's `(planned, measured)` bytes, rank order.
    pub fn gather_mem(&mut self, mine: [u64; 3], out: &mut Vec<[u64; 3]>) -> Result<()> {
        gather_mem(
            self.group.comm.as_ref(),
            &mut self.small.borrow_mut(),
            mine,
            out,
        )
    }
}

/// The segments of `owners` (every rank's, by their start: [`DataParallel::reduce_in_place`]'s
/// table of parameters, owner and offset in the owner's shard) inside parameters `r`.
fn owners_in(
    owners: &[(Range<usize>, usize, usize)],
    r: Range<usize>,
) -> impl Iterator<Item = &(Range<usize>, usize, usize)> {
    let first = owners.partition_point(|(p, ..)| p.start < r.start);
    owners[first..]
        .iter()
        .take_while(move |(p, ..)| p.end <= r.end)
}

/// `len` elements of `memory` at element `at` of `base`, as a view.
///
/// # Safety
/// The elements lie inside one live allocation, not aliased by another live view.
unsafe fn view_at<'a, G>(
    base: *mut G,
    at: usize,
    len: usize,
    memory: crate::Memory,
) -> ferrotron_engine::kernels::ViewMut<'a, G> {
    let p = std::ptr::NonNull::new(base.add(at)).expect("never null");
    ferrotron_engine::kernels::ViewMut::from_raw_parts(p, len, memory)
}

/// What the group's first failure of a step is reported as.
const FAILED: &str = "data-parallel gradient reduction";

/// A collective started at `start` landed now; the rank blocked on it from `waited`.
fn landed_now(
    spans: &mut Vec<CommSpan>,
    exposed: &mut Duration,
    name: &'static str,
    start: Instant,
    waited: Instant,
) {
    let end = Instant::now();
    *exposed += end.saturating_duration_since(waited);
    spans.push(CommSpan {
        name,
        start,
        waited,
        end,
    });
}

/// The parameter tensor of `table` the backward does not report (an untied LM head).
pub fn unreported(table: &ParamTable) -> Option<Range<usize>> {
    (table.lm_head != table.embed).then(|| table.lm_head.clone())
}

/// The gradient ranges in the order the backward makes them final (`Llama::backward_notify`:
/// the final norm with the [`unreported`] LM head, the layers last to first, each in
/// `LayerIdx::ranges` order, the embedding), by unit. The buckets are laid out in this order,
/// and [`DataParallel::add`] refuses a report that departs from it.
pub fn unit_groups(table: &ParamTable) -> Vec<(Unit, Vec<Range<usize>>)> {
    let mut head = vec![table.norm.clone()];
    head.extend(unreported(table));
    let mut groups = vec![(Unit::Head, head)];
    for (i, l) in table.layers.iter().enumerate().rev() {
        groups.push((Unit::Layer(i), l.ranges().cloned().collect()));
    }
    groups.push((Unit::Embedding, vec![table.embed.clone()]));
    groups
}

/// [`unit_groups`], one after the other.
pub fn report_order(table: &ParamTable) -> Vec<Range<usize>> {
    unit_groups(table).into_iter().flat_map(|g| g.1).collect()
}

impl SmallSums for DataParallel {
    fn comm(&self) -> &dyn Communicator {
        self.group.comm.as_ref()
    }
    fn small(&self) -> RefMut<'_, Region<f32>> {
        self.small.borrow_mut()
    }
}
