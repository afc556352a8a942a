//! The optimizer's side of a step: the learning-rate schedule, the fp16 loss scale, and the
//! update itself (the global gradient norm, clipping, AdamW: [`step`]).

pub mod loss_scale;
pub mod lr;
pub mod step;
