//! The layout flags as a user gives them (`--dp --tp --pp --cp --ep --zero --sp --pp-schedule
//! --pp-virtual --offload`), one definition for `ferrotron plan`, its JSON API and
//! `ferrotron train`, turned into a [`Layout`] by one function. With the `cli` feature they are
//! also clap flags (the planner library itself does not need clap).

use crate::api::parse;
use crate::error::{PlanError, Result};
use crate::layout::{Layout, Offload, PpSchedule};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::Args))]
#[serde(deny_unknown_fields)]
pub struct LayoutFlags {
    /// Data-parallel ranks [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub dp: Option<u64>,
    /// Tensor-parallel ranks [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub tp: Option<u64>,
    /// Pipeline stages [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp: Option<u64>,
    /// Context-parallel ranks [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub cp: Option<u64>,
    /// Expert-parallel ranks [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub ep: Option<u64>,
    /// ZeRO stage 0..3 [default: 0].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub zero: Option<u64>,
    /// Sequence parallelism (with tp > 1); `--sp` alone means true [default: false].
    #[cfg_attr(
        feature = "cli",
        arg(long, num_args = 0..=1, default_missing_value = "true")
    )]
    pub sp: Option<bool>,
    /// afab | 1f1b | interleaved [default: 1f1b].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp_schedule: Option<String>,
    /// Model chunks per stage for the interleaved schedule [default: 1].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp_virtual: Option<u64>,
    /// Layers per pipeline stage, e.g. `7,8*14,7` (126 layers on 16 stages), or per model chunk
    /// (pp × pp-virtual counts, model order) [default: even].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub pp_layers: Option<String>,
    /// Layers of the first pipeline stage, the others sharing the rest evenly (Megatron-LM's
    /// `--decoder-first-pipeline-num-layers`) [default: an even share]. Not written when not
    /// given: a saved config reads as it did before the flag existed.
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_first_layers: Option<u64>,
    /// Layers of the last pipeline stage (Megatron-LM's `--decoder-last-pipeline-num-layers`)
    /// [default: an even share].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pp_last_layers: Option<u64>,
    /// none | optimizer | params [default: none].
    #[cfg_attr(feature = "cli", arg(long, allow_negative_numbers = true))]
    pub offload: Option<String>,
}

impl LayoutFlags {
    /// The layout these flags describe, defaults filled in. Checks what the flags alone decide
    /// (the ZeRO stage, the names); [`Layout::validate`] checks it against model and batch.
    pub fn resolve(&self) -> Result<Layout> {
        let zero = self.zero.unwrap_or(0);
        if zero > 3 {
            return Err(PlanError::setting(
                "zero",
                zero,
                "ZeRO stages are 0, 1, 2 or 3",
            ));
        }
        Ok(Layout {
            dp: self.dp.unwrap_or(1),
            tp: self.tp.unwrap_or(1),
            pp: self.pp.unwrap_or(1),
            cp: self.cp.unwrap_or(1),
            ep: self.ep.unwrap_or(1),
            zero: zero as u8,
            sp: self.sp.unwrap_or(false),
            pp_schedule: parse(&self.pp_schedule, PpSchedule::OneFOneB)?,
            pp_virtual: self.pp_virtual.unwrap_or(1),
            pp_layers: match &self.pp_layers {
                Some(s) => crate::layout::parse_pp_layers(s)?,
                None => vec![],
            },
            pp_first_layers: self.pp_first_layers,
            pp_last_layers: self.pp_last_layers,
            offload: parse(&self.offload, Offload::None)?,
            ep_overlap: false,
            tp_overlap: false,
            param_gather_overlap: false,
            pp_overlap: false,
        })
    }

    /// Fills every flag not given here from `other` (a TOML file's values under the command
    /// line's).
    pub fn or(mut self, other: LayoutFlags) -> Self {
        macro_rules! fill {
            ($($f:ident),*) => { $( if self.$f.is_none() { self.$f = other.$f; } )* };
        }
        fill!(
            dp,
            tp,
            pp,
            cp,
            ep,
            zero,
            sp,
            pp_schedule,
            pp_virtual,
            pp_layers,
            pp_first_layers,
            pp_last_layers,
            offload
        );
        self
    }
}

impl From<&Layout> for LayoutFlags {
    /// Every flag of `l` given (what a resumed run's flags fill in from its checkpoint).
    fn from(l: &Layout) -> Self {
        let layers = l.pp_layers.iter().map(u64::to_string).collect::<Vec<_>>();
        LayoutFlags {
            dp: Some(l.dp),
            tp: Some(l.tp),
            pp: Some(l.pp),
            cp: Some(l.cp),
            ep: Some(l.ep),
            zero: Some(l.zero as u64),
            sp: Some(l.sp),
            pp_schedule: Some(l.pp_schedule.to_string()),
            pp_virtual: Some(l.pp_virtual),
            pp_layers: (!layers.is_empty()).then(|| layers.join(",")),
            pp_first_layers: l.pp_first_layers,
            pp_last_layers: l.pp_last_layers,
            offload: Some(l.offload.to_string()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_layout_given_as_flags_resolves_to_itself() {
        let l = LayoutFlags {
            dp: Some(4),
            pp: Some(3),
            zero: Some(1),
            pp_schedule: Some("interleaved".into()),
            pp_virtual: Some(2),
            pp_layers: Some("1,2*2".into()),
            pp_last_layers: Some(3),
            offload: Some("optimizer".into()),
            sp: Some(true),
            tp: Some(2),
            ..LayoutFlags::default()
        }
        .resolve()
        .unwrap();
        assert_eq!(l.pp_layers, [1, 2, 2]);
        assert_eq!(l.pp_last_layers, Some(3));
        assert_eq!(LayoutFlags::from(&l).resolve().unwrap(), l);
        assert_eq!(
            LayoutFlags::from(&Layout::default()).resolve().unwrap(),
            Layout::default()
        );
    }
}
