//! The trainer's context-parallel group, as the engine calls it (`CpComm`,
//! `crates/engine/src/model/context_parallel.rs`): each pass of the ring copies the block into
//! the plan's `comm.cp.message`, hands it to the next rank (`send_start`, so no rank waits for
//! its peer before receiving) and receives the previous rank's block; bytes are counted, and a
//! failure is recorded and reported after the pass ([`MessageGroup::check`]), so a dead rank stops
//! the step instead of hanging it.
//!
//! The ranks of a group hold the same weights (their gradients are reduced with the
//! data-parallel replicas', over dp × cp) and different tokens of the same sequences; the
//! loader gives each its share ([`crate::data::loader`]).

use crate::message_group::MessageGroup;
use anyhow::Result;
use ferrotron_dist::Communicator;
use ferrotron_engine::model::CpComm;

/// The tag of the ring's messages (below MPI's smallest allowed tag bound, 32767).
const RING_TAG: u32 = 0x4350;

pub struct CpGroup(MessageGroup);

impl std::ops::Deref for CpGroup {
    type Target = MessageGroup;
    fn deref(&self) -> &MessageGroup {
        &self.0
    }
}

impl CpGroup {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        CpGroup(MessageGroup::new(comm))
    }

    /// The sums over the group of per-rank f64 values (an evaluation's loss sum and count:
    /// each rank holds its tokens' part), the same on every rank.
    pub fn sum_f64<const N: usize>(&self, x: [f64; N]) -> Result<[f64; N]> {
        self.sum_f64s(x, "context-parallel sum")
    }
}

impl CpComm for CpGroup {
    fn size(&self) -> usize {
        self.comm.size()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn pass(&self, send: &[f32], recv: &mut [f32]) {
        if self.failed() {
            return;
        }
        let (size, rank) = (self.comm.size(), self.comm.rank());
        let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
        let mut message = self.message();
        let mut out = std::mem::take(&mut *message);
        // Within the planned capacity: no allocation.
        out.clear();
        out.extend_from_slice(send);
        let pending = self.comm.send_start(out, next, RING_TAG);
        let received = self.comm.recv(recv, prev, RING_TAG);
        match (received, pending.wait()) {
            (Ok(()), Ok(back)) => {
                *message = back;
                self.sent(4.0 * send.len() as f64);
            }
            (Err(e), _) | (_, Err(e)) => self.fail("context-parallel ring", e),
        }
    }
}
