//! Data parallelism's gradient sum on the device itself (issue #33): where every rank has a
//! GPU of its own and NCCL, each gradient range the backward reports final is summed over the
//! replicas in place, on NCCL's stream, as soon as it is final, while the compute stream goes
//! on with the backward; the compute stream waits for the sums only before the optimizer
//! reads them ([`DeviceReduce::land`]). This is DDP's overlap (Li et al. 2020, §3.2.3) without
//! its buckets: the gradients are contiguous per range, so NCCL sums them where they lie
//! (PyTorch's `gradient_as_bucket_view`), and nothing crosses to the host. f32 gradients are
//! summed in f32, as the host-staged buckets sum them.
//!
//! bf16 gradients are summed by NCCL in bf16: each addition in f32, rounded to bf16 (NCCL's
//! reduction). At two ranks that is the host path's bits (one addition, rounded once); at p
//! ranks a ring rounds up to p − 1 times, as PyTorch DDP's bf16 all-reduce does, where the
//! host-staged buckets add in f32 and round once.
//!
//! **ZeRO-1** (Rajbhandari et al. 2020, §5.1): each part of a gradient range is summed into its
//! owner's copy only (one NCCL reduce per owner's segment, the range's in one NCCL group: a
//! reduce-scatter's volume, in place, in the gradients' type), and after the update every
//! rank's weights of each segment become its owner's (one broadcast per segment, in place: an
//! all-gather's volume), ordered before the next forward. **ZeRO-2** (§5.2) sums each segment
//! of a window into its owner's shard of the reduced gradients, and the compute stream waits
//! for the sums before the window is cleared for the next layer. NCCL's reduce overwrites the
//! shard, which serves one micro-batch a step; with gradient accumulation (the shard sums the
//! micro-batches' sums) each segment is summed in place into the owner's window instead, and
//! the owner adds it into its shard by the backend's kernel ([`DeviceAdd`], on the compute
//! stream, before the window is cleared). **ZeRO-3** (§5.3) sums its gradient
//! windows as ZeRO-2 does, and gathers each unit's weights into its window as one group of
//! broadcasts, each segment from its owner's shard, started a layer ahead on the communication
//! stream (the prefetch) and waited for by the compute stream only before the layer's kernels.
//! Under expert parallelism the routed experts' replicas sum over their own group as plain data
//! parallelism does (ZeRO-1: each segment into its owner among them, and broadcast back from
//! it). With offload or fp16 gradients, the host-staged buckets of `data_parallel.rs` stay.

use crate::communicator::{Memory, Result, ViewMut};
use ferrotron_engine::Elem;
use ferrotron_plan::DType;
use std::marker::PhantomData;

/// Gradients (or ZeRO-1's weights) on a device, of a type the in-place sum takes (f32 or bf16),
/// borrowed as the view they came from ([`grads_of`]).
pub struct Grads<'a> {
    ptr: *mut u8,
    len: usize,
    mem: Memory,
    pub dtype: DType,
    _borrow: PhantomData<&'a mut [u8]>,
}

impl Grads<'_> {
    /// Their address, elements and memory.
    pub fn raw(&mut self) -> (*mut u8, usize, Memory) {
        (self.ptr, self.len, self.mem)
    }

    /// Their bytes.
    pub fn bytes(&self) -> usize {
        self.len * self.dtype.bytes() as usize
    }
}

/// A group's in-place sum of device gradients, started range by range and landed at once.
pub trait DeviceReduce {
    /// Starts summing `grads` (this rank's device memory) over the group, in place, after the
    /// device's work issued so far; the host does not wait.
    fn start(&mut self, grads: Grads<'_>) -> Result<()>;
    /// Starts summing each of `parts` over the group into its owner's copy, as one group,
    /// after the device's work issued so far; the host does not wait. Every rank gives the
    /// same parts in the same order.
    fn start_owned(&mut self, parts: &mut dyn Iterator<Item = Owned<'_>>) -> Result<()>;
    /// The compute stream's next work runs after every sum started; the host does not wait.
    fn land(&mut self) -> Result<()>;
    /// Starts making every rank's copy of each of `parts` its owner's, as one group, after the
    /// device's work issued so far: from the owner's copy in place, or from its `into` where
    /// given (ZeRO-3: its shard, into every rank's window). [`DeviceReduce::land`] orders the
    /// compute stream after it; the host does not wait.
    fn broadcast_owned(&mut self, parts: &mut dyn Iterator<Item = Owned<'_>>) -> Result<()>;
}

/// `acc += x` on the device, both this rank's memory of one type and length, on the compute
/// stream (the backend's `add_inplace`): ZeRO-2 and 3 add each micro-batch's sums into the
/// owner's shard with it, as the host's buckets add theirs.
pub type DeviceAdd = Box<dyn Fn(Grads<'_>, Grads<'_>)>;

/// A segment of ZeRO's partition on every rank, and its owner: summed into the owner's copy
/// (`into`: its shard of the reduced gradients, ZeRO-2 and 3; `None`: in place, ZeRO-1), or
/// broadcast from it (from `into`, its shard of the weights, ZeRO-3; `None`: in place, ZeRO-1
/// and 2).
pub struct Owned<'a> {
    pub part: Grads<'a>,
    pub owner: usize,
    pub into: Option<Grads<'a>>,
}

/// `v` as gradients the in-place sum takes (f32 or bf16), else `None`.
pub fn grads_of<G: Elem>(mut v: ViewMut<'_, G>) -> Option<Grads<'_>> {
    matches!(G::DTYPE, DType::F32 | DType::Bf16).then(|| Grads {
        ptr: v.as_mut_ptr().cast(),
        len: v.len(),
        mem: v.memory(),
        dtype: G::DTYPE,
        _borrow: PhantomData,
    })
}
