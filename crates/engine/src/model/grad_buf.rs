//! Where a backward writes parameter gradients.
//!
//! The model addresses a gradient by its parameter's range in the flat parameter order
//! ([`super::ParamTable`]). One rank without ZeRO holds every gradient in one buffer of that
//! order ([`Whole`], or a `Vec`). ZeRO-2 does not: a rank holds its shard of the reduced
//! gradients and, while a unit's backward runs, only that unit's full gradients, in a window it
//! reuses for the next unit (Rajbhandari et al. 2020, §5.2: gradients are reduced and released
//! as soon as they are complete). [`Windows`] are such windows, each at its base in the flat
//! order; a stage asking for a gradient outside them is a bug, and says which range.

use std::ops::{Index, IndexMut, Range};

/// Parameter gradients addressed by their range in the flat parameter order.
pub trait GradBuf<G> {
    /// The gradients of parameters `r`.
    fn slice(&self, r: Range<usize>) -> &[G];
    fn slice_mut(&mut self, r: Range<usize>) -> &mut [G];
    /// Two disjoint ranges at once (a weight's gradient and its bias's).
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (&mut [G], &mut [G]);
}

impl<G> Index<Range<usize>> for dyn GradBuf<G> + '_ {
    type Output = [G];
    fn index(&self, r: Range<usize>) -> &[G] {
        self.slice(r)
    }
}

impl<G> IndexMut<Range<usize>> for dyn GradBuf<G> + '_ {
    fn index_mut(&mut self, r: Range<usize>) -> &mut [G] {
        self.slice_mut(r)
    }
}

/// Mutable views of two disjoint ranges of one buffer.
pub fn two_mut<T>(buf: &mut [T], a: Range<usize>, b: Range<usize>) -> (&mut [T], &mut [T]) {
    assert!(a.end <= b.start || b.end <= a.start, "ranges overlap");
    if a.start < b.start {
        let (lo, hi) = buf.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = buf.split_at_mut(a.start);
        (&mut hi[..a.end - a.start], &mut lo[b])
    }
}

/// Every gradient, in one buffer of the flat order.
pub struct Whole<'a, G>(pub &'a mut [G]);

impl<G> GradBuf<G> for Whole<'_, G> {
    fn slice(&self, r: Range<usize>) -> &[G] {
        &self.0[r]
    }
    fn slice_mut(&mut self, r: Range<usize>) -> &mut [G] {
        &mut self.0[r]
    }
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (&mut [G], &mut [G]) {
        two_mut(self.0, a, b)
    }
}

impl<G> GradBuf<G> for Vec<G> {
    fn slice(&self, r: Range<usize>) -> &[G] {
        &self[r]
    }
    fn slice_mut(&mut self, r: Range<usize>) -> &mut [G] {
        &mut self[r]
    }
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (&mut [G], &mut [G]) {
        two_mut(self, a, b)
    }
}

/// Windows of the flat order: up to [`Windows::MAX`] buffers, each holding the gradients from
/// its base on (a unit's: a layer, the final norm, the embedding, the LM head).
pub struct Windows<'a, G> {
    parts: [Option<(usize, &'a mut [G])>; Windows::<()>::MAX],
}

impl<'a, G> Windows<'a, G> {
    pub const MAX: usize = 3;

    /// `parts`: (base, buffer) pairs (at most [`Windows::MAX`]; no allocation).
    pub fn new(parts: impl IntoIterator<Item = (usize, &'a mut [G])>) -> Self {
        let mut w = Windows {
            parts: [None, None, None],
        };
        for (i, p) in parts.into_iter().enumerate() {
            assert!(i < Self::MAX, "at most {} gradient windows", Self::MAX);
            w.parts[i] = Some(p);
        }
        w
    }

    /// The window holding `r`, and `r` relative to it.
    fn find(&self, r: &Range<usize>) -> (usize, Range<usize>) {
        for (i, p) in self.parts.iter().enumerate() {
            if let Some((base, buf)) = p {
                if r.start >= *base && r.end <= base + buf.len() {
                    return (i, r.start - base..r.end - base);
                }
            }
        }
        panic!("gradients {r:?} are outside the windows this stage was given");
    }
}

impl<G> GradBuf<G> for Windows<'_, G> {
    fn slice(&self, r: Range<usize>) -> &[G] {
        let (i, r) = self.find(&r);
        let (_, buf) = self.parts[i].as_ref().expect("found");
        &buf[r]
    }
    fn slice_mut(&mut self, r: Range<usize>) -> &mut [G] {
        let (i, r) = self.find(&r);
        let (_, buf) = self.parts[i].as_mut().expect("found");
        &mut buf[r]
    }
    fn pair_mut(&mut self, a: Range<usize>, b: Range<usize>) -> (&mut [G], &mut [G]) {
        let ((i, a), (j, b)) = (self.find(&a), self.find(&b));
        assert_eq!(i, j, "a weight and its bias live in one window");
        let (_, buf) = self.parts[i].as_mut().expect("found");
        two_mut(buf, a, b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_address_gradients_by_their_flat_range() {
        let (mut a, mut b) = (vec![0.0f32; 4], vec![0.0f32; 6]);
        let mut w = Windows::new([(10, &mut a[..]), (100, &mut b[..])]);
        let g: &mut dyn GradBuf<f32> = &mut w;
        g[11..13].fill(1.0);
        let (x, y) = g.pair_mut(104..106, 100..102);
        x.fill(2.0);
        y.fill(3.0);
        assert_eq!(a, [0.0, 1.0, 1.0, 0.0]);
        assert_eq!(b, [3.0, 3.0, 0.0, 0.0, 2.0, 2.0]);
    }

    #[test]
    #[should_panic(expected = "gradients 12..16 are outside the windows this stage was given")]
    fn a_range_outside_the_windows_is_refused() {
        let mut a = [0.0f32; 4];
        let w = Windows::new([(10, &mut a[..])]);
        let _ = w.slice(12..16);
    }
}
