//! The disk tier of offload (`--offload-dir`): the offloaded optimizer states, one file per
//! state (fp32 master weights, Adam's two moments), read and written bucket by bucket around
//! the host's update as ZeRO-Infinity's NVMe offload does (Rajbhandari et al. 2021, §5; the
//! planner's model is `ferrotron_plan::disk_tier`).
//!
//! Per optimizer step the tier's reader thread fetches bucket k+1 while the update runs on
//! bucket k and its writer thread writes bucket k−1 back: three bucket sets in host memory
//! (`disk_tier::IN_FLIGHT`), so the host holds only the buckets in flight. The threads are
//! started once, with the files ([`super::disk_io`]). Every byte read and written by a step is
//! counted ([`disk_bytes`]).
//!
//! The files live in a directory of their own, `PATH/ferrotron-offload-<pid>-rank<r>`,
//! preallocated at start (`posix_fallocate`: a full disk is refused then, not mid-run) and
//! removed when the run ends, or when creating them fails.

pub use super::disk_io::disk_bytes;
use super::disk_io::{as_bytes_mut, write_all, BucketSet, DiskIo};
use super::host_tier::HostBuf;
use anyhow::{anyhow, bail, Context, Result};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

const NAMES: [&str; 3] = ["master.f32", "exp_avg.f32", "exp_avg_sq.f32"];

/// The offloaded states in files.
pub struct DiskStates {
    dir: PathBuf,
    files: Arc<[File]>,
    /// Elements per state.
    n: usize,
    /// The I/O threads and the bucket sets (`None` only while the files are being made).
    io: Option<DiskIo>,
}

/// The refusal of a disk with `free` bytes for states of `need` bytes, naming the setting.
fn too_small(dir: &Path, free: u64, need: u64) -> String {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    format!(
        "offload_dir = {}: {:.3} GiB free, the offloaded optimizer states need {:.3} GiB: free space there or choose another directory",
        dir.display(),
        gib(free),
        gib(need)
    )
}

/// Bytes free to an unprivileged writer on `dir`'s file system.
pub(crate) fn free_bytes(dir: &Path) -> Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes())?;
    // SAFETY: a zeroed statvfs is a valid out-parameter; `c` is a NUL-terminated path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        bail!(
            "offload_dir = {}: {}",
            dir.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(s.f_bavail as u64 * s.f_frsize as u64)
}

impl DiskStates {
    /// Files for `states` states of `n` elements each under `parent` (the first is the master
    /// weights when `master` is given, written now), moved in buckets of `bucket` elements.
    /// Refuses, in one line naming `offload_dir`, a missing directory, one that cannot be
    /// written and a disk without room; nothing is left behind then.
    pub fn create(
        parent: &Path,
        rank: usize,
        n: usize,
        bucket: usize,
        states: usize,
        initial: &[Option<&[f32]>],
    ) -> Result<DiskStates> {
        let shown = parent.display();
        if !parent.is_dir() {
            bail!("offload_dir = {shown}: no such directory: create it first, or choose another");
        }
        let need = (n * 4 * states) as u64;
        let free = free_bytes(parent)?;
        if free < need {
            bail!(too_small(parent, free, need));
        }
        let dir = parent.join(format!(
            "ferrotron-offload-{}-rank{rank}",
            std::process::id()
        ));
        std::fs::create_dir(&dir)
            .map_err(|e| anyhow!("offload_dir = {shown}: cannot write there: {e}"))?;
        let mut d = DiskStates {
            dir,
            files: Arc::from(Vec::new()),
            n,
            io: None,
        };
        let bucket = bucket.min(n).max(1);
        // From here on `d`'s drop removes what was made.
        let mut files = Vec::with_capacity(states);
        for (name, init) in NAMES[3 - states..].iter().zip(initial) {
            let path = d.dir.join(name);
            let f = File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(|e| anyhow!("offload_dir = {shown}: cannot write there: {e}"))?;
            // Reserve the blocks now (reads give zeros: the moments start at zero), so a disk
            // that fills up refuses the run here, not in the middle of a step.
            let bytes = need / states as u64;
            // SAFETY: a valid open descriptor.
            let rc = unsafe {
                libc::posix_fallocate(std::os::fd::AsRawFd::as_raw_fd(&f), 0, bytes as libc::off_t)
            };
            if rc != 0 {
                let e = std::io::Error::from_raw_os_error(rc);
                if rc == libc::ENOSPC {
                    bail!(too_small(parent, free_bytes(parent).unwrap_or(0), need));
                }
                bail!("offload_dir = {shown}: cannot reserve {bytes} bytes there: {e}");
            }
            if let Some(init) = init {
                write_all(&f, init)
                    .map_err(|e| anyhow!("offload_dir = {shown}: writing {name}: {e}"))?;
            }
            files.push(f);
        }
        d.files = Arc::from(files);
        let buckets = n.div_ceil(bucket);
        let sets = (0..buckets.min(super::offload::IN_FLIGHT))
            .map(|_| BucketSet((0..states).map(|_| HostBuf::zeros(bucket)).collect()));
        let io = DiskIo::start(
            d.files.clone(),
            parent.to_path_buf(),
            n,
            bucket,
            sets.collect(),
        )?;
        d.io = Some(io);
        Ok(d)
    }

    /// The directory of the files.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Every state, whole, read from its file (a checkpoint reads them): the first is the
    /// master weights when there are three.
    pub fn read_all(&self) -> Result<Vec<Vec<f32>>> {
        self.files
            .iter()
            .map(|f| {
                let mut v = vec![0.0f32; self.n];
                f.read_exact_at(as_bytes_mut(&mut v), 0)
                    .with_context(|| format!("offload_dir: reading {}", self.dir.display()))?;
                Ok(v)
            })
            .collect()
    }

    /// Overwrites every state (a loaded checkpoint's), in the order of [`read_all`].
    pub fn write_all(&self, states: &[&[f32]]) -> Result<()> {
        for (f, s) in self.files.iter().zip(states) {
            write_all(f, s)
                .with_context(|| format!("offload_dir: writing {}", self.dir.display()))?;
        }
        Ok(())
    }

    /// Runs `update(lo, hi, states)` on every bucket `lo..hi` of the states in order, with
    /// the next bucket read ahead and the previous one written back by the I/O threads.
    pub fn for_each_bucket(
        &mut self,
        update: impl FnMut(usize, usize, &mut [HostBuf<f32>]),
    ) -> Result<()> {
        self.io
            .as_mut()
            .expect("made with the files")
            .for_each_bucket(update)
    }
}

impl Drop for DiskStates {
    fn drop(&mut self) {
        // The threads first: they hold the files.
        self.io = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[cfg(test)]
mod tests {
    use super::super::disk_io::tests::scratch;
    use super::*;

    #[test]
    fn buckets_go_round_in_order_and_land_in_the_files() {
        let p = scratch("order");
        let master: Vec<f32> = (0..10).map(|i| i as f32).collect();
        let mut d = DiskStates::create(&p, 0, 10, 3, 3, &[Some(&master), None, None]).unwrap();
        let mut seen = vec![];
        for _ in 0..2 {
            d.for_each_bucket(|lo, hi, s| {
                seen.push((lo, hi));
                let [w, m, v] = s else { panic!("three states") };
                let n = hi - lo;
                for ((w, m), v) in w[..n].iter_mut().zip(&mut m[..n]).zip(&mut v[..n]) {
                    // Each state reads as it was written last.
                    assert_eq!(*m, *w * *v);
                    *w += 1.0;
                    *m = *w * 2.0;
                    *v = 2.0;
                }
            })
            .unwrap();
        }
        assert_eq!(seen[..4], [(0, 3), (3, 6), (6, 9), (9, 10)]);
        assert_eq!(
            d.io.as_ref().unwrap().sets_home(),
            3,
            "every bucket set came back"
        );
        let all = d.read_all().unwrap();
        let want: Vec<f32> = (0..10).map(|i| i as f32 + 2.0).collect();
        assert_eq!(all[0], want);
        assert_eq!(all[2], vec![2.0; 10]);
        let dir = d.dir.clone();
        drop(d);
        assert!(!dir.exists(), "the files are removed with the store");
        let _ = std::fs::remove_dir_all(&p);
    }

    #[test]
    fn a_missing_directory_and_a_small_disk_are_refused_by_name() {
        let root = scratch("bad");
        let p = root.join("missing");
        let e = DiskStates::create(&p, 0, 4, 2, 2, &[None, None])
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            format!(
                "offload_dir = {}: no such directory: create it first, or choose another",
                p.display()
            )
        );
        assert_eq!(
            too_small(Path::new("/ssd"), 1 << 29, 3 << 30),
            "offload_dir = /ssd: 0.500 GiB free, the offloaded optimizer states need 3.000 GiB: free space there or choose another directory"
        );
        let _ = std::fs::remove_dir_all(&root);
    }
}
