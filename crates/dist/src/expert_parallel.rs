//! The trainer's expert-parallel group, as the engine calls it (`EpComm`,
//! `crates/engine/src/model/expert_parallel.rs`): every exchange is the communicator's
//! `all_to_all_v` through the plan's `comm.ep.message` (one block in flight at a time), its
//! bytes counted, and a failure recorded and reported after the pass
//! ([`Group::check`]). On a device the blocks are views of its memory (the engine's
//! `comm.ep.send` / `comm.ep.recv`), staged through the same message buffer ([`staged`]), or on
//! GPUs with NCCL exchanged where they lie (`device_collective.rs`).

use crate::group::Group;
use crate::{AsView, AsViewMut, CommError, Communicator};
use ferrotron_engine::kernels::host_copy::{read_f32, write_f32, HostCopy};
use ferrotron_engine::kernels::{Memory, View, ViewMut};
use ferrotron_engine::model::EpComm;

/// The exchanges as the engine calls them.
impl EpComm for Group {
    fn size(&self) -> usize {
        self.comm.size()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn exchange(&self, send: View<'_, f32>, sc: &[usize], recv: ViewMut<'_, f32>, rc: &[usize]) {
        if self.failed() {
            return;
        }
        let on_device = send.memory() != Memory::Host || recv.memory() != Memory::Host;
        let nccl = self.device_collectives();
        let mut message = self.buffer();
        let done = match (nccl.as_ref().filter(|_| on_device), self.device_copy()) {
            (Some(dc), _) => dc.all_to_all_v(send, sc, recv, rc),
            (None, dev) => match dev.filter(|_| on_device) {
                Some(dev) => {
                    let cap = message.capacity();
                    message.set_len(cap);
                    let m = message.as_view_mut().host_mut();
                    staged(self.comm.as_ref(), &dev, m, (send, sc), (recv, rc))
                }
                None => self.comm.all_to_all_v(send, sc, recv, rc, &mut message),
            },
        };
        match done {
            Ok(()) => {
                let me = self.comm.rank();
                let out: usize = sc.iter().sum::<usize>() - sc[me];
                self.sent(4.0 * out as f64);
            }
            Err(e) => self.fail("expert-parallel all-to-all", e),
        }
    }
}

/// `all_to_all_v` of device blocks through the host buffer `m` (the plan's `comm.ep.message`,
/// the same length on every rank): each block to or from a peer goes in pieces of `m`, read
/// from the device into it and sent, or received into it and written to the device; the
/// lower rank of a pair sends first (so every send meets its receive); this rank's own block
/// is copied through `m`. The values are f32 both sides: the exchange moves bits.
fn staged(
    comm: &dyn Communicator,
    dev: &HostCopy,
    m: &mut [f32],
    (send, sc): (View<'_, f32>, &[usize]),
    (mut recv, rc): (ViewMut<'_, f32>, &[usize]),
) -> Result<(), CommError> {
    /// Tag of the exchange ("EP").
    const TAG: u32 = 0x4550;
    let me = comm.rank();
    let piece = m.len().max(1);
    let (mut so, mut ro) = (0, 0);
    for p in 0..comm.size() {
        let out = send.slice(so..so + sc[p]);
        let mut into = recv.rb().slice_mut(ro..ro + rc[p]);
        (so, ro) = (so + sc[p], ro + rc[p]);
        let give = |m: &mut [f32]| -> Result<(), CommError> {
            for at in (0..out.len()).step_by(piece) {
                let part = &mut m[..piece.min(out.len() - at)];
                read_f32(Some(dev), out.slice(at..at + part.len()), part);
                comm.send(part.view(), p, TAG)?;
            }
            Ok(())
        };
        let mut take = |m: &mut [f32]| -> Result<(), CommError> {
            for at in (0..into.len()).step_by(piece) {
                let part = &mut m[..piece.min(into.len() - at)];
                comm.recv(part.view_mut(), p, TAG)?;
                write_f32(Some(dev), part, into.rb().slice_mut(at..at + part.len()));
            }
            Ok(())
        };
        if p == me {
            for at in (0..out.len()).step_by(piece) {
                let part = &mut m[..piece.min(out.len() - at)];
                read_f32(Some(dev), out.slice(at..at + part.len()), part);
                write_f32(Some(dev), part, into.rb().slice_mut(at..at + part.len()));
            }
        } else if me < p {
            give(m)?;
            take(m)?;
        } else {
            take(m)?;
            give(m)?;
        }
    }
    Ok(())
}
