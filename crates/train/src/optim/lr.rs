//! Learning-rate schedule: linear warm-up, then cosine decay to a floor (Loshchilov & Hutter
//! 2017, SGDR; the schedule of GPT-3 and llm.c).

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub max_lr: f64,
    /// Final learning rate as a fraction of `max_lr`.
    pub min_lr_ratio: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
}

impl LrSchedule {
    /// The schedule a run's configuration asks for.
    pub fn of(c: &crate::config::TrainConfig) -> Self {
        LrSchedule {
            max_lr: c.optimizer.lr,
            min_lr_ratio: c.optimizer.min_lr_ratio,
            warmup_steps: c.optimizer.warmup,
            total_steps: c.optimizer.decay_steps,
        }
    }

    /// Learning rate for 0-based `step`.
    pub fn at(&self, step: u64) -> f64 {
        let min_lr = self.max_lr * self.min_lr_ratio;
        if step < self.warmup_steps {
            return self.max_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        if self.total_steps <= self.warmup_steps {
            return self.max_lr;
        }
        let decay =
            (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * decay.min(1.0)).cos());
        min_lr + coeff * (self.max_lr - min_lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let s = LrSchedule {
            max_lr: 1e-3,
            min_lr_ratio: 0.1,
            warmup_steps: 10,
            total_steps: 110,
        };
        assert!((s.at(0) - 1e-4).abs() < 1e-15);
        assert!((s.at(9) - 1e-3).abs() < 1e-15);
        assert!((s.at(10) - 1e-3).abs() < 1e-15);
        assert!(
            (s.at(60) - 0.55e-3).abs() < 1e-12,
            "half way: mean of max and min"
        );
        assert!((s.at(110) - 1e-4).abs() < 1e-15);
        assert!(s.at(30) > s.at(31));
    }
}
