//! The trainer's state on a device (`--device cuda`, or the emulated device of the tests):
//! weights, master weights, gradients, Adam's moments and the micro-batch's token ids, each
//! one allocation of the device's memory. The host keeps none of them while training; a
//! checkpoint or a sample copies them back for the moment it needs them
//! (`Trainer::with_host_state`).

use crate::weights::Flat;
use anyhow::{anyhow, Result};
use ferrotron_engine::kernels::{DeviceAlloc, DeviceBuf};
use ferrotron_plan::DType;
use half::{bf16, f16};
use std::sync::Arc;

/// A flat buffer (weights or gradients) in device memory, in its storage type.
pub enum DevFlat {
    F32(DeviceBuf<f32>),
    Bf16(DeviceBuf<bf16>),
    F16(DeviceBuf<f16>),
}

fn dev_err(e: String) -> anyhow::Error {
    anyhow!("device memory: {e}")
}

impl DevFlat {
    pub fn from_host(dev: &Arc<dyn DeviceAlloc>, host: &Flat) -> Result<DevFlat> {
        Ok(match host {
            Flat::F32(v) => DevFlat::F32(DeviceBuf::from_host(dev, v).map_err(dev_err)?),
            Flat::Bf16(v) => DevFlat::Bf16(DeviceBuf::from_host(dev, v).map_err(dev_err)?),
            Flat::F16(v) => DevFlat::F16(DeviceBuf::from_host(dev, v).map_err(dev_err)?),
        })
    }

    pub fn zeros(dev: &Arc<dyn DeviceAlloc>, dtype: DType, n: usize) -> Result<DevFlat> {
        Ok(match dtype {
            DType::Bf16 => DevFlat::Bf16(DeviceBuf::zeros(dev, n).map_err(dev_err)?),
            DType::F16 => DevFlat::F16(DeviceBuf::zeros(dev, n).map_err(dev_err)?),
            _ => DevFlat::F32(DeviceBuf::zeros(dev, n).map_err(dev_err)?),
        })
    }

    pub fn to_host(&self) -> Flat {
        match self {
            DevFlat::F32(b) => Flat::F32(b.to_host().into()),
            DevFlat::Bf16(b) => Flat::Bf16(b.to_host().into()),
            DevFlat::F16(b) => Flat::F16(b.to_host().into()),
        }
    }

    /// The buffer's device address (where a captured graph found it).
    pub fn addr(&self) -> usize {
        match self {
            DevFlat::F32(b) => b.view().as_ptr() as usize,
            DevFlat::Bf16(b) => b.view().as_ptr() as usize,
            DevFlat::F16(b) => b.view().as_ptr() as usize,
        }
    }

    pub fn zero(&mut self) {
        match self {
            DevFlat::F32(b) => b.zero(),
            DevFlat::Bf16(b) => b.zero(),
            DevFlat::F16(b) => b.zero(),
        }
    }
}

/// Runs `$body` with `$p` and `$g` bound to the typed device buffers of a weight and a
/// gradient [`DevFlat`] (as `with_flat_types!` does for host buffers).
#[macro_export]
macro_rules! with_dev_types {
    ($params:expr, $grads:expr, |$p:ident, $g:ident| $body:expr) => {{
        use $crate::device::state::DevFlat;
        match ($params, $grads) {
            (DevFlat::F32($p), DevFlat::F32($g)) => $body,
            (DevFlat::Bf16($p), DevFlat::Bf16($g)) => $body,
            (DevFlat::Bf16($p), DevFlat::F32($g)) => $body,
            (DevFlat::F16($p), DevFlat::F16($g)) => $body,
            _ => unreachable!("no precision pairs these weight and gradient types"),
        }
    }};
}

/// Everything the trainer keeps on the device.
/// (Its memory is the trainer's `device_alloc`.)
pub struct DeviceState {
    /// The weights (out of it while a step or an evaluation runs on them).
    pub params: Option<DevFlat>,
    pub master: Option<DeviceBuf<f32>>,
    /// Created by the first step, as on the host.
    pub grads: Option<DevFlat>,
    /// Adam's first and second moments, from the first optimizer step on.
    pub opt: Option<(DeviceBuf<f32>, DeviceBuf<f32>)>,
    /// The micro-batch's token ids and targets, copied in from the loader's.
    pub tokens: DeviceBuf<u32>,
    pub targets: DeviceBuf<u32>,
}
