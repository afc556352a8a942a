//! The one table of activation tensors: every tensor a Llama-family layer keeps for its
//! backward, and every buffer the ferrotron engine uses outside the layers, each with its name,
//! element type, shape as a function of model and layout (including its tensor-parallel split),
//! and which recompute policies keep it. The planner builds its memory plan from it
//! (`activations.rs`) and the engine names, sizes and allocates its buffers from it; no other
//! file restates a name or a size.
//!
//! Buffer names: a layer tensor `f` of layer `i` is `act.layers.{i}.{f}`; when the recompute
//! policy drops it, it lives in the shared workspace `recompute.{f}`; the rest are named in
//! [`Edge`].

use crate::recipe::{DType, Recompute};
use std::fmt;

/// What a tensor's elements are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elems {
    /// The run's activation storage type (fp32, bf16, fp16; fp8 runs store bf16).
    Storage,
    F32,
    U32,
}

impl Elems {
    pub fn dtype(self, storage: DType) -> DType {
        match self {
            Elems::Storage => storage,
            Elems::F32 => DType::F32,
            Elems::U32 => DType::U32,
        }
    }
}

/// Elements per row of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Width {
    One,
    Hidden,
    /// Query heads × query/key head dim.
    QDim,
    /// The key width each rank holds (see [`Dims::k_rank`]).
    KRank,
    /// The value width each rank holds (see [`Dims::v_rank`]).
    VRank,
    /// Query heads × value head dim (the attention output).
    ODim,
    /// Query heads (one log-sum-exp per head and token).
    Heads,
    /// MLP intermediate size.
    Ffn,
    /// Routed experts (router logits).
    Experts,
    /// Experts per token (router weights and indices).
    TopK,
    Vocab,
    /// Half the rotated dims of a head (RoPE tables).
    HalfRotary,
    /// A routed row and its routing weight (expert parallelism's exchange): hidden + 1.
    HiddenAndWeight,
    /// A ring-attention block (context parallelism): its keys and values and, in the backward,
    /// their gradients travelling with them: 2·(k + v).
    RingBlock,
    /// A vocabulary-parallel cross-entropy's row statistics: this rank's three (max, Σ exp,
    /// target logit) and every rank's, gathered: 3·(t + 1).
    CeStats,
}

/// How many rows a tensor has.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rows {
    /// One per token of the micro-batch on this rank.
    Tokens,
    /// One per routed token copy (tokens × top-k; tokens for a dense MLP), or an expert-parallel
    /// rank's capacity ([`Dims::routed_rows`]).
    Routed,
    /// One per row of an LM-head chunk: min(tokens, ce_chunk_tokens).
    HeadChunk,
    /// One per position of the model's context (RoPE tables).
    Positions,
}

/// How tensor parallelism (degree t) divides a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Whole on every rank.
    Whole,
    /// The residual stream: divided by t under sequence parallelism (Korthikanti et al. 2022).
    Sequence,
    /// Heads / intermediate columns: divided by t (the width rounded up for the MLP).
    Tensor,
}

/// The sizes a tensor's shape is made of, for one micro-batch on one rank.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    /// Tokens of the micro-batch on this rank (b × s).
    pub tokens: u64,
    pub hidden: u64,
    pub heads: u64,
    pub q_dim: u64,
    /// Key and value widths on one rank: the rank's key/value heads × their head dims. Under
    /// tensor parallelism beyond the number of key/value heads each rank holds one whole head,
    /// replicated (so these are not q_dim-like widths divided by t).
    pub k_rank: u64,
    pub v_rank: u64,
    /// Query heads × value head dim.
    pub o_dim: u64,
    /// Dimensions of a head that RoPE rotates.
    pub rotary_dim: u64,
    /// The MLP width of this kind of layer (an expert's for a MoE layer).
    pub ffn: u64,
    pub vocab: u64,
    pub positions: u64,
    /// Routed experts and experts per token (0 and 1 for a dense model).
    pub experts: u64,
    pub top_k: u64,
    /// Rows of the routed tensors when they are not tokens × top-k: an expert-parallel rank's
    /// capacity, the most copies its experts can receive (see the engine's
    /// `expert_parallel.rs`).
    pub routed_rows: Option<u64>,
    pub ce_chunk_tokens: u64,
    /// Tensor-parallel degree, and whether sequence parallelism divides the residual stream.
    pub tp: u64,
    pub sp: bool,
}

/// One tensor of the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub elems: Elems,
    pub rows: Rows,
    pub width: Width,
    pub split: Split,
}

impl Shape {
    const fn new(elems: Elems, rows: Rows, width: Width, split: Split) -> Self {
        Shape {
            elems,
            rows,
            width,
            split,
        }
    }

    /// Elements on one rank.
    pub fn numel(&self, d: &Dims) -> u64 {
        let rows = match self.rows {
            Rows::Tokens => d.tokens,
            Rows::Routed => d.routed_rows.unwrap_or(d.tokens * d.top_k),
            Rows::HeadChunk => d.tokens.min(d.ce_chunk_tokens),
            Rows::Positions => d.positions,
        };
        let t = d.tp.max(1);
        let width = match self.width {
            Width::One => 1,
            Width::Hidden => d.hidden,
            Width::QDim => d.q_dim,
            Width::KRank => d.k_rank,
            Width::VRank => d.v_rank,
            Width::ODim => d.o_dim,
            Width::Heads => d.heads,
            // The intermediate columns of a tensor-parallel MLP, rounded up per rank.
            Width::Ffn if self.split == Split::Tensor => return rows * d.ffn.div_ceil(t),
            Width::Ffn => d.ffn,
            Width::Experts => d.experts,
            Width::TopK => d.top_k,
            // The vocabulary of a tensor-parallel LM head, rounded up per rank.
            Width::Vocab if self.split == Split::Tensor => return rows * d.vocab.div_ceil(t),
            Width::Vocab => d.vocab,
            Width::HalfRotary => d.rotary_dim / 2,
            Width::CeStats => 3 * (t + 1),
            Width::HiddenAndWeight => d.hidden + 1,
            Width::RingBlock => 2 * (d.k_rank + d.v_rank),
        };
        let div = match self.split {
            Split::Whole => 1,
            Split::Sequence if d.sp && t > 1 => t,
            Split::Sequence => 1,
            Split::Tensor => t,
        };
        rows * width / div
    }
}

use Elems::{Storage, F32, U32};
use Rows::{HeadChunk, Positions, Routed, Tokens};
use Split::{Sequence, Tensor, Whole};
use Width::{
    CeStats, Experts, Ffn, HalfRotary, Heads, Hidden, HiddenAndWeight, KRank, ODim, One, QDim,
    RingBlock, TopK, VRank, Vocab,
};

macro_rules! table {
    (
        $(#[$m:meta])* $vis:vis enum $Enum:ident {
            $($(#[$vm:meta])* $Var:ident = $name:literal : $shape:expr;)*
        }
    ) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        $vis enum $Enum {
            $($(#[$vm])* $Var,)*
        }

        impl $Enum {
            /// Every entry, in table order.
            pub const ALL: &'static [$Enum] = &[$($Enum::$Var,)*];
            /// The tensor's name (the last part of its buffer names).
            pub const fn name(self) -> &'static str {
                match self {
                    $($Enum::$Var => $name,)*
                }
            }
            /// Its element type, rows, width and tensor-parallel split.
            pub const fn shape(self) -> Shape {
                match self {
                    $($Enum::$Var => $shape,)*
                }
            }
        }
    };
}

table! {
    /// The tensors of one decoder layer, in the order the forward writes them.
    pub enum LayerTensor {
        /// The residual stream entering the layer (the previous layer's output).
        Input = "input": Shape::new(Storage, Tokens, Hidden, Sequence);
        Ln1Rstd = "ln1_rstd": Shape::new(F32, Tokens, One, Sequence);
        Ln1Out = "ln1_out": Shape::new(Storage, Tokens, Hidden, Sequence);
        /// After RoPE.
        Q = "q": Shape::new(Storage, Tokens, QDim, Tensor);
        /// After RoPE.
        K = "k": Shape::new(Storage, Tokens, KRank, Whole);
        V = "v": Shape::new(Storage, Tokens, VRank, Whole);
        /// One log-sum-exp per head and query (flash attention's backward needs only these).
        AttnLse = "attn_lse": Shape::new(F32, Tokens, Heads, Tensor);
        AttnOut = "attn_out": Shape::new(Storage, Tokens, ODim, Tensor);
        /// Input + attention block output: the residual stream between the two blocks.
        ResidMid = "resid_mid": Shape::new(Storage, Tokens, Hidden, Sequence);
        Ln2Rstd = "ln2_rstd": Shape::new(F32, Tokens, One, Sequence);
        Ln2Out = "ln2_out": Shape::new(Storage, Tokens, Hidden, Sequence);
        /// Router logits, weights and expert indices (balanced routing assumed: every rank of
        /// the expert-parallel group processes tokens × top-k copies on its local experts).
        RouterLogits = "router_logits": Shape::new(F32, Tokens, Experts, Sequence);
        RouterWeights = "router_weights": Shape::new(F32, Tokens, TopK, Sequence);
        RouterIndex = "router_index": Shape::new(U32, Tokens, TopK, Sequence);
        /// The routed token copies entering the experts.
        ExpertIn = "expert_in": Shape::new(Storage, Routed, Hidden, Whole);
        Gate = "gate": Shape::new(Storage, Routed, Ffn, Tensor);
        Up = "up": Shape::new(Storage, Routed, Ffn, Tensor);
        /// The gated product silu(gate)·up; GeGLU models (Gemma) have [`LayerTensor::Geglu`]
        /// in its place.
        Swiglu = "swiglu": Shape::new(Storage, Routed, Ffn, Tensor);
        /// gelu(gate)·up.
        Geglu = "geglu": Shape::new(Storage, Routed, Ffn, Tensor);
    }
}

/// Cheap to rebuild from what is kept, and large: what selective recomputation drops (both
/// RMSNorm outputs, the SwiGLU product, the routed copies of the MoE input).
const SELECTIVE_DROPS: &[LayerTensor] = &[
    LayerTensor::Ln1Out,
    LayerTensor::Ln2Out,
    LayerTensor::Swiglu,
    LayerTensor::Geglu,
    LayerTensor::ExpertIn,
];

impl LayerTensor {
    /// Whether a SwiGLU layer with this kind of MLP (`moe`) has the tensor: the router's and
    /// the routed copies' only MoE layers; GeGLU's product replaces SwiGLU's.
    pub fn in_layer(self, moe: bool) -> bool {
        use LayerTensor::*;
        match self {
            RouterLogits | RouterWeights | RouterIndex | ExpertIn => moe,
            Geglu => false,
            _ => true,
        }
    }

    /// Whether a layer keeps this tensor for its backward under a recompute policy (dropped
    /// ones are rebuilt in the layer's backward, see the engine's `recompute.rs`).
    pub fn kept_by(self, rc: Recompute) -> bool {
        match rc {
            Recompute::None => true,
            Recompute::Selective => !SELECTIVE_DROPS.contains(&self),
            // Only the layer's input; the backward replays the layer's forward from it.
            Recompute::Full => self == LayerTensor::Input,
        }
    }

    /// The tensors of a SwiGLU layer (dense or MoE), in the order the forward writes them.
    pub fn of_layer(moe: bool) -> impl Iterator<Item = LayerTensor> {
        Self::ALL.iter().copied().filter(move |t| t.in_layer(moe))
    }
}

table! {
    /// The engine's buffers outside the layers, by full name.
    pub enum Edge {
        /// The batch's token ids and targets (the trainer's, allocated once).
        DataTokens = "data.tokens": Shape::new(U32, Tokens, One, Whole);
        DataTargets = "data.targets": Shape::new(U32, Tokens, One, Whole);
        /// RoPE cos/sin for every position (the engine's, allocated once).
        RopeCos = "rope.cos": Shape::new(F32, Positions, HalfRotary, Whole);
        RopeSin = "rope.sin": Shape::new(F32, Positions, HalfRotary, Whole);
        /// The last layer's output.
        FinalNormInput = "act.final_norm.input": Shape::new(Storage, Tokens, Hidden, Sequence);
        FinalNormRstd = "act.final_norm.rstd": Shape::new(F32, Tokens, One, Sequence);
        /// Holds d(loss)/d(final norm output) once the fused head has run.
        FinalNormOut = "act.final_norm.out": Shape::new(Storage, Tokens, Hidden, Whole);
        /// One chunk of fp32 logits, then their gradient (the fused, chunked LM head).
        LogitsChunk = "act.logits_chunk": Shape::new(F32, HeadChunk, Vocab, Tensor);
        Losses = "act.losses": Shape::new(F32, Tokens, One, Whole);
        /// Tensor parallelism only: the row statistics of a vocabulary-parallel cross-entropy
        /// chunk, this rank's and the group's (Megatron-LM's `_VocabParallelCrossEntropy`
        /// reduces the same three quantities).
        CeStats = "act.ce_stats": Shape::new(F32, HeadChunk, CeStats, Whole);
        /// Sequence parallelism only: every token's rows of one residual-stream tensor, for
        /// the all-gather before a column-parallel block and the reduce-scatter after a
        /// row-parallel one (forward and backward), one use at a time.
        SpFull = "act.sp.full": Shape::new(Storage, Tokens, Hidden, Whole);
        /// The last position of each sequence (sampling; no training plan has it).
        LastHidden = "act.last_hidden": Shape::new(Storage, Tokens, Hidden, Whole);
        /// d(residual stream), carried from layer to layer by the backward.
        GradResid = "grad.act.resid": Shape::new(Storage, Tokens, Hidden, Sequence);
        /// The backward scratch every layer shares, in the order it is allocated.
        GradLnOut = "grad.act.ln_out": Shape::new(Storage, Tokens, Hidden, Whole);
        GradQ = "grad.act.q": Shape::new(Storage, Tokens, QDim, Tensor);
        GradK = "grad.act.k": Shape::new(Storage, Tokens, KRank, Whole);
        GradV = "grad.act.v": Shape::new(Storage, Tokens, VRank, Whole);
        GradAttnOut = "grad.act.attn_out": Shape::new(Storage, Tokens, ODim, Tensor);
        GradGate = "grad.act.gate": Shape::new(Storage, Routed, Ffn, Tensor);
        GradUp = "grad.act.up": Shape::new(Storage, Routed, Ffn, Tensor);
        GradSwiglu = "grad.act.swiglu": Shape::new(Storage, Routed, Ffn, Tensor);
        GradGeglu = "grad.act.geglu": Shape::new(Storage, Routed, Ffn, Tensor);
        /// A MoE layer's router gradients (after the scratch above).
        GradRouterLogits = "grad.act.router_logits": Shape::new(F32, Tokens, Experts, Sequence);
        GradRouterWeights = "grad.act.router_weights": Shape::new(F32, Tokens, TopK, Sequence);
        /// A MoE layer's routed rows, grouped by expert: the experts' outputs before they are
        /// weighted and summed per token (forward), then their gradients and the gradients of
        /// the routed copies of the input (backward); one use at a time.
        ExpertRows = "act.moe.rows": Shape::new(Storage, Routed, Hidden, Whole);
        /// Expert parallelism only: the rows going to other ranks' experts (and their routing
        /// weights, in the backward), then the rows coming back; in f32.
        EpSend = "comm.ep.send": Shape::new(F32, Routed, HiddenAndWeight, Whole);
        EpRecv = "comm.ep.recv": Shape::new(F32, Routed, HiddenAndWeight, Whole);
        /// Context parallelism only (ring attention): the key/value block a rank attends to
        /// now, the one arriving from the previous rank of the ring (each with its gradients
        /// in the backward), and the running attention output (forward) or query gradient
        /// (backward) in f32; within each layer's attention.
        CpBlock = "comm.cp.block": Shape::new(F32, Tokens, RingBlock, Whole);
        CpNext = "comm.cp.next": Shape::new(F32, Tokens, RingBlock, Whole);
        CpAcc = "act.cp.acc": Shape::new(F32, Tokens, QDim, Tensor);
    }
}

impl Edge {
    /// The backward scratch buffer of a layer tensor's gradient, for the tensors that have one
    /// (the outputs of the layer's matmuls and of the gated product).
    pub fn grad_of(t: LayerTensor) -> Option<Edge> {
        Some(match t {
            LayerTensor::Q => Edge::GradQ,
            LayerTensor::K => Edge::GradK,
            LayerTensor::V => Edge::GradV,
            LayerTensor::AttnOut => Edge::GradAttnOut,
            LayerTensor::Gate => Edge::GradGate,
            LayerTensor::Up => Edge::GradUp,
            LayerTensor::Swiglu => Edge::GradSwiglu,
            LayerTensor::Geglu => Edge::GradGeglu,
            _ => return None,
        })
    }

    /// A MoE layer's backward scratch after [`Edge::SCRATCH`], in allocation order.
    pub const MOE_SCRATCH: [Edge; 2] = [Edge::GradRouterLogits, Edge::GradRouterWeights];

    /// The backward scratch after `grad.act.resid`, in allocation order (one set for every
    /// layer; a MoE layer's gate/up/swiglu gradients hold its routed copies).
    pub const SCRATCH: [Edge; 8] = [
        Edge::GradLnOut,
        Edge::GradQ,
        Edge::GradK,
        Edge::GradV,
        Edge::GradAttnOut,
        Edge::GradGate,
        Edge::GradUp,
        Edge::GradSwiglu,
    ];
}

/// The name of an engine buffer, without allocating: layer `i`'s tensor
/// (`act.layers.{i}.{t}`), the recompute workspace of a dropped layer tensor
/// (`recompute.{t}`), or a buffer outside the layers. Its `Display` is the buffer's name in
/// the memory plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufName {
    Layer(u32, LayerTensor),
    Recompute(LayerTensor),
    Edge(Edge),
}

impl BufName {
    /// The buffer of layer `i`'s tensor `t` under a policy: its own when the policy keeps it,
    /// else the shared workspace.
    pub fn of_layer(i: usize, t: LayerTensor, rc: Recompute) -> Self {
        if t.kept_by(rc) {
            BufName::Layer(i as u32, t)
        } else {
            BufName::Recompute(t)
        }
    }

    pub fn shape(self) -> Shape {
        match self {
            BufName::Layer(_, t) | BufName::Recompute(t) => t.shape(),
            BufName::Edge(e) => e.shape(),
        }
    }
}

/// Layer `i`'s buffers are `{LAYER_PREFIX}{i}.{tensor}`.
pub const LAYER_PREFIX: &str = "act.layers.";
/// The recompute workspace's buffers are `{WORKSPACE_PREFIX}{tensor}`.
pub const WORKSPACE_PREFIX: &str = "recompute.";

impl fmt::Display for BufName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BufName::Layer(i, t) => write!(f, "{LAYER_PREFIX}{i}.{}", t.name()),
            BufName::Recompute(t) => write!(f, "{WORKSPACE_PREFIX}{}", t.name()),
            BufName::Edge(e) => f.write_str(e.name()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims(tp: u64, sp: bool) -> Dims {
        Dims {
            tokens: 8,
            hidden: 12,
            heads: 6,
            q_dim: 12,
            k_rank: 4,
            v_rank: 4,
            o_dim: 12,
            rotary_dim: 2,
            ffn: 30,
            vocab: 100,
            positions: 16,
            experts: 0,
            top_k: 1,
            routed_rows: None,
            ce_chunk_tokens: 5,
            tp,
            sp,
        }
    }

    #[test]
    fn shapes_split_as_megatron_does() {
        let (one, tp, sp) = (dims(1, false), dims(4, false), dims(4, true));
        let n = |t: LayerTensor, d: &Dims| t.shape().numel(d);
        assert_eq!(n(LayerTensor::Input, &one), 96);
        // The residual stream is whole under plain TP and divided under SP.
        assert_eq!(n(LayerTensor::Input, &tp), 96);
        assert_eq!(n(LayerTensor::Input, &sp), 24);
        assert_eq!(n(LayerTensor::Q, &tp), 24);
        // 30 intermediate columns on 4 ranks: 8 each (rounded up).
        assert_eq!(n(LayerTensor::Gate, &tp), 64);
        assert_eq!(Edge::LogitsChunk.shape().numel(&tp), 5 * 25);
        assert_eq!(Edge::RopeCos.shape().numel(&one), 16);
    }

    #[test]
    fn policies_keep_what_the_docs_say() {
        let kept = |rc| {
            LayerTensor::of_layer(false)
                .filter(|t| t.kept_by(rc))
                .map(LayerTensor::name)
                .collect::<Vec<_>>()
        };
        assert_eq!(kept(Recompute::None).len(), 14);
        assert_eq!(kept(Recompute::Full), ["input"]);
        assert!(!kept(Recompute::Selective).contains(&"ln1_out"));
        assert_eq!(kept(Recompute::Selective).len(), 11);
    }
}
