//! ZeRO (Rajbhandari et al. 2020): the optimizer states, gradients and parameters sharded over
//! the data-parallel replicas. ZeRO-1 (P_os) is the data-parallel reduction that
//! reduce-scatters into the rank's shard and all-gathers the updated weights
//! (`crate::data_parallel`: `Shard`, `Gather`); ZeRO-2 (P_os+g) keeps only the shard of the
//! reduced gradients, summed over micro-batches through per-layer windows ([`zero2`]); ZeRO-3
//! (P_os+g+p) also shards the parameters and all-gathers each unit into a window before the
//! model reads it ([`zero3`]).

pub mod zero2;
pub mod zero3;
