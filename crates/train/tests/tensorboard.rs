//! `--tensorboard DIR`: a 3-step data-parallel run's event file, read back with its CRCs
//! checked, holds each step's values of `metrics.jsonl` (loss, validation loss, learning rate,
//! gradient norm, tokens/s, MFU, planned and measured memory per rank, communication bytes,
//! skipped steps). tests/reference/tensorboard_check.py does the same with TensorBoard's reader.

mod common;
use common::{tiny_args, tmp};
use ferrotron_train::run::run;
use ferrotron_train::tensorboard::read_events;
use serde_json::Value;

#[test]
fn a_run_writes_the_metrics_as_tensorboard_scalars() {
    let out = tmp("tensorboard");
    let tb = out.join("tb");
    let mut a = tiny_args(&out, 3);
    a.layout.dp = Some(2);
    a.mbs = Some(2);
    a.eval_interval = Some(2);
    a.tensorboard = Some(tb.clone());
    run(a).unwrap();
    let files: Vec<_> = std::fs::read_dir(&tb)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(files[0]
        .file_name()
        .unwrap()
        .to_string_lossy()
        .starts_with("events.out.tfevents."));
    let events = read_events(&files[0]).unwrap();
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    let lines: Vec<Value> = std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(events.len(), 1 + lines.len());
    for (e, line) in events[1..].iter().zip(&lines) {
        assert_eq!(Some(e.step), line["step"].as_u64());
        let get = |tag: &str| {
            e.values
                .iter()
                .find(|(t, _)| t == tag)
                .map(|(_, v)| *v)
                .unwrap_or_else(|| panic!("step {}: no scalar {tag}", e.step))
        };
        // The JSON line's numbers, as the f32 of TensorBoard's simple_value.
        let json = |pointer: &str| {
            line.pointer(pointer)
                .and_then(Value::as_f64)
                .map(|x| x as f32)
        };
        for key in [
            "loss",
            "lr",
            "grad_norm",
            "tokens_per_s",
            "mfu",
            "mem_peak_planned",
            "mem_peak_measured",
            "comm/dp/sent",
            "comm/dp/planned",
        ] {
            assert_eq!(
                Some(get(key)),
                json(&format!("/{key}")),
                "step {}: {key}",
                e.step
            );
        }
        for rank in 0..2 {
            for key in ["mem_peak_planned", "mem_peak_measured"] {
                let tag = format!("rank_mem/{rank}/{key}");
                assert_eq!(Some(get(&tag)), json(&format!("/{tag}")), "{tag}");
            }
        }
        assert!(get("mem_peak_planned") > 0.0 && get("comm/dp/sent") > 0.0);
        match json("/val_loss") {
            Some(v) => assert_eq!(get("val_loss"), v),
            None => assert!(e.values.iter().all(|(t, _)| t != "val_loss")),
        }
        assert_eq!(get("skipped"), 0.0);
        assert_eq!(get("skipped_steps"), 0.0);
    }
    assert!(
        events
            .iter()
            .any(|e| e.values.iter().any(|(t, _)| t == "val_loss")),
        "an evaluation at step 2"
    );
}

#[test]
fn the_observability_table_of_a_config_file_sets_it() {
    let out = tmp("tensorboard-toml");
    let file = out.join("run.toml");
    std::fs::write(&file, "[observability]\ntensorboard = \"runs/tb\"\n").unwrap();
    let a = ferrotron_train::config::TrainArgs {
        config: Some(file),
        ..Default::default()
    };
    let c = a.merged().unwrap().resolve().unwrap();
    assert_eq!(
        c.observability.tensorboard.as_deref(),
        Some(std::path::Path::new("runs/tb"))
    );
    // The flag wins over the file, as every flag does.
    let a = ferrotron_train::config::TrainArgs {
        config: Some(out.join("run.toml")),
        tensorboard: Some("elsewhere".into()),
        ..Default::default()
    };
    let c = a.merged().unwrap().resolve().unwrap();
    assert_eq!(
        c.observability.tensorboard.as_deref(),
        Some(std::path::Path::new("elsewhere"))
    );
}
