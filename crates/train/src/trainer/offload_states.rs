//! `--offload optimizer` in the trainer: once the state is initialised or loaded, the master
//! weights and Adam's moments move into the offload tier (host memory, or files under
//! `--offload-dir`), and the rank's plan takes the tier's host figure: the planner's
//! host-resident states (`MemoryPlan::host_bytes`), or with the disk tier only the buckets
//! in flight (`ferrotron_plan::disk_tier`), plus a device's staging of one bucket.
//! `--offload params` also moves the weights and gradients into host memory
//! (`crate::offload_params`): the optimizer then reads and writes them there, with no staging.

use super::*;
use crate::offload_params::Streaming;
use crate::optim::disk_states::free_bytes;
use crate::optim::offload::{self, record_plan, OffloadPlan, Offloaded};
use anyhow::Context;
use ferrotron_engine::kernels::transfer_count::Counted;
use ferrotron_plan::disk_tier::{self, Disk};
use ferrotron_plan::Offload;

impl Trainer {
    /// Moves the optimizer states into the offload tier, when the run offloads them.
    pub(super) fn offload_states(&mut self) -> Result<()> {
        let streams = self.cfg.parallel.offload == Offload::Params;
        if self.cfg.parallel.offload == Offload::None {
            return Ok(());
        }
        let n = self.opt_len;
        let bucket = (self.cfg.runtime.offload_bucket as usize).min(n).max(1);
        let p = self.cfg.precision.kind;
        let (g, s) = (
            p.engine_grads().bytes() as usize,
            p.storage().bytes() as usize,
        );
        let dir = self.cfg.runtime.offload_dir.clone();
        // The tiers copy through a device that counts the bytes (`host_transfer.rs`).
        let counted = self.device_alloc.clone().map(Counted::new);
        let counting = counted.clone().map(|c| c as Arc<dyn DeviceAlloc>);
        self.transfers = counted;
        let states = 2 + self.master.is_some() as u64;
        // Streamed weights and gradients are in host memory already: no staging.
        let device = (counting.clone()).filter(|_| !streams).map(|d| (d, g, s));
        let staging = match device {
            Some(_) => offload::staging_bytes(n, bucket, g, s),
            None => 0,
        };
        let mut o = Offloaded::new(
            n,
            bucket,
            // (A plan with the master weights on the host tier has no place for them in the
            // weights' region: they are a heap region, taken without a copy.)
            (self.master.take()).map(|m| m.into_vec().unwrap_or_else(|m| m.to_vec())),
            self.opt.take(),
            dir.as_deref(),
            self.world_rank(),
            device,
        )?;
        // The planner's figure for the states in host memory, and the disk tier's share of
        // it (its bandwidth an NVMe drive's, `Disk::nvme`; the update's own time is not
        // modelled here, so the tier's time is its I/O).
        let states_bytes = self.plan.plan.host_bytes;
        let disk = match &dir {
            Some(d) => {
                let free = free_bytes(d)? + states_bytes;
                let bucket_bytes = bucket as u64 * 4 * states;
                Some(
                    disk_tier::plan(states_bytes, bucket_bytes, 0.0, &Disk::nvme(free))
                        .map_err(|e| anyhow::anyhow!("{e}"))?,
                )
            }
            None => None,
        };
        let host_bytes = disk.map_or(states_bytes, |d| d.host_bytes) + staging;
        self.plan.plan.host_bytes = host_bytes;
        let plan = OffloadPlan {
            states_bytes,
            host_bytes,
            staging_bytes: staging,
            disk,
        };
        record_plan(plan);
        o.plan = Some(plan);
        self.offload = Some(o);
        if streams {
            let dev = (counting.clone())
                .context("offload = params: the weights stream to a device (checked before)")?;
            let t = &self.model.params;
            // Under ZeRO-3 the host keeps this rank's shard alone (ZeRO-Infinity).
            let shard = self.gather.as_ref().map(|_| n);
            let st = Streaming::new(&self.params, p.engine_grads(), t, dev, shard);
            st.check_plan(&self.plan)?;
            self.streaming = Some(st);
            // The streamed copy is the weights' home from here on: the first one is freed
            // before anything else takes host memory.
            self.params = Flat::zeros(self.params.dtype(), 0);
        }
        Ok(())
    }

    /// The offload tier's line for the start of a run (`None` without offload).
    pub fn offload_line(&self) -> Option<String> {
        let o = self.offload.as_ref()?;
        let (Some(s), Some(p)) = (&self.streaming, o.plan) else {
            return Some(o.describe());
        };
        let master = match self.cfg.precision.kind.has_master() {
            true => ", fp32 master weights",
            false => "",
        };
        Some(format!(
            "offload: {}weights, gradients{master} and Adam's moments in host memory ({:.1} MiB); each unit {} into the device's windows as the model reaches it, the next layer one ahead ({} elements: the embedding, the head, two layers)",
            if s.sharded() { "this rank's ZeRO-3 shard of the " } else { "" },
            p.host_bytes as f64 / (1u64 << 20) as f64,
            if s.sharded() { "all-gathered from every rank's host shard" } else { "uploaded" },
            s.param_windows()
        ))
    }

    /// What the plan says the offload tier takes (`None` without offload).
    pub fn offload_plan(&self) -> Option<OffloadPlan> {
        self.offload.as_ref().and_then(|o| o.plan)
    }
}
