//! The token stream of a build, written to disk as it comes, then split into train and
//! validation shards once its length is known.
//!
//! Why on disk: the validation split is the *last* `val_fraction` of the stream, and where it
//! starts is known only when the input ends. Holding the stream (4 bytes a token) or its tail
//! in memory grows with the input; counting first would tokenize everything twice. Instead
//! the stream goes into temporary train shards of at most `max_shard_tokens` tokens each
//! (sealed, i.e. flushed and closed, when full). At the end the shards before the split are
//! published as they are, the one holding the split point is truncated in place after its
//! tail is copied out, and the ones after it are copied into validation shards and deleted.
//! Extra I/O: the validation tokens once more, plus one read of the cut shard's prefix for
//! its checksum. Memory: one shard writer's 1 MiB buffer and a 256 KiB read-back block.
//!
//! Nothing is published before the end, so an interrupted build leaves the previous output
//! (shards and `summary.json`) as it was; its temporary files are removed by the next run
//! ([`super::shard::remove_orphan_temps`]).

use std::path::{Path, PathBuf};

use super::build::Split;
use super::error::Result;
use super::shard::{SealedShard, ShardInfo, ShardWriter};

/// Receives the token stream in order; [`Spool::finish`] splits and publishes it.
pub(crate) struct Spool {
    dir: PathBuf,
    vocab_size: u32,
    max_shard_tokens: u64,
    sealed: Vec<SealedShard>,
    open: Option<ShardWriter>,
    tokens: u64,
}

impl Spool {
    pub(crate) fn new(dir: &Path, vocab_size: u32, max_shard_tokens: u64) -> Self {
        Spool {
            dir: dir.to_path_buf(),
            vocab_size,
            max_shard_tokens: max_shard_tokens.max(1),
            sealed: Vec::new(),
            open: None,
            tokens: 0,
        }
    }

    /// Tokens received so far.
    pub(crate) fn len(&self) -> u64 {
        self.tokens
    }

    /// Appends tokens to the stream.
    pub(crate) fn push(&mut self, mut tokens: &[u32]) -> Result<()> {
        while !tokens.is_empty() {
            let w = match &mut self.open {
                Some(w) => w,
                None => {
                    let name = Split::Train.shard_name(self.sealed.len());
                    self.open
                        .insert(ShardWriter::create(self.dir.join(name), self.vocab_size)?)
                }
            };
            let room = (self.max_shard_tokens - w.len()) as usize;
            let n = room.min(tokens.len());
            w.push(&tokens[..n])?;
            self.tokens += n as u64;
            tokens = &tokens[n..];
            if w.len() == self.max_shard_tokens {
                let full = self.open.take().expect("just written");
                self.sealed.push(full.seal()?);
            }
        }
        Ok(())
    }

    /// Publishes the first `train` tokens as `train_NNNN.tok` shards (the spool's own shard
    /// boundaries) and the rest as `val_NNNN.tok` shards of at most `max_shard_tokens`.
    pub(crate) fn finish(mut self, train: u64) -> Result<(Vec<ShardInfo>, Vec<ShardInfo>)> {
        if let Some(w) = self.open.take() {
            self.sealed.push(w.seal()?);
        }
        let mut val = ValShards {
            dir: self.dir.clone(),
            vocab_size: self.vocab_size,
            max_shard_tokens: self.max_shard_tokens,
            open: None,
            done: Vec::new(),
        };
        let mut train_shards = Vec::new();
        let mut start = 0u64;
        for shard in std::mem::take(&mut self.sealed) {
            let len = shard.len();
            let keep = train.saturating_sub(start).min(len);
            if let Some(info) = shard.finish_split(keep, &mut |t| val.push(t))? {
                train_shards.push(info);
            }
            start += len;
        }
        Ok((train_shards, val.finish()?))
    }
}

/// Validation shards written in order, each of at most `max_shard_tokens`.
struct ValShards {
    dir: PathBuf,
    vocab_size: u32,
    max_shard_tokens: u64,
    open: Option<ShardWriter>,
    done: Vec<ShardInfo>,
}

impl ValShards {
    fn push(&mut self, mut tokens: &[u32]) -> Result<()> {
        while !tokens.is_empty() {
            let w = match &mut self.open {
                Some(w) => w,
                None => {
                    let name = Split::Val.shard_name(self.done.len());
                    self.open
                        .insert(ShardWriter::create(self.dir.join(name), self.vocab_size)?)
                }
            };
            let n = ((self.max_shard_tokens - w.len()) as usize).min(tokens.len());
            w.push(&tokens[..n])?;
            tokens = &tokens[n..];
            if w.len() == self.max_shard_tokens {
                let full = self.open.take().expect("just written");
                self.done.push(full.finish()?);
            }
        }
        Ok(())
    }

    fn finish(mut self) -> Result<Vec<ShardInfo>> {
        if let Some(w) = self.open.take() {
            self.done.push(w.finish()?);
        }
        Ok(self.done)
    }
}
