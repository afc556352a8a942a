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
use crate::layout::Offload;

/// Buckets resident in host memory at once: the one read ahead, the one the update runs on,
/// the one being written back.
pub const IN_FLIGHT: u64 = 3;

/// An SSD's size and sequential bandwidth.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
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

/// Elements of each state per bucket, by default: 2^24, 64 MiB of each fp32 state (the
/// trainer's `--offload-bucket` default; DeepSpeed's `sub_group_size` plays the same part).
pub const DEFAULT_BUCKET: u64 = 1 << 24;

/// The disk tier a plan assumes (`ferrotron plan --disk-gib ... --offload optimizer`): the
/// drive, and the bucket the states move in, in elements of each state as the trainer's
/// `--offload-bucket`.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct DiskTier {
    pub disk: Disk,
    pub bucket: u64,
}

/// The tier `ferrotron plan`'s flags describe: `None` without `disk_gib`. Refuses, in one
/// line naming the flag, a size or bandwidth that is not a positive number, an empty bucket,
/// disk settings without `disk_gib`, and a disk tier without `--offload optimizer`.
pub fn tier(
    disk_gib: Option<f64>,
    read_gbs: Option<f64>,
    write_gbs: Option<f64>,
    bucket: Option<u64>,
    offload: Offload,
) -> Result<Option<DiskTier>> {
    let Some(gib) = disk_gib else {
        let given = [
            ("disk_read_gbs", read_gbs.map(|v| v.to_string())),
            ("disk_write_gbs", write_gbs.map(|v| v.to_string())),
            ("offload_bucket", bucket.map(|v| v.to_string())),
        ];
        if let Some((f, Some(v))) = given.into_iter().find(|(_, v)| v.is_some()) {
            return Err(PlanError::setting(
                f,
                v,
                "describes the disk tier: give its size too, e.g. --disk-gib 1000",
            ));
        }
        return Ok(None);
    };
    let positive = |field: &str, v: f64, what: &str| {
        if v.is_finite() && v > 0.0 {
            Ok(v)
        } else {
            Err(PlanError::setting(
                field,
                v,
                format!("must be a positive {what}"),
            ))
        }
    };
    let capacity = positive("disk_gib", gib, "size in GiB (the drive's free space)")?;
    let nvme = Disk::nvme(0);
    let bw = |field, v: Option<f64>, default: f64| match v {
        None => Ok(default),
        Some(v) => positive(
            field,
            v,
            "bandwidth in GB/s (a PCIe 4.0 NVMe drive: 7.45 read, 6.9 write)",
        )
        .map(|v| v * 1e9),
    };
    let read_bw = bw("disk_read_gbs", read_gbs, nvme.read_bw)?;
    let write_bw = bw("disk_write_gbs", write_gbs, nvme.write_bw)?;
    let bucket = bucket.unwrap_or(DEFAULT_BUCKET);
    if bucket == 0 {
        return Err(PlanError::setting(
            "offload_bucket",
            0,
            "the disk tier moves states in buckets of a positive number of elements",
        ));
    }
    if offload != Offload::Optimizer {
        return Err(PlanError::setting(
            "disk_gib",
            gib,
            format!("the disk tier holds offloaded optimizer states, and offload is {offload}: add --offload optimizer"),
        ));
    }
    Ok(Some(DiskTier {
        disk: Disk {
            capacity: (capacity * crate::GIB) as u64,
            read_bw,
            write_bw,
        },
        bucket,
    }))
}

/// fp32 states the trainer offloads per element: the master weights (mixed precision) and
/// Adam's two moments (SGD keeps none).
pub fn fp32_states(r: &crate::recipe::Recipe) -> u64 {
    let moments = match r.optimizer {
        crate::recipe::Optimizer::Adamw => 2,
        crate::recipe::Optimizer::Sgd => 0,
    };
    r.precision.has_master() as u64 + moments
}

impl DiskTier {
    /// The tier for `elems` elements of each of `states` fp32 states (master weights when
    /// kept, Adam's moments) beside a host update of `update_s` seconds, as the trainer
    /// moves them: buckets of `bucket` elements of every state.
    pub fn plan(&self, elems: u64, states: u64, update_s: f64) -> Result<DiskPlan> {
        let (offloaded, bucket) = self.bytes(elems, states);
        if offloaded > self.disk.capacity {
            return Err(PlanError::setting(
                "disk_gib",
                self.disk.capacity as f64 / crate::GIB,
                format!(
                    "the offloaded optimizer states of a rank need {:.2} GiB: a larger drive, or shard them over more ranks (--dp with --zero 1)",
                    offloaded as f64 / crate::GIB
                ),
            ));
        }
        plan(offloaded, bucket, update_s, &self.disk)
    }

    /// [`DiskTier::plan`] without its refusals (the step-time model's inner loop; the memory
    /// plan refuses a drive too small).
    pub fn timing(&self, elems: u64, states: u64, update_s: f64) -> DiskPlan {
        let (offloaded, bucket) = self.bytes(elems, states);
        sized(offloaded, bucket.max(1), update_s, &self.disk)
    }

    /// Bytes offloaded and bytes of a bucket (every state's share of it).
    fn bytes(&self, elems: u64, states: u64) -> (u64, u64) {
        let bucket = self.bucket.min(elems).max(1);
        (elems * 4 * states, bucket * 4 * states)
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
    Ok(sized(offloaded, bucket, update_s, disk))
}

/// [`plan`] once its settings are known to be good.
fn sized(offloaded: u64, bucket: u64, update_s: f64, disk: &Disk) -> DiskPlan {
    let host_bytes = (IN_FLIGHT * bucket).min(offloaded);
    let (read, write) = (
        offloaded as f64 / disk.read_bw,
        offloaded as f64 / disk.write_bw,
    );
    let io_s = read + write;
    // The first bucket's read and the last one's write have nothing to overlap.
    let first = bucket.min(offloaded) as f64;
    let edges = first / disk.read_bw + first / disk.write_bw;
    DiskPlan {
        disk_bytes: offloaded,
        host_bytes,
        host_saved: offloaded - host_bytes,
        read_bytes: offloaded,
        written_bytes: offloaded,
        io_s,
        optimizer_s: io_s.max(update_s) + edges,
    }
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
    fn the_flags_make_a_tier_or_are_refused_by_name() {
        let t = tier(Some(2.0), Some(3.5), None, Some(1000), Offload::Optimizer)
            .unwrap()
            .unwrap();
        assert_eq!(t.disk.capacity, 2 << 30);
        assert_eq!(
            (t.disk.read_bw, t.disk.write_bw, t.bucket),
            (3.5e9, 6.9e9, 1000)
        );
        assert_eq!(tier(None, None, None, None, Offload::None).unwrap(), None);
        let refused = |gib, r, w, b, o| tier(gib, r, w, b, o).unwrap_err().to_string();
        let o = Offload::Optimizer;
        assert_eq!(
            refused(Some(100.0), Some(0.0), None, None, o),
            "disk_read_gbs = 0: must be a positive bandwidth in GB/s (a PCIe 4.0 NVMe drive: 7.45 read, 6.9 write)"
        );
        assert_eq!(
            refused(Some(100.0), None, Some(f64::NAN), None, o),
            "disk_write_gbs = NaN: must be a positive bandwidth in GB/s (a PCIe 4.0 NVMe drive: 7.45 read, 6.9 write)"
        );
        assert_eq!(
            refused(Some(-1.0), None, None, None, o),
            "disk_gib = -1: must be a positive size in GiB (the drive's free space)"
        );
        assert_eq!(
            refused(Some(100.0), None, None, Some(0), o),
            "offload_bucket = 0: the disk tier moves states in buckets of a positive number of elements"
        );
        assert_eq!(
            refused(None, Some(3.0), None, None, o),
            "disk_read_gbs = 3: describes the disk tier: give its size too, e.g. --disk-gib 1000"
        );
        assert_eq!(
            refused(Some(100.0), None, None, None, Offload::None),
            "disk_gib = 100: the disk tier holds offloaded optimizer states, and offload is none: add --offload optimizer"
        );
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
