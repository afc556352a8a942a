//! ferrotron-view: device-neutral buffer views, what the kernel interface (`ferrotron-engine`)
//! and the communicators (`ferrotron-dist`) take instead of host slices.
//!
//! A [`View`] (read) or [`ViewMut`] (write) is a typed, bounds-checked, borrow-checked window
//! of `len` elements in some memory: the host's, or an accelerator's ([`Memory`]). The model
//! slices them by method ([`View::slice`], [`ViewMut::split_at_mut`], …), never by indexing
//! into host memory, so the same model code drives a backend whose buffers the host cannot
//! address (a CUDA backend reads the pointer as a device address). A backend takes the views
//! it can run on: the CPU backend asks each for its host slice ([`View::host`]), which refuses
//! device memory with the memory's name rather than reading an address that is not the host's.
//!
//! Like `&[T]` and `&mut [T]`, a `View` is `Copy` and a `ViewMut` is unique: the borrow checker
//! keeps two writers of one buffer apart whatever memory it lives in.

mod device_copy;
mod region;

pub use device_copy::{copy_problem, DeviceCopy, HostStaging};
pub use region::{carve, Region};

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Bound, RangeBounds};
use std::ptr::NonNull;

/// Where a buffer's memory lives.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Memory {
    /// The host's memory: a view of it is also a slice.
    #[default]
    Host,
    /// Accelerator `ordinal`'s memory: not addressable from the host.
    Device(u32),
}

impl fmt::Display for Memory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Memory::Host => write!(f, "host memory"),
            Memory::Device(d) => write!(f, "device {d} memory"),
        }
    }
}

/// `start..end` of a range over `len` elements, checked as slice indexing checks it.
fn bounds(r: impl RangeBounds<usize>, len: usize) -> (usize, usize) {
    let start = match r.start_bound() {
        Bound::Included(&s) => s,
        Bound::Excluded(&s) => s + 1,
        Bound::Unbounded => 0,
    };
    let end = match r.end_bound() {
        Bound::Included(&e) => e + 1,
        Bound::Excluded(&e) => e,
        Bound::Unbounded => len,
    };
    assert!(
        start <= end && end <= len,
        "view range {start}..{end} out of bounds of a view of {len} elements"
    );
    (start, end)
}

/// The pointer and length of elements `r` of `len` elements at `ptr`.
#[track_caller]
fn sub<T>(ptr: NonNull<T>, len: usize, r: impl RangeBounds<usize>) -> (NonNull<T>, usize) {
    let (start, end) = bounds(r, len);
    // SAFETY: `start <= len`, so the offset stays inside (or one past) the view.
    (
        unsafe { NonNull::new_unchecked(ptr.as_ptr().add(start)) },
        end - start,
    )
}

/// What both kinds of view have: construction from raw parts (with the contract `$safety`),
/// length and memory.
macro_rules! view_basics {
    ($view:ident, $safety:literal) => {
        impl<'a, T> $view<'a, T> {
            /// A view of `len` elements at `ptr` in `mem`.
            ///
            /// # Safety
            #[doc = $safety]
            pub unsafe fn from_raw_parts(ptr: NonNull<T>, len: usize, mem: Memory) -> Self {
                $view {
                    ptr,
                    len,
                    mem,
                    _borrow: PhantomData,
                }
            }

            pub fn len(&self) -> usize {
                self.len
            }

            pub fn is_empty(&self) -> bool {
                self.len == 0
            }

            pub fn memory(&self) -> Memory {
                self.mem
            }
        }
    };
}

view_basics!(
    View,
    "`ptr` must address `len` initialised elements in `mem` that stay valid and unwritten for `'a`."
);
view_basics!(
    ViewMut,
    "`ptr` must address `len` initialised elements in `mem` that stay valid for `'a` and that nothing else reads or writes while the view lives."
);

/// A host-side use of memory that lives elsewhere: a bug in whoever paired the buffer with a
/// host backend or host code, so it stops the program with both named.
#[cold]
#[track_caller]
fn not_host(mem: Memory) -> ! {
    panic!("a host slice was asked of a view of {mem}: only a backend of that memory may read it")
}

/// A read-only view of `len` elements of `T` in [`Memory`] `mem`, borrowed for `'a`.
pub struct View<'a, T> {
    ptr: NonNull<T>,
    len: usize,
    mem: Memory,
    _borrow: PhantomData<&'a [T]>,
}

impl<T> Clone for View<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for View<'_, T> {}

// SAFETY: a `View` is a shared borrow of its elements, as `&[T]` is.
unsafe impl<T: Sync> Send for View<'_, T> {}
unsafe impl<T: Sync> Sync for View<'_, T> {}

impl<'a, T> View<'a, T> {
    /// The first element's address in the view's memory (a device address on a device).
    pub fn as_ptr(&self) -> *const T {
        self.ptr.as_ptr()
    }

    /// The elements `r` of this view (panics out of bounds, as slice indexing does).
    #[track_caller]
    pub fn slice(self, r: impl RangeBounds<usize>) -> View<'a, T> {
        let (ptr, len) = sub(self.ptr, self.len, r);
        View { ptr, len, ..self }
    }

    /// The first `mid` elements and the rest.
    #[track_caller]
    pub fn split_at(self, mid: usize) -> (View<'a, T>, View<'a, T>) {
        (self.slice(..mid), self.slice(mid..))
    }

    /// The host slice it is; panics naming the memory when that is a device's.
    #[track_caller]
    pub fn host(self) -> &'a [T] {
        match self.mem {
            // SAFETY: `from_raw_parts`'s contract, and the memory is the host's.
            Memory::Host => unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) },
            m => not_host(m),
        }
    }

    /// The host slice it is, or the memory it lives in when that is a device's (for a host
    /// backend that answers a misplaced buffer with an error rather than a panic).
    pub fn try_host(self) -> Result<&'a [T], Memory> {
        match self.mem {
            Memory::Host => Ok(self.host()),
            m => Err(m),
        }
    }
}

impl<'a, T> From<&'a [T]> for View<'a, T> {
    fn from(s: &'a [T]) -> Self {
        // SAFETY: a slice is `len` initialised host elements, shared for `'a`.
        unsafe { View::from_raw_parts(NonNull::from(s).cast(), s.len(), Memory::Host) }
    }
}

impl<T> fmt::Debug for View<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "View[{}; {}]", self.len, self.mem)
    }
}

/// A writable view of `len` elements of `T` in [`Memory`] `mem`, borrowed uniquely for `'a`.
pub struct ViewMut<'a, T> {
    ptr: NonNull<T>,
    len: usize,
    mem: Memory,
    _borrow: PhantomData<&'a mut [T]>,
}

// SAFETY: a `ViewMut` is a unique borrow of its elements, as `&mut [T]` is.
unsafe impl<T: Send> Send for ViewMut<'_, T> {}
unsafe impl<T: Sync> Sync for ViewMut<'_, T> {}

impl<'a, T> ViewMut<'a, T> {
    /// The first element's address in the view's memory (a device address on a device).
    pub fn as_mut_ptr(&mut self) -> *mut T {
        self.ptr.as_ptr()
    }

    /// The same elements, borrowed again for a shorter time (passing a `ViewMut` to an op
    /// moves it; `v.rb()` passes it and keeps `v`).
    pub fn rb(&mut self) -> ViewMut<'_, T> {
        ViewMut { ..*self }
    }

    /// The same elements, read-only, while this view is borrowed.
    pub fn as_view(&self) -> View<'_, T> {
        // SAFETY: the unique borrow is shared for the returned lifetime.
        unsafe { View::from_raw_parts(self.ptr, self.len, self.mem) }
    }

    /// The same elements, read-only, for the rest of `'a`.
    pub fn into_view(self) -> View<'a, T> {
        // SAFETY: as `as_view`, consuming the unique borrow.
        unsafe { View::from_raw_parts(self.ptr, self.len, self.mem) }
    }

    /// The elements `r` of this view (panics out of bounds, as slice indexing does).
    #[track_caller]
    pub fn slice_mut(self, r: impl RangeBounds<usize>) -> ViewMut<'a, T> {
        let (ptr, len) = sub(self.ptr, self.len, r);
        ViewMut { ptr, len, ..self }
    }

    /// The first `mid` elements and the rest, both writable.
    #[track_caller]
    pub fn split_at_mut(self, mid: usize) -> (ViewMut<'a, T>, ViewMut<'a, T>) {
        let (ptr, len) = sub(self.ptr, self.len, mid..);
        // The halves do not overlap: the borrow splits as `<[T]>::split_at_mut`'s does.
        (ViewMut { len: mid, ..self }, ViewMut { ptr, len, ..self })
    }

    /// The host slice it is; panics naming the memory when that is a device's.
    #[track_caller]
    pub fn host_mut(self) -> &'a mut [T] {
        match self.mem {
            // SAFETY: `from_raw_parts`'s contract, and the memory is the host's.
            Memory::Host => unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) },
            m => not_host(m),
        }
    }

    /// The host slice it is, or the memory it lives in when that is a device's.
    pub fn try_host_mut(self) -> Result<&'a mut [T], Memory> {
        match self.mem {
            Memory::Host => Ok(self.host_mut()),
            m => Err(m),
        }
    }
}

impl<'a, T> From<&'a mut [T]> for ViewMut<'a, T> {
    fn from(s: &'a mut [T]) -> Self {
        let len = s.len();
        // SAFETY: a unique borrow of `len` initialised host elements for `'a`.
        unsafe { ViewMut::from_raw_parts(NonNull::from(s).cast(), len, Memory::Host) }
    }
}

impl<'a, T> From<ViewMut<'a, T>> for View<'a, T> {
    fn from(v: ViewMut<'a, T>) -> Self {
        v.into_view()
    }
}

impl<T> fmt::Debug for ViewMut<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ViewMut[{}; {}]", self.len, self.mem)
    }
}

/// Whatever a [`View`] can be taken of: host slices (and so `Vec`s and arrays), the pool's
/// buffers (the engine's `model::Buf`, in whatever memory the pool placed them).
pub trait AsView<T> {
    fn view(&self) -> View<'_, T>;
}

/// Whatever a [`ViewMut`] can be taken of.
pub trait AsViewMut<T>: AsView<T> {
    fn view_mut(&mut self) -> ViewMut<'_, T>;
}

impl<T> AsView<T> for [T] {
    fn view(&self) -> View<'_, T> {
        self.into()
    }
}

impl<T> AsViewMut<T> for [T] {
    fn view_mut(&mut self) -> ViewMut<'_, T> {
        self.into()
    }
}

impl<T> AsView<T> for Vec<T> {
    fn view(&self) -> View<'_, T> {
        self[..].view()
    }
}

impl<T> AsViewMut<T> for Vec<T> {
    fn view_mut(&mut self) -> ViewMut<'_, T> {
        self[..].view_mut()
    }
}

impl<T> AsView<T> for View<'_, T> {
    fn view(&self) -> View<'_, T> {
        *self
    }
}

impl<T> AsView<T> for ViewMut<'_, T> {
    fn view(&self) -> View<'_, T> {
        self.as_view()
    }
}

impl<T> AsViewMut<T> for ViewMut<'_, T> {
    fn view_mut(&mut self) -> ViewMut<'_, T> {
        self.rb()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slicing_follows_slice_semantics() {
        let mut data: Vec<u32> = (0..10).collect();
        let v = data.view();
        assert_eq!(v.slice(2..5).host(), &[2, 3, 4]);
        assert_eq!(v.slice(..=1).host(), &[0, 1]);
        assert_eq!(v.slice(8..).slice(1..).host(), &[9]);
        let (a, b) = v.split_at(3);
        assert_eq!((a.len(), b.len(), b.host()[0]), (3, 7, 3));
        let (lo, hi) = data.view_mut().split_at_mut(4);
        lo.host_mut()[0] = 100;
        hi.slice_mut(1..2).host_mut()[0] = 500;
        assert_eq!(&data[..6], &[100, 1, 2, 3, 4, 500]);
    }

    #[test]
    #[should_panic(expected = "view range 3..11 out of bounds of a view of 10 elements")]
    fn out_of_bounds_panics_with_the_range() {
        let data = [0u8; 10];
        let _ = data.view().slice(3..11);
    }

    #[test]
    #[should_panic(expected = "a host slice was asked of a view of device 1 memory")]
    fn device_memory_is_never_read_as_host_memory() {
        let data = [1.0f32; 4];
        // SAFETY: never dereferenced: `host` refuses before it would.
        let v = unsafe {
            View::from_raw_parts(NonNull::from(&data).cast::<f32>(), 4, Memory::Device(1))
        };
        assert_eq!(v.slice(1..3).memory(), Memory::Device(1));
        assert_eq!(v.try_host().unwrap_err(), Memory::Device(1));
        let _ = v.host();
    }
}
