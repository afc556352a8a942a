//! The trainer's expert-parallel group, as the engine calls it (`EpComm`,
//! `crates/engine/src/model/expert_parallel.rs`): every exchange is the communicator's
//! `all_to_all_v` through the plan's `comm.ep.message` (one block in flight at a time), its
//! bytes counted, and a failure recorded and reported after the pass ([`EpGroup::check`]), so
//! a dead rank stops the step instead of hanging it.

use anyhow::{anyhow, Result};
use ferrotron_dist::Communicator;
use ferrotron_engine::model::EpComm;
use std::cell::{Cell, RefCell};

pub struct EpGroup {
    comm: Box<dyn Communicator>,
    /// The plan's `comm.ep.message`, allocated with the first step ([`EpGroup::allocate`]).
    message: RefCell<Vec<f32>>,
    failed: RefCell<Option<String>>,
    /// Bytes this rank sent to other ranks since the counter was last taken.
    pub bytes: Cell<f64>,
    /// Small values of the gradient norm's sum, reused.
    small: RefCell<Vec<f32>>,
}

impl EpGroup {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        EpGroup {
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

    /// The error of an exchange that failed during the pass, if one did.
    pub fn check(&self) -> Result<()> {
        match self.failed.borrow_mut().take() {
            Some(e) => Err(anyhow!(e)),
            None => Ok(()),
        }
    }

    /// The sum over the group of a per-rank f64 (the experts' part of the gradient norm), the
    /// same on every rank.
    pub fn sum_f64(&self, x: f64) -> Result<f64> {
        let hi = x as f32;
        let mine = [hi, (x - hi as f64) as f32];
        let mut small = self.small.borrow_mut();
        let all = crate::data_parallel::gather_small(
            self.comm.as_ref(),
            &mut small,
            &mine,
            "expert-parallel gradient norm",
        )?;
        Ok(all.chunks(2).map(|c| c[0] as f64 + c[1] as f64).sum())
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
}

impl EpComm for EpGroup {
    fn size(&self) -> usize {
        self.comm.size()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn exchange(&self, send: &[f32], sc: &[usize], recv: &mut [f32], rc: &[usize]) {
        if self.failed.borrow().is_some() {
            return;
        }
        let mut message = self.message.borrow_mut();
        match self.comm.all_to_all_v(send, sc, recv, rc, &mut message) {
            Ok(()) => {
                let me = self.comm.rank();
                let out: usize = sc.iter().sum::<usize>() - sc[me];
                self.bytes.set(self.bytes.get() + 4.0 * out as f64);
            }
            Err(e) => {
                *self.failed.borrow_mut() = Some(format!("expert-parallel all-to-all: {e}"));
            }
        }
    }
}
