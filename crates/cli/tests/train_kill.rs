//! The kill -9 guarantee: a training run killed at any moment (mid-step, mid-checkpoint)
//! resumes from its last checkpoint and ends bit-identical to a run never interrupted.

mod common;
use common::{ok, tiny_model};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: &str = "30";

/// `ferrotron train` of the tiny model with a checkpoint after every step.
fn train_args(model: &str, data: &str, out: &str, ck: &str) -> Vec<String> {
    [
        "train",
        "--model",
        model,
        "--data",
        data,
        "--seq",
        "32",
        "--mbs",
        "4",
        "--steps",
        STEPS,
        "--lr",
        "1e-2",
        "--eval-interval",
        "0",
        "--out-dir",
        out,
        "--checkpoint-dir",
        ck,
        "--checkpoint-interval",
        "1",
        "--peak-gflops",
        "100",
        "--quiet",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_run_killed_at_any_moment_resumes_bit_identically() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = |x: &str| d.join(x).to_string_lossy().to_string();
    let model = tiny_model(d);
    let corpus = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/corpus/shakespeare.txt"
    );
    let data = p("shards");
    ok(&["data", "--input", corpus, "--out", &data]);
    // The uninterrupted run; its duration scales the moments of the kills below, so they fall
    // inside a run on a fast machine and a slow one alike.
    let t0 = Instant::now();
    ok(&strs(&train_args(
        &model,
        &data,
        &p("straight"),
        &p("ck-straight"),
    )));
    let whole = t0.elapsed().as_secs_f64();
    // Kill the same run again and again, resuming each time from whatever checkpoint exists:
    // each run is let past a checkpoint or two (so the whole makes progress) and killed at a
    // different fraction of a step after it, in the step's compute or in its save.
    let ck = p("ck");
    let step_time = whole / STEPS.parse::<f64>().unwrap();
    let saved_step = || -> Option<u64> {
        let text = std::fs::read_to_string(d.join("ck/trainer_state.json")).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        v["step"].as_u64()
    };
    let mut kills = 0;
    let mut finished = false;
    for i in 0..60u64 {
        let mut args = train_args(&model, &data, &p("killed"), &ck);
        // A checkpoint exists once the first save completed (a save killed between its two
        // renames leaves it beside as `.ck.old-PID`, which resuming restores).
        let saved = std::fs::read_dir(d).unwrap().any(|e| {
            let n = e.unwrap().file_name().to_string_lossy().to_string();
            n == "ck" || n.starts_with(".ck.old-")
        });
        if saved {
            args.extend(["--resume".to_string(), ck.clone()]);
        }
        let start = saved_step().unwrap_or(0);
        if start == STEPS.parse::<u64>().unwrap() {
            // Killed after its last save: the run is complete.
            finished = true;
            break;
        }
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Every fifth run is killed during startup; the others 1-2 checkpoints further on.
        if i % 5 != 4 {
            let target = start + 1 + i % 2;
            let deadline = Instant::now() + Duration::from_secs_f64(10.0 * whole);
            while saved_step().unwrap_or(start) < target
                && child.try_wait().unwrap().is_none()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        // A fraction of a step later (a fixed sequence of fractions).
        let frac = ((i * 7919 + 13) % 97) as f64 / 97.0;
        std::thread::sleep(Duration::from_secs_f64(frac * step_time));
        match child.try_wait().unwrap() {
            Some(status) => {
                let out = child.wait_with_output().unwrap();
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(status.success(), "run {i} failed: {err}");
                finished = true;
                break;
            }
            None => {
                child.kill().unwrap(); // SIGKILL
                child.wait().unwrap();
                kills += 1;
            }
        }
    }
    eprintln!("{kills} kills before the run finished (a whole run takes {whole:.2}s)");
    assert!(
        kills >= 3,
        "only {kills} kills: the run is too fast to interrupt"
    );
    if !finished {
        let mut args = train_args(&model, &data, &p("killed"), &ck);
        args.extend(["--resume".to_string(), ck.clone()]);
        ok(&strs(&args));
    }
    for f in ["model.safetensors", "optimizer.safetensors"] {
        let a = std::fs::read(d.join("ck-straight").join(f)).unwrap();
        let b = std::fs::read(d.join("ck").join(f)).unwrap();
        assert!(a == b, "{f} differs after {kills} kills");
    }
    let state = std::fs::read_to_string(d.join("ck/trainer_state.json")).unwrap();
    assert!(state.contains(&format!("\"step\": {STEPS}")), "{state}");
}
