//! Where a rank's gradients and model states sit under data parallelism: the buckets the
//! gradients are reduced in, and under ZeRO-1/2/3 the blocks of them each rank owns (the
//! segments of its shard of the master weights, moments and, under ZeRO-2/3, gradients).
//!
//! The buckets follow PyTorch DDP (Li et al. 2020, "PyTorch Distributed", §3.2.3): the
//! gradients in the order the backward makes them final, cut into buckets of a fixed length
//! (`buffers::dp_bucket_len`, `--bucket-mb`); ZeRO-3 reduces (and gathers) one unit of the model
//! per bucket (`zero3.rs`). Under ZeRO (Rajbhandari et al. 2020, §5.1–5.3) every bucket is
//! padded to `dp` equal blocks and rank r owns block r of each, as flat-buffer implementations
//! do, so a rank's shard is the sum of its blocks: ⌈params / dp⌉ for fixed buckets (whose
//! length is a multiple of `dp`), `zero3::shard_len` for units. The lengths are the plan's
//! ([`StateLens`]); [`Shard::planned`] refuses a layout whose blocks do not fill them.
//!
//! The gradients' ranges are the engine's flat parameter offsets, which only the engine's
//! parameter table knows: the trainer hands them over in report order; everything else here
//! is the planner's.

use crate::buffers::CommBuf;
use crate::zero3::Sizes;
use serde::Serialize;
use std::ops::Range;

/// A run of a bucket: gradients (or parameters) of this range, at this offset in the bucket.
pub type Piece = (Range<usize>, usize);

/// Where the gradients go: into which bucket, at which offset, in the order they become final.
#[derive(Debug, Clone, PartialEq)]
pub struct BucketLayout {
    /// Every bucket's pieces.
    pub pieces: Vec<Vec<Piece>>,
    /// Elements each bucket sends (its pieces, padded to `blocks` equal blocks under ZeRO).
    pub len: Vec<usize>,
}

impl BucketLayout {
    /// `order` cut into buckets of `bucket_len` (a report spanning two buckets is split), each
    /// padded to `blocks` equal blocks.
    pub fn fixed(order: &[Range<usize>], bucket_len: usize, blocks: usize) -> Self {
        let bucket_len = bucket_len.max(1);
        let (mut pieces, mut cur, mut used) = (Vec::new(), Vec::new(), 0);
        for r in order {
            let mut r = r.clone();
            while !r.is_empty() {
                let take = r.len().min(bucket_len - used);
                cur.push((r.start..r.start + take, used));
                (used, r.start) = (used + take, r.start + take);
                if used == bucket_len {
                    pieces.push(std::mem::take(&mut cur));
                    used = 0;
                }
            }
        }
        if used > 0 {
            pieces.push(cur);
        }
        let len = pieces
            .iter()
            .map(|p: &Vec<Piece>| filled(p).next_multiple_of(blocks.max(1)))
            .collect();
        BucketLayout { pieces, len }
    }

    /// ZeRO-3's layout: one bucket per unit (`groups`, each unit's gradient ranges in report
    /// order), padded to `blocks` equal blocks.
    pub fn per_unit(groups: &[Vec<Range<usize>>], blocks: usize) -> Self {
        let mut layout = BucketLayout {
            pieces: Vec::with_capacity(groups.len()),
            len: Vec::with_capacity(groups.len()),
        };
        for g in groups {
            let mut at = 0;
            let pieces = g.iter().map(|r| {
                at += r.len();
                (r.clone(), at - r.len())
            });
            layout.pieces.push(pieces.collect());
            layout.len.push(at.next_multiple_of(blocks.max(1)));
        }
        layout
    }

    /// Elements bucket `k`'s pieces fill (before padding).
    pub fn used(&self, k: usize) -> usize {
        filled(&self.pieces[k])
    }
}

fn filled(pieces: &[Piece]) -> usize {
    pieces.last().map_or(0, |(r, at)| at + r.len())
}

/// One contiguous run of a rank's shard: gradients/parameters `params`, at `at` in the shard
/// (the optimizer states and master weights) and at `in_bucket` in bucket `bucket`.
#[derive(Debug, Clone, PartialEq)]
pub struct Segment {
    pub bucket: usize,
    pub params: Range<usize>,
    pub at: usize,
    pub in_bucket: usize,
}

/// A rank's ZeRO partition: block `rank` of every bucket, as segments of the flat parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Shard {
    pub segments: Vec<Segment>,
    /// Elements of the shard (the sum of its blocks, padding included).
    pub len: usize,
    /// The segments of every bucket (indices into `segments`).
    pub of_bucket: Vec<Range<usize>>,
}

impl Shard {
    /// Block `rank` of `ranks` of every bucket of `layout`.
    pub fn new(layout: &BucketLayout, rank: usize, ranks: usize) -> Self {
        let (mut segments, mut of_bucket, mut base) = (Vec::new(), Vec::new(), 0);
        for (k, (pieces, &len)) in layout.pieces.iter().zip(&layout.len).enumerate() {
            let block = len / ranks.max(1);
            let own = rank * block..(rank + 1) * block;
            let first = segments.len();
            for (r, at) in pieces {
                let lo = (*at).max(own.start);
                let hi = (at + r.len()).min(own.end);
                if lo < hi {
                    segments.push(Segment {
                        bucket: k,
                        params: r.start + (lo - at)..r.start + (hi - at),
                        at: base + (lo - own.start),
                        in_bucket: lo,
                    });
                }
            }
            of_bucket.push(first..segments.len());
            base += block;
        }
        Shard {
            segments,
            len: base,
            of_bucket,
        }
    }

    /// [`Shard::new`], whose blocks must add up to the `planned` elements (the plan's shard of
    /// this group's states): else the engine's parameters are not the ones the plan counted.
    pub fn planned(
        layout: &BucketLayout,
        rank: usize,
        ranks: usize,
        planned: u64,
    ) -> Result<Self, String> {
        let s = Shard::new(layout, rank, ranks);
        if s.len as u64 != planned {
            return Err(format!(
                "internal: the engine's gradients fill a ZeRO shard of {} elements on rank {rank} of {ranks}, the plan's is {planned}",
                s.len
            ));
        }
        Ok(s)
    }
}

/// The length of every model state of one rank, as the plan allocates them (`states.rs`,
/// `buffers.rs`), in elements. The trainer allocates these and sizes nothing itself.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StateLens {
    /// Parameters of the rank's stage before any ZeRO sharding (its tensor-parallel slice, its
    /// experts): what the engine's parameter table must hold.
    pub stage_params: u64,
    /// The parameters the rank keeps (ZeRO-3: its shard; else `stage_params`).
    pub params: u64,
    /// The gradients it keeps (ZeRO-2/3 without pipelining: its shard).
    pub grads: u64,
    /// Master weights and each optimizer moment (ZeRO-1/2/3: its shard).
    pub opt: u64,
    /// Of `opt`, the dense parameters' shard (under expert parallelism the experts' follow it).
    pub opt_dense: u64,
    /// ZeRO-2/3's gradient windows (`comm.zero2.grad_windows`) and ZeRO-3's parameter windows
    /// (`zero3.param_windows`).
    pub grad_windows: u64,
    pub param_windows: u64,
    /// f32 elements of one data-parallel gradient bucket (`comm.dp.grad_buckets` holds two), and
    /// of one routed experts' bucket (`comm.dp.expert_grad_buckets`); 0 when there is none.
    pub bucket: u64,
    pub expert_bucket: u64,
}

impl StateLens {
    /// With the windows and buckets of the rank's communication buffers `comm` (and ZeRO-3's
    /// `zero3` parameter windows).
    pub fn with_comm(mut self, comm: &[CommBuf], zero3: Option<Sizes>) -> Self {
        for c in comm {
            match c.name {
                "zero2.grad_windows" => self.grad_windows = c.numel,
                // Two buckets in flight, each of half the buffer.
                "dp.grad_buckets" => self.bucket = c.numel / 2,
                "dp.expert_grad_buckets" => self.expert_bucket = c.numel / 2,
                _ => {}
            }
        }
        self.param_windows = zero3.map_or(0, |z| z.windows);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero1_blocks_cover_every_gradient_once_and_add_up_to_the_planned_shard() {
        // Ranges of 7, 5, 9 and 3 elements in buckets of 8 over 4 ranks: three buckets of 8,
        // blocks of 2.
        let order = [0..7, 7..12, 12..21, 21..24];
        let layout = BucketLayout::fixed(&order, 8, 4);
        assert_eq!(layout.len, vec![8, 8, 8]);
        assert_eq!(layout.pieces[1], vec![(8..12, 0), (12..16, 4)]);
        let mut seen = [0; 24];
        for rank in 0..4 {
            let s = Shard::planned(&layout, rank, 4, 6).unwrap();
            let covered: usize = s.segments.iter().map(|g| g.params.len()).sum();
            assert_eq!(covered, 6, "rank {rank}");
            for g in &s.segments {
                for i in g.params.clone() {
                    seen[i] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
        // A short last bucket is padded to whole blocks: 10 elements in buckets of 8 over 4
        // ranks give a last bucket of 2 padded to 4, and shards of ⌈10 / 4⌉ = 3.
        let whole = 0..10;
        let layout = BucketLayout::fixed(std::slice::from_ref(&whole), 8, 4);
        assert_eq!(layout.len, vec![8, 4]);
        let s = Shard::planned(&layout, 3, 4, 3).unwrap();
        let only = Segment {
            bucket: 0,
            params: 6..8,
            at: 0,
            in_bucket: 6,
        };
        assert_eq!(
            s.segments,
            vec![only],
            "rank 3's block of the last bucket is padding"
        );
    }

    #[test]
    fn a_shard_that_is_not_the_planned_one_is_refused() {
        let whole = 0..10;
        let layout = BucketLayout::fixed(std::slice::from_ref(&whole), 8, 4);
        let e = Shard::planned(&layout, 0, 4, 4).unwrap_err();
        assert_eq!(
            e,
            "internal: the engine's gradients fill a ZeRO shard of 3 elements on rank 0 of 4, the plan's is 4"
        );
    }

    #[test]
    fn a_unit_is_one_bucket_padded_to_whole_blocks() {
        // Units of 10 (two ranges) and 6 over 4 ranks: buckets of 12 and 8, shards of 3 + 2,
        // as `zero3::shard_len` counts them.
        let last = 10..16;
        let groups = [vec![0..4, 4..10], std::slice::from_ref(&last).to_vec()];
        let layout = BucketLayout::per_unit(&groups, 4);
        assert_eq!(layout.len, vec![12, 8]);
        assert_eq!(layout.pieces[0], vec![(0..4, 0), (4..10, 4)]);
        let s = Shard::planned(&layout, 1, 4, crate::zero3::shard_len([10, 6], 4)).unwrap();
        assert_eq!(s.segments[0].params, 3..4);
        assert_eq!(s.segments[1].params, 4..6);
        assert_eq!(s.segments[2].params, 12..14);
        assert_eq!(s.of_bucket, vec![0..2, 2..3]);
    }

    /// The plan of one rank of smollm-135m over `dp` ranks under ZeRO `zero`.
    fn lens_of(dp: u64, zero: u8) -> (StateLens, Vec<(crate::zero3::Unit, u64)>) {
        use crate::planner::{plan, ModelSource, PlanInput};
        let m = crate::presets::preset("smollm-135m").unwrap();
        let x = PlanInput {
            model: ModelSource::Spec(m.clone()),
            recipe: crate::recipe::Recipe {
                seq: 64,
                ..Default::default()
            },
            layout: crate::layout::Layout {
                dp,
                zero,
                ..Default::default()
            },
            convention: crate::convention::Convention::Ferrotron,
            runtime: crate::runtime::Runtime::Ferrotron,
            overhead: crate::hardware::Overhead::NONE,
            bucket_bytes: 1 << 20,
        };
        let r = plan(&x).unwrap();
        let units = crate::zero3::unit_lens(&r.tensors, 1, |_| true);
        (r.ranks[0].states, units)
    }

    #[test]
    fn the_plan_lists_every_state_length_and_its_buckets_fill_them() {
        // ZeRO-1 over 4 ranks: whole parameters and gradients, a shard of ⌈Ψ / 4⌉ master
        // weights and moments, 1 MiB buckets of f32 (a multiple of 4), no windows.
        let (l, _) = lens_of(4, 1);
        let psi = l.stage_params;
        assert_eq!((l.params, l.grads), (psi, psi));
        assert_eq!((l.opt, l.opt_dense), (psi.div_ceil(4), psi.div_ceil(4)));
        assert_eq!(l.bucket, (1 << 20) / 4);
        assert_eq!(
            (l.grad_windows, l.param_windows, l.expert_bucket),
            (0, 0, 0)
        );
        // Every rank's blocks of the buckets the plan sizes fill the plan's shard.
        let flat = 0..psi as usize;
        let layout = BucketLayout::fixed(std::slice::from_ref(&flat), l.bucket as usize, 4);
        for rank in 0..4 {
            Shard::planned(&layout, rank, 4, l.opt).unwrap();
        }
        // ZeRO-2: the gradients are the shard too, and three windows hold the backward's.
        let (l2, units) = lens_of(4, 2);
        assert_eq!(
            (l2.params, l2.grads, l2.opt),
            (psi, psi.div_ceil(4), psi.div_ceil(4))
        );
        let layer = units.iter().map(|u| u.1).max().unwrap();
        assert!(l2.grad_windows > layer && l2.grad_windows < psi);
        // ZeRO-3: one bucket per unit, every state the rank's blocks of the units.
        let (l3, units) = lens_of(4, 3);
        let shard = crate::zero3::shard_len(units.iter().map(|u| u.1), 4);
        assert_eq!((l3.params, l3.grads, l3.opt), (shard, shard, shard));
        assert!(l3.param_windows > l2.grad_windows);
        let mut at = 0;
        let groups: Vec<Vec<Range<usize>>> = units
            .iter()
            .map(|u| {
                at += u.1 as usize;
                std::slice::from_ref(&(at - u.1 as usize..at)).to_vec()
            })
            .collect();
        let layout = BucketLayout::per_unit(&groups, 4);
        assert_eq!(*layout.len.iter().max().unwrap() as u64, l3.bucket);
        for rank in 0..4 {
            Shard::planned(&layout, rank, 4, l3.opt).unwrap();
        }
    }
}
