//! Dynamic loss scaling for fp16 training (Micikevicius et al. 2018, "Mixed Precision
//! Training", §3.2), with the update rule of PyTorch's `torch.amp.GradScaler`
//! (`torch.cuda.amp.GradScaler`; the `_amp_update_scale_` kernel).
//!
//! The loss is multiplied by `scale` before the backward pass so that small gradients do not
//! flush to zero in fp16, and the gradients are multiplied by [`DynamicLossScaler::unscale_factor`]
//! before the optimizer step. After each backward pass the caller reports whether all
//! gradients were finite:
//!
//! * **overflow** (an inf or NaN anywhere): the optimizer step is skipped, the scale is
//!   multiplied by `backoff_factor` and the run of good steps restarts from zero;
//! * **success**: the step is taken; after `growth_interval` consecutive successes the scale is
//!   multiplied by `growth_factor` and the count restarts.
//!
//! Two bounds, both keeping the scale a usable finite number:
//! * like torch, growth is applied only if the grown scale is finite (so with the default
//!   power-of-two factors the scale never exceeds 2^127); the counter still restarts;
//! * unlike torch, which has no lower bound, a backoff never goes below `min_scale` (as
//!   Megatron-LM's and DeepSpeed's `min_loss_scale`, default 1): repeated overflows then keep
//!   skipping steps at `min_scale` instead of driving the scale to zero.

use serde::{Deserialize, Serialize};

/// Hyper-parameters of [`DynamicLossScaler`]; the defaults are `torch.amp.GradScaler`'s.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LossScaleConfig {
    /// Initial scale (default 2^16 = 65536).
    pub init_scale: f32,
    /// Factor applied after `growth_interval` consecutive finite steps (default 2).
    pub growth_factor: f32,
    /// Factor applied on overflow (default 0.5).
    pub backoff_factor: f32,
    /// Consecutive finite steps before the scale grows (default 2000).
    pub growth_interval: u64,
    /// Lower bound of the scale after a backoff (default 1).
    pub min_scale: f32,
}

impl Default for LossScaleConfig {
    fn default() -> Self {
        LossScaleConfig {
            init_scale: 65536.0,
            growth_factor: 2.0,
            backoff_factor: 0.5,
            growth_interval: 2000,
            min_scale: 1.0,
        }
    }
}

impl LossScaleConfig {
    /// Checks every field; the error is one line naming the field, its value and the fix.
    pub fn validate(&self) -> Result<(), String> {
        let c = self;
        if !(c.init_scale.is_finite() && c.init_scale > 0.0) {
            return Err(format!(
                "loss_scale.init_scale = {}: must be a finite number > 0 (default 65536)",
                c.init_scale
            ));
        }
        if !(c.growth_factor.is_finite() && c.growth_factor > 1.0) {
            return Err(format!(
                "loss_scale.growth_factor = {}: must be > 1 (default 2)",
                c.growth_factor
            ));
        }
        if !(c.backoff_factor > 0.0 && c.backoff_factor < 1.0) {
            return Err(format!(
                "loss_scale.backoff_factor = {}: must be in (0, 1) (default 0.5)",
                c.backoff_factor
            ));
        }
        if c.growth_interval == 0 {
            return Err("loss_scale.growth_interval = 0: must be >= 1 (default 2000)".to_string());
        }
        if !(c.min_scale.is_finite() && c.min_scale > 0.0) {
            return Err(format!(
                "loss_scale.min_scale = {}: must be a finite number > 0 (default 1)",
                c.min_scale
            ));
        }
        if c.init_scale < c.min_scale {
            return Err(format!(
                "loss_scale.init_scale = {}: must be >= loss_scale.min_scale = {}; raise \
                 init_scale or lower min_scale",
                c.init_scale, c.min_scale
            ));
        }
        Ok(())
    }
}

/// What [`DynamicLossScaler::update`] decided for one step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ScaleUpdate {
    /// Whether the optimizer step should be applied (false: gradients overflowed, skip it).
    pub step_taken: bool,
    /// The scale the step's loss was multiplied by.
    pub old_scale: f32,
    /// The scale for the next step.
    pub new_scale: f32,
}

/// Dynamic loss scaler state; serializable so that checkpoints resume it exactly.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DynamicLossScaler {
    /// Current scale: multiply the loss by this before backward.
    pub scale: f32,
    /// Consecutive finite steps since the last growth or overflow (torch's `_growth_tracker`).
    pub good_steps: u64,
    /// Total number of skipped (overflowed) steps.
    pub skipped: u64,
    config: LossScaleConfig,
}

impl DynamicLossScaler {
    /// A scaler at `cfg.init_scale`. The config should have passed
    /// [`LossScaleConfig::validate`].
    pub fn new(cfg: LossScaleConfig) -> Self {
        DynamicLossScaler {
            scale: cfg.init_scale,
            good_steps: 0,
            skipped: 0,
            config: cfg,
        }
    }

    /// The configuration this scaler was made with.
    pub fn config(&self) -> &LossScaleConfig {
        &self.config
    }

    /// Multiply gradients by this (1 / scale) before the optimizer step.
    pub fn unscale_factor(&self) -> f32 {
        1.0 / self.scale
    }

    /// Records one step whose gradients were (`grads_finite`) or were not all finite, and
    /// updates the scale (torch `GradScaler.update` semantics, plus the `min_scale` floor).
    pub fn update(&mut self, grads_finite: bool) -> ScaleUpdate {
        let c = &self.config;
        let old_scale = self.scale;
        if grads_finite {
            self.good_steps += 1;
            if self.good_steps >= c.growth_interval {
                let grown = self.scale * c.growth_factor;
                if grown.is_finite() {
                    self.scale = grown;
                }
                self.good_steps = 0;
            }
        } else {
            self.scale = (self.scale * c.backoff_factor).max(c.min_scale);
            self.good_steps = 0;
            self.skipped += 1;
        }
        ScaleUpdate {
            step_taken: grads_finite,
            old_scale,
            new_scale: self.scale,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(growth_interval: u64) -> LossScaleConfig {
        LossScaleConfig {
            growth_interval,
            ..LossScaleConfig::default()
        }
    }

    #[test]
    fn defaults_are_torch_gradscaler_defaults() {
        let c = LossScaleConfig::default();
        assert_eq!(
            (
                c.init_scale,
                c.growth_factor,
                c.backoff_factor,
                c.growth_interval
            ),
            (65536.0, 2.0, 0.5, 2000)
        );
        assert_eq!(c.min_scale, 1.0);
        assert_eq!(c.validate(), Ok(()));
        let s = DynamicLossScaler::new(c);
        assert_eq!((s.scale, s.good_steps, s.skipped), (65536.0, 0, 0));
        assert_eq!(s.unscale_factor(), 1.0 / 65536.0);
    }

    #[test]
    fn overflow_skips_and_backs_off() {
        let mut s = DynamicLossScaler::new(cfg(3));
        s.update(true);
        s.update(true);
        let u = s.update(false);
        assert_eq!(
            u,
            ScaleUpdate {
                step_taken: false,
                old_scale: 65536.0,
                new_scale: 32768.0
            }
        );
        assert_eq!((s.scale, s.good_steps, s.skipped), (32768.0, 0, 1));
        assert_eq!(s.unscale_factor(), 1.0 / 32768.0);
        // The good-step count restarted: growth needs 3 more finite steps.
        assert!(s.update(true).step_taken);
        assert_eq!(s.update(true).new_scale, 32768.0);
        let u = s.update(true);
        assert_eq!((u.old_scale, u.new_scale), (32768.0, 65536.0));
    }

    #[test]
    fn grows_after_exactly_growth_interval_good_steps() {
        let mut s = DynamicLossScaler::new(cfg(2000));
        for i in 1..2000 {
            let u = s.update(true);
            assert!(u.step_taken);
            assert_eq!(u.new_scale, 65536.0, "step {i}");
            assert_eq!(s.good_steps, i);
        }
        let u = s.update(true);
        assert_eq!(
            (u.step_taken, u.old_scale, u.new_scale),
            (true, 65536.0, 131072.0)
        );
        assert_eq!(s.good_steps, 0);
        // And again after another full interval.
        for _ in 0..1999 {
            s.update(true);
        }
        assert_eq!(s.scale, 131072.0);
        assert_eq!(s.update(true).new_scale, 262144.0);
        assert_eq!(s.skipped, 0);
    }

    #[test]
    fn backoff_is_clamped_at_min_scale() {
        let mut s = DynamicLossScaler::new(LossScaleConfig {
            init_scale: 8.0,
            min_scale: 2.0,
            ..cfg(10)
        });
        let scales: Vec<f32> = (0..5).map(|_| s.update(false).new_scale).collect();
        assert_eq!(scales, [4.0, 2.0, 2.0, 2.0, 2.0]);
        assert_eq!(s.skipped, 5);
        // A min_scale that is not a power of the backoff factor is hit exactly.
        let mut s = DynamicLossScaler::new(LossScaleConfig {
            init_scale: 8.0,
            min_scale: 3.0,
            ..cfg(10)
        });
        s.update(false);
        assert_eq!(s.update(false).new_scale, 3.0);
    }

    #[test]
    fn growth_stops_before_overflowing_f32() {
        let mut s = DynamicLossScaler::new(LossScaleConfig {
            init_scale: 2f32.powi(126),
            ..cfg(1)
        });
        assert_eq!(s.update(true).new_scale, 2f32.powi(127));
        let u = s.update(true);
        assert_eq!((u.step_taken, u.new_scale), (true, 2f32.powi(127)));
        assert_eq!(s.good_steps, 0); // torch also resets the tracker when growth is refused
        assert!(s.unscale_factor() > 0.0);
    }

    #[test]
    fn validate_names_the_field_and_the_fix() {
        let bad = [
            (
                LossScaleConfig {
                    growth_factor: 0.5,
                    ..Default::default()
                },
                "loss_scale.growth_factor = 0.5: must be > 1",
            ),
            (
                LossScaleConfig {
                    growth_factor: 1.0,
                    ..Default::default()
                },
                "loss_scale.growth_factor = 1:",
            ),
            (
                LossScaleConfig {
                    backoff_factor: 1.0,
                    ..Default::default()
                },
                "loss_scale.backoff_factor = 1: must be in (0, 1)",
            ),
            (
                LossScaleConfig {
                    backoff_factor: 0.0,
                    ..Default::default()
                },
                "loss_scale.backoff_factor = 0:",
            ),
            (
                LossScaleConfig {
                    growth_interval: 0,
                    ..Default::default()
                },
                "loss_scale.growth_interval = 0: must be >= 1",
            ),
            (
                LossScaleConfig {
                    init_scale: f32::INFINITY,
                    ..Default::default()
                },
                "loss_scale.init_scale = inf:",
            ),
            (
                LossScaleConfig {
                    init_scale: -1.0,
                    ..Default::default()
                },
                "loss_scale.init_scale = -1:",
            ),
            (
                LossScaleConfig {
                    min_scale: 0.0,
                    ..Default::default()
                },
                "loss_scale.min_scale = 0:",
            ),
            (
                LossScaleConfig {
                    init_scale: 0.5,
                    ..Default::default()
                },
                "loss_scale.init_scale = 0.5: must be >= loss_scale.min_scale = 1",
            ),
            (
                LossScaleConfig {
                    backoff_factor: f32::NAN,
                    ..Default::default()
                },
                "loss_scale.backoff_factor = NaN:",
            ),
        ];
        for (c, want) in bad {
            let e = c.validate().unwrap_err();
            assert!(e.starts_with(want), "{e:?} should start with {want:?}");
            assert!(!e.contains('\n'));
        }
    }

    #[test]
    fn serde_round_trip() {
        let mut s = DynamicLossScaler::new(cfg(5));
        for ok in [true, true, false, true, true, true] {
            s.update(ok);
        }
        let json = serde_json::to_string(&s).unwrap();
        let back: DynamicLossScaler = serde_json::from_str(&json).unwrap();
        assert_eq!(back, s);
        // The restored scaler continues identically.
        let (mut a, mut b) = (s, back);
        for ok in [true, true, false, true] {
            assert_eq!(a.update(ok), b.update(ok));
        }
        // Configs: partial TOML-style input takes the defaults for missing fields, and unknown
        // fields are rejected.
        let c: LossScaleConfig = serde_json::from_str(r#"{"growth_interval": 100}"#).unwrap();
        assert_eq!(c, cfg(100));
        assert!(serde_json::from_str::<LossScaleConfig>(r#"{"growth_intervall": 1}"#).is_err());
        let c2: LossScaleConfig =
            serde_json::from_str(&serde_json::to_string(&cfg(7)).unwrap()).unwrap();
        assert_eq!(c2, cfg(7));
    }
}
