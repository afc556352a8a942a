//! Context parallelism: a sequence split over the `cp` ranks of a group, attention computed as
//! ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; Megatron-LM's
//! context parallelism; the playbook's "Context parallelism" section).
//!
//! Every op of a layer but attention works token by token, so each rank runs them on its own
//! tokens. Attention needs every earlier key: the ranks pass their key/value blocks around a
//! ring, and each merges the attention of its queries to each block into a running output by
//! the blocks' log-sum-exp (the online softmax of flash attention, one block at a time):
//!
//! ```text
//! forward   step 0: own block; step s: block of rank r − s. Each step first starts sending
//!           its block on to rank r + 1, computes on it meanwhile, then receives the next
//!           from rank r − 1 (the transfer hides behind the step's attention). o and lse
//!           merged in f32, o rounded once.
//! backward  step s: the same blocks with their dK, dV travelling along: this rank adds its
//!           queries' part to them and to its own dQ; after the last step one more pass
//!           brings each block's dK, dV home.
//! ```
//!
//! Load balance (the causal mask makes late tokens cost more): the sequence is cut into
//! `2·cp` chunks and rank `r` holds chunks `r` and `2·cp − 1 − r` ([`SeqPart`]), as Megatron-LM
//! and Llama 3 do. RoPE rotates each token by its position in the sequence: the rank's
//! RoPE table holds, in row `i`, the angles of its local token `i`'s position.
//!
//! Blocks travel in f32 through the plan's `comm.cp.block` / `comm.cp.next`, the running
//! output (forward) and query gradient (backward) accumulate in `act.cp.acc`.

use super::buffers::{Buf, BufName, BufferPool};
use super::llama::Llama;
use crate::dtype::Elem;
use crate::kernels::host_copy::HostCopy;
use crate::kernels::{
    AsView, AsViewMut, AttnShape, Kernels, Memory, RingShape, RopeTable, SeqPart, View, ViewMut,
};
use ferrotron_plan::tensors::Edge;
use std::rc::Rc;

/// The ring of a context-parallel group. A failure leaves `recv` as it was and is reported by
/// the implementation after the pass (the trainer checks).
pub trait CpComm {
    fn size(&self) -> usize;
    fn rank(&self) -> usize;
    /// Starts sending `send` to the next rank of the ring (`rank + 1`): `send` may be read at
    /// once, and written once [`CpComm::recv_prev`] has returned (a device ring sends it as it
    /// lies, a host one a copy).
    fn send_next(&self, send: View<'_, f32>);
    /// Receives the previous rank's block (as long as the last one sent) into `recv`, and
    /// waits for this rank's send to be taken.
    fn recv_prev(&self, recv: ViewMut<'_, f32>);
    /// Sums `x` over the group, element by element in rank order (every rank gets the same
    /// bits): a MoE layer's load-balancing statistics of the micro-batch the ranks share.
    fn sum(&self, x: &mut [f32]);
    /// Both, one after the other.
    fn pass(&self, send: View<'_, f32>, recv: ViewMut<'_, f32>) {
        self.send_next(send);
        self.recv_prev(recv);
    }
    /// The copies between the rank's device and the host when the model's tensors live on a
    /// device (the ring's blocks are then device buffers, sent and received through them);
    /// `None` on the host.
    fn device(&self) -> Option<HostCopy> {
        None
    }
}

/// `dst = 0`, on the host or on the device.
pub(super) fn zero(dev: Option<&HostCopy>, dst: ViewMut<'_, f32>) {
    match dev {
        Some(c) if dst.memory() != Memory::Host => c.zero(dst),
        _ => dst.host_mut().fill(0.0),
    }
}

/// This rank's place in its context-parallel group, and the group's ring.
#[derive(Clone)]
pub struct ContextParallel {
    pub size: usize,
    pub rank: usize,
    comm: Rc<dyn CpComm>,
    /// This rank's tokens of a sequence (set by [`Llama::context_parallel`]), the rows the
    /// RoPE table is turned to.
    pub(super) tokens: usize,
}

impl std::fmt::Debug for ContextParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ContextParallel {{ rank {} of {} }}",
            self.rank, self.size
        )
    }
}

impl ContextParallel {
    /// Sums `x` over the group ([`CpComm::sum`]).
    pub fn sum(&self, x: &mut [f32]) {
        self.comm.sum(x)
    }

    pub fn new(comm: Rc<dyn CpComm>) -> Self {
        ContextParallel {
            size: comm.size(),
            rank: comm.rank(),
            comm,
            tokens: 0,
        }
    }

    /// The tokens rank `r` of the group holds.
    pub fn part_of(&self, r: usize) -> SeqPart {
        SeqPart {
            rank: r,
            ranks: self.size,
        }
    }

    /// The tokens this rank holds.
    pub fn part(&self) -> SeqPart {
        self.part_of(self.rank)
    }

    /// `full`'s rows for this rank's `t` local tokens: row `i` holds the angles of local token
    /// `i`'s position; the rows past `t` are `full`'s, so the table keeps its planned size.
    pub fn rope(&self, full: &RopeTable, t: usize) -> RopeTable {
        let half = full.head_dim / 2;
        let (mut cos, mut sin) = (full.cos.clone(), full.sin.clone());
        let part = self.part();
        for i in 0..t {
            let p = part.position(i, t);
            cos[i * half..(i + 1) * half].copy_from_slice(&full.cos[p * half..(p + 1) * half]);
            sin[i * half..(i + 1) * half].copy_from_slice(&full.sin[p * half..(p + 1) * half]);
        }
        RopeTable { cos, sin, ..*full }
    }

    /// The rank whose block this rank holds at ring step `step`.
    fn source(&self, step: usize) -> usize {
        (self.rank + self.size - step % self.size) % self.size
    }

    fn ring(&self, s: AttnShape, step: usize) -> RingShape {
        RingShape {
            attn: s,
            q: self.part(),
            kv: self.part_of(self.source(step)),
        }
    }
}

/// What attention's backward reads: q, k, v, o, lse and dO.
type Saved<'a, S> = (
    View<'a, S>,
    View<'a, S>,
    View<'a, S>,
    View<'a, S>,
    View<'a, f32>,
    View<'a, S>,
);

/// The three ring buffers of one attention (forward or backward).
struct RingBufs {
    block: Buf<f32>,
    next: Buf<f32>,
    acc: Buf<f32>,
}

impl Llama {
    /// With context parallelism, this model's RoPE table turned to the rank's tokens of
    /// sequences of `seq` (see [`ContextParallel::rope`]): now when it is built, else by
    /// [`Llama::build_rope`].
    pub fn context_parallel(mut self, mut cp: ContextParallel, seq: usize) -> Result<Self, String> {
        if cp.size > 1 {
            cp.tokens = cp.part().local_len(seq)?;
            if self.rope_built() {
                self.rope = cp.rope(&self.rope, cp.tokens);
            }
            self.cp = Some(cp);
        }
        Ok(self)
    }

    fn ring_bufs(&self, pool: &mut dyn BufferPool, n: usize) -> RingBufs {
        RingBufs {
            block: self.buf(pool, BufName::Edge(Edge::CpBlock), n),
            next: self.buf(pool, BufName::Edge(Edge::CpNext), n),
            acc: self.buf(pool, BufName::Edge(Edge::CpAcc), n),
        }
    }

    fn free_ring_bufs(&self, pool: &mut dyn BufferPool, b: RingBufs) {
        pool.free(BufName::Edge(Edge::CpBlock), b.block);
        pool.free(BufName::Edge(Edge::CpNext), b.next);
        pool.free(BufName::Edge(Edge::CpAcc), b.acc);
    }

    /// Causal attention of this rank's tokens: the plain kernel on one rank, the ring under
    /// context parallelism.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        s: AttnShape,
        (q, kk, v): (View<'_, S>, View<'_, S>, View<'_, S>),
        o: ViewMut<'_, S>,
        mut lse: ViewMut<'_, f32>,
    ) {
        let Some(cp) = &self.cp else {
            return k.attention_forward(s, q, kk, v, o, lse);
        };
        // The ring's blocks are the pool's (the device's on a device), in f32; the group sends
        // them through its host buffer (threads, MPI) or, on GPUs with NCCL, as they lie.
        let kvl = s.kv_len();
        let mut b = self.ring_bufs(pool, s.b * s.t);
        k.widen(kk, b.block.view_mut().slice_mut(..kvl));
        k.widen(v, b.block.view_mut().slice_mut(kvl..2 * kvl));
        for step in 0..cp.size {
            let more = step + 1 < cp.size;
            if more {
                cp.comm.send_next(b.block.view().slice(..2 * kvl));
            }
            let (kb, vb) = b.block.view().slice(..2 * kvl).split_at(kvl);
            let acc = b.acc.view_mut().slice_mut(..s.q_len());
            k.attention_forward_ring(cp.ring(s, step), q, kb, vb, acc, lse.rb(), step == 0);
            if more {
                cp.comm.recv_prev(b.next.view_mut().slice_mut(..2 * kvl));
                std::mem::swap(&mut b.block, &mut b.next);
            }
        }
        k.narrow(b.acc.view().slice(..s.q_len()), o);
        self.free_ring_bufs(pool, b);
    }

    /// The backward of [`Llama::attention`]: overwrites `dq`, `dk`, `dv`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_backward<S: Elem, G: Elem>(
        &self,
        k: &dyn Kernels<S, G>,
        pool: &mut dyn BufferPool,
        s: AttnShape,
        (q, kk, v, o, lse, d_o): Saved<S>,
        (dq, dk, dv): (ViewMut<'_, S>, ViewMut<'_, S>, ViewMut<'_, S>),
    ) {
        let Some(cp) = &self.cp else {
            return k.attention_backward(s, q, kk, v, o, lse, d_o, dq, dk, dv);
        };
        // Sent as the forward's ring.
        let dev = cp.comm.device();
        let dev = dev.as_ref();
        let kvl = s.kv_len();
        let mut b = self.ring_bufs(pool, s.b * s.t);
        // A block travels as [K | V | dK | dV].
        k.widen(kk, b.block.view_mut().slice_mut(..kvl));
        k.widen(v, b.block.view_mut().slice_mut(kvl..2 * kvl));
        zero(dev, b.block.view_mut().slice_mut(2 * kvl..4 * kvl));
        zero(dev, b.acc.view_mut().slice_mut(..s.q_len()));
        for step in 0..cp.size {
            if step > 0 {
                let next = b.next.view_mut().slice_mut(..4 * kvl);
                cp.comm.pass(b.block.view().slice(..4 * kvl), next);
                std::mem::swap(&mut b.block, &mut b.next);
            }
            let (kv, grads) = b
                .block
                .view_mut()
                .slice_mut(..4 * kvl)
                .split_at_mut(2 * kvl);
            let (kb, vb) = kv.into_view().split_at(kvl);
            let (dkb, dvb) = grads.split_at_mut(kvl);
            let dqa = b.acc.view_mut().slice_mut(..s.q_len());
            let r = cp.ring(s, step);
            k.attention_backward_ring(r, q, kb, vb, o, lse, d_o, dqa, dkb, dvb);
        }
        // The block held last is the next rank's: its gradients go home, and this rank's
        // arrive from the previous one.
        if cp.size > 1 {
            let next = b.next.view_mut().slice_mut(2 * kvl..4 * kvl);
            cp.comm.pass(b.block.view().slice(2 * kvl..4 * kvl), next);
            std::mem::swap(&mut b.block, &mut b.next);
        }
        k.narrow(b.acc.view().slice(..s.q_len()), dq);
        k.narrow(b.block.view().slice(2 * kvl..3 * kvl), dk);
        k.narrow(b.block.view().slice(3 * kvl..4 * kvl), dv);
        self.free_ring_bufs(pool, b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LlamaConfig;

    /// Rank 1 of a ring of 2 that never sends: only the RoPE turn is under test.
    struct Rank1;
    impl CpComm for Rank1 {
        fn size(&self) -> usize {
            2
        }
        fn rank(&self) -> usize {
            1
        }
        fn send_next(&self, _: View<'_, f32>) {
            unreachable!("no attention runs here")
        }
        fn recv_prev(&self, _: ViewMut<'_, f32>) {
            unreachable!("no attention runs here")
        }
        fn sum(&self, _: &mut [f32]) {
            unreachable!("no router runs here")
        }
    }

    fn config() -> LlamaConfig {
        LlamaConfig {
            hidden: 8,
            intermediate: 12,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            layers: 1,
            vocab: 10,
            rope_theta: 10000.0,
            rms_eps: 1e-5,
            tie_embeddings: true,
            qkv_bias: false,
            max_pos: 16,
            moe: None,
        }
    }

    /// A trainer builds the model's tables, takes its memory baseline, then the RoPE table
    /// (`Llama::tables`, `Llama::build_rope`): the table it gets is the one a model built at
    /// once has, turned to the rank's tokens the same under context parallelism, and built
    /// once (a GPU keys its copy by the table's address).
    #[test]
    fn the_rope_table_built_after_the_tables_is_the_one_built_at_once() {
        let cp = || ContextParallel::new(Rc::new(Rank1));
        let at_once = Llama::new(config()).context_parallel(cp(), 8).unwrap();
        let mut later = Llama::tables(config()).context_parallel(cp(), 8).unwrap();
        assert!(later.rope.cos.is_empty() && !later.rope_built());
        later.build_rope();
        assert_eq!(later.rope.cos, at_once.rope.cos);
        assert_eq!(later.rope.sin, at_once.rope.sin);
        // The turn moved rows: rank 1's first token is not position 0.
        let whole = Llama::new(config());
        assert_ne!(later.rope.cos, whole.rope.cos);
        let at = later.rope.cos.as_ptr();
        later.build_rope();
        assert_eq!(later.rope.cos.as_ptr(), at, "built twice");
    }
}
