//! The small collectives of a step: every rank's few values (a loss, a gradient norm's part, a
//! peak), gathered in place in a group's reused buffer so the step allocates nothing for them.
//! Every group of the trainer (data-parallel, tensor-parallel, pipeline, expert- and
//! context-parallel) sums its per-rank f64s through the one [`SmallSums::sum_f64`] here.

use crate::{Communicator, Region};
use anyhow::{anyhow, Result};
use std::cell::RefMut;

/// Every rank's `mine` (a few values), rank order, in the rank's `small` buffer: in place, so
/// the step allocates nothing for it.
pub(crate) fn gather_small<'a>(
    comm: &dyn Communicator,
    small: &'a mut Region<f32>,
    mine: &[f32],
    what: &str,
) -> Result<&'a [f32]> {
    let (n, me) = (mine.len(), comm.rank());
    let mut buf = std::mem::take(small);
    buf.fit(n * comm.size());
    buf[me * n..(me + 1) * n].copy_from_slice(mine);
    *small = comm
        .all_gather_start(buf)
        .wait()
        .map_err(|e| anyhow!("{what} all-gather: {e}"))?;
    Ok(small)
}

/// Every rank of `comm`'s `[planned, measured, kernel workspace]` bytes, rank order (exact:
/// each u64 travels as two 24-bit halves, which f32 holds exactly).
pub fn gather_mem(
    comm: &dyn Communicator,
    small: &mut Region<f32>,
    mine: [u64; 3],
    out: &mut Vec<[u64; 3]>,
) -> Result<()> {
    let mut halves = [0f32; 6];
    for (h, b) in halves.chunks_mut(2).zip(mine) {
        h.copy_from_slice(&[(b >> 24) as f32, (b & 0xFF_FFFF) as f32]);
    }
    let all = gather_small(comm, small, &halves, "memory")?;
    let join = |h: &[f32]| ((h[0] as u64) << 24) | h[1] as u64;
    // Into the caller's reused buffer (sized for the group when it was built).
    out.clear();
    out.extend(
        all.chunks(6)
            .map(|c| [join(&c[0..2]), join(&c[2..4]), join(&c[4..6])]),
    );
    Ok(())
}

/// A group that sums a few per-rank values: its communicator and the buffer it gathers them
/// in.
pub trait SmallSums {
    fn comm(&self) -> &dyn Communicator;
    /// The reused buffer of every rank's few values (a planned one where the group has it).
    fn small(&self) -> RefMut<'_, Region<f32>>;

    /// The sums over the group of a few per-rank f64 values, the same on every rank. Each
    /// value travels as two f32 (its rounding and the rest) and the halves are added in f64,
    /// rank by rank, so a sum keeps about 48 bits where one f32 would keep 24.
    fn sum_f64<const N: usize>(&self, x: [f64; N], what: &str) -> Result<[f64; N]> {
        let mut mine = [0.0f32; 8];
        assert!(2 * N <= mine.len(), "at most four sums at once");
        for (i, v) in x.iter().enumerate() {
            let hi = *v as f32;
            (mine[2 * i], mine[2 * i + 1]) = (hi, (v - hi as f64) as f32);
        }
        let mut small = self.small();
        let all = gather_small(self.comm(), &mut small, &mine[..2 * N], what)?;
        let mut out = [0.0f64; N];
        for rank in all.chunks(2 * N) {
            for (i, o) in out.iter_mut().enumerate() {
                *o += rank[2 * i] as f64 + rank[2 * i + 1] as f64;
            }
        }
        Ok(out)
    }
}
