//! The NCCL communicator (`ferrotron_dist::nccl`) at world size 1, the one GPU of the GPU
//! machine (NCCL refuses two ranks on one GPU): every collective on device buffers gives the
//! threads backend's result at world size 1 bit for bit, bad input is refused with its reason.
//! Without a GPU the GPU tests return at once saying so (CI), unless `FERROTRON_GPU_REQUIRED`
//! is set (the GPU kit), where that fails them; on a machine with a GPU a missing NCCL fails
//! them. `FERROTRON_REQUIRE_NCCL=1` (set by the GPU kit, `run.sh`, and
//! usable on any machine with NCCL on `LD_LIBRARY_PATH`) makes a missing NCCL fail the
//! library test too.
#![cfg(feature = "cuda")]

use ferrotron_dist::device_collective::DeviceCollective;
use ferrotron_dist::device_reduce::{grads_of, DeviceReduce, Owned};
use ferrotron_dist::nccl::{self, Nccl};
use ferrotron_dist::threads::{world, ThreadComm};
use ferrotron_dist::{AsView, AsViewMut, Communicator};
use ferrotron_engine::kernels::cuda::cudarc::driver::CudaContext;
use ferrotron_engine::kernels::cuda::{device, download, skip, upload, DeviceBlock};
use ferrotron_engine::model::tensor_parallel::TpOp;
use ferrotron_engine::model::DeviceOperands;
use ferrotron_engine::Elem;
use ferrotron_plan::DType;
use half::bf16;
use std::sync::Arc;
use std::time::Duration;

fn one_rank() -> ThreadComm {
    world(1, Duration::from_secs(20)).pop().unwrap()
}

/// GPU 0's context, or `None` (saying why) where there is no GPU.
fn gpu() -> Option<Arc<CudaContext>> {
    if !device::driver_present() {
        skip::unavailable("no NVIDIA driver here");
        return None;
    }
    match CudaContext::new(0) {
        Ok(c) => Some(c),
        Err(e) => {
            skip::unavailable(&format!("no GPU 0 ({e:?})"));
            None
        }
    }
}

#[test]
fn the_library_loads_where_required() {
    match nccl::version() {
        Ok(v) => {
            eprintln!("NCCL {}.{}.{}", v / 10000, v / 100 % 100, v % 100);
            assert!(v >= 21800, "NCCL {v} is older than 2.18");
        }
        Err(e) => {
            assert!(
                std::env::var_os("FERROTRON_REQUIRE_NCCL").is_none(),
                "FERROTRON_REQUIRE_NCCL is set: {e}"
            );
            eprintln!("skipped: {e}");
        }
    }
}

fn data(n: usize, salt: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| ((i.wrapping_mul(2654435761) ^ salt) % 1999) as f32 * 0.731 - 700.0)
        .collect()
}

fn up(ctx: &Arc<CudaContext>, v: &[f32]) -> DeviceBlock {
    upload(ctx, v).expect("upload")
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

/// `f` on views of `ins` and of an output starting as `out`, in device memory where `dev` is
/// given, else on the host: the output's bits.
fn run(
    dev: Option<&Arc<CudaContext>>,
    ins: &[f32],
    out: Vec<f32>,
    f: &dyn Fn(ferrotron_dist::View<'_, f32>, ferrotron_dist::ViewMut<'_, f32>),
) -> Vec<u32> {
    match dev {
        None => {
            let mut out = out;
            f(ins.view(), out.view_mut());
            bits(&out)
        }
        Some(ctx) => {
            let i = up(ctx, ins);
            let mut o = up(ctx, &out);
            f(i.view(ins.len()), o.view_mut(out.len()));
            bits(&download(o.view::<f32>(out.len())))
        }
    }
}

/// Every collective on `c` (world size 1), on device buffers where `dev` is given, else on
/// host buffers: each result.
fn collectives(c: &dyn Communicator, dev: Option<&Arc<CudaContext>>) -> Vec<Vec<u32>> {
    let n = 1000;
    let x = data(n, 1);
    let mut out = Vec::new();
    // In place: the input is the output.
    out.push(run(dev, &[], x.clone(), &|_, o| {
        c.all_reduce_sum(o).unwrap()
    }));
    out.push(run(dev, &[], x.clone(), &|_, o| c.broadcast(o, 0).unwrap()));
    out.push(run(dev, &x, vec![0.0; n], &|i, o| {
        c.reduce_scatter_sum(i, o).unwrap()
    }));
    out.push(run(dev, &x, vec![0.0; n], &|i, o| {
        c.all_gather(i, o).unwrap()
    }));
    out.push(run(dev, &x, vec![0.0; n], &|i, o| {
        c.all_to_all(i, o).unwrap()
    }));
    // Uneven: 600 of the 1000 elements out, into the front of a buffer of 700.
    out.push(run(dev, &x, vec![-1.0; 700], &|i, o| {
        c.all_to_all_v(i, &[600], o, &[600], &mut Default::default())
            .unwrap()
    }));
    let sub = c.split_group(&[0]).unwrap();
    out.push(run(dev, &[], data(n, 2), &|_, o| {
        sub.all_reduce_sum(o).unwrap()
    }));
    c.barrier().unwrap();
    out
}

/// Every collective of a group of several ranks on `c`, each rank with its own data, and a
/// ring of messages (rank 0 sends first, every other rank receives first: no cycle of waiting
/// senders): each result.
fn group_collectives(c: &dyn Communicator, dev: Option<&Arc<CudaContext>>) -> Vec<Vec<u32>> {
    let (me, size) = (c.rank(), c.size());
    let n = 24 * size;
    let x = data(n, 10 + me as u32);
    let mut out = Vec::new();
    out.push(run(dev, &[], x.clone(), &|_, o| {
        c.all_reduce_sum(o).unwrap()
    }));
    out.push(run(dev, &[], x.clone(), &|_, o| {
        c.broadcast(o, size - 1).unwrap()
    }));
    out.push(run(dev, &x, vec![0.0; 24], &|i, o| {
        c.reduce_scatter_sum(i, o).unwrap()
    }));
    out.push(run(dev, &x[..24], vec![0.0; n], &|i, o| {
        c.all_gather(i, o).unwrap()
    }));
    out.push(run(dev, &x, vec![0.0; n], &|i, o| {
        c.all_to_all(i, o).unwrap()
    }));
    out.push(run(dev, &x[..8], vec![0.0; 8], &|i, o| {
        let (next, prev) = ((me + 1) % size, (me + size - 1) % size);
        if me == 0 {
            c.send(i, next, 7).unwrap();
            c.recv(o, prev, 7).unwrap();
        } else {
            c.recv(o, prev, 7).unwrap();
            c.send(i, next, 7).unwrap();
        }
    }));
    c.barrier().unwrap();
    out
}

#[test]
fn world_size_one_collectives_equal_the_threads_backend() {
    let Some(ctx) = gpu() else { return };
    let want = collectives(&one_rank(), None);
    let c = Nccl::new(Box::new(one_rank()), ctx.clone()).unwrap_or_else(|e| panic!("{e}"));
    let got = collectives(&c, Some(&ctx));
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "collective {k}");
    }
    // The host communicator's overlapped all-reduce, through NCCL's host group.
    let summed = c.all_reduce_start(data(8, 3).into()).wait().unwrap();
    assert_eq!(bits(&summed), bits(&data(8, 3)));
}

#[test]
fn bad_input_is_refused_with_its_reason() {
    let Some(ctx) = gpu() else { return };
    let c = Nccl::new(Box::new(one_rank()), ctx.clone()).unwrap_or_else(|e| panic!("{e}"));
    let mut host = vec![0.0f32; 4];
    assert_eq!(
        c.all_reduce_sum(host.view_mut()).unwrap_err().to_string(),
        "rank 0: all_reduce_sum: the buffer is in host memory, and this NCCL communicator runs on device 0 memory"
    );
    let mut b = up(&ctx, &[1.0; 4]);
    assert_eq!(
        c.send(b.view(4), 0, 1).unwrap_err().to_string(),
        "rank 0: send: destination 0 is this rank: NCCL messages itself only within an all-to-all"
    );
    assert_eq!(
        c.recv(b.view_mut(4), 1, 1).unwrap_err().to_string(),
        "rank 0: recv: source 1 is not in a group of 1"
    );
    let s = up(&ctx, &[0.0; 7]);
    assert_eq!(
        c.reduce_scatter_sum(s.view(7), b.view_mut(4))
            .unwrap_err()
            .to_string(),
        "rank 0: reduce_scatter_sum: send has 7 elements, expected size 1 × recv 4"
    );
    assert_eq!(
        c.send_start(vec![0.0; 3].into(), 0, 1)
            .wait()
            .unwrap_err()
            .to_string(),
        "rank 0: send_start: a started send of 3 host elements: NCCL sends device views (send), which its receiver waits on"
    );
}

/// Several ranks (threads) on the CUDA emulator, whose libnccl joins the threads of one
/// process (`crates/engine/cuda_emu/nccl.cpp`): every collective and a ring of messages on
/// device buffers equals the threads backend's on host buffers, bit for bit, at 2 and 3 ranks.
/// NCCL itself refuses two ranks on one GPU, so on a GPU this returns at once saying so (not
/// a missing GPU or library: the GPU kit passes it there).
#[test]
fn several_ranks_on_the_emulator_equal_the_threads_backend() {
    let Some(ctx) = gpu() else { return };
    if ctx.name().ok().as_deref() != Some("ferrotron CUDA emulator") {
        eprintln!(
            "skipped: NCCL refuses two ranks on one GPU; several ranks run on the CUDA emulator"
        );
        return;
    }
    for size in [2, 3] {
        let ranks = |dev: Option<&Arc<CudaContext>>| -> Vec<Vec<Vec<u32>>> {
            let comms = world(size, Duration::from_secs(20));
            std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .into_iter()
                    .map(|c| {
                        s.spawn(move || match dev {
                            None => group_collectives(&c, None),
                            Some(ctx) => {
                                let n = Nccl::new(Box::new(c), ctx.clone())
                                    .unwrap_or_else(|e| panic!("{e}"));
                                group_collectives(&n, Some(ctx))
                            }
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            })
        };
        let (want, got) = (ranks(None), ranks(Some(&ctx)));
        for (r, (g, w)) in got.iter().zip(&want).enumerate() {
            for (k, (g, w)) in g.iter().zip(w).enumerate() {
                assert_eq!(g, w, "{size} ranks: rank {r}, collective {k}");
            }
        }
    }
}

/// Elements of a type the device collectives take, as their bits.
trait Bits: Elem + Default {
    fn bits(self) -> u32;
}
impl Bits for f32 {
    fn bits(self) -> u32 {
        self.to_bits()
    }
}
impl Bits for bf16 {
    fn bits(self) -> u32 {
        self.to_bits() as u32
    }
}

/// Rank `r`'s `n` inputs, of type `T`.
fn typed<T: Elem>(n: usize, r: usize) -> Vec<T> {
    data(n, r as u32 + 7)
        .iter()
        .map(|&x| T::from_f32(x / 64.0))
        .collect()
}

/// The rank-order sum of every rank's `n` inputs, each addition in f32 rounded to `T` (f32:
/// f32's sum; bf16: NCCL's ring rounding, at two ranks the staged path's one rounding).
fn summed<T: Elem>(n: usize, size: usize) -> Vec<T> {
    let all: Vec<Vec<T>> = (0..size).map(|r| typed(n, r)).collect();
    (0..n)
        .map(|i| {
            all.iter().fold(T::from_f32(0.0), |s, x| {
                T::from_f32(s.to_f32() + x[i].to_f32())
            })
        })
        .collect()
}

/// Tensor parallelism's three collectives (`DeviceCollective`, what the model's all-reduces,
/// sequence parallelism's gathers and scatters call) on device buffers of `T` by rank `me` of
/// `size`, each result's bits against the host's rank-order sums and copies.
fn tp_collectives<T: Bits>(
    dc: &dyn DeviceCollective,
    ctx: &Arc<CudaContext>,
    me: usize,
    size: usize,
) {
    let n = 37;
    let bits = |v: &[T]| v.iter().map(|x| x.bits()).collect::<Vec<_>>();
    let run = |op: TpOp, send: Vec<T>, recv_len: usize, count: usize| -> Vec<u32> {
        let s = upload(ctx, &send).expect("upload");
        // An all-reduce runs in place: its input is its output.
        let mut r = match op {
            TpOp::AllReduce => upload(ctx, &send).expect("upload"),
            _ => DeviceBlock::new(ctx, recv_len * size_of::<T>()).expect("a block"),
        };
        let mut rv = r.view_mut::<T>(recv_len);
        let recv = rv.as_mut_ptr();
        let send = match op {
            TpOp::AllReduce => recv.cast_const(),
            _ => s.view::<T>(send.len()).as_ptr(),
        };
        let x = DeviceOperands {
            send: send.cast(),
            recv: recv.cast(),
            count,
            dtype: T::DTYPE,
            memory: rv.memory(),
        };
        dc.run(op, x).unwrap_or_else(|e| panic!("{op:?}: {e}"));
        bits(&download(r.view::<T>(recv_len)))
    };
    assert_eq!(
        run(TpOp::AllReduce, typed(n, me), n, n),
        bits(&summed::<T>(n, size)),
        "all-reduce, rank {me}"
    );
    let all: Vec<T> = (0..size).flat_map(|r| typed::<T>(n, r)).collect();
    assert_eq!(
        run(TpOp::AllGather, typed(n, me), n * size, n),
        bits(&all),
        "all-gather, rank {me}"
    );
    // Every rank's `n · size` inputs; this rank gets the sums of block `me`.
    let block = summed::<T>(n * size, size)[me * n..(me + 1) * n].to_vec();
    assert_eq!(
        run(TpOp::ReduceScatter, typed(n * size, me), n, n),
        bits(&block),
        "reduce-scatter, rank {me}"
    );
}

/// Context parallelism's ring pass (`DeviceCollective::ring_ready`, `ring_pass`): rank `me`'s
/// block goes to the next rank and the previous rank's arrives, twice round (the second pass
/// sends what the first received, as the ring does).
fn ring_pass(dc: &dyn DeviceCollective, ctx: &Arc<CudaContext>, me: usize, size: usize) {
    let n = 29;
    let mut block = upload(ctx, &typed::<f32>(n, me)).expect("upload");
    let mut next = DeviceBlock::new(ctx, n * 4).expect("a block");
    for step in 1..=2 {
        dc.ring_ready().expect("ring_ready");
        let send = block.view::<f32>(n).as_ptr();
        let recv = next.view_mut::<f32>(n).as_mut_ptr();
        dc.ring_pass(send, recv, n).expect("ring_pass");
        std::mem::swap(&mut block, &mut next);
        let from = (me + size * 2 - step) % size;
        let want: Vec<u32> = typed::<f32>(n, from).iter().map(|x| x.to_bits()).collect();
        let got: Vec<u32> = download(block.view::<f32>(n))
            .iter()
            .map(|x| x.to_bits())
            .collect();
        assert_eq!(
            got, want,
            "rank {me} of {size}, pass {step}: rank {from}'s block"
        );
    }
}

/// ZeRO's sums into each segment's owner and broadcasts from it (`DeviceReduce::start_owned`,
/// `broadcast_owned`): ZeRO-2's into the owner's shard (the window left as it was), ZeRO-3's
/// broadcasts from the owners' shards into every window, then ZeRO-1's in place: after the sums the owner holds the rank-order sum of its segments and
/// every other rank its own values; after the broadcasts every rank holds the owners' sums
/// everywhere.
fn zero1_owned<T: Bits>(dr: &mut dyn DeviceReduce, ctx: &Arc<CudaContext>, me: usize, size: usize) {
    let n = 40;
    let segments = [(0..10, 0), (10..13, size - 1), (13..40, 1 % size)];
    let mine = typed::<T>(n, me);
    let sum = summed::<T>(n, size);
    let bits = |v: &[T]| v.iter().map(|x| x.bits()).collect::<Vec<_>>();
    let mut b = upload(ctx, &mine).expect("upload");
    // The segments of `b`, and with `shard` the owner's sums into it (a block as long as the
    // window, each segment at the window's offset).
    let parts = |b: &mut DeviceBlock, shard: Option<&mut DeviceBlock>| {
        let mut whole = b.view_mut::<T>(n);
        let (base, memory) = (whole.as_mut_ptr(), whole.memory());
        let sbase = shard.map(|s| s.view_mut::<T>(n).as_mut_ptr());
        segments.clone().map(|(r, owner)| {
            // SAFETY: disjoint segments of the blocks, which outlive the call.
            let view = |p: *mut T| unsafe {
                ferrotron_dist::ViewMut::from_raw_parts(
                    std::ptr::NonNull::new(p.add(r.start)).unwrap(),
                    r.len(),
                    memory,
                )
            };
            Owned {
                part: grads_of(view(base)).expect("f32 or bf16"),
                owner,
                into: sbase.map(|s| grads_of(view(s)).expect("f32 or bf16")),
            }
        })
    };
    let mut shard = upload(ctx, &vec![T::from_f32(0.0); n]).expect("upload");
    dr.start_owned(&mut parts(&mut b, Some(&mut shard)).into_iter())
        .expect("start_owned");
    dr.land().expect("land");
    let (window, got) = (download(b.view::<T>(n)), download(shard.view::<T>(n)));
    assert_eq!(
        bits(&window),
        bits(&mine),
        "rank {me} of {size}: the window after ZeRO-2's sums"
    );
    for (r, owner) in segments.clone().into_iter().filter(|s| s.1 == me) {
        let what = format!("rank {me} of {size}: shard sums of {r:?} (owner {owner})");
        assert_eq!(bits(&got[r.clone()]), bits(&sum[r]), "{what}");
    }
    // ZeRO-3's gathers: each segment from its owner's shard (its sums now) into every rank's
    // window.
    dr.broadcast_owned(&mut parts(&mut b, Some(&mut shard)).into_iter())
        .and_then(|()| dr.land())
        .expect("broadcast_owned from the shards");
    let window: Vec<T> = download(b.view::<T>(n));
    assert_eq!(
        bits(&window),
        bits(&sum),
        "rank {me} of {size}: every window segment its owner's shard after the broadcasts"
    );
    let mut b = upload(ctx, &mine).expect("upload");
    dr.start_owned(&mut parts(&mut b, None).into_iter())
        .expect("start_owned");
    dr.land().expect("land");
    let got: Vec<T> = download(b.view::<T>(n));
    for (r, owner) in segments.clone() {
        let want = if owner == me {
            &sum[r.clone()]
        } else {
            &mine[r.clone()]
        };
        let what = format!("rank {me} of {size}: sums of {r:?} (owner {owner})");
        assert_eq!(bits(&got[r.clone()]), bits(want), "{what}");
    }
    dr.broadcast_owned(&mut parts(&mut b, None).into_iter())
        .and_then(|()| dr.land())
        .expect("broadcast_owned");
    let got: Vec<u32> = download(b.view::<T>(n)).iter().map(|x| x.bits()).collect();
    let want: Vec<u32> = sum.iter().map(|x| x.bits()).collect();
    assert_eq!(
        got, want,
        "rank {me} of {size}: every segment its owner's after the broadcasts"
    );
}

/// The tensor-parallel collectives where the activations lie, f32 and bf16, in their own type,
/// and context parallelism's ring: at world size 1 on a GPU (NCCL itself), and at 2 and 3
/// ranks (threads) on the emulator.
#[test]
fn model_group_exchanges_run_where_the_tensors_lie_in_their_type() {
    let Some(ctx) = gpu() else { return };
    let emulated = ctx.name().ok().as_deref() == Some("ferrotron CUDA emulator");
    let sizes: &[usize] = if emulated { &[1, 2, 3] } else { &[1] };
    for &size in sizes {
        let comms = world(size, Duration::from_secs(20));
        std::thread::scope(|s| {
            for c in comms {
                let ctx = ctx.clone();
                s.spawn(move || {
                    let me = c.rank();
                    let n = Nccl::new(Box::new(c), ctx.clone()).unwrap_or_else(|e| panic!("{e}"));
                    assert!(n.takes(DType::F32) && n.takes(DType::Bf16) && !n.takes(DType::F16));
                    tp_collectives::<f32>(&n, &ctx, me, size);
                    tp_collectives::<bf16>(&n, &ctx, me, size);
                    ring_pass(&n, &ctx, me, size);
                    let mut n = n;
                    zero1_owned::<f32>(&mut n, &ctx, me, size);
                    zero1_owned::<bf16>(&mut n, &ctx, me, size);
                });
            }
        });
    }
}

/// The pipeline's messages between GPUs (`DeviceP2p`): two stages, an NCCL communicator per
/// directed edge, each stage sending three messages through two device send buffers before it
/// receives any (1F1B's warm-up does so), each source overwritten at once: every message
/// arrives whole and in order. With sends that waited for their receiver this deadlocked.
/// The receiving edge times its waits and the stage's span. Two ranks: on the emulator only
/// (NCCL refuses two ranks on one GPU).
#[test]
fn pipeline_messages_go_before_their_receives_are_posted() {
    use ferrotron_dist::device_p2p::DeviceP2p;
    let Some(ctx) = gpu() else { return };
    if ctx.name().ok().as_deref() != Some("ferrotron CUDA emulator") {
        eprintln!("skipped: two pipeline stages need two GPUs (the emulator takes them on one)");
        return;
    }
    let (n, k, messages) = (37, 2, 3);
    let (fwd, bwd) = (
        world(2, Duration::from_secs(20)),
        world(2, Duration::from_secs(20)),
    );
    std::thread::scope(|s| {
        for (me, (f, b)) in fwd.into_iter().zip(bwd).enumerate() {
            let ctx = ctx.clone();
            s.spawn(move || {
                // Both stages make the edges in one order: forward (0 -> 1), then backward.
                let mut edges = [f, b].map(|c| Nccl::new(Box::new(c), ctx.clone()).unwrap());
                let [out, into] = match me {
                    0 => [0, 1],
                    _ => [1, 0],
                };
                let mut via: Vec<DeviceBlock> = (0..k)
                    .map(|_| DeviceBlock::new(&ctx, n * 4).unwrap())
                    .collect();
                let src = DeviceBlock::new(&ctx, n * 4).unwrap();
                // Every event a step uses is made before it: a send through a buffer not
                // reserved is refused.
                let (p, v) = (
                    src.view::<f32>(n).as_ptr().cast(),
                    via[0].view_mut::<f32>(n).as_mut_ptr().cast(),
                );
                let e = edges[out].send_via(p, v, 0, n * 4).unwrap_err().to_string();
                assert!(e.ends_with("send buffer 0 of 0 reserved"), "{e}");
                edges[out].reserve(k, 0).unwrap();
                edges[into].reserve(0, messages).unwrap();
                edges[into].mark(false).unwrap();
                for i in 0..messages {
                    let msg = typed::<f32>(n, 10 * me + i);
                    fill(&src, &msg);
                    let v = via[i % k].view_mut::<f32>(n).as_mut_ptr().cast();
                    let p = src.view::<f32>(n).as_ptr().cast();
                    edges[out].send_via(p, v, i % k, n * 4).unwrap();
                    // The source is the compute stream's again at once.
                    fill(&src, &[f32::NAN; 37]);
                }
                let peer = 1 - me;
                for i in 0..messages {
                    let mut dst = DeviceBlock::new(&ctx, n * 4).unwrap();
                    let d = dst.view_mut::<f32>(n).as_mut_ptr().cast();
                    edges[into].recv_into(d, n * 4).unwrap();
                    let got = bits(&download(dst.view::<f32>(n)));
                    let want = bits(&typed::<f32>(n, 10 * peer + i));
                    assert_eq!(got, want, "stage {me}: message {i} of stage {peer}");
                }
                edges[out].settle().unwrap();
                // The receives' waits and the span, timed on the device for the bubble; each
                // take starts afresh.
                edges[into].mark(true).unwrap();
                let (waited, span) = edges[into].take_times().unwrap();
                assert!(0.0 <= waited && waited <= span, "{waited} s of {span} s");
                assert_eq!(edges[into].take_times().unwrap(), (0.0, 0.0));
            });
        }
    });
}

/// Overwrites `b` with `v`, after the work issued before on the default stream.
fn fill(b: &DeviceBlock, v: &[f32]) {
    use ferrotron_engine::kernels::cuda::cudarc::driver::result;
    // SAFETY: the block holds at least `v`'s bytes (the callers' blocks of 37 f32).
    unsafe { result::memcpy_htod_sync(b.ptr(), v) }.expect("an upload");
}
