//! Rotary position embedding, HF `rotate_half` convention (RoFormer, Su et al. 2021, eq. 34):
//! with `x = [x1, x2]` (halves of the head dim) and per-frequency `(c, s)` at the token position,
//! `y1 = x1·c − x2·s`, `y2 = x2·c + x1·s`. Backward applies the inverse rotation
//! (`s → −s`), because the Jacobian of a rotation is the rotation itself.

use crate::dtype::Elem;
use crate::kernels::{RopeShape, RopeTable};
use rayon::prelude::*;

fn rotate<S: Elem>(s: RopeShape, table: &RopeTable, x: &mut [S], sign: f32) {
    let d = s.head_dim;
    let half = d / 2;
    assert_eq!(
        table.head_dim, d,
        "rope table head_dim {} != {}",
        table.head_dim, d
    );
    assert!(
        s.t <= table.max_pos,
        "sequence length {} exceeds rope table max_pos {}",
        s.t,
        table.max_pos
    );
    assert_eq!(x.len(), s.b * s.t * s.heads * d, "rope x len");
    let row = s.heads * d;
    x.par_chunks_mut(row).enumerate().for_each(|(bt, xr)| {
        let pos = bt % s.t;
        let cos = &table.cos[pos * half..(pos + 1) * half];
        let sin = &table.sin[pos * half..(pos + 1) * half];
        for head in xr.chunks_exact_mut(d) {
            let (x1, x2) = head.split_at_mut(half);
            for i in 0..half {
                let (c, sn) = (cos[i], sign * sin[i]);
                let (a, b) = (x1[i].to_f32(), x2[i].to_f32());
                x1[i] = S::from_f32(a * c - b * sn);
                x2[i] = S::from_f32(b * c + a * sn);
            }
        }
    });
}

pub fn forward<S: Elem>(s: RopeShape, table: &RopeTable, x: &mut [S]) {
    rotate(s, table, x, 1.0);
}

pub fn backward<S: Elem>(s: RopeShape, table: &RopeTable, dx: &mut [S]) {
    rotate(s, table, dx, -1.0);
}
