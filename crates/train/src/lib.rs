//! ferrotron-train: the single-rank trainer (data, loop, checkpoints, sampling, metrics).

pub mod alloc;
pub mod arena;
pub mod checkpoint;
pub mod config;
pub mod data;
pub mod data_parallel;
pub mod eval;
pub mod expert_parallel;
pub mod heap;
pub mod loss_scale;
pub mod lr;
pub mod metrics;
pub mod pipeline;
pub mod pool;
pub mod report;
pub mod run;
pub mod sample;
pub mod setup;
pub mod tensor_parallel;
pub mod timeline;
pub mod trace;
pub mod trainer;
pub mod weights;
pub mod workspace;
pub mod zero2;
pub mod zero3;
