//! NCCL where each rank has a GPU of its own (issue #33), for two groups:
//! - **data parallelism**: the backward's final gradients are summed in place on the device,
//!   on NCCL's stream, while the backward goes on (`ferrotron_dist::device_reduce`), instead of
//!   through the host's buckets; under ZeRO each segment into its owner's copy or shard (with
//!   gradient accumulation into its window, added into the shard by the backend's kernel), and
//!   the updated weights broadcast from their owners (ZeRO-3: each unit's into its window, a
//!   layer ahead);
//! - **tensor parallelism**: the model's all-reduces, all-gathers and reduce-scatters run on
//!   the activations where they lie (`ferrotron_dist::device_collective`), instead of through
//!   the group's host buffer;
//! - **context parallelism**: the ring passes each key/value block as it lies, beside the
//!   attention of the block in hand (the same module);
//! - **expert parallelism**: the routed rows' all-to-alls between the blocks where they lie
//!   (the same module);
//! - **the pipeline**: the first and last stages' sum of a tied embedding's gradient, in place,
//!   and the stages' messages between their GPUs, a communicator per directed edge, from device
//!   send buffers the plan holds (`ferrotron_dist::pipeline`, `device_p2p`).
//!
//! Each group takes NCCL on every rank or on none (the choice is agreed over the group's host
//! communicator first: NCCL's bootstrap is collective).
//!
//! `FERROTRON_NCCL` chooses: unset or `auto`, NCCL where it can serve (data parallelism: f32 or
//! bf16 gradients, any ZeRO stage, the experts' replicas over their own group (with ZeRO-1,
//! the one stage a mixture of experts takes), no offload; tensor parallelism: f32 or bf16
//! activations; all: one rank per GPU, the library present); `1`, NCCL or a refusal naming
//! what stands in the way (also where ranks share a GPU: the CUDA emulator's libnccl takes
//! them, NCCL itself refuses); `0`, the host's buffers.

use crate::config::TrainConfig;
use crate::device::Machine;
use anyhow::{bail, Result};
use ferrotron_dist::data_parallel::DataParallel;
use ferrotron_dist::group::Group;
use ferrotron_dist::{AsViewMut, Communicator, Dim};
use ferrotron_engine::kernels::Backend;
use ferrotron_plan::{DType, Offload};

/// `FERROTRON_NCCL`'s choice.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Want {
    Auto,
    Required,
    Never,
}

const ENV: &str = "FERROTRON_NCCL";

fn want() -> Result<Want> {
    match std::env::var(ENV).as_deref() {
        Err(_) | Ok("auto") => Ok(Want::Auto),
        Ok("1") => Ok(Want::Required),
        Ok("0") => Ok(Want::Never),
        Ok(other) => bail!("{ENV} = `{other}`: use auto (NCCL where it can serve), 1 (NCCL or a refusal) or 0 (the host's buffers)"),
    }
}

/// The name of dimension `d`'s group in a line.
fn name(d: Dim) -> &'static str {
    match d {
        Dim::Dp => "data parallel",
        Dim::Tp => "tensor parallel",
        Dim::Cp => "context parallel",
        Dim::Ep => "expert parallel",
        Dim::Pp => "pipeline parallel",
    }
}

/// What keeps this rank's `group` from NCCL, in words; `None` when nothing does.
fn obstacle(
    cfg: &TrainConfig,
    machine: &Machine,
    want: Want,
    nccl: bool,
    group: Dim,
) -> Option<String> {
    let p = &cfg.parallel;
    let dp = group == Dim::Dp;
    // The groups that sum gradients: data parallelism's, and the pipeline's ends' tied embedding.
    let grads = dp || group == Dim::Pp;
    let kind = cfg.precision.kind;
    Some(match () {
        _ if grads && kind.engine_grads() == DType::F16 => {
            "precision = fp16: fp16 gradients (and their loss scale's overflow check) are summed on the host; use bf16 or fp32".into()
        }
        _ if group == Dim::Tp && kind.storage() == DType::F16 => {
            "precision = fp16: fp16 activations are summed through the group's host buffer; use bf16 or fp32".into()
        }
        _ if grads && p.offload != Offload::None => "offload: the gradients are summed on the host".into(),
        _ => return shared_obstacle(machine, want, nccl),
    })
}

/// What keeps any group of this rank from NCCL (the pipeline's messages, which carry any type
/// and sum nothing, meet only this), in words.
fn shared_obstacle(machine: &Machine, want: Want, nccl: bool) -> Option<String> {
    Some(match () {
        _ if want == Want::Auto && machine.gpu_share > 1 => format!(
            "{} ranks share GPU {} (NCCL takes one rank per GPU)",
            machine.gpu_share, machine.gpu
        ),
        _ if !nccl => "NCCL is not found: cudarc loads libnccl.so by name; put a libnccl.so link to libnccl.so.2 (PyTorch: site-packages/nvidia/nccl/lib) in a directory on LD_LIBRARY_PATH".into(),
        _ => return None,
    })
}

/// Whether `group` (whose host communicator is `comm`) takes NCCL: every rank's answer,
/// agreed over `comm` (a collective), or this rank's refusal under `FERROTRON_NCCL=1`.
fn agree(
    comm: &dyn Communicator,
    cfg: &TrainConfig,
    machine: &Machine,
    group: Dim,
) -> Result<bool> {
    let why = |want| obstacle(cfg, machine, want, nccl_present(), group);
    agree_on(comm, name(group), why)
}

/// [`agree`], where `why(want)` says what keeps this rank from NCCL.
fn agree_on(
    comm: &dyn Communicator,
    name: &str,
    why: impl FnOnce(Want) -> Option<String>,
) -> Result<bool> {
    let want = want()?;
    if want == Want::Never || comm.size() < 2 {
        return Ok(false);
    }
    let why = why(want);
    // Every rank's answer: NCCL's bootstrap needs all of them.
    let mut ready = [f32::from(why.is_none())];
    comm.all_reduce_sum(ready.view_mut())
        .map_err(|e| anyhow::anyhow!("{name}: agreeing on NCCL: {e}"))?;
    let all = ready[0] as usize == comm.size();
    match (want, &why, all) {
        (Want::Required, Some(w), _) => bail!("{ENV}=1: {name}: {w}"),
        (Want::Required, None, false) => {
            bail!("{ENV}=1: another {name} rank cannot take NCCL (its own line says why)")
        }
        (Want::Auto, _, false) => Ok(false),
        _ => Ok(true),
    }
}

/// Hands `dp`'s gradient sum to NCCL on this rank's GPU when every rank of the group can (see
/// the module docs); `true` when it did. A collective over `dp`'s group.
pub fn reduce_on_gpus(
    backend: &Backend,
    cfg: &TrainConfig,
    machine: &Machine,
    dp: &mut DataParallel,
) -> Result<bool> {
    let Some(ctx) = gpu_context(backend) else {
        return Ok(false);
    };
    if !agree(dp.group().comm.as_ref(), cfg, machine, Dim::Dp)? {
        return Ok(false);
    }
    #[cfg(feature = "cuda")]
    {
        // The experts' replicas first (the dense group's sum checks they are in place).
        if let Some(g) = dp.experts_group() {
            let experts = over(g, ctx.clone(), Dim::Dp)?;
            dp.experts_in_place(Box::new(experts))?;
        }
        dp.reduce_in_place(Box::new(over(dp.group(), ctx, Dim::Dp)?))?;
        if let (Backend::Cuda(k), true) = (backend, cfg.parallel.zero >= 2 && cfg.data.grad_acc > 1)
        {
            dp.accumulate_with(device_add(k.clone()));
        }
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda(ctx)?;
    Ok(true)
}

/// ZeRO-2/3's shard accumulation on the GPU: the backend's `add_inplace`, in the gradients'
/// type, on its compute stream.
#[cfg(feature = "cuda")]
fn device_add(
    k: std::sync::Arc<ferrotron_engine::kernels::cuda::CudaKernels>,
) -> ferrotron_dist::device_reduce::DeviceAdd {
    use ferrotron_engine::kernels::Memory;
    use ferrotron_engine::kernels::{Kernels, View, ViewMut};
    use ferrotron_engine::Elem;
    use half::bf16;
    use std::ptr::NonNull;
    fn add<T: Elem>(k: &dyn Kernels<T, T>, acc: (*mut u8, usize, Memory), x: *mut u8) {
        let (p, n, m) = acc;
        let at = |p: *mut u8| NonNull::new(p.cast::<T>()).expect("device memory is never null");
        // SAFETY: `n` elements of `T` each (`Grads` of one type and length, checked by the
        // caller), this rank's device memory, borrowed for the call.
        let (acc, x) = unsafe {
            (
                ViewMut::from_raw_parts(at(p), n, m),
                View::from_raw_parts(at(x), n, m),
            )
        };
        k.add_inplace(acc, x);
    }
    Box::new(move |mut acc, mut x| {
        assert!(
            acc.dtype == x.dtype && acc.bytes() == x.bytes(),
            "internal: a shard's sum of another type or length"
        );
        let (to, from) = (acc.raw(), x.raw().0);
        match acc.dtype {
            DType::F32 => add::<f32>(&*k, to, from),
            DType::Bf16 => add::<bf16>(&*k, to, from),
            d => panic!("internal: {d:?} gradients summed on NCCL"),
        }
    })
}

/// Hands the exchanges of model group `what` (tensor parallelism's collectives, context
/// parallelism's ring, expert parallelism's all-to-alls) to NCCL on this rank's GPU when every
/// rank of the group can; `true` when it did. A collective over the group.
pub fn collectives_on_gpus(
    backend: &Backend,
    cfg: &TrainConfig,
    machine: &Machine,
    group: &Group,
    what: Dim,
) -> Result<bool> {
    let Some(ctx) = gpu_context(backend) else {
        return Ok(false);
    };
    if !agree(group.comm.as_ref(), cfg, machine, what)? {
        return Ok(false);
    }
    #[cfg(feature = "cuda")]
    group.collectives_on_device(Box::new(over(group, ctx, what)?));
    #[cfg(not(feature = "cuda"))]
    no_cuda(ctx)?;
    Ok(true)
}

#[cfg(feature = "cuda")]
type Context = std::sync::Arc<ferrotron_engine::kernels::cuda::cudarc::driver::CudaContext>;
#[cfg(not(feature = "cuda"))]
type Context = ();

/// The GPU's context behind `backend` (`None` off the GPU).
fn gpu_context(backend: &Backend) -> Option<Context> {
    #[cfg(feature = "cuda")]
    if let Backend::Cuda(k) = backend {
        return Some(k.gpu().ctx.clone());
    }
    let _ = backend;
    None
}

fn nccl_present() -> bool {
    #[cfg(feature = "cuda")]
    return ferrotron_dist::nccl::present();
    #[cfg(not(feature = "cuda"))]
    false
}

/// NCCL over `group`'s ranks, bootstrapped over a copy of its host communicator.
#[cfg(feature = "cuda")]
fn over(group: &Group, ctx: Context, what: Dim) -> Result<ferrotron_dist::nccl::Nccl> {
    let all: Vec<usize> = (0..group.size()).collect();
    over_members(group, &all, ctx, what)
}

/// NCCL over `members` of `group` (its ranks, in their order there), bootstrapped over a host
/// sub-group of them (every member calls it).
#[cfg(feature = "cuda")]
fn over_members(
    group: &Group,
    members: &[usize],
    ctx: Context,
    what: Dim,
) -> Result<ferrotron_dist::nccl::Nccl> {
    let name = name(what);
    let host = (group.comm.split_group(members))
        .map_err(|e| anyhow::anyhow!("{name}: a group for NCCL's bootstrap: {e}"))?;
    ferrotron_dist::nccl::Nccl::new(host, ctx).map_err(|e| anyhow::anyhow!("{name}: NCCL: {e}"))
}

/// Hands the pipeline's messages to NCCL between the stages' GPUs when every stage can (a
/// collective over the pipeline group): an NCCL communicator of two ranks per directed edge
/// this stage sends or receives on, made in the edges' one order on every stage, and the
/// program's send buffers on this GPU, `bytes` each (a boundary activation in the storage
/// type), for each direction it sends in. Returns the buffers' names and sizes for the plan
/// (`None`: the host's buffers stay).
pub fn messages_on_gpus(
    backend: &Backend,
    machine: &Machine,
    pp: &mut ferrotron_dist::pipeline::Pipeline,
    alloc: &std::sync::Arc<dyn ferrotron_engine::kernels::device_memory::DeviceAlloc>,
    bytes: usize,
) -> Result<Option<Vec<(String, u64)>>> {
    let Some(ctx) = gpu_context(backend) else {
        return Ok(None);
    };
    let why = |want| shared_obstacle(machine, want, nccl_present());
    if !agree_on(pp.group().comm.as_ref(), "pipeline parallel", why)? {
        return Ok(None);
    }
    #[cfg(feature = "cuda")]
    {
        use ferrotron_dist::pipeline::DeviceMessages;
        use ferrotron_engine::kernels::device_memory::DeviceBuf;
        let (me, k) = (pp.stage, pp.send_buffers() as usize);
        let mut gpus = DeviceMessages::default();
        let mut planned = Vec::new();
        for e in pp
            .edges()
            .into_iter()
            .filter(|e| e.from == me || e.to == me)
        {
            let mut edge = Box::new(over_members(
                pp.group(),
                &[e.from, e.to],
                ctx.clone(),
                Dim::Pp,
            )?);
            // Every event a step uses, made now.
            let (slots, receives) = match e.to == me {
                true => (0, pp.receives(e.dir)),
                false => (k, 0),
            };
            ferrotron_dist::device_p2p::DeviceP2p::reserve(&mut *edge, slots, receives)
                .map_err(|err| anyhow::anyhow!("pipeline parallel: NCCL: {err}"))?;
            if e.to == me {
                gpus.recvs[e.dir] = Some(edge);
                continue;
            }
            let dir = ["forward", "backward"][e.dir];
            let bufs = (0..k).map(|j| {
                planned.push((format!("comm.pp.device.send.{dir}.{j}"), bytes as u64));
                DeviceBuf::<u8>::zeros(alloc, bytes).map_err(anyhow::Error::msg)
            });
            gpus.sends[e.dir] = Some((edge as Box<_>, bufs.collect::<Result<_>>()?));
        }
        pp.messages_on_gpus(gpus);
        Ok(Some(planned))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (pp, alloc, bytes);
        no_cuda(ctx).map(|()| None)
    }
}

/// Without the cuda feature there is no GPU context: never reached.
#[cfg(not(feature = "cuda"))]
fn no_cuda(_: Context) -> Result<()> {
    bail!("internal: NCCL without the cuda feature")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::Device;
    use ferrotron_plan::Precision;

    fn machine(share: usize) -> Machine {
        Machine {
            device: Device::Cuda,
            peak_gflops: 0.0,
            gpu: 1,
            gpu_share: share,
        }
    }

    #[test]
    fn each_obstacle_to_nccl_is_named() {
        let mut cfg = crate::config::TrainArgs::default().resolve().unwrap();
        cfg.precision.kind = Precision::Fp32;
        let dp = Dim::Dp;
        assert_eq!(obstacle(&cfg, &machine(1), Want::Auto, true, dp), None);
        let one = |cfg: &TrainConfig, share, want, nccl| {
            obstacle(cfg, &machine(share), want, nccl, dp).expect("an obstacle")
        };
        assert!(one(&cfg, 2, Want::Auto, true).starts_with("2 ranks share GPU 1"));
        // Asked for, ranks sharing a GPU try (the emulator's libnccl takes them).
        assert_eq!(obstacle(&cfg, &machine(2), Want::Required, true, dp), None);
        assert!(one(&cfg, 1, Want::Auto, false).starts_with("NCCL is not found"));
        cfg.parallel.offload = Offload::Optimizer;
        assert_eq!(
            one(&cfg, 1, Want::Auto, true),
            "offload: the gradients are summed on the host"
        );
        cfg.parallel.offload = Offload::None;
        cfg.parallel.ep = 2;
        // Experts without replicas: held alone, the dense sums on NCCL.
        assert_eq!(obstacle(&cfg, &machine(1), Want::Auto, true, dp), None);
        // Experts with replicas: their sums on NCCL too, over the replicas' group.
        cfg.parallel.dp = 2;
        assert_eq!(obstacle(&cfg, &machine(1), Want::Auto, true, dp), None);
        // ZeRO-1 of both groups' segments, each into its owner's copy.
        cfg.parallel.zero = 1;
        assert_eq!(obstacle(&cfg, &machine(1), Want::Auto, true, dp), None);
        cfg.data.grad_acc = 2;
        (cfg.parallel.ep, cfg.parallel.dp) = (1, 2);
        // ZeRO-2 and 3, with gradient accumulation too: gathers and sums on NCCL.
        for z in [2, 3] {
            cfg.parallel.zero = z;
            assert_eq!(obstacle(&cfg, &machine(1), Want::Auto, true, dp), None);
        }
        // Tensor parallelism's collectives take any of these but fp16 activations.
        let tp = Dim::Tp;
        assert_eq!(obstacle(&cfg, &machine(1), Want::Auto, true, tp), None);
        cfg.precision.kind = Precision::Fp16;
        assert!(one(&cfg, 1, Want::Auto, true).starts_with("precision = fp16: fp16 gradients"));
        // The pipeline's ends sum gradients too (a tied embedding's).
        let e = obstacle(&cfg, &machine(1), Want::Auto, true, Dim::Pp).expect("an obstacle");
        assert!(e.starts_with("precision = fp16: fp16 gradients"), "{e}");
        let e = obstacle(&cfg, &machine(1), Want::Auto, true, tp).expect("an obstacle");
        assert_eq!(e, "precision = fp16: fp16 activations are summed through the group's host buffer; use bf16 or fp32");
        cfg.precision.kind = Precision::Bf16;
        let e = obstacle(&cfg, &machine(2), Want::Auto, true, tp).expect("an obstacle");
        assert!(e.starts_with("2 ranks share GPU 1"), "{e}");
    }
}
