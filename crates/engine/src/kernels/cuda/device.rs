//! Opening the GPU: the driver, a context on one device, its stream, and the backend's
//! kernels compiled for it. Everything that can be missing is reported in one line that says
//! what is missing and what to do, never a panic (cudarc itself panics when a library it
//! calls cannot be loaded, so presence is checked first).

use super::{ptx_version, source};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::sync::Arc;

/// Why `--device cuda` cannot run here.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error("device = cuda: no NVIDIA driver on this machine (libcuda.so.1 not found); run on a machine with an NVIDIA GPU, or use --device cpu")]
    NoDriver,
    #[error("device = cuda: the NVIDIA driver found no GPU {ordinal} ({detail}); check nvidia-smi and CUDA_VISIBLE_DEVICES, or use --device cpu")]
    NoDevice { ordinal: usize, detail: String },
    #[error("device = cuda: {0}")]
    Compile(#[from] source::CompileError),
    #[error("device = cuda: {what}: {detail}")]
    Driver { what: &'static str, detail: String },
}

fn driver(what: &'static str) -> impl FnOnce(cudarc::driver::DriverError) -> DeviceError {
    move |e| DeviceError::Driver {
        what,
        detail: format!("{e:?}"),
    }
}

/// Whether the driver library loads (without creating anything): on the loader's path, or
/// where NVIDIA's containers mount it (see [`super::libs`]).
pub fn driver_present() -> bool {
    // SAFETY: a dlopen probe, as cudarc does before its first call.
    super::libs::load(
        "FERROTRON_LIBCUDA",
        &["libcuda.so.1", "libcuda.so"],
        || unsafe { cudarc::driver::sys::is_culib_present() },
    )
}

/// The `sm_XY` NVRTC compiles for, from a compute capability.
pub fn arch(major: i32, minor: i32) -> &'static str {
    match (major, minor) {
        (8, 0) => "sm_80",
        (8, 6) => "sm_86",
        (8, 9) => "sm_89",
        (9, 0) => "sm_90",
        (10, 0) => "sm_100",
        (12, 0) => "sm_120",
        // Once per process: the name must outlive NVRTC's options.
        _ => Box::leak(format!("sm_{major}{minor}").into_boxed_str()),
    }
}

/// The driver's CUDA version (`cuDriverGetVersion`: 1000·major + 10·minor).
pub fn driver_cuda_version() -> Result<u32, DeviceError> {
    let mut v = 0;
    // SAFETY: the driver is loaded (checked by the caller); one int written.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(driver("reading the driver's CUDA version"))?;
    Ok(v as u32)
}

/// The compiled kernels loaded into `ctx`, their PTX first fitted to the driver
/// ([`ptx_version`]): a module newer than the driver is loaded with its version lowered, said
/// on stderr; if the driver refuses even that, the error names both versions and the fix.
fn load(ctx: &Arc<CudaContext>, ptx: String) -> Result<Arc<CudaModule>, DeviceError> {
    let cuda = driver_cuda_version()?;
    let (from, to, ptx) = match ptx_version::fit(&ptx, cuda) {
        ptx_version::Fit::AsIs => {
            return ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(driver("loading the compiled kernels"));
        }
        ptx_version::Fit::Lowered { ptx, from, to } => (from, to, ptx),
    };
    let nvrtc = super::libs::found()
        .into_iter()
        .find(|l| l.starts_with("FERROTRON_NVRTC"))
        .unwrap_or_else(|| "NVRTC".into());
    let cuda = ptx_version::cuda_name(cuda);
    eprintln!(
        "warning: {nvrtc} wrote PTX ISA {}.{}, newer than this driver (CUDA {cuda}) loads; loading it as ISA {}.{}",
        from.0, from.1, to.0, to.1
    );
    ctx.load_module(Ptx::from_src(ptx)).map_err(|e| DeviceError::Driver {
        what: "loading the compiled kernels",
        detail: format!(
            "{e:?}: the PTX is ISA {}.{} ({nvrtc}) and this driver is CUDA {cuda}; use an NVRTC of CUDA {cuda} (`pip install 'nvidia-cuda-nvrtc=={cuda}.*'`, then FERROTRON_NVRTC=<its libnvrtc.so.*>)",
            from.0, from.1
        ),
    })
}

/// How many GPUs the driver sees (`cuDeviceGetCount`, after `CUDA_VISIBLE_DEVICES`): a rank's
/// GPU is chosen among them.
pub fn count() -> Result<usize, DeviceError> {
    if !driver_present() {
        return Err(DeviceError::NoDriver);
    }
    let n = CudaContext::device_count().map_err(driver("counting the GPUs"))?;
    Ok(n.max(0) as usize)
}

/// GPU `ordinal`'s free and total memory by the driver's count (`cuMemGetInfo`), read
/// through its primary context, the one the trainer's ranks then share: what that context
/// itself takes is already gone from the free count, as other processes' memory is.
pub fn memory(ordinal: usize) -> Result<(u64, u64), DeviceError> {
    let (free, total) = context(ordinal)?
        .mem_get_info()
        .map_err(driver("reading the free memory"))?;
    Ok((free as u64, total as u64))
}

/// GPU `ordinal`'s primary context (the driver checked first: cudarc panics without it).
fn context(ordinal: usize) -> Result<Arc<CudaContext>, DeviceError> {
    if !driver_present() {
        return Err(DeviceError::NoDriver);
    }
    CudaContext::new(ordinal).map_err(|e| DeviceError::NoDevice {
        ordinal,
        detail: format!("{e:?}"),
    })
}

/// One GPU, ready to run the backend's kernels.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub arch: &'static str,
    _module: Arc<CudaModule>,
    functions: HashMap<String, CudaFunction>,
}

impl Gpu {
    /// Device `ordinal`: a context, the compute stream, and every kernel compiled and loaded.
    pub fn open(ordinal: usize) -> Result<Gpu, DeviceError> {
        let ctx = context(ordinal)?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let name = ctx.name().map_err(driver("reading the device name"))?;
        let arch = arch(major, minor);
        let ptx = source::compile(arch)?;
        let module = load(&ctx, ptx)?;
        let mut functions = HashMap::new();
        for f in source::entry_points() {
            let func = module
                .load_function(&f)
                .map_err(driver("finding a kernel in the compiled program"))?;
            functions.insert(f, func);
        }
        let stream = super::compute_stream::compute_stream(&ctx);
        Ok(Gpu {
            ctx,
            stream,
            name,
            arch,
            _module: module,
            functions,
        })
    }

    /// The kernel `name` (one of [`source::entry_points`]).
    pub fn function(&self, name: &str) -> &CudaFunction {
        self.functions
            .get(name)
            .unwrap_or_else(|| panic!("CUDA kernel {name} is not in the program (source.rs)"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn arch_names_follow_the_compute_capability() {
        assert_eq!(super::arch(9, 0), "sm_90");
        assert_eq!(super::arch(8, 0), "sm_80");
        assert_eq!(super::arch(7, 5), "sm_75");
    }
}
