//! The trainer's context-parallel group, as the engine calls it (`CpComm`,
//! `crates/engine/src/model/context_parallel.rs`): each pass of the ring copies the block into
//! the plan's `comm.cp.message`, hands it to the next rank (`send_start`, so no rank waits for
//! its peer before receiving) and receives the previous rank's block; bytes are counted, and a
//! failure is recorded and reported after the pass ([`CpGroup::check`]), so a dead rank stops
//! the step instead of hanging it.
//!
//! The ranks of a group hold the same weights (their gradients are reduced with the
//! data-parallel replicas', over dp × cp) and different tokens of the same sequences; the
//! loader gives each its share ([`crate::data::loader`]).

use anyhow::{anyhow, Result};
use ferrotron_dist::Communicator;
use ferrotron_engine::model::CpComm;
use std::cell::{Cell, RefCell};

/// The tag of the ring's messages (below MPI's smallest allowed tag bound, 32767).
const RING_TAG: u32 = 0x4350;

pub struct CpGroup {
    comm: Box<dyn Communicator>,
    /// The plan's `comm.cp.message`, allocated with the first step ([`CpGroup::allocate`]).
    message: RefCell<Vec<f32>>,
    failed: RefCell<Option<String>>,
    /// Bytes this rank sent since the counter was last taken.
    pub bytes: Cell<f64>,
    /// Small values of the loss sums, reused.
    small: RefCell<Vec<f32>>,
}

impl CpGroup {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        CpGroup {
            comm,
            message: RefCell::new(Vec::new()),
            failed: RefCell::new(None),
            bytes: Cell::new(0.0),
            small: RefCell::new(Vec::new()),
        }
    }

    /// The message buffer of the plan (`len` f32).
    pub fn allocate(&self, len: usize) {
        let mut m = self.message.borrow_mut();
        if m.capacity() < len {
            *m = Vec::with_capacity(len);
        }
    }

    /// The error of a pass that failed, if one did.
    pub fn check(&self) -> Result<()> {
        match self.failed.borrow_mut().take() {
            Some(e) => Err(anyhow!(e)),
            None => Ok(()),
        }
    }

    /// The sums over the group of per-rank f64 values (an evaluation's loss sum and count:
    /// each rank holds its tokens' part), the same on every rank.
    pub fn sum_f64<const N: usize>(&self, x: [f64; N]) -> Result<[f64; N]> {
        let mut mine = [0.0f32; 8];
        assert!(2 * N <= mine.len(), "at most four sums at once");
        for (i, v) in x.iter().enumerate() {
            let hi = *v as f32;
            mine[2 * i] = hi;
            mine[2 * i + 1] = (v - hi as f64) as f32;
        }
        let mut small = self.small.borrow_mut();
        let all = crate::data_parallel::gather_small(
            self.comm.as_ref(),
            &mut small,
            &mine[..2 * N],
            "context-parallel sum",
        )?;
        let mut out = [0.0f64; N];
        for rank in all.chunks(2 * N) {
            for (i, o) in out.iter_mut().enumerate() {
                *o += rank[2 * i] as f64 + rank[2 * i + 1] as f64;
            }
        }
        Ok(out)
    }

    pub fn size(&self) -> usize {
        self.comm.size()
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
        if self.failed.borrow().is_some() {
            return;
        }
        let (size, rank) = (self.comm.size(), self.comm.rank());
        let (next, prev) = ((rank + 1) % size, (rank + size - 1) % size);
        let mut message = self.message.borrow_mut();
        let mut out = std::mem::take(&mut *message);
        // Within the planned capacity: no allocation.
        out.clear();
        out.extend_from_slice(send);
        let pending = self.comm.send_start(out, next, RING_TAG);
        let received = self.comm.recv(recv, prev, RING_TAG);
        let sent = pending.wait();
        let fail =
            |e: String| *self.failed.borrow_mut() = Some(format!("context-parallel ring: {e}"));
        match (received, sent) {
            (Ok(()), Ok(back)) => {
                *message = back;
                self.bytes.set(self.bytes.get() + 4.0 * send.len() as f64);
            }
            (Err(e), _) | (_, Err(e)) => fail(e.to_string()),
        }
    }
}
