//! The disk tier's two I/O threads: a reader that fetches buckets of the state files ahead of
//! the host's update and a writer that writes them back behind it (ZeRO-Infinity's NVMe
//! offload, Rajbhandari et al. 2021, §5: fetch ahead, write behind, overlapping the optimizer).
//!
//! Why persistent threads: spawning them and their channels for every optimizer step put small
//! heap allocations outside the plan on the hot path. Here both threads and the three
//! bounded channels (their slots allocated once, `sync_channel`) are made when the tier is
//! created, and a step only moves the bucket sets round:
//!
//! ```text
//!   main ──Read(k)──▶ reader ──Ready(k)──▶ main (update k) ──(k)──▶ writer
//!                       ▲                                              │
//!                       └──────────── Read(k + sets) ◀─────────────────┤
//!                                     Free (last buckets) ─────────▶ main
//! ```
//!
//! The writer hands a written set straight to the reader for the bucket `sets` further on, so
//! the next read starts as soon as a set is free, as with threads made per step. Every set
//! comes home to the main thread before [`DiskIo::for_each_bucket`] returns, so between steps
//! the files are quiet (a checkpoint reads them then). I/O errors come back as one line naming
//! `offload_dir`; a thread that died (a panic) is reported in one line, and the tier refuses
//! every later step. Dropping the tier closes the channels and joins both threads.

use super::host_tier::HostBuf;
use anyhow::{anyhow, bail, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

static READ: AtomicU64 = AtomicU64::new(0);
static WRITTEN: AtomicU64 = AtomicU64::new(0);

/// Bytes the optimizer steps have read from and written to the disk tier (the process's).
pub fn disk_bytes() -> (u64, u64) {
    (
        READ.load(Ordering::Relaxed),
        WRITTEN.load(Ordering::Relaxed),
    )
}

/// One bucket of every state file, in host memory.
pub struct BucketSet(pub Vec<HostBuf<f32>>);

/// How the states are cut: `n` elements per state, buckets of `bucket`, `sets` bucket sets.
#[derive(Clone, Copy)]
struct Cut {
    n: usize,
    bucket: usize,
    sets: usize,
}

impl Cut {
    fn buckets(self) -> usize {
        self.n.div_ceil(self.bucket)
    }

    fn range(self, k: usize) -> (usize, usize) {
        (k * self.bucket, ((k + 1) * self.bucket).min(self.n))
    }
}

enum ToReader {
    Read(usize, BucketSet),
    /// Makes the reader panic, to test how a dead thread is reported.
    #[cfg(test)]
    Die,
}

impl ToReader {
    fn into_set(self) -> Option<BucketSet> {
        match self {
            ToReader::Read(_, set) => Some(set),
            #[cfg(test)]
            ToReader::Die => None,
        }
    }
}

enum Event {
    /// Bucket k read (or not) into the set.
    Ready(usize, std::io::Result<()>, BucketSet),
    /// A set the writer is done with: no bucket left for it to read this step.
    Free(std::io::Result<()>, BucketSet),
}

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast(), size_of_val(v)) }
}

pub(crate) fn as_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as `as_bytes`; every bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast(), size_of_val(v)) }
}

pub(crate) fn write_all(f: &File, v: &[f32]) -> std::io::Result<()> {
    f.write_all_at(as_bytes(v), 0)
}

/// The reader and writer threads of one tier, and the bucket sets while they are home.
pub struct DiskIo {
    dir: PathBuf,
    cut: Cut,
    to_reader: Option<SyncSender<ToReader>>,
    to_writer: Option<SyncSender<(usize, BucketSet)>>,
    events: Receiver<Event>,
    reader: Option<JoinHandle<()>>,
    writer: Option<JoinHandle<()>>,
    /// The bucket sets, home between steps.
    sets: Vec<BucketSet>,
    /// Why the tier cannot step any more (a thread died).
    dead: Option<String>,
}

/// Which I/O thread a closed channel says is ending.
#[derive(Clone, Copy)]
enum Who {
    Reader,
    Writer,
    Both,
    /// Whichever has finished.
    Finished,
}

/// How long the main thread waits for an event before it looks whether a thread died.
const POLL: Duration = Duration::from_millis(200);

impl DiskIo {
    /// Starts the threads over `files` (`n` elements each, in buckets of `bucket`) with
    /// `sets` bucket sets; `dir` names the files in messages.
    pub fn start(
        files: Arc<[File]>,
        dir: PathBuf,
        n: usize,
        bucket: usize,
        sets: Vec<BucketSet>,
    ) -> Result<DiskIo> {
        let cut = Cut {
            n,
            bucket,
            sets: sets.len(),
        };
        assert!(
            cut.sets <= cut.buckets(),
            "no more bucket sets than buckets"
        );
        // At most `sets` messages are ever in any channel: one per set.
        let (to_reader, reader_rx) = sync_channel::<ToReader>(cut.sets);
        let (to_writer, writer_rx) = sync_channel::<(usize, BucketSet)>(cut.sets);
        let (events_tx, events) = sync_channel::<Event>(cut.sets);
        let spawn_err = |e| {
            anyhow!(
                "offload_dir = {}: cannot start an I/O thread: {e}",
                dir.display()
            )
        };
        let (rf, ev) = (files.clone(), events_tx.clone());
        let reader = std::thread::Builder::new()
            .name("ferrotron-disk-read".into())
            .spawn(move || read_loop(&rf, cut, reader_rx, ev))
            .map_err(spawn_err)?;
        let back = to_reader.clone();
        let writer = std::thread::Builder::new()
            .name("ferrotron-disk-write".into())
            .spawn(move || write_loop(&files, cut, writer_rx, back, events_tx));
        let mut io = DiskIo {
            dir: dir.clone(),
            cut,
            to_reader: Some(to_reader),
            to_writer: None,
            events,
            reader: Some(reader),
            writer: None,
            sets,
            dead: None,
        };
        // On failure `io`'s drop joins the reader.
        io.writer = Some(writer.map_err(spawn_err)?);
        io.to_writer = Some(to_writer);
        Ok(io)
    }

    /// Runs `update(lo, hi, states)` on every bucket `lo..hi` of the states in order, the
    /// next buckets read ahead and the previous ones written back by the threads.
    pub fn for_each_bucket(
        &mut self,
        mut update: impl FnMut(usize, usize, &mut [HostBuf<f32>]),
    ) -> Result<()> {
        if let Some(d) = &self.dead {
            bail!("{d}");
        }
        let mut out = 0;
        for k in 0..self.cut.sets {
            let set = self.sets.pop().expect("every set is home between steps");
            self.send_read(k, set)?;
            out += 1;
        }
        // The first I/O error, read or written; after it no bucket is updated or written, and
        // the sets still out come home.
        let mut failed: Option<(&str, std::io::Error)> = None;
        while out > 0 {
            match self.next_event()? {
                Event::Ready(k, Ok(()), mut set) if failed.is_none() => {
                    let (lo, hi) = self.cut.range(k);
                    update(lo, hi, &mut set.0);
                    let w = self.to_writer.as_ref().expect("live until drop");
                    if let Err(e) = w.send((k, set)) {
                        self.sets.push(e.0 .1);
                        return Err(self.died(Who::Writer));
                    }
                }
                Event::Ready(_, r, set) => {
                    if let Err(e) = r {
                        failed.get_or_insert(("reading", e));
                    }
                    self.sets.push(set);
                    out -= 1;
                }
                Event::Free(r, set) => {
                    if let Err(e) = r {
                        failed.get_or_insert(("writing", e));
                    }
                    self.sets.push(set);
                    out -= 1;
                }
            }
        }
        match failed {
            None => Ok(()),
            Some((what, e)) => bail!(
                "offload_dir = {}: {what} the optimizer states: {e}",
                self.dir.display()
            ),
        }
    }

    fn send_read(&mut self, k: usize, set: BucketSet) -> Result<()> {
        let r = self.to_reader.as_ref().expect("live until drop");
        if let Err(e) = r.send(ToReader::Read(k, set)) {
            self.sets.extend(e.0.into_set());
            return Err(self.died(Who::Reader));
        }
        Ok(())
    }

    /// The next event, or the one line saying that a thread died.
    fn next_event(&mut self) -> Result<Event> {
        loop {
            match self.events.recv_timeout(POLL) {
                Ok(ev) => return Ok(ev),
                Err(RecvTimeoutError::Timeout) => {
                    let finished =
                        |h: &Option<JoinHandle<()>>| h.as_ref().is_some_and(|h| h.is_finished());
                    if finished(&self.reader) || finished(&self.writer) {
                        return Err(self.died(Who::Finished));
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return Err(self.died(Who::Both)),
            }
        }
    }

    /// The one line for a dead I/O thread (joined here, for its panic's message); the tier
    /// refuses every step after it. `who` is the thread known to be ending (its channel
    /// closed), so joining it does not wait on a live one.
    fn died(&mut self, who: Who) -> anyhow::Error {
        let mut why = Vec::new();
        for (name, h, ending) in [
            (
                "reader",
                &mut self.reader,
                matches!(who, Who::Reader | Who::Both),
            ),
            (
                "writer",
                &mut self.writer,
                matches!(who, Who::Writer | Who::Both),
            ),
        ] {
            if h.as_ref().is_some_and(|h| ending || h.is_finished()) {
                let payload = h.take().expect("checked").join().err();
                let msg = payload
                    .as_deref()
                    .and_then(|p| {
                        p.downcast_ref::<&str>()
                            .map(|s| s.to_string())
                            .or_else(|| p.downcast_ref::<String>().cloned())
                    })
                    .unwrap_or_else(|| "it stopped".into());
                why.push(format!("the {name} thread died ({msg})"));
            }
        }
        if why.is_empty() {
            why.push("an I/O thread died".into());
        }
        let line = format!(
            "offload_dir = {}: {}: the optimizer states on disk are incomplete; resume from the last checkpoint",
            self.dir.display(),
            why.join(", ")
        );
        self.dead = Some(line.clone());
        anyhow!(line)
    }

    /// The bucket sets home (all of them between steps).
    #[cfg(test)]
    pub fn sets_home(&self) -> usize {
        self.sets.len()
    }

    #[cfg(test)]
    fn kill_reader(&self) {
        let _ = self.to_reader.as_ref().unwrap().send(ToReader::Die);
    }
}

impl Drop for DiskIo {
    fn drop(&mut self) {
        // The writer ends when its channel closes, and drops its sender to the reader; the
        // reader ends when both senders are gone.
        self.to_writer = None;
        self.to_reader = None;
        for h in [self.writer.take(), self.reader.take()]
            .into_iter()
            .flatten()
        {
            let _ = h.join();
        }
    }
}

fn read_loop(files: &[File], cut: Cut, rx: Receiver<ToReader>, events: SyncSender<Event>) {
    for msg in rx {
        let (k, mut set) = match msg {
            ToReader::Read(k, set) => (k, set),
            #[cfg(test)]
            ToReader::Die => panic!("told to die"),
        };
        let (lo, hi) = cut.range(k);
        let r = files.iter().zip(&mut set.0).try_for_each(|(f, buf)| {
            f.read_exact_at(as_bytes_mut(&mut buf[..hi - lo]), (lo * 4) as u64)
        });
        if r.is_ok() {
            READ.fetch_add(((hi - lo) * 4 * files.len()) as u64, Ordering::Relaxed);
        }
        if events.send(Event::Ready(k, r, set)).is_err() {
            return;
        }
    }
}

fn write_loop(
    files: &[File],
    cut: Cut,
    rx: Receiver<(usize, BucketSet)>,
    to_reader: SyncSender<ToReader>,
    events: SyncSender<Event>,
) {
    for (k, set) in rx {
        let (lo, hi) = cut.range(k);
        let r = files
            .iter()
            .zip(&set.0)
            .try_for_each(|(f, buf)| f.write_all_at(as_bytes(&buf[..hi - lo]), (lo * 4) as u64));
        let next = k + cut.sets;
        let ev = match r {
            Ok(()) => {
                WRITTEN.fetch_add(((hi - lo) * 4 * files.len()) as u64, Ordering::Relaxed);
                if next < cut.buckets() {
                    match to_reader.send(ToReader::Read(next, set)) {
                        Ok(()) => continue,
                        // The reader is gone: the set goes home, and the main thread finds
                        // the reader dead.
                        Err(e) => Event::Free(Ok(()), e.0.into_set().expect("a read")),
                    }
                } else {
                    Event::Free(Ok(()), set)
                }
            }
            Err(e) => Event::Free(Err(e), set),
        };
        if events.send(ev).is_err() {
            return;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn scratch(tag: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("ferrotron-disk-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        p
    }

    fn io_over(p: &std::path::Path, n: usize, bucket: usize, sets: usize) -> DiskIo {
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(p.join("state.f32"))
            .unwrap();
        f.set_len((n * 4) as u64).unwrap();
        let sets = (0..sets)
            .map(|_| BucketSet(vec![HostBuf::zeros(bucket)]))
            .collect();
        DiskIo::start(Arc::from(vec![f]), p.to_path_buf(), n, bucket, sets).unwrap()
    }

    #[test]
    fn a_short_file_is_one_line_and_every_set_comes_home() {
        let p = scratch("short");
        let mut io = io_over(&p, 10, 3, 3);
        io.for_each_bucket(|_, _, _| {}).unwrap();
        // The file loses its last bucket: bucket 3's read fails mid-step.
        File::options()
            .write(true)
            .open(p.join("state.f32"))
            .unwrap()
            .set_len(9 * 4 - 1)
            .unwrap();
        let e = io.for_each_bucket(|_, _, _| {}).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "offload_dir = {}: reading the optimizer states: failed to fill whole buffer",
                p.display()
            )
        );
        assert_eq!(io.sets_home(), 3, "the sets out came home");
        drop(io);
        let _ = std::fs::remove_dir_all(&p);
    }

    #[test]
    fn a_dead_reader_is_one_line_and_refuses_the_next_steps() {
        let p = scratch("dead");
        let mut io = io_over(&p, 8, 2, 2);
        io.kill_reader();
        let want = format!(
            "offload_dir = {}: the reader thread died (told to die): the optimizer states on disk are incomplete; resume from the last checkpoint",
            p.display()
        );
        let e = io.for_each_bucket(|_, _, _| {}).unwrap_err();
        assert_eq!(e.to_string(), want);
        let e = io.for_each_bucket(|_, _, _| {}).unwrap_err();
        assert_eq!(e.to_string(), want, "and stays refused");
        drop(io); // joins the writer: returns
        let _ = std::fs::remove_dir_all(&p);
    }
}
