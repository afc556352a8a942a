//! Collective communication costs: bytes each rank sends and the time a ring takes, with latency.
//!
//! Bandwidth terms are the ring algorithms' (Patarasuk & Yuan 2009, "Bandwidth optimal
//! all-reduce algorithms"; Thakur, Rabenseifner & Gropp 2005, "Optimization of collective
//! communication operations in MPICH"): for a buffer of X bytes over n ranks, a reduce-scatter or
//! an all-gather moves (n − 1)/n · X per rank in n − 1 steps, an all-reduce (reduce-scatter then
//! all-gather) 2(n − 1)/n · X in 2(n − 1) steps; an all-to-all sends (n − 1)/n of each rank's
//! buffer; a point-to-point send moves X. Time = bytes / link bandwidth + steps × per-hop latency,
//! where the latency steps are the fewer of the ring's and NCCL's double binary tree's
//! (2⌈log₂ n⌉ for an all-reduce; Sanders, Speck & Träff 2009), as NCCL picks trees for small
//! messages at scale. Per-hop latencies come from NCCL's tuning model (see `cluster.rs`).

use crate::cluster::Link;
use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    AllReduce,
    AllGather,
    ReduceScatter,
    AllToAll,
    SendRecv,
}

fn log2_ceil(n: u64) -> f64 {
    (64 - (n.max(1) - 1).leading_zeros()) as f64
}

/// Bytes one rank sends for collective `c` over `n` ranks on a buffer of `bytes` (the whole
/// buffer for all-reduce, all-gather and reduce-scatter; the rank's own send buffer for
/// all-to-all and send/recv).
pub fn bytes_per_rank(c: Collective, bytes: f64, n: u64) -> f64 {
    if n <= 1 && c != Collective::SendRecv {
        return 0.0;
    }
    let frac = (n as f64 - 1.0) / n as f64;
    match c {
        Collective::AllReduce => 2.0 * frac * bytes,
        Collective::AllGather | Collective::ReduceScatter | Collective::AllToAll => frac * bytes,
        Collective::SendRecv => bytes,
    }
}

/// Latency steps of collective `c` over `n` ranks.
pub fn latency_steps(c: Collective, n: u64) -> f64 {
    if n <= 1 && c != Collective::SendRecv {
        return 0.0;
    }
    let ring = (n - 1) as f64;
    let tree = log2_ceil(n);
    match c {
        Collective::AllReduce => 2.0 * ring.min(tree),
        Collective::AllGather | Collective::ReduceScatter => ring.min(tree),
        // Pairwise exchange: n − 1 rounds.
        Collective::AllToAll => ring,
        Collective::SendRecv => 1.0,
    }
}

/// Seconds for collective `c` over `n` ranks on `bytes` across `link`.
pub fn time(c: Collective, bytes: f64, n: u64, link: Link) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    bytes_per_rank(c, bytes, n) / link.bw + latency_steps(c, n) * link.latency
}

/// Seconds for collective `c` on `bytes` issued as buckets of at most `bucket` bytes (PyTorch
/// DDP's gradient buckets, Li et al. 2020 §3.2.3): the same bandwidth term, one latency per
/// bucket.
pub fn time_bucketed(c: Collective, bytes: f64, n: u64, link: Link, bucket: f64) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    let buckets = if bucket > 0.0 {
        (bytes / bucket).ceil()
    } else {
        1.0
    };
    bytes_per_rank(c, bytes, n) / link.bw + buckets * latency_steps(c, n) * link.latency
}

/// One parallel dimension's traffic over a step, per rank.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct DimComm {
    /// Bytes this rank sends per step.
    pub bytes: f64,
    /// Seconds the collectives take per step, overlapped or not.
    pub s: f64,
    /// Seconds on the critical path (not hidden behind compute), per step.
    pub exposed_s: f64,
    /// Ranks in the group.
    pub group: u64,
    pub crosses_nodes: bool,
    /// What is communicated, and what overlaps.
    pub what: String,
}

impl DimComm {
    /// Adds `count` collectives of `bytes` each over `n` ranks (exposure is decided by the
    /// caller, which knows what they overlap with).
    pub fn add(&mut self, c: Collective, bytes: f64, n: u64, link: Link, count: f64) {
        self.bytes += count * bytes_per_rank(c, bytes, n);
        self.s += count * time(c, bytes, n, link);
    }

    /// As `add`, for a bucketed collective (one latency per bucket).
    pub fn add_bucketed(
        &mut self,
        c: Collective,
        bytes: f64,
        n: u64,
        link: Link,
        count: f64,
        bucket: f64,
    ) {
        self.bytes += count * bytes_per_rank(c, bytes, n);
        self.s += count * time_bucketed(c, bytes, n, link, bucket);
    }
}
