//! `ferrotron plan` with the time model, clusters and FLOPs conventions; `ferrotron plan search`.

mod common;
use common::{fails, ok};
use serde_json::Value;

const BASE: &[&str] = &[
    "plan",
    "--model",
    "llama-3-8b",
    "--seq",
    "4096",
    "--mbs",
    "1",
    "--grad-acc",
    "4",
    "--recompute",
    "selective",
    "--dp",
    "8",
    "--zero",
    "1",
    "--gpu",
    "h100",
];

fn json(extra: &[&str]) -> Value {
    let mut a = BASE.to_vec();
    a.extend_from_slice(extra);
    a.push("--json");
    serde_json::from_str(&ok(&a)).unwrap()
}

#[test]
fn json_has_time_and_comm() {
    let v = json(&[]);
    let t = &v["time"];
    for k in ["step_s", "tokens_per_s", "mfu", "hfu"] {
        assert!(t[k].as_f64().unwrap() > 0.0, "time.{k}");
    }
    let b = &t["breakdown"];
    let sum: f64 = [
        "compute_s",
        "recompute_s",
        "exposed_comm_s",
        "bubble_s",
        "optimizer_s",
    ]
    .iter()
    .map(|k| b[k].as_f64().unwrap())
    .sum();
    assert!((sum - t["step_s"].as_f64().unwrap()).abs() < 1e-9);
    assert_eq!(t["tokens_per_step"], 8 * 4 * 4096);
    for d in ["tp", "cp", "ep", "dp", "pp"] {
        for k in ["bytes", "s", "exposed_s"] {
            assert!(!v["comm"][d][k].is_null(), "comm.{d}.{k}");
        }
    }
    assert!(v["comm"]["dp"]["bytes"].as_u64().unwrap() > 0);
    assert_eq!(v["comm"]["tp"]["bytes"], 0);
    // The memory keys are still there.
    assert!(v["per_rank"]["peak"].as_u64().unwrap() > 0);
}

#[test]
fn flops_convention_changes_mfu_not_time() {
    let ours = json(&[]);
    let titan = json(&["--flops-convention", "torchtitan"]);
    assert_eq!(ours["time"]["step_s"], titan["time"]["step_s"]);
    assert!(titan["time"]["mfu"].as_f64() > ours["time"]["mfu"].as_f64());
    assert_eq!(titan["time"]["flops_convention"], "torchtitan");
    let e = fails(&[BASE, &["--flops-convention", "palm"]].concat());
    assert!(e.contains("flops_convention = palm: expected one of ferrotron, torchtitan, nanotron, megatron, 6n"), "{e}");
}

#[test]
fn nodes_and_cluster_files() {
    // tp 8 inside a node of 8, or across two nodes of 4.
    let tp8 = |extra: &[&str]| -> Value {
        let mut a = vec![
            "plan",
            "--model",
            "llama-3-8b",
            "--seq",
            "4096",
            "--tp",
            "8",
            "--sp",
            "--json",
        ];
        a.extend_from_slice(extra);
        serde_json::from_str(&ok(&a)).unwrap()
    };
    let inside = tp8(&[]);
    let across = tp8(&["--gpus-per-node", "4"]);
    assert_eq!(inside["comm"]["tp"]["crosses_nodes"], false);
    assert_eq!(across["comm"]["tp"]["crosses_nodes"], true);
    assert!(across["time"]["step_s"].as_f64() > inside["time"]["step_s"].as_f64());

    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("cluster.toml");
    std::fs::write(
        &f,
        "gpu = \"a100-80\"\ngpus_per_node = 8\nnetwork = \"ib-hdr\"\n",
    )
    .unwrap();
    let v = tp8(&["--cluster", f.to_str().unwrap()]);
    assert_eq!(v["time"]["gpu"], "a100-80");
    assert_eq!(v["verdict"]["gpu"], "a100-80");
    // The flag wins over the file.
    let v = tp8(&["--cluster", f.to_str().unwrap(), "--gpu", "h200"]);
    assert_eq!(v["time"]["gpu"], "h200");
    assert_eq!(v["verdict"]["gpu"], "h200");
    // The shipped example parses.
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../configs/cluster-example.toml"
    );
    assert_eq!(
        tp8(&["--cluster", example])["time"]["cluster"],
        "dgx-h100-ndr"
    );

    std::fs::write(&f, "gpu = \"h100\"\ngpus_per_nod = 8\n").unwrap();
    let e = fails(&[BASE, &["--cluster", f.to_str().unwrap()]].concat());
    assert!(e.contains("unknown field `gpus_per_nod`"), "{e}");
    std::fs::write(&f, "[custom_gpu]\nname = \"x\"\nmemory_gib = 96\nbf16_tflops = -3\nfp32_tflops = 60\nhbm_tb_s = 4\nsms = 100\nlink_gb_s = 400\n").unwrap();
    let e = fails(&[BASE, &["--cluster", f.to_str().unwrap()]].concat());
    assert!(
        e.contains("custom_gpu.bf16_tflops = -3: must be a positive number"),
        "{e}"
    );
    let e = fails(&[BASE, &["--gpus-per-node", "0"]].concat());
    assert!(e.contains("gpus_per_node = 0"), "{e}");
}

#[test]
fn table_and_html_show_time() {
    let out = ok(BASE);
    for needle in [
        "Step time on 8 × h100",
        "tokens/s",
        "MFU",
        "pipeline bubble",
        "model FLOPs per token",
    ] {
        assert!(out.contains(needle), "missing {needle:?} in\n{out}");
    }
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("p.html");
    ok(&[BASE, &["--html", page.to_str().unwrap()]].concat());
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("id=\"time\"") && html.contains("tokens/s"));
    let gpus = ok(&["plan", "--list-gpus"]);
    for g in [
        "a100-40", "a100-80", "h100", "h200", "b200", "mi300x", "ib-ndr",
    ] {
        assert!(gpus.contains(g), "{g}");
    }
}

#[test]
fn search_prints_the_top_k_and_the_reason() {
    let args = [
        "plan",
        "search",
        "--model",
        "llama-3-8b",
        "--gpus",
        "16",
        "--gpus-per-node",
        "8",
        "--gpu",
        "h100",
        "--seq",
        "4096",
        "--gbs-tokens",
        "2097152",
    ];
    let out = ok(&args);
    assert!(
        out.contains("peak GiB") && out.contains("MFU") && out.contains("Why #1:"),
        "{out}"
    );
    let mut j = args.to_vec();
    j.extend(["--json", "--top", "3"]);
    let v: Value = serde_json::from_str(&ok(&j)).unwrap();
    let top = v["top"].as_array().unwrap();
    assert_eq!(top.len(), 3);
    for c in top {
        assert!(c["peak"].as_u64().unwrap() <= v["budget"].as_u64().unwrap());
        assert!(c["time"]["tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    // The winner's flags reproduce it with `ferrotron plan`.
    let flags: Vec<&str> = top[0]["flags"]
        .as_str()
        .unwrap()
        .split_whitespace()
        .collect();
    let mut plan_args = vec![
        "plan",
        "--model",
        "llama-3-8b",
        "--seq",
        "4096",
        "--gpu",
        "h100",
        "--json",
    ];
    plan_args.extend(flags);
    let p: Value = serde_json::from_str(&ok(&plan_args)).unwrap();
    assert_eq!(p["per_rank"]["peak"], top[0]["peak"]);
    assert_eq!(p["time"]["step_s"], top[0]["time"]["step_s"]);

    for (bad, want) in [
        (
            vec!["plan", "search", "--model", "llama-3-8b"],
            "gpus = (none): required",
        ),
        (vec!["plan", "search", "--gpus", "8"], "no model"),
        (
            vec![
                "plan",
                "search",
                "--model",
                "llama-3-8b",
                "--gpus",
                "8",
                "--gbs-tokens",
                "1000",
            ],
            "gbs_tokens = 1000",
        ),
        (
            vec![
                "plan",
                "search",
                "--model",
                "llama-3-8b",
                "--gpus",
                "8",
                "--margin",
                "2",
            ],
            "margin = 2",
        ),
        (
            vec![
                "plan",
                "search",
                "--model",
                "llama-3.1-405b",
                "--gpus",
                "2",
                "--gpu",
                "rtx4090",
            ],
            "no layout",
        ),
    ] {
        let e = fails(&bad);
        assert!(e.contains(want), "{bad:?}: {e}");
    }
}
