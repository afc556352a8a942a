//! Spare containers the model hands itself back between micro-batches, so its own bookkeeping
//! on the hot path — the list of a micro-batch's layer activations, a mixture of experts'
//! routing tables — reuses the capacity the first micro-batch grew instead of allocating each
//! time. The tensors themselves come from the pool (the trainer's arena, at the plan's
//! offsets); these are the few host `Vec`s around them, a few KB, allocated once.
//!
//! The list of layer activations is generic over the element type, so spares are kept
//! type-erased, one stack per type, and found again by their type.

use std::any::Any;
use std::sync::Mutex;

/// Spare values, a stack (`Vec<T>`) per type: as many as are in flight at once (the
/// pipeline's micro-batches) each find one after the first step.
#[derive(Default)]
pub struct Spares(Mutex<Vec<Box<dyn Any + Send>>>);

impl Spares {
    /// A spare `T`, if one was given back.
    pub fn take<T: Any + Send>(&self) -> Option<T> {
        let mut stacks = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut stack = stacks.iter_mut().filter_map(|s| s.downcast_mut::<Vec<T>>());
        stack.next()?.pop()
    }

    /// Keeps `value` for the next [`Self::take`] of its type.
    pub fn give<T: Any + Send>(&self, value: T) {
        let mut stacks = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let mut stack = stacks.iter_mut().filter_map(|s| s.downcast_mut::<Vec<T>>());
        match stack.next() {
            Some(stack) => stack.push(value),
            None => stacks.push(Box::new(vec![value])),
        }
    }
}

/// A clone of a model starts without spares (they are its own scratch, not its state).
impl Clone for Spares {
    fn clone(&self) -> Self {
        Spares::default()
    }
}

impl std::fmt::Debug for Spares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Spares")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spare_is_found_by_its_type_with_its_capacity() {
        let s = Spares::default();
        assert_eq!(s.take::<Vec<u32>>(), None);
        s.give(Vec::<u32>::with_capacity(64));
        assert_eq!(s.take::<Vec<f32>>(), None, "another type is not found");
        s.give(vec![0.5f32]);
        let v = s.take::<Vec<u32>>().expect("given back");
        assert!(v.capacity() >= 64);
        assert_eq!(s.take::<Vec<u32>>(), None, "taken once");
        assert_eq!(
            s.take::<Vec<f32>>(),
            Some(vec![0.5]),
            "kept beside the other type"
        );
        s.give(1u8);
        s.give(2u8);
        assert_eq!((s.take::<u8>(), s.take::<u8>()), (Some(2), Some(1)));
    }
}
