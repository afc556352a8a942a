//! [`DeviceCopy`] (crate `ferrotron-view`) for the engine's devices, so a host communicator can
//! stage their buffers (`ferrotron_dist::Staged`): the emulated device here, CUDA in
//! `cuda::staging` (page-locked staging, the driver's synchronous copies).

use super::{EmulatedDevice, Memory, View, ViewMut};
use ferrotron_view::{copy_problem, DeviceCopy};

impl DeviceCopy for EmulatedDevice {
    fn memory(&self) -> Memory {
        Memory::Device(self.ordinal)
    }

    fn download(&self, src: View<'_, f32>, dst: &mut [f32]) -> Result<(), String> {
        if let Some(p) = copy_problem(self.memory(), src.memory(), src.len(), dst.len()) {
            return Err(p);
        }
        // SAFETY: the emulated device's memory is host memory (`device_memory.rs`), `src.len()`
        // elements, borrowed for the call; `dst` has as many.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn upload(&self, src: &[f32], mut dst: ViewMut<'_, f32>) -> Result<(), String> {
        if let Some(p) = copy_problem(self.memory(), dst.memory(), dst.len(), src.len()) {
            return Err(p);
        }
        // SAFETY: as `download`, the other way; the view is a unique borrow.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.as_mut_ptr(), src.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{emulated, emulated_mut};

    #[test]
    fn emulated_copies_round_trip_and_refuse_other_memory() {
        let dev = EmulatedDevice { ordinal: 2 };
        let mut on_dev = vec![1.5f32, -2.0, 3.25];
        let mut host = vec![0.0; 3];
        dev.download(emulated(&on_dev, 2), &mut host).unwrap();
        assert_eq!(host, on_dev);
        dev.upload(&[7.0, 8.0, 9.0], emulated_mut(&mut on_dev, 2))
            .unwrap();
        assert_eq!(on_dev, [7.0, 8.0, 9.0]);
        assert_eq!(
            dev.download(emulated(&on_dev, 1), &mut host).unwrap_err(),
            "a copy for device 2 memory was handed a buffer in device 1 memory"
        );
        assert_eq!(
            dev.upload(&[1.0], emulated_mut(&mut on_dev, 2))
                .unwrap_err(),
            "a copy of 3 device elements into 1 host elements"
        );
        assert_eq!(dev.staging(5).unwrap().as_mut_slice().len(), 5);
    }
}
