//! Data parallelism's gradient sum on the device itself (issue #33): where every rank has a
//! GPU of its own and NCCL, each gradient range the backward reports final is summed over the
//! replicas in place, on NCCL's stream, as soon as it is final, while the compute stream goes
//! on with the backward; the compute stream waits for the sums only before the optimizer
//! reads them ([`DeviceReduce::land`]). This is DDP's overlap (Li et al. 2020, §3.2.3) without
//! its buckets: the gradients are f32 and contiguous per range, so NCCL sums them where they
//! lie (PyTorch's `gradient_as_bucket_view`), in f32 as the host-staged buckets do, and nothing
//! crosses to the host.
//!
//! Where the gradients are 16-bit (their sum must be taken in f32 and rounded once), under
//! ZeRO (reduce-scatters into shards), expert parallelism or offload, the host-staged buckets
//! of `data_parallel.rs` stay.

use crate::communicator::{Result, ViewMut};
use ferrotron_engine::Elem;
use ferrotron_plan::DType;
use std::ptr::NonNull;

/// A group's in-place sum of device gradients, started range by range and landed at once.
pub trait DeviceReduce {
    /// Starts summing `grads` (f32, this rank's device memory) over the group, in place,
    /// after the device's work issued so far; the host does not wait.
    fn start(&mut self, grads: ViewMut<'_, f32>) -> Result<()>;
    /// The compute stream's next work runs after every sum started; the host does not wait.
    fn land(&mut self) -> Result<()>;
}

/// `v` as a view of f32 when `G` is f32 (the gradients this sum takes), else `None`.
pub fn as_f32<G: Elem>(mut v: ViewMut<'_, G>) -> Option<ViewMut<'_, f32>> {
    if G::DTYPE != DType::F32 {
        return None;
    }
    let (len, mem) = (v.len(), v.memory());
    let p = NonNull::new(v.as_mut_ptr().cast::<f32>()).expect("a view's address is not null");
    // SAFETY: `G` is f32, so these are the same `len` elements, borrowed as `v` was.
    Some(unsafe { ViewMut::from_raw_parts(p, len, mem) })
}
