//! [`Backend`]: the backend a run chose, as one type the trainer holds: the CPU, the CPU on
//! emulated device memory (`device_check`), or a GPU. Every op is forwarded to the chosen one
//! by a match generated from the interface's list (`kernel_interface!`), so no signature is
//! written here.

use super::*;

/// The backend of a run.
pub enum Backend {
    Cpu(CpuKernels),
    /// The CPU kernels with every buffer in emulated device memory: the trainer's device
    /// path, checked without a device.
    Emulated(OnDevice<CpuKernels>),
    #[cfg(feature = "cuda")]
    Cuda(std::sync::Arc<cuda::CudaKernels>),
}

impl Backend {
    /// The CPU kernels of the CPU and emulated backends.
    pub fn cpu(&self) -> Option<&CpuKernels> {
        match self {
            Backend::Cpu(k) => Some(k),
            Backend::Emulated(k) => Some(&k.inner),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => None,
        }
    }
}

macro_rules! backend_op {
    ($s:ident, $name:ident, $($arg:ident),*) => {
        match $s {
            Backend::Cpu(k) => Kernels::<S, G>::$name(k, $($arg),*),
            Backend::Emulated(k) => Kernels::<S, G>::$name(k, $($arg),*),
            #[cfg(feature = "cuda")]
            Backend::Cuda(k) => Kernels::<S, G>::$name(&**k, $($arg),*),
        }
    };
}

macro_rules! backend_kernels {
    (hooks { $($hook:tt)* } ops { $($op:tt)* }) => {
        impl<S: Elem, G: Elem> Kernels<S, G> for Backend {
            backend_kernels!(@each hook $($hook)*);
            backend_kernels!(@each op $($op)*);
        }
    };
    (@each $kind:ident) => {};
    (@each $kind:ident $(#[$attr:meta])* fn $name:ident (&self $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?;
     $($rest:tt)*) => {
        $(#[$attr])*
        fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
            let s = self;
            backend_op!(s, $name, $($arg),*)
        }
        backend_kernels!(@each $kind $($rest)*);
    };
    // A hook with a default body is still the chosen backend's (its `warm_up`, say) ...
    (@each hook $(#[$attr:meta])* fn $name:ident (&self $(, $arg:ident: $ty:ty)* $(,)?) $(-> $ret:ty)?
     $default:block $($rest:tt)*) => {
        fn $name(&self $(, $arg: $ty)*) $(-> $ret)? {
            let s = self;
            backend_op!(s, $name, $($arg),*)
        }
        backend_kernels!(@each hook $($rest)*);
    };
    // ... while a composite op keeps its default body, which calls the parts above.
    (@each op $(#[$attr:meta])* fn $name:ident $args:tt $(-> $ret:ty)? $default:block
     $($rest:tt)*) => {
        backend_kernels!(@each op $($rest)*);
    };
}
kernel_interface!(backend_kernels);
