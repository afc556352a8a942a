//! The rank's part of the whole model's state, as checkpoints and samples address it: the
//! blocks of every parameter's states it holds (its ZeRO shard, its tensor-parallel slices, its
//! pipeline stage's tensors, its experts) and writes, the weights gathered whole, and the
//! setters that take a checkpoint's (or `--init-from`'s) state back into this rank's part.

use super::update::planned_moments;
use super::*;

impl Trainer {
    /// The blocks of every parameter's states this rank holds, each as (range of every
    /// parameter of the whole model, offset in this rank's optimizer states): its ZeRO shard,
    /// else all of them; under tensor parallelism, of its slice.
    pub fn held_blocks(&self) -> Vec<(Range<usize>, usize)> {
        let local = match self.sharded() {
            true => self.runs.iter().map(|r| (r.params.clone(), r.at)).collect(),
            false => vec![(0..self.model.params.total, 0)],
        };
        self.to_whole(local, false)
    }

    /// The blocks this rank writes into a checkpoint: those it holds when ZeRO shards them,
    /// else (every rank holding all of them) its even share, so every rank writes; a
    /// replicated norm only by the first rank of its tensor-parallel group. Each block is
    /// (range of the whole model's parameters, offset in this rank's states, offset in its
    /// weights).
    pub fn written_blocks(&self) -> Vec<(Range<usize>, usize, usize)> {
        let local = match (self.sharded(), &self.mesh.dp) {
            (true, _) => self.runs.iter().map(|r| (r.params.clone(), r.at)).collect(),
            // Expert parallelism: the dense weights shared out over every replica, each
            // rank's experts over the ranks holding them.
            (false, Some(dp)) if self.mesh.group(Dim::Ep).is_some() => {
                let (dense, experts) = self.dense_and_experts();
                let (xr, xn) = dp.expert_rank();
                let mut out = even_share(&dense, self.rank(), self.ranks());
                out.extend(even_share(&experts, xr, xn));
                out.into_iter().map(|r| (r.clone(), r.start)).collect()
            }
            (false, _) => {
                let (n, p, r) = (self.model.params.total, self.ranks(), self.rank());
                let part = n * r / p..n * (r + 1) / p;
                vec![(part.clone(), part.start)]
            }
        };
        let weights_at = |(whole, at): (Range<usize>, usize)| {
            // ZeRO-3 holds only its shard of the weights, at the states' offsets; otherwise
            // the weights are where the states would be without ZeRO.
            let w = match self.gather.is_some() {
                true => at,
                false => self.local_of(&whole),
            };
            (whole, at, w)
        };
        self.to_whole(local, true)
            .into_iter()
            .filter(|(r, _)| !r.is_empty())
            .map(weights_at)
            .collect()
    }

    /// Blocks of this rank's flat parameters as blocks of the whole model's (the identity
    /// without tensor parallelism). `writing` leaves replicated norms to tensor-parallel
    /// rank 0.
    fn to_whole(
        &self,
        local: Vec<(Range<usize>, usize)>,
        writing: bool,
    ) -> Vec<(Range<usize>, usize)> {
        let Some(part) = self.model.part() else {
            return local;
        };
        let pieces = match writing {
            true => self.written_pieces(),
            false => part.pieces.to_vec(),
        };
        let mut out = Vec::new();
        for (r, at) in local {
            for (l, f) in &pieces {
                let (a, b) = (r.start.max(l.start), r.end.min(l.end));
                if a >= b {
                    continue;
                }
                let w = f.start + (a - l.start);
                out.push((w..w + (b - a), at + (a - r.start)));
            }
        }
        out
    }

    /// Where parameter `whole.start` of the whole model sits in this rank's flat parameters.
    fn local_of(&self, whole: &Range<usize>) -> usize {
        let Some(part) = self.model.part() else {
            return whole.start;
        };
        part.pieces
            .iter()
            .find(|(_, f)| f.contains(&whole.start))
            .map(|(l, f)| l.start + (whole.start - f.start))
            .expect("a block of this rank's parameters")
    }

    /// Elements of this rank's optimizer states.
    pub fn states_len(&self) -> usize {
        self.opt_len
    }

    /// Whether ZeRO shards the optimizer states over the ranks.
    fn sharded(&self) -> bool {
        self.mesh.dp.as_ref().is_some_and(|d| d.shard().is_some())
    }

    /// Every weight, as f32 (under ZeRO-3 gathered: every rank must call it).
    pub fn full_weights(&mut self) -> Result<Vec<f32>> {
        let n = self.model.params.total;
        let mine = match (&mut self.mesh.dp, &self.gather) {
            (Some(dp), Some(_)) => {
                let saved = dp.counters();
                let w = gather_weights(dp, &self.params, self.opt_len, n)?;
                dp.set_counters(saved);
                w
            }
            _ => self.params.to_f32(0..n),
        };
        let Some(part) = self.model.part() else {
            return Ok(mine);
        };
        // Every rank's part put together: the first data-parallel replica writes each piece
        // once (a replicated norm from tensor-parallel rank 0, a tied embedding from the first
        // stage) into zeros, and the world sums them (adding zeros is exact).
        let mut whole = vec![0.0; part.whole.total];
        // Under expert parallelism each rank's experts come from the first of the ranks
        // holding them.
        let experts = expert_ranges(&self.model.params);
        let expert_first = self.mesh.dp.as_ref().is_none_or(|d| d.expert_rank().0 == 0);
        for (l, f) in self.written_pieces() {
            let expert = experts.binary_search_by_key(&l.start, |r| r.start).is_ok();
            let first = match (self.mesh.group(Dim::Ep), expert) {
                (Some(_), true) => expert_first,
                _ => self.rank() == 0,
            };
            if first {
                whole[f].copy_from_slice(&mine[l]);
            }
        }
        let world = (self.mesh.world()).expect("a model split over ranks has a world");
        world
            .all_reduce_sum(whole.view_mut())
            .map_err(|e| anyhow::anyhow!("gathering the weights: {e}"))?;
        Ok(whole)
    }

    /// This rank's parameter ranges: the dense ones (merged where adjacent) and its experts'.
    fn dense_and_experts(&self) -> (Vec<Range<usize>>, Vec<Range<usize>>) {
        let experts = expert_ranges(&self.model.params);
        let mut dense: Vec<Range<usize>> = Vec::new();
        let mut at = 0;
        for x in experts
            .iter()
            .chain([&(self.model.params.total..self.model.params.total)])
        {
            if at < x.start {
                dense.push(at..x.start);
            }
            at = x.end;
        }
        (dense, experts)
    }

    /// The pieces (local range, whole range) of this rank's part that it writes: all of them
    /// but a replicated norm on tensor-parallel ranks after the first and the last stage's copy
    /// of a tied embedding.
    fn written_pieces(&self) -> Vec<(Range<usize>, Range<usize>)> {
        let Some(part) = self.model.part() else {
            let n = self.model.params.total;
            return vec![(0..n, 0..n)];
        };
        let tp_rank = self.model.tp.as_ref().map_or(0, |t| t.rank);
        let copied = self.model.copied().unwrap_or(0..0);
        part.pieces
            .iter()
            .filter(|(l, _)| !(tp_rank > 0 && tpar::is_replicated(&self.model, l)))
            .filter(|(l, _)| !(copied.contains(&l.start)))
            .cloned()
            .collect()
    }

    /// Takes the weights of every parameter (a checkpoint's, `--init-from`'s), written into
    /// this rank's weights where they are (their planned place); under ZeRO-3 its shard of
    /// them. Called before the state moves to a device.
    pub fn set_weights(&mut self, full: Flat) {
        let part = match self.model.part() {
            // This rank's part (widened, and rounded back exactly by `set_from_f32`).
            Some(_) => tpar::slice_of(&self.model, &full.into_f32()),
            None if self.gather.is_none() => return self.params.copy_from(&full),
            None => full.into_f32(),
        };
        match &self.gather {
            Some(z) => {
                let shard = shard_of(&self.runs, self.opt_len + z.len(), &part);
                self.params.set_from_f32(&shard)
            }
            None => self.params.set_from_f32(&part),
        }
    }

    /// Takes this rank's part of the optimizer states (and master weights), as `held_blocks`
    /// lays them out (what `checkpoint::load_optimizer` reads), written into their places: the
    /// master weights' in the weights' region, the moments' in theirs (on the host; a device
    /// takes them from the heap).
    pub fn set_states(&mut self, opt: AdamState, master: Option<Vec<f32>>) {
        let mut held = match self.device_alloc {
            Some(_) => None,
            None => planned_moments(&mut self.moments, self.opt_len),
        };
        self.opt = Some(match &mut held {
            Some(h) => {
                h.m.copy_from_slice(&opt.m);
                h.v.copy_from_slice(&opt.v);
                held.expect("matched")
            }
            None => opt,
        });
        if let Some(m) = master {
            self.set_own_master(m);
        }
    }

    /// Takes the fp32 master weights of every parameter (under ZeRO, keeps this rank's shard).
    pub fn set_master(&mut self, full: Vec<f32>) {
        let own = self.own_part(full);
        self.set_own_master(own);
    }

    /// This rank's master weights `own` written into their place.
    fn set_own_master(&mut self, own: Vec<f32>) {
        match &mut self.master {
            Some(m) => m.copy_from_slice(&own),
            None => self.master = Some(own.into()),
        }
    }

    /// This rank's part of a state of every parameter: all of it, or under ZeRO its shard.
    fn own_part(&self, full: Vec<f32>) -> Vec<f32> {
        match self.sharded() {
            true => shard_of(&self.runs, self.opt_len, &full),
            false => full,
        }
    }
}

/// Share `r` of `p` even shares of the elements of `ranges` (in order), as ranges.
fn even_share(ranges: &[Range<usize>], r: usize, p: usize) -> Vec<Range<usize>> {
    let n: usize = ranges.iter().map(|x| x.len()).sum();
    let (lo, hi) = (n * r / p, n * (r + 1) / p);
    let (mut out, mut at) = (Vec::new(), 0);
    for x in ranges {
        let (a, b) = (lo.max(at), hi.min(at + x.len()));
        if a < b {
            out.push(x.start + (a - at)..x.start + (b - at));
        }
        at += x.len();
    }
    out
}
