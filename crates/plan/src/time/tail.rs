//! What a pipeline stage runs after its last micro-batch: the data-parallel gradient
//! reduction (bucketed, overlapping the last backward), the ZeRO-1/2/3 collectives, and the
//! optimizer step, on the device or on the host with offloading (see the module docs of `time`).

use super::cost::Efficiency;
use super::layer::TimeModel;
use super::overlap;
use super::stage::StageMb;
use crate::cluster::{Group, Link};
use crate::comm::{Collective, DimComm};
use crate::disk_tier::{fp32_states, DiskPlan, DiskTier};
use crate::layout::{Layout, Offload};
use crate::recipe::{Optimizer, Recipe};
use crate::states::RankElems;

/// Host offload: achievable PCIe Gen4 x16 bandwidth and host memory bandwidth (assumptions).
pub(super) const PCIE_BW: f64 = 25e9;
pub(super) const HOST_BW: f64 = 100e9;

/// A stage's data-parallel communication and optimizer time.
pub(super) struct Tail {
    pub(super) dp: DimComm,
    pub(super) optimizer_s: f64,
    /// Seconds of host transfers (offloading).
    pub(super) host: f64,
    /// The disk tier of the offloaded states, when they are on a drive.
    pub(super) disk: Option<DiskPlan>,
}

/// What a stage's tail depends on, computed once per step estimate.
pub(super) struct TailInputs<'a> {
    pub(super) tm: &'a TimeModel<'a>,
    pub(super) layout: &'a Layout,
    pub(super) recipe: &'a Recipe,
    pub(super) e: &'a Efficiency,
    /// The replica groups of dense and of expert parameters.
    pub(super) groups: (Group, Group),
    pub(super) links: (Link, Link),
    /// DDP bucket size, bytes.
    pub(super) bucket: f64,
    /// Micro-batches per step.
    pub(super) mb: f64,
    pub(super) grad_bytes: f64,
    pub(super) param_bytes: f64,
    /// Bytes of a stored (16-bit or 32-bit) weight element.
    pub(super) st: f64,
    /// Whose ZeRO-3 schedule runs (`zero3::applies`).
    pub(super) runtime: crate::runtime::Runtime,
    /// The drive of the offloaded optimizer states (`--disk-gib`).
    pub(super) disk: Option<DiskTier>,
}

impl TailInputs<'_> {
    /// The tail of pipeline stage `stage`, whose per-micro-batch cost is `s`.
    pub(super) fn tail(&self, stage: u64, s: &StageMb) -> Tail {
        let (tm, l, r, e) = (self.tm, self.layout, self.recipe, self.e);
        let (rg, eg) = (&self.groups.0, &self.groups.1);
        let (dp_link, ep_dp_link) = self.links;
        let (mb, grad_bytes, param_bytes, st) =
            (self.mb, self.grad_bytes, self.param_bytes, self.st);
        let RankElems { dense, expert } = tm.rank_elems(l, stage);
        let (dn, en) = (dense as f64, expert as f64);
        let (rd, re) = (rg.size, eg.size);
        let mut dp = DimComm {
            group: rd,
            crosses_nodes: rg.crosses_nodes,
            ..DimComm::default()
        };
        let mut exposed = 0.0;
        let bucket = self.bucket;
        let reduce = |dp: &mut DimComm, c: Collective, count: f64| -> f64 {
            let before = dp.s;
            dp.add_bucketed(c, dn * grad_bytes, rd, dp_link, count, bucket);
            dp.add_bucketed(c, en * grad_bytes, re, ep_dp_link, count, bucket);
            dp.s - before
        };
        let window = s.backward_s;
        let last_bucket = crate::comm::time(Collective::AllReduce, bucket, rd, dp_link);
        // With pipelining, ZeRO-2/3 reduce-scatter gradients once, in the step's last
        // backward, and ZeRO-3 gathers a stage's parameters once, at its first forward
        // (torch.distributed.pipelining + FSDP2 as torchtitan runs them; see states.rs).
        if l.pp > 1 && l.zero == 3 {
            let before = dp.s;
            dp.add(Collective::AllGather, dn * param_bytes, rd, dp_link, 1.0);
            dp.add(Collective::AllGather, en * param_bytes, re, ep_dp_link, 1.0);
            let gather = dp.s - before;
            exposed += overlap::exposed(gather, (s.compute + s.recompute).s());
        }
        let zero = if l.pp > 1 { l.zero.min(1) } else { l.zero };
        match zero {
            0 | 1 => {
                let c = if l.zero == 0 {
                    Collective::AllReduce
                } else {
                    Collective::ReduceScatter
                };
                let t = reduce(&mut dp, c, 1.0);
                if t > 0.0 {
                    exposed += overlap::exposed(t, window).max(last_bucket.min(t));
                }
                dp.what = format!(
                    "{}gradient {} once per step, bucketed, overlapping the last backward",
                    if l.zero == 3 && l.pp > 1 {
                        "parameter all-gather at the stage's first forward, "
                    } else {
                        ""
                    },
                    if l.zero == 0 {
                        "all-reduce"
                    } else {
                        "reduce-scatter"
                    }
                );
            }
            2 => {
                let t = reduce(&mut dp, Collective::ReduceScatter, mb);
                if t > 0.0 {
                    let per = t / mb;
                    exposed += mb * overlap::exposed(per, window).max(last_bucket.min(per));
                }
                dp.what = "gradient reduce-scatter in every micro-batch's backward (ZeRO-2), overlapping it".into();
            }
            _ if crate::zero3::applies(self.runtime, l, expert) => {
                // ferrotron's ZeRO-3 executes `zero3.rs`: each unit's parameters gathered when
                // its windows do not hold it, each unit's gradients reduce-scattered every
                // micro-batch, units padded to whole blocks; prefetched, overlapping compute.
                let units = crate::zero3::unit_lens(tm.tensors, l.tp, |_| true);
                let (gathered, scattered) = crate::zero3::step_collectives(&units, rd, r.grad_acc);
                let before = dp.s;
                dp.add(
                    Collective::AllGather,
                    gathered as f64 * param_bytes,
                    rd,
                    dp_link,
                    1.0,
                );
                dp.add(
                    Collective::ReduceScatter,
                    scattered as f64 * grad_bytes,
                    rd,
                    dp_link,
                    1.0,
                );
                let per = (dp.s - before) / mb;
                if per > 0.0 {
                    exposed += mb * overlap::exposed(per, (s.compute + s.recompute).s());
                }
                dp.what = "parameter all-gathers of the units the windows do not hold and gradient reduce-scatter every micro-batch (ZeRO-3), prefetched to overlap compute".into();
            }
            _ => {
                // ZeRO-3: gather the parameters for the forward and again for the backward,
                // reduce-scatter the gradients, every micro-batch (ZeRO paper §7.2.2: 1.5× the
                // data-parallel volume); prefetched, overlapping the micro-batch's compute.
                let before = dp.s;
                dp.add(
                    Collective::AllGather,
                    dn * param_bytes,
                    rd,
                    dp_link,
                    2.0 * mb,
                );
                dp.add(
                    Collective::AllGather,
                    en * param_bytes,
                    re,
                    ep_dp_link,
                    2.0 * mb,
                );
                dp.add(Collective::ReduceScatter, dn * grad_bytes, rd, dp_link, mb);
                dp.add(
                    Collective::ReduceScatter,
                    en * grad_bytes,
                    re,
                    ep_dp_link,
                    mb,
                );
                let per = (dp.s - before) / mb;
                if per > 0.0 {
                    exposed += mb * overlap::exposed(per, (s.compute + s.recompute).s());
                }
                dp.what = "parameter all-gathers (forward and backward) and gradient reduce-scatter every micro-batch (ZeRO-3), prefetched to overlap compute".into();
            }
        }
        if l.zero == 1 || l.zero == 2 {
            // Updated parameter shards are all-gathered after the optimizer step: exposed, or
            // (Megatron-LM's `--overlap-param-gather`) bucket by bucket under the next step's
            // first forward of this stage, slowed as `overlap::exposed` says.
            let before = dp.s;
            dp.add(Collective::AllGather, dn * param_bytes, rd, dp_link, 1.0);
            dp.add(Collective::AllGather, en * param_bytes, re, ep_dp_link, 1.0);
            let gather = dp.s - before;
            if l.param_gather_overlap {
                let forward = (s.compute + s.recompute).s() - s.backward_s;
                exposed += overlap::exposed(gather, forward);
                dp.what
                    .push_str("; parameter all-gather overlapping the next step's first forward");
            } else {
                exposed += gather;
                dp.what
                    .push_str("; parameter all-gather after the optimizer step (exposed)");
            }
        }
        if rd <= 1 && re <= 1 {
            dp.what = "no data parallelism".into();
        }
        dp.exposed_s = exposed;

        // Optimizer: a memory-bound pass over this rank's shard.
        let opt_elems = if l.zero >= 1 {
            dense.div_ceil(rd) + expert.div_ceil(re)
        } else {
            dense + expert
        } as f64;
        let grad_elems = if l.zero >= 2 {
            dense.div_ceil(rd) + expert.div_ceil(re)
        } else {
            dense + expert
        } as f64;
        let per_param = match (r.optimizer, r.precision.has_master()) {
            // Read grad; read+write master and both moments; write 16-bit weights.
            (Optimizer::Adamw, true) => grad_bytes + 8.0 + 16.0 + st,
            // Read grad; read+write weights and both moments.
            (Optimizer::Adamw, false) => grad_bytes + 8.0 + 16.0,
            (Optimizer::Sgd, true) => grad_bytes + 8.0 + st,
            (Optimizer::Sgd, false) => grad_bytes + 8.0,
        };
        let opt_bytes = opt_elems * per_param + grad_elems * grad_bytes * 2.0;
        let mut disk = None;
        let (optimizer_s, host) = if l.offload == Offload::None {
            (opt_bytes / (e.hbm_bw * e.memory), 0.0)
        } else if let Some(t) = self
            .disk
            .filter(|_| l.offload == Offload::Optimizer && fp32_states(r) > 0)
        {
            // The states on a drive: the host's update of a bucket overlaps the reads ahead
            // and the writes behind (`disk_tier::plan`); gradients down and weights up over
            // PCIe as without the drive.
            let pcie = opt_elems * (grad_bytes + st) / PCIE_BW;
            let host_update = opt_elems * per_param / HOST_BW;
            // (The drive's capacity is checked with the memory plan, `report`.)
            let d = t.timing(opt_elems as u64, fp32_states(r), host_update);
            disk = Some(d);
            (pcie + d.optimizer_s, pcie)
        } else {
            // The update runs on the host: gradients down and weights up over PCIe.
            let pcie = opt_elems * (grad_bytes + st) / PCIE_BW;
            let host_update = opt_elems * per_param / HOST_BW;
            // ferrotron's trainer copies bucket i + 1 down and bucket i − 1 up while the host
            // updates bucket i (`optim/offload_copies.rs`): the larger of the two, plus the
            // first bucket's copy down and the last one's up, which nothing hides. A framework
            // as the planner models it runs them one after the other.
            let copies_and_update = match self.runtime {
                crate::runtime::Runtime::Framework => pcie + host_update,
                _ => {
                    let bucket = self
                        .disk
                        .map_or(crate::disk_tier::DEFAULT_BUCKET, |d| d.bucket);
                    let ramp = pcie * (bucket as f64 / opt_elems.max(1.0)).min(1.0);
                    pcie.max(host_update) + ramp
                }
            };
            let per_mb_params = if l.offload == Offload::Params {
                // Parameters stream in for every forward and backward, and the gradient sums
                // cross both ways after the first micro-batch (`param_stream`).
                let elems = (dense + expert) as f64;
                let compute = (s.compute + s.recompute).s();
                let grads = elems * grad_bytes;
                super::param_stream::exposed_s(elems * st, grads, mb, compute, PCIE_BW)
            } else {
                0.0
            };
            (copies_and_update + per_mb_params, pcie + per_mb_params)
        };
        Tail {
            dp,
            optimizer_s,
            host,
            disk,
        }
    }
}
