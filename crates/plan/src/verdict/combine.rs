//! Planning the candidate changes, alone and combined (when no single change fits a group).

use super::change::{candidates, Knob};
use super::flags::{changed, to_flags};
use crate::planner::{plan, plan_extremes, PlanInput};
use std::collections::HashSet;

/// The most changes combined into one option.
const MAX_CHANGES: usize = 3;
/// Configurations of each size expanded to the next (the lowest peaks): bounds the planning
/// work to a few dozen plans per size, whatever the number of candidates.
const BEAM: usize = 8;

/// Whether an option runs on the GPUs the user has or needs more. No candidate removes GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Gpus {
    Same,
    More,
}

impl Gpus {
    pub(super) fn of(x: &PlanInput, y: &PlanInput) -> Gpus {
        if y.layout.world() > x.layout.world() {
            Gpus::More
        } else {
            Gpus::Same
        }
    }
}

/// A change or combination of changes, planned.
#[derive(Clone)]
pub(super) struct Tried {
    pub knobs: Vec<Knob>,
    pub whys: Vec<String>,
    pub costs: Vec<&'static str>,
    /// Position in the candidate order, summed over a combination: the ranking when the
    /// options cannot be timed.
    pub rank: usize,
    pub input: PlanInput,
    /// Peak of the most loaded rank; `None` when the planner rejects the configuration.
    pub peak: Option<u64>,
}

impl Tried {
    pub(super) fn fits(&self, capacity: u64) -> bool {
        self.peak.is_some_and(|p| p <= capacity)
    }
}

/// The planned peak, as `ferrotron plan` and the JSON API compute it (deep pipelines: the first
/// and last stage, which bound every stage).
pub(super) fn peak_of(x: &PlanInput) -> Option<u64> {
    let result = if x.layout.pp > 16 {
        plan_extremes(x)
    } else {
        plan(x)
    };
    result.ok().map(|r| r.worst().peak)
}

/// Each candidate change of `x` alone, planned.
pub(super) fn singles(x: &PlanInput) -> Vec<Tried> {
    candidates(x)
        .into_iter()
        .enumerate()
        .map(|(rank, c)| Tried {
            knobs: vec![c.knob],
            whys: vec![c.why],
            costs: vec![c.cost],
            rank,
            peak: peak_of(&c.input),
            input: c.input,
        })
        .collect()
}

/// Combinations of two to `MAX_CHANGES` changes (each knob turned once) that fit in `group`,
/// for when no single change does. Each size extends the `BEAM` lowest-peak configurations of
/// the size before; every fitting combination found is returned, so the caller can pick the
/// cheapest.
pub(super) fn combinations(
    x: &PlanInput,
    singles: &[Tried],
    capacity: u64,
    group: Gpus,
) -> Vec<Tried> {
    // A configuration is extended only while the group can still be reached: GPUs are never
    // removed, so a "same GPUs" search drops anything that added some.
    let reachable = |y: &PlanInput| group == Gpus::More || Gpus::of(x, y) == Gpus::Same;
    let mut seen: HashSet<String> = singles
        .iter()
        .map(|t| to_flags(&changed(x, &t.input)))
        .collect();
    let mut frontier: Vec<Tried> = singles
        .iter()
        .filter(|t| t.peak.is_some() && reachable(&t.input))
        .cloned()
        .collect();
    let mut found = Vec::new();
    for _ in 1..MAX_CHANGES {
        frontier.sort_by_key(|t| t.peak);
        frontier.truncate(BEAM);
        let mut next = Vec::new();
        for t in &frontier {
            for (rank, c) in candidates(&t.input).into_iter().enumerate() {
                if t.knobs.contains(&c.knob) {
                    continue;
                }
                let key = to_flags(&changed(x, &c.input));
                if key.is_empty() || !seen.insert(key) {
                    continue;
                }
                let mut y = t.clone();
                y.knobs.push(c.knob);
                y.whys.push(c.why);
                y.costs.push(c.cost);
                y.rank += rank;
                y.peak = peak_of(&c.input);
                y.input = c.input;
                if y.fits(capacity) {
                    // Extending a fitting combination would only add cost (or GPUs to one
                    // that fits without them): keep it if it is in the group, else drop it.
                    if Gpus::of(x, &y.input) == group {
                        found.push(y);
                    }
                } else if y.peak.is_some() && reachable(&y.input) {
                    next.push(y);
                }
            }
        }
        frontier = next;
    }
    found
}
