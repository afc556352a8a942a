//! A kernel's per-thread scratch kept from call to call: a parallel loop's tiles (attention's
//! score and accumulator tiles) are taken from the worker thread's own slot and put back when
//! the loop's piece of work ends, so that after the first call no call allocates them again —
//! the engine's hot path allocates nothing outside the pool (`tests/hot_path.rs`).
//!
//! Scratch that does not fit the call (another head size or sequence length) is replaced; a
//! thread that starts a second piece of work while its first holds the slot (rayon may steal
//! while it waits) makes fresh scratch for it. Either way only memory is at stake, never the
//! results: every kernel initialises the scratch it reads.

use std::cell::RefCell;
use std::thread::LocalKey;

/// Scratch `T` borrowed from this thread's slot `home`, returned to it when dropped.
pub struct Reused<T: 'static> {
    value: Option<T>,
    home: &'static LocalKey<RefCell<Option<T>>>,
}

/// This thread's scratch in `home` if `fits` accepts it, else `make()`'s.
pub fn reuse<T>(
    home: &'static LocalKey<RefCell<Option<T>>>,
    fits: impl FnOnce(&T) -> bool,
    make: impl FnOnce() -> T,
) -> Reused<T> {
    let kept = home.with(|slot| slot.borrow_mut().take());
    let value = kept.filter(fits).unwrap_or_else(make);
    Reused {
        value: Some(value),
        home,
    }
}

impl<T> std::ops::Deref for Reused<T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.value.as_ref().expect("held until dropped")
    }
}

impl<T> std::ops::DerefMut for Reused<T> {
    fn deref_mut(&mut self) -> &mut T {
        self.value.as_mut().expect("held until dropped")
    }
}

impl<T> Drop for Reused<T> {
    fn drop(&mut self) {
        if let Some(v) = self.value.take() {
            // A thread being torn down has no slot left: the scratch is simply freed.
            let _ = self.home.try_with(|slot| *slot.borrow_mut() = Some(v));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    thread_local! {
        static SLOT: RefCell<Option<Vec<f32>>> = const { RefCell::new(None) };
    }

    #[test]
    fn scratch_that_fits_is_kept_and_other_scratch_replaced() {
        let first = reuse(&SLOT, |_| true, || vec![0.0; 8]);
        let at = first.as_ptr();
        drop(first);
        let again = reuse(&SLOT, |v| v.len() == 8, || vec![0.0; 8]);
        assert_eq!(again.as_ptr(), at, "the same memory");
        // The slot is empty while held: a second holder gets its own.
        let second = reuse(&SLOT, |_| true, || vec![1.0; 8]);
        assert_ne!(second.as_ptr(), at);
        assert_eq!(second[0], 1.0);
        drop((again, second));
        let other = reuse(&SLOT, |v| v.len() == 16, || vec![2.0; 16]);
        assert_eq!((other.len(), other[0]), (16, 2.0), "a misfit is replaced");
    }
}
