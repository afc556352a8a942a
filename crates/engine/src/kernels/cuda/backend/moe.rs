//! The mixture-of-experts ops on the GPU (`cu/moe.cu`; the reference is
//! `kernels/cpu/moe_routing.rs`).
//!
//! The router runs on the device: one thread per token picks its top k and weights, then one
//! thread per expert adds the probabilities and counts to the running load statistics and
//! marks the copies past a capacity, in token order, as the CPU does.
//!
//! The routed rows' order (`routed_rows`: expert by expert, copies in order) is built on the
//! host from the router's choices, downloaded (`n·k` u32), and uploaded as two small tables
//! into the backend's scratch, as the embedding backward groups its tokens. The model reads
//! the choices back for its expert blocks anyway (`Llama::expert_rows`). The grouping is then
//! the CPU's own function, and every row copy, scaling and dot runs in the CPU's order.
//!
//! A layer's row ops (permute and unpermute forward; permute, row_dot, scale_rows and
//! unpermute backward) all read the same choices, so the tables are built once and kept
//! ([`Routing`]) until those choices may have changed: a hit skips the download (a host
//! synchronisation) and both uploads.

use super::*;

/// A routed copy's row table entry for "none" (`ROUTE_NONE` in `cu/moe.cu`).
pub const NONE: u32 = u32::MAX;

/// The routed rows of a router's choices `index` (`top_k` per token, `tokens` tokens, marks
/// of dropped copies included), as `cu/moe.cu` reads them:
/// - `by_row[r]`: the copy in routed row `r` (`routed_rows`' order);
/// - `by_token[2(n·k + j)..][..2]`: the row and copy of token `n`'s `j`-th routed copy, in
///   row order, [`NONE`] after its last (a dropped copy has no row).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Routes {
    pub by_row: Vec<u32>,
    pub by_token: Vec<u32>,
}

pub fn routes(index: &[u32], experts: usize, tokens: usize, top_k: usize) -> Routes {
    let mut r = Routes::default();
    r.fill(index, experts, tokens, top_k);
    r
}

impl Routes {
    /// The tables of `index`, in place (the capacity of the last call's reused).
    pub fn fill(&mut self, index: &[u32], experts: usize, tokens: usize, top_k: usize) {
        self.by_row.clear();
        self.by_token.clear();
        self.by_token.resize(2 * tokens * top_k, NONE);
        for (r, c) in routed_rows(index, experts) {
            let n = c / top_k;
            assert!(
                n < tokens,
                "router choice {c} belongs to token {n} of {tokens}"
            );
            self.by_row.push(c as u32);
            // The token's next free entry (its copies arrive in row order).
            let slots = 2 * n * top_k..2 * (n + 1) * top_k;
            let free = (slots.step_by(2)).find(|&at| self.by_token[at] == NONE);
            let at = free.expect("at most top_k copies per token");
            self.by_token[at..at + 2].copy_from_slice(&[r as u32, c as u32]);
        }
    }
}

/// Which router choices the uploaded tables are of: the index buffer's device address and
/// length, the shape, and the device-write epoch ([`write_epoch`]) when they were read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RouteKey {
    pub index: u64,
    pub len: usize,
    pub experts: usize,
    pub tokens: usize,
    pub top_k: usize,
    pub epoch: u64,
}

/// Anything that may change the contents of device memory other than the backend's kernels,
/// counted ([`OPS`]): host→device copies and memsets, device copies, allocations and frees
/// (an index buffer freed and another allocated at its address). The one kernel that writes
/// router choices, the router's, drops the kept tables and the host's copy of the old choices
/// itself (`moe_router_forward`). So
/// tables read at one epoch are those of any later call at the same epoch with the same index
/// buffer: nothing can have written it between. (Expert parallelism, whose token exchange
/// would write choices through NCCL, is refused on the GPU; it would have to end the epoch
/// too.)
pub fn write_epoch(ops: &crate::kernels::DeviceOps) -> u64 {
    ops.writes + ops.copies + ops.syncs[SyncSite::Alloc as usize]
}

/// The router's choices read back, their routing tables, and the key of the choices the
/// tables in the device scratch hold (`None`: none yet, or the scratch is new).
#[derive(Default)]
pub struct Routing {
    choices: Vec<u32>,
    routes: Routes,
    uploaded: Option<(RouteKey, u64, u64, usize)>,
}

impl Routing {
    /// The uploaded tables' addresses and rows, if they are of `key` and still where they
    /// were put (`base`: the routes scratch now).
    pub fn hit(&self, key: RouteKey, base: u64) -> Option<(u64, u64, usize)> {
        match self.uploaded {
            Some((k, b, by_token, rows)) if k == key && b == base => Some((b, by_token, rows)),
            _ => None,
        }
    }
}

impl CudaKernels {
    /// Scratch both: the routing tables the row kernels read, and the router's per-token max
    /// and Σexp, for micro-batches of `tokens` tokens routed to `top_k` experts each. Called
    /// with [`Self::reserve`] for a MoE model, so that no step allocates them.
    pub fn reserve_routing(&self, tokens: usize, top_k: usize) {
        self.scratch(Scratch::Routes, (3 * tokens * top_k * 4).max(4));
        self.scratch(Scratch::RouterStats, (2 * tokens * 4).max(8));
    }

    /// The routed rows of `index` uploaded: the device addresses of `by_row` and `by_token`,
    /// and the number of routed rows.
    fn routes(&self, s: RouteShape, index: View<'_, u32>, op: &str) -> (u64, u64, usize) {
        // The router's choices and the tables in host buffers kept from call to call.
        let mut held = lock(&self.routing);
        // The largest tables these shapes make (the scratch's size never depends on the
        // routing, so a hit's scratch is the one the tables were put in). Grown, if it is,
        // before the epoch is read: its allocation moves the epoch on.
        let most = (3 * s.tokens * s.top_k * 4).max(4);
        let base = self.scratch(Scratch::Routes, most);
        let key = RouteKey {
            index: dev(&index, op),
            len: index.len(),
            experts: s.experts,
            tokens: s.tokens,
            top_k: s.top_k,
            epoch: write_epoch(&OPS.read()),
        };
        if let Some(hit) = held.hit(key, base) {
            return hit;
        }
        held.uploaded = None;
        let Routing {
            choices, routes: r, ..
        } = &mut *held;
        // The model's copy of the choices where it announced one (`host_ids`), else read back.
        super::host_ids::ids().read_into(index, SyncSite::MoeRouting, choices);
        r.fill(choices, s.experts, s.tokens, s.top_k);
        let (rows, bytes) = (r.by_row.len(), (r.by_row.len() + r.by_token.len()) * 4);
        assert!(bytes <= most, "routing tables of {bytes} bytes past {most}");
        let by_token = base + 4 * rows as u64;
        let mut mine = 0;
        for (at, table) in [(base, &*r.by_row), (by_token, &*r.by_token)] {
            if !table.is_empty() {
                OPS.write();
                mine += 1;
                // SAFETY: the scratch holds `bytes`; the copy (from pageable memory, staged by
                // the call) runs after the work before it on the compute stream (a kernel
                // still reading the previous tables), and the launches that read these after.
                unsafe { write_queued(&self.gpu.stream, at, table, "routing table upload") };
            }
        }
        // The uploads just made moved the epoch on by `mine`, and wrote only the scratch: the
        // tables are of the epoch after them, unless something else wrote meanwhile (another
        // rank's thread), which leaves the key at the epoch before (the next call reads again).
        let after = write_epoch(&OPS.read());
        let epoch = if after == key.epoch + mine {
            after
        } else {
            key.epoch
        };
        held.uploaded = Some((RouteKey { epoch, ..key }, base, by_token, rows));
        (base, by_token, rows)
    }

    pub(super) fn moe_router_forward(
        &self,
        s: RouteShape,
        logits: View<'_, f32>,
        mut weights: ViewMut<'_, f32>,
        mut index: ViewMut<'_, u32>,
        mut load: ViewMut<'_, f32>,
    ) {
        let op = "router_forward";
        let (e, k, n) = (s.experts, s.top_k, s.tokens);
        assert_eq!(logits.len(), n * e, "router logits len");
        assert!(weights.len() == n * k && index.len() == n * k);
        assert_eq!(load.len(), 2 * e, "router load len");
        let stats = self.scratch(Scratch::RouterStats, (2 * n * 4).max(8));
        // New choices: the routing tables kept are of none of them any more (whichever
        // buffer they were of, it may be this one).
        lock(&self.routing).uploaded = None;
        // New choices: the host's copy of the old ones is stale.
        super::host_ids::forget(index.as_view().as_ptr() as u64, 4 * index.len() as u64);
        let (l, w) = (dev(&logits, op), dev_mut(&mut weights, op));
        let (ix, ld) = (dev_mut(&mut index, op), dev_mut(&mut load, op));
        let (tokens, e, k, norm) = (n as u64, e as u64, k as u64, s.norm_topk as i32);
        let (has_cap, cap) = (s.capacity.is_some() as i32, s.capacity.unwrap_or(0) as u64);
        launch!(self, "router_topk", elementwise(tokens); l, w, ix, stats, tokens, e, k, norm);
        launch!(self, "router_load", elementwise(e); l, ix, stats, ld, tokens, e, k, has_cap, cap);
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn moe_router_backward(
        &self,
        s: RouteShape,
        logits: View<'_, f32>,
        index: View<'_, u32>,
        dweights: View<'_, f32>,
        aux_dp: View<'_, f32>,
        mut dlogits: ViewMut<'_, f32>,
    ) {
        let op = "router_backward";
        let (e, k, n) = (s.experts, s.top_k, s.tokens);
        assert!(logits.len() == n * e && dlogits.len() == n * e);
        assert!(index.len() == n * k && dweights.len() == n * k);
        assert_eq!(aux_dp.len(), e, "aux gradient len");
        let (l, ix, dw) = (dev(&logits, op), dev(&index, op), dev(&dweights, op));
        let (aux, dl) = (dev(&aux_dp, op), dev_mut(&mut dlogits, op));
        let (tokens, e, k, norm) = (n as u64, e as u64, k as u64, s.norm_topk as i32);
        launch!(self, op, elementwise(tokens); l, ix, dw, aux, dl, tokens, e, k, norm);
    }

    pub(super) fn moe_permute<S: Elem>(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        x: View<'_, S>,
        mut rows: ViewMut<'_, S>,
    ) {
        let op = "permute";
        let w = s.width;
        assert!(x.len() == s.tokens * w && rows.len() <= s.tokens * s.top_k * w);
        let (by_row, _, n) = self.routes(s, index, op);
        assert!(rows.len() >= n * w, "permute: {n} routed rows of {w}");
        let (x, r) = (dev(&x, op), dev_mut(&mut rows, op));
        let (n, w, k) = (n as u64, w as u64, s.top_k as u64);
        launch!(self, name::<S>("moe_permute"), elementwise(n * w); by_row, x, r, n, w, k);
    }

    pub(super) fn moe_unpermute<S: Elem>(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        weights: Option<View<'_, f32>>,
        rows: View<'_, S>,
        mut y: ViewMut<'_, S>,
        accum: Accum,
    ) {
        let op = "unpermute";
        let w = s.width;
        assert!(y.len() == s.tokens * w && rows.len() <= s.tokens * s.top_k * w);
        let (_, by_token, n) = self.routes(s, index, op);
        assert!(rows.len() >= n * w, "unpermute: {n} routed rows of {w}");
        let wt = weights.map_or(0, |v| dev(&v, op));
        let (r, yp) = (dev(&rows, op), dev_mut(&mut y, op));
        let (tokens, w, k) = (s.tokens as u64, w as u64, s.top_k as u64);
        let acc = (accum == Accum::Add) as i32;
        launch!(self, name::<S>("moe_unpermute"), elementwise(tokens * w); by_token, wt, r, yp, tokens, w, k, acc);
    }

    pub(super) fn moe_scale_rows<S: Elem>(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        weights: View<'_, f32>,
        rows: ViewMut<'_, S>,
    ) {
        let op = "scale_rows";
        let w = s.width;
        assert!(rows.len() <= s.tokens * s.top_k * w, "routed rows len");
        let (by_row, _, n) = self.routes(s, index, op);
        assert!(rows.len() >= n * w, "scale_rows: {n} routed rows of {w}");
        self.scale_rows_by(op, by_row, weights, rows, n, w);
    }

    /// `cu/moe.cu`'s row scaling: `rows[r] *= weights[table[r]]` (`table` 0: `weights[r]`).
    fn scale_rows_by<S: Elem>(
        &self,
        op: &str,
        table: u64,
        weights: View<'_, f32>,
        mut rows: ViewMut<'_, S>,
        n: usize,
        w: usize,
    ) {
        let (wt, r) = (dev(&weights, op), dev_mut(&mut rows, op));
        let (n, w) = (n as u64, w as u64);
        launch!(self, name::<S>("moe_scale_rows"), elementwise(n * w); table, wt, r, n, w);
    }

    pub(super) fn moe_row_dot<S: Elem>(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        a: View<'_, S>,
        b: View<'_, S>,
        out: ViewMut<'_, f32>,
    ) {
        let op = "row_dot";
        let w = s.width;
        assert!(a.len() <= s.tokens * s.top_k * w && b.len() == a.len());
        let (by_row, _, n) = self.routes(s, index, op);
        assert!(a.len() >= n * w, "row_dot: {n} routed rows of {w}");
        self.dot_rows_into(op, by_row, (a, b), out, n, w);
    }

    /// `cu/moe.cu`'s row dots: `out[table[r]] = ⟨a[r], b[r]⟩` (`table` 0: `out[r]`).
    fn dot_rows_into<S: Elem>(
        &self,
        op: &str,
        table: u64,
        (a, b): (View<'_, S>, View<'_, S>),
        mut out: ViewMut<'_, f32>,
        n: usize,
        w: usize,
    ) {
        let (ap, bp, o) = (dev(&a, op), dev(&b, op), dev_mut(&mut out, op));
        let (n, w) = (n as u64, w as u64);
        launch!(self, name::<S>("moe_row_dot"), elementwise(n); table, ap, bp, o, n, w);
    }

    /// `gather_copies` (`gather`: `to[r] = from[by_row[r]]`) and `scatter_copies` (the
    /// inverse).
    pub(super) fn moe_copies(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        from: View<'_, f32>,
        mut to: ViewMut<'_, f32>,
        gather: bool,
    ) {
        let op = if gather {
            "gather_copies"
        } else {
            "scatter_copies"
        };
        let copies = s.tokens * s.top_k;
        let (by_row, _, n) = self.routes(s, index, op);
        let (rows, values) = match gather {
            true => (to.len(), from.len()),
            false => (from.len(), to.len()),
        };
        assert!(
            values == copies && rows >= n,
            "{op}: {n} routed rows, {copies} copies"
        );
        let (f, t, n) = (dev(&from, op), dev_mut(&mut to, op), n as u64);
        launch!(self, kname!("moe_{op}"), elementwise(n); by_row, f, t, n);
    }

    /// `rows[r] *= weights[r]` ([`Self::moe_scale_rows`]'s kernel without a table).
    pub(super) fn moe_scale_each_row<S: Elem>(
        &self,
        width: usize,
        weights: View<'_, f32>,
        rows: ViewMut<'_, S>,
    ) {
        let op = "scale_each_row";
        let n = rows.len() / width.max(1);
        assert!(rows.len() == n * width && weights.len() >= n, "{op}: rows");
        self.scale_rows_by(op, 0, weights, rows, n, width);
    }

    /// `out[r] = ⟨a[r], b[r]⟩` ([`Self::moe_row_dot`]'s kernel without a table).
    pub(super) fn moe_dot_each_row<S: Elem>(
        &self,
        width: usize,
        a: View<'_, S>,
        b: View<'_, S>,
        out: ViewMut<'_, f32>,
    ) {
        let op = "dot_each_row";
        let n = out.len();
        assert!(a.len() == b.len() && a.len() == n * width, "{op}: rows");
        self.dot_rows_into(op, 0, (a, b), out, n, width);
    }
}

#[cfg(test)]
mod tests {
    use super::{routes, write_epoch, RouteKey, Routes, Routing, NONE};
    use crate::kernels::device_ops::OpCounter;
    use crate::kernels::{routed_rows, SyncSite, DROPPED};

    #[test]
    fn cuda_routing_tables_are_kept_only_for_the_same_choices_and_epoch() {
        let key = RouteKey {
            index: 0x7000,
            len: 8,
            experts: 3,
            tokens: 4,
            top_k: 2,
            epoch: 5,
        };
        let mut r = Routing::default();
        assert_eq!(r.hit(key, 0x9000), None, "nothing uploaded yet");
        r.uploaded = Some((key, 0x9000, 0x9000 + 28, 7));
        assert_eq!(r.hit(key, 0x9000), Some((0x9000, 0x9000 + 28, 7)));
        // Another buffer, length, shape or epoch, or the scratch moved: read again.
        for other in [
            RouteKey {
                index: 0x8000,
                ..key
            },
            RouteKey { len: 6, ..key },
            RouteKey { experts: 4, ..key },
            RouteKey { tokens: 3, ..key },
            RouteKey { top_k: 1, ..key },
            RouteKey { epoch: 6, ..key },
        ] {
            assert_eq!(r.hit(other, 0x9000), None, "{other:?}");
        }
        assert_eq!(r.hit(key, 0xa000), None, "a new scratch");
        // The epoch moves with every write, device copy, allocation and free, and with
        // nothing else the backend counts.
        let c = OpCounter::new();
        let mut at = write_epoch(&c.read());
        let changes: [fn(&OpCounter); 3] = [
            |c| c.write(),
            |c| c.copy(),
            |c| drop(c.sync(SyncSite::Alloc)),
        ];
        for (i, change) in changes.iter().enumerate() {
            change(&c);
            let now = write_epoch(&c.read());
            assert_eq!(now, at + 1, "change {i}");
            at = now;
        }
        c.kernel();
        c.blas();
        let _ = (c.sync(SyncSite::CeLoss), c.sync(SyncSite::MoeRouting));
        assert_eq!(write_epoch(&c.read()), at);
    }

    #[test]
    fn cuda_routing_tables_follow_the_routed_rows() {
        // 4 tokens, top-2 of 3 experts; token 3's copy to expert 1 dropped by a capacity.
        let index = [0, 2, 1, 0, 2, 1, 0, 1 | DROPPED];
        let r = routes(&index, 3, 4, 2);
        // Rows expert by expert, copies in order: expert 0 takes copies 0, 3, 6; expert 1
        // copies 2, 5; expert 2 copies 1, 4. The dropped copy 7 has no row.
        assert_eq!(r.by_row, [0, 3, 6, 2, 5, 1, 4]);
        let want: Vec<u32> = [
            [0, 0, 5, 1],       // token 0: rows 0 (copy 0) and 5 (copy 1)
            [1, 3, 3, 2],       // token 1: rows 1 (copy 3) and 3 (copy 2)
            [4, 5, 6, 4],       // token 2: rows 4 (copy 5) and 6 (copy 4)
            [2, 6, NONE, NONE], // token 3: row 2 (copy 6) only
        ]
        .concat();
        assert_eq!(r.by_token, want);
        // The same pairs as `routed_rows`, which the CPU kernels walk.
        let pairs: Vec<(u32, u32)> = r
            .by_token
            .chunks(2)
            .filter(|p| p[0] != NONE)
            .map(|p| (p[0], p[1]))
            .collect();
        let mut cpu: Vec<(u32, u32)> = routed_rows(&index, 3)
            .map(|(r, c)| (r as u32, c as u32))
            .collect();
        cpu.sort_by_key(|&(r, c)| (c / 2, r));
        assert_eq!(pairs, cpu);
        // No routed copies: no rows, every token empty.
        let none = routes(&[DROPPED, DROPPED], 2, 1, 2);
        assert_eq!(
            none,
            Routes {
                by_row: vec![],
                by_token: vec![NONE; 4]
            }
        );
    }
}
