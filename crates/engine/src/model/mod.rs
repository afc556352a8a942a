//! Models built on the [`crate::kernels::Kernels`] trait.

pub mod activations;
pub mod buffers;
pub mod config;
pub mod context_parallel;
pub mod expert_parallel;
pub mod grad_buf;
pub mod kv_cache;
pub mod llama;
pub mod moe;
pub mod param_buf;
pub mod params;
pub mod pipeline;
pub mod recompute;
pub mod spares;
pub mod stages;
pub mod tensor_parallel;

pub use activations::{Activations, BatchShape, LayerActs, LossSum};
pub use buffers::{Boundary, Buf, BufName, BufferPool, HeapPool, PoolEvent, BUF_ALIGN};
pub use config::{LlamaConfig, ModelError, MoeConfig};
pub use context_parallel::{ContextParallel, CpComm};
pub use expert_parallel::{EpComm, ExpertParallel};
pub use grad_buf::{two_mut, GradBuf, Whole};
pub use kv_cache::KvCache;
pub use llama::{Llama, DEFAULT_CE_CHUNK_TOKENS};
pub use param_buf::{ParamBuf, ParamSource, Unit, WholeParams};
pub use params::{LayerIdx, ParamTable, Placement, TensorEntry};
pub use pipeline::{Part, PartRef, Stage};
pub use recompute::Recompute;
pub use stages::{BackwardState, GradsDone, HeadActs};
pub use tensor_parallel::{DeviceOperands, TensorParallel, TpComm};
