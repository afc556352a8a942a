//! `ferrotron data`, `train` and `sample` end to end through the binary.

mod common;
use common::{ferrotron, tiny_model};
use std::process::Output;

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

#[test]
fn data_train_checkpoint_sample() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    // A slice of the bundled corpus as the user's own text.
    let corpus = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../data/corpus/shakespeare.txt"
    ))
    .unwrap();
    std::fs::write(d.join("mine.txt"), &corpus[..300_000]).unwrap();
    let shards = d.join("shards");
    let o = ferrotron(&[
        "data",
        "--input",
        d.join("mine.txt").to_str().unwrap(),
        "--out",
        shards.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(shards.join("train_0000.tok").is_file() && shards.join("val_0000.tok").is_file());

    let model = tiny_model(d);
    let ck = d.join("ck");
    let o = ferrotron(&[
        "train",
        "--model",
        &model,
        "--data",
        shards.to_str().unwrap(),
        "--seq",
        "32",
        "--mbs",
        "4",
        "--steps",
        "3",
        "--eval-interval",
        "3",
        "--out-dir",
        d.join("run").to_str().unwrap(),
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--peak-gflops",
        "100",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for needle in [
        "effective config:",
        "memory plan peak",
        "step     3/3",
        "val ",
        "peak memory planned",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in {out}");
    }
    let o = ferrotron(&[
        "sample",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--prompt",
        "JULIET:",
        "--tokens",
        "8",
        "--seed",
        "3",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let s = String::from_utf8_lossy(&o.stdout).to_string();
    assert!(
        s.starts_with("JULIET:") && s.len() > "JULIET:".len(),
        "{s:?}"
    );
    // A file of prompts: each continued in turn, as it would be alone, a blank line apart.
    let alone = |prompt: &str| {
        let ck = ck.to_str().unwrap();
        let args = [
            "sample",
            "--checkpoint",
            ck,
            "--tokens",
            "8",
            "--temperature",
            "0",
        ];
        let o = ferrotron(&[&args[..], &["--prompt", prompt]].concat());
        assert!(o.status.success(), "{}", text(&o));
        String::from_utf8_lossy(&o.stdout).to_string()
    };
    let prompts = ck.parent().unwrap().join("prompts.txt");
    std::fs::write(&prompts, "JULIET:\n\nROMEO:\n").unwrap();
    let o = ferrotron(&[
        "sample",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--prompts",
        prompts.to_str().unwrap(),
        "--tokens",
        "8",
        "--temperature",
        "0",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let both = String::from_utf8_lossy(&o.stdout).to_string();
    assert_eq!(both, format!("{}\n{}", alone("JULIET:"), alone("ROMEO:")));
    // More tokens than the model's context holds: one line naming the limit, nothing printed.
    let o = ferrotron(&[
        "sample",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--prompt",
        "JULIET:",
        "--tokens",
        "1000000",
    ]);
    let err = text(&o);
    assert!(!o.status.success() && o.stdout.is_empty(), "{err}");
    assert!(
        err.starts_with("error: tokens = 1000000: the prompt's ")
            && err.contains("tokens plus 1000000 pass the model's context of")
            && err.trim().lines().count() == 1,
        "{err}"
    );
}

#[test]
fn bad_train_input_exits_nonzero_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["train", "--steps", "0"],
            "error: steps = 0: must be a positive integer",
        ),
        (
            vec!["train", "--steps", "-3"],
            "invalid value '-3' for '--steps",
        ),
        (
            vec!["train", "--lr", "abc"],
            "invalid value 'abc' for '--lr",
        ),
        (
            vec!["train", "--model", "llama-9b"],
            "model = llama-9b: neither a built-in preset nor a config.json file",
        ),
        (
            vec!["train", "--cp", "2", "--ep", "2"],
            "error: cp = 2: context parallelism does not run with expert parallelism yet: use --cp or --ep, not both",
        ),
        (
            vec!["train", "--sp"],
            "error: sp = true: sequence parallelism divides the tensor-parallel group's activations: add --tp 2 or more",
        ),
        (
            vec!["train", "--tp", "4"],
            "error: config field `num_attention_heads` = 6: tensor parallelism splits the attention heads over the ranks: tp = 4 must divide it (this model splits at tp = 2)",
        ),
        (
            vec!["train", "--dp", "2", "--comm", "mpi"],
            // This test's binary is built without MPI: the rebuild comes first (the mpirun
            // command alone would start a binary that refuses it).
            "error: comm = mpi: this ferrotron was built without MPI; build it with `cargo build --release -p ferrotron --features mpi`, then run `mpirun -np 2 ferrotron train --dp 2` (or use --comm threads)",
        ),
        (
            // Built without CUDA: the rebuild to ask for; with it and no GPU: the driver.
            vec!["train", "--device", "cuda"],
            "error: device = cuda: this ferrotron was built without CUDA; build it with `cargo build --release --features cuda`, or use --device cpu",
        ),
        (
            vec!["train", "--device", "gpu"],
            "invalid value 'gpu' for '--device <DEVICE>'",
        ),
        (
            vec!["train", "--comm", "nccl"],
            "invalid value 'nccl' for '--comm <COMM>'",
        ),
        (
            vec!["train", "--dp", "2", "--resume", "/nonexistent"],
            "error: checkpoint /nonexistent: no trainer_state.json (not a ferrotron checkpoint directory)",
        ),
        (
            vec!["train", "--zero", "7"],
            "zero = 7: ZeRO stages are 0, 1, 2 or 3",
        ),
        (
            vec!["train", "--pp-schedule", "zigzag"],
            "pp_schedule = zigzag: expected one of afab, 1f1b, interleaved",
        ),
        (
            vec!["train", "--pp-virtual", "0"],
            "error: pp_virtual = 0: must be a positive integer",
        ),
        (
            vec!["sample", "--checkpoint", "/nonexistent/ck"],
            "not a ferrotron checkpoint directory",
        ),
        (
            vec!["sample", "--checkpoint", "/nonexistent/ck", "--prompts", "/nonexistent/p.txt"],
            "error: --prompts /nonexistent/p.txt: No such file or directory (os error 2)\n",
        ),
        (
            vec![
                "data",
                "--input",
                "/nonexistent.txt",
                "--out",
                dir.path().to_str().unwrap(),
            ],
            "/nonexistent.txt",
        ),
    ];
    for (args, want) in cases {
        let o = ferrotron(&args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn a_backend_that_cannot_be_is_refused_under_mpirun() {
    // As mpirun starts a process (Open MPI's environment), with this test's binary, which is
    // built without the `mpi` feature: it must not train alone in each process.
    let under_mpirun = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .args(args)
            .env("OMPI_COMM_WORLD_SIZE", "2")
            .output()
            .unwrap()
    };
    for (args, want) in [
        (
            &["train", "--dp", "2"][..],
            "error: comm = mpi: mpirun started this ferrotron, which was built without MPI; build it with `cargo build --release -p ferrotron --features mpi`",
        ),
        (
            &["train", "--dp", "2", "--comm", "threads"][..],
            "error: comm = threads: mpirun started this process; run `ferrotron train --dp 2` without mpirun for ranks as threads, or --comm mpi",
        ),
    ] {
        let o = under_mpirun(args);
        let err = String::from_utf8_lossy(&o.stderr).to_string();
        assert!(!o.status.success(), "{args:?} should fail");
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "one line: {err}");
    }
}
