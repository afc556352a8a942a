//! Which system runs a step's communication. The memory convention (`convention.rs`) says
//! whose kernels run and which buffers they hold; the runtime says whose data-parallel and
//! pipeline machinery moves the tensors between ranks, and so which collectives a step issues
//! and which communication buffers it allocates. They differ when ferrotron's kernels are
//! costed under another system's communication: llm-foundry's MPT runs (PyTorch FSDP, costed
//! with the engine's fused kernels and flash attention in `tests/measured_runs.rs`).

use crate::convention::Convention;
use crate::error::{PlanError, Result};
use std::fmt;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// ferrotron's trainer (`crates/train`): gradients reduced through two f32 buckets (ZeRO-1/2:
    /// reduce-scattered, ZeRO-2 through its gradient windows), its own ZeRO-3 schedule
    /// (`zero3.rs`: two layer windows, a layer gathered only when no window holds it), tensor
    /// parallelism through one f32 staging buffer, its pipeline's per-slot buffers and f32 send
    /// buffers, one f32 message buffer for context and expert parallelism. Runs only ferrotron's
    /// engine, so only under the `ferrotron` convention.
    Ferrotron,
    /// ferrotron's trainer with the model's tensors on a device (`--device emulated`, a GPU):
    /// the same buffers, all of them host staging, and one more: the context-parallel ring
    /// receives into a second message buffer (`comm.cp.receive`), because the planned one is
    /// the send's, in flight meanwhile (on the host a block is received in place).
    FerrotronDevice,
    /// The framework the convention describes, as the planner models frameworks: PyTorch DDP's
    /// gradient buckets, ZeRO-3 as FSDP and DeepSpeed run it (every micro-batch gathers each
    /// unit for its forward and again for its backward and reduce-scatters its gradients: ZeRO
    /// paper §7.2.2), the framework's own send/receive and exchange buffers. Under the
    /// `ferrotron` convention: the engine's kernels under PyTorch FSDP/DDP.
    Framework,
}

impl Runtime {
    /// ferrotron's own trainer, on the host or on a device.
    pub fn is_trainer(self) -> bool {
        matches!(self, Runtime::Ferrotron | Runtime::FerrotronDevice)
    }

    /// The runtime a convention means when none is named (the CLI, the API, the layout
    /// search): ferrotron's trainer under its own convention, the convention's framework
    /// under every other.
    pub fn of(conv: Convention) -> Runtime {
        match conv {
            Convention::Ferrotron => Runtime::Ferrotron,
            _ => Runtime::Framework,
        }
    }

    /// ferrotron's trainer executes ferrotron's engine only.
    pub fn validate(self, conv: Convention) -> Result<()> {
        if self.is_trainer() && conv != Convention::Ferrotron {
            return Err(PlanError::setting(
                "runtime",
                self,
                format!(
                    "ferrotron's trainer runs only the ferrotron convention's engine, not `{conv}`; use the framework runtime"
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Runtime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Runtime::Ferrotron => "ferrotron",
            Runtime::FerrotronDevice => "ferrotron on a device",
            Runtime::Framework => "framework",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_convention_means_its_own_runtime_and_the_trainer_runs_only_its_engine() {
        for c in Convention::ALL {
            assert!(Runtime::of(c).validate(c).is_ok(), "{c}");
            assert!(Runtime::Framework.validate(c).is_ok(), "{c}");
            for t in [Runtime::Ferrotron, Runtime::FerrotronDevice] {
                assert_eq!(t.validate(c).is_ok(), c == Convention::Ferrotron, "{t} {c}");
            }
        }
        assert_eq!(Runtime::of(Convention::Ferrotron), Runtime::Ferrotron);
        assert_eq!(Runtime::of(Convention::Torchtitan), Runtime::Framework);
    }
}
