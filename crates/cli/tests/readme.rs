//! The README's `ferrotron` commands, pasted as a user would (#34): every `train`, `eval`,
//! `sample` and `report` line of the trainer's block runs in one directory, in order, each
//! against what the earlier ones wrote (the resume and layout examples read `runs/ck`).
//!
//! The lines of the resume chain (those naming a checkpoint directory, or resuming) run their
//! steps as written, at sequences of 64. Every other `train` line (a layout, a precision) runs
//! as written plus one step, no evaluation and, where it sets none, `--seq 64 --mbs 1`
//! ([`shorten`]): one step proves the flags are accepted and the layout starts and trains,
//! without the 150 default steps. Lines that need what CI lacks are left out and listed in
//! `skipped`: `mpirun` (the MPI tests run those layouts), a GPU, a Python
//! script, a placeholder path, or the user's own text files (`data`).

mod common;
use std::path::Path;
use std::process::Command;

const BLOCK_START: &str = "./target/release/ferrotron train --steps 10 --checkpoint-dir runs/ck";

/// The command lines of the README's trainer block, comments removed.
fn trainer_block() -> Vec<String> {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../README.md")).unwrap();
    let start = readme
        .find(BLOCK_START)
        .expect("the README's trainer block starts with the first checkpointed run");
    let block = &readme[start..];
    let block = &block[..block.find("```").expect("the block ends")];
    block
        .lines()
        .map(|l| l.split(" # ").next().unwrap().trim().to_string())
        .filter(|l| !l.is_empty())
        .collect()
}

/// Splits a command line as a shell would, for the quoting the README uses ("…").
fn words(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in line.chars() {
        match c {
            '"' => quoted = !quoted,
            ' ' if !quoted => {
                if !cur.is_empty() {
                    out.push(std::mem::take(&mut cur));
                }
            }
            c => cur.push(c),
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

fn chain(line: &str) -> bool {
    line.contains("--resume") || line.contains("--checkpoint-dir")
}

/// What a `train` line gets on top of what it says, so that the block runs in a few minutes
/// on CI's 2 cores (at the default `--seq 256` and `--mbs 8` it took most of CI's half hour):
/// sequences of 64 where the line sets none, on every line, the resume chain's included (a
/// resumed run keeps its checkpoint's sequence length, so the whole chain shares it); and on
/// the other lines one step, no evaluation, and a micro-batch of 1 where the line sets none:
/// the layout and the flags are what is checked.
fn shorten(args: &mut Vec<String>, chain: bool) {
    let sets = |flag: &str, args: &[String]| args.iter().any(|a| a == flag);
    if !sets("--seq", args) {
        args.extend(["--seq", "64"].map(String::from));
    }
    if chain {
        return;
    }
    args.extend(["--stop-after", "1", "--eval-interval", "0", "--quiet"].map(String::from));
    if !sets("--mbs", args) {
        args.extend(["--mbs", "1"].map(String::from));
    }
}

#[test]
fn the_readme_trainer_commands_run_as_written() {
    let dir = tempfile::tempdir().unwrap();
    let cwd = dir.path();
    // What the commands read from the repository (a TOML file, the bundled corpus).
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for d in ["configs", "data"] {
        std::os::unix::fs::symlink(repo.join(d).canonicalize().unwrap(), cwd.join(d)).unwrap();
    }
    // The eval example's token sequences.
    std::fs::write(cwd.join("seqs.json"), "[[1, 5, 9, 12, 7], [2, 7, 30, 4]]").unwrap();
    // The batch sampling example's prompts.
    std::fs::write(cwd.join("prompts.txt"), "ROMEO:\nJULIET:\n").unwrap();
    let mut ran = Vec::new();
    let mut skipped = Vec::new();
    for line in trainer_block() {
        // `data` lines tokenize the user's own files (their tests: crates/train/tests/data_*).
        let needs = [
            "mpirun",
            "path/to",
            "python3",
            "--device cuda",
            "ferrotron data ",
            "runs/shards",
        ];
        if !line.starts_with("./target/release/ferrotron ")
            || needs.iter().any(|n| line.contains(n))
        {
            skipped.push(line);
            continue;
        }
        let mut args = words(&line)[1..].to_vec();
        if args[0] == "train" {
            shorten(&mut args, chain(&line));
        }
        let o = Command::new(env!("CARGO_BIN_EXE_ferrotron"))
            .args(&args)
            .current_dir(cwd)
            .output()
            .unwrap();
        assert!(
            o.status.success(),
            "README line failed: {line}\n{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        ran.push(line);
    }
    eprintln!("ran {} README lines; skipped {skipped:#?}", ran.len());
    // The chain really chained: the layout change resumed the first run's checkpoint.
    assert!(ran
        .iter()
        .any(|l| l.contains("--resume runs/ck --steps 25 --dp 4")));
    assert!(ran.len() >= 25, "{ran:#?}");
}
