//! What a device backend asked of its driver, counted ([`OpCounter`]): the blocking host
//! synchronisations by site, the kernel launches, the GEMM library calls and the device copies.
//! Issue #32 wants a step with at most three host round trips and far fewer launches; these
//! counts are its before and after. The CUDA backend keeps one counter for the process
//! (`cuda::OPS`), read through [`DeviceAlloc::ops`](super::DeviceAlloc::ops); the trainer
//! reports each step's difference ([`DeviceOps::since`]) in its metrics.
//!
//! A host synchronisation is a call that returns only after the device has finished the work
//! queued before it: a device→host copy (`cuMemcpyDtoH`), a stream synchronize, and the
//! allocation calls that synchronise the device (`cuMemAlloc`/`cuMemFree`). Synchronous
//! host→device copies and memsets from pageable memory also wait for the queue (the driver
//! stages the bytes first), but bring nothing back: they are counted apart, as `writes`.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Where a host synchronisation comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncSite {
    /// `take_loss`: the step's loss sum kept on the device, read back where the gradient norm
    /// did not bring it along.
    CeLoss,
    /// `count_targets`: the number of non-ignored targets.
    TargetCount,
    /// `embedding_backward`: the token ids read back to group positions by token on the host.
    EmbeddingGrouping,
    /// `sum_squares`, `sum_squares_weighted`: the per-block partial sums of a squared gradient
    /// norm.
    GradNorm,
    /// A mixture of experts' row ops: the router's choices read back to build the routing
    /// tables.
    MoeRouting,
    /// The model and the trainer reading device memory through their allocator
    /// (`DeviceAlloc::download`, `HostCopy`): a mixture of experts' router choices for its
    /// expert blocks (`Llama::expert_rows`) and load statistics, the fp16 overflow flag,
    /// checkpoints, the offload tiers.
    StateDownload,
    /// A host-staged communicator's copies to its page-locked staging (`CudaCopy`).
    Staging,
    /// Any other device→host copy (tests and tools: `cuda::download`).
    OtherDownload,
    /// An explicit stream synchronize (`Kernels::synchronize`: the end of a step).
    StreamSync,
    /// Device memory allocated or freed (`cuMemAlloc`/`cuMemFree` synchronise the device).
    Alloc,
}

impl SyncSite {
    pub const ALL: [SyncSite; 10] = [
        SyncSite::CeLoss,
        SyncSite::TargetCount,
        SyncSite::EmbeddingGrouping,
        SyncSite::GradNorm,
        SyncSite::MoeRouting,
        SyncSite::StateDownload,
        SyncSite::Staging,
        SyncSite::OtherDownload,
        SyncSite::StreamSync,
        SyncSite::Alloc,
    ];

    /// The site's name in the metrics (`device_ops.sync_sites`).
    pub fn name(self) -> &'static str {
        match self {
            SyncSite::CeLoss => "ce_loss",
            SyncSite::TargetCount => "target_count",
            SyncSite::EmbeddingGrouping => "embedding_grouping",
            SyncSite::GradNorm => "grad_norm",
            SyncSite::MoeRouting => "moe_routing",
            SyncSite::StateDownload => "state_download",
            SyncSite::Staging => "staging",
            SyncSite::OtherDownload => "other_download",
            SyncSite::StreamSync => "stream_sync",
            SyncSite::Alloc => "alloc",
        }
    }
}

const SITES: usize = SyncSite::ALL.len();

/// One op's time on the device, from the events around it (`Kernels::take_device_spans`):
/// its start after the first op's of the interval, and its length, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeviceSpan {
    pub op: &'static str,
    pub start_ms: f64,
    pub dur_ms: f64,
}

/// Counts since the process started (or, from [`DeviceOps::since`], over an interval).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeviceOps {
    /// Host synchronisations, indexed as [`SyncSite::ALL`].
    pub syncs: [u64; SITES],
    /// Kernels launched.
    pub kernels: u64,
    /// GEMM library calls (cuBLASLt matmuls).
    pub blas: u64,
    /// Device-to-device copies queued on the stream.
    pub copies: u64,
    /// Host→device copies and memsets (queued on the compute stream or synchronous).
    pub writes: u64,
    /// Synchronous copies and memsets, which CUDA runs on the legacy default stream: work a
    /// captured step (CUDA graphs) cannot hold (`cuda::compute_stream`).
    pub legacy: u64,
    /// Captured graphs launched (`cuda::CudaKernels::replay`): one launch for the work of a
    /// whole micro-batch, whose kernels and products the host does not launch again.
    pub graphs: u64,
}

impl DeviceOps {
    /// The counts between `earlier` and `self` (a later reading of the same counter).
    pub fn since(&self, earlier: &DeviceOps) -> DeviceOps {
        let d = |a: u64, b: u64| a.saturating_sub(b);
        DeviceOps {
            syncs: std::array::from_fn(|i| d(self.syncs[i], earlier.syncs[i])),
            kernels: d(self.kernels, earlier.kernels),
            blas: d(self.blas, earlier.blas),
            copies: d(self.copies, earlier.copies),
            writes: d(self.writes, earlier.writes),
            legacy: d(self.legacy, earlier.legacy),
            graphs: d(self.graphs, earlier.graphs),
        }
    }

    pub fn host_syncs(&self) -> u64 {
        self.syncs.iter().sum()
    }

    /// Work queued on the device: kernels, library calls, copies and graphs.
    pub fn launches(&self) -> u64 {
        self.kernels + self.blas + self.copies + self.graphs
    }

    /// The report of these counts in a step's metrics.
    pub fn report(&self) -> DeviceOpsReport {
        DeviceOpsReport {
            host_syncs: self.host_syncs(),
            sync_sites: (SyncSite::ALL.iter())
                .zip(self.syncs)
                .filter(|&(_, n)| n > 0)
                .map(|(s, n)| (s.name().to_string(), n))
                .collect(),
            launches: self.launches(),
            kernels: self.kernels,
            blas: self.blas,
            copies: self.copies,
            writes: self.writes,
            legacy: self.legacy,
            graphs: self.graphs,
        }
    }
}

/// One step's [`DeviceOps`], as the metrics carry them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceOpsReport {
    /// Blocking host synchronisations, in all.
    pub host_syncs: u64,
    /// The same by site ([`SyncSite::name`]), the sites with none left out.
    pub sync_sites: BTreeMap<String, u64>,
    /// `kernels + blas + copies`.
    pub launches: u64,
    pub kernels: u64,
    pub blas: u64,
    pub copies: u64,
    pub writes: u64,
    /// Of the step's copies and memsets, those on the legacy default stream.
    #[serde(default)]
    pub legacy: u64,
    /// Captured graphs launched (`--cuda-graph`), each counted once in `launches`.
    #[serde(default)]
    pub graphs: u64,
}

/// What arms a host synchronisation's wait under a watchdog, and disarms it: `arm` returns the
/// wait's id (`None`: not watched), `disarm` takes it back. Plain functions, so arming a wait
/// allocates nothing on the step's path.
#[derive(Clone, Copy, Debug)]
pub struct SyncHook {
    pub arm: fn(SyncSite) -> Option<u64>,
    pub disarm: fn(u64),
}

thread_local! {
    static HOOK: std::cell::Cell<Option<SyncHook>> = const { std::cell::Cell::new(None) };
}

/// Watches every host synchronisation this thread makes from now on with `hook` (`None`:
/// none). A rank whose GPU runs collectives (NCCL) waits for its peers only here, in the
/// device's queue: a peer that stopped would hold it in its next synchronisation forever, so
/// the communication watchdog (`ferrotron_dist::watchdog`) arms these waits as it arms the
/// host collectives. Per thread: the threads launcher runs each rank on a thread of its own.
pub fn watch_syncs(hook: Option<SyncHook>) {
    HOOK.set(hook);
}

/// A host synchronisation's wait, watched until dropped ([`OpCounter::sync`]).
#[must_use = "hold the guard across the wait: the watchdog watches it until it is dropped"]
pub struct SyncWatch(Option<(u64, fn(u64))>);

impl Drop for SyncWatch {
    fn drop(&mut self) {
        if let Some((id, disarm)) = self.0 {
            disarm(id);
        }
    }
}

/// The counter a backend adds to; relaxed atomics (a count, ordered by nothing).
#[derive(Debug)]
pub struct OpCounter {
    syncs: [AtomicU64; SITES],
    kernels: AtomicU64,
    blas: AtomicU64,
    copies: AtomicU64,
    writes: AtomicU64,
    legacy: AtomicU64,
    graphs: AtomicU64,
}

impl Default for OpCounter {
    fn default() -> Self {
        Self::new()
    }
}

impl OpCounter {
    pub const fn new() -> OpCounter {
        OpCounter {
            syncs: [const { AtomicU64::new(0) }; SITES],
            kernels: AtomicU64::new(0),
            blas: AtomicU64::new(0),
            copies: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            legacy: AtomicU64::new(0),
            graphs: AtomicU64::new(0),
        }
    }

    /// Counts a host synchronisation at `site`, about to wait: the wait is watched (see
    /// [`watch_syncs`]) until the returned guard is dropped, so hold it across the wait.
    pub fn sync(&self, site: SyncSite) -> SyncWatch {
        self.syncs[site as usize].fetch_add(1, Relaxed);
        SyncWatch(HOOK.get().and_then(|h| Some(((h.arm)(site)?, h.disarm))))
    }
    pub fn kernel(&self) {
        self.kernels.fetch_add(1, Relaxed);
    }
    pub fn blas(&self) {
        self.blas.fetch_add(1, Relaxed);
    }
    pub fn copy(&self) {
        self.copies.fetch_add(1, Relaxed);
    }
    pub fn write(&self) {
        self.writes.fetch_add(1, Relaxed);
    }
    /// A synchronous copy or memset: work on the legacy default stream.
    pub fn legacy(&self) {
        self.legacy.fetch_add(1, Relaxed);
    }
    /// A captured graph launched.
    pub fn graph(&self) {
        self.graphs.fetch_add(1, Relaxed);
    }

    pub fn read(&self) -> DeviceOps {
        DeviceOps {
            syncs: std::array::from_fn(|i| self.syncs[i].load(Relaxed)),
            kernels: self.kernels.load(Relaxed),
            blas: self.blas.load(Relaxed),
            copies: self.copies.load(Relaxed),
            writes: self.writes.load(Relaxed),
            legacy: self.legacy.load(Relaxed),
            graphs: self.graphs.load(Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sites_are_indexed_in_order_and_named_once() {
        for (i, s) in SyncSite::ALL.iter().enumerate() {
            assert_eq!(*s as usize, i, "{s:?}");
        }
        let mut names: Vec<_> = SyncSite::ALL.iter().map(|s| s.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), SITES);
    }

    #[test]
    fn a_step_reports_what_was_counted_during_it() {
        let c = OpCounter::new();
        let _ = c.sync(SyncSite::GradNorm);
        c.kernel();
        let before = c.read();
        // The step: two loss reads, the norm, the end-of-step synchronize; 3 kernels, 2
        // products, a copy and an upload.
        for site in [SyncSite::CeLoss, SyncSite::CeLoss, SyncSite::GradNorm] {
            let _ = c.sync(site);
        }
        let _ = c.sync(SyncSite::StreamSync);
        (0..3).for_each(|_| c.kernel());
        c.blas();
        c.blas();
        c.copy();
        c.write();
        let r = c.read().since(&before).report();
        assert_eq!(r.host_syncs, 4);
        let sites: Vec<(&str, u64)> = r.sync_sites.iter().map(|(k, &v)| (&**k, v)).collect();
        assert_eq!(
            sites,
            [("ce_loss", 2), ("grad_norm", 1), ("stream_sync", 1)]
        );
        assert_eq!((r.launches, r.kernels, r.blas, r.copies), (6, 3, 2, 1));
        assert_eq!(r.writes, 1);
        // Nothing since: nothing reported.
        assert_eq!(
            c.read().since(&c.read()).report(),
            DeviceOpsReport::default()
        );
    }
}
