//! [`Region`]: an owned, exclusive span of elements in some memory — a [`ViewMut`] without a
//! borrow. An operation in flight (a communicator's `all_reduce_start`, `send_start`, …) must
//! own its buffer until it completes, which a borrowed view cannot promise (a forgotten
//! handle would end the borrow while the operation still writes); a region is moved into the
//! operation and handed back when it is waited for.
//!
//! Its memory is a `Vec` it owns, or a planned place in a block that outlives it (a span of
//! the rank's arena at the plan's offset), which it keeps alive through a shared handle: the
//! buffers of the overlapped collectives then need no heap allocation of their own. A region
//! has a fixed capacity (its planned length) and a length that an operation uses, set in
//! place without allocating ([`Region::set_len`]).

use crate::{AsView, AsViewMut, Memory, View, ViewMut};
use std::fmt;
use std::ptr::NonNull;
use std::sync::Arc;

/// What keeps a region's memory alive.
enum Keep<T> {
    /// The region's own heap buffer (never touched but to drop it: the region's pointer
    /// addresses its elements).
    Vec(#[allow(dead_code)] Vec<T>),
    /// A block the region is a span of (the rank's arena), freed when its last span goes.
    Block(#[allow(dead_code)] Arc<dyn Send + Sync>),
}

/// `len` of `capacity` elements of `T` at a fixed place in [`Memory`] `mem`, owned uniquely.
pub struct Region<T> {
    ptr: NonNull<T>,
    len: usize,
    capacity: usize,
    mem: Memory,
    _keep: Keep<T>,
}

// SAFETY: a region is the unique owner of its elements, as a `Vec<T>` is; its block handle is
// `Send + Sync`.
unsafe impl<T: Send> Send for Region<T> {}
unsafe impl<T: Sync> Sync for Region<T> {}

impl<T> Region<T> {
    /// A span of `capacity` elements at `ptr` in `mem`, kept alive by `block`.
    ///
    /// # Safety
    /// `ptr` must address `capacity` initialised elements in `mem` that stay valid while
    /// `block` lives, and that nothing but this region reads or writes while it lives (the
    /// spans carved from one block do not overlap).
    pub unsafe fn from_raw_parts(
        ptr: NonNull<T>,
        capacity: usize,
        mem: Memory,
        block: Arc<dyn Send + Sync>,
    ) -> Self {
        Region {
            ptr,
            len: capacity,
            capacity,
            mem,
            _keep: Keep::Block(block),
        }
    }

    /// Elements in use.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Elements it can hold (its planned length).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn memory(&self) -> Memory {
        self.mem
    }

    /// Uses its first `len` elements (they keep their values: every element of the capacity
    /// is initialised). Panics past the capacity, naming both: a region never grows.
    #[track_caller]
    pub fn set_len(&mut self, len: usize) {
        assert!(
            len <= self.capacity,
            "a region of {} elements cannot hold {len}",
            self.capacity
        );
        self.len = len;
    }

    /// Uses none of its elements (as `Vec::clear`, keeping the capacity and the place).
    pub fn clear(&mut self) {
        self.len = 0;
    }

    /// The `Vec` a heap region owns, cut to the elements in use (no copy), or the region
    /// itself back when it is a span of a block.
    pub fn into_vec(self) -> Result<Vec<T>, Self> {
        match self._keep {
            Keep::Vec(mut v) => {
                v.truncate(self.len);
                Ok(v)
            }
            keep => Err(Region {
                _keep: keep,
                ..self
            }),
        }
    }

    /// The elements in use, read-only.
    pub fn as_view(&self) -> View<'_, T> {
        // SAFETY: `len <= capacity` initialised elements this region owns, shared while
        // `self` is borrowed.
        unsafe { View::from_raw_parts(self.ptr, self.len, self.mem) }
    }

    /// The elements in use, writable.
    pub fn as_view_mut(&mut self) -> ViewMut<'_, T> {
        // SAFETY: as `as_view`, borrowed uniquely.
        unsafe { ViewMut::from_raw_parts(self.ptr, self.len, self.mem) }
    }

    /// The elements in use as a host slice; panics naming the memory when it is a device's
    /// (as [`View::host`]).
    #[track_caller]
    pub fn host(&self) -> &[T] {
        self.as_view().host()
    }

    /// [`Region::host`], writable.
    #[track_caller]
    pub fn host_mut(&mut self) -> &mut [T] {
        self.as_view_mut().host_mut()
    }
}

impl<T: Copy> Region<T> {
    /// Uses its first `len` elements, those past the ones in use now set to `fill` (a host
    /// region only, as `Vec::resize` without the allocation).
    #[track_caller]
    pub fn resize(&mut self, len: usize, fill: T) {
        let old = self.len;
        self.set_len(len);
        if len > old {
            self.host_mut()[old..].fill(fill);
        }
    }
}

impl<T: Copy + Default> Region<T> {
    /// Uses `len` elements, replaced first by a new host region of `len` default elements when
    /// it holds fewer: for a buffer sized by its uses (a message, a few small sums), which
    /// allocates only until it holds the largest. (A planned region is made at its size and
    /// never needs this.)
    pub fn fit(&mut self, len: usize) {
        if len > self.capacity {
            *self = vec![T::default(); len].into();
        }
        self.set_len(len);
    }
}

impl<T> From<Vec<T>> for Region<T> {
    /// A host region owning `v` (its length is the capacity: what is past it is not
    /// initialised).
    fn from(mut v: Vec<T>) -> Self {
        let (len, ptr) = (
            v.len(),
            NonNull::new(v.as_mut_ptr()).expect("a Vec's pointer"),
        );
        Region {
            ptr,
            len,
            capacity: len,
            mem: Memory::Host,
            _keep: Keep::Vec(v),
        }
    }
}

impl<T> Default for Region<T> {
    /// An empty host region.
    fn default() -> Self {
        Vec::new().into()
    }
}

impl<T> std::ops::Deref for Region<T> {
    type Target = [T];
    /// The host slice in use (panics on a device's memory, as [`View::host`]).
    fn deref(&self) -> &[T] {
        self.host()
    }
}

impl<T> std::ops::DerefMut for Region<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        self.host_mut()
    }
}

impl<'a, T> IntoIterator for &'a Region<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;
    fn into_iter(self) -> Self::IntoIter {
        self.host().iter()
    }
}

impl<T> AsView<T> for Region<T> {
    fn view(&self) -> View<'_, T> {
        self.as_view()
    }
}

impl<T> AsViewMut<T> for Region<T> {
    fn view_mut(&mut self) -> ViewMut<'_, T> {
        self.as_view_mut()
    }
}

impl<T> fmt::Debug for Region<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Region[{} of {}; {}]", self.len, self.capacity, self.mem)
    }
}

/// Carves a block of `lens.iter().sum()` host elements, zeroed, into one region per length,
/// in order and without gaps: the spans of one planned buffer (the data-parallel buckets
/// of `dp.grad_buckets`), one allocation of exactly the planned size. The block is freed with
/// the last of its regions.
pub fn carve<T: Copy + Default + Send + Sync + 'static>(lens: &[usize]) -> Vec<Region<T>> {
    let block = vec![T::default(); lens.iter().sum()];
    carve_block(block.into_boxed_slice(), lens)
}

/// [`carve`] of an existing block (its length the sum of `lens`).
fn carve_block<T: Send + Sync + 'static>(block: Box<[T]>, lens: &[usize]) -> Vec<Region<T>> {
    assert_eq!(
        block.len(),
        lens.iter().sum::<usize>(),
        "a block is carved whole"
    );
    let base = NonNull::new(Box::into_raw(block) as *mut T).expect("a box's pointer");
    let owner: Arc<dyn Send + Sync> = Arc::new(Block {
        ptr: base,
        len: lens.iter().sum(),
    });
    let mut at = 0;
    lens.iter()
        .map(|&n| {
            // SAFETY: `at + n` stays inside the block; the spans do not overlap, and `owner`
            // keeps the block alive for each.
            let r = unsafe {
                Region::from_raw_parts(
                    NonNull::new_unchecked(base.as_ptr().add(at)),
                    n,
                    Memory::Host,
                    owner.clone(),
                )
            };
            at += n;
            r
        })
        .collect()
}

/// A host block that regions are spans of; freed once no region holds it.
struct Block<T> {
    ptr: NonNull<T>,
    len: usize,
}

// SAFETY: the block is only freed (in `drop`); its elements are reached through the regions.
unsafe impl<T: Send> Send for Block<T> {}
unsafe impl<T: Sync> Sync for Block<T> {}

impl<T> Drop for Block<T> {
    fn drop(&mut self) {
        // SAFETY: made from a `Box<[T]>` of `len` elements in `carve_block`, freed once.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_region_keeps_its_place_and_never_grows() {
        let mut r = Region::from(vec![1.0f32, 2.0, 3.0, 4.0]);
        let at = r.as_ptr();
        r.set_len(2);
        assert_eq!(&*r, &[1.0, 2.0]);
        r.resize(4, 0.0);
        assert_eq!(&*r, &[1.0, 2.0, 0.0, 0.0]);
        assert_eq!((r.as_ptr(), r.capacity()), (at, 4));
        let grow = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || r.set_len(5)))
            .unwrap_err();
        let msg = grow.downcast_ref::<String>().unwrap();
        assert_eq!(msg, "a region of 4 elements cannot hold 5");
    }

    #[test]
    fn carved_regions_are_adjacent_spans_of_one_block() {
        let mut parts = carve::<f32>(&[3, 5]);
        let (a, b) = (parts[0].as_ptr(), parts[1].as_ptr());
        // SAFETY: pointer arithmetic for the check only.
        assert_eq!(unsafe { a.add(3) }, b);
        parts[1].host_mut().fill(2.0);
        parts[0][2] = 1.0;
        let first = parts.remove(0);
        assert_eq!(&*first, &[0.0, 0.0, 1.0]);
        drop(first); // the block lives on with the second span
        assert_eq!(&*parts[0], &[2.0; 5]);
    }
}
