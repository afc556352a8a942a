//! The pipeline's messages between GPUs (issue #33): where every stage has a GPU of its own and
//! NCCL, a stage's boundary activation (forward) or its gradient (backward) goes from the
//! sender's device to the receiver's by NCCL, instead of device → host send buffer → host
//! communicator → host receive buffer → device, and neither host waits for it.
//!
//! The host path's program is kept, device for host (`pipeline.rs`): a stage copies each
//! message into the next of its `k` send buffers (`schedule::send_buffers`) on the compute
//! stream and goes on; the compute stream waits for a buffer's last send only when it refills
//! it. A receive lands straight in the activation the model asks for, ordered after the
//! compute stream's work so far, and the compute stream waits for it. So the device's waits
//! are the host program's, whose completion with `k` buffers the planner proves (a Kahn
//! network with bounded channels: the same for any timing).
//!
//! Each directed edge (direction, sender → receiver) is a communicator of its own, with its
//! own stream, as PyTorch's ProcessGroupNCCL keeps one per peer pair for send/recv: NCCL
//! matches a pair's messages in call order, so the forward and backward messages between two
//! stages (and the interleaved schedule's wrap-around) must not share one, and a send held in
//! a stream must not hold a receive behind it.

use crate::communicator::Result;

/// One direction of one pipeline edge on the device (NCCL between this stage and the peer).
pub trait DeviceP2p: Send {
    /// Makes the events of `slots` send buffers and of a training step's `receives` (and the
    /// stage's start and end marks), once before the first step, so that no step makes any.
    fn reserve(&mut self, slots: usize, receives: usize) -> Result<()>;
    /// Copies `bytes` from `src` into send buffer `via` (number `slot` of the sender's ring)
    /// on the compute stream, once that buffer's last send has gone, then sends `via` to the
    /// peer on the edge's stream behind the copy; the compute stream goes on meanwhile.
    /// `src` may be reused by the compute stream's next work; `via` is left alone until the
    /// next send through `slot`.
    fn send_via(&mut self, src: *const u8, via: *mut u8, slot: usize, bytes: usize) -> Result<()>;
    /// Receives `bytes` from the peer into `dst` (this GPU), behind the compute stream's work
    /// so far (which may still read `dst`); the compute stream's next work runs after it. The
    /// compute stream's wait is timed (events around it), for the bubble.
    fn recv_into(&mut self, dst: *mut u8, bytes: usize) -> Result<()>;
    /// The compute stream's next work runs after every send so far: their buffers are free.
    fn settle(&mut self) -> Result<()>;
    /// Marks the start (`end` false: the receives from here to the take are timed) or the end
    /// of a stage's training step on the compute stream.
    fn mark(&mut self, end: bool) -> Result<()>;
    /// Seconds the compute stream waited for this edge's receives, and between the last start
    /// and end marks (0 without both), since the last call; waits for the events (call it
    /// once the step's work has run).
    fn take_times(&mut self) -> Result<(f64, f64)>;
}
