//! What the trainer's expert- and context-parallel groups share: a communicator, the one f32
//! message buffer the plan gives the group (`comm.ep.message`, `comm.cp.message`; allocated with
//! the first step, so exchanges allocate nothing), the bytes this rank sent, and the first
//! failure of an exchange, recorded during the engine's pass (which cannot return errors) and
//! reported after it ([`MessageGroup::check`]), so a dead rank stops the step instead of
//! hanging it.

use crate::small_sums::SmallSums;
use anyhow::{anyhow, Result};
use ferrotron_dist::Communicator;
use std::cell::{Cell, RefCell, RefMut};

pub struct MessageGroup {
    pub comm: Box<dyn Communicator>,
    message: RefCell<Vec<f32>>,
    failed: RefCell<Option<String>>,
    /// Bytes this rank sent to other ranks since the counter was last taken.
    pub bytes: Cell<f64>,
    /// Every rank's few values of a small sum, reused.
    small: RefCell<Vec<f32>>,
}

impl MessageGroup {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        MessageGroup {
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

    /// The planned message buffer, for one exchange.
    pub fn message(&self) -> RefMut<'_, Vec<f32>> {
        self.message.borrow_mut()
    }

    /// Whether an exchange of this pass failed (the later ones are skipped).
    pub fn failed(&self) -> bool {
        self.failed.borrow().is_some()
    }

    /// Records an exchange's failure, reported by [`MessageGroup::check`].
    pub fn fail(&self, what: &str, e: impl std::fmt::Display) {
        self.failed
            .borrow_mut()
            .get_or_insert(format!("{what}: {e}"));
    }

    /// Counts `bytes` sent.
    pub fn sent(&self, bytes: f64) {
        self.bytes.set(self.bytes.get() + bytes);
    }

    /// The error of an exchange that failed during the pass, if one did.
    pub fn check(&self) -> Result<()> {
        match self.failed.borrow_mut().take() {
            Some(e) => Err(anyhow!(e)),
            None => Ok(()),
        }
    }

    /// Sums `x` over the group element by element, in rank order (the same bits on every
    /// rank), through the reused small buffer; a failure is recorded like an exchange's.
    pub fn sum_f32s(&self, x: &mut [f32], what: &str) {
        if self.failed() {
            return;
        }
        let mut small = self.small.borrow_mut();
        let n = x.len();
        match crate::small_sums::gather_small(self.comm.as_ref(), &mut small, x, what) {
            Ok(all) => {
                x.fill(0.0);
                for rank in all.chunks(n) {
                    x.iter_mut().zip(rank).for_each(|(s, v)| *s += v);
                }
            }
            Err(e) => self.fail(what, e),
        }
    }

    pub fn size(&self) -> usize {
        self.comm.size()
    }

    pub fn rank(&self) -> usize {
        self.comm.rank()
    }
}

impl SmallSums for MessageGroup {
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn small(&self) -> RefMut<'_, Vec<f32>> {
        self.small.borrow_mut()
    }
}
