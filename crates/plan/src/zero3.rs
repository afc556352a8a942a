//! ferrotron's ZeRO-3 (Rajbhandari et al. 2020, §5.3, P_os+g+p): which parameters a rank
//! gathers, when, and into which window. The trainer executes this schedule
//! (`crates/dist/src/zero/zero3.rs`) and the planner counts its buffers and bytes from it, so the
//! two cannot disagree.
//!
//! The model is cut into units, each reduce-scattered and all-gathered as one bucket split into
//! `dp` equal blocks (rank r owns block r of every unit, as FSDP shards each of its flat
//! parameters): the embedding, every decoder layer, and the head (final norm and an untied LM
//! head). A rank keeps the gathered parameters in windows:
//! - the embedding's and the head's, gathered once per step at their first use (a tied LM head
//!   reads the embedding window);
//! - two layer windows: the layer being computed and the next one, whose all-gather runs
//!   (prefetched) while the current layer computes. A layer still in a window when it is asked
//!   for again is not gathered again: the last layers of the forward are the first of the
//!   backward, and the first of the backward's end are the next micro-batch's first.
//!
//! The windows are valid for one step (the optimizer changes every parameter after it).

use crate::inventory::{Placement, Tensor};
use crate::layout::Layout;
use crate::runtime::Runtime;
use std::collections::BTreeMap;

/// A part of the model that ZeRO-3 gathers at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    Embedding,
    Layer(usize),
    /// The final norm, and the LM head when it is not tied to the embedding.
    Head,
}

/// The units a training micro-batch asks for, in order: the embedding, the layers, the head's
/// forward (the fused LM head and loss) and its backward (the final norm), the layers from
/// last to first. (The embedding's backward reads no parameter.)
pub fn train_sequence(layers: usize) -> Vec<Unit> {
    let mut s = vec![Unit::Embedding];
    s.extend((0..layers).map(Unit::Layer));
    s.extend([Unit::Head, Unit::Head]);
    s.extend((0..layers).rev().map(Unit::Layer));
    s
}

/// The units an evaluation or sampling forward asks for.
pub fn eval_sequence(layers: usize) -> Vec<Unit> {
    let mut s = vec![Unit::Embedding];
    s.extend((0..layers).map(Unit::Layer));
    s.push(Unit::Head);
    s
}

/// The first layer asked for after position `at` of `seq` that is not `Unit::Layer(not)`.
pub fn next_layer(seq: &[Unit], at: usize, not: Option<usize>) -> Option<usize> {
    seq[at + 1..].iter().find_map(|u| match u {
        Unit::Layer(i) if Some(*i) != not => Some(*i),
        _ => None,
    })
}

/// What a layer request makes the rank do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fetch {
    /// The window the layer is read from.
    pub slot: usize,
    /// The layer is in no window: gather it now, and wait (a miss; only the first layer of a
    /// step, which nothing prefetched).
    pub gather: bool,
    /// Start gathering this layer into this window, to land by its request.
    pub prefetch: Option<(usize, usize)>,
}

/// The two layer windows: which layer each holds (or is gathering).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerWindows {
    held: [Option<usize>; 2],
}

impl LayerWindows {
    /// Layer `layer` is asked for (`None`: another unit) and `next` is the next layer the
    /// schedule asks for: where it is, and what to gather.
    pub fn request(&mut self, layer: Option<usize>, next: Option<usize>) -> Fetch {
        let (slot, gather) = match layer {
            None => (None, false),
            Some(i) => match self.held.iter().position(|h| *h == Some(i)) {
                Some(s) => (Some(s), false),
                None => {
                    // Not the window the next layer is (being) gathered into.
                    let s = usize::from(next.is_some() && self.held[0] == next);
                    self.held[s] = Some(i);
                    (Some(s), true)
                }
            },
        };
        let prefetch = next.filter(|n| !self.held.contains(&Some(*n))).map(|n| {
            let o = slot.map_or(0, |s| 1 - s);
            self.held[o] = Some(n);
            (o, n)
        });
        Fetch {
            slot: slot.unwrap_or(0),
            gather,
            prefetch,
        }
    }

    /// The parameters changed: no window holds anything valid.
    pub fn clear(&mut self) {
        self.held = [None, None];
    }
}

/// How many times each layer is all-gathered in a training step of `micro_batches`
/// micro-batches: by [`LayerWindows`] over [`train_sequence`], from empty windows. (The
/// embedding and the head are gathered once per step.) Once a micro-batch leaves the windows
/// as the one before it did, every later one repeats it (the schedule is deterministic in the
/// windows' state), so a step of thousands of micro-batches costs two or three to simulate.
pub fn layer_gathers_per_step(layers: usize, micro_batches: u64) -> Vec<u64> {
    let seq = train_sequence(layers);
    let mut w = LayerWindows::default();
    let mut total = vec![0; layers];
    let mut before: Option<LayerWindows> = None;
    for done in 0..micro_batches {
        let start = w.clone();
        let mut n = vec![0; layers];
        for (at, u) in seq.iter().enumerate() {
            let layer = match u {
                Unit::Layer(i) => Some(*i),
                _ => None,
            };
            let f = w.request(layer, next_layer(&seq, at, layer));
            if let (true, Some(i)) = (f.gather, layer) {
                n[i] += 1;
            }
            if let Some((_, j)) = f.prefetch {
                n[j] += 1;
            }
        }
        // This micro-batch started where the one before did: it and every later one repeat.
        let rest = micro_batches - done - 1;
        if before.as_ref() == Some(&start) {
            for (t, x) in total.iter_mut().zip(&n) {
                *t += x * (rest + 1);
            }
            return total;
        }
        for (t, x) in total.iter_mut().zip(&n) {
            *t += x;
        }
        before = Some(start);
    }
    total
}

/// Whether a rank runs ferrotron's own ZeRO-3: under its trainer (`Runtime::Ferrotron`, not
/// merely its convention: an FSDP run costed with the engine's kernels gathers as FSDP does),
/// sharded over more than one rank, dense (no expert shards), without pipelining.
pub fn applies(runtime: Runtime, l: &Layout, expert_elems: u64) -> bool {
    runtime.is_trainer() && l.zero >= 3 && l.pp == 1 && l.dense_replicas() > 1 && expert_elems == 0
}

/// A step's ZeRO-3 collectives over `dp` ranks, in f32 elements each all-gather or
/// reduce-scatter carries, one entry per collective kind: every unit's parameters gathered as
/// [`layer_gathers_per_step`] says (padded to whole blocks), and every unit's gradients
/// reduce-scattered once per micro-batch.
pub fn step_collectives(units: &[(Unit, u64)], dp: u64, micro_batches: u64) -> (u64, u64) {
    let layers = units
        .iter()
        .filter(|u| matches!(u.0, Unit::Layer(_)))
        .count();
    let counts = layer_gathers_per_step(layers, micro_batches);
    let padded = |n: u64| n.next_multiple_of(dp.max(1));
    let gathered = units
        .iter()
        .map(|&(u, n)| match u {
            Unit::Layer(i) => counts[i] * padded(n),
            _ => padded(n),
        })
        .sum();
    let scattered = micro_batches * units.iter().map(|u| padded(u.1)).sum::<u64>();
    (gathered, scattered)
}

/// Elements of every unit of a stage (per tensor-parallel rank), in the flat order: the
/// embedding, each layer, the head.
pub fn unit_lens(
    tensors: &[Tensor],
    tp: u64,
    on_stage: impl Fn(Placement) -> bool,
) -> Vec<(Unit, u64)> {
    let mut layers: BTreeMap<u64, u64> = BTreeMap::new();
    let (mut embedding, mut head) = (0, 0);
    for t in tensors.iter().filter(|t| on_stage(t.placement)) {
        let n = t.numel_tp(tp);
        match t.placement {
            Placement::Embedding => embedding += n,
            Placement::Head => head += n,
            Placement::Layer(i) => *layers.entry(i).or_default() += n,
        }
    }
    let mut out = vec![(Unit::Embedding, embedding)];
    out.extend(
        layers
            .into_iter()
            .map(|(i, n)| (Unit::Layer(i as usize), n)),
    );
    out.push((Unit::Head, head));
    out
}

/// A rank's ZeRO-3 memory under ferrotron's trainer (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sizes {
    /// Elements of its shard of the parameters, gradients, master weights and optimizer states
    /// ([`shard_len`]).
    pub shard: u64,
    /// Elements of the parameter windows: the embedding's, the head's and two layers'.
    pub windows: u64,
    /// Elements of the largest unit padded to whole blocks: the all-gather buffer, and each of
    /// the two gradient buckets.
    pub bucket: u64,
}

impl Sizes {
    pub fn of(units: &[(Unit, u64)], dp: u64) -> Self {
        let of = |k: fn(&Unit) -> bool| units.iter().filter(move |(u, _)| k(u)).map(|u| u.1);
        let layer = of(|u| matches!(u, Unit::Layer(_))).max().unwrap_or(0);
        let ends: u64 = of(|u| !matches!(u, Unit::Layer(_))).sum();
        Sizes {
            shard: shard_len(units.iter().map(|u| u.1), dp),
            windows: ends + 2 * layer,
            bucket: units
                .iter()
                .map(|u| u.1.next_multiple_of(dp.max(1)))
                .max()
                .unwrap_or(0),
        }
    }
}

/// Elements of a rank's ZeRO-3 shard: its block of every unit, each unit padded to `dp` blocks.
pub fn shard_len(unit_lens: impl IntoIterator<Item = u64>, dp: u64) -> u64 {
    unit_lens.into_iter().map(|u| u.div_ceil(dp.max(1))).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_is_gathered_before_its_request_and_reused_while_a_window_holds_it() {
        // Four layers, two micro-batches. Forward: layer 0 misses, 1..3 are prefetched; the
        // backward finds 3 and 2 still held, prefetches 1 and 0; the next forward finds 0 and
        // 1, prefetches 2 and 3; its backward finds 3 and 2 again.
        let seq = train_sequence(4);
        let mut w = LayerWindows::default();
        let mut log = vec![];
        for _ in 0..2 {
            for (at, u) in seq.iter().enumerate() {
                if let Unit::Layer(i) = u {
                    let f = w.request(Some(*i), next_layer(&seq, at, Some(*i)));
                    log.push((*i, f.gather, f.prefetch.map(|p| p.1)));
                }
            }
        }
        let first = [
            (0, true, Some(1)),
            (1, false, Some(2)),
            (2, false, Some(3)),
            (3, false, None),
            (3, false, None),
            (2, false, Some(1)),
            (1, false, Some(0)),
            (0, false, None),
        ];
        assert_eq!(log[..8], first);
        assert_eq!(log[8..10], [(0, false, None), (1, false, Some(2))]);
        assert_eq!(
            log[12..],
            [
                (3, false, None),
                (2, false, Some(1)),
                (1, false, Some(0)),
                (0, false, None)
            ]
        );
        // 4 + 2 in the first micro-batch (layers 0 and 1 twice), 2 + 2 in the second (each
        // once), and so in every later one.
        assert_eq!(layer_gathers_per_step(4, 1), vec![2, 2, 1, 1]);
        assert_eq!(layer_gathers_per_step(4, 2), vec![3, 3, 2, 2]);
        let a_million = layer_gathers_per_step(4, 1_000_000);
        assert_eq!(a_million, vec![1_000_001, 1_000_001, 1_000_000, 1_000_000]);
        // One layer: gathered once for the forward, still held for the backward.
        assert_eq!(layer_gathers_per_step(1, 3), vec![1]);
        // Units of 10 (embedding), 6 and 6 (layers), 3 (head) over 4 ranks, 2 micro-batches:
        // both layers stay in the two windows for the whole step, so every unit is gathered
        // once (padded: 12 + 8 + 8 + 4) and reduce-scattered twice.
        let units = [
            (Unit::Embedding, 10),
            (Unit::Layer(0), 6),
            (Unit::Layer(1), 6),
            (Unit::Head, 3),
        ];
        assert_eq!(layer_gathers_per_step(2, 2), vec![1, 1]);
        assert_eq!(step_collectives(&units, 4, 2), (12 + 8 + 8 + 4, 64));
    }

    #[test]
    fn the_embedding_request_prefetches_the_first_layer_into_a_free_window() {
        let seq = train_sequence(2);
        let mut w = LayerWindows::default();
        let f = w.request(None, next_layer(&seq, 0, None));
        assert_eq!(f.prefetch, Some((0, 0)));
        let f = w.request(Some(0), next_layer(&seq, 1, Some(0)));
        assert_eq!((f.slot, f.gather, f.prefetch), (0, false, Some((1, 1))));
    }

    #[test]
    fn each_unit_is_padded_to_whole_blocks() {
        assert_eq!(shard_len([10, 7, 7, 3], 4), 3 + 2 + 2 + 1);
        assert_eq!(shard_len([10], 1), 10);
    }
}
