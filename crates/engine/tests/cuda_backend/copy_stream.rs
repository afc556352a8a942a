//! Weights uploaded ahead on the copy stream (`DeviceAlloc::upload_ahead`, `--offload
//! params`' one-layer-ahead prefetch): a kernel issued after `await_uploads` reads what was
//! copied, on a GPU and on the CUDA emulator; on the emulator, whose non-default streams run
//! as late as CUDA allows, a kernel issued before reads what was there before (the race the
//! await closes, which a GPU shows only sometimes); and after `settle_uploads` the host's
//! source may change without touching the device's copy.

use super::gpu;
use ferrotron_engine::kernels::cuda::{download, CudaAlloc};
use ferrotron_engine::kernels::host_copy::bytes;
use ferrotron_engine::kernels::*;
use std::ptr::NonNull;
use std::sync::Arc;

#[test]
fn an_upload_ahead_is_seen_once_awaited() {
    let Some(k) = gpu() else { return };
    let g: &dyn Kernels<f32> = &k;
    let alloc: Arc<dyn DeviceAlloc> = Arc::new(CudaAlloc::new(k.gpu().ctx.clone(), k.baseline()));
    // (`FERROTRON_CUDA_EMU_STREAMS=sync` runs the emulator's streams at once.)
    let late = std::env::var("FERROTRON_CUDA_EMU_STREAMS").as_deref() != Ok("sync");
    let emulated = k.gpu().name.contains("emulator") && late;
    let n = 3000;
    let mut src: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    let mut window = DeviceBuf::<f32>::zeros(&alloc, n).unwrap();
    let mut before = DeviceBuf::<f32>::zeros(&alloc, n).unwrap();
    let mut after = DeviceBuf::<f32>::zeros(&alloc, n).unwrap();
    let dst = NonNull::new(window.view_mut().as_mut_ptr().cast::<u8>()).unwrap();
    // SAFETY: `window` holds `n` f32 of the device's memory; `src` outlives the settle below.
    unsafe { alloc.upload_ahead(dst, bytes(&src)) };
    g.add_inplace(before.view_mut(), window.view());
    alloc.await_uploads();
    g.add_inplace(after.view_mut(), window.view());
    alloc.settle_uploads();
    // The source changes once the copies have settled: the window keeps what was copied.
    src.iter_mut().for_each(|x| *x = -1.0);
    let want: Vec<f32> = (0..n).map(|i| i as f32 + 0.5).collect();
    assert_eq!(download(after.view()), want, "a kernel after the await");
    assert_eq!(
        download(window.view()),
        want,
        "the window after the source changed"
    );
    if emulated {
        assert_eq!(
            download(before.view()),
            vec![0.0; n],
            "on the emulator a kernel issued before the await reads the window as it was"
        );
    }
}
