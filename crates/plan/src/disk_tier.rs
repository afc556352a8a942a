//! The disk tier of offload (`--offload-dir`): the offloaded optimizer states (and, with
//! `--offload params`, the parameters) kept in files on an SSD instead of host memory, read and
//! written bucket by bucket around the host's update, as ZeRO-Infinity's NVMe offload does
//! (Rajbhandari et al., "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme Scale Deep
//! Learning", SC 2021, §5: states partitioned to NVMe, fetched ahead and written behind the
//! optimizer step so the I/O overlaps it).
//!
//! What it changes, for the planner's memory and time model:
//! - **capacity**: the disk holds every offloaded byte (the plan's host-resident states); host
//!   memory holds only the buckets in flight: one read ahead, one being updated, one being
//!   written back ([`IN_FLIGHT`]).
//! - **bytes per step**: the optimizer reads every offloaded byte once and writes it back once.
//! - **time**: the reads and writes share the drive, so they take `bytes / read + bytes /
//!   write`; they overlap the host's update of the other buckets, so the optimizer term becomes
//!   the longer of the two, plus the first bucket's read and the last one's write, which
//!   nothing overlaps.

use crate::error::{PlanError, Result};

/// Buckets resident in host memory at once: the one read ahead, the one the update runs on,
/// the one being written back.
pub const IN_FLIGHT: u64 = 3;

/// An SSD's size and sequential bandwidth.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Disk {
    /// Bytes free for the offloaded states.
    pub capacity: u64,
    /// Sequential read and write bandwidth, bytes/s.
    pub read_bw: f64,
    pub write_bw: f64,
}

impl Disk {
    /// A PCIe 4.0 ×4 NVMe drive of `capacity` bytes at its vendor's sequential figures
    /// (Samsung 990 PRO data sheet: 7,450 MB/s read, 6,900 MB/s write); an assumption stated
    /// with every figure derived from it, as the time model's PCIe and host bandwidths are.
    pub fn nvme(capacity: u64) -> Disk {
        Disk {
            capacity,
            read_bw: 7.45e9,
            write_bw: 6.9e9,
        }
    }
}

/// The disk tier's share of a rank's memory and step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskPlan {
    /// Bytes on the disk: every offloaded byte.
    pub disk_bytes: u64,
    /// Host bytes the offloaded states still take: the buckets in flight.
    pub host_bytes: u64,
    /// Host bytes the tier frees against keeping the states in host memory.
    pub host_saved: u64,
    /// Bytes read from and written to the disk per step.
    pub read_bytes: u64,
    pub written_bytes: u64,
    /// Seconds of disk I/O per step, and the optimizer term with it (the update overlapped
    /// with the I/O of the other buckets).
    pub io_s: f64,
    pub optimizer_s: f64,
}

/// The disk tier for `offloaded` bytes of states (the plan's host-resident bytes, `MemoryPlan::
/// host_bytes`), moved in buckets of `bucket` bytes, beside a host update that takes
/// `update_s` seconds per step. Refuses a disk too small or a bucket that is not positive,
/// naming the setting.
pub fn plan(offloaded: u64, bucket: u64, update_s: f64, disk: &Disk) -> Result<DiskPlan> {
    if bucket == 0 {
        return Err(PlanError::setting(
            "bucket_mb",
            0,
            "the disk tier moves states in buckets of a positive size",
        ));
    }
    if offloaded > disk.capacity {
        return Err(PlanError::setting(
            "offload_dir",
            format!("{:.2} GiB free", disk.capacity as f64 / crate::GIB),
            format!(
                "the offloaded states need {:.2} GiB: a larger disk, or offload less",
                offloaded as f64 / crate::GIB
            ),
        ));
    }
    let host_bytes = (IN_FLIGHT * bucket).min(offloaded);
    let (read, write) = (
        offloaded as f64 / disk.read_bw,
        offloaded as f64 / disk.write_bw,
    );
    let io_s = read + write;
    // The first bucket's read and the last one's write have nothing to overlap.
    let first = bucket.min(offloaded) as f64;
    let edges = first / disk.read_bw + first / disk.write_bw;
    Ok(DiskPlan {
        disk_bytes: offloaded,
        host_bytes,
        host_saved: offloaded - host_bytes,
        read_bytes: offloaded,
        written_bytes: offloaded,
        io_s,
        optimizer_s: io_s.max(update_s) + edges,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn one_billion_parameters_of_adam_states_by_hand() {
        // bf16 with fp32 master weights, optimizer offloaded: master + two moments, 12 bytes
        // per parameter, 1e9 parameters: 12e9 bytes on disk, in 25 MiB buckets.
        let offloaded = 12_000_000_000;
        let disk = Disk::nvme(2_000_000_000_000);
        let p = plan(offloaded, 25 * MIB, 1.0, &disk).unwrap();
        assert_eq!(p.disk_bytes, 12_000_000_000);
        // Three buckets resident: 75 MiB = 78,643,200 bytes.
        assert_eq!(p.host_bytes, 78_643_200);
        assert_eq!(p.host_saved, 12_000_000_000 - 78_643_200);
        assert_eq!((p.read_bytes, p.written_bytes), (offloaded, offloaded));
        // 12e9 / 7.45e9 = 1.610738 s read, 12e9 / 6.9e9 = 1.739130 s written: 3.349868 s.
        assert!((p.io_s - 3.349868).abs() < 1e-6, "{}", p.io_s);
        // The update (1 s) hides under the I/O; one bucket (26,214,400 bytes) read before and
        // written after: 0.0035187 + 0.0037992 = 0.0073179 s.
        assert!((p.optimizer_s - 3.357186).abs() < 1e-6, "{}", p.optimizer_s);
        // An update slower than the I/O is what the step waits for instead.
        let slow = plan(offloaded, 25 * MIB, 5.0, &disk).unwrap();
        assert!(
            (slow.optimizer_s - 5.007318).abs() < 1e-6,
            "{}",
            slow.optimizer_s
        );
    }

    #[test]
    fn small_states_stay_whole_in_host_memory() {
        // Fewer bytes than three buckets: all of them in flight, nothing saved.
        let p = plan(10 * MIB, 25 * MIB, 0.0, &Disk::nvme(1 << 40)).unwrap();
        assert_eq!((p.host_bytes, p.host_saved), (10 * MIB, 0));
    }

    #[test]
    fn a_disk_too_small_or_an_empty_bucket_is_refused() {
        let e = plan(12 << 30, 25 * MIB, 0.0, &Disk::nvme(8 << 30)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "offload_dir = 8.00 GiB free: the offloaded states need 12.00 GiB: a larger disk, or offload less"
        );
        let e = plan(1 << 30, 0, 0.0, &Disk::nvme(1 << 40)).unwrap_err();
        assert_eq!(
            e.to_string(),
            "bucket_mb = 0: the disk tier moves states in buckets of a positive size"
        );
    }
}
