//! `--offload optimizer`: the fp32 master weights and Adam's moments live off the device, in
//! host memory ([`host_tier`](super::host_tier)) or in files (`--offload-dir`,
//! [`disk_states`](super::disk_states)), and AdamW runs there with the CPU backend's kernels,
//! bucket by bucket (ZeRO-Offload, Ren et al. 2021, §4: gradients to the host, the update on
//! the CPU, the updated 16-bit weights back).
//!
//! On a device each bucket's gradients are copied into a host staging buffer, AdamW runs on
//! the host states, and the new weights (16-bit, or fp32 without master weights) are copied
//! back; on the CPU the update reads the gradients and writes the weights where they are.
//! AdamW is element-wise (`kernels::cpu::adamw`), so cutting a tensor at a bucket's edge
//! changes no bit: the trajectory is the one without offload. Stochastic rounding's noise is
//! indexed by the position in the tensor the kernel is given, so it is refused with offload
//! (`check`) rather than reindexed.

use super::disk_states::DiskStates;
use super::host_tier::HostBuf;
use super::offload_copies::{parts, CopyThread, Part, RunAddrs, Slot, SLOTS};
use super::step::{as_f32, AdamState, OptRun};
use anyhow::{bail, Result};
use ferrotron_engine::kernels::{
    AdamWParams, AsViewMut, CpuKernels, DeviceAlloc, Kernels, Memory, Rounding, View, ViewMut,
};
// The typed copies between a host view and a device address are the engine's (`host_copy`),
// where ZeRO-3's parameter windows (`ferrotron_dist::zero::zero3`) also take them.
pub(crate) use ferrotron_engine::kernels::host_copy::{copy_down, copy_up};
use ferrotron_engine::Elem;
use ferrotron_plan::{Layout, Offload};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bucket sets in host memory at once with the disk tier (the planner's `disk_tier::IN_FLIGHT`).
pub const IN_FLIGHT: usize = ferrotron_plan::disk_tier::IN_FLIGHT as usize;

/// Refuses what offload does not run, each in one line naming the setting: `--offload
/// optimizer` on a CPU run without `--offload-dir` (the states are in host memory already:
/// nothing would move), `--offload-dir` without `--offload optimizer`, several ranks (with
/// `--offload params`: any but data parallelism, and ZeRO-1/2), and stochastic rounding.
pub fn check(
    layout: &Layout,
    offload_dir: Option<&Path>,
    on_device: bool,
    world: usize,
    stochastic_rounding: bool,
) -> Result<()> {
    let what = layout.offload;
    if let (Some(d), false) = (offload_dir, what == Offload::Optimizer) {
        bail!(
            "offload_dir = {}: the disk tier holds offloaded optimizer states: add --offload optimizer",
            d.display()
        );
    }
    match what {
        Offload::None => return Ok(()),
        Offload::Optimizer if !on_device && offload_dir.is_none() => bail!("offload = optimizer: a CPU run keeps its optimizer states in host memory already, so there is nothing to move: add --offload-dir PATH to keep them on disk, or drop --offload"),
        Offload::Params if !on_device => bail!("offload = params: a CPU run keeps its weights in host memory already, so there is nothing to stream: add --device emulated (or cuda), or drop --offload"),
        _ => {}
    }
    if what == Offload::Params {
        // Each data-parallel rank streams the whole model (`crate::offload_params`).
        let l = layout;
        let split = [("tp", l.tp), ("pp", l.pp), ("cp", l.cp), ("ep", l.ep)];
        if let Some((flag, n)) = split.into_iter().find(|x| x.1 > 1) {
            bail!("offload = params: not with --{flag} {n} yet (each data-parallel rank streams the whole model): drop --{flag}, or --offload");
        }
        // ZeRO-3 shards the host copy (ZeRO-Infinity); ZeRO-1 and 2 would shard only the
        // optimizer states and gradients, which the streamed step does not do.
        if l.dp > 1 && matches!(l.zero, 1 | 2) {
            bail!("offload = params: not with --zero {} (each of the {} data-parallel ranks would keep the whole weights in host memory): use --zero 3 (each rank keeps its shard), drop --zero, or --offload", l.zero, l.dp);
        }
    } else if world > 1 {
        bail!("offload = {what}: one rank only for now ({world} ranks asked): drop the parallel flags, or --offload");
    }
    if stochastic_rounding {
        bail!("offload = {what}: not with stochastic rounding yet (its noise is indexed by the position in each tensor the update is given, and offload cuts tensors into buckets): drop --stochastic-rounding");
    }
    Ok(())
}

/// [`check`] on the flags of a run, and `--async-checkpoint`, whose staging copies states
/// that offload keeps elsewhere.
pub fn check_args(args: &crate::config::TrainArgs, layout: &Layout, world: usize) -> Result<()> {
    let on_device = args.device != crate::device::Device::Cpu;
    let sr = args.stochastic_rounding.unwrap_or(false);
    check(layout, args.offload_dir.as_deref(), on_device, world, sr)?;
    if layout.offload != Offload::None && args.async_checkpoint == Some(true) {
        bail!(
            "offload = {}: not with --async-checkpoint yet: drop one of them",
            layout.offload
        );
    }
    Ok(())
}

/// Where the offloaded states are.
enum Tier {
    /// Host memory: the master weights (mixed precision) and, from the first optimizer step
    /// on, the moments.
    Host {
        master: Option<HostBuf<f32>>,
        moments: Option<(HostBuf<f32>, HostBuf<f32>)>,
    },
    Disk(DiskStates),
}

/// How the update reaches a device's weights and gradients: slots of staging on the host,
/// which a copy thread fills and drains while the host updates (`offload_copies`).
struct Staging {
    copies: CopyThread,
    /// Each run's addresses in the device's memory, this step (kept: no allocation a step).
    addrs: Vec<RunAddrs>,
}

/// Slots of staging for `n` elements of states in buckets of `bucket`: [`SLOTS`], one bucket
/// updated while the other is copied, or one where there is one bucket.
fn slots(n: usize, bucket: usize) -> usize {
    SLOTS.min(n.div_ceil(bucket.max(1))).max(1)
}

/// Host bytes of a device's staging for `n` elements of states in buckets of `bucket`
/// elements, of `g`-byte gradients and `s`-byte weights.
pub fn staging_bytes(n: usize, bucket: usize, g: usize, s: usize) -> u64 {
    let bucket = bucket.min(n).max(1);
    slots(n, bucket) as u64 * Slot::bytes(bucket, (g, s))
}

/// The offloaded optimizer states of a rank, and how its update reaches them.
pub struct Offloaded {
    /// Elements of each state, and of a bucket.
    n: usize,
    bucket: usize,
    master: bool,
    /// Whether the moments exist (from the first optimizer step on, taken or skipped).
    moments: bool,
    tier: Tier,
    /// The CPU backend's kernels: AdamW on the host.
    cpu: CpuKernels,
    staging: Option<Staging>,
    /// What the plan says the tier takes (set by the trainer, which plans it).
    pub plan: Option<OffloadPlan>,
    /// Time in the updates since the last [`Offloaded::take_times`]: all of it, and the host's
    /// AdamW within it.
    times: UpdateTimes,
}

/// Where an offloaded update's time went.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct UpdateTimes {
    /// The whole update: copies, AdamW on the host, the disk tier's waits.
    pub wall: Duration,
    /// AdamW on the host (the CPU backend's kernel, on every core).
    pub host_adamw: Duration,
}

/// The first `len` elements of `buf` as a host view of `T` (T no wider than f32's alignment).
pub(crate) fn typed<T: Elem>(buf: &mut HostBuf<f32>, len: usize) -> ViewMut<'_, T> {
    assert!(len * size_of::<T>() <= buf.len() * 4 && align_of::<T>() <= 4);
    let p = NonNull::new(buf.as_mut_ptr().cast::<T>()).expect("never null");
    // SAFETY: inside `buf`, aligned (checked), borrowed as `buf`; every bit pattern of the
    // words is a valid `T` (plain numbers).
    unsafe { ViewMut::from_raw_parts(p, len, Memory::Host) }
}

impl Offloaded {
    /// The states of a rank with `n` elements of optimizer state: `master` (mixed precision)
    /// and `opt` as initialised or loaded, moved off the device into host memory, or into
    /// files under `dir`. `device` is the memory the weights and gradients live in (`None`:
    /// the host's); its staging holds up to [`SLOTS`] buckets of `G` gradients and of
    /// `S`-sized weights ([`staging_bytes`]).
    pub fn new(
        n: usize,
        bucket: usize,
        master: Option<Vec<f32>>,
        opt: Option<AdamState>,
        dir: Option<&Path>,
        rank: usize,
        device: Option<(Arc<dyn DeviceAlloc>, usize, usize)>,
    ) -> Result<Offloaded> {
        let bucket = bucket.min(n).max(1);
        let has_master = master.is_some();
        let moments = opt.is_some();
        let tier = match dir {
            None => Tier::Host {
                master: master.as_deref().map(HostBuf::from_slice),
                moments: opt
                    .as_ref()
                    .map(|o| (HostBuf::from_slice(&o.m), HostBuf::from_slice(&o.v))),
            },
            Some(d) => {
                let states = 2 + has_master as usize;
                let mut init = vec![master.as_deref()];
                init.truncate(has_master as usize);
                init.push(opt.as_ref().map(|o| &o.m[..]));
                init.push(opt.as_ref().map(|o| &o.v[..]));
                Tier::Disk(DiskStates::create(d, rank, n, bucket, states, &init)?)
            }
        };
        let staging = match device {
            None => None,
            Some((dev, g, s)) => {
                let slots = (0..slots(n, bucket)).map(|_| Slot::new(bucket, (g, s), &dev));
                let slots = slots.collect();
                let copies = CopyThread::start(dev, slots, (g, s), n, bucket);
                Some(Staging {
                    copies: copies.map_err(anyhow::Error::msg)?,
                    addrs: vec![],
                })
            }
        };
        Ok(Offloaded {
            n,
            bucket,
            master: has_master,
            moments,
            tier,
            cpu: CpuKernels::PLAIN,
            staging,
            plan: None,
            times: UpdateTimes::default(),
        })
    }

    /// One line for the start of a run: where the states are and what the plan says they take.
    pub fn describe(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let Some(p) = self.plan else {
            return String::new();
        };
        let tier = match (&self.tier, p.disk) {
            (Tier::Disk(d), Some(k)) => format!(
                "on disk in {} ({:.1} MiB), {:.1} MiB read + {:.1} MiB written per step ({:.3} s of I/O at an NVMe drive's bandwidth), host memory {:.1} MiB (3 buckets in flight{})",
                d.dir().display(),
                mib(k.disk_bytes),
                mib(k.read_bytes),
                mib(k.written_bytes),
                k.io_s,
                mib(p.host_bytes),
                if p.staging_bytes > 0 { " + device staging" } else { "" },
            ),
            _ => format!(
                "in host memory ({:.1} MiB{})",
                mib(p.host_bytes),
                if p.staging_bytes > 0 { " with device staging" } else { "" },
            ),
        };
        format!(
            "offload: optimizer states ({:.1} MiB: {}Adam's moments) {tier}; buckets of {} elements",
            mib(p.states_bytes),
            if self.master { "fp32 master weights, " } else { "" },
            self.bucket
        )
    }

    /// Where the updates' time went since the last call, which starts the count again.
    pub fn take_times(&mut self) -> UpdateTimes {
        std::mem::take(&mut self.times)
    }

    /// Whether Adam's moments exist.
    pub fn has_moments(&self) -> bool {
        self.moments
    }

    /// The moments, created (zero) by the first optimizer step, as torch.optim creates them.
    pub fn ensure_moments(&mut self) {
        if let Tier::Host { moments, .. } = &mut self.tier {
            moments.get_or_insert_with(|| (HostBuf::zeros(self.n), HostBuf::zeros(self.n)));
        }
        // (On disk they are zero from the start: the files are preallocated.)
        self.moments = true;
    }

    /// The master weights and moments, whole, in host vectors (read from disk with the disk
    /// tier): a checkpoint reads them.
    pub fn to_host(&self) -> Result<(Option<Vec<f32>>, Option<AdamState>)> {
        let (master, m, v) = match &self.tier {
            Tier::Host { master, moments } => (
                master.as_ref().map(|m| m.to_vec()),
                moments.as_ref().map(|(m, _)| m.to_vec()),
                moments.as_ref().map(|(_, v)| v.to_vec()),
            ),
            Tier::Disk(d) => {
                let mut all = d.read_all()?.into_iter();
                let master = match self.master {
                    true => all.next(),
                    false => None,
                };
                (master, all.next(), all.next())
            }
        };
        let opt = match (self.moments, m, v) {
            (true, Some(m), Some(v)) => Some(AdamState {
                m: m.into(),
                v: v.into(),
            }),
            _ => None,
        };
        Ok((master, opt))
    }

    /// AdamW over `runs` (as `optim::step::adamw`), bucket by bucket of the states; on a
    /// device, each bucket's copies overlapped with the host's update of another
    /// (`offload_copies`).
    pub(crate) fn step<'g, S: Elem, G: Elem>(
        &mut self,
        runs: &[OptRun],
        h: AdamWParams,
        rounding: Rounding,
        mut params: ViewMut<'_, S>,
        grad_of: impl Fn(&OptRun) -> View<'g, G>,
    ) -> Result<()> {
        let wall = Instant::now();
        let mut host_adamw = Duration::ZERO;
        let (n, bucket, master) = (self.n, self.bucket, self.master);
        let k: &dyn Kernels<S, G> = &self.cpu;
        let update = Update {
            k,
            runs,
            h,
            rounding,
        };
        let tier = &mut self.tier;
        let done = match self.staging.as_mut() {
            // The CPU: gradients and weights are host memory already.
            None => tier.each_bucket(n, bucket, master, |b| {
                host_adamw += update.in_place(b, params.rb(), &grad_of);
            }),
            Some(st) => {
                let base = params.as_mut_ptr() as usize;
                st.addrs.clear();
                st.addrs.extend(runs.iter().map(|r| RunAddrs {
                    grads: grad_of(r).as_ptr() as usize,
                    weights: base + r.weights * size_of::<S>(),
                }));
                let mut copies = st.copies.begin(runs, &st.addrs, !master);
                tier.each_bucket(n, bucket, master, |b| {
                    let mut slot = copies.next();
                    let (lo, hi) = (b.lo, b.hi);
                    host_adamw += update.staged(b, &mut slot);
                    copies.updated(lo, hi, slot);
                })
            }
        };
        self.times.wall += wall.elapsed();
        self.times.host_adamw += host_adamw;
        done
    }
}

impl Tier {
    /// Calls `f` on each bucket of the states of `n` elements, in order.
    fn each_bucket(
        &mut self,
        n: usize,
        bucket: usize,
        master: bool,
        mut f: impl FnMut(Bucket<'_>),
    ) -> Result<()> {
        match self {
            Tier::Host { master, moments } => {
                let (m, v) = moments.as_mut().expect("ensure_moments ran");
                for lo in (0..n).step_by(bucket) {
                    let hi = (lo + bucket).min(n);
                    f(Bucket {
                        lo,
                        hi,
                        master: master.as_mut().map(|w| &mut w[lo..hi]),
                        m: &mut m[lo..hi],
                        v: &mut v[lo..hi],
                    });
                }
                Ok(())
            }
            // The files' buckets, in `DiskStates`'s order: [master,] m, v.
            Tier::Disk(d) => d.for_each_bucket(|lo, hi, bufs| {
                let n = hi - lo;
                let (w, mv) = match master {
                    true => {
                        let (w, mv) = bufs.split_at_mut(1);
                        (Some(&mut w[0][..n]), mv)
                    }
                    false => (None, bufs),
                };
                let [m, v] = mv else {
                    unreachable!("two moments in every bucket set")
                };
                f(Bucket {
                    lo,
                    hi,
                    master: w,
                    m: &mut m[..n],
                    v: &mut v[..n],
                });
            }),
        }
    }
}

/// The states `lo..hi` of one bucket, in host memory.
struct Bucket<'a> {
    lo: usize,
    hi: usize,
    master: Option<&'a mut [f32]>,
    m: &'a mut [f32],
    v: &'a mut [f32],
}

/// What AdamW is run with, bucket after bucket.
struct Update<'a, S: Elem, G: Elem> {
    k: &'a dyn Kernels<S, G>,
    runs: &'a [OptRun],
    h: AdamWParams,
    rounding: Rounding,
}

impl<S: Elem, G: Elem> Update<'_, S, G> {
    /// AdamW on the part of every run inside the bucket, the gradients and weights in host
    /// memory where they are; returns the time it took.
    fn in_place<'g>(
        &self,
        mut b: Bucket<'_>,
        mut params: ViewMut<'_, S>,
        grad_of: &impl Fn(&OptRun) -> View<'g, G>,
    ) -> Duration {
        let t = Instant::now();
        for p in parts(self.runs, b.lo, b.hi) {
            let run = &self.runs[p.run];
            let g = grad_of(run).slice(p.off..p.off + p.len);
            let at = run.weights + p.off..run.weights + p.off + p.len;
            self.part(p, run, g, params.rb().slice_mut(at), &mut b);
        }
        t.elapsed()
    }

    /// AdamW on the bucket's gradients and weights in a slot of staging (`offload_copies`):
    /// the new weights are left there for the copy up; returns the time it took.
    fn staged(&self, mut b: Bucket<'_>, slot: &mut Slot) -> Duration {
        let t = Instant::now();
        let (g, mut w) = slot.views::<G, S>(b.hi - b.lo);
        for p in parts(self.runs, b.lo, b.hi) {
            let at = p.at..p.at + p.len;
            let (g, w) = (g.as_view().slice(at.clone()), w.rb().slice_mut(at));
            self.part(p, &self.runs[p.run], g, w, &mut b);
        }
        t.elapsed()
    }

    /// AdamW on part `p` of bucket `b` (of `run`): its gradients `g` and weights `w`, and the
    /// bucket's states.
    fn part(&self, p: Part, run: &OptRun, g: View<'_, G>, w: ViewMut<'_, S>, b: &mut Bucket<'_>) {
        let h = AdamWParams {
            weight_decay: if run.decay { self.h.weight_decay } else { 0.0 },
            ..self.h
        };
        let at = p.at..p.at + p.len;
        let (m, v) = (b.m[at.clone()].view_mut(), b.v[at.clone()].view_mut());
        match b.master.as_deref_mut().map(|x| &mut x[at]) {
            Some(x) => self
                .k
                .adamw_step(h, x.view_mut(), g, m, v, Some((w, self.rounding))),
            None => self.k.adamw_step(h, as_f32(w), g, m, v, None),
        }
    }
}

/// What the plan says offload takes: the states' bytes, the host bytes they take (all of
/// them in host memory, or the disk tier's buckets in flight) with a device's staging, and
/// the disk tier.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct OffloadPlan {
    pub states_bytes: u64,
    pub host_bytes: u64,
    pub staging_bytes: u64,
    pub disk: Option<ferrotron_plan::disk_tier::DiskPlan>,
}

static PLANNED: std::sync::Mutex<Option<OffloadPlan>> = std::sync::Mutex::new(None);

pub(crate) fn record_plan(p: OffloadPlan) {
    *PLANNED.lock().unwrap_or_else(|e| e.into_inner()) = Some(p);
}

/// The plan of the last offloading run of the process (its measured counterparts are
/// `host_tier::host_peak` and `disk_states::disk_bytes`).
pub fn last_plan() -> Option<OffloadPlan> {
    *PLANNED.lock().unwrap_or_else(|e| e.into_inner())
}
