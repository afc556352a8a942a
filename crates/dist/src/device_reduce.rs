//! Data parallelism's gradient sum on the device itself (issue #33): where every rank has a
//! GPU of its own and NCCL, each gradient range the backward reports final is summed over the
//! replicas in place, on NCCL's stream, as soon as it is final, while the compute stream goes
//! on with the backward; the compute stream waits for the sums only before the optimizer
//! reads them ([`DeviceReduce::land`]). This is DDP's overlap (Li et al. 2020, §3.2.3) without
//! its buckets: the gradients are f32 and contiguous per range, so NCCL sums them where they
//! lie (PyTorch's `gradient_as_bucket_view`), and nothing crosses to the host. f32 gradients
//! are summed in f32, as the host-staged buckets sum them.
//!
//! bf16 gradients are summed by NCCL in bf16: each addition in f32, rounded to bf16 (NCCL's
//! reduction). At two ranks that is the host path's bits (one addition, rounded once); at p
//! ranks a ring rounds up to p − 1 times, as PyTorch DDP's bf16 all-reduce does, where the
//! host-staged buckets add in f32 and round once. Under ZeRO (reduce-scatters into shards),
//! expert parallelism, offload, or with fp16 gradients, the host-staged buckets of
//! `data_parallel.rs` stay.

use crate::communicator::{Result, ViewMut};
use ferrotron_engine::Elem;
use ferrotron_plan::DType;
use std::ptr::NonNull;

/// Gradients on a device, of a type the in-place sum takes.
pub enum Grads<'a> {
    F32(ViewMut<'a, f32>),
    Bf16(ViewMut<'a, half::bf16>),
}

impl Grads<'_> {
    pub fn len(&self) -> usize {
        match self {
            Grads::F32(v) => v.len(),
            Grads::Bf16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes per element.
    pub fn width(&self) -> usize {
        match self {
            Grads::F32(_) => 4,
            Grads::Bf16(_) => 2,
        }
    }
}

/// A group's in-place sum of device gradients, started range by range and landed at once.
pub trait DeviceReduce {
    /// Starts summing `grads` (this rank's device memory) over the group, in place, after the
    /// device's work issued so far; the host does not wait.
    fn start(&mut self, grads: Grads<'_>) -> Result<()>;
    /// The compute stream's next work runs after every sum started; the host does not wait.
    fn land(&mut self) -> Result<()>;
}

/// `v` as gradients the in-place sum takes (f32 or bf16), else `None`.
pub fn grads_of<G: Elem>(mut v: ViewMut<'_, G>) -> Option<Grads<'_>> {
    let (len, mem) = (v.len(), v.memory());
    let p = v.as_mut_ptr();
    // SAFETY: `G` is the type named, so these are the same `len` elements, borrowed as `v` was.
    unsafe {
        match G::DTYPE {
            DType::F32 => Some(Grads::F32(ViewMut::from_raw_parts(nn(p), len, mem))),
            DType::Bf16 => Some(Grads::Bf16(ViewMut::from_raw_parts(nn(p), len, mem))),
            _ => None,
        }
    }
}

fn nn<T, U>(p: *mut T) -> NonNull<U> {
    NonNull::new(p.cast::<U>()).expect("a view's address is not null")
}
