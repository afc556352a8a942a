//! Expert parallelism (GShard, Lepikhin et al. 2020; Megatron-Core's all-to-all token
//! dispatcher): each rank of a group of `ep` holds `E/ep` of every MoE layer's experts and all
//! the dense weights, and trains on its own tokens. Per MoE layer:
//!
//! ```text
//! forward   route locally → copies grouped by expert → all-to-all-v (each rank's copies for
//!           rank p's experts go to p) → regroup expert-major → experts → back, source-major →
//!           all-to-all-v → weighted sum per token
//! backward  d out grouped, with each copy's routing weight → all-to-all-v → d h = d y·W2 and
//!           ⟨d h, h⟩ per copy (the routing weights' gradient) → all-to-all-v back → router
//!           backward at home; the experts' weight gradients and d input copies → all-to-all-v
//!           back → summed per token
//! ```
//!
//! Exact routing: nothing is dropped, so a rank's experts may receive anything from none to
//! every rank's copies. Its routed buffers are sized for the most it can receive,
//! tokens × ep × min(top_k, E/ep) rows (each rank sends each token here at most min(top_k,
//! E/ep) times: a token's choices are distinct experts; `ferrotron_plan::activations::
//! routed_rows`), so that the memory plan is the allocation whatever the routing.
//!
//! The exchange is in f32 (16-bit activations widened, then rounded once on arrival), through
//! the `comm.ep.send` / `comm.ep.recv` buffers.

use super::config::{LlamaConfig, ModelError};
use crate::dtype::Elem;
use crate::kernels::{AsView, AsViewMut, Kernels, View, ViewMut};
use std::cell::RefCell;
use std::ops::Range;
use std::rc::Rc;

/// The expert-parallel group's exchange: `Communicator::all_to_all_v` (blocks of f32 in rank
/// order, `send_counts[p]` to rank p, `recv_counts[s]` from rank s). A failure leaves `recv`
/// as it was and is reported by the implementation after the pass. On a device the blocks are
/// views of its memory (the plan's `comm.ep.send` / `comm.ep.recv` live in its arena): the
/// implementation stages them through the host.
pub trait EpComm {
    fn size(&self) -> usize;
    fn rank(&self) -> usize;
    fn exchange(
        &self,
        send: View<'_, f32>,
        send_counts: &[usize],
        recv: ViewMut<'_, f32>,
        recv_counts: &[usize],
    );
}

/// This rank's place in its expert-parallel group and the group's exchange.
#[derive(Clone)]
pub struct ExpertParallel {
    pub size: usize,
    pub rank: usize,
    /// Experts per MoE layer of the whole model.
    pub experts: usize,
    comm: Rc<dyn EpComm>,
    /// The exchanges' element counts per rank, and the counts' own exchange, rewritten in
    /// place for every exchange (so that one allocates nothing after the first).
    scratch: RefCell<Scratch>,
}

#[derive(Clone, Default)]
struct Scratch {
    send_counts: Vec<usize>,
    recv_counts: Vec<usize>,
    counts_out: Vec<f32>,
    counts_in: Vec<f32>,
    /// Rows of each local expert placed so far.
    within: Vec<usize>,
}

impl std::fmt::Debug for ExpertParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ExpertParallel {{ rank {} of {} }}",
            self.rank, self.size
        )
    }
}

/// Where the copies one rank receives sit: for each (source rank s, local expert j), its
/// first row in arrival order (source-major), its first row expert-major, and its rows.
#[derive(Default)]
pub(super) struct Arrivals {
    pub blocks: Vec<(usize, usize, usize)>,
    /// Rows per local expert, expert-major.
    pub per_expert: Vec<Range<usize>>,
    pub rows: usize,
}

impl ExpertParallel {
    /// Rank `comm.rank()` of a group sharding `cfg`'s experts; refused when the model has no
    /// experts or the group does not divide them.
    pub fn new(cfg: &LlamaConfig, comm: Rc<dyn EpComm>) -> Result<Self, ModelError> {
        let size = comm.size();
        let Some(m) = cfg.moe else {
            return Err(ModelError::Unsupported(format!(
                "ep = {size}: expert parallelism needs a mixture-of-experts model"
            )));
        };
        if !m.experts.is_multiple_of(size) {
            return Err(ModelError::Config {
                field: "num_local_experts",
                value: m.experts.to_string(),
                fix: format!(
                    "expert parallelism gives each of the ep = {size} ranks as many experts: ep must divide it"
                )
                .into(),
            });
        }
        Ok(ExpertParallel {
            size,
            rank: comm.rank(),
            experts: m.experts,
            comm,
            scratch: Default::default(),
        })
    }

    /// Experts per rank.
    pub fn per_rank(&self) -> usize {
        self.experts / self.size
    }

    /// The experts this rank holds.
    pub fn local(&self) -> Range<usize> {
        self.rank * self.per_rank()..(self.rank + 1) * self.per_rank()
    }

    /// From this rank's copies per expert (`counts[e]`, every expert), the copies each rank
    /// sends each of this rank's experts, and where they land: into `a`, in place.
    pub(super) fn arrivals(&self, counts: &[usize], a: &mut Arrivals) {
        let (el, size) = (self.per_rank(), self.size);
        let mut guard = self.scratch.borrow_mut();
        let x = &mut *guard;
        x.counts_out.clear();
        x.counts_out.extend(counts.iter().map(|&c| c as f32));
        x.counts_in.clear();
        x.counts_in.resize(size * el, 0.0);
        x.send_counts.clear();
        x.send_counts.resize(size, el);
        let (out, each) = (x.counts_out.view(), &x.send_counts);
        self.comm.exchange(out, each, x.counts_in.view_mut(), each);
        // Counts are below 2^24 (tokens × top_k), exact in f32.
        let n = |s: usize, j: usize| x.counts_in[s * el + j] as usize;
        a.per_expert.clear();
        let mut at = 0;
        for j in 0..el {
            let p: usize = (0..size).map(|s| n(s, j)).sum();
            a.per_expert.push(at..at + p);
            at += p;
        }
        a.blocks.clear();
        x.within.clear();
        x.within.resize(el, 0);
        let mut arrival = 0;
        for s in 0..size {
            for j in 0..el {
                let rows = n(s, j);
                a.blocks
                    .push((arrival, a.per_expert[j].start + x.within[j], rows));
                arrival += rows;
                x.within[j] += rows;
            }
        }
        a.rows = at;
    }

    /// Sends this rank's grouped rows (`width` f32 each, `counts[e]` rows per expert) to the
    /// ranks holding their experts; `recv` gets the arrivals, source-major.
    pub(super) fn dispatch(
        &self,
        send: View<'_, f32>,
        counts: &[usize],
        a: &Arrivals,
        recv: ViewMut<'_, f32>,
        width: usize,
    ) {
        let mut guard = self.scratch.borrow_mut();
        let x = &mut *guard;
        self.per_destination(counts, width, &mut x.send_counts);
        self.per_source(a, width, &mut x.recv_counts);
        self.comm
            .exchange(send, &x.send_counts, recv, &x.recv_counts);
    }

    /// The reverse of [`Self::dispatch`]: rows in arrival order go back to their ranks; `recv`
    /// gets this rank's grouped rows.
    pub(super) fn combine(
        &self,
        send: View<'_, f32>,
        counts: &[usize],
        a: &Arrivals,
        recv: ViewMut<'_, f32>,
        width: usize,
    ) {
        let mut guard = self.scratch.borrow_mut();
        let x = &mut *guard;
        self.per_source(a, width, &mut x.send_counts);
        self.per_destination(counts, width, &mut x.recv_counts);
        self.comm
            .exchange(send, &x.send_counts, recv, &x.recv_counts);
    }

    /// Elements this rank sends each rank: its copies for that rank's experts.
    fn per_destination(&self, counts: &[usize], width: usize, out: &mut Vec<usize>) {
        out.clear();
        let per_rank = counts.chunks(self.per_rank());
        out.extend(per_rank.map(|c| c.iter().sum::<usize>() * width));
    }

    /// Elements this rank receives from each rank.
    fn per_source(&self, a: &Arrivals, width: usize, out: &mut Vec<usize>) {
        out.clear();
        let per_rank = a.blocks.chunks(self.per_rank());
        out.extend(per_rank.map(|b| b.iter().map(|x| x.2).sum::<usize>() * width));
    }
}

/// Arrival-order f32 rows (`width` wide, the first `cols` of each taken) into expert-major
/// `S` rows of `cols`, each rounded once by `k` (`Kernels::narrow`: on a device, a kernel).
pub(super) fn to_expert_major<S: Elem, G: Elem>(
    k: &dyn Kernels<S, G>,
    a: &Arrivals,
    src: View<'_, f32>,
    width: usize,
    cols: usize,
    mut dst: ViewMut<'_, S>,
) {
    for &(arrival, expert, rows) in &a.blocks {
        if width == cols {
            // A block of whole rows is one run of both buffers.
            let from = src.slice(arrival * width..(arrival + rows) * width);
            let to = dst.rb().slice_mut(expert * cols..(expert + rows) * cols);
            k.narrow(from, to);
            continue;
        }
        for r in 0..rows {
            let from = src.slice((arrival + r) * width..).slice(..cols);
            let to = dst
                .rb()
                .slice_mut((expert + r) * cols..(expert + r + 1) * cols);
            k.narrow(from, to);
        }
    }
}

/// Expert-major `S` rows of `cols` into arrival-order f32 rows of `cols`, widened exactly by
/// `k` (`Kernels::widen`).
pub(super) fn to_arrival_order<S: Elem, G: Elem>(
    k: &dyn Kernels<S, G>,
    a: &Arrivals,
    src: View<'_, S>,
    cols: usize,
    mut dst: ViewMut<'_, f32>,
) {
    for &(arrival, expert, rows) in &a.blocks {
        let from = src.slice(expert * cols..(expert + rows) * cols);
        let to = dst.rb().slice_mut(arrival * cols..(arrival + rows) * cols);
        k.widen(from, to);
    }
}
