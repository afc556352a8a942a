//! The host's copies of the ids written to the device (`Kernels::host_ids`), and the
//! embedding backward's grouping built from them (issue #32).
//!
//! A micro-batch's tokens and targets come from the host. Reading them back, to group the
//! positions by token for the embedding backward and to count the targets, made the host
//! wait for the device to finish everything queued before: two host synchronisations a
//! micro-batch, which leave the GPU idle while the host catches up. With the trainer's copy
//! announced as it uploads them, both are computed on the host from that copy, and only the
//! grouping goes up (one write, queued on the stream).

use super::super::memory::download_into;
use crate::kernels::{SyncSite, View};
use std::sync::{Mutex, MutexGuard};

/// The process's mirrors, keyed by device address (unique across a process's devices under
/// unified addressing), so that freeing device memory, wherever it happens, can drop the
/// mirrors of it ([`forget`]): a later buffer at the same address holds other ids.
static IDS: Mutex<HostIds> = Mutex::new(HostIds::new());

/// The mirrors, locked.
pub(in crate::kernels::cuda) fn ids() -> MutexGuard<'static, HostIds> {
    IDS.lock().unwrap_or_else(|e| e.into_inner())
}

/// Device memory `at..at + bytes` was freed: its mirrors are no more.
pub(in crate::kernels::cuda) fn forget(at: u64, bytes: u64) {
    ids().drop_overlapping(at, at + bytes, None);
}

/// Mirrors kept: a step's id buffers are its tokens and targets and, in a mixture of experts,
/// each MoE layer's router choices (which the router's kernel drops as it writes new ones);
/// past this many, the oldest goes (its ids are then read back where asked for).
const MIRRORS: usize = 64;

/// The host's copy of the ids at one device address.
struct Mirror {
    at: u64,
    ids: Vec<u32>,
}

impl Mirror {
    fn end(&self) -> u64 {
        self.at + 4 * self.ids.len() as u64
    }
}

/// Mirrors of id buffers, and the host buffers the grouping is built in, reused from call to
/// call (no heap allocation per step once they have grown).
pub(in crate::kernels::cuda) struct HostIds {
    mirrors: Vec<Mirror>,
    /// The buffers of mirrors dropped, for the next ones: a MoE layer's choices are dropped
    /// and noted again every step.
    spare: Vec<Vec<u32>>,
    /// Ids read back where no mirror covers the view (a caller that announced none).
    read: Vec<u32>,
    /// The grouping as uploaded: positions in token order, then each token's first index.
    grouping: Vec<u32>,
}

impl HostIds {
    const fn new() -> HostIds {
        HostIds {
            mirrors: Vec::new(),
            spare: Vec::new(),
            read: Vec::new(),
            grouping: Vec::new(),
        }
    }

    /// `host` was just written at device address `at`: a mirror of it replaces any mirror of
    /// the bytes it overwrote.
    pub(in crate::kernels::cuda) fn note(&mut self, at: u64, host: &[u32]) {
        let end = at + 4 * host.len() as u64;
        let i = match self.mirrors.iter().position(|m| m.at == at) {
            Some(i) => {
                let m = &mut self.mirrors[i];
                m.ids.clear();
                m.ids.extend_from_slice(host);
                i
            }
            None => {
                let mut ids = self.spare.pop().unwrap_or_default();
                ids.clear();
                ids.extend_from_slice(host);
                self.mirrors.push(Mirror { at, ids });
                self.mirrors.len() - 1
            }
        };
        self.drop_overlapping(at, end, Some(i));
        if self.mirrors.len() > MIRRORS {
            let oldest = usize::from(self.mirrors[0].at == at);
            self.drop_at(oldest);
        }
    }

    /// Drops the mirrors of any byte in `at..end`, but for the one at index `keep`.
    fn drop_overlapping(&mut self, at: u64, end: u64, keep: Option<usize>) {
        for i in (0..self.mirrors.len()).rev() {
            let m = &self.mirrors[i];
            if Some(i) != keep && m.end() > at && m.at < end {
                self.drop_at(i);
            }
        }
    }

    /// Drops mirror `i`, keeping its buffer (the order of the rest is their age).
    fn drop_at(&mut self, i: usize) {
        let m = self.mirrors.remove(i);
        if self.spare.len() < MIRRORS {
            self.spare.push(m.ids);
        }
    }

    /// The host's copy of `ids`, if a mirror covers them.
    fn mirrored(&self, ids: &View<'_, u32>) -> Option<&[u32]> {
        let (at, len) = (ids.as_ptr() as u64, ids.len());
        let m = self
            .mirrors
            .iter()
            .find(|m| m.at <= at && at + 4 * len as u64 <= m.end() && (at - m.at) % 4 == 0)?;
        let first = ((at - m.at) / 4) as usize;
        Some(&m.ids[first..first + len])
    }

    /// `ids` into `out`: the mirror's copy, or read back (a host synchronisation at `site`).
    pub(in crate::kernels::cuda) fn read_into(
        &self,
        ids: View<'_, u32>,
        site: SyncSite,
        out: &mut Vec<u32>,
    ) {
        match self.mirrored(&ids) {
            Some(m) => {
                out.clear();
                out.extend_from_slice(m);
            }
            None => download_into(site, ids, out),
        }
    }

    /// `ids` on the host: the mirror's copy, or read back (a host synchronisation at `site`).
    fn ids(&mut self, ids: View<'_, u32>, site: SyncSite) -> &[u32] {
        if self.mirrored(&ids).is_some() {
            return self.mirrored(&ids).expect("just found");
        }
        download_into(site, ids, &mut self.read);
        &self.read
    }

    /// How many of `targets` are below `vocab`, where a mirror has them (else `None`: the
    /// device counts them).
    pub(in crate::kernels::cuda) fn count_below(
        &self,
        targets: &View<'_, u32>,
        vocab: usize,
    ) -> Option<usize> {
        let t = self.mirrored(targets)?;
        Some(t.iter().filter(|&&t| (t as usize) < vocab).count())
    }

    /// The positions of `tokens` grouped by token id ([`group_into`]), as the embedding
    /// backward uploads them.
    pub(in crate::kernels::cuda) fn grouping(&mut self, tokens: View<'_, u32>) -> &[u32] {
        let mut g = std::mem::take(&mut self.grouping);
        let ids = self.ids(tokens, SyncSite::EmbeddingGrouping);
        group_into(ids, &mut g);
        self.grouping = g;
        &self.grouping
    }
}

/// Positions of `tokens` grouped by token id, in position order within a token, into `out`
/// (reused): the order, then each token's first index into it, then the count, repeated to
/// `n + 1` entries (group `k` past the last is empty). So the grouping has one length for a
/// micro-batch's `n` positions whatever its tokens, and the embedding backward one launch
/// geometry (a block per position, the empty groups' blocks returning at once): a step's
/// launches do not depend on its data, which a captured step (CUDA graphs) replays.
fn group_into(tokens: &[u32], out: &mut Vec<u32>) {
    out.clear();
    out.extend(0..tokens.len() as u32);
    // Keys are unique (the position breaks ties), so an unstable sort gives the same order.
    out.sort_unstable_by_key(|&i| (tokens[i as usize], i));
    let n = tokens.len();
    for k in 0..n {
        if k == 0 || tokens[out[k] as usize] != tokens[out[k - 1] as usize] {
            out.push(k as u32);
        }
    }
    out.resize(2 * n + 1, n as u32);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Memory;
    use std::ptr::NonNull;

    /// Positions of `tokens` grouped by token id, in position order within a token:
    /// `(order, starts)`, token group `k` being `order[starts[k]..starts[k + 1]]`.
    fn group_by_token(tokens: &[u32]) -> (Vec<u32>, Vec<u32>) {
        let mut g = vec![];
        group_into(tokens, &mut g);
        let starts = g.split_off(tokens.len());
        (g, starts)
    }

    /// A device view at a made-up address (never dereferenced: only mirrors are read).
    fn at(addr: u64, len: usize) -> View<'static, u32> {
        let p = NonNull::new(addr as *mut u32).expect("not null");
        // SAFETY: the view is only compared by address and length here.
        unsafe { View::from_raw_parts(p, len, Memory::Device(0)) }
    }

    #[test]
    fn positions_are_grouped_by_token_in_order() {
        let (order, starts) = group_by_token(&[5, 2, 5, 9, 2, 5]);
        assert_eq!(order, [1, 4, 0, 2, 5, 3]);
        assert_eq!(
            starts,
            [0, 2, 5, 6, 6, 6, 6],
            "3 groups, then empty ones to n + 1"
        );
        assert_eq!(group_by_token(&[]), (vec![], vec![0]));
    }

    #[test]
    fn a_mirror_answers_for_views_inside_it_until_overwritten() {
        let mut h = HostIds::new();
        h.note(0x1000, &[7, 3, 7, 1]);
        h.note(0x2000, &[2, 9, 9]);
        // The whole buffer and a slice of it, by address.
        assert_eq!(h.mirrored(&at(0x1000, 4)), Some(&[7, 3, 7, 1][..]));
        assert_eq!(h.mirrored(&at(0x1004, 2)), Some(&[3, 7][..]));
        assert_eq!(h.count_below(&at(0x2000, 3), 9), Some(1));
        // Past a mirror's end, or between mirrors: none.
        assert_eq!(h.mirrored(&at(0x1008, 3)), None);
        assert_eq!(h.mirrored(&at(0x3000, 1)), None);
        // Written again: the new ids; a write over part of another mirror drops it.
        h.note(0x1000, &[4, 4]);
        assert_eq!(h.mirrored(&at(0x1000, 2)), Some(&[4, 4][..]));
        h.note(0x1ffc, &[1, 1]);
        assert_eq!(h.mirrored(&at(0x2000, 1)), Some(&[1][..]));
        assert_eq!(
            h.mirrored(&at(0x2004, 1)),
            None,
            "the old mirror at 0x2000 is stale"
        );
        // The grouping of a mirrored view needs no read-back (a device view is never read).
        assert_eq!(h.grouping(at(0x1000, 2)), &[0, 1, 0, 2, 2][..]);
        // Freed memory takes its mirrors with it.
        h.drop_overlapping(0x1004, 0x1005, None);
        assert_eq!(h.mirrored(&at(0x1000, 1)), None);
        // Its buffer is kept for the next mirror.
        let spare = h.spare.last().map(|v| v.as_ptr());
        h.note(0x5000, &[3]);
        assert_eq!(h.mirrors.last().map(|m| m.ids.as_ptr()), spare);
    }

    #[test]
    fn the_oldest_mirror_goes_first() {
        let mut h = HostIds::new();
        for i in 0..=MIRRORS as u64 {
            h.note(0x100 * (i + 1), &[i as u32]);
        }
        assert_eq!(h.mirrors.len(), MIRRORS);
        assert_eq!(h.mirrored(&at(0x100, 1)), None);
        assert_eq!(h.mirrored(&at(0x200, 1)), Some(&[1][..]));
    }
}
