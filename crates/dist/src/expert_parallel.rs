//! The trainer's expert-parallel group, as the engine calls it (`EpComm`,
//! `crates/engine/src/model/expert_parallel.rs`): every exchange is the communicator's
//! `all_to_all_v` through the plan's `comm.ep.message` (one block in flight at a time), its
//! bytes counted, and a failure recorded and reported after the pass
//! ([`Group::check`]).

use crate::group::Group;
use crate::{AsView, AsViewMut};
use ferrotron_engine::model::EpComm;

/// The exchanges as the engine calls them.
impl EpComm for Group {
    fn size(&self) -> usize {
        self.comm.size()
    }

    fn rank(&self) -> usize {
        self.comm.rank()
    }

    fn exchange(&self, send: &[f32], sc: &[usize], recv: &mut [f32], rc: &[usize]) {
        if self.failed() {
            return;
        }
        let mut message = self.buffer();
        match self
            .comm
            .all_to_all_v(send.view(), sc, recv.view_mut(), rc, &mut message)
        {
            Ok(()) => {
                let me = self.comm.rank();
                let out: usize = sc.iter().sum::<usize>() - sc[me];
                self.sent(4.0 * out as f64);
            }
            Err(e) => self.fail("expert-parallel all-to-all", e),
        }
    }
}
