//! Each traced op's time on the GPU, from CUDA events (issue #32): an event is recorded on
//! the stream before the op's launches and one after, and the step's end reads the times
//! between them (`Kernels::take_device_spans`). The device is never drained to time an op,
//! as a trace with `CUDA_LAUNCH_BLOCKING=1` would: the host keeps launching ahead, and the
//! trace shows the GPU's own time per op and the gaps where it waited for the host.

use crate::kernels::DeviceSpan;
use cudarc::driver::{sys::CUevent_flags, CudaContext, CudaEvent, CudaStream};
use std::sync::Arc;

/// The events of the ops announced since the spans were last taken.
#[derive(Default)]
pub(super) struct OpEvents {
    /// Events made so far, reused from step to step (made only while tracing).
    pool: Vec<CudaEvent>,
    /// Events of `pool` recorded since the last take.
    used: usize,
    /// Each op: its name, and its events before and after (indices into `pool`).
    ops: Vec<(&'static str, usize, usize)>,
}

impl OpEvents {
    /// Records the next event of the pool on `stream`.
    fn record(&mut self, ctx: &Arc<CudaContext>, stream: &CudaStream) -> usize {
        if self.used == self.pool.len() {
            let e = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT));
            self.pool
                .push(e.unwrap_or_else(|e| panic!("CUDA event for a trace: {e:?}")));
        }
        let i = self.used;
        self.used += 1;
        (self.pool[i].record(stream)).unwrap_or_else(|e| panic!("CUDA event record: {e:?}"));
        i
    }

    /// Op `op` begins: its first event.
    pub(super) fn begin(&mut self, op: &'static str, ctx: &Arc<CudaContext>, stream: &CudaStream) {
        let i = self.record(ctx, stream);
        self.ops.push((op, i, i));
    }

    /// The op last begun ends: its second event.
    pub(super) fn end(&mut self, ctx: &Arc<CudaContext>, stream: &CudaStream) {
        let i = self.record(ctx, stream);
        if let Some(op) = self.ops.last_mut() {
            op.2 = i;
        }
    }

    /// The ops' spans since the last take (waiting for their events), and a fresh start.
    pub(super) fn take(&mut self, out: &mut Vec<DeviceSpan>) -> Result<(), String> {
        let ms = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map(f64::from);
        let err = |e| format!("CUDA event times: {e:?}");
        if let Some(&(_, first, _)) = self.ops.first() {
            let zero = &self.pool[first];
            for &(op, a, b) in &self.ops {
                out.push(DeviceSpan {
                    op,
                    start_ms: ms(zero, &self.pool[a]).map_err(err)?,
                    dur_ms: ms(&self.pool[a], &self.pool[b]).map_err(err)?,
                });
            }
        }
        self.ops.clear();
        self.used = 0;
        Ok(())
    }
}
