//! Batches of (input, target) token sequences from token shards.
//!
//! **Windows.** A shard of `n` tokens is cut into `(n - 1) / T` non-overlapping windows of
//! `T + 1` tokens, window `k` starting at token `k·T` (consecutive windows share one boundary
//! token, so every token after the first is a target exactly once per epoch). Windows never
//! span two shards. A window gives `input = w[0..T]`, `target = w[1..T+1]`.
//!
//! **Training order.** Each epoch visits every window once, in the order of a Fisher–Yates
//! permutation drawn from a SplitMix64 generator seeded with [`epoch_seed`]`(seed, epoch)`.
//! Since the permutation is a pure function of `(seed, epoch)`, the loader's whole position
//! is `(epoch, cursor)` and [`LoaderState`] restores it exactly (no generator state to save).
//! A global step takes `batch_size × world_size` consecutive windows of the permutation and
//! rank `r` gets the `r`-th block of `batch_size`; the tail of an epoch that cannot fill a
//! global batch is skipped, and the next epoch starts.
//!
//! **Validation.** [`ValLoader`] serves a fixed, ordered set of batches (no shuffling): the
//! windows are spread evenly over the validation shards, so a capped number of batches still
//! samples the whole split. Every evaluation sees the same tokens; there is no state.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::build::{find_shards, Split};
use super::error::{DataError, Result};
use super::rng::{epoch_seed, mix64, SplitMix64};
use super::shard::Shard;
use ferrotron_engine::kernels::SeqPart;

/// A set of validated shards read as one stream of windows.
#[derive(Debug)]
pub struct TokenDataset {
    shards: Vec<Shard>,
    vocab_size: u32,
    fingerprint: u64,
}

impl TokenDataset {
    /// Opens and validates every shard in `paths` (in the given order).
    pub fn open<P: AsRef<Path>>(paths: &[P]) -> Result<Self> {
        if paths.is_empty() {
            return Err(DataError::InvalidArgument(
                "no token shards given (run `ferrotron data` first)".into(),
            ));
        }
        let shards = paths.iter().map(Shard::open).collect::<Result<Vec<_>>>()?;
        Ok(Self::from_shards(shards))
    }

    /// Opens the shards and checks that they fit a model with `model_vocab` entries.
    pub fn open_for_model<P: AsRef<Path>>(paths: &[P], model_vocab: u32) -> Result<Self> {
        let d = Self::open(paths)?;
        d.check_vocab(model_vocab)?;
        Ok(d)
    }

    /// Opens the `train_*.tok` or `val_*.tok` shards of a `ferrotron data` output directory.
    pub fn open_split(dir: impl AsRef<Path>, split: Split) -> Result<Self> {
        let dir = dir.as_ref();
        let paths = find_shards(dir, split)?;
        if paths.is_empty() {
            return Err(DataError::InvalidArgument(format!(
                "{}: no {}_*.tok shards found (run `ferrotron data` to build them)",
                dir.display(),
                split.prefix()
            )));
        }
        Self::open(&paths)
    }

    /// Wraps already-opened shards.
    pub fn from_shards(shards: Vec<Shard>) -> Self {
        let vocab_size = shards.iter().map(|s| s.vocab_size()).max().unwrap_or(0);
        // Identifies the data: token counts and checksums of every shard, in order.
        let mut fp = mix64(shards.len() as u64);
        for s in &shards {
            fp = mix64(fp ^ s.len());
            fp = mix64(fp ^ s.info().checksum);
        }
        TokenDataset {
            shards,
            vocab_size,
            fingerprint: fp,
        }
    }

    /// Errors (naming the first offending shard) unless every shard fits `model_vocab`.
    pub fn check_vocab(&self, model_vocab: u32) -> Result<()> {
        self.shards
            .iter()
            .try_for_each(|s| s.check_vocab(model_vocab))
    }

    /// The shards, in order.
    pub fn shards(&self) -> &[Shard] {
        &self.shards
    }

    /// Total tokens over all shards.
    pub fn tokens(&self) -> u64 {
        self.shards.iter().map(|s| s.len()).sum()
    }

    /// Largest vocab size recorded in any shard.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    /// A hash of the shards' token counts and checksums; a loader state records it.
    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }

    /// Number of windows of `seq_len + 1` tokens (see the module docs).
    pub fn windows(&self, seq_len: usize) -> u64 {
        WindowIndex::new(self, seq_len).total
    }
}

/// Maps a global window number to (shard, start token).
#[derive(Debug, Clone)]
struct WindowIndex {
    seq_len: u64,
    /// `starts[i]` = first global window of shard i; `starts[len]` = total.
    starts: Vec<u64>,
    total: u64,
}

impl WindowIndex {
    fn new(data: &TokenDataset, seq_len: usize) -> Self {
        let t = seq_len.max(1) as u64;
        let mut starts = Vec::with_capacity(data.shards.len() + 1);
        let mut total = 0u64;
        for s in &data.shards {
            starts.push(total);
            total += if s.len() > t { (s.len() - 1) / t } else { 0 };
        }
        starts.push(total);
        WindowIndex {
            seq_len: t,
            starts,
            total,
        }
    }

    fn locate(&self, w: u64) -> (usize, u64) {
        // Last shard whose first window is <= w (shards with no window are skipped over).
        let s = self.starts.partition_point(|&st| st <= w) - 1;
        (s, (w - self.starts[s]) * self.seq_len)
    }
}

/// Copies window `w` as `input`/`target` rows.
fn fill_window(
    data: &TokenDataset,
    index: &WindowIndex,
    w: u64,
    scratch: &mut [u32],
    input: &mut [u32],
    target: &mut [u32],
) {
    let (s, start) = index.locate(w);
    data.shards[s].read_into(start, scratch);
    let t = input.len();
    input.copy_from_slice(&scratch[..t]);
    target.copy_from_slice(&scratch[1..t + 1]);
}

/// Shape and order of the batches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderConfig {
    /// Sequences per batch on this rank (B).
    pub batch_size: usize,
    /// Tokens per sequence (T); windows hold T + 1 tokens.
    pub seq_len: usize,
    /// Seed of the data order.
    pub seed: u64,
    /// This rank's index among the data-parallel ranks.
    pub rank: usize,
    /// Number of data-parallel ranks sharing the dataset.
    pub world_size: usize,
}

impl LoaderConfig {
    /// Single-rank config.
    pub fn new(batch_size: usize, seq_len: usize, seed: u64) -> Self {
        LoaderConfig {
            batch_size,
            seq_len,
            seed,
            rank: 0,
            world_size: 1,
        }
    }

    /// The same config for `rank` of `world_size` ranks.
    pub fn with_rank(mut self, rank: usize, world_size: usize) -> Self {
        self.rank = rank;
        self.world_size = world_size;
        self
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(DataError::InvalidArgument(m));
        if self.batch_size == 0 {
            return bad("batch_size = 0: use at least 1".into());
        }
        if self.seq_len == 0 {
            return bad("seq_len = 0: use at least 1".into());
        }
        if self.world_size == 0 {
            return bad("world_size = 0: use at least 1".into());
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank = {} is out of range for world_size = {}: use 0..{}",
                self.rank, self.world_size, self.world_size
            ));
        }
        Ok(())
    }

    fn global_batch(&self) -> u64 {
        (self.batch_size * self.world_size) as u64
    }
}

fn check_enough(data: &TokenDataset, cfg: &LoaderConfig, windows: u64, what: &str) -> Result<()> {
    if windows < cfg.global_batch() {
        return Err(DataError::InvalidArgument(format!(
            "{what}: {} tokens give only {windows} windows of seq_len + 1 = {} tokens, fewer than \
             one batch of batch_size × world_size = {}; use more data or a smaller batch_size/seq_len",
            data.tokens(),
            cfg.seq_len + 1,
            cfg.global_batch()
        )));
    }
    Ok(())
}

/// One batch: `batch_size × seq_len` row-major inputs and targets (`targets[i]` is the token
/// after `inputs[i]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    pub batch_size: usize,
    pub seq_len: usize,
}

impl Batch {
    fn zeros(batch_size: usize, seq_len: usize) -> Self {
        Batch {
            inputs: vec![0; batch_size * seq_len],
            targets: vec![0; batch_size * seq_len],
            batch_size,
            seq_len,
        }
    }
}

/// The exact position of a [`Loader`]; save it in a checkpoint, restore with
/// [`Loader::restore`] or [`Loader::from_state`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub config: LoaderConfig,
    /// Epoch of the next batch (0-based).
    pub epoch: u64,
    /// Index into the epoch's permutation of the next global batch's first window.
    pub cursor: u64,
    /// Batches served since the loader was created (informational).
    pub batches: u64,
    /// Windows per epoch of the dataset the state was saved with.
    pub windows: u64,
    /// [`TokenDataset::fingerprint`] of that dataset.
    pub dataset_fingerprint: u64,
}

/// Context parallelism's share of every sequence: a batch is read whole into `inputs` and
/// `targets` (allocated with the loader, before any step), then this rank's tokens of each
/// sequence are picked out (the load-balanced split of `ferrotron_engine::kernels::SeqPart`).
#[derive(Debug)]
struct CpShare {
    part: SeqPart,
    inputs: Vec<u32>,
    targets: Vec<u32>,
}

impl CpShare {
    fn new(part: SeqPart, cfg: &LoaderConfig) -> Result<Self> {
        part.local_len(cfg.seq_len)
            .map_err(DataError::InvalidArgument)?;
        let n = cfg.batch_size * cfg.seq_len;
        Ok(CpShare {
            part,
            inputs: vec![0; n],
            targets: vec![0; n],
        })
    }

    /// Tokens of this rank per batch.
    fn local(&self, cfg: &LoaderConfig) -> usize {
        cfg.batch_size * cfg.seq_len / self.part.ranks
    }

    /// This rank's tokens of every sequence of the whole batch held.
    fn pick(&self, seq: usize, inputs: &mut [u32], targets: &mut [u32]) {
        let tl = seq / self.part.ranks;
        let rows = inputs
            .chunks_exact_mut(tl)
            .zip(targets.chunks_exact_mut(tl));
        for (b, (ins, tgts)) in rows.enumerate() {
            for (i, (x, y)) in ins.iter_mut().zip(tgts.iter_mut()).enumerate() {
                let p = b * seq + self.part.position(i, tl);
                (*x, *y) = (self.inputs[p], self.targets[p]);
            }
        }
    }
}

fn check_lens(inputs: &[u32], targets: &[u32], n: usize, what: &str) -> Result<()> {
    if inputs.len() != n || targets.len() != n {
        return Err(DataError::InvalidArgument(format!(
            "batch buffers have {} and {} elements, expected {what} = {n}",
            inputs.len(),
            targets.len()
        )));
    }
    Ok(())
}

/// Deterministic, seeded, resumable training batches.
#[derive(Debug)]
pub struct Loader {
    data: TokenDataset,
    cfg: LoaderConfig,
    index: WindowIndex,
    order: Vec<u64>,
    epoch: u64,
    cursor: u64,
    batches: u64,
    scratch: Vec<u32>,
    /// Context parallelism: this rank's share of each sequence.
    cp: Option<CpShare>,
}

/// The window order of `epoch`: a permutation of `0..windows` (see the module docs).
pub fn epoch_order(seed: u64, epoch: u64, windows: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..windows).collect();
    SplitMix64::new(epoch_seed(seed, epoch)).shuffle(&mut order);
    order
}

impl Loader {
    /// A loader at epoch 0, cursor 0.
    pub fn new(data: TokenDataset, config: LoaderConfig) -> Result<Self> {
        config.validate()?;
        let index = WindowIndex::new(&data, config.seq_len);
        check_enough(&data, &config, index.total, "training data")?;
        let order = epoch_order(config.seed, 0, index.total);
        Ok(Loader {
            scratch: vec![0; config.seq_len + 1],
            data,
            cfg: config,
            index,
            order,
            epoch: 0,
            cursor: 0,
            batches: 0,
            cp: None,
        })
    }

    /// The same loader for a rank of a context-parallel group: each batch holds `part`'s
    /// tokens of every sequence (`batch_size × seq_len / cp` of them).
    pub fn with_context_parallel(mut self, part: SeqPart) -> Result<Self> {
        self.cp = (part.ranks > 1)
            .then(|| CpShare::new(part, &self.cfg))
            .transpose()?;
        Ok(self)
    }

    /// A loader positioned exactly where `state` was saved (config taken from the state).
    pub fn from_state(data: TokenDataset, state: &LoaderState) -> Result<Self> {
        let mut l = Loader::new(data, state.config.clone())?;
        l.restore(state)?;
        Ok(l)
    }

    /// The current position.
    pub fn state(&self) -> LoaderState {
        LoaderState {
            config: self.cfg.clone(),
            epoch: self.epoch,
            cursor: self.cursor,
            batches: self.batches,
            windows: self.index.total,
            dataset_fingerprint: self.data.fingerprint(),
        }
    }

    /// Moves to the position in `state`, which must come from a loader with the same config
    /// over the same data.
    pub fn restore(&mut self, state: &LoaderState) -> Result<()> {
        if state.config != self.cfg {
            return Err(DataError::StateMismatch(format!(
                "saved with {:?}, this loader has {:?}",
                state.config, self.cfg
            )));
        }
        self.restore_position(state)
    }

    /// Moves to the position in `state` of a loader over the same data with the same order
    /// (sequence length and seed) but possibly another layout: another rank, number of ranks or
    /// micro-batch size. The cursor counts windows of the global order, so a run resumed on
    /// another data-parallel layout with the same windows per step goes on where it stopped.
    pub fn restore_position(&mut self, state: &LoaderState) -> Result<()> {
        let (a, b) = (&state.config, &self.cfg);
        if (a.seq_len, a.seed) != (b.seq_len, b.seed) {
            return Err(DataError::StateMismatch(format!(
                "saved with seq_len {} and seed {}, this loader has seq_len {} and seed {}",
                a.seq_len, a.seed, b.seq_len, b.seed
            )));
        }
        if state.dataset_fingerprint != self.data.fingerprint() || state.windows != self.index.total
        {
            return Err(DataError::StateMismatch(format!(
                "saved for a different dataset (fingerprint {:#018x}, {} windows), these shards \
                 have fingerprint {:#018x}, {} windows",
                state.dataset_fingerprint,
                state.windows,
                self.data.fingerprint(),
                self.index.total
            )));
        }
        if state.cursor + self.cfg.global_batch() > self.index.total {
            return Err(DataError::StateMismatch(format!(
                "cursor {} is past the last full batch of an epoch of {} windows",
                state.cursor, self.index.total
            )));
        }
        if state.epoch != self.epoch {
            self.order = epoch_order(self.cfg.seed, state.epoch, self.index.total);
        }
        self.epoch = state.epoch;
        self.cursor = state.cursor;
        self.batches = state.batches;
        Ok(())
    }

    /// The next batch (allocates; see [`Loader::next_into`] for the allocation-free form).
    pub fn next_batch(&mut self) -> Batch {
        let mut b = Batch::zeros(self.cfg.batch_size, self.cfg.seq_len);
        self.fill(&mut b.inputs, &mut b.targets);
        b
    }

    /// Writes the next batch into `inputs` and `targets` (each `batch_size × seq_len`).
    /// Under context parallelism, this rank's share of it (`batch_size × seq_len / cp`).
    pub fn next_into(&mut self, inputs: &mut [u32], targets: &mut [u32]) -> Result<()> {
        match self.cp.take() {
            Some(mut cp) => {
                let r = check_lens(
                    inputs,
                    targets,
                    cp.local(&self.cfg),
                    "batch_size × seq_len / cp",
                );
                if r.is_ok() {
                    self.fill(&mut cp.inputs, &mut cp.targets);
                    cp.pick(self.cfg.seq_len, inputs, targets);
                }
                self.cp = Some(cp);
                r
            }
            None => {
                let n = self.cfg.batch_size * self.cfg.seq_len;
                check_lens(inputs, targets, n, "batch_size × seq_len")?;
                self.fill(inputs, targets);
                Ok(())
            }
        }
    }

    fn fill(&mut self, inputs: &mut [u32], targets: &mut [u32]) {
        let t = self.cfg.seq_len;
        let first = self.cursor + (self.cfg.rank * self.cfg.batch_size) as u64;
        for b in 0..self.cfg.batch_size {
            let w = self.order[(first + b as u64) as usize];
            fill_window(
                &self.data,
                &self.index,
                w,
                &mut self.scratch,
                &mut inputs[b * t..(b + 1) * t],
                &mut targets[b * t..(b + 1) * t],
            );
        }
        self.batches += 1;
        self.cursor += self.cfg.global_batch();
        if self.cursor + self.cfg.global_batch() > self.index.total {
            self.epoch += 1;
            self.cursor = 0;
            self.order = epoch_order(self.cfg.seed, self.epoch, self.index.total);
        }
    }

    /// Epoch of the next batch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Windows in one epoch (all ranks together).
    pub fn windows_per_epoch(&self) -> u64 {
        self.index.total
    }

    /// Global batches per epoch.
    pub fn batches_per_epoch(&self) -> u64 {
        self.index.total / self.cfg.global_batch()
    }

    /// The config.
    pub fn config(&self) -> &LoaderConfig {
        &self.cfg
    }

    /// The data.
    pub fn dataset(&self) -> &TokenDataset {
        &self.data
    }
}

/// A fixed, deterministic set of validation batches (see the module docs).
#[derive(Debug)]
pub struct ValLoader {
    data: TokenDataset,
    cfg: LoaderConfig,
    index: WindowIndex,
    num_batches: usize,
    total_windows_used: u64,
    /// Context parallelism: this rank's share of each sequence.
    cp: Option<std::cell::RefCell<CpShare>>,
}

impl ValLoader {
    /// Up to `max_batches` batches (all full batches when `None`); `config.seed` is unused.
    pub fn new(
        data: TokenDataset,
        config: LoaderConfig,
        max_batches: Option<usize>,
    ) -> Result<Self> {
        config.validate()?;
        let index = WindowIndex::new(&data, config.seq_len);
        check_enough(&data, &config, index.total, "validation data")?;
        let full = (index.total / config.global_batch()) as usize;
        let num_batches = max_batches.map_or(full, |m| m.min(full));
        if num_batches == 0 {
            return Err(DataError::InvalidArgument(
                "max_batches = 0 for validation: use at least 1".into(),
            ));
        }
        Ok(ValLoader {
            total_windows_used: num_batches as u64 * config.global_batch(),
            data,
            cfg: config,
            index,
            num_batches,
            cp: None,
        })
    }

    /// The same batches for a rank of a context-parallel group (see
    /// [`Loader::with_context_parallel`]).
    pub fn with_context_parallel(mut self, part: SeqPart) -> Result<Self> {
        self.cp = (part.ranks > 1)
            .then(|| CpShare::new(part, &self.cfg).map(std::cell::RefCell::new))
            .transpose()?;
        Ok(self)
    }

    /// Number of batches in the fixed set.
    pub fn num_batches(&self) -> usize {
        self.num_batches
    }

    /// Tokens predicted per pass on this rank (`num_batches × batch_size × seq_len`).
    pub fn tokens_per_pass(&self) -> u64 {
        (self.num_batches * self.cfg.batch_size * self.cfg.seq_len) as u64
    }

    /// The config.
    pub fn config(&self) -> &LoaderConfig {
        &self.cfg
    }

    /// Batch `i` of the set (`i < num_batches`).
    pub fn batch(&self, i: usize) -> Batch {
        let mut b = Batch::zeros(self.cfg.batch_size, self.cfg.seq_len);
        self.whole_batch_into(i, &mut b.inputs, &mut b.targets)
            .expect("buffers sized by Batch::zeros");
        b
    }

    /// Writes batch `i` into `inputs`/`targets` (each `batch_size × seq_len`).
    /// Under context parallelism, this rank's share of it (`batch_size × seq_len / cp`).
    pub fn batch_into(&self, i: usize, inputs: &mut [u32], targets: &mut [u32]) -> Result<()> {
        if let Some(cp) = &self.cp {
            let mut cp = cp.borrow_mut();
            let n = cp.local(&self.cfg);
            check_lens(inputs, targets, n, "batch_size × seq_len / cp")?;
            let CpShare {
                inputs: all,
                targets: next,
                ..
            } = &mut *cp;
            self.whole_batch_into(i, all, next)?;
            cp.pick(self.cfg.seq_len, inputs, targets);
            return Ok(());
        }
        self.whole_batch_into(i, inputs, targets)
    }

    fn whole_batch_into(&self, i: usize, inputs: &mut [u32], targets: &mut [u32]) -> Result<()> {
        let t = self.cfg.seq_len;
        let n = self.cfg.batch_size * t;
        if i >= self.num_batches {
            return Err(DataError::InvalidArgument(format!(
                "validation batch {i} does not exist: there are {}",
                self.num_batches
            )));
        }
        check_lens(inputs, targets, n, "batch_size × seq_len")?;
        let mut scratch = vec![0u32; t + 1];
        let first = (i * self.cfg.world_size + self.cfg.rank) * self.cfg.batch_size;
        for b in 0..self.cfg.batch_size {
            // j-th of K selected windows sits at floor(j · W / K): evenly spread, increasing.
            let j = (first + b) as u128;
            let w = (j * u128::from(self.index.total) / u128::from(self.total_windows_used)) as u64;
            fill_window(
                &self.data,
                &self.index,
                w,
                &mut scratch,
                &mut inputs[b * t..(b + 1) * t],
                &mut targets[b * t..(b + 1) * t],
            );
        }
        Ok(())
    }

    /// All batches of the set, in order.
    pub fn iter(&self) -> impl Iterator<Item = Batch> + '_ {
        (0..self.num_batches).map(move |i| self.batch(i))
    }

    /// The data.
    pub fn dataset(&self) -> &TokenDataset {
        &self.data
    }
}
