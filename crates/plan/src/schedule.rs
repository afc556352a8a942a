//! The program of one pipeline stage over the first two optimizer steps: which micro-batch
//! chunk runs forward or backward when (AFAB, 1F1B, interleaved 1F1B), and the allocations
//! and frees each implies.

use crate::layout::{Layout, PpSchedule};

/// One unit of work of a stage: forward or backward of micro-batch `mb` on model chunk `chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Work {
    F { mb: u64, chunk: u64 },
    B { mb: u64, chunk: u64 },
}

/// Warm-up forwards on `stage` before the first backward.
/// 1F1B: p − s − 1 (Narayanan et al. 2021, PipeDream-Flush). Interleaved with v chunks:
/// (p − s − 1)·2 + (v − 1)·p (Megatron-LM `schedules.py`); this reproduces Korthikanti et al.
/// 2022's first-stage factor: p·(L/p)·(1 + (p − 1)/(p·v)) layers in flight.
pub fn warmup(l: &Layout, stage: u64, micro_batches: u64) -> u64 {
    let (p, v) = (l.pp, l.pp_virtual);
    let total = micro_batches * v;
    match l.pp_schedule {
        PpSchedule::Afab => total,
        PpSchedule::OneFOneB => (p - stage - 1).min(total),
        PpSchedule::Interleaved => ((p - stage - 1) * 2 + (v - 1) * p).min(total),
    }
}

/// Micro-batches simulated per step. The steady 1F1B phase repeats itself, so simulating the
/// warm-up plus two more micro-batches reaches the same peak as simulating all of them.
pub fn simulated_micro_batches(l: &Layout, stage: u64, micro_batches: u64) -> u64 {
    match l.pp_schedule {
        PpSchedule::Afab => micro_batches,
        _ => micro_batches.min(warmup(l, stage, micro_batches).div_ceil(l.pp_virtual) + 2),
    }
}

/// The order of forward and backward work on `stage` for `m` micro-batches.
pub fn order(l: &Layout, stage: u64, m: u64) -> Vec<Work> {
    let (p, v) = (l.pp, l.pp_virtual);
    let total = m * v;
    let w = warmup(l, stage, m);
    // Megatron's get_model_chunk_id: the k-th forward (or backward) of a stage goes to chunk
    // (k / p) % v (reversed for backward), micro-batch groups of p.
    let fwd = |k: u64| {
        let group = k / (p * v);
        let chunk = (k / p) % v;
        Work::F {
            mb: group * p + k % p,
            chunk,
        }
    };
    let bwd = |k: u64| {
        let group = k / (p * v);
        let chunk = v - 1 - (k / p) % v;
        Work::B {
            mb: group * p + k % p,
            chunk,
        }
    };
    if v == 1 {
        // Plain schedules: micro-batch k, chunk 0.
        let f = |k| Work::F { mb: k, chunk: 0 };
        let b = |k| Work::B { mb: k, chunk: 0 };
        let mut out: Vec<Work> = (0..w).map(f).collect();
        for k in 0..total - w {
            out.push(f(w + k));
            out.push(b(k));
        }
        out.extend((total - w..total).map(b));
        return out;
    }
    let mut out: Vec<Work> = (0..w).map(fwd).collect();
    for k in 0..total - w {
        out.push(fwd(w + k));
        out.push(bwd(k));
    }
    out.extend((total - w..total).map(bwd));
    out
}

/// The in-flight slot of each work item of `work` (one stage's order): a forward takes the
/// lowest slot of its chunk that no micro-batch still holds (its backward not yet run), and
/// its backward gives it back. A stage holds at most `1 + max slot` micro-batches of a chunk's
/// activations at once; the memory plan names each slot's buffers apart (`name@slot`), so the
/// arena gives every in-flight micro-batch its own place and the trainer, running the same
/// order, asks for the same names.
pub fn slots(work: &[Work]) -> Vec<u64> {
    // (chunk, mb) → slot held, per chunk a set of taken slots.
    let mut held: Vec<(u64, u64, u64)> = Vec::new();
    work.iter()
        .map(|w| match *w {
            Work::F { mb, chunk } => {
                let s = (0..)
                    .find(|s| !held.iter().any(|&(c, _, t)| c == chunk && t == *s))
                    .expect("a free slot");
                held.push((chunk, mb, s));
                s
            }
            Work::B { mb, chunk } => {
                let i = held
                    .iter()
                    .position(|&(c, m, _)| c == chunk && m == mb)
                    .expect("a backward follows its forward");
                held.swap_remove(i).2
            }
        })
        .collect()
}

/// Which way a message between pipeline stages goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// An activation, to the next model chunk's stage.
    Forward,
    /// A gradient, to the previous model chunk's stage.
    Backward,
}

/// A point-to-point message of the pipeline: the input of chunk `chunk` (global index g)
/// for micro-batch `mb`: its activation (forward) or its output's gradient (backward).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Message {
    pub dir: Direction,
    pub chunk: u64,
    pub mb: u64,
}

impl Message {
    /// The stage that receives it.
    pub fn to(&self, p: u64) -> u64 {
        self.chunk % p
    }
}

/// What work `w` of `stage` receives before it runs and sends after (`None`: the embedding's
/// forward and the head's backward receive nothing; the head's forward and the embedding's
/// backward send nothing).
pub fn messages(l: &Layout, stage: u64, w: Work) -> (Option<Message>, Option<Message>) {
    let chunks = l.pp * l.pp_virtual;
    let msg = |dir, chunk, mb| Some(Message { dir, chunk, mb });
    match w {
        Work::F { mb, chunk } => {
            let g = chunk * l.pp + stage;
            let recv = (g > 0).then(|| msg(Direction::Forward, g, mb)).flatten();
            let send = (g + 1 < chunks)
                .then(|| msg(Direction::Forward, g + 1, mb))
                .flatten();
            (recv, send)
        }
        Work::B { mb, chunk } => {
            let g = chunk * l.pp + stage;
            let recv = (g + 1 < chunks)
                .then(|| msg(Direction::Backward, g, mb))
                .flatten();
            let send = (g > 0)
                .then(|| msg(Direction::Backward, g - 1, mb))
                .flatten();
            (recv, send)
        }
    }
}

/// Send buffers each stage needs per direction so that the pipeline of `m` micro-batches runs
/// to its end: a stage sends from `k` buffers in turn and, before reusing one, waits until the
/// message it last carried is received (a blocking receive, and a send that blocks only when
/// all `k` buffers are in flight). With `k = 1` a stage could wait to send while its
/// neighbour waits to send back (the deadlock Megatron-LM avoids with combined
/// send-and-receive calls); the smallest `k` that completes is found by running every stage's
/// order as such a network. Whether it completes does not depend on timing (a Kahn network
/// with bounded channels is deterministic, Kahn 1974), so this run decides it for every run.
pub fn send_buffers(l: &Layout, m: u64) -> u64 {
    use std::collections::HashMap;
    use std::sync::Mutex;
    if l.pp == 1 {
        return 0;
    }
    // The layout search plans thousands of layouts sharing a few (p, v, schedule, m): each
    // network is run once.
    type Known = HashMap<(u64, u64, PpSchedule, u64), u64>;
    static KNOWN: Mutex<Option<Known>> = Mutex::new(None);
    let key = (l.pp, l.pp_virtual, l.pp_schedule, m);
    if let Some(&k) = KNOWN
        .lock()
        .ok()
        .and_then(|c| c.as_ref()?.get(&key).copied())
        .as_ref()
    {
        return k;
    }
    let k = (1..=m * l.pp_virtual + 1)
        .find(|&k| completes(l, m, k))
        .unwrap_or(m * l.pp_virtual + 1);
    if let Ok(mut c) = KNOWN.lock() {
        c.get_or_insert_with(HashMap::new).insert(key, k);
    }
    k
}

/// Whether every stage's order of `m` micro-batches completes with `k` send buffers per
/// direction (see [`send_buffers`]).
fn completes(l: &Layout, m: u64, k: u64) -> bool {
    use std::collections::{HashMap, HashSet};
    let p = l.pp;
    let orders: Vec<Vec<Work>> = (0..p).map(|s| order(l, s, m)).collect();
    let mut next = vec![0usize; p as usize];
    // A stage whose work has run but whose message is not sent yet.
    let mut sending = vec![false; p as usize];
    let mut unread: HashSet<Message> = HashSet::new();
    // Per (sending stage, direction): messages sent and read so far (a channel is read in the
    // order it is written: both ends follow the chunks' micro-batch order).
    let mut sent: HashMap<(u64, Direction), (u64, u64)> = HashMap::new();
    loop {
        let mut progress = false;
        for s in 0..p {
            let si = s as usize;
            let Some(&w) = orders[si].get(next[si]) else {
                continue;
            };
            let (recv, send) = messages(l, s, w);
            if !sending[si] {
                if let Some(r) = recv {
                    if !unread.remove(&r) {
                        continue;
                    }
                    let from = match r.dir {
                        Direction::Forward => (r.chunk + p - 1) % p,
                        Direction::Backward => (r.chunk + 1) % p,
                    };
                    sent.entry((from, r.dir)).or_default().1 += 1;
                }
                sending[si] = true;
                progress = true;
            }
            if let Some(out) = send {
                let (written, read) = sent.entry((s, out.dir)).or_default();
                // The buffer this message takes last carried message `written − k`.
                if *written >= k && *read <= *written - k {
                    continue;
                }
                *written += 1;
                unread.insert(out);
            }
            sending[si] = false;
            next[si] += 1;
            progress = true;
        }
        if (0..p as usize).all(|s| next[s] == orders[s].len()) {
            return true;
        }
        if !progress {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(pp: u64, v: u64, schedule: PpSchedule) -> Layout {
        Layout {
            pp,
            pp_virtual: v,
            pp_schedule: schedule,
            ..Layout::default()
        }
    }

    fn max_slot(l: &Layout, stage: u64, m: u64) -> u64 {
        slots(&order(l, stage, m)).into_iter().max().unwrap_or(0)
    }

    #[test]
    fn afab_holds_every_micro_batch_and_1f1b_the_first_stage_pp_of_them() {
        let afab = layout(4, 1, PpSchedule::Afab);
        let one = layout(4, 1, PpSchedule::OneFOneB);
        assert_eq!(max_slot(&afab, 0, 8) + 1, 8);
        assert_eq!(max_slot(&afab, 3, 8) + 1, 8);
        // PipeDream-Flush: stage s holds p − s micro-batches.
        for s in 0..4 {
            assert_eq!(max_slot(&one, s, 8) + 1, 4 - s, "stage {s}");
        }
    }

    #[test]
    fn a_backward_frees_the_slot_of_its_own_forward() {
        let l = layout(2, 3, PpSchedule::Interleaved);
        let work = order(&l, 0, 4);
        let s = slots(&work);
        for (i, w) in work.iter().enumerate() {
            if let Work::B { mb, chunk } = *w {
                let f = work
                    .iter()
                    .position(|x| *x == Work::F { mb, chunk })
                    .unwrap();
                assert_eq!(s[i], s[f], "{w:?}");
            }
        }
    }

    #[test]
    fn one_send_buffer_per_direction_completes_every_schedule_and_every_message_is_matched() {
        for (p, v, sch) in [
            (2, 1, PpSchedule::Afab),
            (4, 1, PpSchedule::Afab),
            (2, 1, PpSchedule::OneFOneB),
            (4, 1, PpSchedule::OneFOneB),
            (2, 3, PpSchedule::Interleaved),
            (4, 2, PpSchedule::Interleaved),
        ] {
            let l = layout(p, v, sch);
            let k = send_buffers(&l, 8);
            assert_eq!(k, 1, "p {p} v {v} {sch:?}");
            assert!(completes(&l, 8, k));
            // Every message sent is received once, by the stage that runs its chunk.
            let mut sent = Vec::new();
            let mut got = Vec::new();
            for s in 0..p {
                for w in order(&l, s, 8) {
                    let (r, o) = messages(&l, s, w);
                    got.extend(r.map(|r| (r, s)));
                    sent.extend(o.map(|o| (o, o.to(p))));
                }
            }
            sent.sort_by_key(|(m, _)| (m.dir as u8, m.chunk, m.mb));
            got.sort_by_key(|(m, _)| (m.dir as u8, m.chunk, m.mb));
            assert_eq!(sent, got);
        }
    }
}
