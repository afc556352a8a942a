//! FLOPs conventions, collective costs, rank placement and the invariants of the step-time model.

mod common;
use common::input;
use ferrotron_plan::cluster::{gpu, groups, Cluster, Dim, Link};
use ferrotron_plan::comm::{bytes_per_rank, latency_steps, time, Collective};
use ferrotron_plan::flops::{flops_per_token, model_flops_per_token, FlopsConvention};
use ferrotron_plan::presets::preset;
use ferrotron_plan::time::{estimate, TimeReport};
use ferrotron_plan::*;

fn close(a: f64, b: f64, rel: f64) -> bool {
    (a - b).abs() <= rel * b.abs().max(1e-300)
}

#[test]
fn megatron_convention_is_narayanan_equation_3() {
    // Narayanan et al. 2021 eq. (3): 72·B·s·L·h²·(1 + s/(6h) + V/(12hL)) per iteration.
    for name in [
        "megatron-22b",
        "megatron-175b",
        "megatron-530b",
        "megatron-1t",
    ] {
        let m = preset(name).unwrap();
        let (s, l, h, v) = (2048.0, m.layers as f64, m.hidden as f64, m.vocab as f64);
        let per_seq = 72.0 * s * l * h * h * (1.0 + s / (6.0 * h) + v / (12.0 * h * l));
        let ours = flops_per_token(&m, 2048, FlopsConvention::Megatron) * s;
        assert!(close(ours, per_seq, 1e-12), "{name}: {ours} vs {per_seq}");
    }
}

#[test]
fn torchtitan_nanotron_6n_and_ferrotron_on_llama_3_8b() {
    let m = preset("llama-3-8b").unwrap();
    let s = 4096u64;
    // Published facts: 8,030,261,248 parameters, embedding 128,256 × 4,096, 65 RMSNorm
    // weights of 4,096, 32 layers × 32 heads × 128.
    let total = 8_030_261_248f64;
    let emb = 128_256.0 * 4096.0;
    let norms = 65.0 * 4096.0;
    let attn_full = 12.0 * 32.0 * 32.0 * 128.0 * s as f64;
    let tt = flops_per_token(&m, s, FlopsConvention::Torchtitan);
    assert_eq!(tt, 6.0 * (total - emb) + attn_full);
    assert_eq!(tt, 51_471_998_976.0);
    let nano = flops_per_token(&m, s, FlopsConvention::Nanotron);
    assert_eq!(nano, 6.0 * (total - emb - norms) + attn_full);
    assert_eq!(flops_per_token(&m, s, FlopsConvention::SixN), 6.0 * total);
    // The default halves the attention term for the causal mask.
    let ours = flops_per_token(&m, s, FlopsConvention::Ferrotron);
    assert_eq!(ours, nano - attn_full / 2.0);
    assert_eq!(ours, model_flops_per_token(&m, s));
    // docs/FORMULAS.md's worked example.
    assert_eq!(ours, 48_249_176_064.0);
    // Megatron's formula counts the same matmuls as nanotron for a Llama (no biases).
    assert!(close(
        flops_per_token(&m, s, FlopsConvention::Megatron),
        nano,
        1e-12
    ));
}

#[test]
fn mixture_of_experts_counts_active_experts_only() {
    let m = preset("mixtral-8x7b").unwrap();
    let active = 12_879_925_248f64;
    assert_eq!(
        flops_per_token(&m, 4096, FlopsConvention::SixN),
        6.0 * active
    );
    let tt = flops_per_token(&m, 4096, FlopsConvention::Torchtitan);
    let emb = 32_000.0 * 4096.0;
    assert_eq!(
        tt,
        6.0 * (active - emb) + 12.0 * 32.0 * 32.0 * 128.0 * 4096.0
    );
}

#[test]
fn flops_convention_names_round_trip_and_reject_typos() {
    for c in FlopsConvention::ALL {
        assert_eq!(c.name().parse::<FlopsConvention>().unwrap(), c);
    }
    let e = "palm".parse::<FlopsConvention>().unwrap_err().to_string();
    assert!(
        e.starts_with("flops_convention = palm: expected one of"),
        "{e}"
    );
}

#[test]
fn ring_collective_volumes_and_times() {
    let x = 1e9;
    let link = Link {
        bw: 100e9,
        latency: 5e-6,
    };
    for n in [2u64, 4, 8, 64] {
        let f = (n - 1) as f64 / n as f64;
        assert!(close(
            bytes_per_rank(Collective::AllReduce, x, n),
            2.0 * f * x,
            1e-15
        ));
        assert!(close(
            bytes_per_rank(Collective::AllGather, x, n),
            f * x,
            1e-15
        ));
        assert!(close(
            bytes_per_rank(Collective::ReduceScatter, x, n),
            f * x,
            1e-15
        ));
        assert!(close(
            bytes_per_rank(Collective::AllToAll, x, n),
            f * x,
            1e-15
        ));
        // An all-reduce is a reduce-scatter followed by an all-gather.
        let ar = time(Collective::AllReduce, x, n, link);
        let rs_ag =
            time(Collective::ReduceScatter, x, n, link) + time(Collective::AllGather, x, n, link);
        assert!(close(ar, rs_ag, 1e-12));
        assert!(close(
            ar,
            2.0 * f * x / 100e9 + latency_steps(Collective::AllReduce, n) * 5e-6,
            1e-12
        ));
    }
    // Latency: ring steps for small groups, tree depth for large ones.
    assert_eq!(latency_steps(Collective::AllReduce, 4), 2.0 * 2.0);
    assert_eq!(latency_steps(Collective::AllReduce, 1024), 2.0 * 10.0);
    assert_eq!(latency_steps(Collective::AllToAll, 8), 7.0);
    assert_eq!(bytes_per_rank(Collective::AllReduce, x, 1), 0.0);
    assert_eq!(time(Collective::SendRecv, x, 2, link), x / 100e9 + 5e-6);
}

#[test]
fn placement_is_tp_innermost_and_knows_node_crossings() {
    let l = Layout {
        dp: 4,
        tp: 4,
        pp: 2,
        cp: 2,
        ..Layout::default()
    };
    let g = groups(&l, 8);
    let get = |d: Dim| *g.iter().find(|x| x.dim == d).unwrap();
    assert_eq!(
        (get(Dim::Tp).stride, get(Dim::Tp).crosses_nodes),
        (1, false)
    );
    assert_eq!(
        (get(Dim::Cp).stride, get(Dim::Cp).crosses_nodes),
        (4, false)
    );
    assert_eq!((get(Dim::Dp).stride, get(Dim::Dp).crosses_nodes), (8, true));
    assert_eq!(
        (get(Dim::Pp).stride, get(Dim::Pp).crosses_nodes),
        (32, true)
    );
    assert!(!get(Dim::Ep).crosses_nodes, "size-1 groups cross nothing");
    // tp 8 on nodes of 4 crosses; tp 3 on nodes of 8 straddles node boundaries.
    let wide = Layout {
        tp: 8,
        ..Layout::default()
    };
    assert!(groups(&wide, 4)[0].crosses_nodes);
    assert!(!groups(&wide, 8)[0].crosses_nodes);
    let odd = Layout {
        tp: 3,
        ..Layout::default()
    };
    assert!(groups(&odd, 8)[0].crosses_nodes);
}

fn h100(gpn: u64) -> Cluster {
    Cluster::of(gpu("h100").unwrap(), gpn).unwrap()
}

fn llama(recipe: Recipe, layout: Layout) -> TimeReport {
    llama_as(recipe, layout, Convention::Ferrotron)
}

fn llama_as(recipe: Recipe, layout: Layout, c: Convention) -> TimeReport {
    let x = input("llama-3-8b", recipe, layout, c);
    estimate(&x, &h100(8), FlopsConvention::Ferrotron)
        .unwrap()
        .unwrap()
}

fn recipe(mbs: u64, grad_acc: u64, recompute: Recompute) -> Recipe {
    Recipe {
        seq: 4096,
        mbs,
        grad_acc,
        recompute,
        ..Recipe::default()
    }
}

#[test]
fn breakdown_sums_to_the_step_and_utilisation_is_consistent() {
    let layouts = [
        Layout {
            dp: 8,
            zero: 1,
            ..Layout::default()
        },
        Layout {
            dp: 2,
            tp: 4,
            sp: true,
            ..Layout::default()
        },
        Layout {
            dp: 2,
            pp: 4,
            pp_schedule: PpSchedule::Interleaved,
            pp_virtual: 2,
            ..Layout::default()
        },
        Layout {
            dp: 4,
            cp: 2,
            zero: 3,
            ..Layout::default()
        },
    ];
    for l in layouts {
        let t = llama(recipe(1, 8, Recompute::Selective), l.clone());
        let b = &t.breakdown;
        let sum = b.compute_s + b.recompute_s + b.exposed_comm_s + b.bubble_s + b.optimizer_s;
        assert!(close(sum, t.step_s, 1e-12), "{l:?}");
        let exposed: f64 = t.comm.iter().map(|(_, c)| c.exposed_s).sum();
        assert!(close(exposed, b.exposed_comm_s, 1e-12));
        for (_, c) in &t.comm {
            assert!(c.exposed_s <= c.s + 1e-12 && c.s >= 0.0);
        }
        assert_eq!(t.tokens_per_step, 8 * l.dp * 4096);
        assert!(close(
            t.tokens_per_s,
            t.tokens_per_step as f64 / t.step_s,
            1e-12
        ));
        assert!(
            t.mfu > 0.0 && t.mfu < t.hfu && t.hfu < 1.0,
            "{} {}",
            t.mfu,
            t.hfu
        );
        assert_eq!(t.gpus, l.world());
    }
}

#[test]
fn recomputation_costs_time_and_full_costs_most() {
    let l = Layout {
        dp: 8,
        ..Layout::default()
    };
    let none = llama(recipe(1, 4, Recompute::None), l.clone());
    let sel = llama(recipe(1, 4, Recompute::Selective), l.clone());
    let full = llama(recipe(1, 4, Recompute::Full), l);
    assert_eq!(none.breakdown.recompute_s, 0.0);
    assert!(none.step_s < sel.step_s && sel.step_s < full.step_s);
    // Full recompute replays the forward: about a third of forward + backward.
    let ratio = full.breakdown.recompute_s / full.breakdown.compute_s;
    assert!((0.25..0.4).contains(&ratio), "{ratio}");
    // MFU counts model FLOPs only, so it drops with recomputation; HFU counts it.
    assert!(full.mfu < none.mfu);
    assert!(full.hfu > full.mfu * 1.2);
}

#[test]
fn pipeline_bubble_is_p_minus_1_over_v_m() {
    for (pp, v, m) in [(4u64, 1u64, 8u64), (4, 2, 8), (8, 4, 16)] {
        let l = Layout {
            pp,
            pp_schedule: if v > 1 {
                PpSchedule::Interleaved
            } else {
                PpSchedule::OneFOneB
            },
            pp_virtual: v,
            ..Layout::default()
        };
        let t = llama(recipe(1, m, Recompute::None), l);
        let want = (pp - 1) as f64 / (v * m) as f64;
        assert!(close(t.bubble_fraction, want, 1e-12));
        // The bubble is that fraction of the pipeline's busy time (llama-3-8b: untied, so the
        // pp traffic is the per-micro-batch sends only).
        let busy = t.breakdown.compute_s
            + t.breakdown.recompute_s
            + t.comm_of(Dim::Tp).exposed_s
            + t.comm_of(Dim::Cp).exposed_s
            + t.comm_of(Dim::Ep).exposed_s
            + t.comm_of(Dim::Pp).exposed_s;
        assert!(
            close(t.breakdown.bubble_s, want * busy, 1e-9),
            "pp {pp} v {v}"
        );
    }
}

#[test]
fn zero_communication_volumes_follow_the_zero_paper() {
    // §7.2: ZeRO-1/2 move what plain data parallelism moves (reduce-scatter + all-gather =
    // all-reduce); ZeRO-3 1.5× (an extra parameter all-gather). One micro-batch, bf16 grads.
    let layout = |zero| Layout {
        dp: 8,
        zero,
        ..Layout::default()
    };
    let bytes = |zero: u8| {
        let t = llama_as(
            recipe(1, 1, Recompute::None),
            layout(zero),
            Convention::ZeroPaper,
        );
        t.comm_of(Dim::Dp).bytes
    };
    // ferrotron's ZeRO-3 gathers what its windows do not hold (`ferrotron_plan::zero3`): each
    // of the 32 layers for the forward, all but the last two again for the backward, the
    // embedding and the head once; every unit padded to 8 blocks.
    let ours = llama(recipe(1, 1, Recompute::None), layout(3))
        .comm_of(Dim::Dp)
        .bytes;
    let (n, head) = (8_030_261_248u64, 128_256 * 4096 + 4096);
    let embed = 128_256 * 4096;
    let layer = (n - embed - head) / 32;
    let pad = |u: u64| u.next_multiple_of(8) as f64;
    let gathered = pad(embed) + pad(head) + 62.0 * pad(layer);
    let scattered = pad(embed) + pad(head) + 32.0 * pad(layer);
    let want = 7.0 / 8.0 * 2.0 * (gathered + scattered);
    assert!(close(ours, want, 1e-12), "{ours} vs {want}");
    let (z0, z1, z2, z3) = (bytes(0), bytes(1), bytes(2), bytes(3));
    assert!(
        close(z1, z0, 1e-12) && close(z2, z0, 1e-12),
        "{z0} {z1} {z2}"
    );
    assert!(close(z3, 1.5 * z0, 1e-12), "{z3} vs {z0}");
    // And the all-reduce moves 2(n − 1)/n of the gradient bytes of the rank.
    let params = 8_030_261_248f64;
    assert!(close(z0, 2.0 * 7.0 / 8.0 * 2.0 * params, 1e-12));
}

#[test]
fn the_runtime_not_the_convention_picks_the_zero3_schedule() {
    // ferrotron's kernels under PyTorch FSDP (the llm-foundry rows of `measured_runs.rs`) gather
    // as every framework's ZeRO-3 does, 1.5× the data-parallel volume, into FSDP's unit
    // buffers; ferrotron's trainer gathers what its windows do not hold, into its windows.
    let run = |zero, runtime| {
        let layout = Layout {
            dp: 8,
            zero,
            ..Layout::default()
        };
        let mut x = input(
            "llama-3-8b",
            recipe(1, 1, Recompute::None),
            layout,
            Convention::Ferrotron,
        );
        x.runtime = runtime;
        x
    };
    let dp_bytes = |x: &PlanInput| {
        let t = estimate(x, &h100(8), FlopsConvention::Ferrotron).unwrap();
        t.unwrap().comm_of(Dim::Dp).bytes
    };
    let fsdp = run(3, Runtime::Framework);
    let trainer = run(3, Runtime::Ferrotron);
    let z0 = dp_bytes(&run(0, Runtime::Framework));
    assert!(close(dp_bytes(&fsdp), 1.5 * z0, 1e-12));
    assert!(dp_bytes(&trainer) < dp_bytes(&fsdp));
    let holds = |x: &PlanInput, name: &str| plan(x).unwrap().worst().plan.find(name).is_some();
    assert!(holds(&fsdp, "comm.zero3.gathered_params"));
    assert!(!holds(&fsdp, "zero3.param_windows"));
    assert!(holds(&trainer, "zero3.param_windows"));
    assert!(!holds(&trainer, "comm.zero3.gathered_params"));
    // ferrotron's trainer runs only ferrotron's engine.
    let mut titan = run(3, Runtime::Ferrotron);
    titan.convention = Convention::Torchtitan;
    assert!(plan(&titan).is_err());
    assert!(estimate(&titan, &h100(8), FlopsConvention::Ferrotron).is_err());
}

#[test]
fn tensor_parallel_traffic_and_node_crossings() {
    let l = |sp| Layout {
        dp: 1,
        tp: 8,
        sp,
        ..Layout::default()
    };
    let plain = llama(recipe(1, 1, Recompute::None), l(false));
    let sp = llama(recipe(1, 1, Recompute::None), l(true));
    // Sequence parallelism replaces each all-reduce by a reduce-scatter + all-gather pair:
    // the same volume (Korthikanti et al. 2022 §4.2.2), as Megatron counts it.
    let megatron = |sp| llama_as(recipe(1, 1, Recompute::None), l(sp), Convention::Megatron);
    let (m_plain, m_sp) = (megatron(false), megatron(true));
    let (a, b) = (m_plain.comm_of(Dim::Tp), m_sp.comm_of(Dim::Tp));
    assert!(close(a.bytes, b.bytes, 1e-12));
    // ferrotron's backward also gathers each block's saved norm output again for the weight
    // gradients (one more all-gather + reduce-scatter volume per layer, 3 pairs for 2
    // all-reduces) and all-reduces the norms' gradients (2 per layer and the final one).
    let (a, b) = (plain.comm_of(Dim::Tp), sp.comm_of(Dim::Tp));
    let pair = 2.0 * 7.0 / 8.0 * 4096.0 * 4096.0 * 2.0;
    let norms = 2.0 * 7.0 / 8.0 * 4.0 * (2.0 * 32.0 + 1.0) * 4096.0;
    assert!(
        close(b.bytes - a.bytes, 32.0 * pair + norms, 1e-12),
        "{} vs {}",
        b.bytes,
        a.bytes
    );
    // Per layer 4 collectives of s·b·h·2 bytes (2 forward, 2 backward), plus the embedding's
    // (forward) and the LM head's (backward): 32·4 + 2 all-reduces of 4096 × 4096 bf16, and
    // the vocabulary-parallel cross-entropy's statistics (3 f32 per token and rank, gathered).
    let x = 4096.0 * 4096.0 * 2.0;
    let stats = 7.0 / 8.0 * 12.0 * 4096.0 * 8.0;
    assert!(close(
        a.bytes,
        (32.0 * 4.0 + 2.0) * 2.0 * 7.0 / 8.0 * x + stats,
        1e-12
    ));
    assert!(!a.crosses_nodes && a.exposed_s == a.s);
    // The same tp on nodes of 4 GPUs crosses the network and takes longer.
    let x4 = input(
        "llama-3-8b",
        recipe(1, 1, Recompute::None),
        l(true),
        Convention::Ferrotron,
    );
    let t4 = estimate(&x4, &h100(4), FlopsConvention::Ferrotron)
        .unwrap()
        .unwrap();
    assert!(t4.comm_of(Dim::Tp).crosses_nodes);
    assert!(t4.comm_of(Dim::Tp).s > 5.0 * b.s);
}

#[test]
fn bare_parameter_counts_have_no_time_model() {
    let x = PlanInput {
        model: ModelSource::Params(7_000_000_000),
        recipe: Recipe::default(),
        layout: Layout::default(),
        convention: Convention::ZeroPaper,
        runtime: Runtime::Framework,
        overhead: ferrotron_plan::hardware::Overhead::NONE,
        bucket_bytes: 25 << 20,
    };
    assert!(estimate(&x, &h100(8), FlopsConvention::Ferrotron)
        .unwrap()
        .is_none());
}

#[test]
fn planning_the_extreme_stages_finds_the_same_worst_rank() {
    let cases = [
        (
            "llama-3-8b",
            4u64,
            1u64,
            PpSchedule::OneFOneB,
            8u64,
            Recompute::None,
        ),
        (
            "llama-3-8b",
            8,
            2,
            PpSchedule::Interleaved,
            16,
            Recompute::Selective,
        ),
        ("llama-3.2-1b", 4, 1, PpSchedule::Afab, 4, Recompute::Full),
        ("gpt2", 4, 3, PpSchedule::Interleaved, 8, Recompute::None),
        (
            "mixtral-8x7b",
            4,
            1,
            PpSchedule::OneFOneB,
            6,
            Recompute::Selective,
        ),
    ];
    for (model, pp, v, sched, m, rc) in cases {
        for conv in [Convention::Ferrotron, Convention::Megatron] {
            let x = input(
                model,
                Recipe {
                    seq: 1024,
                    mbs: 2,
                    grad_acc: m,
                    recompute: rc,
                    ..Recipe::default()
                },
                Layout {
                    pp,
                    pp_virtual: v,
                    pp_schedule: sched,
                    tp: 2,
                    sp: true,
                    ..Layout::default()
                },
                conv,
            );
            let all = plan(&x).unwrap();
            let ext = plan_extremes(&x).unwrap();
            assert_eq!(all.worst().peak, ext.worst().peak, "{model} pp {pp} {conv}");
            assert_eq!(all.worst().name, ext.worst().name);
            assert!(ext.ranks.len() <= 2);
        }
    }
}

#[test]
fn bucketed_reductions_pay_one_latency_per_bucket() {
    use ferrotron_plan::comm::time_bucketed;
    let link = Link {
        bw: 100e9,
        latency: 5e-6,
    };
    let x = 1e9;
    let one = time(Collective::AllReduce, x, 8, link);
    let bucketed = time_bucketed(Collective::AllReduce, x, 8, link, 25e6);
    let steps = latency_steps(Collective::AllReduce, 8);
    assert!(close(bucketed - one, 39.0 * steps * 5e-6, 1e-9));
}

#[test]
fn power_capped_h100_sustains_the_cube_root_of_its_power_share() {
    // The 500 W H100 of torchtitan's benchmarks: the 700 W sustained clock × (500/700)^(1/3).
    let (full, capped) = (gpu("h100").unwrap(), gpu("h100-96").unwrap());
    for p in [Precision::Bf16, Precision::Fp8] {
        let want = full.sustained(p) * (500.0f64 / 700.0).cbrt();
        assert!(close(capped.sustained(p), want, 1e-12), "{p:?}");
    }
    assert!(close(
        capped.sustained(Precision::Bf16),
        0.842 * 0.894,
        1e-3
    ));
}

#[test]
fn fp8_pays_the_casts_of_its_gemm_operands() {
    // fp8 GEMMs run at twice the bf16 rate, but the casts around them are memory traffic
    // (`time/fp8.rs`): an fp8 step has more memory-bound time than the same bf16 step.
    let run = |p: Precision, model: &str| {
        let recipe = Recipe {
            seq: 2048,
            mbs: 4,
            precision: p,
            ..Recipe::default()
        };
        let x = input(model, recipe, Layout::default(), Convention::Ferrotron);
        let c = Cluster::of(gpu("h100").unwrap(), 8).unwrap();
        estimate(&x, &c, FlopsConvention::Ferrotron)
            .unwrap()
            .unwrap()
            .compute_detail
    };
    let (bf16, fp8) = (
        run(Precision::Bf16, "llama-3-8b"),
        run(Precision::Fp8, "llama-3-8b"),
    );
    assert!(fp8.matmul_s < bf16.matmul_s);
    assert!(fp8.memory_bound_s > bf16.memory_bound_s);
}

#[test]
fn ferrotrons_offload_hides_the_copies_behind_the_host_update() {
    // The optimizer term of `--offload optimizer` on one H100 (Llama-3-8B, bf16 with fp32
    // master weights): PCIe 25 GB/s carries 2 B of gradient down and 2 B of weight up per
    // parameter, host memory 100 GB/s carries AdamW's 28 B (tail.rs's assumptions).
    let l = Layout {
        offload: Offload::Optimizer,
        ..Layout::default()
    };
    let optimizer = |runtime| {
        let mut x = input(
            "llama-3-8b",
            recipe(1, 1, Recompute::Full),
            l.clone(),
            Convention::Ferrotron,
        );
        x.runtime = runtime;
        let t = estimate(&x, &h100(1), FlopsConvention::Ferrotron)
            .unwrap()
            .unwrap();
        t.breakdown.optimizer_s
    };
    let n = 8_030_261_248f64;
    let (pcie, host) = (n * 4.0 / 25e9, n * 28.0 / 100e9);
    // A framework runs them one after the other (ZeRO-Offload as the planner models it).
    assert!(close(optimizer(Runtime::Framework), pcie + host, 1e-9));
    // ferrotron's copy thread overlaps them, bucket by bucket (2^24 elements): the larger,
    // plus the first bucket down and the last one up.
    let ramp = pcie * (1u64 << 24) as f64 / n;
    assert!(close(
        optimizer(Runtime::FerrotronDevice),
        host.max(pcie) + ramp,
        1e-9
    ));
}
