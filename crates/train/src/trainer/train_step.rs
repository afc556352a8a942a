//! One optimizer step as the run sees it: the peak counters and the trace opened, the
//! gradients and the planned communication buffers allocated with the first step, the typed
//! step (`step.rs`) on the weights where they live (host or device), and the metrics: measured
//! against planned peaks over every rank, tokens/s, MFU and HFU, each dimension's bytes.

use super::*;
use ferrotron_engine::kernels::DeviceOps;
use ferrotron_plan::state_regions::{grads_len, GRADS};

impl Trainer {
    /// One optimizer step over `grad_acc` micro-batches.
    pub fn train_step(&mut self) -> Result<StepOutput> {
        let planned = self.begin_step();
        let ops0 = self.device_ops();
        let t0 = Instant::now();
        let step = self.step + 1;
        ferrotron_dist::watchdog::set_step(self.world_rank(), step);
        stall_if_asked(self.world_rank(), step);
        fail_if_asked(self.world_rank(), step)?;
        self.allocate_step_buffers(step)?;
        let ran_with = self.scaler.as_ref().map(|s| s.scale);
        let stepped = self.step_where_the_state_is(step)?;
        let k = &self.kernels;
        // A GPU's step ends when its last kernel does.
        Kernels::<f32>::synchronize(k);
        k.phase("step", t0, step, 0);
        // Traced on a GPU: each op's time on the device, from its events.
        k.device_spans(step);
        self.step += 1;
        let secs = t0.elapsed().as_secs_f64();
        let ops = (self.device_ops().zip(ops0)).map(|(now, then)| now.since(&then).report());
        let mut out = self.step_output(stepped, planned, secs, ran_with)?;
        out.metrics.device_ops = ops;
        Ok(out)
    }

    /// What the GPU's backend has asked of its driver so far, where it counts (`device_ops`).
    fn device_ops(&self) -> Option<DeviceOps> {
        self.device_alloc.as_ref().and_then(|d| d.ops())
    }

    /// Resets the peak counters and opens (or closes) the trace for the step; returns the
    /// step's planned peak.
    fn begin_step(&mut self) -> u64 {
        alloc::reset_peak();
        if let Some(d) = &self.device_alloc {
            d.reset_peak();
        }
        self.step_transfer();
        if self.trace_left > 0 {
            self.trace_left -= 1;
            self.kernels.start(0);
        } else {
            self.kernels.stop();
        }
        self.planned_peak[self.has_opt() as usize]
    }

    /// Gradients appear before the first forward (the fused LM head accumulates into them),
    /// and with them the plan's communication buffers. Their length is the plan's (the rank's
    /// gradients, its ZeRO shard or none when streamed, and the windows after them); on the
    /// host they are its gradients' region, on a device the device allocator's.
    fn allocate_step_buffers(&mut self, step: u64) -> Result<()> {
        let no_grads = match &self.dev {
            Some(d) => d.grads.is_none(),
            None => self.grads.is_none(),
        };
        if !no_grads {
            return Ok(());
        }
        let gt = self.cfg.precision.kind.engine_grads();
        let len = grads_len(&self.plan.plan) as usize;
        match (&mut self.dev, &self.device_alloc) {
            (Some(d), Some(a)) => d.grads = Some(DevFlat::zeros(a, gt, len)?),
            _ => {
                let planned = Flat::carve(&mut self.grad_region, gt, GRADS[0]);
                self.grads = Some(planned.expect("internal: the memory plan has no gradients"));
            }
        }
        // The plan's `comm.dp.grad_buckets` (and ZeRO-3's `comm.zero3.gather`) appear with the
        // gradients, in the resident region (allocated with the first of them).
        let r = &mut self.resident;
        if let Some(dp) = &mut self.mesh.dp {
            dp.allocate(&mut |name, parts| {
                r.carve(name, parts).unwrap_or_else(|| {
                    panic!("internal: data parallelism needs `{name}`, which the memory plan does not have")
                })
            });
        }
        // The model groups' buffers (tensor parallelism's staging, the expert and context
        // parallel messages, a device ring's receive staging), as planned.
        self.mesh
            .allocate(&mut |name| r.carve(name, 1).map(|mut v| v.remove(0)));
        self.allocate_pipeline();
        self.pool.sample(step, Point::Grads);
        Ok(())
    }

    /// The typed step on the weights and gradients where they live. The typed buffers leave
    /// `self` for the step (moving a Vec moves no memory).
    fn step_where_the_state_is(&mut self, step: u64) -> Result<Stepped> {
        match self.dev.as_mut() {
            Some(d) => {
                let mut params = d.params.take().expect("the weights are on the device");
                let mut grads = d.grads.take().expect("gradients exist");
                grads.zero();
                if let Some(g) = &mut self.graph {
                    g.begin_step([params.addr(), grads.addr()], self.kernels.is_on());
                }
                let r = with_dev_types!(&mut params, &mut grads, |p, g| {
                    self.step_typed(step, p.view_mut(), g.view_mut())
                });
                let d = self.dev.as_mut().expect("still on the device");
                (d.params, d.grads) = (Some(params), Some(grads));
                r
            }
            None => {
                let mut params = std::mem::replace(&mut self.params, Flat::F32(Region::default()));
                let mut grads = self.grads.take().expect("gradients exist");
                grads.fill_zero();
                let r = with_flat_types!(&mut params, &mut grads, |p, g| {
                    self.step_typed(step, p.view_mut(), g.view_mut())
                });
                self.params = params;
                self.grads = Some(grads);
                r
            }
        }
    }

    /// What the step did, with every rank's memory and each dimension's communication.
    fn step_output(
        &mut self,
        stepped: Stepped,
        planned: u64,
        secs: f64,
        ran_with: Option<f32>,
    ) -> Result<StepOutput> {
        let Stepped {
            loss,
            grad_norm,
            lr,
            overflow,
            non_finite,
        } = stepped;
        // A GPU's memory is counted by its allocator (the state, the arena) plus the backend's
        // workspace; the host's (and an emulated device's) by the tracking allocator.
        let measured = match self.device_alloc.as_ref().and_then(|d| d.peak()) {
            Some(peak) => peak + self.plan.overhead,
            None => alloc::peak().saturating_sub(self.baseline),
        };
        let mut rank_mem = Vec::new();
        let all = self
            .mesh
            .gather_mem([planned, measured, self.plan.overhead])?;
        let (mut planned_max, mut measured_max) = (planned, measured);
        if let Some(all) = &all {
            rank_mem = rank_mems(all);
            planned_max = all.iter().map(|r| r[0]).max().unwrap_or(planned);
            measured_max = all.iter().map(|r| r[1]).max().unwrap_or(measured);
        }
        let (kernels, step) = (&self.kernels, self.step);
        let mut span = |name, a, b| kernels.comm(name, a, b, step);
        let comm = self
            .mesh
            .take_step_comm(self.cfg.data.grad_acc, &mut span)?;
        let tokens = self.global_batch_tokens();
        let tps = tokens as f64 / secs;
        // Every rank has this machine's peak: MFU is against all of them.
        let peak = self.peak_flops * (self.ranks() * self.mesh.model_ranks()) as f64;
        let mfu = tps * self.flops_per_token / peak;
        Ok(StepOutput {
            tokens,
            overflow,
            non_finite,
            metrics: StepMetrics {
                step: self.step,
                loss: loss.mean(),
                lr,
                grad_norm,
                tokens_per_s: tps,
                mfu,
                // HFU counts the recomputed FLOPs, MFU does not.
                hfu: tps * self.hw_flops_per_token / peak,
                step_ms: secs * 1e3,
                mem_peak_measured: measured_max,
                mem_peak_planned: planned_max,
                mem_device_driver: self.device_alloc.as_ref().and_then(|d| d.driver_used()),
                device_ops: None,
                val_loss: None,
                loss_scale: ran_with,
                skipped: overflow.is_some() || non_finite,
                rank_mem,
                comm: comm.comm,
                comm_exposed_ms: comm.exposed_ms,
                host_transfer: self.step_transfer(),
                pp_bubble: comm.bubble,
                pp_bubble_planned: comm.bubble_planned,
                gemm: self.gemm.clone(),
            },
        })
    }
}
