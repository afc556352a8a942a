//! Expert parallelism against one rank: 2 and 4 ranks (threads of this process, talking through
//! `ferrotron_dist`'s threads backend), each holding its share of the experts and training on
//! its own micro-batch, give what one rank holding every expert gives on the same micro-batches
//! in turn: the loss (with the load-balancing term of each micro-batch), the summed dense
//! gradients and every expert's gradient, under every recompute policy.

mod common;
use common::moe::{cfg, expert_parallel_run, step, targets_in, Group};
use ferrotron_dist::threads;
use ferrotron_engine::model::{ExpertParallel, Llama, Recompute};
use std::rc::Rc;
use std::time::Duration;

fn close(what: &str, want: &[f32], got: &[f32], tol: f32) {
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    for (i, (x, y)) in want.iter().zip(got).enumerate() {
        assert!(
            (x - y).abs() <= tol * scale,
            "{what}[{i}]: {x} vs {y} (scale {scale})"
        );
    }
}

#[test]
fn expert_parallel_ranks_give_the_one_rank_loss_and_gradients() {
    for (ep, experts, top_k, rc) in [
        (2, 4, 2, Recompute::None),
        (2, 4, 2, Recompute::Selective),
        (4, 4, 2, Recompute::Full),
        (4, 8, 3, Recompute::None),
    ] {
        let what = format!("ep {ep} experts {experts} top-{top_k} {rc}");
        let c = cfg(experts, top_k);
        let one = Llama::new(c.clone()).with_recompute(rc);
        let params = one.params.init(5, 0.2);
        let nt = targets_in(ep);
        let mut want = vec![0.0f32; one.num_params()];
        let want_loss: f64 = (0..ep).map(|r| step(&one, &params, &mut want, r, nt)).sum();

        let (loss, got, expert_seen) =
            expert_parallel_run(&c, ep, &params, nt, move |m| m.with_recompute(rc));
        let rel = (loss - want_loss).abs() / want_loss.abs();
        assert!(rel < 1e-5, "{what}: loss {loss} vs {want_loss}");
        for e in &one.params.entries {
            if e.name.contains(".experts.") {
                assert_eq!(expert_seen[e.offset], 1, "{what}: {} on one rank", e.name);
            }
            close(
                &format!("{what} {}", e.name),
                &want[e.range()],
                &got[e.range()],
                1e-5,
            );
        }
    }
}

#[test]
fn an_ep_that_does_not_divide_the_experts_is_refused() {
    let c = cfg(6, 2);
    let out = threads::run(4, Duration::from_secs(10), move |_, comm| {
        Ok::<_, String>(
            ExpertParallel::new(&c, Rc::new(Group(comm)))
                .unwrap_err()
                .to_string(),
        )
    });
    for e in out {
        assert_eq!(
            e.unwrap(),
            "config field `num_local_experts` = 6: expert parallelism gives each of the ep = 4 ranks as many experts: ep must divide it"
        );
    }
}
