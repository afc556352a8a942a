//! The threads backend against serial references: every collective, sub-groups of a layout's
//! grid, non-blocking all-reduce overlapping other work, and a failing rank taking the job down
//! with its name instead of a hang.

use ferrotron_dist::threads::{run, ThreadComm};
use ferrotron_dist::{AsView, AsViewMut, CommError, Communicator, Dim, Grid, Memory, Region};
use ferrotron_plan::Layout;
use ferrotron_view::carve;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(20);

/// Rank `r`'s test data: `n` values that differ by rank and position.
fn data(r: usize, n: usize) -> Vec<f32> {
    (0..n).map(|i| (r * 1000 + i) as f32 * 0.25 - 3.0).collect()
}

fn all_ok<T>(v: Vec<Result<T, String>>) -> Vec<T> {
    v.into_iter().map(|r| r.unwrap()).collect()
}

#[test]
fn collectives_match_serial_references() {
    let p = 4;
    let n = 12;
    let out = all_ok(run(p, T, move |r, c: ThreadComm| {
        let e = |x: CommError| x.to_string();
        assert_eq!((c.rank(), c.size()), (r, p));
        let mut sum = data(r, n);
        c.all_reduce_sum(sum.view_mut()).map_err(e)?;
        let mut part = vec![0.0; n / p];
        c.reduce_scatter_sum(data(r, n).view(), part.view_mut())
            .map_err(e)?;
        let mut gathered = vec![0.0; n * p];
        c.all_gather(data(r, n).view(), gathered.view_mut())
            .map_err(e)?;
        let mut b = if r == 2 { data(2, n) } else { vec![0.0; n] };
        c.broadcast(b.view_mut(), 2).map_err(e)?;
        let mut a2a = vec![0.0; n];
        c.all_to_all(data(r, n).view(), a2a.view_mut()).map_err(e)?;
        // A ring of point-to-point messages: to the next rank, from the previous one.
        c.send(data(r, 3).view(), (r + 1) % p, 7).map_err(e)?;
        let mut got = vec![0.0; 3];
        c.recv(got.view_mut(), (r + p - 1) % p, 7).map_err(e)?;
        c.barrier().map_err(e)?;
        Ok((sum, part, gathered, b, a2a, got))
    }));
    let want_sum: Vec<f32> = (0..n)
        .map(|i| (0..p).map(|r| data(r, n)[i]).sum())
        .collect();
    let b = n / p;
    for (r, (sum, part, gathered, bc, a2a, got)) in out.iter().enumerate() {
        assert_eq!(sum, &want_sum, "rank {r} all_reduce");
        assert_eq!(
            part,
            &want_sum[r * b..(r + 1) * b],
            "rank {r} reduce_scatter"
        );
        let want_gather: Vec<f32> = (0..p).flat_map(|q| data(q, n)).collect();
        assert_eq!(gathered, &want_gather, "rank {r} all_gather");
        assert_eq!(bc, &data(2, n), "rank {r} broadcast");
        let want_a2a: Vec<f32> = (0..p)
            .flat_map(|q| data(q, n)[r * b..(r + 1) * b].to_vec())
            .collect();
        assert_eq!(a2a, &want_a2a, "rank {r} all_to_all");
        assert_eq!(got, &data((r + p - 1) % p, 3), "rank {r} recv");
    }
    // The sum is in rank order: the same bits on every rank.
    for (sum, ..) in &out {
        assert!(sum
            .iter()
            .zip(&out[0].0)
            .all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn groups_of_a_layout_grid_reduce_apart() {
    // dp 2 × tp 2 (tp innermost): ranks {0,1} and {2,3} are tp groups, {0,2} and {1,3} dp.
    let layout = Layout {
        dp: 2,
        tp: 2,
        ..Layout::default()
    };
    let grid = Grid::new(&layout);
    assert_eq!(grid.world(), 4);
    assert_eq!(grid.group(3, Dim::Tp), vec![2, 3]);
    assert_eq!(grid.group(3, Dim::Dp), vec![1, 3]);
    assert_eq!((grid.coord(3, Dim::Dp), grid.coord(3, Dim::Tp)), (1, 1));
    let g = grid.clone();
    let out = all_ok(run(4, T, move |r, world: ThreadComm| {
        let e = |x: CommError| x.to_string();
        let tp = world.split(&g.group(r, Dim::Tp)).map_err(e)?;
        let dp = world.split(&g.group(r, Dim::Dp)).map_err(e)?;
        let mut a = vec![r as f32];
        tp.all_reduce_sum(a.view_mut()).map_err(e)?;
        let mut b = vec![r as f32];
        dp.all_reduce_sum(b.view_mut()).map_err(e)?;
        Ok((a[0], b[0], tp.rank(), dp.rank()))
    }));
    assert_eq!(out[0], (1.0, 2.0, 0, 0));
    assert_eq!(out[1], (1.0, 4.0, 1, 0));
    assert_eq!(out[2], (5.0, 2.0, 0, 1));
    assert_eq!(out[3], (5.0, 4.0, 1, 1));
    // pp outermost, then dp, ep, cp, tp.
    let big = Grid::new(&Layout {
        dp: 2,
        tp: 2,
        pp: 2,
        cp: 2,
        ..Layout::default()
    });
    assert_eq!(big.world(), 16);
    assert_eq!(big.group(0, Dim::Cp), vec![0, 2]);
    assert_eq!(big.group(0, Dim::Dp), vec![0, 4]);
    assert_eq!(big.group(0, Dim::Pp), vec![0, 8]);
}

#[test]
fn a_started_all_reduce_completes_while_the_rank_computes() {
    let out = all_ok(run(3, T, |r, c: ThreadComm| {
        let e = |x: CommError| x.to_string();
        let first = c.all_reduce_start(vec![r as f32; 4].into());
        let second = c.all_reduce_start(vec![10.0 * r as f32; 4].into());
        // Work while the reductions run, then a blocking collective after them.
        let busy: f64 = (0..200_000).map(|i| (i as f64).sqrt()).sum();
        let mut third = vec![1.0f32];
        c.all_reduce_sum(third.view_mut()).map_err(e)?;
        assert!(busy > 0.0);
        let a = first.wait().map_err(e)?;
        let b = second.wait().map_err(e)?;
        Ok((a[0], b[0], third[0]))
    }));
    for o in out {
        assert_eq!(o, (3.0, 30.0, 3.0), "in the order started, on every rank");
    }
}

#[test]
fn started_reduce_scatter_and_all_gather_work_in_place() {
    let (p, b) = (3, 5);
    let out = all_ok(run(p, T, move |r, c: ThreadComm| {
        let e = |x: CommError| x.to_string();
        let rs = c.reduce_scatter_start(data(r, p * b).into());
        // A block filled by this rank only; the others are garbage to be overwritten.
        let mut mine = vec![-1.0; p * b];
        mine[r * b..(r + 1) * b].copy_from_slice(&data(r, b));
        let ag = c.all_gather_start(mine.into());
        let summed = rs.wait().map_err(e)?;
        let gathered = ag.wait().map_err(e)?;
        let bad = c.reduce_scatter_start(vec![0.0; p * b + 1].into()).wait();
        Ok((summed[r * b..(r + 1) * b].to_vec(), gathered.to_vec(), bad))
    }));
    for (r, (summed, gathered, bad)) in out.into_iter().enumerate() {
        let want: Vec<f32> = (r * b..(r + 1) * b)
            .map(|i| (0..p).fold(0.0f32, |acc, q| acc + data(q, p * b)[i]))
            .collect();
        assert_eq!(
            summed, want,
            "rank {r}: its block of the sum, in rank order"
        );
        let all: Vec<f32> = (0..p).flat_map(|q| data(q, b)).collect();
        assert_eq!(gathered, all, "rank {r}: every rank's block");
        assert_eq!(
            bad.unwrap_err().to_string(),
            format!("rank {r}: reduce_scatter_start: 16 elements do not make 3 equal blocks")
        );
    }
}

#[test]
fn a_started_collective_runs_in_a_planned_span_and_refuses_device_memory() {
    let out = all_ok(run(2, T, |r, c: ThreadComm| {
        let e = |x: CommError| x.to_string();
        // Two spans of one block, as the two buckets of the plan's `dp.grad_buckets`.
        let mut spans = carve::<f32>(&[4, 6]);
        let mut second = spans.pop().unwrap();
        let mut first = spans.pop().unwrap();
        first.copy_from_slice(&data(r, 4));
        second.set_len(2);
        second.copy_from_slice(&data(r, 2));
        let at = (first.as_ptr(), second.as_ptr());
        let (a, b) = (c.all_reduce_start(first), c.all_reduce_start(second));
        let (a, b) = (a.wait().map_err(e)?, b.wait().map_err(e)?);
        let in_place = (a.as_ptr(), b.as_ptr()) == at && b.capacity() == 6;
        // A span of a device's memory: a host backend refuses it by its memory, on every rank
        // alike (nothing is exchanged), and hands nothing back.
        let mut raw = [0.0f32; 3];
        let keep: Arc<dyn Send + Sync> = Arc::new(());
        // SAFETY: never dereferenced: the backend refuses it before.
        let dev = unsafe {
            Region::from_raw_parts(NonNull::from(&mut raw[0]), 3, Memory::Device(0), keep)
        };
        let refused = c.all_gather_start(dev).wait().map(drop).map_err(e);
        Ok((a.to_vec(), b.to_vec(), in_place, refused))
    }));
    let sum = |n| -> Vec<f32> { (0..n).map(|i| data(0, n)[i] + data(1, n)[i]).collect() };
    for (r, (a, b, in_place, refused)) in out.into_iter().enumerate() {
        assert_eq!((a, b), (sum(4), sum(2)), "rank {r}");
        assert!(in_place, "rank {r}: each sum lands in its own span");
        assert_eq!(
            refused.unwrap_err(),
            format!("rank {r}: all_gather_start: the buffer is in device 0 memory, which this host communicator cannot read (use a device communicator)")
        );
    }
}

#[test]
fn a_failing_rank_takes_the_job_down_naming_itself() {
    // Rank 1 fails before the collective the others wait in: they stop within a poll interval
    // with rank 1's error, long before the 20 s timeout.
    let t0 = Instant::now();
    let out = run(4, T, |r, c: ThreadComm| {
        if r == 1 {
            std::thread::sleep(Duration::from_millis(100));
            return Err("data shard unreadable".into());
        }
        let mut x = vec![1.0f32; 8];
        c.all_reduce_sum(x.view_mut()).map_err(|e| e.to_string())?;
        Ok(())
    });
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    for (r, o) in out.iter().enumerate() {
        let e = o.as_ref().expect_err("every rank fails");
        if r == 1 {
            assert_eq!(e, "data shard unreadable");
        } else {
            assert_eq!(e, "rank 1 failed: data shard unreadable", "rank {r}");
        }
    }
    // A panicking rank, and a rank that never arrives (caught by the timeout).
    let out = run(2, T, |r, c: ThreadComm| {
        if r == 0 {
            panic!("boom");
        }
        c.barrier().map_err(|e| e.to_string())
    });
    assert_eq!(out[0].as_ref().unwrap_err(), "rank 0 panicked");
    assert_eq!(out[1].as_ref().unwrap_err(), "rank 0 failed: panicked");
    let out = run(2, Duration::from_millis(300), |r, c: ThreadComm| {
        if r == 0 {
            std::mem::forget(c); // gone without a word
            return Ok(());
        }
        c.barrier().map_err(|e| e.to_string())
    });
    assert!(out[0].is_ok());
    let e = out[1].as_ref().unwrap_err();
    assert!(
        e.contains("rank 1: no answer from the group within 0.3 s in barrier"),
        "{e}"
    );
}

#[test]
fn bad_calls_are_usage_errors() {
    let out = run(2, T, |r, c: ThreadComm| {
        let mut x = vec![0.0f32; 3 + r];
        let e = c.all_reduce_sum(x.view_mut()).unwrap_err().to_string();
        let mut part = vec![0.0f32; 2];
        let e2 = c
            .reduce_scatter_sum([1.0; 3].view(), part.view_mut())
            .unwrap_err()
            .to_string();
        let e3 = c
            .split(&[5])
            .err()
            .map(|x| x.to_string())
            .unwrap_or_default();
        Ok::<_, String>((e, e2, e3))
    });
    for (r, o) in out.into_iter().enumerate() {
        let (e, e2, e3) = o.unwrap();
        assert_eq!(
            e,
            format!("rank {r}: all_reduce_sum: ranks passed different lengths [3, 4]")
        );
        assert_eq!(
            e2,
            format!("rank {r}: reduce_scatter_sum: send has 3 elements, expected size 2 × recv 2")
        );
        assert_eq!(
            e3,
            format!("rank {r}: split: member 5 is not in a group of 2")
        );
    }
}

/// Expert parallelism's dispatch: rank r sends rank p `r + p` values (none from rank 0 to
/// itself), every rank receives each block in rank order, whatever the pairs' sizes.
#[test]
fn all_to_all_v_moves_blocks_of_any_size() {
    fn count(from: usize, to: usize) -> usize {
        from + to
    }
    fn block(from: usize, to: usize) -> Vec<f32> {
        (0..count(from, to))
            .map(|i| (from * 100 + to * 10 + i) as f32)
            .collect()
    }
    let p = 3;
    let out = all_ok(run(p, T, move |r, c: ThreadComm| {
        let send: Vec<f32> = (0..p).flat_map(|to| block(r, to)).collect();
        let sc: Vec<usize> = (0..p).map(|to| count(r, to)).collect();
        let rc: Vec<usize> = (0..p).map(|from| count(from, r)).collect();
        // Room to spare: only the first Σ rc elements are written.
        let mut recv = vec![-1.0; rc.iter().sum::<usize>() + 2];
        let mut message = Region::default();
        c.all_to_all_v(send.view(), &sc, recv.view_mut(), &rc, &mut message)
            .map_err(|e| e.to_string())?;
        let bad = c
            .all_to_all_v(send.view(), &sc[..2], recv.view_mut(), &rc, &mut message)
            .unwrap_err()
            .to_string();
        Ok((recv, bad))
    }));
    for (r, (recv, bad)) in out.into_iter().enumerate() {
        let want: Vec<f32> = (0..p).flat_map(|from| block(from, r)).collect();
        assert_eq!(&recv[..want.len()], &want[..], "rank {r}");
        assert_eq!(
            &recv[want.len()..],
            &[-1.0, -1.0],
            "rank {r}: nothing past the counts"
        );
        assert_eq!(
            bad,
            format!("rank {r}: all_to_all_v: 2 send and 3 receive counts for a group of 3")
        );
    }
}

/// The threads backend reads host memory: a view of device memory (what a GPU communicator
/// would take) is refused with a usage error naming the memory, never read as a host address.
#[test]
fn a_device_view_is_a_usage_error_on_a_host_backend() {
    use ferrotron_dist::{Memory, ViewMut};
    use std::ptr::NonNull;
    let out = run(1, T, |_, c: ThreadComm| {
        let mut x = [0.0f32; 4];
        // SAFETY: the backend refuses the view before it would read it.
        let dev = unsafe {
            ViewMut::from_raw_parts(NonNull::from(&mut x[..]).cast(), 4, Memory::Device(0))
        };
        Ok(c.all_reduce_sum(dev).unwrap_err().to_string())
    });
    assert_eq!(
        out[0].as_deref(),
        Ok(
            "rank 0: all_reduce_sum: the buffer is in device 0 memory, which this host \
         communicator cannot read (use a device communicator)"
        )
    );
}
