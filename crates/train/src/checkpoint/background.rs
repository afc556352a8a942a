//! Asynchronous checkpoints (`--async-checkpoint`): the step waits only for a copy of this
//! rank's blocks into a staging buffer; a thread writes them while training goes on, as
//! torchtitan's async checkpointing stages the state dict in CPU memory and writes it in the
//! background (CheckFreq, Mohan et al. 2021, splits a checkpoint the same way: snapshot, then
//! persist).
//!
//! The staging buffer is in the memory plan (`checkpoint.staging`, every instant of the run:
//! allocated once before the first step and reused by every save), sized exactly to this
//! rank's blocks (`block_bytes`). One save is in flight at a time: the next one, and the end of
//! the run, first wait for it.
//!
//! What a kill leaves is what a synchronous save leaves: blocks go into the temp directory, and
//! only rank 0 renames it into place, after every rank has written its blocks and said so. The
//! ranks cannot meet in a collective from the writer threads (the training step owns the
//! communicator), so each says so with a marker file in the temp directory (`.rank-N.done`, or
//! `.rank-N.failed` with its error), which rank 0's writer waits for — a filesystem all ranks
//! share is already required (`parallel`).

use super::{
    block_bytes, emit_blocks, keep_after, layouts, prepare, seal, target, BlockFile, BlockFiles,
    Kept, SmallFiles,
};
use crate::config::CheckpointConfig;
use crate::trainer::Trainer;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The plan's name of the staging buffer.
pub const STAGING: &str = "checkpoint.staging";

/// A contiguous run of staged bytes and where it goes.
struct Segment {
    file: BlockFile,
    offset: u64,
    start: usize,
    len: usize,
}

/// This rank's blocks, copied out of the live buffers.
struct Staging {
    bytes: Vec<u8>,
    segments: Vec<Segment>,
}

impl Staging {
    /// Appends `b`, to go at `offset` of `file`; a run that continues the last one extends it.
    /// Never grows the buffer: it was sized to this rank's blocks.
    fn push(&mut self, file: BlockFile, offset: u64, b: &[u8]) -> std::io::Result<()> {
        if self.bytes.len() + b.len() > self.bytes.capacity() {
            return Err(std::io::Error::other(format!(
                "internal: the checkpoint's staging buffer holds {} bytes, this rank's blocks need more",
                self.bytes.capacity()
            )));
        }
        let start = self.bytes.len();
        self.bytes.extend_from_slice(b);
        match self.segments.last_mut() {
            Some(s) if s.file == file && s.offset + s.len as u64 == offset => s.len += b.len(),
            _ => self.segments.push(Segment {
                file,
                offset,
                start,
                len: b.len(),
            }),
        }
        Ok(())
    }
}

/// What a writer thread needs besides the staged bytes.
struct Job {
    dir: PathBuf,
    tmp: PathBuf,
    rank: usize,
    world: usize,
    with_opt: bool,
    /// Rank 0's: it puts the checkpoint in place, then does the `--keep-checkpoints`
    /// bookkeeping when there is some.
    finish: Option<Kept>,
    /// How long rank 0 waits for the other ranks' markers (the run's `--comm-timeout`).
    timeout: Duration,
}

/// A save in flight: its step, its directory, and the thread writing it (which hands the
/// staging buffer back).
type Writer = (u64, PathBuf, JoinHandle<(Staging, Result<()>)>);

/// One rank's asynchronous saves.
pub struct Background {
    /// The staging buffer while no save is in flight (a writer thread owns it meanwhile).
    idle: Option<Staging>,
    writer: Option<Writer>,
    /// How long the last `save` waited for the save before it to finish.
    pub waited_for_previous: Duration,
}

impl Background {
    /// The saver of `t`'s rank, its staging buffer allocated now and added to `t`'s memory
    /// plan: call before the first step.
    pub fn new(t: &mut Trainer) -> Self {
        let bytes = block_bytes(t);
        t.plan_persistent(STAGING, bytes);
        // Touched now, at start-up: the first save must not fault its pages in on the step.
        // (`vec![0; n]` would map zero pages without touching them.)
        #[allow(clippy::slow_vector_initialization)]
        let mut buf = Vec::with_capacity(bytes as usize);
        buf.resize(bytes as usize, 0u8);
        buf.clear();
        Self {
            idle: Some(Staging {
                bytes: buf,
                segments: Vec::new(),
            }),
            writer: None,
            waited_for_previous: Duration::ZERO,
        }
    }

    /// Starts saving `t`'s checkpoint as `c` says (each rank must call it): waits for the
    /// previous save, makes the temp directory and files (rank 0, a collective), stages this
    /// rank's blocks and hands them to a writer thread. A failure of the previous save is
    /// returned here, with the step it saved.
    pub fn save(
        &mut self,
        c: &CheckpointConfig,
        t: &Trainer,
        tokenizer_json: &str,
        tokenizer_name: &str,
    ) -> Result<()> {
        let started = Instant::now();
        self.wait()?;
        self.waited_for_previous = started.elapsed();
        let Some(root) = &c.dir else {
            return Ok(());
        };
        let (dir, kept) = target(root, c.keep, t)?;
        let rank = t.world_rank();
        let tmp = super::tmp_dir(&dir, t.step)?;
        let mut staging = self.idle.take().expect("no save in flight");
        let small = (rank == 0).then(|| SmallFiles::of(t, tokenizer_json, tokenizer_name));
        let staged = stage(&dir, &tmp, t, &mut staging, small.as_ref());
        if let Err(e) = staged {
            self.idle = Some(staging);
            if rank == 0 {
                let _ = std::fs::remove_dir_all(&tmp);
            }
            return Err(e.context(format!(
                "writing the checkpoint of step {} into {} (the previous checkpoint is intact)",
                t.step,
                dir.display()
            )));
        }
        let job = Job {
            dir: dir.clone(),
            tmp,
            rank,
            world: t.world_size(),
            with_opt: t.opt.is_some(),
            finish: (rank == 0).then_some(kept),
            timeout: Duration::from_secs_f64(t.cfg.runtime.comm_timeout),
        };
        let handle = std::thread::Builder::new()
            .name(format!("checkpoint-writer-{rank}"))
            .spawn(move || {
                let r = write(&job, &staging);
                (staging, r)
            })
            .context("cannot start the checkpoint writer thread")?;
        self.writer = Some((t.step, dir, handle));
        Ok(())
    }

    /// Waits for the save in flight, if any, and returns its outcome.
    pub fn wait(&mut self) -> Result<()> {
        let Some((step, dir, handle)) = self.writer.take() else {
            return Ok(());
        };
        let (staging, r) = handle
            .join()
            .map_err(|_| anyhow::anyhow!("the checkpoint writer of step {step} panicked"))?;
        self.idle = Some(staging);
        r.with_context(|| {
            format!(
                "writing the checkpoint of step {step} into {} (the previous checkpoint is intact)",
                dir.display()
            )
        })
    }
}

/// The synchronous part of a save: the temp directory and files (rank 0, then every rank
/// meets it), rank 0's small files (a few KiB, written now so the writer thread allocates
/// nothing while the next step runs), and this rank's blocks copied into `staging`.
fn stage(
    dir: &Path,
    tmp: &Path,
    t: &Trainer,
    staging: &mut Staging,
    small: Option<&SmallFiles>,
) -> Result<()> {
    prepare(dir, tmp, t)?;
    if let Some(small) = small {
        small.write(tmp)?;
    }
    staging.bytes.clear();
    staging.segments.clear();
    let (weights, states) = layouts(t);
    emit_blocks(t, &weights, &states, &mut |file, offset, b| {
        staging.push(file, offset, b)
    })?;
    Ok(())
}

fn marker(tmp: &Path, rank: usize, done: bool) -> PathBuf {
    let what = if done { "done" } else { "failed" };
    tmp.join(format!(".rank-{rank}.{what}"))
}

/// The writer thread: this rank's blocks, synced, then its marker; rank 0 then waits for every
/// rank's marker and puts the checkpoint in place. A failure leaves the previous checkpoint
/// (rank 0 removes the temp directory).
fn write(job: &Job, staging: &Staging) -> Result<()> {
    let mine = write_staged(job, staging);
    let mark = match &mine {
        Ok(()) => std::fs::write(marker(&job.tmp, job.rank, true), b""),
        Err(e) => std::fs::write(marker(&job.tmp, job.rank, false), format!("{e:#}")),
    };
    mine?;
    mark.with_context(|| format!("cannot write a marker into {}", job.tmp.display()))?;
    let Some(keep) = &job.finish else {
        return Ok(());
    };
    let done = wait_for_ranks(job).and_then(|()| {
        for r in 0..job.world {
            let _ = std::fs::remove_file(marker(&job.tmp, r, true));
        }
        seal(&job.dir, &job.tmp, job.with_opt)?;
        keep_after(keep.as_ref(), &job.dir)
    });
    if done.is_err() {
        let _ = std::fs::remove_dir_all(&job.tmp);
    }
    done
}

fn write_staged(job: &Job, staging: &Staging) -> Result<()> {
    if staging.segments.is_empty() {
        return Ok(());
    }
    let files = BlockFiles::open(&job.tmp, job.rank, job.with_opt)?;
    for s in &staging.segments {
        files
            .write(s.file, s.offset, &staging.bytes[s.start..s.start + s.len])
            .map_err(|e| files.error(s.file, e))?;
    }
    files.sync()
}

/// Rank 0: every other rank's marker, or the first failure one names.
fn wait_for_ranks(job: &Job) -> Result<()> {
    let started = Instant::now();
    let mut pending: Vec<usize> = (1..job.world).collect();
    while !pending.is_empty() {
        for &r in &pending {
            if let Ok(why) = std::fs::read_to_string(marker(&job.tmp, r, false)) {
                bail!("rank {r}: {why}");
            }
        }
        pending.retain(|&r| !marker(&job.tmp, r, true).exists());
        if pending.is_empty() {
            break;
        }
        if started.elapsed() > job.timeout {
            bail!(
                "rank {} did not write its part of the checkpoint within {:.0} s (--comm-timeout)",
                pending[0],
                job.timeout.as_secs_f64()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staging_merges_contiguous_runs_and_never_grows() {
        let mut s = Staging {
            bytes: Vec::with_capacity(10),
            segments: Vec::new(),
        };
        s.push(BlockFile::Model, 100, &[1, 2, 3]).unwrap();
        s.push(BlockFile::Model, 103, &[4, 5]).unwrap();
        s.push(BlockFile::Optimizer, 105, &[6]).unwrap();
        s.push(BlockFile::Optimizer, 200, &[7, 8]).unwrap();
        let runs: Vec<_> = s
            .segments
            .iter()
            .map(|g| (g.file, g.offset, g.start, g.len))
            .collect();
        assert_eq!(
            runs,
            [
                (BlockFile::Model, 100, 0, 5),
                (BlockFile::Optimizer, 105, 5, 1),
                (BlockFile::Optimizer, 200, 6, 2),
            ]
        );
        let err = s.push(BlockFile::Model, 0, &[0, 0, 0]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "internal: the checkpoint's staging buffer holds 10 bytes, this rank's blocks need more"
        );
        assert_eq!(s.bytes.capacity(), 10);
    }
}
