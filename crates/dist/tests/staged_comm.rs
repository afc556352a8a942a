//! The host-staged communicator (`ferrotron_dist::Staged`) on the emulated device: every
//! collective and message on device views, through a staging buffer small enough to cut each
//! one into chunks or large enough for one, gives the threads backend's result on host buffers
//! bit for bit; bad input is refused with its reason; the staging buffer is allocated once.

use ferrotron_dist::threads::{run, ThreadComm};
use ferrotron_dist::{AsView, AsViewMut, CommError, Communicator, Staged};
use ferrotron_engine::kernels::view::{DeviceCopy, HostStaging, Memory, View, ViewMut};
use ferrotron_engine::kernels::{emulated, emulated_mut, EmulatedDevice};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

const T: Duration = Duration::from_secs(20);

/// Rank `r`'s `n` values, of magnitudes from 1e-3 to 1e3, so that a sum in another order
/// would round differently.
fn data(r: usize, n: usize, salt: usize) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let k = (r * 7919 + i * 104_729 + salt * 31) % 1000;
            let scale = [1e-3f32, 1.0, 1e3][(i + r) % 3];
            (k as f32 - 500.0) * 0.37 * scale
        })
        .collect()
}

/// Elements rank `from` sends rank `to` in the all-to-all-v (differ by pair, some zero).
fn count(from: usize, to: usize) -> usize {
    ((from + 2 * to) % 3) * 5 + usize::from(from == to)
}

/// Where a rank's buffers live: the host, or emulated device `ordinal`.
#[derive(Clone, Copy)]
enum Mem {
    Host,
    Device(u32),
}

impl Mem {
    fn view(self, v: &[f32]) -> View<'_, f32> {
        match self {
            Mem::Host => v.view(),
            Mem::Device(d) => emulated(v, d),
        }
    }
    fn view_mut(self, v: &mut [f32]) -> ViewMut<'_, f32> {
        match self {
            Mem::Host => v.view_mut(),
            Mem::Device(d) => emulated_mut(v, d),
        }
    }
}

/// Every collective and message of `c` on buffers in `mem`; each result, in order.
fn exercise(c: &dyn Communicator, mem: Mem) -> Result<Vec<Vec<f32>>, CommError> {
    let (r, p) = (c.rank(), c.size());
    let n = 6 * p + 5;
    let mut out = Vec::new();

    let mut sum = data(r, n, 1);
    c.all_reduce_sum(mem.view_mut(&mut sum))?;
    out.push(sum);

    let m = 13;
    let send = data(r, p * m, 2);
    let mut part = vec![0.0; m];
    c.reduce_scatter_sum(mem.view(&send), mem.view_mut(&mut part))?;
    out.push(part);

    let mine = data(r, m, 3);
    let mut gathered = vec![0.0; p * m];
    c.all_gather(mem.view(&mine), mem.view_mut(&mut gathered))?;
    out.push(gathered);

    let mut b = if r == p - 1 {
        data(r, n, 4)
    } else {
        vec![0.0; n]
    };
    c.broadcast(mem.view_mut(&mut b), p - 1)?;
    out.push(b);

    let send = data(r, p * 9, 5);
    let mut a2a = vec![0.0; p * 9];
    c.all_to_all(mem.view(&send), mem.view_mut(&mut a2a))?;
    out.push(a2a);

    let sc: Vec<usize> = (0..p).map(|q| count(r, q)).collect();
    let rc: Vec<usize> = (0..p).map(|q| count(q, r)).collect();
    let send = data(r, sc.iter().sum::<usize>() + 2, 6);
    let mut got = vec![-1.0; rc.iter().sum::<usize>() + 3];
    let mut message = ferrotron_dist::Region::default();
    c.all_to_all_v(
        mem.view(&send),
        &sc,
        mem.view_mut(&mut got),
        &rc,
        &mut message,
    )?;
    out.push(got);

    // A ring of messages longer than the small staging buffer.
    let msg = data(r, 23, 7);
    c.send(mem.view(&msg), (r + 1) % p, 9)?;
    let mut ring = vec![0.0; 23];
    c.recv(mem.view_mut(&mut ring), (r + p - 1) % p, 9)?;
    out.push(ring);

    // A started send (a host buffer) received into device memory.
    let pending = c.send_start(data(r, 5, 8).into(), (r + 1) % p, 10);
    let mut ring = vec![0.0; 5];
    c.recv(mem.view_mut(&mut ring), (r + p - 1) % p, 10)?;
    pending.wait()?;
    out.push(ring);

    // A sub-group: the ranks of this rank's parity.
    let members: Vec<usize> = (r % 2..p).step_by(2).collect();
    let sub = c.split_named(&members, "parity")?;
    let mut s = data(r, n, 11);
    sub.all_reduce_sum(mem.view_mut(&mut s))?;
    out.push(s);
    c.barrier()?;
    Ok(out)
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|x| x.iter().map(|f| f.to_bits()).collect())
        .collect()
}

/// The threads backend on host buffers.
fn reference(p: usize) -> Vec<Vec<Vec<u32>>> {
    run(p, T, |_, c: ThreadComm| {
        exercise(&c, Mem::Host)
            .map(|o| bits(&o))
            .map_err(|e| e.to_string())
    })
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

/// The staged communicator on emulated device views (ranks share devices 0 and 1 in turn).
fn staged(p: usize, capacity: usize) -> Vec<Vec<Vec<u32>>> {
    run(p, T, move |r, c: ThreadComm| {
        let dev = EmulatedDevice {
            ordinal: (r % 2) as u32,
        };
        let s = Staged::new(Box::new(c), Arc::new(dev), capacity).map_err(|e| e.to_string())?;
        exercise(&s, Mem::Device(dev.ordinal))
            .map(|o| bits(&o))
            .map_err(|e| e.to_string())
    })
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

#[test]
fn every_collective_equals_the_host_backend_bit_for_bit() {
    for p in 2..=4 {
        let want = reference(p);
        // 2p + 1: every collective and message in several chunks, the last one short; 4096:
        // each in one.
        for capacity in [2 * p + 1, 4096] {
            let got = staged(p, capacity);
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                for (k, (gk, wk)) in g.iter().zip(w).enumerate() {
                    assert_eq!(
                        gk, wk,
                        "{p} ranks, capacity {capacity}: rank {r} result {k}"
                    );
                }
                assert_eq!(g.len(), w.len());
            }
        }
    }
}

/// Host views through the staged communicator take the same chunks, so a rank whose buffers
/// are on the host talks with ranks whose buffers are on a device.
#[test]
fn host_and_device_ranks_mix() {
    let got: Vec<_> = run(3, T, |r, c: ThreadComm| {
        let s = Staged::new(Box::new(c), Arc::new(EmulatedDevice { ordinal: 0 }), 7)
            .map_err(|e| e.to_string())?;
        let mem = if r == 1 { Mem::Host } else { Mem::Device(0) };
        exercise(&s, mem)
            .map(|o| bits(&o))
            .map_err(|e| e.to_string())
    })
    .into_iter()
    .map(Result::unwrap)
    .collect();
    assert_eq!(got, reference(3));
}

/// The emulated device, counting its staging allocations.
#[derive(Debug)]
struct Counting {
    dev: EmulatedDevice,
    stagings: Arc<AtomicUsize>,
}

impl DeviceCopy for Counting {
    fn memory(&self) -> Memory {
        self.dev.memory()
    }
    fn download(&self, src: View<'_, f32>, dst: &mut [f32]) -> Result<(), String> {
        self.dev.download(src, dst)
    }
    fn upload(&self, src: &[f32], dst: ViewMut<'_, f32>) -> Result<(), String> {
        self.dev.upload(src, dst)
    }
    fn staging(&self, len: usize) -> Result<Box<dyn HostStaging>, String> {
        self.stagings.fetch_add(1, Relaxed);
        self.dev.staging(len)
    }
}

#[test]
fn the_staging_buffer_is_allocated_once_per_group() {
    let counts: Vec<usize> = run(2, T, |_, c: ThreadComm| {
        let stagings = Arc::new(AtomicUsize::new(0));
        let dev = Counting {
            dev: EmulatedDevice { ordinal: 0 },
            stagings: stagings.clone(),
        };
        let s = Staged::new(Box::new(c), Arc::new(dev), 5).map_err(|e| e.to_string())?;
        for _ in 0..3 {
            exercise(&s, Mem::Device(0)).map_err(|e| e.to_string())?;
        }
        // The world's buffer, and one for each of the three sub-groups split.
        Ok(stagings.load(Relaxed))
    })
    .into_iter()
    .map(Result::unwrap)
    .collect();
    assert_eq!(counts, [4, 4]);
}

/// What each rank's `f` returns on a staged communicator of `capacity` elements, as text.
fn errors(
    p: usize,
    capacity: impl Fn(usize) -> usize + Send + Sync + 'static,
    f: impl Fn(usize, &Staged) -> Result<(), CommError> + Send + Sync + 'static,
) -> Vec<String> {
    run(p, T, move |r, c: ThreadComm| {
        let s = Staged::new(
            Box::new(c),
            Arc::new(EmulatedDevice { ordinal: 0 }),
            capacity(r),
        );
        match s.and_then(|s| f(r, &s)) {
            Ok(()) => Err("no error".into()),
            Err(e) => Ok(e.to_string()),
        }
    })
    .into_iter()
    .map(Result::unwrap)
    .collect()
}

#[test]
fn bad_input_is_refused_with_its_reason() {
    let other_device = errors(
        2,
        |_| 8,
        |_, s| s.all_reduce_sum(emulated_mut(&mut [1.0; 4], 1)),
    );
    assert_eq!(
        other_device[1],
        "rank 1: all_reduce_sum: the buffer is in device 1 memory, and this staged communicator copies device 0 memory"
    );
    let shape = errors(
        2,
        |_| 8,
        |_, s| s.reduce_scatter_sum(emulated(&[0.0; 7], 0), emulated_mut(&mut [0.0; 3], 0)),
    );
    assert_eq!(
        shape[0],
        "rank 0: reduce_scatter_sum: send has 7 elements, expected size 2 × recv 3"
    );
    let root = errors(
        2,
        |_| 8,
        |_, s| s.broadcast(emulated_mut(&mut [0.0; 3], 0), 2),
    );
    assert_eq!(root[1], "rank 1: broadcast: root 2 is not in a group of 2");
    let differ = errors(2, |r| 8 + 8 * r, |_, _| Ok(()));
    assert_eq!(
        differ[0],
        "rank 0: staged: the ranks' staging capacities differ ([8, 16] elements): give every rank the same"
    );
    let small = errors(2, |_| 3, |_, _| Ok(()));
    assert_eq!(
        small[1],
        "rank 1: staged: a staging capacity of 3 elements is below 2 × the group's 2 ranks"
    );
    let long = errors(
        2,
        |_| 8,
        |r, s| s.send_start(vec![0.0; 9].into(), 1 - r, 3).wait().map(drop),
    );
    assert_eq!(
        long[0],
        "rank 0: send_start: a message of 9 elements exceeds the staging buffer of 8 (its receiver takes at most one chunk): plan a larger staging capacity"
    );
}
