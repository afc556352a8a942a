//! The trainer's device path (`--device`), on the emulated device: weights, master weights,
//! gradients, Adam's moments, activations and token ids all in memory the host may not read
//! (`kernels::device_check`), so any host access by the trainer stops the run. The CPU kernels
//! compute, so every precision must give the plain CPU run's trajectory bit for bit, the same
//! checkpoint and sample, resume exactly, and stay within its memory plan. On a GPU the same
//! path runs with the CUDA backend (`--device cuda`).

mod common;
use common::{assert_same_trajectory, assert_within_plans, tiny_args, tmp};
use ferrotron_train::alloc::Tracking;
use ferrotron_train::device::Device;
use ferrotron_train::run::run;

#[global_allocator]
static A: Tracking = Tracking;

fn run_on(
    device: Device,
    tag: &str,
    f: impl Fn(&mut ferrotron_train::config::TrainArgs),
) -> ferrotron_train::run::RunSummary {
    let out = tmp(&format!("device-{tag}-{device:?}"));
    let mut a = tiny_args(&out, 4);
    a.grad_acc = Some(2);
    a.eval_interval = Some(2);
    a.eval_batches = Some(2);
    a.sample_tokens = Some(6);
    a.device = device;
    f(&mut a);
    run(a).unwrap_or_else(|e| panic!("{tag} on {device:?}: {e:#}"))
}

/// One test: the tracking allocator's counters are the process's, so runs measured side by
/// side would count each other.
#[test]
fn the_device_path_follows_the_cpu_and_resumes() {
    every_precision_gives_the_cpu_runs_bits();
    a_device_checkpoint_resumes_on_the_device_and_on_the_cpu_exactly();
}

fn every_precision_gives_the_cpu_runs_bits() {
    for (precision, rc) in [
        ("fp32", "none"),
        ("bf16", "selective"),
        ("fp16", "full"),
        ("bf16-fp32grads", "none"),
    ] {
        let set = |a: &mut ferrotron_train::config::TrainArgs| {
            a.precision = Some(precision.into());
            a.recompute = Some(rc.into());
        };
        let cpu = run_on(Device::Cpu, precision, set);
        let dev = run_on(Device::Emulated, precision, set);
        for (c, d) in cpu.steps.iter().zip(&dev.steps) {
            let what = format!("{precision} step {}", c.step);
            assert_eq!(c.loss.to_bits(), d.loss.to_bits(), "{what}: loss");
            assert_eq!(
                c.grad_norm.to_bits(),
                d.grad_norm.to_bits(),
                "{what}: grad norm"
            );
            assert_eq!(
                c.val_loss.map(f64::to_bits),
                d.val_loss.map(f64::to_bits),
                "{what}: val loss"
            );
        }
        assert_eq!(cpu.steps.len(), dev.steps.len());
        assert!(
            dev.steps.iter().any(|m| m.val_loss.is_some()),
            "{precision}: evaluated"
        );
        assert_eq!(
            cpu.sample, dev.sample,
            "{precision}: sample from the weights brought back"
        );
        assert!(
            dev.sample.as_ref().is_some_and(|s| !s.is_empty()),
            "{precision}: a sample"
        );
        assert_within_plans(&dev.steps, &format!("{precision} on the device"));
        for m in &dev.steps {
            let off = (m.mem_peak_measured as f64 / m.mem_peak_planned as f64 - 1.0).abs();
            assert!(off < 0.01, "{precision} step {}: {m:?}", m.step);
        }
    }
}

fn a_device_checkpoint_resumes_on_the_device_and_on_the_cpu_exactly() {
    let out = tmp("device-ckpt");
    let ck = out.join("ck");
    let straight = run_on(Device::Emulated, "straight", |a| {
        a.steps = Some(6);
        a.precision = Some("bf16".into());
    });
    let mut first = tiny_args(&out, 3);
    (first.grad_acc, first.eval_interval, first.sample_tokens) = (Some(2), Some(2), Some(0));
    (first.eval_batches, first.precision) = (Some(2), Some("bf16".into()));
    first.steps = Some(3);
    first.decay_steps = Some(6);
    first.checkpoint_dir = Some(ck.clone());
    first.device = Device::Emulated;
    run(first).unwrap();
    for device in [Device::Emulated, Device::Cpu] {
        let o = tmp(&format!("device-resume-{device:?}"));
        let mut a = common::resume_args(&ck, &o, Some(6), "m.jsonl");
        // Not back into `ck`: the other device resumes from it next.
        a.checkpoint_dir = Some(o.join("ck"));
        a.sample_tokens = Some(0);
        a.device = device;
        let resumed = run(a).unwrap();
        let what = format!("resumed on {device:?}");
        assert_same_trajectory(&what, &resumed.steps, &straight.steps[3..]);
    }
}
