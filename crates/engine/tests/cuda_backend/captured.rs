//! Work captured into a CUDA graph and replayed by the backend (`CudaKernels::begin_capture`
//! .. `replay`, #32 item 5; the trainer's `--cuda-graph`): what the host writes inside the eager
//! work is written before each launch from the ids now on the device (the embedding
//! backward's grouping), and what the host keeps of the work is kept (the device's loss
//! slots were added to, so `take_loss` reads them). Each launch on a new batch's ids gives the
//! eager run's bits on those ids.

use super::gpu;
use ferrotron_engine::kernels::cuda::{download, CudaAlloc};
use ferrotron_engine::kernels::*;
use std::sync::Arc;

/// The embedding backward and a cross-entropy over the batch's targets: the captured part of
/// a micro-batch that depends on its ids.
fn id_work(
    g: &dyn Kernels<f32>,
    (tokens, targets): (View<'_, u32>, View<'_, u32>),
    (dout, logits): (View<'_, f32>, ViewMut<'_, f32>),
    (dwte, losses): (ViewMut<'_, f32>, ViewMut<'_, f32>),
    s: CeShape,
    c: usize,
) {
    g.embedding_backward(tokens, dout, c, dwte);
    g.cross_entropy(s, logits, targets, losses, Some(0.25));
}

#[test]
fn a_captured_micro_batch_replays_on_new_ids_with_its_grouping_and_loss() {
    let Some(k) = gpu() else { return };
    let g: &dyn Kernels<f32> = &k;
    let alloc: Arc<dyn DeviceAlloc> = Arc::new(CudaAlloc::new(k.gpu().ctx.clone(), k.baseline()));
    let (n, c, vocab) = (48usize, 8usize, 40usize);
    let s = CeShape { rows: n, vocab };
    let buf = |len| DeviceBuf::<f32>::zeros(&alloc, len).unwrap();
    let (mut tokens, mut targets) = (
        DeviceBuf::<u32>::zeros(&alloc, n).unwrap(),
        DeviceBuf::<u32>::zeros(&alloc, n).unwrap(),
    );
    let (mut dout, mut logits, mut dwte, mut losses) =
        (buf(n * c), buf(n * vocab), buf(vocab * c), buf(n));
    let fill: Vec<f32> = (0..n * c).map(|i| (i as f32 * 0.31).sin()).collect();
    dout.copy_from_host(&fill);
    // Two batches: many repeats (a few distinct ids), then nearly all distinct.
    let batches: [Vec<u32>; 2] = [
        (0..n as u32).map(|i| (i * 7) % 5).collect(),
        (0..n as u32).map(|i| (i * 13 + 3) % vocab as u32).collect(),
    ];
    let logit_of = |seed: u32| -> Vec<f32> {
        (0..n * vocab)
            .map(|i| ((i as f32 + seed as f32) * 0.17).cos())
            .collect()
    };
    // The batch's ids on the device, with the host's copy announced (as the trainer does).
    let load = |ids: &[u32], tokens: &mut DeviceBuf<u32>, targets: &mut DeviceBuf<u32>| {
        let shifted: Vec<u32> = ids.iter().map(|&t| (t + 1) % vocab as u32).collect();
        tokens.copy_from_host(ids);
        targets.copy_from_host(&shifted);
        g.host_ids(tokens.view(), ids);
        g.host_ids(targets.view(), &shifted);
    };
    let mut eager = Vec::new();
    for (b, ids) in batches.iter().enumerate() {
        load(ids, &mut tokens, &mut targets);
        logits.copy_from_host(&logit_of(b as u32));
        dwte.zero();
        let views = (tokens.view(), targets.view());
        id_work(
            g,
            views,
            (dout.view(), logits.view_mut()),
            (dwte.view_mut(), losses.view_mut()),
            s,
            c,
        );
        let loss = g.take_loss();
        eager.push((download(dwte.view()), download(logits.view()), loss));
    }
    assert_ne!(
        eager[0].0, eager[1].0,
        "the batches' embedding gradients differ"
    );
    // Captured on the first batch's ids: nothing runs, nothing is added to the loss.
    load(&batches[0], &mut tokens, &mut targets);
    dwte.zero();
    k.begin_capture().expect("the capture starts");
    let views = (tokens.view(), targets.view());
    id_work(
        g,
        views,
        (dout.view(), logits.view_mut()),
        (dwte.view_mut(), losses.view_mut()),
        s,
        c,
    );
    let work = k.end_capture().expect("the capture ends");
    assert!(
        download(dwte.view()).iter().all(|&v| v == 0.0),
        "a capture runs nothing"
    );
    let err = k.end_capture().expect_err("no capture is open");
    assert_eq!(err, "no capture is open");
    // Replayed on each batch, the second's ids never seen by the capture.
    for (b, ids) in batches.iter().enumerate() {
        load(ids, &mut tokens, &mut targets);
        logits.copy_from_host(&logit_of(b as u32));
        dwte.zero();
        k.replay(&work).expect("the graph launches");
        let loss = g.take_loss();
        assert_eq!(
            download(dwte.view()),
            eager[b].0,
            "the embedding gradient, replayed (batch {b})"
        );
        assert_eq!(
            download(logits.view()),
            eager[b].1,
            "the logit gradients, replayed (batch {b})"
        );
        assert_eq!(
            loss, eager[b].2,
            "the loss kept on the device, replayed (batch {b})"
        );
    }
}
