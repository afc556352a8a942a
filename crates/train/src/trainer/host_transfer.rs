//! A step's host↔device bytes of the offload tiers, measured by the device they copy through
//! (`ferrotron_engine::kernels::transfer_count::Counted`) and set beside the plan's
//! (`ferrotron_plan::host_transfer`): the per-step metric and the run's last line.

use super::*;
use crate::observe::metrics::HostTransferBytes;

impl Trainer {
    /// The bytes the offload tiers copied since the last call, which starts the count again
    /// (`None`: no offload on a device). Under ZeRO-3's sharded offload the windows are filled
    /// and drained by ZeRO-3's own copies, which the plan does not count as offload: `None`.
    pub(super) fn step_transfer(&self) -> Option<HostTransferBytes> {
        let c = self.transfers.as_ref()?;
        let (up, down) = c.take();
        if self.streaming.as_ref().is_some_and(|s| s.sharded()) {
            return None;
        }
        let p = self.plan.host_transfer;
        Some(HostTransferBytes {
            up,
            down,
            planned_up: p.up,
            planned_down: p.down,
        })
    }
}
