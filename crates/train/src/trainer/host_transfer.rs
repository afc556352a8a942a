//! A step's host↔device bytes of the offload tiers, measured by the device they copy through
//! (`ferrotron_engine::kernels::transfer_count::Counted`) and set beside the plan's
//! (`ferrotron_plan::host_transfer`): the per-step metric and the run's last line.

use super::*;
use crate::observe::metrics::HostTransferBytes;

impl Trainer {
    /// The bytes the offload tiers copied since the last call, which starts the count again
    /// (`None`: no offload on a device). Under ZeRO-3's sharded offload the windows are filled
    /// and drained by ZeRO-3's own copies, which the plan does not count as offload: `None`.
    pub(super) fn step_transfer(&mut self) -> Option<HostTransferBytes> {
        let c = self.transfers.as_ref()?;
        let moved = c.take();
        if self.streaming.as_ref().is_some_and(|s| s.sharded()) {
            return None;
        }
        let times = self
            .offload
            .as_mut()
            .map(|o| o.take_times())
            .unwrap_or_default();
        let us = |d: std::time::Duration| d.as_micros().min(u64::MAX as u128) as u64;
        let p = self.plan.host_transfer;
        Some(HostTransferBytes {
            up: moved.up,
            down: moved.down,
            planned_up: p.up,
            planned_down: p.down,
            up_ahead: moved.ahead,
            copy_us: us(moved.busy),
            update_us: us(times.wall),
            host_adamw_us: us(times.host_adamw),
        })
    }
}
