//! The one group type of the trainer: a communicator, the one f32 buffer the plan gives the
//! group (`comm.tp.staging`, `comm.ep.message`, `comm.cp.message`; allocated with the first
//! step, so the model's collectives and exchanges allocate nothing), the bytes this rank sent,
//! and the first failure of a collective, recorded during the engine's pass (which cannot
//! return errors) and reported after it ([`Group::check`]), so a dead rank stops the step
//! instead of hanging it. Each dimension's communication is beside its concept:
//! `tensor_parallel.rs` (`TpComm`), `context_parallel.rs` (`CpComm`), `expert_parallel.rs`
//! (`EpComm`) implement the engine's trait for this type. The data-parallel reduction
//! (`DataParallel`: its bytes and first failure are this type's) and the pipeline (`Pipeline`,
//! and the tied embedding's group) hold one too; their planned buffers (the gradient buckets,
//! the send rings) are their own, so this type's stays unallocated there.

use crate::device_collective::DeviceCollective;
use crate::small_sums::SmallSums;
use crate::{Communicator, Pending, Region};
use anyhow::{anyhow, Result};
use ferrotron_engine::kernels::HostCopy;
use std::cell::{Cell, RefCell, RefMut};

pub struct Group {
    pub comm: Box<dyn Communicator>,
    buffer: RefCell<Region<f32>>,
    failed: RefCell<Option<String>>,
    /// Bytes this rank sent to other ranks since the counter was last taken.
    pub bytes: Cell<f64>,
    /// Every rank's few values of a small sum during a pass (and before the planned buffer
    /// exists), reused.
    small: RefCell<Region<f32>>,
    /// A send in flight (the context-parallel ring's block), finished by the next receive.
    pub(crate) sending: RefCell<Option<Pending>>,
    /// On GPUs with NCCL, the ring's block noted ready to go (sent with the next receive).
    pub(crate) ready: Cell<Option<(*const f32, usize)>>,
    /// On a device: the copies that fill the buffer from the device's tensors and write the
    /// results back (`ferrotron_engine::kernels::host_copy`).
    device: RefCell<Option<HostCopy>>,
    /// On a device, the context-parallel ring's receive staging (the planned buffer is the
    /// send's, in flight meanwhile; on the host a block is received in place).
    receive: RefCell<Region<f32>>,
    /// On GPUs with NCCL: the model's collectives run on the device itself
    /// (`device_collective.rs`), the buffer unused by them.
    collectives: RefCell<Option<Box<dyn DeviceCollective>>>,
}

impl Group {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        Group {
            comm,
            buffer: RefCell::default(),
            failed: RefCell::new(None),
            bytes: Cell::new(0.0),
            small: RefCell::default(),
            sending: RefCell::new(None),
            ready: Cell::new(None),
            device: RefCell::new(None),
            receive: RefCell::default(),
            collectives: RefCell::new(None),
        }
    }

    /// On a device, the receive staging: the plan's `comm.cp.receive` (a ring's messages are
    /// as long as its message buffer; the plan lists it for a device rank only).
    pub fn allocate_receive(&self, planned: Region<f32>) {
        *self.receive.borrow_mut() = planned;
    }

    /// The receive staging (a device's ring).
    pub fn receive_staging(&self) -> RefMut<'_, Region<f32>> {
        self.receive.borrow_mut()
    }

    /// The model's tensors live on a device: the group's exchanges copy through `copy`.
    pub fn on_device(&self, copy: HostCopy) {
        *self.device.borrow_mut() = Some(copy);
    }

    /// The model's collectives run on the device by `c` (NCCL over the same ranks) where it
    /// takes their type.
    pub fn collectives_on_device(&self, c: Box<dyn DeviceCollective>) {
        *self.collectives.borrow_mut() = Some(c);
    }

    /// The device's own collectives, if the group has them.
    pub(crate) fn device_collectives(
        &self,
    ) -> std::cell::Ref<'_, Option<Box<dyn DeviceCollective>>> {
        self.collectives.borrow()
    }

    /// The device copies, when the model's tensors live on a device.
    pub fn device_copy(&self) -> Option<HostCopy> {
        self.device.borrow().clone()
    }

    /// Runs each kind of collective once on a tiny buffer, so what the backend sets up on
    /// first use (its worker, channels, the group's meeting point) is part of the process's
    /// baseline, before the plan's first buffer.
    pub fn warm_up(&self, what: &str) -> Result<()> {
        let n = self.comm.size();
        let warm = |r: Result<Region<f32>, crate::CommError>| {
            r.map(drop)
                .map_err(|e| anyhow!("{what} group warm-up: {e}"))
        };
        warm(self.comm.all_reduce_start(vec![0.0; n].into()).wait())?;
        warm(self.comm.all_gather_start(vec![0.0; n].into()).wait())
    }

    /// The buffer of the plan (in the rank's resident region, at the plan's offset).
    pub fn allocate(&self, planned: Region<f32>) {
        *self.buffer.borrow_mut() = planned;
    }

    /// The planned buffer, for one collective or exchange.
    pub fn buffer(&self) -> RefMut<'_, Region<f32>> {
        self.buffer.borrow_mut()
    }

    /// Whether a collective of this pass failed (the later ones are skipped: the other ranks
    /// are gone or going, and the trainer reports the failure after the pass).
    pub fn failed(&self) -> bool {
        self.failed.borrow().is_some()
    }

    /// Records a collective's failure, reported by [`Group::check`].
    pub fn fail(&self, what: &str, e: impl std::fmt::Display) {
        self.failed
            .borrow_mut()
            .get_or_insert_with(|| format!("{what}: {e}"));
    }

    /// Counts `bytes` sent.
    pub fn sent(&self, bytes: f64) {
        self.bytes.set(self.bytes.get() + bytes);
    }

    /// The bytes sent since the last call, rounded (the metrics' count).
    pub fn take_bytes(&self) -> u64 {
        self.bytes.take().round() as u64
    }

    /// The error of a collective that failed during the pass, if one did.
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

/// Small sums (a loss, the gradient norm's parts) run between passes: they gather in the
/// planned buffer once it exists, so they allocate nothing outside the plan.
impl SmallSums for Group {
    fn comm(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }
    fn small(&self) -> RefMut<'_, Region<f32>> {
        let planned = self.buffer.borrow().capacity() > 0;
        match planned {
            true => self.buffer.borrow_mut(),
            false => self.small.borrow_mut(),
        }
    }
}
