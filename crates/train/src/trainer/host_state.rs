//! Where the weights, master weights and optimizer states live: on the host, or (`--device`)
//! moved to the device once initialised or loaded, and copied back for what reads them on the
//! host (a checkpoint, a sample).

use super::*;
use ferrotron_plan::Offload;

impl Trainer {
    /// Whether Adam's moments exist (from the first optimizer step on), wherever they live.
    pub(super) fn has_opt(&self) -> bool {
        if let Some(o) = &self.offload {
            return o.has_moments();
        }
        match &self.dev {
            Some(d) => d.opt.is_some(),
            None => self.opt.is_some(),
        }
    }

    /// Moves the weights, master weights and any optimizer states to the device the run
    /// chose (nothing on the CPU): called once they are initialised or loaded. From then on
    /// the host holds none of them, as it would not on a GPU.
    /// The state then is where it stays (the offload tier included): the first sample of the
    /// memory timeline.
    ///
    /// On a device the weights go first, and their host copy is freed before the offload
    /// tier takes its host memory: the two never coexist (they did: 2 bytes a weight over the
    /// tier in bf16, 2.5 GB for a 1B model).
    pub fn to_device(&mut self) -> Result<()> {
        use crate::observe::host_rss::mark;
        let params = self.upload_weights()?;
        mark("weights on the device");
        self.offload_states()?;
        mark("offload tier built");
        self.move_to_device(params)?;
        mark("states on the device");
        self.pool.sample(1, Point::Init);
        Ok(())
    }

    /// The weights on the device, their host copy freed (`None`: on the CPU, or streamed by
    /// `--offload params`, which keeps them on the host).
    fn upload_weights(&mut self) -> Result<Option<DevFlat>> {
        let Some(alloc) = self.device_alloc.clone() else {
            return Ok(None);
        };
        if self.cfg.parallel.offload == Offload::Params {
            return Ok(None);
        }
        let params = DevFlat::from_host(&alloc, &self.params)?;
        self.params = Flat::zeros(self.params.dtype(), 0);
        Ok(Some(params))
    }

    fn move_to_device(&mut self, params: Option<DevFlat>) -> Result<()> {
        let Some(alloc) = self.device_alloc.clone() else {
            return Ok(());
        };
        let n = self.tokens.len();
        let e = anyhow::Error::msg;
        // Streamed (`--offload params`), the device holds only the windows units are
        // uploaded into.
        let params = Some(match (params, &self.streaming) {
            (Some(p), _) => p,
            (None, Some(s)) => DevFlat::zeros(&alloc, self.params.dtype(), s.param_windows())?,
            (None, None) => DevFlat::from_host(&alloc, &self.params)?,
        });
        let master = (self.master.take())
            .map(|m| DeviceBuf::from_host(&alloc, &m).map_err(e))
            .transpose()?;
        let opt = (self.opt.take())
            .map(|o| -> Result<_> {
                let m = DeviceBuf::from_host(&alloc, &o.m).map_err(e)?;
                Ok((m, DeviceBuf::from_host(&alloc, &o.v).map_err(e)?))
            })
            .transpose()?;
        self.params = Flat::zeros(self.params.dtype(), 0);
        self.dev = Some(DeviceState {
            params,
            master,
            grads: None,
            opt,
            tokens: DeviceBuf::zeros(&alloc, n).map_err(e)?,
            targets: DeviceBuf::zeros(&alloc, n).map_err(e)?,
        });
        Ok(())
    }

    /// Runs `f` with the weights, master weights and optimizer states on the host (copied
    /// from the device for it, and dropped after, when the run is on one): a checkpoint or a
    /// sample reads them there.
    /// With `--offload optimizer` the master weights and moments are read from the offload
    /// tier (from disk with `--offload-dir`) into host vectors for it, and dropped after.
    pub fn with_host_state<R>(&mut self, f: impl FnOnce(&mut Trainer) -> Result<R>) -> Result<R> {
        self.with_device_state_on_host(|t| {
            let Some(o) = &t.offload else {
                return f(t);
            };
            let (master, opt) = o.to_host()?;
            (t.master, t.opt) = (master.map(Region::from), opt);
            let r = f(t);
            (t.master, t.opt) = (None, None);
            r
        })
    }

    fn with_device_state_on_host<R>(&mut self, f: impl FnOnce(&mut Trainer) -> R) -> R {
        let Some(d) = &self.dev else {
            return f(self);
        };
        let dtype = self.params.dtype();
        self.params = match &mut self.streaming {
            Some(s) => s.to_flat(),
            None => d
                .params
                .as_ref()
                .expect("the weights are on the device")
                .to_host(),
        };
        self.master = d.master.as_ref().map(|m| m.to_host().into());
        self.opt = (d.opt.as_ref()).map(|(m, v)| AdamState {
            m: m.to_host().into(),
            v: v.to_host().into(),
        });
        let r = f(self);
        self.params = Flat::zeros(dtype, 0);
        (self.master, self.opt) = (None, None);
        r
    }

    /// Data parallelism's gradient sum and the model groups' exchanges (tensor parallelism's
    /// collectives, context parallelism's ring, expert parallelism's all-to-alls) through NCCL
    /// on each rank's GPU, where every rank of the group can (`device::nccl`), each said once on
    /// stderr, by world rank 0 (a member of one group of each kind: with several groups of a
    /// kind, their ranks said it as many times).
    pub(super) fn nccl_groups(&mut self, machine: &crate::device::Machine) -> Result<()> {
        use crate::device::nccl;
        use ferrotron_dist::watchdog;
        // Each group's NCCL bootstrap waits under the watchdog as its group; the step's waits on
        // the GPU (its host synchronisations, its NCCL calls) as every group on NCCL.
        let mut on = Vec::new();
        let rank = self.world_rank();
        let joining = |d: Dim| watchdog::watch_gpu(rank, d.name());
        let backend = &self.kernels.inner;
        if let Some(dp) = self.mesh.dp.as_mut() {
            joining(Dim::Dp);
            if nccl::reduce_on_gpus(backend, &self.cfg, machine, dp)? {
                on.push(Dim::Dp.name());
                if rank == 0 {
                    let line = match self.cfg.parallel.zero {
                        2 => "data parallel: ZeRO-2's gradients summed into each owner's shard by NCCL on each rank's GPU, each window's before it is reused",
                        3 => "data parallel: ZeRO-3's weights gathered into their windows from each owner's shard by NCCL on each rank's GPU, a layer ahead; its gradients summed into each owner's shard",
                        _ => "data parallel: gradients summed in place by NCCL on each rank's GPU, overlapping the backward",
                    };
                    eprintln!("{line}");
                }
                let width = self.cfg.precision.kind.engine_grads().bytes();
                self.mesh.sums_in(Dim::Dp, width);
            }
        }
        if let Some(tp) = self.mesh.group(Dim::Tp).cloned() {
            joining(Dim::Tp);
            if nccl::collectives_on_gpus(backend, &self.cfg, machine, &tp, Dim::Tp)? {
                on.push(Dim::Tp.name());
                if rank == 0 {
                    eprintln!("tensor parallel: the activations' collectives run on each rank's GPU by NCCL");
                }
                let width = self.cfg.precision.kind.storage().bytes();
                self.mesh.sums_in(Dim::Tp, width);
            }
        }
        let said = [
            (Dim::Cp, "context parallel: the ring's blocks pass between the ranks' GPUs by NCCL, beside the attention"),
            (Dim::Ep, "expert parallel: the routed rows' all-to-alls run between the ranks' GPUs by NCCL"),
        ];
        for (d, line) in said {
            if let Some(g) = self.mesh.group(d).cloned() {
                joining(d);
                if nccl::collectives_on_gpus(backend, &self.cfg, machine, &g, d)? {
                    on.push(d.name());
                    if rank == 0 {
                        eprintln!("{line}");
                    }
                }
            }
        }
        // The first and last pipeline stages' sum of a tied embedding's gradient.
        if let Some(g) = self.mesh.pp.as_ref().and_then(|p| p.embedding_group()) {
            joining(Dim::Pp);
            if nccl::collectives_on_gpus(backend, &self.cfg, machine, g, Dim::Pp)? {
                on.push("embedding");
                if rank == 0 {
                    eprintln!("pipeline parallel: the tied embedding's gradient summed over the first and last stages by NCCL, in place on their GPUs");
                }
            }
        }
        // The stages' messages, each directed edge between two GPUs by NCCL, from planned
        // device send buffers (a boundary activation each, in the storage type).
        let boundary = self.plan.plan.find("comm.pp.recv").map(|b| b.numel);
        if let (Some(pp), Some(alloc), Some(n)) =
            (self.mesh.pp.as_mut(), self.device_alloc.clone(), boundary)
        {
            joining(Dim::Pp);
            let bytes = (n * self.cfg.precision.kind.storage().bytes()) as usize;
            if let Some(planned) = nccl::messages_on_gpus(backend, machine, pp, &alloc, bytes)? {
                on.push("pipeline messages");
                if rank == 0 {
                    eprintln!("pipeline parallel: the stages' messages pass between their GPUs by NCCL, one communicator per directed edge");
                }
                for (name, bytes) in planned {
                    self.plan_persistent(&name, bytes);
                }
            }
        }
        match on.is_empty() {
            true => watchdog::unwatch_gpu(),
            false => watchdog::watch_gpu(rank, &on.join(", ")),
        }
        Ok(())
    }

    /// The run's memory is the device's (`None`: the host's): the arena allocates there.
    pub(super) fn place_on(&mut self, device_alloc: Option<Arc<dyn DeviceAlloc>>) {
        if let (Some(d), Some(a)) = (&device_alloc, &mut self.pool.arena) {
            a.on_device(d.clone());
        }
        // Data parallelism's buckets stage the device's gradients through the host.
        if let (Some(d), Some(dp)) = (&device_alloc, &mut self.mesh.dp) {
            dp.on_device(crate::device::ranks::HostCopy::new(d.clone()));
        }
        // So do the model groups' planned buffers (tensor and context parallelism) and the
        // pipeline's send and receive buffers.
        if let Some(d) = &device_alloc {
            let copy = crate::device::ranks::HostCopy::new(d.clone());
            if let Some(pp) = &mut self.mesh.pp {
                pp.on_device(copy.clone());
            }
            self.mesh.on_device(&copy);
        }
        self.device_alloc = device_alloc;
    }
}
