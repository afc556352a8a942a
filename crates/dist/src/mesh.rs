//! A rank's place in every parallel dimension, built once at start-up from the layout's groups
//! (`run::model_groups` splits them from the world as the planner's grid places them): the
//! model's groups (tensor, expert and context parallelism, one [`Group`] type, keyed by the
//! dimension), the data-parallel reduction, the pipeline stage and, when the model is split,
//! the world. The small helpers that span dimensions live here: the first failure of any
//! group, the planned buffers, the bytes each dimension sent against the plan, every rank's
//! memory, the barrier.

use crate::comm_bytes::{dim_index, CommByDim, CommBytes};
use crate::data_parallel::DataParallel;
use crate::group::Group;
use crate::pipeline::Pipeline;
use crate::small_sums::SmallSums;
use crate::{Communicator, Dim};
use anyhow::Result;
use std::cell::RefCell;
use std::rc::Rc;

pub struct Mesh {
    /// The groups the model's collectives go through, by dimension (`Dim::Tp`, `Dim::Ep`,
    /// `Dim::Cp`).
    groups: Vec<(Dim, Rc<Group>)>,
    /// This rank's part in data parallelism (`None`: one replica).
    pub dp: Option<DataParallel>,
    /// This rank's pipeline stage.
    pub pp: Option<Pipeline>,
    /// With the model split over ranks, every rank (for `rank_mem`), and a small buffer for it.
    world: Option<(Box<dyn Communicator>, crate::Region<f32>)>,
    /// Every rank's memory as `gather_mem` last gathered it: sized for the ranks it gathers
    /// over when the mesh is built, so a step allocates nothing for it.
    mems: Vec<[u64; 3]>,
    /// The planner's bytes per step and rank of each dimension this rank sends in.
    planned: [Option<u64>; 5],
    /// Sequence parallelism: the norms' gradients are partial on each tensor-parallel rank.
    sp: bool,
}

/// The plan's buffer of a model group's collectives (allocated with the first step).
fn planned_buffer(d: Dim) -> &'static str {
    match d {
        Dim::Tp => "comm.tp.staging",
        Dim::Ep => "comm.ep.message",
        Dim::Cp => "comm.cp.message",
        Dim::Dp | Dim::Pp => "",
    }
}

impl Mesh {
    /// The mesh of a rank's groups: the model's (tensor, expert and context parallelism), the
    /// data-parallel reduction, the pipeline stage, and the world when the model is split.
    pub fn new(
        tp: Option<Rc<Group>>,
        ep: Option<Rc<Group>>,
        cp: Option<Rc<Group>>,
        dp: Option<DataParallel>,
        pp: Option<Pipeline>,
        world: Option<Box<dyn Communicator>>,
        sp: bool,
    ) -> Self {
        let groups = [(Dim::Tp, tp), (Dim::Ep, ep), (Dim::Cp, cp)];
        let ranks = match (&world, &dp) {
            (Some(w), _) => w.size(),
            (None, Some(d)) => d.size(),
            (None, None) => 0,
        };
        Mesh {
            groups: (groups.into_iter())
                .filter_map(|(d, g)| Some((d, g?)))
                .collect(),
            dp,
            pp,
            world: world.map(|w| (w, Default::default())),
            mems: Vec::with_capacity(ranks),
            planned: [None; 5],
            sp,
        }
    }

    /// The group over which the norms' gradients are summed once final (sequence
    /// parallelism's partial norms; `None` when they are whole on every rank).
    pub fn partial_norms(&self) -> Option<Rc<Group>> {
        self.group(Dim::Tp).filter(|_| self.sp).cloned()
    }

    /// The model's group of dimension `d`, if the rank has one.
    pub fn group(&self, d: Dim) -> Option<&Rc<Group>> {
        self.groups.iter().find(|(g, _)| *g == d).map(|(_, g)| g)
    }

    /// Ranks of dimension `d`'s model group (1 without one).
    pub fn size(&self, d: Dim) -> usize {
        self.group(d).map_or(1, |g| g.size())
    }

    /// The dimensions this rank communicates in (no estimate for one rank alone).
    pub fn dims(&self) -> Vec<Dim> {
        let mut dims: Vec<Dim> = self.groups.iter().map(|(d, _)| *d).collect();
        if self.dp.is_some() {
            dims.push(Dim::Dp);
        }
        dims
    }

    /// The planner's bytes per step of each dimension this rank sends in (`planned`, asked only
    /// when there is one).
    pub fn plan_bytes<F: Fn(Dim) -> u64>(
        &mut self,
        planned: impl FnOnce() -> Result<F>,
    ) -> Result<()> {
        let dims = self.dims();
        if !dims.is_empty() {
            let planned = planned()?;
            for d in dims {
                self.planned[dim_index(d)] = Some(planned(d));
            }
        }
        Ok(())
    }

    /// Dimension `d`'s collectives run on NCCL in their elements' own type of `width` bytes
    /// (data parallelism's gradients, tensor parallelism's activations), where the plan prices
    /// the host's f32 buffers: its bytes scaled so.
    pub fn sums_in(&mut self, d: Dim, width: u64) {
        if let Some(p) = self.planned[dim_index(d)].as_mut() {
            *p = *p * width / 4;
        }
    }

    /// The model's tensors live on a device: its groups' exchanges copy through `copy`.
    pub fn on_device(&self, copy: &ferrotron_engine::kernels::HostCopy) {
        for (_, g) in &self.groups {
            g.on_device(copy.clone());
        }
    }

    /// The first failure of a model group's collective in the pass, if one failed.
    pub fn check(&self) -> Result<()> {
        self.groups.iter().try_for_each(|(_, g)| g.check())
    }

    /// The model groups' planned buffers (`planned`: a plan buffer by name, as one region of
    /// the rank's resident region; `None` when the plan has none of that name).
    pub fn allocate(&self, planned: &mut dyn FnMut(&str) -> Option<crate::Region<f32>>) {
        for (d, g) in &self.groups {
            if let Some(r) = planned(planned_buffer(*d)) {
                g.allocate(r);
            }
            // A device rank's ring receive (`Runtime::FerrotronDevice` plans it), asked for by
            // the context-parallel group alone: a buffer is carved once.
            if *d == Dim::Cp {
                if let Some(r) = planned("comm.cp.receive") {
                    g.allocate_receive(r);
                }
            }
        }
    }

    /// Bytes each dimension sent since the last call, beside the plan's, keyed by the
    /// dimension's name (`dp` counts the gradient reductions and ZeRO's gathers).
    pub fn take_comm_bytes(&mut self) -> CommByDim {
        let mut out = CommByDim::default();
        let mut put = |d: Dim, sent: u64| {
            if let Some(planned) = self.planned[dim_index(d)] {
                out.insert(d, CommBytes { sent, planned });
            }
        };
        for (d, g) in &self.groups {
            put(*d, g.take_bytes());
        }
        if let Some(dp) = &self.dp {
            put(Dim::Dp, dp.group().take_bytes());
        }
        out
    }

    /// Every rank's `[planned, measured, workspace]` bytes (over the world when the model is
    /// split, else over the data-parallel group; `None` alone).
    pub fn gather_mem(&mut self, mine: [u64; 3]) -> Result<Option<&[[u64; 3]]>> {
        let out = &mut self.mems;
        match (&mut self.world, &mut self.dp) {
            (Some((w, small)), _) => crate::small_sums::gather_mem(w.as_ref(), small, mine, out)?,
            (None, Some(dp)) => dp.gather_mem(mine, out)?,
            (None, None) => return Ok(None),
        }
        Ok(Some(out))
    }

    /// Waits for every rank (nothing alone).
    pub fn barrier(&self) -> Result<()> {
        match (&self.world, &self.dp) {
            (Some((w, _)), _) => w.barrier().map_err(|e| anyhow::anyhow!("barrier: {e}")),
            (None, Some(d)) => d.barrier(),
            (None, None) => Ok(()),
        }
    }

    /// The world, when the model is split over ranks.
    pub fn world(&self) -> Option<&dyn Communicator> {
        self.world.as_ref().map(|(w, _)| w.as_ref())
    }
}

/// The model groups' byte counters, put aside while something that is not the step talks
/// (an evaluation), and put back after.
pub struct SavedBytes([f64; 4]);

impl Mesh {
    pub fn save_bytes(&self) -> SavedBytes {
        let mut b = [0.0; 4];
        for (x, (_, g)) in b.iter_mut().zip(&self.groups) {
            *x = g.bytes.get();
        }
        SavedBytes(b)
    }

    pub fn restore_bytes(&self, saved: SavedBytes) {
        for (x, (_, g)) in saved.0.iter().zip(&self.groups) {
            g.bytes.set(*x);
        }
    }
}

/// What the dimensions report of a step: bytes sent against the plan, the data-parallel
/// communication the backward did not hide, the pipeline's bubble against the plan's.
pub struct StepComm {
    pub comm: CommByDim,
    pub exposed_ms: Option<f64>,
    pub bubble: Vec<f64>,
    pub bubble_planned: Option<f64>,
}

impl Mesh {
    /// The step's report ([`StepComm`]) over `grad_acc` micro-batches; each blocking span of
    /// the step goes to `span` (the trace's communication track).
    pub fn take_step_comm(
        &mut self,
        grad_acc: u64,
        span: &mut dyn FnMut(&'static str, std::time::Instant, std::time::Instant),
    ) -> Result<StepComm> {
        let mut exposed_ms = None;
        if let Some(dp) = &mut self.dp {
            exposed_ms = Some(std::mem::take(&mut dp.exposed).as_secs_f64() * 1e3);
            for c in &dp.spans {
                span(c.name, c.start, c.end);
            }
            dp.spans.clear();
        }
        let (mut bubble, mut bubble_planned) = (Vec::new(), None);
        if let Some(pp) = &mut self.pp {
            for &(a, b) in &pp.waits {
                span("pp.wait", a, b);
            }
            pp.waits.clear();
            bubble = pp.take_bubbles()?;
            bubble_planned = Some(pp.planned_bubble(grad_acc));
        }
        Ok(StepComm {
            comm: self.take_comm_bytes(),
            exposed_ms,
            bubble,
            bubble_planned,
        })
    }

    /// Ranks computing in parallel on one replica's model: tensor-parallel ranks times
    /// pipeline stages (MFU is against all of their peaks).
    pub fn model_ranks(&self) -> usize {
        self.size(Dim::Tp) * self.pp.as_ref().map_or(1, |p| p.stages())
    }

    /// Data-parallel replicas (1 alone).
    pub fn replicas(&self) -> usize {
        self.dp.as_ref().map_or(1, |d| d.size())
    }

    /// This rank's data-parallel rank (0 alone).
    pub fn replica(&self) -> usize {
        self.dp.as_ref().map_or(0, |d| d.rank())
    }
}

impl Mesh {
    /// Whether a group splits the weights over its ranks, each holding slices of the
    /// matrices and a copy of every norm (tensor parallelism).
    pub fn splits_weights(&self) -> bool {
        self.group(Dim::Tp).is_some()
    }

    /// The share of a replicated tensor's Σg² this rank counts: each rank of a group that
    /// splits the weights holds a copy, which counts once over the group.
    pub fn replicated_share(&self) -> f64 {
        1.0 / self.size(Dim::Tp) as f64
    }

    /// Whether a group splits the routed experts, each expert's gradient on one of its ranks
    /// (expert parallelism).
    pub fn splits_experts(&self) -> bool {
        self.group(Dim::Ep).is_some()
    }

    /// The loss summed over the ranks that share each sequence's tokens (context parallelism:
    /// each evaluated its share of the positions); as it is without such a group.
    pub fn sum_over_sequence(&self, sum: f64, count: usize) -> Result<(f64, usize)> {
        match self.group(Dim::Cp) {
            Some(cp) => {
                let [sum, count] = cp.sum_f64([sum, count as f64], "context-parallel sum")?;
                Ok((sum, count.round() as usize))
            }
            None => Ok((sum, count)),
        }
    }

    /// The model's Σg² from this rank's part `local`, the same number on every rank: each
    /// group that splits the gradients adds its ranks' parts. Tensor parallelism: each rank
    /// holds its slices (and 1/t of every replicated norm). Expert parallelism: each expert's
    /// gradient is on one rank of the group, the dense ones on all (`experts`: this rank's
    /// experts' part of `local`, `None` when ZeRO's data-parallel sum covers them). Pipeline:
    /// each stage holds its layers. ZeRO (`sharded`): each rank holds the sums of its shard.
    pub fn global_sum_sq(
        &self,
        local: f64,
        experts: Option<f64>,
        sharded: Option<&RefCell<DataParallel>>,
    ) -> Result<f64> {
        let mut sum_sq = local;
        if let Some(tp) = self.group(Dim::Tp) {
            [sum_sq] = tp.sum_f64([sum_sq], "tensor-parallel gradient norm")?;
        }
        if let (Some(ep), Some(experts)) = (self.group(Dim::Ep), experts) {
            sum_sq += ep.sum_f64([experts], "expert-parallel gradient norm")?[0] - experts;
        }
        if let Some(pp) = &self.pp {
            [sum_sq] = pp.sum_f64([sum_sq], "pipeline gradient norm")?;
        }
        if let Some(dp) = sharded {
            [sum_sq] = dp
                .borrow()
                .sum_f64([sum_sq], "data-parallel gradient norm")?;
        }
        Ok(sum_sq)
    }
}
