//! ZeRO's gathers as the trainer uses them: a sharded optimizer state (or ZeRO-3's weights)
//! gathered into one value per parameter, and the shard of a whole-model state that this rank
//! updates. (The parameters after ZeRO-1/2's all-gather, on the host or a device, are
//! `device_ranks::ViewGather`'s.)

use super::*;

/// The `len` values of `full` (one per parameter) that `runs` update, at their offsets.
pub(super) fn shard_of(runs: &[OptRun], len: usize, full: &[f32]) -> Vec<f32> {
    let mut out = vec![0.0; len];
    fill_shard(&mut out, runs, full);
    out
}

/// `out` (zeros where no run lands) with each run's weights of `full` at its offset.
pub(super) fn fill_shard(out: &mut [f32], runs: &[OptRun], full: &[f32]) {
    out.fill(0.0);
    for r in runs {
        out[r.at..r.at + r.params.len()].copy_from_slice(&full[r.params.clone()]);
    }
}

/// Every weight as f32, gathered from ZeRO-3's shards (the first `shard_len` elements of
/// `params`).
pub(super) fn gather_weights(
    dp: &mut DataParallel,
    params: &Flat,
    shard_len: usize,
    n: usize,
) -> Result<Vec<f32>> {
    match params {
        Flat::F32(p) => gather_full(dp, &p[..shard_len], n),
        Flat::Bf16(p) => gather_full(dp, &p[..shard_len], n),
        Flat::F16(p) => gather_full(dp, &p[..shard_len], n),
    }
}

/// A sharded optimizer state (or ZeRO-3's weights) gathered into one of every parameter.
struct GatherShard<'a, S> {
    shard: &'a [S],
    full: Vec<f32>,
}

impl<S: Elem> Gather for GatherShard<'_, S> {
    fn own(&self, seg: &Segment, out: &mut [f32]) {
        for (o, x) in out
            .iter_mut()
            .zip(&self.shard[seg.at..seg.at + seg.params.len()])
        {
            *o = x.to_f32();
        }
    }
    fn put(&mut self, r: Range<usize>, values: &[f32]) {
        self.full[r].copy_from_slice(values);
    }
}

/// Every parameter's value of a sharded state (all ranks call it: an all-gather).
fn gather_full<S: Elem>(dp: &mut DataParallel, shard: &[S], n: usize) -> Result<Vec<f32>> {
    let mut g = GatherShard {
        shard,
        full: vec![0.0; n],
    };
    dp.all_gather(&mut g)?;
    Ok(g.full)
}
