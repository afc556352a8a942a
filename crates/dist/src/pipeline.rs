//! The trainer's side of pipeline parallelism (`--pp N`; the model's part is
//! `ferrotron_engine::model::pipeline`): the stage's program of forward and backward work
//! (`ferrotron_plan::schedule`, the order the planner predicts memory from: AFAB, 1F1B or
//! interleaved 1F1B), the in-flight slot each micro-batch takes, and the point-to-point
//! transfers between stages.
//!
//! A stage sends from the plan's `comm.pp.send.{forward,backward}.j` buffers in turn, without
//! waiting for the receiver, and waits for a buffer only when it reuses it
//! (`schedule::send_buffers` proves one per direction never deadlocks); it receives into
//! `comm.pp.recv` and narrows into the activation buffer the arena gives the micro-batch. The
//! time a stage spends blocked in those transfers is its share of the bubble, reported next to
//! the planner's (p − 1)/(v·m) (Narayanan et al. 2021, §2.2). On GPUs with NCCL the same program
//! runs on the device ([`DeviceMessages`], `device_p2p.rs`): device send buffers, receives
//! straight into the activation, no host in the way; the bubble is then the compute stream's
//! time waiting for its receives, timed by CUDA events.

use crate::device_p2p::DeviceP2p;
use crate::group::Group;
use crate::small_sums::{gather_small, SmallSums};
use crate::{AsViewMut, Communicator, Pending, Region};
use anyhow::{anyhow, Result};
use ferrotron_engine::kernels::device_memory::DeviceBuf;
use ferrotron_engine::kernels::host_copy::{read_f32, write_f32, HostCopy};
use ferrotron_engine::kernels::{Memory, View, ViewMut};
use ferrotron_engine::model::tensor_parallel::TpOp;
use ferrotron_engine::model::DeviceOperands;
use ferrotron_engine::Elem;
use ferrotron_plan::schedule::{messages, order, slots, Direction, Message, Work};
use ferrotron_plan::Layout;
use std::time::{Duration, Instant};

/// Tags of the two directions (a channel from one stage to another is read in order).
const TAG: [u32; 2] = [0x7070, 0x7071];

fn lane(d: Direction) -> usize {
    match d {
        Direction::Forward => 0,
        Direction::Backward => 1,
    }
}

/// The send buffers of one direction, used in turn.
#[derive(Default)]
struct Ring {
    idle: Vec<Region<f32>>,
    pending: Vec<Option<Pending>>,
    next: usize,
}

/// The stage's messages on GPUs (NCCL), per direction (forward, backward): the edge it sends
/// on with its device send buffers (used in turn, as the host's), and the edge it receives on.
#[derive(Default)]
pub struct DeviceMessages {
    pub sends: [Option<SendEdge>; 2],
    pub recvs: [Option<Box<dyn DeviceP2p>>; 2],
}

/// The edge a stage sends on, and its device send buffers.
pub type SendEdge = (Box<dyn DeviceP2p>, Vec<DeviceBuf<u8>>);

/// A directed edge of the pipeline: messages of direction `dir` (0 forward, 1 backward) from
/// stage `from` to stage `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Edge {
    pub dir: usize,
    pub from: usize,
    pub to: usize,
}

/// A rank's pipeline group and its stage's program.
pub struct Pipeline {
    /// The pipeline group (its communicator; its small buffer gathers the bubbles and sums).
    group: Group,
    layout: Layout,
    pub stage: usize,
    /// The stage's work in order, and the in-flight slot of each.
    pub work: Vec<Work>,
    pub slots: Vec<u64>,
    /// The slot of chunk 0 each micro-batch holds (its tokens and targets live there).
    pub batch_slot: Vec<usize>,
    rings: [Ring; 2],
    recv: Region<f32>,
    /// The first and last stages with tied embeddings: their two copies' gradients are summed.
    embedding: Option<Group>,
    /// Time blocked in transfers since the counter was last taken.
    pub idle: Duration,
    /// Wall time of the stage's work since the counter was last taken.
    pub span: Duration,
    /// Spans blocked (start, end), for the trace.
    pub waits: Vec<(Instant, Instant)>,
    /// On a device: the copies between the stage's tensors and the host buffers.
    device: Option<HostCopy>,
    /// On GPUs with NCCL: the messages between the devices instead.
    gpus: Option<DeviceMessages>,
    /// Micro-batches a step.
    m: u64,
    /// The trainer's table of the micro-batches in flight on this stage (its type is the
    /// trainer's; empty between steps), kept from step to step so a step allocates none.
    pub in_flight: Option<Box<dyn std::any::Any>>,
}

impl Pipeline {
    /// The program of `stage` of `layout` over `m` micro-batches; `embedding` is the group of
    /// the first and last stage when they share a tied embedding.
    pub fn new(
        comm: Box<dyn Communicator>,
        layout: &Layout,
        m: u64,
        embedding: Option<Box<dyn Communicator>>,
    ) -> Self {
        let stage = comm.rank();
        let work = order(layout, stage as u64, m);
        let slots = slots(&work);
        let mut batch_slot = vec![0; m as usize];
        for (w, &s) in work.iter().zip(&slots) {
            if let Work::F { mb, chunk: 0 } = *w {
                batch_slot[mb as usize] = s as usize;
            }
        }
        Pipeline {
            group: Group::new(comm),
            layout: layout.clone(),
            stage,
            work,
            slots,
            batch_slot,
            rings: Default::default(),
            recv: Region::default(),
            embedding: embedding.map(Group::new),
            idle: Duration::ZERO,
            span: Duration::ZERO,
            waits: Vec::with_capacity(4 * m as usize * layout.pp_virtual as usize + 8),
            device: None,
            gpus: None,
            m,
            in_flight: None,
        }
    }

    /// Every directed edge some stage sends on, sorted: the same list on every stage, so each
    /// pair makes its edges' communicators in one order.
    pub fn edges(&self) -> Vec<Edge> {
        let p = self.layout.pp;
        let mut out: Vec<Edge> = (0..p)
            .flat_map(|s| {
                order(&self.layout, s, self.m)
                    .into_iter()
                    .map(move |w| (s, w))
            })
            .filter_map(|(s, w)| {
                let m = messages(&self.layout, s, w).1?;
                Some(Edge {
                    dir: lane(m.dir),
                    from: s as usize,
                    to: m.to(p) as usize,
                })
            })
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Send buffers per direction the program uses in turn (`schedule::send_buffers`).
    pub fn send_buffers(&self) -> u64 {
        ferrotron_plan::schedule::send_buffers(&self.layout, self.m)
    }

    /// Messages of direction `dir` (0 forward, 1 backward) this stage receives in a step.
    pub fn receives(&self, dir: usize) -> usize {
        let of = |w: &Work| self.messages(*w).0.is_some_and(|m| lane(m.dir) == dir);
        self.work.iter().filter(|w| of(w)).count()
    }

    /// The messages run between the stages' GPUs by `gpus` from now on.
    pub fn messages_on_gpus(&mut self, gpus: DeviceMessages) {
        self.gpus = Some(gpus);
    }

    /// A training step's work on this stage begins (on GPUs, its span and receive waits are
    /// timed on the device from here, for the bubble).
    pub fn begin(&mut self) -> Result<()> {
        self.mark(false)
    }

    /// Marks the start or end of the stage's work on each receiving edge's compute stream.
    fn mark(&mut self, end: bool) -> Result<()> {
        let Some(g) = self.gpus.as_mut() else {
            return Ok(());
        };
        for edge in g.recvs.iter_mut().flatten() {
            edge.mark(end)
                .map_err(|e| anyhow!("pipeline bubble: {e}"))?;
        }
        Ok(())
    }

    /// The stage's tensors live on a device: messages are copied from and into them through
    /// the host send and receive buffers.
    pub fn on_device(&mut self, copy: HostCopy) {
        self.device = Some(copy);
    }

    pub fn stages(&self) -> usize {
        self.layout.pp as usize
    }

    /// Model chunks on this stage (`--pp-virtual`).
    pub fn chunks(&self) -> u64 {
        self.layout.pp_virtual
    }

    /// In-flight slots of chunk `chunk` this program uses.
    pub fn slots_of(&self, chunk: u64) -> u64 {
        self.work
            .iter()
            .zip(&self.slots)
            .filter(|(w, _)| matches!(w, Work::F { chunk: c, .. } if *c == chunk))
            .map(|(_, &s)| s + 1)
            .max()
            .unwrap_or(1)
    }

    /// The global index of model chunk `chunk` of this stage.
    pub fn global_chunk(&self, chunk: u64) -> u64 {
        chunk * self.layout.pp + self.stage as u64
    }

    /// The layers of this stage's chunk `chunk` in a model of `layers` layers.
    pub fn chunk_layers(&self, chunk: u64, layers: usize) -> std::ops::Range<usize> {
        let r = self
            .layout
            .chunk_layers(layers as u64, self.global_chunk(chunk));
        r.start as usize..r.end as usize
    }

    /// What work `w` receives and sends.
    pub fn messages(&self, w: Work) -> (Option<Message>, Option<Message>) {
        messages(&self.layout, self.stage as u64, w)
    }

    /// Exchanges one tiny message each way with each neighbour and sums once over the
    /// embedding group, so what the backend sets up on first use is in the process's baseline.
    pub fn warm_up(&mut self) -> Result<()> {
        let p = self.stages();
        let (next, prev) = ((self.stage + 1) % p, (self.stage + p - 1) % p);
        let mut got = [0.0f32; 1];
        for (to, from, tag) in [(next, prev, TAG[0]), (prev, next, TAG[1])] {
            let sent = self.group.comm.send_start(vec![0.0].into(), to, tag);
            self.group
                .comm
                .recv(got.view_mut(), from, tag)
                .map_err(|e| anyhow!("pipeline warm-up: {e}"))?;
            sent.wait().map_err(|e| anyhow!("pipeline warm-up: {e}"))?;
        }
        if let Some(e) = &self.embedding {
            e.comm
                .all_reduce_start(vec![0.0; 2].into())
                .wait()
                .map_err(|e| anyhow!("pipeline warm-up: {e}"))?;
        }
        self.sum_f64([0.0], "pipeline warm-up sum")?;
        Ok(())
    }

    /// Takes the plan's send buffers (per direction, forward then backward, the `k` it sends
    /// from in turn, none in a direction this stage does not send in; each handed to the
    /// communicator while its message is in flight) and its receive buffer.
    pub fn allocate(&mut self, sends: [Vec<Region<f32>>; 2], recv: Region<f32>) {
        for (ring, bufs) in self.rings.iter_mut().zip(sends) {
            ring.pending = (0..bufs.len()).map(|_| None).collect();
            ring.idle = bufs;
        }
        self.recv = recv;
    }

    fn waited<T>(&mut self, f: impl FnOnce(&mut Self) -> T) -> T {
        let t0 = Instant::now();
        let out = f(self);
        let t1 = Instant::now();
        self.idle += t1 - t0;
        if self.waits.len() < self.waits.capacity() {
            self.waits.push((t0, t1));
        }
        out
    }

    /// Sends `x` as message `m` from the next send buffer of its direction (waiting for that
    /// buffer's last message to be received first).
    pub fn send<S: Elem>(&mut self, m: Message, x: View<'_, S>) -> Result<()> {
        let l = lane(m.dir);
        let to = m.to(self.layout.pp) as usize;
        if let Some((edge, bufs)) = self.gpus.as_mut().and_then(|g| g.sends[l].as_mut()) {
            let ring = &mut self.rings[l];
            let j = ring.next % bufs.len().max(1);
            ring.next += 1;
            let bytes = x.len() * std::mem::size_of::<S>();
            let via = &mut bufs[j];
            assert!(
                bytes <= via.len(),
                "internal: a pipeline message past its device buffer"
            );
            let via = via.view_mut().as_mut_ptr();
            return (edge.send_via(x.as_ptr().cast(), via, j, bytes))
                .map_err(|e| anyhow!("pipeline send to stage {to}: {e}"));
        }
        let ring = &mut self.rings[l];
        let j = ring.next % ring.pending.len().max(1);
        ring.next += 1;
        let mut buf = match self.rings[l].pending[j].take() {
            Some(p) => self
                .waited(|_| p.wait())
                .map_err(|e| anyhow!("pipeline send to stage {to}: {e}"))?,
            None => self.rings[l]
                .idle
                .pop()
                .expect("the plan's send buffers are allocated"),
        };
        assert_eq!(
            buf.len(),
            x.len(),
            "internal: a pipeline message of the plan's size"
        );
        read_f32(self.device.as_ref(), x, &mut buf);
        self.rings[l].pending[j] = Some(self.group.comm.send_start(buf, to, TAG[l]));
        Ok(())
    }

    /// Receives message `m` (from the stage of the chunk next to it) into `x`.
    pub fn recv<S: Elem>(&mut self, m: Message, x: ViewMut<'_, S>) -> Result<()> {
        let p = self.layout.pp;
        let from = match m.dir {
            Direction::Forward => (m.chunk + p - 1) % p,
            Direction::Backward => (m.chunk + 1) % p,
        } as usize;
        if let Some(edge) = self
            .gpus
            .as_mut()
            .and_then(|g| g.recvs[lane(m.dir)].as_mut())
        {
            let (bytes, mut x) = (x.len() * std::mem::size_of::<S>(), x);
            return (edge.recv_into(x.as_mut_ptr().cast(), bytes))
                .map_err(|e| anyhow!("pipeline receive from stage {from}: {e}"));
        }
        let mut buf = std::mem::take(&mut self.recv);
        let r = self.waited(|s| s.group.comm.recv(buf.view_mut(), from, TAG[lane(m.dir)]));
        r.map_err(|e| anyhow!("pipeline receive from stage {from}: {e}"))?;
        assert_eq!(
            buf.len(),
            x.len(),
            "internal: a pipeline message of the plan's size"
        );
        write_f32(self.device.as_ref(), &buf, x);
        self.recv = buf;
        Ok(())
    }

    /// Waits for every send in flight (their buffers back), at the end of the stage's work (on
    /// GPUs, the compute stream waits: the step's end waits for it).
    pub fn flush(&mut self) -> Result<()> {
        if let Some(g) = self.gpus.as_mut() {
            for (edge, _) in g.sends.iter_mut().flatten() {
                edge.settle().map_err(|e| anyhow!("pipeline send: {e}"))?;
            }
        }
        self.mark(true)?;
        for l in 0..2 {
            for j in 0..self.rings[l].pending.len() {
                if let Some(p) = self.rings[l].pending[j].take() {
                    let buf = self
                        .waited(|_| p.wait())
                        .map_err(|e| anyhow!("pipeline send: {e}"))?;
                    self.rings[l].idle.push(buf);
                }
            }
            self.rings[l].next = 0;
        }
        Ok(())
    }

    /// The pipeline group (its communicator, bytes sent, first failure).
    pub fn group(&self) -> &Group {
        &self.group
    }

    /// The first and last stages' group, when they share a tied embedding.
    pub fn embedding_group(&self) -> Option<&Group> {
        self.embedding.as_ref()
    }

    /// Sums the tied embedding's gradient `g` with the other stage's copy, in place: on GPUs
    /// with NCCL where it lies, in its own type (bf16 at two ranks: one addition rounded once,
    /// the host path's bits), else through the receive buffer (so nothing is allocated).
    pub fn sum_embedding<G: Elem>(&mut self, mut g: ViewMut<'_, G>) -> Result<()> {
        let Some(embedding) = &self.embedding else {
            return Ok(());
        };
        let memory = g.memory();
        if let (Some(dc), Memory::Device(_)) = (&*embedding.device_collectives(), memory) {
            if dc.takes(G::DTYPE) {
                let p = g.as_mut_ptr().cast::<u8>();
                let (count, dtype) = (g.len(), G::DTYPE);
                let x = DeviceOperands {
                    send: p.cast_const(),
                    recv: p,
                    count,
                    dtype,
                    memory,
                };
                return (dc.run(TpOp::AllReduce, x))
                    .map_err(|e| anyhow!("tied embedding gradient all-reduce: {e}"));
            }
        }
        let dev = self.device.as_ref();
        let mut buf = std::mem::take(&mut self.recv);
        let step = buf.len().max(1);
        for at in (0..g.len()).step_by(step) {
            let r = at..(at + step).min(g.len());
            buf.set_len(r.len());
            read_f32(dev, g.as_view().slice(r.clone()), &mut buf);
            buf = embedding
                .comm
                .all_reduce_start(buf)
                .wait()
                .map_err(|e| anyhow!("tied embedding gradient all-reduce: {e}"))?;
            write_f32(dev, &buf, g.rb().slice_mut(r));
        }
        buf.resize(step, 0.0);
        self.recv = buf;
        Ok(())
    }

    /// Every stage's bubble of the step just run (stage order): its time blocked in transfers
    /// over its time computing, the measure of the planner's (p − 1)/(v·m). Resets the
    /// counters.
    /// On GPUs with NCCL both are the device's: the compute stream's waits for its receives
    /// and its span from [`Pipeline::begin`] to the flush, timed by events.
    pub fn take_bubbles(&mut self) -> Result<Vec<f64>> {
        let (mut idle, mut span) = (self.idle.as_secs_f64(), self.span.as_secs_f64());
        (self.idle, self.span) = (Duration::ZERO, Duration::ZERO);
        if let Some(g) = self.gpus.as_mut() {
            (idle, span) = (0.0, 0.0);
            for edge in g.recvs.iter_mut().flatten() {
                let (waited, s) = edge
                    .take_times()
                    .map_err(|e| anyhow!("pipeline bubble: {e}"))?;
                (idle, span) = (idle + waited, span.max(s));
            }
        }
        let mine = (idle / (span - idle).max(1e-9)) as f32;
        let mut small = SmallSums::small(&self.group);
        let comm = self.group.comm.as_ref();
        let all = gather_small(comm, &mut small, &[mine], "pipeline bubble")?;
        Ok(all.iter().map(|&b| b as f64).collect())
    }

    /// The planner's bubble: (p − 1)/(v·m) of the ideal compute time.
    pub fn planned_bubble(&self, m: u64) -> f64 {
        (self.layout.pp - 1) as f64 / (self.layout.pp_virtual * m) as f64
    }
}

impl SmallSums for Pipeline {
    fn comm(&self) -> &dyn Communicator {
        self.group.comm.as_ref()
    }
    fn small(&self) -> std::cell::RefMut<'_, Region<f32>> {
        SmallSums::small(&self.group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrotron_plan::PpSchedule;

    /// Stage 0's pipeline of `pp` stages (`v` chunks each) over `m` micro-batches.
    fn stage0(pp: u64, v: u64, schedule: PpSchedule, m: u64) -> Pipeline {
        let comm = crate::threads::world(1, Duration::from_secs(5))
            .pop()
            .unwrap();
        let l = Layout {
            pp,
            pp_virtual: v,
            pp_schedule: schedule,
            ..Layout::default()
        };
        Pipeline::new(Box::new(comm), &l, m, None)
    }

    fn edge(dir: usize, from: usize, to: usize) -> Edge {
        Edge { dir, from, to }
    }

    #[test]
    fn every_stage_lists_the_directed_edges_messages_take_in_one_order() {
        // 1F1B on two stages: forward 0 -> 1, backward 1 -> 0.
        let two = stage0(2, 1, PpSchedule::OneFOneB, 4).edges();
        assert_eq!(two, [edge(0, 0, 1), edge(1, 1, 0)]);
        // Three stages: each neighbour pair, each direction; no wrap-around.
        // Stage 0 receives each micro-batch's gradient, no activation.
        let s0 = stage0(2, 1, PpSchedule::OneFOneB, 4);
        assert_eq!((s0.receives(0), s0.receives(1)), (0, 4));
        let three = stage0(3, 1, PpSchedule::Afab, 4).edges();
        let want = [edge(0, 0, 1), edge(0, 1, 2), edge(1, 1, 0), edge(1, 2, 1)];
        assert_eq!(three, want);
        // Interleaved: the last stage's chunk sends on to the first stage's next chunk, and
        // back: the pair of two stages carries four edges, each a communicator of its own.
        let inter = stage0(2, 2, PpSchedule::Interleaved, 4).edges();
        let want = [edge(0, 0, 1), edge(0, 1, 0), edge(1, 0, 1), edge(1, 1, 0)];
        assert_eq!(inter, want);
    }
}
