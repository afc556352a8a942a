//! The host-staged communicator: any host communicator (threads, MPI) made to take device
//! views. Each collective copies its device operands into one host staging buffer, runs the
//! inner collective on the host copy, and copies the result back: device → host → inner
//! collective → device. It is how ranks that share a GPU talk (NCCL refuses two ranks on one
//! device), how machines without NCCL run data, tensor and pipeline parallelism on GPUs, and
//! how every collective of a device backend is tested without a GPU (on the emulated device).
//!
//! Memory is planned, not allocated per call: the staging buffer holds `capacity` elements,
//! allocated once when the communicator is made (page-locked on a GPU: [`DeviceCopy::staging`])
//! and reused by every call. A message larger than it goes in chunks, each a whole inner
//! collective on a contiguous range of every block, so a result is the inner backend's, element
//! for element (the threads backend sums each element in rank order, so the staged sums are its
//! bits; an MPI implementation may choose its reduction order by message length, so there the
//! chunk size can change the rounding).
//!
//! Every rank must give its staged communicator the same capacity (the chunks of one call are
//! then the same inner calls on every rank, whatever memory each rank's buffers are in, host
//! views included): [`Staged::new`] checks it, as a collective.

use crate::communicator::{
    CommError, Communicator, Memory, Pending, Region, Result, View, ViewMut,
};
use crate::shapes;
use ferrotron_view::{AsView, AsViewMut, DeviceCopy, HostStaging};
use std::cell::RefCell;
use std::sync::Arc;

/// A host communicator taking views of one device's memory, through a staging buffer.
pub struct Staged {
    inner: Box<dyn Communicator>,
    copy: Arc<dyn DeviceCopy>,
    capacity: usize,
    /// `capacity` host elements; borrowed by one call at a time (a communicator is used by
    /// one thread at a time, as MPI's are).
    staging: RefCell<Box<dyn HostStaging>>,
}

/// The ranges `start..start + len` that cut `n` elements into chunks of at most `chunk`.
fn chunks(n: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..n)
        .step_by(chunk.max(1))
        .map(move |s| (s, chunk.min(n - s)))
}

impl Staged {
    /// Wraps `inner`, staging views of `copy`'s device memory through a buffer of `capacity`
    /// elements (at least twice the group's size: an all-to-all chunk holds one element of
    /// every block going out and coming in). A collective: every rank of `inner` calls it, with
    /// the same capacity, or every rank gets an error naming the capacities.
    pub fn new(
        inner: Box<dyn Communicator>,
        copy: Arc<dyn DeviceCopy>,
        capacity: usize,
    ) -> Result<Staged> {
        let (me, size) = (inner.rank(), inner.size());
        // Every rank's capacity, exact in f32 as two 24-bit halves (f32 holds integers to 2^24).
        const HALF: usize = 1 << 24;
        let mine = [(capacity / HALF) as f32, (capacity % HALF) as f32];
        let mut all = vec![0.0f32; 2 * size];
        inner.all_gather(mine.view(), all.view_mut())?;
        let caps: Vec<usize> = all
            .chunks(2)
            .map(|c| c[0] as usize * HALF + c[1] as usize)
            .collect();
        let usage = |problem: String| CommError::Usage {
            rank: me,
            op: "staged",
            problem,
        };
        if caps.iter().any(|&c| c != capacity) {
            return Err(usage(format!(
                "the ranks' staging capacities differ ({caps:?} elements): give every rank the same"
            )));
        }
        if capacity < 2 * size {
            return Err(usage(format!(
                "a staging capacity of {capacity} elements is below 2 × the group's {size} ranks"
            )));
        }
        let staging = copy.staging(capacity).map_err(|e| {
            usage(format!(
                "cannot allocate {capacity} elements of staging memory: {e}"
            ))
        })?;
        Ok(Staged {
            inner,
            copy,
            capacity,
            staging: RefCell::new(staging),
        })
    }

    /// Elements the staging buffer holds.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn usage(&self, op: &'static str, problem: String) -> CommError {
        CommError::usage(self.rank(), op, problem)
    }

    /// `mem` is the host's or this communicator's device's, else a usage error naming both.
    fn check(&self, mem: Memory, op: &'static str) -> Result<()> {
        match mem {
            Memory::Host => Ok(()),
            m if m == self.copy.memory() => Ok(()),
            m => Err(self.usage(
                op,
                format!(
                    "the buffer is in {m}, and this staged communicator copies {}",
                    self.copy.memory()
                ),
            )),
        }
    }

    /// A device copy that failed leaves the other ranks waiting in the collective: they are
    /// told (`abort`) and this rank reports it.
    fn failed(&self, op: &'static str, e: String) -> CommError {
        let cause = format!(
            "{op}: copying between {} and the host: {e}",
            self.copy.memory()
        );
        self.inner.abort(&cause);
        CommError::PeerFailed {
            rank: self.rank(),
            cause,
        }
    }

    /// `src` into the host elements `dst`.
    fn read(&self, src: View<'_, f32>, dst: &mut [f32], op: &'static str) -> Result<()> {
        match src.try_host() {
            Ok(s) => {
                dst.copy_from_slice(s);
                Ok(())
            }
            Err(_) => self.copy.download(src, dst).map_err(|e| self.failed(op, e)),
        }
    }

    /// The host elements `src` into `dst`.
    fn write(&self, src: &[f32], dst: ViewMut<'_, f32>, op: &'static str) -> Result<()> {
        match dst.memory() {
            Memory::Host => {
                dst.host_mut().copy_from_slice(src);
                Ok(())
            }
            _ => self.copy.upload(src, dst).map_err(|e| self.failed(op, e)),
        }
    }
}

impl Communicator for Staged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn size(&self) -> usize {
        self.inner.size()
    }

    fn all_reduce_sum(&self, mut buf: ViewMut<'_, f32>) -> Result<()> {
        const OP: &str = "all_reduce_sum";
        self.check(buf.memory(), OP)?;
        let mut st = self.staging.borrow_mut();
        for (s, n) in chunks(buf.len(), self.capacity) {
            let st = &mut st.as_mut_slice()[..n];
            self.read(buf.as_view().slice(s..s + n), st, OP)?;
            self.inner.all_reduce_sum(st.view_mut())?;
            self.write(st, buf.rb().slice_mut(s..s + n), OP)?;
        }
        Ok(())
    }

    fn reduce_scatter_sum(&self, send: View<'_, f32>, mut recv: ViewMut<'_, f32>) -> Result<()> {
        const OP: &str = "reduce_scatter_sum";
        self.check(send.memory(), OP)?;
        self.check(recv.memory(), OP)?;
        let (size, m) = (self.size(), recv.len());
        shapes::reduce_scatter(size, send.len(), m).map_err(|e| self.usage(OP, e))?;
        let mut st = self.staging.borrow_mut();
        // Chunk [s, s + n) of every block: size blocks out, one back.
        for (s, n) in chunks(m, self.capacity / (size + 1)) {
            let (out, back) = st.as_mut_slice()[..(size + 1) * n].split_at_mut(size * n);
            for (j, o) in out.chunks_mut(n).enumerate() {
                self.read(send.slice(j * m + s..j * m + s + n), o, OP)?;
            }
            self.inner.reduce_scatter_sum(out.view(), back.view_mut())?;
            self.write(back, recv.rb().slice_mut(s..s + n), OP)?;
        }
        Ok(())
    }

    fn all_gather(&self, send: View<'_, f32>, mut recv: ViewMut<'_, f32>) -> Result<()> {
        const OP: &str = "all_gather";
        self.check(send.memory(), OP)?;
        self.check(recv.memory(), OP)?;
        let (size, m) = (self.size(), send.len());
        shapes::all_gather(size, m, recv.len()).map_err(|e| self.usage(OP, e))?;
        let mut st = self.staging.borrow_mut();
        for (s, n) in chunks(m, self.capacity / (size + 1)) {
            let (out, back) = st.as_mut_slice()[..(size + 1) * n].split_at_mut(n);
            self.read(send.slice(s..s + n), out, OP)?;
            self.inner.all_gather(out.view(), back.view_mut())?;
            for (j, b) in back.chunks(n).enumerate() {
                self.write(b, recv.rb().slice_mut(j * m + s..j * m + s + n), OP)?;
            }
        }
        Ok(())
    }

    fn broadcast(&self, mut buf: ViewMut<'_, f32>, root: usize) -> Result<()> {
        const OP: &str = "broadcast";
        self.check(buf.memory(), OP)?;
        shapes::member(self.size(), root, "root").map_err(|e| self.usage(OP, e))?;
        let me = self.rank();
        let mut st = self.staging.borrow_mut();
        for (s, n) in chunks(buf.len(), self.capacity) {
            let st = &mut st.as_mut_slice()[..n];
            if me == root {
                self.read(buf.as_view().slice(s..s + n), st, OP)?;
            }
            self.inner.broadcast(st.view_mut(), root)?;
            if me != root {
                self.write(st, buf.rb().slice_mut(s..s + n), OP)?;
            }
        }
        Ok(())
    }

    fn all_to_all(&self, send: View<'_, f32>, mut recv: ViewMut<'_, f32>) -> Result<()> {
        const OP: &str = "all_to_all";
        self.check(send.memory(), OP)?;
        self.check(recv.memory(), OP)?;
        let size = self.size();
        shapes::all_to_all(size, send.len(), recv.len()).map_err(|e| self.usage(OP, e))?;
        let b = send.len() / size;
        let mut st = self.staging.borrow_mut();
        // Chunk [s, s + n) of every block, out and back.
        for (s, n) in chunks(b, self.capacity / (2 * size)) {
            let (out, back) = st.as_mut_slice()[..2 * size * n].split_at_mut(size * n);
            for (j, o) in out.chunks_mut(n).enumerate() {
                self.read(send.slice(j * b + s..j * b + s + n), o, OP)?;
            }
            self.inner.all_to_all(out.view(), back.view_mut())?;
            for (j, k) in back.chunks(n).enumerate() {
                self.write(k, recv.rb().slice_mut(j * b + s..j * b + s + n), OP)?;
            }
        }
        Ok(())
    }

    /// The pairwise exchange of the trait's default (pairs in one global order, the lower rank
    /// sending first), each block through [`Staged::send`]/[`Staged::recv`], so in chunks of
    /// the staging buffer; `message` is not needed.
    fn all_to_all_v(
        &self,
        send: View<'_, f32>,
        send_counts: &[usize],
        mut recv: ViewMut<'_, f32>,
        recv_counts: &[usize],
        _message: &mut Region<f32>,
    ) -> Result<()> {
        /// Tag of the exchange ("EP"), the default's.
        const TAG: u32 = 0x4550;
        const OP: &str = "all_to_all_v";
        self.check(send.memory(), OP)?;
        self.check(recv.memory(), OP)?;
        let (me, size) = (self.rank(), self.size());
        shapes::all_to_all_v(size, (send.len(), send_counts), (recv.len(), recv_counts))
            .and_then(|()| match send_counts[me] == recv_counts[me] {
                true => Ok(()),
                false => Err(format!(
                    "this rank sends itself {} elements but expects {}",
                    send_counts[me], recv_counts[me]
                )),
            })
            .map_err(|e| self.usage(OP, e))?;
        let (mut so, mut ro) = (0, 0);
        for p in 0..size {
            let out = send.slice(so..so + send_counts[p]);
            let into = recv.rb().slice_mut(ro..ro + recv_counts[p]);
            (so, ro) = (so + send_counts[p], ro + recv_counts[p]);
            if p == me {
                let mut st = self.staging.borrow_mut();
                let mut into = into;
                for (s, n) in chunks(out.len(), self.capacity) {
                    let st = &mut st.as_mut_slice()[..n];
                    self.read(out.slice(s..s + n), st, OP)?;
                    self.write(st, into.rb().slice_mut(s..s + n), OP)?;
                }
            } else if me < p {
                self.send(out, p, TAG)?;
                self.recv(into, p, TAG)?;
            } else {
                self.recv(into, p, TAG)?;
                self.send(out, p, TAG)?;
            }
        }
        Ok(())
    }

    /// In chunks of the staging buffer, which [`Staged::recv`] receives alike.
    fn send(&self, buf: View<'_, f32>, dst: usize, tag: u32) -> Result<()> {
        const OP: &str = "send";
        self.check(buf.memory(), OP)?;
        shapes::member(self.size(), dst, "destination").map_err(|e| self.usage(OP, e))?;
        let mut st = self.staging.borrow_mut();
        for (s, n) in chunks(buf.len(), self.capacity) {
            let st = &mut st.as_mut_slice()[..n];
            self.read(buf.slice(s..s + n), st, OP)?;
            self.inner.send(st.view(), dst, tag)?;
        }
        Ok(())
    }

    /// A host buffer already: passed to the inner communicator as one message, which a
    /// [`Staged::recv`] receives only if it fits one chunk (the staging buffer), so a longer
    /// one is refused.
    fn send_start(&self, buf: Region<f32>, dst: usize, tag: u32) -> Pending {
        if buf.len() > self.capacity {
            let e = self.usage(
                "send_start",
                format!(
                    "a message of {} elements exceeds the staging buffer of {} (its receiver takes at most one chunk): plan a larger staging capacity",
                    buf.len(),
                    self.capacity
                ),
            );
            return Pending::refused(e);
        }
        self.inner.send_start(buf, dst, tag)
    }

    fn recv(&self, mut buf: ViewMut<'_, f32>, src: usize, tag: u32) -> Result<()> {
        const OP: &str = "recv";
        self.check(buf.memory(), OP)?;
        shapes::member(self.size(), src, "source").map_err(|e| self.usage(OP, e))?;
        let mut st = self.staging.borrow_mut();
        for (s, n) in chunks(buf.len(), self.capacity) {
            let st = &mut st.as_mut_slice()[..n];
            self.inner.recv(st.view_mut(), src, tag)?;
            self.write(st, buf.rb().slice_mut(s..s + n), OP)?;
        }
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }

    super::host_side::overlapped_on_host!(inner);

    fn abort(&self, cause: &str) {
        self.inner.abort(cause)
    }

    fn split_group(&self, members: &[usize]) -> Result<Box<dyn Communicator>> {
        self.split_named(members, "")
    }

    /// The inner communicator's sub-group, staged through a buffer of its own (the same
    /// capacity): groups of one rank may run at once on different threads.
    fn split_named(&self, members: &[usize], name: &str) -> Result<Box<dyn Communicator>> {
        let inner = match name {
            "" => self.inner.split_group(members)?,
            _ => self.inner.split_named(members, name)?,
        };
        Ok(Box::new(Staged::new(
            inner,
            self.copy.clone(),
            self.capacity,
        )?))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunks_cover_the_range_once() {
        let c: Vec<_> = super::chunks(10, 4).collect();
        assert_eq!(c, [(0, 4), (4, 4), (8, 2)]);
        assert_eq!(super::chunks(0, 4).count(), 0);
        assert_eq!(super::chunks(3, 8).collect::<Vec<_>>(), [(0, 3)]);
    }
}
