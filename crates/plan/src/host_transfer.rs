//! Bytes an offloading rank copies between host and device memory in one training step, by
//! the trainer's schedule (what its copies count, `crates/train`'s `trainer/host_transfer`):
//! - `--offload optimizer` (ZeRO-Offload, Ren et al. 2021 §4): the update reads every
//!   gradient down to the host once per step, and writes the updated weights back up; without
//!   fp32 master weights the weights themselves are the optimizer's, so they come down too
//!   (`optim/offload.rs`'s staging, bucket by bucket);
//! - `--offload params` (ZeRO-Infinity, Rajbhandari et al. 2021 §5.1): every unit's weights
//!   go up as ZeRO-3's schedule asks for them (the embedding and the head once per step, each
//!   layer as often as [`layer_gathers_per_step`] says), every unit's gradients come down
//!   after each micro-batch's backward, and from the second micro-batch on the running sums go
//!   back up before it (the first starts from zeroed windows, which moves nothing). The
//!   optimizer then runs on host memory: nothing more moves.
//!
//! (The time model, `time/param_stream.rs`, charges 2P weights per micro-batch, an upper
//! bound of the schedule's uploads.)

use crate::zero3::{layer_gathers_per_step, Unit};

/// Bytes up (host → device) and down (device → host) in one step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostTransfer {
    pub up: u64,
    pub down: u64,
}

/// `--offload optimizer` on a device: `elems` optimizer elements, gradients of `grad_bytes`
/// and weights of `storage_bytes` each, with or without `master` weights.
pub fn optimizer(elems: u64, grad_bytes: u64, storage_bytes: u64, master: bool) -> HostTransfer {
    let weights_down = if master { 0 } else { storage_bytes };
    HostTransfer {
        up: elems * storage_bytes,
        down: elems * (grad_bytes + weights_down),
    }
}

/// `--offload params` on one device holding the whole model's `units` (ZeRO-3's units and
/// their elements), over `micro_batches`.
pub fn params(
    units: &[(Unit, u64)],
    micro_batches: u64,
    grad_bytes: u64,
    storage_bytes: u64,
) -> HostTransfer {
    let layers: Vec<u64> = units
        .iter()
        .filter(|u| matches!(u.0, Unit::Layer(_)))
        .map(|u| u.1)
        .collect();
    let gathers = layer_gathers_per_step(layers.len(), micro_batches);
    let ends: u64 = (units.iter())
        .filter(|u| !matches!(u.0, Unit::Layer(_)))
        .map(|u| u.1)
        .sum();
    let layer_uploads: u64 = gathers.iter().zip(&layers).map(|(k, n)| k * n).sum();
    let all: u64 = units.iter().map(|u| u.1).sum();
    HostTransfer {
        up: storage_bytes * (ends + layer_uploads) + (micro_batches - 1) * grad_bytes * all,
        down: micro_batches * grad_bytes * all,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_optimizer_moves_gradients_down_and_weights_up_once() {
        // bf16 weights with fp32 master weights and fp32 gradients: 4 B down, 2 B up a param.
        assert_eq!(
            optimizer(1000, 4, 2, true),
            HostTransfer {
                up: 2000,
                down: 4000
            }
        );
        // fp32 without master weights: the weights come down too.
        assert_eq!(
            optimizer(1000, 4, 4, false),
            HostTransfer {
                up: 4000,
                down: 8000
            }
        );
    }

    #[test]
    fn streamed_units_go_up_by_the_schedule_and_gradients_both_ways_after_the_first() {
        // An embedding of 100, two layers of 10, a head of 1; bf16 weights, fp32 gradients.
        let units = [
            (Unit::Embedding, 100),
            (Unit::Layer(0), 10),
            (Unit::Layer(1), 10),
            (Unit::Head, 1),
        ];
        // One micro-batch: forward 0 (gathered), 1 (prefetched); backward 1 and 0 still in
        // the two windows: each layer once. Ends once: 2 × (101 + 20) up; 4 × 121 down.
        assert_eq!(layer_gathers_per_step(2, 1), vec![1, 1]);
        assert_eq!(params(&units, 1, 4, 2), HostTransfer { up: 242, down: 484 });
        // Three micro-batches: the layers as the schedule gathers them, the ends still once;
        // the gradient sums up twice, down three times.
        let g = layer_gathers_per_step(2, 3);
        let layers = 10 * (g[0] + g[1]);
        assert_eq!(
            params(&units, 3, 4, 2),
            HostTransfer {
                up: 2 * (101 + layers) + 2 * 4 * 121,
                down: 3 * 4 * 121
            }
        );
    }
}
