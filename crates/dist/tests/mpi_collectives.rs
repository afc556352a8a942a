//! The MPI backend against serial references, run by `mpirun` (see `run_mpi.sh`; MPI
//! initialises once per process, so this binary has its own `main`). Every rank runs every
//! check (the same MPI calls whatever the outcome, so a failed check cannot hang the job); a
//! check passes when it passes on every rank. Rank 0 prints `N passed, M failed`; the exit
//! status is non-zero on any failure.
//!
//! `mpi_collectives fail|panic|exit`: rank 1 aborts, panics, or exits without finalising while
//! the others wait in an all-reduce; the job must go down, non-zero, naming rank 1.

use ferrotron_dist::mpi::{finalize, launched_by_mpirun, MpiComm};
use ferrotron_dist::{AsView, AsViewMut, CommError, Communicator, Dim, Grid};
use ferrotron_plan::Layout;

type Check = std::result::Result<(), String>;

/// Rank `r`'s test data: `n` values whose sums are exact in f32 (any order gives them).
fn exact(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (r * 1000 + i % 997) as f32 * 0.25 - 3.0)
        .collect()
}

/// Rank `r`'s test data whose sums round: the order of a reduction shows in the bits.
fn inexact(r: usize, n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((r * 7919 + i * 104_729) % 10_007) as f32 / 7.0 + 0.1)
        .collect()
}

/// The rank-order sum over `p` ranks of `f(r, n)`.
fn serial_sum(p: usize, n: usize, f: fn(usize, usize) -> Vec<f32>) -> Vec<f32> {
    let mut out = vec![0.0f32; n];
    for r in 0..p {
        for (o, x) in out.iter_mut().zip(f(r, n)) {
            *o += x;
        }
    }
    out
}

fn same(what: &str, got: &[f32], want: &[f32]) -> Check {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, want {}",
            got.len(),
            want.len()
        ));
    }
    match got.iter().zip(want).position(|(a, b)| a != b) {
        None => Ok(()),
        Some(i) => Err(format!("{what}: [{i}] = {}, want {}", got[i], want[i])),
    }
}

fn close(what: &str, got: &[f32], want: &[f32], rel: f32) -> Check {
    if got.len() != want.len() {
        return Err(format!(
            "{what}: {} elements, want {}",
            got.len(),
            want.len()
        ));
    }
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        if (a - b).abs() > rel * b.abs().max(1.0) {
            return Err(format!(
                "{what}: [{i}] = {a}, want {b} within {rel} relative"
            ));
        }
    }
    Ok(())
}

fn err(e: CommError) -> String {
    e.to_string()
}

/// Whether every rank of `c` holds the same bits in `v` (gathered, compared on each rank).
fn same_everywhere(c: &MpiComm, what: &str, v: &[f32]) -> Check {
    let mut all = vec![0.0f32; v.len() * c.size()];
    c.all_gather(v.view(), all.view_mut()).map_err(err)?;
    for (q, chunk) in all.chunks(v.len().max(1)).enumerate() {
        if chunk.iter().zip(v).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!("{what}: rank {q} has other bits than this rank"));
        }
    }
    Ok(())
}

fn all_reduce(c: &MpiComm, info: &mut Vec<String>) -> Check {
    let (r, p) = (c.rank(), c.size());
    for n in [1usize, 12, 4099, 1 << 20] {
        let mut x = exact(r, n);
        c.all_reduce_sum(x.view_mut()).map_err(err)?;
        same(
            &format!("all_reduce n={n} exact"),
            &x,
            &serial_sum(p, n, exact),
        )?;
        let mut y = inexact(r, n);
        c.all_reduce_sum(y.view_mut()).map_err(err)?;
        let mut y2 = inexact(r, n);
        c.all_reduce_sum(y2.view_mut()).map_err(err)?;
        let want = serial_sum(p, n, inexact);
        close(&format!("all_reduce n={n}"), &y, &want, 1e-6)?;
        same(&format!("all_reduce n={n} run to run"), &y2, &y)?;
        same_everywhere(c, &format!("all_reduce n={n}"), &y)?;
        let differ = y.iter().zip(&want).filter(|(a, b)| a != b).count();
        info.push(format!(
            "all_reduce n={n}: {differ} of {n} sums differ in bits from the rank-order sum"
        ));
    }
    Ok(())
}

fn reduce_scatter(c: &MpiComm) -> Check {
    let (r, p) = (c.rank(), c.size());
    let b = 1000;
    let n = b * p;
    let mut part = vec![0.0; b];
    c.reduce_scatter_sum(exact(r, n).view(), part.view_mut())
        .map_err(err)?;
    same(
        "reduce_scatter exact",
        &part,
        &serial_sum(p, n, exact)[r * b..(r + 1) * b],
    )?;
    c.reduce_scatter_sum(inexact(r, n).view(), part.view_mut())
        .map_err(err)?;
    close(
        "reduce_scatter",
        &part,
        &serial_sum(p, n, inexact)[r * b..(r + 1) * b],
        1e-6,
    )
}

fn all_gather(c: &MpiComm) -> Check {
    let (r, p, n) = (c.rank(), c.size(), 12);
    let mut g = vec![0.0; n * p];
    c.all_gather(inexact(r, n).view(), g.view_mut())
        .map_err(err)?;
    let want: Vec<f32> = (0..p).flat_map(|q| inexact(q, n)).collect();
    same("all_gather", &g, &want)
}

fn broadcast(c: &MpiComm) -> Check {
    let (r, p, n) = (c.rank(), c.size(), 4099);
    let root = 2 % p;
    let mut b = if r == root {
        inexact(root, n)
    } else {
        vec![0.0; n]
    };
    c.broadcast(b.view_mut(), root).map_err(err)?;
    same("broadcast", &b, &inexact(root, n))
}

fn all_to_all(c: &MpiComm) -> Check {
    let (r, p) = (c.rank(), c.size());
    let b = 5;
    let mut got = vec![0.0; b * p];
    c.all_to_all(inexact(r, b * p).view(), got.view_mut())
        .map_err(err)?;
    let want: Vec<f32> = (0..p)
        .flat_map(|q| inexact(q, b * p)[r * b..(r + 1) * b].to_vec())
        .collect();
    same("all_to_all", &got, &want)
}

/// Blocks of different sizes, one far above the eager limit (rank r sends rank q
/// `(r + q)·40000 + 1` values), so blocking sends of every pair are exercised.
fn all_to_all_v(c: &MpiComm) -> Check {
    let (r, p) = (c.rank(), c.size());
    let count = |from: usize, to: usize| (from + to) * 40_000 + 1;
    let block = |from: usize, to: usize| -> Vec<f32> {
        (0..count(from, to))
            .map(|i| (from * 7 + to * 3 + i % 97) as f32)
            .collect()
    };
    let send: Vec<f32> = (0..p).flat_map(|to| block(r, to)).collect();
    let sc: Vec<usize> = (0..p).map(|to| count(r, to)).collect();
    let rc: Vec<usize> = (0..p).map(|from| count(from, r)).collect();
    let mut got = vec![0.0; rc.iter().sum()];
    c.all_to_all_v(
        send.view(),
        &sc,
        got.view_mut(),
        &rc,
        &mut Default::default(),
    )
    .map_err(err)?;
    let want: Vec<f32> = (0..p).flat_map(|from| block(from, r)).collect();
    same("all_to_all_v", &got, &want)
}

fn send_recv(c: &MpiComm) -> Check {
    let (r, p) = (c.rank(), c.size());
    let (next, prev) = ((r + 1) % p, (r + p - 1) % p);
    // A ring: everyone sends first. Small messages, then one far above the eager limit
    // (send does not wait for the receiver, as in the threads backend).
    for n in [3usize, 1 << 20] {
        c.send(inexact(r, n).view(), next, 7).map_err(err)?;
        let mut got = vec![0.0; n];
        c.recv(got.view_mut(), prev, 7).map_err(err)?;
        same(&format!("ring n={n}"), &got, &inexact(prev, n))?;
    }
    // Tags keep messages apart: received in the other order than sent.
    c.send([1.0].view(), next, 1).map_err(err)?;
    c.send([2.0, 2.0].view(), next, 2).map_err(err)?;
    let mut two = [0.0; 2];
    c.recv(two.view_mut(), prev, 2).map_err(err)?;
    let mut one = [0.0; 1];
    c.recv(one.view_mut(), prev, 1).map_err(err)?;
    same("tags", &[one[0], two[0], two[1]], &[1.0, 2.0, 2.0])?;
    // A message of the wrong length is a usage error (and is consumed).
    c.send([1.0; 5].view(), next, 9).map_err(err)?;
    let mut three = [0.0; 3];
    let e = c.recv(three.view_mut(), prev, 9).map_err(err);
    let want =
        format!("rank {r}: recv: message from rank {prev} (tag 9) has 5 elements, the buffer 3");
    if e != Err(want.clone()) {
        return Err(format!("wrong-length recv gave {e:?}, want {want}"));
    }
    c.barrier().map_err(err)
}

fn started_all_reduce(c: &MpiComm) -> Check {
    let (r, p) = (c.rank(), c.size());
    let first = c.all_reduce_start(vec![r as f32; 4].into());
    let second = c.all_reduce_start(inexact(r, 1 << 18).into());
    // Work while they run, polling so that MPI progresses them, then a blocking collective.
    let mut busy = 0.0f64;
    for k in 0..20 {
        busy += (0..20_000).map(|i| ((i + k) as f64).sqrt()).sum::<f64>();
        first.is_done();
        second.is_done();
    }
    let mut third = vec![1.0f32];
    c.all_reduce_sum(third.view_mut()).map_err(err)?;
    if busy <= 0.0 {
        return Err("busy".into());
    }
    let a = first.wait().map_err(err)?;
    let b = second.wait().map_err(err)?;
    let s = (0..p).sum::<usize>() as f32;
    same("started all_reduce 1", &a, &[s; 4])?;
    close(
        "started all_reduce 2",
        &b,
        &serial_sum(p, 1 << 18, inexact),
        1e-6,
    )?;
    same("blocking after started", &third, &[p as f32])?;
    // A Pending dropped without waiting still completes on every rank.
    drop(c.all_reduce_start(vec![1.0; 8].into()));
    c.barrier().map_err(err)
}

fn started_scatter_gather(c: &MpiComm) -> Check {
    let (r, p, b) = (c.rank(), c.size(), 1000);
    let rs = c.reduce_scatter_start(inexact(r, p * b).into());
    let mut mine = vec![-1.0; p * b];
    mine[r * b..(r + 1) * b].copy_from_slice(&inexact(r, b));
    let ag = c.all_gather_start(mine.into());
    let summed = rs.wait().map_err(err)?;
    let gathered = ag.wait().map_err(err)?;
    let want = serial_sum(p, p * b, inexact);
    close(
        "started reduce_scatter",
        &summed[r * b..(r + 1) * b],
        &want[r * b..(r + 1) * b],
        1e-6,
    )?;
    let all: Vec<f32> = (0..p).flat_map(|q| inexact(q, b)).collect();
    same("started all_gather", &gathered, &all)?;
    let bad = c.all_gather_start(vec![0.0; p * b + 1].into()).wait();
    let want = format!(
        "rank {r}: all_gather_start: {} elements do not make {p} equal blocks",
        p * b + 1
    );
    if bad.as_ref().err().map(|e| e.to_string()) != Some(want.clone()) {
        return Err(format!("bad all_gather_start gave {bad:?}, want {want}"));
    }
    c.barrier().map_err(err)
}

fn grid_split(c: &MpiComm) -> Check {
    let (r, p) = (c.rank(), c.size());
    if p % 2 != 0 {
        return Err(format!(
            "the grid test needs an even number of ranks, not {p}"
        ));
    }
    // dp p/2 × tp 2 (tp innermost). With 4 ranks: {0,1} and {2,3} are tp groups, {0,2} and
    // {1,3} dp.
    let grid = Grid::new(&Layout {
        dp: p as u64 / 2,
        tp: 2,
        ..Layout::default()
    });
    let tp = c.split(&grid.group(r, Dim::Tp)).map_err(err)?;
    let dp = c.split(&grid.group(r, Dim::Dp)).map_err(err)?;
    let mut a = vec![r as f32];
    tp.all_reduce_sum(a.view_mut()).map_err(err)?;
    let mut b = vec![r as f32];
    dp.all_reduce_sum(b.view_mut()).map_err(err)?;
    let sum = |d: Dim| grid.group(r, d).iter().sum::<usize>() as f32;
    let want = (
        sum(Dim::Tp),
        sum(Dim::Dp),
        grid.coord(r, Dim::Tp),
        grid.coord(r, Dim::Dp),
    );
    let got = (a[0], b[0], tp.rank(), dp.rank());
    if got != want {
        return Err(format!("grid: rank {r} got {got:?}, want {want:?}"));
    }
    if p == 4 {
        let by_hand = [
            (1.0, 2.0, 0, 0),
            (1.0, 4.0, 1, 0),
            (5.0, 2.0, 0, 1),
            (5.0, 4.0, 1, 1),
        ][r];
        if got != by_hand {
            return Err(format!("grid: rank {r} got {got:?}, want {by_hand:?}"));
        }
    }
    if (tp.size(), dp.size(), tp.world_rank()) != (2, p / 2, r) {
        return Err("grid: sizes or world rank".into());
    }
    // Every collective on a sub-group, against the group's serial reference.
    let members = grid.group(r, Dim::Dp);
    let n = 8;
    let mut x = inexact(r, n);
    dp.all_reduce_sum(x.view_mut()).map_err(err)?;
    let mut want = vec![0.0f32; n];
    for &m in &members {
        for (w, v) in want.iter_mut().zip(inexact(m, n)) {
            *w += v;
        }
    }
    close("dp all_reduce", &x, &want, 1e-6)?;
    let mut g = vec![0.0; dp.size() * n];
    dp.all_gather(inexact(r, n).view(), g.view_mut())
        .map_err(err)?;
    let want_g: Vec<f32> = members.iter().flat_map(|&m| inexact(m, n)).collect();
    same("dp all_gather", &g, &want_g)?;
    let mut bc = inexact(r, n);
    tp.broadcast(bc.view_mut(), 1).map_err(err)?;
    same("tp broadcast", &bc, &inexact(grid.group(r, Dim::Tp)[1], n))?;
    // Point to point inside a group: ranks are the group's.
    let other = 1 - tp.rank();
    tp.send([r as f32].view(), other, 3).map_err(err)?;
    let mut got = [0.0];
    tp.recv(got.view_mut(), other, 3).map_err(err)?;
    same(
        "tp send/recv",
        &got,
        &[grid.group(r, Dim::Tp)[other] as f32],
    )?;
    // A sub-group of a sub-group, and one started reduction on it.
    let solo = tp.split(&[tp.rank()]).map_err(err)?;
    let s = solo
        .all_reduce_start(vec![r as f32].into())
        .wait()
        .map_err(err)?;
    same("split of a split", &s, &[r as f32])?;
    c.barrier().map_err(err)
}

/// A communicator moved to another thread works there (`Send`), while this thread uses the
/// world at the same time (MPI_THREAD_MULTIPLE).
fn on_another_thread(c: &MpiComm) -> Check {
    let (r, p) = (c.rank(), c.size());
    let all: Vec<usize> = (0..p).collect();
    let copy = c.split(&all).map_err(err)?;
    let t = std::thread::spawn(move || {
        let mut x = vec![r as f32; 3];
        copy.all_reduce_sum(x.view_mut()).map(|_| x).map_err(err)
    });
    let mut y = vec![1.0f32];
    if MpiComm::thread_multiple() {
        c.all_reduce_sum(y.view_mut()).map_err(err)?;
    } else {
        y[0] = p as f32;
    }
    let x = t.join().map_err(|_| "the thread panicked".to_string())??;
    same("on another thread", &x, &[(0..p).sum::<usize>() as f32; 3])?;
    same("meanwhile on this one", &y, &[p as f32])
}

fn usage_errors(c: &MpiComm) -> Check {
    let (r, p) = (c.rank(), c.size());
    let mut part = vec![0.0f32; 2];
    let e = c
        .reduce_scatter_sum([1.0; 3].view(), part.view_mut())
        .map(|_| ())
        .map_err(err);
    let want =
        format!("rank {r}: reduce_scatter_sum: send has 3 elements, expected size {p} × recv 2");
    if e != Err(want.clone()) {
        return Err(format!("{e:?}, want {want}"));
    }
    let e = c.split(&[p + 1]).map(|_| ()).map_err(err);
    let want = format!("rank {r}: split: member {} is not in a group of {p}", p + 1);
    if e != Err(want.clone()) {
        return Err(format!("{e:?}, want {want}"));
    }
    let e = c.split(&[(r + 1) % p]).map(|_| ()).map_err(err);
    if !e
        .as_ref()
        .is_err_and(|e| e.contains("this rank is not among"))
    {
        return Err(format!("split without this rank: {e:?}"));
    }
    let e = c.broadcast([0.0].view_mut(), p).map_err(err);
    if !e.as_ref().is_err_and(|e| e.contains("is not in a group")) {
        return Err(format!("broadcast root out of range: {e:?}"));
    }
    if !launched_by_mpirun() {
        return Err("launched_by_mpirun() is false under mpirun".into());
    }
    Ok(())
}

fn main() {
    let mode = std::env::args().nth(1).unwrap_or_default();
    let c = match MpiComm::world() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("MPI init: {e}");
            std::process::exit(2);
        }
    };
    let r = c.rank();
    if mode == "fail" || mode == "panic" || mode == "exit" {
        if r == 1 {
            std::thread::sleep(std::time::Duration::from_millis(200));
            if mode == "panic" {
                panic!("data shard unreadable");
            }
            if mode == "exit" {
                drop(c);
                std::process::exit(3);
            }
            c.abort("data shard unreadable");
        }
        let mut x = vec![1.0f32; 8];
        let out = c.all_reduce_sum(x.view_mut());
        eprintln!("rank {r}: survived a failed rank: {out:?}");
        std::process::exit(0);
    }
    let mut info = Vec::new();
    let checks: Vec<(&str, Check)> = vec![
        (
            "rank and size",
            if c.world_rank() == r && r < c.size() {
                Ok(())
            } else {
                Err("rank".into())
            },
        ),
        ("all_reduce_sum", all_reduce(&c, &mut info)),
        ("reduce_scatter_sum", reduce_scatter(&c)),
        ("all_gather", all_gather(&c)),
        ("broadcast", broadcast(&c)),
        ("all_to_all", all_to_all(&c)),
        ("all_to_all_v", all_to_all_v(&c)),
        ("send/recv", send_recv(&c)),
        ("barrier", c.barrier().map_err(err)),
        ("all_reduce_start", started_all_reduce(&c)),
        (
            "reduce_scatter_start, all_gather_start",
            started_scatter_gather(&c),
        ),
        ("dp×tp grid split", grid_split(&c)),
        ("a communicator on another thread", on_another_thread(&c)),
        ("usage errors", usage_errors(&c)),
    ];
    let mut failed = vec![0.0f32; checks.len()];
    for (i, (name, res)) in checks.iter().enumerate() {
        if let Err(e) = res {
            eprintln!("rank {r}: FAIL {name}: {e}");
            failed[i] = 1.0;
        }
    }
    if let Err(e) = c.all_reduce_sum(failed.view_mut()) {
        eprintln!("rank {r}: tallying: {e}");
        std::process::exit(1);
    }
    let nfail = failed.iter().filter(|&&f| f > 0.0).count();
    if r == 0 {
        for line in &info {
            println!("info: {line}");
        }
        for ((name, _), f) in checks.iter().zip(&failed) {
            println!("{} {name}", if *f > 0.0 { "FAIL" } else { "ok  " });
        }
        println!(
            "info: {} ranks, MPI_THREAD_MULTIPLE: {}",
            c.size(),
            MpiComm::thread_multiple()
        );
        println!("{} passed, {nfail} failed", checks.len() - nfail);
    }
    drop(c);
    if let Err(e) = finalize() {
        eprintln!("rank {r}: finalize: {e}");
        std::process::exit(1);
    }
    std::process::exit(if nfail == 0 { 0 } else { 1 });
}
