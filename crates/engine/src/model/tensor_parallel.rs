//! Tensor parallelism (Megatron-LM: Shoeybi et al. 2019 §3). Each rank of a group of t holds a
//! slice of every large matrix and computes on it:
//!
//! - **column-parallel** q, k, v (with their biases) and gate, up: rank r holds rows
//!   `r·out/t..` (its attention heads, its key/value heads, its MLP columns), so attention and
//!   SwiGLU run on local heads and columns without communication;
//! - **row-parallel** o_proj and down_proj: rank r holds the matching columns and produces a
//!   partial sum, all-reduced before the residual add (Megatron's `g`: all-reduce forward,
//!   identity backward); the layer's input gradient from the column-parallel products is
//!   likewise partial and all-reduced before the norm's backward (Megatron's `f`);
//! - **vocabulary-parallel** embedding and LM head: rank r holds rows `r·V/t..` of the table;
//!   the lookup zeroes other ranks' tokens and all-reduces; the cross-entropy exchanges three
//!   statistics per row and never gathers the logits (`kernels::cpu::vocab_parallel_ce`);
//! - the norms are replicated, and their gradients come out identical on every rank.
//!
//! The model runs on the rank's slice of the config ([`shard_config`]) and reads the same HF
//! tensor names, with the slices' shapes. [`shard_pieces`] maps the slices onto the whole
//! tensors (initialisation, checkpoints, tests).

use super::config::{LlamaConfig, ModelError};
use super::params::ParamTable;
use crate::dtype::Elem;
use crate::kernels::host_copy::{read_f32, write_f32, HostCopy};
use crate::kernels::{View, ViewMut};
use ferrotron_plan::DType;
use ferrotron_view::Memory;
use std::ops::Range;
use std::rc::Rc;

/// A collective over the tensor-parallel group, on a buffer of `len` f32 (`TpComm::run`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpOp {
    /// Every rank's buffer summed into every rank's.
    AllReduce,
    /// Rank r fills block r of t equal blocks; every rank gets every block.
    AllGather,
    /// Every rank fills the whole buffer; rank r gets the sum of block r.
    ReduceScatter,
}

/// A collective's operands where they lie, for a group that runs collectives on the device
/// itself (NCCL): `count` is NCCL's (every element of an all-reduce; one rank's block of an
/// all-gather's output and of a reduce-scatter's input), `send` may be `recv` (an all-reduce
/// in place), both `memory`, in the elements' own type.
#[derive(Clone, Copy, Debug)]
pub struct DeviceOperands {
    pub send: *const u8,
    pub recv: *mut u8,
    pub count: usize,
    pub dtype: DType,
    pub memory: Memory,
}

impl DeviceOperands {
    /// `send` into `recv`, `count` as NCCL counts; `None` on the host, where the group's
    /// buffer serves.
    fn of<S: Elem>(send: *const S, recv: &mut ViewMut<'_, S>, count: usize) -> Option<Self> {
        let memory = recv.memory();
        matches!(memory, Memory::Device(_)).then(|| DeviceOperands {
            send: send.cast(),
            recv: recv.as_mut_ptr().cast(),
            count,
            dtype: S::DTYPE,
            memory,
        })
    }
}

/// The collectives of a tensor-parallel group the model needs. A failed collective leaves its
/// buffer as it was and is reported by the implementation after the pass (the trainer checks).
pub trait TpComm {
    fn size(&self) -> usize;
    fn rank(&self) -> usize;
    /// Runs `op` over the group through an f32 buffer of `len`: `io(buf, true)` writes this
    /// rank's input into it, `io(buf, false)` reads the result (every rank gets the same bits).
    /// One callback for both, so it may hold the caller's tensor mutably; the values may be
    /// stored in any precision (16-bit activations are summed in f32 and rounded once).
    fn run(&self, op: TpOp, len: usize, io: &mut dyn FnMut(&mut [f32], bool));
    /// The copies between the rank's device and the host when the model's tensors live on a
    /// device (`io` then fills the buffer from the device and writes the result back through
    /// them); `None` on the host.
    fn device(&self) -> Option<HostCopy> {
        None
    }
    /// Runs `op` on device operands where they lie, in their own type, ordered after the
    /// device work issued so far and before the work issued next (the host does not wait);
    /// `false` when the group has no such collective for them, and `run` stages them instead.
    /// A failure is recorded like `run`'s.
    fn on_device(&self, _op: TpOp, _x: DeviceOperands) -> bool {
        false
    }
}

/// This rank's place in its tensor-parallel group, and the group's collectives.
#[derive(Clone)]
pub struct TensorParallel {
    pub size: usize,
    pub rank: usize,
    /// Sequence parallelism (Korthikanti et al. 2022 §4.2.2): the residual stream and the
    /// norms hold this rank's 1/t of the tokens; an all-gather before each column-parallel
    /// block and a reduce-scatter after each row-parallel one replace the all-reduces.
    pub sp: bool,
    /// The whole model's config (the rank's model runs on [`shard_config`] of it).
    pub full: LlamaConfig,
    /// The whole model's parameter table (checkpoints hold its tensors).
    pub whole: ParamTable,
    /// This rank's slices of the whole model: (range of its flat parameters, range of the
    /// whole model's), [`shard_pieces`].
    pub pieces: Vec<(Range<usize>, Range<usize>)>,
    comm: Rc<dyn TpComm>,
}

impl std::fmt::Debug for TensorParallel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sp = if self.sp { ", sequence parallel" } else { "" };
        write!(
            f,
            "TensorParallel {{ rank {} of {}{sp} }}",
            self.rank, self.size
        )
    }
}

/// Sums `buf` over `comm`'s group in place, in f32 whatever `S` ([`TensorParallel::sum`]; the
/// trainer's sequence-parallel norm sums call it with the group alone).
pub fn all_reduce<S: Elem>(comm: &dyn TpComm, mut buf: ViewMut<'_, S>) {
    let n = buf.len();
    let x = DeviceOperands::of(buf.as_mut_ptr().cast_const(), &mut buf, n);
    if x.is_some_and(|x| comm.on_device(TpOp::AllReduce, x)) {
        return;
    }
    let dev = comm.device();
    comm.run(TpOp::AllReduce, buf.len(), &mut |f, fill| match fill {
        true => read_f32(dev.as_ref(), buf.as_view(), f),
        false => write_f32(dev.as_ref(), f, buf.rb()),
    });
}

impl TensorParallel {
    /// Rank `comm.rank()` of the group splitting `full` (refused when the group cannot
    /// split it: [`shard_config`]).
    pub fn new(full: LlamaConfig, comm: Rc<dyn TpComm>) -> Result<Self, ModelError> {
        let (size, rank) = (comm.size(), comm.rank());
        let local = ParamTable::new(&shard_config(&full, size)?);
        let whole = ParamTable::new(&full);
        Ok(TensorParallel {
            size,
            rank,
            sp: false,
            pieces: shard_pieces(&whole, &local, rank),
            whole,
            full,
            comm,
        })
    }

    /// With sequence parallelism.
    pub fn with_sp(mut self, sp: bool) -> Self {
        self.sp = sp;
        self
    }

    /// Sums a partial result over the group, in place (in f32, whatever `S`): a row-parallel
    /// product's, or (the trainer's) a norm's gradient shares under sequence parallelism.
    ///
    /// The group's communicators (threads, MPI) stage through host memory: device views are
    /// copied into the group's buffer and back ([`TpComm::device`]); where the group has NCCL,
    /// it takes the views themselves ([`TpComm::on_device`]).
    pub fn sum<S: Elem>(&self, buf: ViewMut<'_, S>) {
        all_reduce(self.comm.as_ref(), buf)
    }

    /// Every rank's `local` rows, rank order, into `full` (sequence parallelism's gather).
    pub(super) fn gather_rows<S: Elem>(&self, local: View<'_, S>, mut full: ViewMut<'_, S>) {
        let (n, r) = (local.len(), self.rank);
        debug_assert_eq!(full.len(), n * self.size);
        let x = DeviceOperands::of(local.as_ptr(), &mut full, n);
        if x.is_some_and(|x| self.comm.on_device(TpOp::AllGather, x)) {
            return;
        }
        let dev = self.comm.device();
        self.comm
            .run(TpOp::AllGather, full.len(), &mut |f, fill| match fill {
                true => read_f32(dev.as_ref(), local, &mut f[r * n..(r + 1) * n]),
                false => write_f32(dev.as_ref(), f, full.rb()),
            });
    }

    /// This rank's block of the sum over ranks of `full` (every rank's partial result for
    /// every row), into `local` (sequence parallelism's reduce-scatter).
    pub(super) fn scatter_rows<S: Elem>(&self, full: View<'_, S>, mut local: ViewMut<'_, S>) {
        let (n, r) = (local.len(), self.rank);
        debug_assert_eq!(full.len(), n * self.size);
        let x = DeviceOperands::of(full.as_ptr(), &mut local, n);
        if x.is_some_and(|x| self.comm.on_device(TpOp::ReduceScatter, x)) {
            return;
        }
        let dev = self.comm.device();
        self.comm
            .run(TpOp::ReduceScatter, full.len(), &mut |f, fill| match fill {
                true => read_f32(dev.as_ref(), full, f),
                false => write_f32(dev.as_ref(), &f[r * n..(r + 1) * n], local.rb()),
            });
    }

    /// The first vocabulary row this rank holds.
    pub fn vocab_first(&self) -> usize {
        self.rank * self.full.vocab / self.size
    }
}

/// The slice of `full` one rank of `t` computes on: query heads, key/value heads, MLP width
/// and vocabulary divided by t (each must divide, as in Megatron-LM, which also pads the
/// vocabulary to a multiple of t; ferrotron asks for a divisible one).
pub fn shard_config(full: &LlamaConfig, t: usize) -> Result<LlamaConfig, ModelError> {
    if full.moe.is_some() && t > 1 {
        return Err(ModelError::Unsupported(format!(
            "tp = {t}: tensor parallelism of a mixture-of-experts model is not supported; run it with --dp"
        )));
    }
    // The largest degree up to t that splits all four.
    let sizes = [full.heads, full.kv_heads, full.intermediate, full.vocab];
    let fits = (1..=t)
        .rev()
        .find(|d| sizes.iter().all(|v| v.is_multiple_of(*d)))
        .unwrap_or(1);
    let check = |field: &'static str, v: usize, what: &str| {
        if v.is_multiple_of(t) {
            Ok(v / t)
        } else {
            Err(ModelError::Config {
                field,
                value: v.to_string(),
                fix: format!(
                    "tensor parallelism splits the {what} over the ranks: tp = {t} must divide it (this model splits at tp = {fits})"
                )
                .into(),
            })
        }
    };
    let mut c = full.clone();
    c.heads = check("num_attention_heads", full.heads, "attention heads")?;
    c.kv_heads = check("num_key_value_heads", full.kv_heads, "key/value heads")?;
    c.intermediate = check("intermediate_size", full.intermediate, "MLP columns")?;
    c.vocab = check("vocab_size", full.vocab, "vocabulary")?;
    Ok(c)
}

/// How a tensor of the whole model maps onto a rank's slice of it: pieces of (range in the
/// rank's flat parameters, range in the whole model's), found by comparing the two tables'
/// shapes: equal (a norm) is replicated, fewer rows is column-parallel (or the vocabulary),
/// fewer columns is row-parallel (one piece per row).
pub fn shard_pieces(
    full: &ParamTable,
    local: &ParamTable,
    rank: usize,
) -> Vec<(Range<usize>, Range<usize>)> {
    let mut out = Vec::new();
    for e in &local.entries {
        let f = full
            .get(&e.name)
            .unwrap_or_else(|| panic!("{} is in the rank's table but not the model's", e.name));
        let (lo, fo) = (e.offset, f.offset);
        if e.shape == f.shape {
            out.push((lo..lo + e.numel, fo..fo + f.numel));
        } else if e.shape[0] != f.shape[0] {
            let start = fo + rank * e.numel;
            out.push((lo..lo + e.numel, start..start + e.numel));
        } else {
            let (rows, cols, full_cols) = (e.shape[0], e.shape[1], f.shape[1]);
            for i in 0..rows {
                let from = fo + i * full_cols + rank * cols;
                out.push((lo + i * cols..lo + (i + 1) * cols, from..from + cols));
            }
        }
    }
    out
}

/// Whether the local tensor holding flat parameter `i` is replicated over the group (a norm).
pub fn replicated(full: &ParamTable, local: &ParamTable, i: usize) -> bool {
    local
        .entries
        .iter()
        .find(|e| e.range().contains(&i))
        .is_some_and(|e| full.get(&e.name).is_some_and(|f| f.shape == e.shape))
}
