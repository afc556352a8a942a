//! `--pp-layers auto`: the split of the layers over the pipeline stages that balances the
//! stages' times, within the memory limit.
//!
//! A stage's time per micro-batch is a line in its layer count (`time::stage_lines`): the
//! first stage adds the embedding, the last the final norm, the LM head and its
//! cross-entropy. The pipeline runs at the pace of its slowest stage (its steady state and
//! its bubble, Narayanan et al. 2021 §2.2), so the split minimises the slowest stage's time.
//! With identical layers that is greedy: each layer goes to the stage it leaves fastest
//! (list scheduling of identical jobs on machines that start at different times; placing a
//! layer anywhere else cannot lower the maximum). Llama 3 405B's hand-made split — one layer
//! fewer on the first and last of 16 stages (Llama Team 2024, arXiv 2407.21783 §3.3.2) — is
//! the kind of answer it gives.
//!
//! The memory limit: the first stage holds the most micro-batches in flight (p under 1F1B),
//! so a time-balanced split, lighter at the first stage, usually also lowers the peak. Where
//! the proposal does not fit but the GPU has room elsewhere, layers move one at a time from
//! the stage with the highest peak to the one with the lowest, while that lowers the highest
//! peak (a few full plans; the layout search uses the time-balanced split and its own fit
//! check).

use crate::cluster::Cluster;
use crate::error::{PlanError, Result};
use crate::inventory::inventory;
use crate::planner::{plan, ModelSource, PlanInput};
use crate::time::{stage_lines, TimeModel};

/// Layer counts per stage (`stages` lines of (fixed, per layer) seconds) that minimise the
/// slowest stage's time, `layers` in all.
pub fn balance_stages(lines: &[(f64, f64)], layers: u64) -> Vec<u64> {
    let mut n = vec![0u64; lines.len()];
    let time = |s: usize, k: u64| lines[s].0 + lines[s].1 * k as f64;
    for _ in 0..layers {
        // Ties go to the middle stages, then the earlier (a deterministic answer).
        let s = (0..lines.len())
            .min_by(|&a, &b| time(a, n[a] + 1).total_cmp(&time(b, n[b] + 1)))
            .expect("at least one stage");
        n[s] += 1;
    }
    n
}

/// Layers per stage, each stage holding at least one layer per model chunk (`v`, so no
/// chunk is empty, as `--pp-layers` requires of a split given by hand): the balance of what
/// is left once every chunk has its one. `layers` is at least `v` per stage (the layout's
/// validation says so first).
pub fn balance_with_floor(lines: &[(f64, f64)], layers: u64, v: u64) -> Vec<u64> {
    let floor: Vec<(f64, f64)> = lines.iter().map(|&(a, b)| (a + b * v as f64, b)).collect();
    let rest = layers.saturating_sub(v * lines.len() as u64);
    balance_stages(&floor, rest).iter().map(|n| n + v).collect()
}

/// Per model chunk counts (model order, chunk g on stage g mod p) from per-stage counts: a
/// stage's layers split as evenly as its `v` chunks allow, the earlier chunks taking the
/// remainder.
pub fn chunks_of(stages: &[u64], v: u64) -> Vec<u64> {
    let p = stages.len();
    let mut out = vec![0u64; p * v as usize];
    for (s, &n) in stages.iter().enumerate() {
        for c in 0..v {
            out[c as usize * p + s] = n / v + u64::from(c < n % v);
        }
    }
    out
}

/// The split `--pp-layers auto` proposes for `x` on `cluster` (pp counts, or pp × pp_virtual
/// with virtual stages), and the notes saying how it was chosen.
pub fn propose(x: &PlanInput, cluster: &Cluster) -> Result<(Vec<u64>, Vec<String>)> {
    let ModelSource::Spec(m) = &x.model else {
        return Err(PlanError::setting(
            "pp_layers",
            "auto",
            "proposing a split needs the model's layers (--model or --config, not --params)",
        ));
    };
    let l = &x.layout;
    if l.pp_first_layers.is_some() || l.pp_last_layers.is_some() {
        return Err(PlanError::setting(
            "pp_layers",
            "auto",
            "goes without --pp-first-layers/--pp-last-layers (auto chooses every stage's layers)",
        ));
    }
    // Everything but the split must be valid before the stages are priced: check it with a
    // near-even split (any layer count is).
    let even = (m.layers / l.pp, m.layers % l.pp);
    let near_even: Vec<u64> = (0..l.pp).map(|s| even.0 + u64::from(s < even.1)).collect();
    let mut y = x.clone();
    y.layout.pp_layers = chunks_of(&near_even, l.pp_virtual);
    y.recipe.validate()?;
    y.layout.validate(Some(m), &y.recipe)?;
    let tensors = inventory(m);
    let tm = TimeModel::new(m, &tensors);
    let lines = stage_lines(&tm, x, cluster);
    let mut stages = balance_with_floor(&lines, m.layers, l.pp_virtual);
    let time = |n: &[u64]| {
        n.iter()
            .zip(&lines)
            .map(|(&k, &(a, b))| a + b * k as f64)
            .fold(0.0, f64::max)
    };
    let mut notes = vec![format!(
        "--pp-layers auto: stage times balanced (embedding on the first, LM head and cross-entropy on the last): slowest stage {:.2} ms per micro-batch against {:.2} ms for the even one",
        time(&stages) * 1e3,
        time(&near_even) * 1e3
    )];
    let with = |n: &[u64]| {
        let mut y = x.clone();
        y.layout.pp_layers = chunks_of(n, l.pp_virtual);
        y
    };
    let capacity = cluster.gpu.capacity;
    let mut peaks: Vec<u64> = plan(&with(&stages))?.ranks.iter().map(|r| r.peak).collect();
    // Moves toward the memory limit, a few full plans at most.
    for _ in 0..8 {
        let (hi, lo) = match (argmax(&peaks), argmin(&peaks)) {
            (Some(h), Some(lo)) if h != lo => (h, lo),
            _ => break,
        };
        if peaks[hi] <= capacity || stages[hi] <= l.pp_virtual {
            break;
        }
        let mut moved = stages.clone();
        moved[hi] -= 1;
        moved[lo] += 1;
        let p2: Vec<u64> = plan(&with(&moved))?.ranks.iter().map(|r| r.peak).collect();
        if p2.iter().max() >= peaks.iter().max() {
            break;
        }
        notes.push(format!(
            "--pp-layers auto: moved a layer from stage {hi} to stage {lo} for memory (peak {:.2} → {:.2} GiB)",
            peaks[hi] as f64 / (1u64 << 30) as f64,
            p2.iter().max().copied().unwrap_or(0) as f64 / (1u64 << 30) as f64
        ));
        stages = moved;
        peaks = p2;
    }
    Ok((chunks_of(&stages, l.pp_virtual), notes))
}

fn argmax(v: &[u64]) -> Option<usize> {
    (0..v.len()).max_by_key(|&i| (v[i], std::cmp::Reverse(i)))
}

fn argmin(v: &[u64]) -> Option<usize> {
    (0..v.len()).min_by_key(|&i| (v[i], i))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavier_edges_get_fewer_layers_and_the_slowest_stage_is_as_fast_as_it_can_be() {
        // 126 layers of 1 s on 16 stages, the first and last 1 s heavier: 7, 8 × 14, 7.
        let mut lines = vec![(0.0, 1.0); 16];
        lines[0].0 = 1.0;
        lines[15].0 = 1.0;
        let n = balance_stages(&lines, 126);
        assert_eq!(n, [vec![7], vec![8; 14], vec![7]].concat());
        // No split of 126 does better than 8 s: every exchange of one layer is worse or equal.
        let worst = |n: &[u64]| {
            n.iter()
                .zip(&lines)
                .map(|(&k, &(a, b))| a + b * k as f64)
                .fold(0.0, f64::max)
        };
        for i in 0..16 {
            for j in 0..16 {
                if i != j && n[i] > 0 {
                    let mut m = n.clone();
                    m[i] -= 1;
                    m[j] += 1;
                    assert!(worst(&m) >= worst(&n));
                }
            }
        }
        // A head costing 2.5 layers: the last stage gets 2 or 3 fewer.
        let lines = [(0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (2.5, 1.0)];
        assert_eq!(balance_stages(&lines, 32), [9, 9, 8, 6]);
    }

    /// A head costing 7 layers on 4 stages of 8 layers: unbounded, the last stage would get
    /// none (a split `--pp-layers` refuses by hand); with the floor it keeps one per chunk.
    #[test]
    fn no_stage_is_left_without_a_layer_per_chunk() {
        let lines = [(0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (7.0, 1.0)];
        assert_eq!(balance_stages(&lines, 8), [3, 3, 2, 0]);
        assert_eq!(balance_with_floor(&lines, 8, 1), [3, 2, 2, 1]);
        assert_eq!(balance_with_floor(&lines, 8, 2), [2, 2, 2, 2]);
    }

    #[test]
    fn each_stage_splits_over_its_chunks_in_model_order() {
        // Stage 0 has 7 layers over 2 chunks (4 + 3), stage 1 8 (4 + 4): chunks 0, 1, 2, 3
        // sit on stages 0, 1, 0, 1.
        assert_eq!(chunks_of(&[7, 8], 2), [4, 4, 3, 4]);
        assert_eq!(chunks_of(&[7, 8], 1), [7, 8]);
    }
}
