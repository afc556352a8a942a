//! The optimizer's side of a step: the learning-rate schedule, the fp16 loss scale, and the
//! update itself (the global gradient norm ([`grad_norm`]), clipping, AdamW: [`step`]).

pub mod disk_io;
pub mod disk_states;
pub mod grad_norm;
pub mod host_tier;
pub mod loss_scale;
pub mod lr;
pub mod offload;
mod offload_copies;
pub mod step;
