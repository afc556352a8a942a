//! The trainer's context-parallel group, as the engine calls it (`CpComm`,
//! `crates/engine/src/model/context_parallel.rs`): a pass copies the block into the plan's
//! `comm.cp.message` and hands it to the next rank (`send_start`, so the engine computes on the
//! block while it travels and no rank waits for its peer before receiving), then receives the
//! previous rank's block; bytes are counted, and a failure is recorded and reported after the
//! pass ([`Group::check`]), so a dead rank stops the step instead of hanging it. On GPUs with
//! NCCL (`device_collective.rs`) the block goes as it lies: noted ready when sent, passed with
//! the receive as one NCCL group beside the attention of the block in hand.
//!
//! The ranks of a group hold the same weights (their gradients are reduced with the
//! data-parallel replicas', over dp × cp) and different tokens of the same sequences; the
//! loader gives each its share (`ferrotron_train`'s `data::loader`).

use crate::group::Group;
use crate::AsViewMut;
use ferrotron_engine::kernels::host_copy::{read_f32, write_f32, HostCopy};
use ferrotron_engine::kernels::{Memory, View, ViewMut};
use ferrotron_engine::model::CpComm;

/// The tag of the ring's messages (below MPI's smallest allowed tag bound, 32767).
const RING_TAG: u32 = 0x4350;

/// The ring as the engine calls it; the send in flight is the group's `sending`.
impl CpComm for Group {
    fn size(&self) -> usize {
        self.comm.size()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn send_next(&self, send: View<'_, f32>) {
        if self.failed() {
            return;
        }
        if let (Some(dc), Memory::Device(_)) = (&*self.device_collectives(), send.memory()) {
            if let Err(e) = dc.ring_ready() {
                self.fail("context-parallel ring", e);
                return;
            }
            self.sent(4.0 * send.len() as f64);
            let earlier = self.ready.replace(Some((send.as_ptr(), send.len())));
            assert!(earlier.is_none(), "one ring message in flight at a time");
            return;
        }
        let (size, rank) = (self.comm.size(), self.comm.rank());
        let mut out = std::mem::take(&mut *self.buffer());
        // Within the planned capacity: no allocation.
        out.fit(send.len());
        read_f32(self.device_copy().as_ref(), send, &mut out);
        let pending = self.comm.send_start(out, (rank + 1) % size, RING_TAG);
        self.sent(4.0 * send.len() as f64);
        let earlier = self.sending.borrow_mut().replace(pending);
        assert!(earlier.is_none(), "one ring message in flight at a time");
    }

    fn sum(&self, x: &mut [f32]) {
        self.sum_f32s(x, "context-parallel router statistics");
    }

    fn device(&self) -> Option<HostCopy> {
        self.device_copy()
    }

    fn recv_prev(&self, mut recv: ViewMut<'_, f32>) {
        if let Some((send, n)) = self.ready.take() {
            assert_eq!(n, recv.len(), "the ring receives as much as it sends");
            let on = self.device_collectives();
            let dc = on
                .as_ref()
                .expect("a block noted ready has the device's ring");
            if let Err(e) = dc.ring_pass(send, recv.as_mut_ptr(), n) {
                self.fail("context-parallel ring", e);
            }
            return;
        }
        let Some(pending) = self.sending.borrow_mut().take() else {
            // A failed pass started no send.
            return;
        };
        let (size, rank) = (self.comm.size(), self.comm.rank());
        let from = (rank + size - 1) % size;
        let received = match self.device_copy() {
            // A device block: received into the plan's `comm.cp.receive`, then copied up (the
            // message buffer is the send's, still in flight).
            Some(dev) if recv.memory() != Memory::Host => {
                let mut stage = self.receive_staging();
                stage.clear();
                stage.resize(recv.len(), 0.0);
                let r = self.comm.recv(stage.view_mut(), from, RING_TAG);
                if r.is_ok() {
                    write_f32(Some(&dev), &stage, recv);
                }
                r
            }
            _ => self.comm.recv(recv, from, RING_TAG),
        };
        match (received, pending.wait()) {
            (Ok(()), Ok(back)) => *self.buffer() = back,
            (Err(e), _) | (_, Err(e)) => self.fail("context-parallel ring", e),
        }
    }
}
