//! oneDNN's matmul primitive (Intel's CPU deep-learning library), loaded at run time.
//!
//! Why at run time: a build must work on machines without oneDNN (CI runs AMD EPYC and Intel
//! Xeon hosts, with or without the library), so nothing links against it. On first use
//! `libdnnl.so.2` (the oneDNN 2.x C API, Debian's `libdnnl2`) is opened with `dlopen` and the
//! dozen functions used here are resolved into [`Api`]. A missing library, another major
//! version or any failing call means "not available" and the caller keeps the portable gemm
//! crate.
//!
//! Why the matmul primitive: oneDNN 2.x has `dnnl_sgemm` but no bf16 GEMM function, and the
//! primitive covers both f32 and bf16×bf16 → f32/bf16 (AMX tiles or AVX512-BF16 dot products,
//! accumulating in f32), with arbitrary strides, a bias and `dst +=` (a sum post-op).
//!
//! Creating a primitive JIT-compiles its kernels (milliseconds), so primitives are cached per
//! [`Product`] (shape, strides, data types, bias, accumulate) for the life of the process; a
//! training run has a few dozen. The scratchpad is the caller's ("user" mode), allocated from
//! the Rust heap on every call: the trainer's tracking allocator then sees it (the memory
//! plan's kernel workspace is measured), and one primitive can run on several threads at once
//! (a library-owned scratchpad belongs to the primitive).

use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex, OnceLock};

type Status = c_int;
type Handle = *mut c_void;

// Values from oneDNN 2.x's dnnl_types.h (stable across 2.x: it is the library's ABI).
const SUCCESS: Status = 0;
const ENGINE_CPU: c_int = 1;
const STREAM_DEFAULT_FLAGS: u32 = 1;
const SCRATCHPAD_MODE_USER: c_int = 1;
const QUERY_IMPL_INFO_STR: c_int = 8;
const QUERY_EXEC_ARG_MD: c_int = 255;
const ARG_SRC: c_int = 1;
const ARG_DST: c_int = 17;
const ARG_WEIGHTS: c_int = 33;
const ARG_BIAS: c_int = 41;
const ARG_SCRATCHPAD: c_int = 80;
const RUNTIME_OMP: u32 = 2;

/// CPU instruction sets as `dnnl_get_effective_cpu_isa` reports them: each is a bit mask that
/// contains the masks of the sets it extends.
pub const ISA_AVX512_CORE: u32 = 0x27;
pub const ISA_AVX512_CORE_BF16: u32 = 0xe7;
pub const ISA_AVX512_CORE_AMX: u32 = 0x3e7;

/// `dnnl_memory_desc_t` (696 bytes in 2.6) and `dnnl_matmul_desc_t` (2,800): plain structs the
/// library fills and reads; only their size and alignment matter here, with room to spare.
#[repr(C, align(8))]
struct MemoryDesc([u8; 1024]);
#[repr(C, align(8))]
struct MatmulDesc([u8; 4096]);

#[repr(C)]
struct ExecArg {
    arg: c_int,
    memory: Handle,
}

#[repr(C)]
struct Version {
    major: c_int,
    minor: c_int,
    patch: c_int,
    hash: *const c_char,
    cpu_runtime: u32,
    gpu_runtime: u32,
}

/// Element types of a product (`dnnl_data_type_t` values).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dt {
    Bf16 = 2,
    F32 = 3,
}

/// Declares [`Api`]: one function pointer per `dnnl_*` symbol, resolved by [`Api::resolve`].
macro_rules! api {
    ($($name:ident: fn($($arg:ty),*) -> $ret:ty;)*) => {
        /// The oneDNN functions used here, resolved from the opened library.
        struct Api {
            $($name: unsafe extern "C" fn($($arg),*) -> $ret,)*
            /// libgomp's, when oneDNN runs on OpenMP (Debian's does): see [`Onednn::execute`].
            omp_set_num_threads: Option<unsafe extern "C" fn(c_int)>,
        }

        impl Api {
            /// # Safety
            /// `lib` must be a live handle from `dlopen` of a oneDNN 2.x library, whose symbols
            /// have the signatures declared here.
            unsafe fn resolve(lib: Handle) -> Result<Api, String> {
                Ok(Api {
                    $($name: {
                        let p = symbol(lib, concat!("dnnl_", stringify!($name), "\0"))
                            .ok_or(concat!("no symbol dnnl_", stringify!($name)))?;
                        // SAFETY: the symbol is the C function of that name (caller's contract).
                        unsafe {
                            std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> $ret>(p)
                        }
                    },)*
                    omp_set_num_threads: symbol(lib, "omp_set_num_threads\0").map(|p| {
                        // SAFETY: libgomp's `void omp_set_num_threads(int)`.
                        unsafe { std::mem::transmute::<*mut c_void, unsafe extern "C" fn(c_int)>(p) }
                    }),
                })
            }
        }
    };
}

api! {
    version: fn() -> *const Version;
    get_effective_cpu_isa: fn() -> c_int;
    engine_create: fn(*mut Handle, c_int, usize) -> Status;
    stream_create: fn(*mut Handle, Handle, u32) -> Status;
    stream_wait: fn(Handle) -> Status;
    stream_destroy: fn(Handle) -> Status;
    memory_desc_init_by_strides: fn(*mut MemoryDesc, c_int, *const i64, c_int, *const i64) -> Status;
    memory_desc_get_size: fn(*const MemoryDesc) -> usize;
    matmul_desc_init: fn(*mut MatmulDesc, *const MemoryDesc, *const MemoryDesc, *const MemoryDesc, *const MemoryDesc) -> Status;
    primitive_attr_create: fn(*mut Handle) -> Status;
    primitive_attr_destroy: fn(Handle) -> Status;
    primitive_attr_set_scratchpad_mode: fn(Handle, c_int) -> Status;
    primitive_attr_set_post_ops: fn(Handle, Handle) -> Status;
    post_ops_create: fn(*mut Handle) -> Status;
    post_ops_destroy: fn(Handle) -> Status;
    post_ops_append_sum: fn(Handle, f32) -> Status;
    primitive_desc_create: fn(*mut Handle, *const c_void, Handle, Handle, Handle) -> Status;
    primitive_desc_destroy: fn(Handle) -> Status;
    primitive_desc_query: fn(Handle, c_int, c_int, *mut c_void) -> Status;
    primitive_desc_query_md: fn(Handle, c_int, c_int) -> *const MemoryDesc;
    primitive_create: fn(*mut Handle, Handle) -> Status;
    primitive_execute: fn(Handle, Handle, c_int, *const ExecArg) -> Status;
    memory_create: fn(*mut Handle, *const MemoryDesc, Handle, *mut c_void) -> Status;
    memory_destroy: fn(Handle) -> Status;
}

/// `dlsym`, or `None`. `name` ends with a NUL.
fn symbol(lib: Handle, name: &str) -> Option<*mut c_void> {
    // SAFETY: `name` is NUL-terminated; dlsym only reads it.
    let p = unsafe { libc::dlsym(lib, name.as_ptr().cast()) };
    (!p.is_null()).then_some(p)
}

/// `Err` naming the call unless it returned `dnnl_success`.
fn check(what: &str, status: Status) -> Result<(), String> {
    match status {
        SUCCESS => Ok(()),
        s => Err(format!("{what} failed (dnnl_status_t {s})")),
    }
}

/// One product `dst[m,n] (=|+=) lhs[m,k]·rhs[k,n] (+ bias[n])`, strides in elements as
/// `(row stride, col stride)`. The bias has the inputs' type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lhs: (usize, usize),
    pub rhs: (usize, usize),
    pub dst: (usize, usize),
    pub inputs: Dt,
    pub output: Dt,
    pub bias: bool,
    pub accumulate: bool,
}

/// The arguments of a matmul, in the order of [`Matmul::mds`].
const ARGS: [c_int; 5] = [ARG_SRC, ARG_WEIGHTS, ARG_DST, ARG_BIAS, ARG_SCRATCHPAD];

/// A created primitive and the memory descriptors its arguments are made with.
///
/// Small on the Rust heap on purpose: a product first seen during a training step adds its
/// entry to the cache then, outside the memory plan, so the descriptors stay in the library's
/// memory (owned by the primitive descriptor, which is kept alive with the primitive: neither
/// is ever destroyed, see [`Onednn`]'s cache).
struct Matmul {
    primitive: Handle,
    /// The descriptor of each of [`ARGS`].
    mds: [*const MemoryDesc; 5],
    scratchpad: usize,
    implementation: String,
}

// SAFETY: a oneDNN primitive may be executed from several threads at once when each execution
// brings its own scratchpad (user scratchpad mode, always set here); the descriptors are
// read-only after creation.
unsafe impl Send for Matmul {}
unsafe impl Sync for Matmul {}

/// The opened library: its functions, a CPU engine and the primitive cache.
pub struct Onednn {
    api: Api,
    engine: Handle,
    /// "2.6.3".
    pub version: String,
    /// `dnnl_get_effective_cpu_isa`: the best instruction set oneDNN uses on this CPU.
    pub isa: u32,
    /// `None` for a product oneDNN has no fast implementation of (see [`Onednn::create`]).
    cache: Mutex<HashMap<Product, Option<Arc<Matmul>>>>,
}

// SAFETY: the engine is thread-safe in oneDNN; the cache is behind a mutex.
unsafe impl Send for Onednn {}
unsafe impl Sync for Onednn {}

/// The library, opened once per process; `Err` says why it is not available.
pub fn library() -> Result<&'static Onednn, &'static str> {
    static LIB: OnceLock<Result<Onednn, String>> = OnceLock::new();
    LIB.get_or_init(open).as_ref().map_err(|e| e.as_str())
}

/// OpenMP's wait policy for oneDNN's threads, unless the user chose one.
///
/// Why: libgomp's default keeps a finished parallel region's threads spinning for a while,
/// and here the next thing to run is rayon's work (attention, norms, the optimizer) on the
/// same cores. Measured on the default model, 2 cores: the spinning cost the oneDNN runs
/// 25–40% of their tokens/s (fp32 871 → 1,154–1,308 tok/s with `passive`, bf16 1,098 →
/// 1,843). libgomp reads the variable once, when it is loaded, which is the `dlopen` of oneDNN
/// below (nothing else in the process links it), so it is set just before.
fn prefer_passive_openmp_threads() {
    if std::env::var_os("OMP_WAIT_POLICY").is_none() && std::env::var_os("GOMP_SPINCOUNT").is_none()
    {
        // Runs once (inside `library()`'s OnceLock), before any OpenMP thread exists; the
        // other threads of the process (rayon's) do not read the environment.
        std::env::set_var("OMP_WAIT_POLICY", "PASSIVE");
    }
}

fn open() -> Result<Onednn, String> {
    prefer_passive_openmp_threads();
    // SAFETY: dlopen with a NUL-terminated name; a failure returns null.
    let lib = unsafe { libc::dlopen(c"libdnnl.so.2".as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        // SAFETY: dlerror returns null or a NUL-terminated message, read before any other dl call.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            "not found".into()
        } else {
            unsafe { CStr::from_ptr(why) }.to_string_lossy()
        };
        return Err(format!(
            "cannot load libdnnl.so.2 ({why}; Debian: apt-get install libdnnl2)"
        ));
    }
    // The handle is never closed: primitives and their JIT code live until the process ends.
    // SAFETY: a live handle of a library named libdnnl.so.2, i.e. the oneDNN 2.x ABI.
    let api = unsafe { Api::resolve(lib)? };
    // SAFETY: dnnl_version returns a pointer to a static struct.
    let v = unsafe { &*(api.version)() };
    if v.major != 2 {
        return Err(format!("libdnnl.so.2 reports version {}, not 2.x", v.major));
    }
    if v.cpu_runtime != RUNTIME_OMP {
        // The thread count is set through OpenMP (see `execute`); other runtimes would need
        // their own handling.
        return Err(format!(
            "oneDNN's CPU runtime is {} (expected OpenMP)",
            v.cpu_runtime
        ));
    }
    let mut engine = std::ptr::null_mut();
    // SAFETY: out-pointer to a handle.
    check("dnnl_engine_create", unsafe {
        (api.engine_create)(&mut engine, ENGINE_CPU, 0)
    })?;
    // SAFETY: no arguments.
    let isa = unsafe { (api.get_effective_cpu_isa)() } as u32;
    Ok(Onednn {
        version: format!("{}.{}.{}", v.major, v.minor, v.patch),
        api,
        engine,
        isa,
        cache: Mutex::new(HashMap::new()),
    })
}

/// oneDNN's name of an instruction-set mask.
pub fn isa_name(isa: u32) -> &'static str {
    match isa {
        0x1 => "sse41",
        0x3 => "avx",
        0x7 => "avx2",
        0x407 => "avx2_vnni",
        0x27 => "avx512_core",
        0x67 => "avx512_core_vnni",
        0xe7 => "avx512_core_bf16",
        0x3e7 => "avx512_core_amx",
        _ => "other",
    }
}

impl Onednn {
    /// Whether this CPU has every instruction of the set `isa` (a mask above), as oneDNN sees it.
    pub fn has(&self, isa: u32) -> bool {
        self.isa & isa == isa
    }

    /// The implementation oneDNN picks for `p` ("brg:avx512_core_amx_bf16"), or `None` when it
    /// has no fast one.
    pub fn implementation(&self, p: &Product) -> Option<String> {
        self.primitive(p).map(|m| m.implementation.clone())
    }

    fn primitive(&self, p: &Product) -> Option<Arc<Matmul>> {
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        cache
            .entry(*p)
            .or_insert_with(|| self.create(p).ok().map(Arc::new))
            .clone()
    }

    /// Creates the primitive of `p`. `Err` also when oneDNN would run it with a reference
    /// implementation (see [`Onednn::finish`]).
    fn create(&self, p: &Product) -> Result<Matmul, String> {
        let a = &self.api;
        let dim = |x: usize| i64::try_from(x).map_err(|_| "dimension overflows i64".to_string());
        let md = |rows: usize, cols: usize, (rs, cs): (usize, usize), dt: Dt| {
            let mut d = MemoryDesc([0; 1024]);
            let dims = [dim(rows)?, dim(cols)?];
            let strides = [dim(rs)?, dim(cs)?];
            // SAFETY: `d` has room for a dnnl_memory_desc_t; the arrays hold 2 dims.
            check("dnnl_memory_desc_init_by_strides", unsafe {
                (a.memory_desc_init_by_strides)(
                    &mut d,
                    2,
                    dims.as_ptr(),
                    dt as c_int,
                    strides.as_ptr(),
                )
            })?;
            Ok::<_, String>(d)
        };
        let mds = [
            md(p.m, p.k, p.lhs, p.inputs)?,
            md(p.k, p.n, p.rhs, p.inputs)?,
            md(p.m, p.n, p.dst, p.output)?,
            md(1, p.n, (p.n, 1), p.inputs)?,
        ];
        // On the stack, not the heap: see [`Matmul`].
        let mut desc = MatmulDesc([0; 4096]);
        let bias: *const MemoryDesc = if p.bias { &mds[3] } else { std::ptr::null() };
        // SAFETY: every descriptor was initialised above; a null bias means none. The matmul
        // descriptor keeps copies of them.
        check("dnnl_matmul_desc_init", unsafe {
            (a.matmul_desc_init)(&mut desc, &mds[0], &mds[1], bias, &mds[2])
        })?;
        let pd = self.primitive_desc(&desc, p.accumulate)?;
        let made = self.finish(pd);
        if made.is_err() {
            // SAFETY: created above and not used since.
            unsafe { (a.primitive_desc_destroy)(pd) };
        }
        made
    }

    /// The primitive descriptor of `desc` with a user scratchpad and, when `accumulate`, a sum
    /// post-op (`dst += product`).
    fn primitive_desc(&self, desc: &MatmulDesc, accumulate: bool) -> Result<Handle, String> {
        let a = &self.api;
        let mut attr = std::ptr::null_mut();
        // SAFETY (the calls below): out-pointers to handles, and handles created just before.
        check("dnnl_primitive_attr_create", unsafe {
            (a.primitive_attr_create)(&mut attr)
        })?;
        let mut set = check("dnnl_primitive_attr_set_scratchpad_mode", unsafe {
            (a.primitive_attr_set_scratchpad_mode)(attr, SCRATCHPAD_MODE_USER)
        });
        if accumulate && set.is_ok() {
            let mut po = std::ptr::null_mut();
            set = check("dnnl_post_ops_create", unsafe {
                (a.post_ops_create)(&mut po)
            });
            if set.is_ok() {
                set = check("dnnl_post_ops_append_sum", unsafe {
                    (a.post_ops_append_sum)(po, 1.0)
                })
                .and_then(|()| {
                    check("dnnl_primitive_attr_set_post_ops", unsafe {
                        (a.primitive_attr_set_post_ops)(attr, po)
                    })
                });
                // The attribute keeps its own copy of the post-ops.
                unsafe { (a.post_ops_destroy)(po) };
            }
        }
        let mut pd = std::ptr::null_mut();
        let made = set.and_then(|()| {
            check("dnnl_primitive_desc_create", unsafe {
                (a.primitive_desc_create)(
                    &mut pd,
                    (desc as *const MatmulDesc).cast(),
                    attr,
                    self.engine,
                    std::ptr::null_mut(),
                )
            })
        });
        unsafe { (a.primitive_attr_destroy)(attr) };
        made.map(|()| pd)
    }

    /// The primitive of the descriptor `pd`, unless its implementation is a reference one
    /// (plain loops, far slower than the gemm crate). `pd` is kept alive on success: the
    /// scratchpad's descriptor belongs to it.
    fn finish(&self, pd: Handle) -> Result<Matmul, String> {
        let a = &self.api;
        let mut name: *const c_char = std::ptr::null();
        // SAFETY (the calls below): `pd` is a live primitive descriptor; out-pointers.
        check("dnnl_primitive_desc_query", unsafe {
            (a.primitive_desc_query)(
                pd,
                QUERY_IMPL_INFO_STR,
                0,
                (&mut name as *mut *const c_char).cast(),
            )
        })?;
        if name.is_null() {
            return Err("no implementation name".to_string());
        }
        // SAFETY: a NUL-terminated string owned by the primitive descriptor.
        let implementation = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        if implementation.starts_with("ref") {
            return Err(format!(
                "only a reference implementation ({implementation})"
            ));
        }
        let mds =
            ARGS.map(|arg| unsafe { (a.primitive_desc_query_md)(pd, QUERY_EXEC_ARG_MD, arg) });
        if mds[..3].iter().any(|md| md.is_null()) {
            return Err("no descriptor of an argument".to_string());
        }
        let scratchpad = match mds[4] {
            md if md.is_null() => 0,
            md => unsafe { (a.memory_desc_get_size)(md) },
        };
        let mut primitive = std::ptr::null_mut();
        check("dnnl_primitive_create", unsafe {
            (a.primitive_create)(&mut primitive, pd)
        })?;
        Ok(Matmul {
            primitive,
            mds,
            scratchpad,
            implementation,
        })
    }

    /// Runs `p` on the given buffers; `false` (nothing written) when oneDNN cannot.
    ///
    /// # Safety
    /// Every element `p` addresses through the strides must lie inside the buffers, which hold
    /// `p.inputs` (lhs, rhs, bias) and `p.output` (dst) elements; `dst` must not be accessed
    /// by anything else during the call; `bias` must be non-null exactly when `p.bias`.
    pub unsafe fn execute(
        &self,
        p: &Product,
        dst: *mut c_void,
        lhs: *const c_void,
        rhs: *const c_void,
        bias: *const c_void,
    ) -> bool {
        let Some(mm) = self.primitive(p) else {
            return false;
        };
        let a = &self.api;
        // OpenMP's thread count is the calling thread's setting; match rayon's pool (the
        // trainer's --threads) so that oneDNN and rayon never run more threads than that.
        if let Some(set) = a.omp_set_num_threads {
            // SAFETY: plain libgomp call.
            unsafe { set(rayon::current_num_threads().clamp(1, c_int::MAX as usize) as c_int) };
        }
        // The scratchpad and the call's argument list are the product's scratch, as the gemm
        // crate's packing is (`scratch`): alive only inside the op. (Unmarked, the engine's
        // hot-path test failed on machines where oneDNN runs the products: AVX-512/AMX.)
        let _scratch = super::scratch::KernelScratch::enter();
        // 64-byte aligned scratchpad from the Rust heap (see the module docs).
        let mut scratch: Vec<u8> = Vec::with_capacity(mm.scratchpad + 64);
        let base = scratch.as_mut_ptr();
        let scratch_ptr = base.wrapping_add(base.align_offset(64));
        let ptrs = [
            lhs.cast_mut(),
            rhs.cast_mut(),
            dst,
            bias.cast_mut(),
            scratch_ptr.cast(),
        ];
        let mut args: Vec<ExecArg> = Vec::with_capacity(ARGS.len());
        let mut ready = true;
        for ((arg, md), ptr) in ARGS.into_iter().zip(mm.mds).zip(ptrs) {
            if ptr.is_null() || md.is_null() || (arg == ARG_SCRATCHPAD && mm.scratchpad == 0) {
                continue;
            }
            let mut memory = std::ptr::null_mut();
            // SAFETY: a descriptor of this library; `ptr` is the caller's buffer or the scratchpad.
            if unsafe { (a.memory_create)(&mut memory, md, self.engine, ptr) } != SUCCESS {
                ready = false;
                break;
            }
            args.push(ExecArg { arg, memory });
        }
        let mut stream = std::ptr::null_mut();
        // SAFETY: out-pointer to a handle.
        ready = ready
            && unsafe { (a.stream_create)(&mut stream, self.engine, STREAM_DEFAULT_FLAGS) }
                == SUCCESS;
        let ran = ready && {
            // SAFETY: handles created above; the arguments point at live buffers (contract).
            let status = unsafe {
                (a.primitive_execute)(mm.primitive, stream, args.len() as c_int, args.as_ptr())
            };
            let waited = unsafe { (a.stream_wait)(stream) };
            // Failing after it may have written part of dst: nothing can fall back correctly.
            assert!(
                status == SUCCESS && waited == SUCCESS,
                "oneDNN matmul {p:?} failed (dnnl_status_t {status}, {waited})"
            );
            true
        };
        if !stream.is_null() {
            // SAFETY: created above; the execution has finished.
            unsafe { (a.stream_destroy)(stream) };
        }
        for arg in &args {
            // SAFETY: created above, used by nothing once the stream has finished.
            unsafe { (a.memory_destroy)(arg.memory) };
        }
        drop(scratch);
        ran
    }
}
