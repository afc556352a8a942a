//! An option as the settings it changes: the same keys as the JSON API and TOML files, and the
//! command-line flags that reproduce it. Both are read off the planned input, so what is shown
//! is exactly what was planned.

use crate::planner::PlanInput;
use serde_json::{json, Map, Value};

type Field = (&'static str, fn(&PlanInput) -> Value);

/// Every setting a change could touch, in the order flags are printed (layout, then batch and
/// recipe). Settings no candidate changes are listed too, so that a change that touched one by
/// mistake would still be shown rather than hidden.
const FIELDS: [Field; 16] = [
    ("tp", |p| json!(p.layout.tp)),
    ("sp", |p| json!(p.layout.sp)),
    ("pp", |p| json!(p.layout.pp)),
    ("pp_schedule", |p| json!(p.layout.pp_schedule)),
    ("pp_virtual", |p| json!(p.layout.pp_virtual)),
    ("cp", |p| json!(p.layout.cp)),
    ("ep", |p| json!(p.layout.ep)),
    ("dp", |p| json!(p.layout.dp)),
    ("zero", |p| json!(p.layout.zero)),
    ("offload", |p| json!(p.layout.offload)),
    ("seq", |p| json!(p.recipe.seq)),
    ("mbs", |p| json!(p.recipe.mbs)),
    ("grad_acc", |p| json!(p.recipe.grad_acc)),
    ("recompute", |p| json!(p.recipe.recompute)),
    ("precision", |p| json!(p.recipe.precision)),
    ("optimizer", |p| json!(p.recipe.optimizer)),
];

/// The settings of `y` that differ from `x`, in `FIELDS` order.
pub(super) fn changed(x: &PlanInput, y: &PlanInput) -> Vec<(&'static str, Value)> {
    FIELDS
        .iter()
        .filter_map(|(key, get)| {
            let v = get(y);
            (get(x) != v).then_some((*key, v))
        })
        .collect()
}

/// The changed settings as a JSON object (keys as in the JSON API).
pub(super) fn to_map(set: &[(&'static str, Value)]) -> Map<String, Value> {
    set.iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// The changed settings as command-line flags, e.g. `--tp 2 --sp --dp 4 --grad-acc 2`.
pub(super) fn to_flags(set: &[(&'static str, Value)]) -> String {
    set.iter()
        .map(|(k, v)| {
            let flag = format!("--{}", k.replace('_', "-"));
            match v {
                Value::Bool(true) => flag,
                Value::String(s) => format!("{flag} {s}"),
                other => format!("{flag} {other}"),
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}
