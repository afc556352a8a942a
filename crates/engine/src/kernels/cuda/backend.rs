//! [`CudaKernels`]: the kernel interface on one GPU. Products go to cuBLASLt (`gemm`), every
//! other op to the CUDA C++ kernels (`cu/`, compiled by NVRTC at start-up); all work runs in
//! order on the compute stream (`compute_stream`: the calling thread's), so an op that returns
//! a value to the host (the loss sum, a squared norm, a count) waits for the work before it
//! and nothing else.
//!
//! The mixture-of-experts ops are in `moe` (their routing tables built on the host).
//!
//! Ring attention and the vocabulary-parallel cross-entropy, which only multi-rank layouts
//! call, have kernels of their own (`cu/ring_attention.cu`, `cu/vocab_parallel_ce.cu`; their
//! host round trips are gone, issue #33). Attention over a KV cache, which only `ferrotron
//! sample` calls, runs on the CPU backend.

use super::compute_stream::{read_after, write_queued, zero_queued};
use super::device::{DeviceError, Gpu};
use super::gemm::{self, Call, Inputs, Lt, Product};
use super::memory::DeviceBlock;
use super::OPS;
use crate::dtype::Elem;
use crate::kernels::cpu::adamw::Consts;
use crate::kernels::cpu::Fp8Inputs;
use crate::kernels::*;
use cudarc::driver::{result, DeviceRepr, LaunchConfig};
use ferrotron_plan::DType;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

mod captured;
mod fp8;
pub(super) mod host_ids;
mod moe;
mod op_events;
pub use captured::CapturedWork;
pub use moe::{routes, Routes};

/// Threads per block of the elementwise and per-row kernels.
const BLOCK: u32 = 256;
/// Blocks of the squared-sum reduction: fixed, so its partition and therefore its result do
/// not depend on the GPU; 8 per SM of a 132-SM H100 or H200, enough loads in flight to
/// stream a model's gradients near the memory's bandwidth.
const SUM_BLOCKS: u32 = 1056;

/// The step's loss sum kept on the device (`take_loss`): a slot after the gradient norm's
/// partial sums in the `Partials` scratch, so that the norm's read brings it back too.
const LOSS_SLOTS: usize = SUM_BLOCKS as usize;
const PARTIALS_BYTES: usize = (SUM_BLOCKS as usize + 1) * 8;

/// What the host knows of the device's loss slots.
#[derive(Default)]
struct LossSlots {
    /// Zeroed once the scratch exists.
    ready: bool,
    /// Added to since the last `take_loss`.
    pending: bool,
    /// Its value as the last gradient norm read it, if nothing was added since.
    fetched: Option<f64>,
}

/// One thread: a sum in a fixed order.
/// The fixed grid of the sums of squares (`SUM_BLOCKS` partials).
fn sum_grid() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (SUM_BLOCKS, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn one_thread() -> LaunchConfig {
    LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (1, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Row slices of a sum over rows per column (RMSNorm's weight gradient, `cu/rmsnorm.cu`; a
/// bias's, `cu/bias.cu`): enough blocks to fill a GPU's SMs at any width, fixed by the row
/// count alone so that the sum's order never depends on the GPU.
const COLUMN_SLICES: usize = 128;

fn column_slices(rows: usize) -> usize {
    rows.clamp(1, COLUMN_SLICES)
}

/// The scratch of a sum over `rows` rows of width `c` per column: a partial sum per slice and
/// column.
fn column_partials_bytes(rows: usize, c: usize) -> usize {
    column_slices(rows) * c * 4
}

/// The kernels' `AttnDims` (`cu/attention.cu`).
#[derive(Clone, Copy)]
#[repr(C)]
struct AttnDims {
    b: u64,
    t: u64,
    heads: u64,
    kv_heads: u64,
    d: u64,
    scale: f32,
}
// SAFETY: plain `repr(C)` data matching the CUDA struct.
unsafe impl DeviceRepr for AttnDims {}

/// The kernels' `RingParts` (`cu/ring_attention.cu`): which tokens a ring step's queries and
/// key/value block are.
#[derive(Clone, Copy)]
#[repr(C)]
struct RingParts {
    q_rank: u64,
    kv_rank: u64,
    ranks: u64,
}
// SAFETY: plain `repr(C)` data matching the CUDA struct.
unsafe impl DeviceRepr for RingParts {}

fn ring_parts(s: RingShape) -> RingParts {
    assert_eq!(s.q.ranks, s.kv.ranks, "ring attention: one split");
    assert!(
        s.q.ranks == 1 || s.attn.t.is_multiple_of(2),
        "ring attention: {} tokens do not split into two chunks",
        s.attn.t
    );
    RingParts {
        q_rank: s.q.rank as u64,
        kv_rank: s.kv.rank as u64,
        ranks: s.q.ranks as u64,
    }
}
// SAFETY: as above (`AdamConsts` in `cu/adamw.cu`).
unsafe impl DeviceRepr for Consts {}

/// Device scratch the ops need beyond their arguments, each grown to the largest request and
/// kept (the backend's workspace, charged to the plan's overhead with cuBLASLt's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Scratch {
    /// 16-bit copies of the LM head's f32 logit gradients for its products.
    HeadStaging,
    /// The attention backward's Δ = dO·O per query row.
    AttnDelta,
    /// Sums over rows per column (RMSNorm's and the biases' weight gradients): partial sums
    /// per row slice and column.
    ColumnPartials,
    /// The embedding backward's positions grouped by token.
    Tokens,
    /// Partial sums and counts read back by the host.
    Partials,
    /// `count_targets`' count.
    TargetCount,
    /// The routed rows' tables of a mixture of experts (`moe::Routes`).
    Routes,
    /// The router's max and Σexp per token, between its two kernels.
    RouterStats,
    /// An fp8 product's two operands as codes, their amax and scales (`fp8::Layout`).
    Fp8,
}

/// A host RoPE table's address, length, head dim and last entries.
type RopeKey = (usize, usize, usize, u32);

/// The CUDA backend.
pub struct CudaKernels {
    gpu: Gpu,
    /// The device's memory in use by the driver's count once the context and the kernels were
    /// loaded, before the backend's workspace: the zero of the trainer's driver reading.
    baseline: u64,
    lt: Lt,
    _lt_workspace: DeviceBlock,
    scratch: Mutex<HashMap<Scratch, DeviceBlock>>,
    /// RoPE tables uploaded, keyed by the host table's identity.
    rope: Mutex<HashMap<RopeKey, (DeviceBlock, DeviceBlock)>>,
    /// A mixture of experts' router choices read back and its routing tables, in host
    /// buffers reused by every row op (`moe::Routes`), and which choices they are of.
    routing: Mutex<moe::Routing>,
    /// The step's loss on the device (`take_loss`).
    loss: Mutex<LossSlots>,
    /// The 16-bit copy of the logit gradients the last `cross_entropy` wrote beside them, for
    /// the head's two products (`stage_head`).
    staged: Mutex<Option<StagedHead>>,
    /// Traced ops' events (`op_begin`, `take_device_spans`).
    op_events: Mutex<op_events::OpEvents>,
    /// What the open capture needs replayed on the host, while one is open (`captured`).
    capturing: Mutex<Option<captured::Capturing>>,
    /// Attention on the plain kernels even where the tensor-core ones apply
    /// (`FERROTRON_CUDA_ATTENTION=plain`, or [`CudaKernels::use_plain_attention`]): the
    /// reference the tests hold the tensor-core kernels to, and a switch for bisecting.
    plain_attention: AtomicBool,
    /// The layer products' fp8 formats (`--precision fp8`), or `None` for products on the
    /// storage type; the LM head's are never fp8 (as on the CPU).
    fp8: Option<Fp8Inputs>,
}

/// Which f32 logit gradients the head staging holds rounded to 16 bits: their address and
/// length, the staging's address, and the device-write epoch when they were written
/// (`moe::write_epoch`: a copy into the logits since would change them).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct StagedHead {
    dlogits: u64,
    len: usize,
    staging: u64,
    epoch: u64,
}

impl StagedHead {
    /// `len` gradients at `dlogits` rounded into `staging`, as of the device writes so far.
    fn now(dlogits: u64, len: usize, staging: u64) -> Self {
        let epoch = moe::write_epoch(&OPS.read());
        StagedHead {
            dlogits,
            len,
            staging,
            epoch,
        }
    }
}

/// The variable that picks the attention kernels: `flash` (the default) or `plain`.
pub const ATTENTION_ENV: &str = "FERROTRON_CUDA_ATTENTION";

impl CudaKernels {
    /// The backend on GPU `ordinal`: context, compiled kernels, cuBLASLt and its workspace.
    pub fn open(ordinal: usize) -> Result<CudaKernels, DeviceError> {
        let gpu = Gpu::open(ordinal)?;
        let baseline = super::memory::in_use(&gpu.ctx).unwrap_or(0);
        let ws = DeviceBlock::new(&gpu.ctx, gemm::WORKSPACE_BYTES).map_err(|detail| {
            DeviceError::Driver {
                what: "the cuBLASLt workspace",
                detail,
            }
        })?;
        let lt = Lt::new(ws.ptr(), ws.bytes()).map_err(|detail| DeviceError::Driver {
            what: "cuBLASLt",
            detail,
        })?;
        Ok(CudaKernels {
            gpu,
            baseline,
            lt,
            _lt_workspace: ws,
            scratch: Mutex::new(HashMap::new()),
            rope: Mutex::new(HashMap::new()),
            routing: Mutex::default(),
            loss: Mutex::default(),
            staged: Mutex::default(),
            op_events: Mutex::default(),
            capturing: Mutex::default(),
            plain_attention: AtomicBool::new(plain_attention_from_env()?),
            fp8: None,
        })
    }

    /// Attention on the plain kernels (`true`) or, where they apply, the tensor-core ones.
    pub fn use_plain_attention(&self, plain: bool) {
        self.plain_attention.store(plain, Ordering::Relaxed);
    }

    /// The tensor-core attention's entry point suffix (`64_bf16`) for this shape in storage
    /// `S`, where it applies: 16-bit storage, head dim 64 or 128, not switched off.
    fn flash<S: Elem>(&self, s: AttnShape) -> Option<KernelName> {
        let sixteen = matches!(S::DTYPE, DType::Bf16 | DType::F16);
        let dims = super::source::FLASH_HEAD_DIMS.contains(&s.head_dim);
        (sixteen && dims && !self.plain_attention.load(Ordering::Relaxed))
            .then(|| kname!("{}_{}", s.head_dim, sfx(S::DTYPE)))
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The device's memory in use before the backend allocated anything (`CudaAlloc::new`'s zero).
    pub fn baseline(&self) -> u64 {
        self.baseline
    }

    /// Device bytes the backend holds beyond the model's buffers: cuBLASLt's workspace, the
    /// scratch grown so far and the RoPE tables.
    pub fn workspace_bytes(&self) -> u64 {
        let scratch: usize = lock(&self.scratch).values().map(DeviceBlock::bytes).sum();
        let rope: usize = lock(&self.rope)
            .values()
            .map(|(c, s)| c.bytes() + s.bytes())
            .sum();
        (gemm::WORKSPACE_BYTES + scratch + rope) as u64
    }

    /// Allocates now the scratch a model's step needs at most, so that none is allocated
    /// during a step (the plan charges it with cuBLASLt's workspace: [`workspace_bytes`]):
    /// `rows`·`vocab` 16-bit logit gradients of an LM-head chunk (`staging`: 2 bytes, or 0 for
    /// f32), the attention backward's `lse_len` Δs, `tokens` token ids grouped, the partial
    /// sums of a weight gradient summed over `tokens` rows per column (RMSNorm's, a bias's) at
    /// the widest `width`, and the model's RoPE table.
    ///
    /// [`workspace_bytes`]: Self::workspace_bytes
    pub fn reserve(
        &self,
        staging: usize,
        lse_len: usize,
        tokens: usize,
        width: usize,
        rope: &RopeTable,
    ) {
        self.rope_table(rope);
        self.scratch(
            Scratch::ColumnPartials,
            column_partials_bytes(tokens, width),
        );
        self.scratch(Scratch::HeadStaging, staging.max(1));
        self.scratch(Scratch::AttnDelta, lse_len * 4);
        self.scratch(Scratch::Tokens, (2 * tokens + 1) * 4);
        self.scratch(Scratch::TargetCount, 8);
        self.partials();
    }

    /// The `Partials` scratch (the gradient norm's partial sums, then the loss slots), its
    /// loss slots zeroed the first time.
    fn partials(&self) -> u64 {
        let p = self.scratch(Scratch::Partials, PARTIALS_BYTES);
        let mut st = lock(&self.loss);
        if !st.ready {
            let acc = p + (LOSS_SLOTS * 8) as u64;
            launch!(self, "loss_reset", one_thread(); acc);
            st.ready = true;
        }
        p
    }

    /// The sums of squares' partials added in block order, read back with the loss slot after
    /// them (which `take_loss` then needs not read): one host synchronisation.
    fn read_partials(&self) -> f64 {
        let mut sums = [0f64; SUM_BLOCKS as usize + 1];
        let at = self.partials();
        let _w = OPS.sync(SyncSite::GradNorm);
        // SAFETY: the partials scratch holds PARTIALS_BYTES; the copy waits for the kernels.
        unsafe { read_after(&self.gpu.stream, &mut sums, at, "sum_squares read-back") };
        let mut st = lock(&self.loss);
        if st.pending {
            st.fetched = Some(sums[LOSS_SLOTS]);
        }
        sums[..LOSS_SLOTS].iter().sum()
    }

    /// The device's loss slots were added to: what the host read of them is stale.
    fn loss_added(&self) {
        let mut st = lock(&self.loss);
        (st.pending, st.fetched) = (true, None);
        if let Some(c) = lock(&self.capturing).as_mut() {
            c.adds_loss();
        }
    }

    /// The embedding backward's `grouping` (`host_ids::group_into`) written to the `Tokens`
    /// scratch at `at`, queued on the compute stream: after the last launch that read the
    /// scratch, before the backward's kernel (eagerly, or a captured graph's, `captured`).
    fn upload_grouping(&self, at: u64, grouping: &[u32]) {
        let scratch = self.scratch(Scratch::Tokens, size_of_val(grouping));
        assert_eq!(
            at, scratch,
            "internal: the grouping goes to the Tokens scratch"
        );
        OPS.write();
        // SAFETY: the scratch holds the grouping (pageable memory, staged by the call); the
        // compute stream orders the copy between the launches around it.
        unsafe { write_queued(&self.gpu.stream, at, grouping, "embedding grouping upload") };
    }

    /// Scratch `which` of at least `bytes`, as a device address.
    fn scratch(&self, which: Scratch, bytes: usize) -> u64 {
        // Every raw copy of the backend goes through a scratch: bound here, it never runs on a
        // thread that has not launched anything yet (cudarc's own calls bind their context,
        // the raw ones do not).
        self.bind();
        let mut s = lock(&self.scratch);
        if s.get(&which).is_none_or(|b| b.bytes() < bytes) {
            s.remove(&which);
            let b = DeviceBlock::new(&self.gpu.ctx, bytes)
                .unwrap_or_else(|e| panic!("CUDA backend scratch {which:?}: {e}"));
            s.insert(which, b);
        }
        s[&which].ptr()
    }

    /// A sum over `rows` rows per column of `cols`, in two passes (`cu/rmsnorm.cu`): the first
    /// pass's grid (a block per 256 columns and row slice), its slice count and the scratch of
    /// its partial sums.
    fn column_sums(&self, rows: usize, cols: usize) -> (LaunchConfig, u64, u64) {
        let slices = column_slices(rows);
        let cfg = LaunchConfig {
            grid_dim: (cols.div_ceil(BLOCK as usize) as u32, slices as u32, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let partial = self.scratch(Scratch::ColumnPartials, column_partials_bytes(rows, cols));
        (cfg, slices as u64, partial)
    }

    /// The product `p` on cuBLASLt: operands A and B of type `types.0`, D of `types.1`, at
    /// device addresses `[a, b, d]`; D accumulates with `acc`.
    fn product(&self, op: &str, p: Product, types: (DType, DType), ptrs: [u64; 3], acc: bool) {
        self.product_of(op, p, Inputs::Stored(types.0), types.1, ptrs, acc, None);
    }

    /// The product `p` with A and B holding `ab` (a storage type, or fp8 codes and scales),
    /// and `bias` added in its epilogue where cuBLASLt can: returns whether it was.
    #[allow(clippy::too_many_arguments)]
    fn product_of(
        &self,
        op: &str,
        p: Product,
        ab: Inputs,
        out: DType,
        [a, b, d]: [u64; 3],
        acc: bool,
        bias: Option<u64>,
    ) -> bool {
        self.bind();
        let stream = self.gpu.stream.cu_stream() as cudarc::cublaslt::sys::cudaStream_t;
        let c = Call {
            p,
            ab,
            out,
            a,
            b,
            d,
            accumulate: acc,
            bias,
        };
        // SAFETY: the pointers are device views the op was handed, of the sizes its shape
        // gives; the stream is the backend's, of the handle's context.
        unsafe { self.lt.run(c, stream) }.unwrap_or_else(|e| panic!("CUDA op {op}: {e}"))
    }

    fn bind(&self) {
        self.gpu
            .ctx
            .bind_to_thread()
            .unwrap_or_else(|e| panic!("CUDA context: {e:?}"));
    }

    /// The device copy of a RoPE table (uploaded once per table).
    fn rope_table(&self, t: &RopeTable) -> (u64, u64) {
        let key = (
            t.cos.as_ptr() as usize,
            t.cos.len(),
            t.head_dim,
            t.cos.last().map_or(0, |x| x.to_bits()) ^ t.sin.last().map_or(0, |x| x.to_bits()),
        );
        let mut r = lock(&self.rope);
        let (c, s) = r.entry(key).or_insert_with(|| {
            let up = |v: &[f32]| {
                super::memory::upload(&self.gpu.ctx, v)
                    .unwrap_or_else(|e| panic!("CUDA RoPE table: {e}"))
            };
            (up(&t.cos), up(&t.sin))
        });
        (c.ptr(), s.ptr())
    }

    fn rope<S: Elem>(&self, s: RopeShape, table: &RopeTable, mut x: ViewMut<'_, S>, sign: f32) {
        let (cos, sin) = self.rope_table(table);
        let pairs = (s.b * s.t * s.heads * s.head_dim / 2) as u64;
        let x = dev_mut(&mut x, "rope");
        let (t, heads, d) = (s.t as u64, s.heads as u64, s.head_dim as u64);
        launch!(self, name::<S>("rope"), elementwise8(pairs); x, cos, sin, t, heads, d, pairs, sign);
    }

    /// `out` (16-bit S) = `src` (f32), for the LM head's products: the staging copy.
    fn stage_head<S: Elem>(&self, dlogits: View<'_, f32>) -> u64 {
        if S::DTYPE == DType::F32 {
            return dev(&dlogits, "head");
        }
        let n = dlogits.len() as u64;
        let out = self.scratch(Scratch::HeadStaging, dlogits.len() * size_of::<S>());
        let src = dev(&dlogits, "head");
        // The cross-entropy that wrote these gradients wrote their copy too (`cross_entropy`).
        if *lock(&self.staged) == Some(StagedHead::now(src, dlogits.len(), out)) {
            return out;
        }
        launch!(self, name::<S>("round_params"), elementwise(n); src, out, n);
        out
    }

    /// The head's logits are written anew (by its forward or a cross-entropy without the
    /// copy): the staging no longer holds their gradients.
    fn unstage_head(&self) {
        *lock(&self.staged) = None;
    }
}

/// `FERROTRON_CUDA_ATTENTION`: `flash` (or unset) or `plain`.
fn plain_attention_from_env() -> Result<bool, DeviceError> {
    match std::env::var(ATTENTION_ENV).as_deref() {
        Err(_) | Ok("flash") => Ok(false),
        Ok("plain") => Ok(true),
        Ok(other) => Err(DeviceError::Driver {
            what: ATTENTION_ENV,
            detail: format!("`{other}` is neither `flash` (tensor cores, the default) nor `plain`"),
        }),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A kernel launch: `launch!(self, name, config; arg, ..)` on the compute stream, the name a
/// `&str` or a [`KernelName`], each argument a value of the kernel's parameter's type.
macro_rules! launch {
    ($s:expr, $name:expr, $cfg:expr; $($arg:expr),* $(,)?) => {{
        let kernel = $name;
        let name: &str = ::core::convert::AsRef::<str>::as_ref(&kernel);
        let f = $s.gpu.function(name);
        let cfg: LaunchConfig = $cfg;
        // No work, no launch: a grid over zero rows or elements is empty (`per_row` & co.),
        // where a block started anyway would touch row 0 of a buffer that has none.
        if cfg.grid_dim.0 > 0 {
            $crate::kernels::cuda::OPS.kernel();
            $s.bind();
            // The arguments are this statement's temporaries, on the stack until the call
            // returns (cuLaunchKernel copies them): no heap allocation per launch, where
            // cudarc's launch builder keeps a Vec of them.
            // SAFETY: the arguments match the kernel's signature (`cu/`), device pointers
            // come from views of device memory with the lengths the kernel reads.
            unsafe {
                result::launch_kernel(
                    f.cu_function(),
                    cfg.grid_dim,
                    cfg.block_dim,
                    cfg.shared_mem_bytes,
                    $s.gpu.stream.cu_stream(),
                    &mut [$($crate::kernels::cuda::backend::param(&$arg)),*],
                )
            }
            .unwrap_or_else(|e| panic!("CUDA kernel {name}: {e:?}"));
        }
    }};
}
use launch;

/// A kernel argument as `cuLaunchKernel` takes it: the address of its value.
pub(in crate::kernels::cuda) fn param<T: DeviceRepr>(v: &T) -> *mut std::ffi::c_void {
    v as *const T as *mut std::ffi::c_void
}

/// A kernel's entry-point name, built on the stack: naming a launch allocates nothing on the
/// step's path (every op names its kernel from its types: `name`, `name2`, `kname!`).
#[derive(Clone, Copy)]
pub(in crate::kernels::cuda) struct KernelName {
    bytes: [u8; 48],
    len: u8,
}

impl KernelName {
    pub(in crate::kernels::cuda) fn of(parts: std::fmt::Arguments<'_>) -> KernelName {
        let mut n = KernelName {
            bytes: [0; 48],
            len: 0,
        };
        std::fmt::Write::write_fmt(&mut n, parts)
            .unwrap_or_else(|_| panic!("internal: a CUDA kernel name over 48 bytes: {parts}"));
        n
    }
}

impl std::fmt::Write for KernelName {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let (at, end) = (self.len as usize, self.len as usize + s.len());
        let to = self.bytes.get_mut(at..end).ok_or(std::fmt::Error)?;
        to.copy_from_slice(s.as_bytes());
        self.len = end as u8;
        Ok(())
    }
}

impl AsRef<str> for KernelName {
    fn as_ref(&self) -> &str {
        std::str::from_utf8(&self.bytes[..self.len as usize]).expect("written from strs")
    }
}

impl std::fmt::Display for KernelName {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_ref())
    }
}

/// A [`KernelName`] from `format!`-style arguments.
macro_rules! kname {
    ($($t:tt)*) => {
        $crate::kernels::cuda::backend::KernelName::of(format_args!($($t)*))
    };
}
use kname;

/// An entry point's name for storage type `S` (`cu/common.cuh`'s suffixes).
fn name<S: Elem>(base: &str) -> KernelName {
    kname!("{base}_{}", sfx(S::DTYPE))
}

/// For a (storage, gradient) pair.
fn name2<S: Elem, G: Elem>(base: &str) -> KernelName {
    kname!("{base}_{}_{}", sfx(S::DTYPE), sfx(G::DTYPE))
}

fn sfx(t: DType) -> &'static str {
    match t {
        DType::F32 => "f32",
        DType::Bf16 => "bf16",
        DType::F16 => "f16",
        other => panic!("the CUDA backend stores no {other:?} tensors"),
    }
}

/// The device address of a view, which must be device memory.
fn dev<T>(v: &View<'_, T>, op: &str) -> u64 {
    assert!(
        matches!(v.memory(), Memory::Device(_)),
        "op {op} was handed {} on the CUDA backend: every buffer must be GPU memory",
        v.memory()
    );
    v.as_ptr() as u64
}

fn dev_mut<T>(v: &mut ViewMut<'_, T>, op: &str) -> u64 {
    dev(&v.as_view(), op)
}

/// Enough blocks for `n` elements (none for none: `launch!` then skips the launch).
fn elementwise(n: u64) -> LaunchConfig {
    let blocks = n.div_ceil(BLOCK as u64).min(65_535 * 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Enough threads for `n` elements taken eight at a time (`for_each8` in common.cuh: 16-byte
/// loads and stores; a misaligned view's elements are spread over the same threads).
fn elementwise8(n: u64) -> LaunchConfig {
    elementwise(n.div_ceil(8))
}

/// One block per row (none for no rows).
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (BLOCK, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One warp per row, four warps a block (none for no rows).
fn per_warp(rows: u64) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows.div_ceil(4) as u32, 1, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The tensor-core attention's grid: a block of 4 warps per (batch, head) and 64-row tile
/// (`FA_TILE` in `cu/flash_attention.cu`), heads along x (no limit), tiles along y (65,535 of
/// them: sequences up to 4M).
fn per_tile(heads: usize, t: usize) -> LaunchConfig {
    // No rows, no launch (`launch!` looks at x).
    let heads = if t == 0 { 0 } else { heads as u32 };
    LaunchConfig {
        grid_dim: (heads, t.div_ceil(64) as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Every `(given, expected)` length of op `op`'s views equal (a kernel reads and writes by the
/// shape alone: a short view is a bug in the caller, named here rather than past its end).
#[track_caller]
fn check_lens(op: &str, lens: &[(usize, usize)]) {
    for (i, &(got, want)) in lens.iter().enumerate() {
        assert_eq!(
            got, want,
            "{op}: view {i} holds {got} elements, the shape {want}"
        );
    }
}

fn attn_dims(s: AttnShape) -> AttnDims {
    AttnDims {
        b: s.b as u64,
        t: s.t as u64,
        heads: s.heads as u64,
        kv_heads: s.kv_heads as u64,
        d: s.head_dim as u64,
        scale: 1.0 / (s.head_dim as f32).sqrt(),
    }
}

impl<S: Elem, G: Elem> Kernels<S, G> for CudaKernels {
    fn synchronize(&self) {
        self.bind();
        let _w = OPS.sync(SyncSite::StreamSync);
        (self.gpu.stream.synchronize()).unwrap_or_else(|e| panic!("CUDA stream: {e:?}"));
    }

    fn op_begin(&self, op: &'static str) -> bool {
        lock(&self.op_events).begin(op, &self.gpu.ctx, &self.gpu.stream);
        true
    }

    fn op_end(&self) {
        lock(&self.op_events).end(&self.gpu.ctx, &self.gpu.stream);
    }

    fn take_device_spans(&self, out: &mut Vec<DeviceSpan>) {
        self.bind();
        (lock(&self.op_events).take(out)).unwrap_or_else(|e| panic!("{e}"));
    }

    fn host_ids(&self, ids: View<'_, u32>, host: &[u32]) {
        assert_eq!(ids.len(), host.len(), "host_ids lens");
        host_ids::ids().note(dev(&ids, "host_ids"), host);
    }

    fn take_loss(&self) -> f64 {
        let acc = self.partials() + (LOSS_SLOTS * 8) as u64;
        let mut st = lock(&self.loss);
        if !st.pending {
            return 0.0;
        }
        let sum = match st.fetched.take() {
            Some(read) => read,
            None => {
                let mut slot = [0f64];
                let _w = OPS.sync(SyncSite::CeLoss);
                // SAFETY: the partials scratch holds the slot; the copy waits for the kernels
                // that add to it.
                unsafe { read_after(&self.gpu.stream, &mut slot, acc, "take_loss read-back") };
                slot[0]
            }
        };
        launch!(self, "loss_reset", one_thread(); acc);
        st.pending = false;
        sum
    }

    fn limits(&self) -> Limits {
        Limits {
            backend: "CUDA",
            max_head_dim: 128,
            experts: true,
        }
    }

    fn matmul_forward(
        &self,
        s: MatmulShape,
        x: View<'_, S>,
        w: View<'_, S>,
        bias: Option<View<'_, S>>,
        mut y: ViewMut<'_, S>,
        y_accum: Accum,
    ) {
        let op = "matmul_forward";
        let (x, w, y) = (dev(&x, op), dev(&w, op), dev_mut(&mut y, op));
        let acc = y_accum == Accum::Add;
        let bias = bias.map(|b| dev(&b, op));
        let added = match self.fp8 {
            Some(f) => {
                self.fp8_forward::<S>(s, f, [x, w, y], acc);
                false
            }
            None => {
                let (p, ab) = (gemm::forward(s), Inputs::Stored(S::DTYPE));
                self.product_of(op, p, ab, S::DTYPE, [w, x, y], acc, bias)
            }
        };
        // Where the epilogue did not take it (fp8's products, an unaligned bias, one cuBLASLt
        // declined: `gemm::Lt::run`): its own pass.
        if let (Some(bias), false, true) = (bias, added, s.n > 0) {
            let (rows, cols) = (s.n as u64, s.out_features as u64);
            launch!(self, name::<S>("bias_add"), elementwise(rows * cols); y, bias, rows, cols);
        }
    }

    fn matmul_backward_weight(
        &self,
        s: MatmulShape,
        dy: View<'_, S>,
        x: View<'_, S>,
        mut dw: ViewMut<'_, G>,
        dbias: Option<ViewMut<'_, G>>,
    ) {
        let op = "matmul_backward_weight";
        let (dyp, xp, dwp) = (dev(&dy, op), dev(&x, op), dev_mut(&mut dw, op));
        match self.fp8 {
            Some(f) => self.fp8_backward_weight::<S, G>(s, f, [dyp, xp, dwp]),
            None => self.product(
                op,
                gemm::backward_weight(s),
                (S::DTYPE, G::DTYPE),
                [xp, dyp, dwp],
                true,
            ),
        }
        if let (Some(mut db), true) = (dbias, s.n > 0) {
            let (db, rows, cols) = (dev_mut(&mut db, op), s.n as u64, s.out_features as u64);
            let (cfg, slices, partial) = self.column_sums(s.n, s.out_features);
            launch!(self, name::<S>("bias_grad_partial"), cfg; dyp, partial, rows, cols, slices);
            launch!(self, name::<G>("column_partials_add"), elementwise(cols); partial, db, slices, cols);
        }
    }

    fn matmul_backward_input(
        &self,
        s: MatmulShape,
        dy: View<'_, S>,
        w: View<'_, S>,
        mut dx: ViewMut<'_, S>,
        dx_accum: Accum,
    ) {
        let op = "matmul_backward_input";
        let (dy, w, dx) = (dev(&dy, op), dev(&w, op), dev_mut(&mut dx, op));
        let acc = dx_accum == Accum::Add;
        match self.fp8 {
            Some(f) => self.fp8_backward_input::<S>(s, f, [dy, w, dx], acc),
            None => self.product(
                op,
                gemm::backward_input(s),
                (S::DTYPE, S::DTYPE),
                [w, dy, dx],
                acc,
            ),
        }
    }

    fn head_forward(
        &self,
        s: MatmulShape,
        x: View<'_, S>,
        w: View<'_, S>,
        mut logits: ViewMut<'_, f32>,
    ) {
        let op = "head_forward";
        self.unstage_head();
        let (x, w, l) = (dev(&x, op), dev(&w, op), dev_mut(&mut logits, op));
        self.product(
            op,
            gemm::forward(s),
            (S::DTYPE, DType::F32),
            [w, x, l],
            false,
        );
    }

    // The head's products take the f32 logit gradients rounded to S (for 16-bit S), as
    // PyTorch's autocast does; the CPU multiplies them in f32 (a difference within the
    // 16-bit type's rounding).
    fn head_backward_weight(
        &self,
        s: MatmulShape,
        dlogits: View<'_, f32>,
        x: View<'_, S>,
        mut dw: ViewMut<'_, G>,
    ) {
        let op = "head_backward_weight";
        let dl = self.stage_head::<S>(dlogits);
        let (x, dw) = (dev(&x, op), dev_mut(&mut dw, op));
        self.product(
            op,
            gemm::backward_weight(s),
            (S::DTYPE, G::DTYPE),
            [x, dl, dw],
            true,
        );
    }

    fn head_backward_input(
        &self,
        s: MatmulShape,
        dlogits: View<'_, f32>,
        w: View<'_, S>,
        mut dx: ViewMut<'_, S>,
    ) {
        let op = "head_backward_input";
        let dl = self.stage_head::<S>(dlogits);
        let (w, dx) = (dev(&w, op), dev_mut(&mut dx, op));
        self.product(
            op,
            gemm::backward_input(s),
            (S::DTYPE, S::DTYPE),
            [w, dl, dx],
            false,
        );
    }

    fn rmsnorm_forward(
        &self,
        s: NormShape,
        x: View<'_, S>,
        w: View<'_, S>,
        mut out: ViewMut<'_, S>,
        mut rstd: ViewMut<'_, f32>,
    ) {
        let op = "rmsnorm_forward";
        let (x, w) = (dev(&x, op), dev(&w, op));
        let (o, r, c) = (dev_mut(&mut out, op), dev_mut(&mut rstd, op), s.c as u64);
        launch!(self, name::<S>(op), per_row(s.n); x, w, o, r, c, s.eps);
    }

    fn add_rmsnorm_forward(
        &self,
        s: NormShape,
        mut resid: ViewMut<'_, S>,
        x: View<'_, S>,
        w: View<'_, S>,
        mut out: ViewMut<'_, S>,
        mut rstd: ViewMut<'_, f32>,
    ) {
        let op = "add_rmsnorm_forward";
        let (x, w, a) = (dev(&x, op), dev(&w, op), dev_mut(&mut resid, op));
        let (o, r, c) = (dev_mut(&mut out, op), dev_mut(&mut rstd, op), s.c as u64);
        launch!(self, name::<S>(op), per_row(s.n); a, x, w, o, r, c, s.eps);
    }

    fn rmsnorm_backward(
        &self,
        s: NormShape,
        dy: View<'_, S>,
        x: View<'_, S>,
        w: View<'_, S>,
        rstd: View<'_, f32>,
        mut dx: ViewMut<'_, S>,
        dx_accum: Accum,
        mut dw: ViewMut<'_, G>,
    ) {
        let op = "rmsnorm_backward";
        let (dy, x, w, r) = (dev(&dy, op), dev(&x, op), dev(&w, op), dev(&rstd, op));
        let (dx, dw) = (dev_mut(&mut dx, op), dev_mut(&mut dw, op));
        let (n, c, acc) = (s.n as u64, s.c as u64, (dx_accum == Accum::Add) as i32);
        launch!(self, name::<S>("rmsnorm_backward_input"), per_row(s.n); dy, x, w, r, dx, c, acc);
        if n == 0 {
            return;
        }
        let (cfg, slices, partial) = self.column_sums(s.n, s.c);
        launch!(self, name::<S>("rmsnorm_weight_partial"), cfg; dy, x, r, partial, n, c, slices);
        launch!(self, name::<G>("column_partials_add"), elementwise(c); partial, dw, slices, c);
    }

    fn rope_forward(&self, s: RopeShape, table: &RopeTable, x: ViewMut<'_, S>) {
        self.rope(s, table, x, 1.0);
    }

    fn rope_backward(&self, s: RopeShape, table: &RopeTable, dx: ViewMut<'_, S>) {
        self.rope(s, table, dx, -1.0);
    }

    fn attention_forward(
        &self,
        s: AttnShape,
        q: View<'_, S>,
        k: View<'_, S>,
        v: View<'_, S>,
        mut o: ViewMut<'_, S>,
        mut lse: ViewMut<'_, f32>,
    ) {
        let op = "attention_forward";
        let (q, k, v) = (dev(&q, op), dev(&k, op), dev(&v, op));
        let (o, l, d) = (dev_mut(&mut o, op), dev_mut(&mut lse, op), attn_dims(s));
        if let Some(f) = self.flash::<S>(s) {
            let cfg = per_tile(s.b * s.heads, s.t);
            launch!(self, kname!("flash_forward_{f}"), cfg; d, q, k, v, o, l);
            return;
        }
        let rows = (s.b * s.heads * s.t) as u64;
        launch!(self, name::<S>(op), per_warp(rows); d, q, k, v, o, l);
    }

    fn attention_backward(
        &self,
        s: AttnShape,
        q: View<'_, S>,
        k: View<'_, S>,
        v: View<'_, S>,
        o: View<'_, S>,
        lse: View<'_, f32>,
        d_o: View<'_, S>,
        mut dq: ViewMut<'_, S>,
        mut dk: ViewMut<'_, S>,
        mut dv: ViewMut<'_, S>,
    ) {
        let op = "attention_backward";
        let (q, k, v, o) = (dev(&q, op), dev(&k, op), dev(&v, op), dev(&o, op));
        let (l, d_o) = (dev(&lse, op), dev(&d_o, op));
        let (dq, dk, dv) = (
            dev_mut(&mut dq, op),
            dev_mut(&mut dk, op),
            dev_mut(&mut dv, op),
        );
        let delta = self.scratch(Scratch::AttnDelta, s.lse_len() * 4);
        let d = attn_dims(s);
        if let Some(f) = self.flash::<S>(s) {
            let cfg = per_tile(s.b * s.heads, s.t);
            launch!(self, kname!("flash_backward_q_{f}"), cfg; d, q, k, v, o, l, d_o, dq, delta);
            let cfg = per_tile(s.b * s.kv_heads, s.t);
            launch!(self, kname!("flash_backward_kv_{f}"), cfg; d, q, k, v, l, d_o, delta, dk, dv);
            return;
        }
        let q_rows = (s.b * s.heads * s.t) as u64;
        launch!(self, name::<S>("attention_backward_q"), per_warp(q_rows); d, q, k, v, o, l, d_o, dq, delta);
        let kv_rows = (s.b * s.kv_heads * s.t) as u64;
        launch!(self, name::<S>("attention_backward_kv"), per_warp(kv_rows); d, q, k, v, l, d_o, delta, dk, dv);
    }

    fn attention_forward_cached(
        &self,
        _: CachedAttnShape,
        _: View<'_, S>,
        _: View<'_, S>,
        _: View<'_, S>,
        _: ViewMut<'_, S>,
    ) {
        panic!("attention_forward_cached: sampling with a KV cache runs on the CPU backend")
    }

    fn attention_forward_ring(
        &self,
        s: RingShape,
        q: View<'_, S>,
        k: View<'_, f32>,
        v: View<'_, f32>,
        mut o: ViewMut<'_, f32>,
        mut lse: ViewMut<'_, f32>,
        first: bool,
    ) {
        let op = "attention_forward_ring";
        let a = s.attn;
        check_lens(
            op,
            &[
                (q.len(), a.q_len()),
                (k.len(), a.kv_len()),
                (v.len(), a.kv_len()),
            ],
        );
        check_lens(op, &[(o.len(), a.q_len()), (lse.len(), a.lse_len())]);
        let (q, k, v) = (dev(&q, op), dev(&k, op), dev(&v, op));
        let (o, l) = (dev_mut(&mut o, op), dev_mut(&mut lse, op));
        let (d, p, merge) = (attn_dims(a), ring_parts(s), i32::from(!first));
        let rows = (a.b * a.heads * a.t) as u64;
        launch!(self, name::<S>("ring_forward"), per_warp(rows); d, p, q, k, v, o, l, merge);
    }

    fn attention_backward_ring(
        &self,
        s: RingShape,
        q: View<'_, S>,
        k: View<'_, f32>,
        v: View<'_, f32>,
        o: View<'_, S>,
        lse: View<'_, f32>,
        d_o: View<'_, S>,
        mut dq: ViewMut<'_, f32>,
        mut dk: ViewMut<'_, f32>,
        mut dv: ViewMut<'_, f32>,
    ) {
        let op = "attention_backward_ring";
        let a = s.attn;
        let (ql, kvl) = (a.q_len(), a.kv_len());
        check_lens(
            op,
            &[
                (q.len(), ql),
                (o.len(), ql),
                (d_o.len(), ql),
                (dq.len(), ql),
            ],
        );
        check_lens(
            op,
            &[
                (k.len(), kvl),
                (v.len(), kvl),
                (dk.len(), kvl),
                (dv.len(), kvl),
            ],
        );
        check_lens(op, &[(lse.len(), a.lse_len())]);
        let (q, k, v, o) = (dev(&q, op), dev(&k, op), dev(&v, op), dev(&o, op));
        let (l, d_o) = (dev(&lse, op), dev(&d_o, op));
        let (dq, dk, dv) = (
            dev_mut(&mut dq, op),
            dev_mut(&mut dk, op),
            dev_mut(&mut dv, op),
        );
        let delta = self.scratch(Scratch::AttnDelta, a.lse_len() * 4);
        let (d, p) = (attn_dims(a), ring_parts(s));
        let q_rows = (a.b * a.heads * a.t) as u64;
        launch!(self, name::<S>("ring_backward_q"), per_warp(q_rows); d, p, q, k, v, o, l, d_o, dq, delta);
        let kv_rows = (a.b * a.kv_heads * a.t) as u64;
        launch!(self, name::<S>("ring_backward_kv"), per_warp(kv_rows); d, p, q, k, v, l, d_o, delta, dk, dv);
    }

    fn swiglu_forward(&self, gate: View<'_, S>, up: View<'_, S>, mut h: ViewMut<'_, S>) {
        let op = "swiglu_forward";
        let n = h.len() as u64;
        let (g, u, h) = (dev(&gate, op), dev(&up, op), dev_mut(&mut h, op));
        launch!(self, name::<S>(op), elementwise8(n); g, u, h, n);
    }

    fn swiglu_backward(
        &self,
        dh: View<'_, S>,
        gate: View<'_, S>,
        up: View<'_, S>,
        mut dgate: ViewMut<'_, S>,
        mut dup: ViewMut<'_, S>,
    ) {
        let op = "swiglu_backward";
        let n = dh.len() as u64;
        let (dh, g, u) = (dev(&dh, op), dev(&gate, op), dev(&up, op));
        let (dg, du) = (dev_mut(&mut dgate, op), dev_mut(&mut dup, op));
        launch!(self, name::<S>(op), elementwise8(n); dh, g, u, dg, du, n);
    }

    fn router_forward(
        &self,
        s: RouteShape,
        logits: View<'_, f32>,
        weights: ViewMut<'_, f32>,
        index: ViewMut<'_, u32>,
        load: ViewMut<'_, f32>,
    ) {
        self.moe_router_forward(s, logits, weights, index, load)
    }
    fn router_backward(
        &self,
        s: RouteShape,
        logits: View<'_, f32>,
        index: View<'_, u32>,
        dweights: View<'_, f32>,
        aux_dp: View<'_, f32>,
        dlogits: ViewMut<'_, f32>,
    ) {
        self.moe_router_backward(s, logits, index, dweights, aux_dp, dlogits)
    }
    fn permute(&self, s: RouteShape, index: View<'_, u32>, x: View<'_, S>, rows: ViewMut<'_, S>) {
        self.moe_permute(s, index, x, rows)
    }
    fn unpermute(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        weights: Option<View<'_, f32>>,
        rows: View<'_, S>,
        y: ViewMut<'_, S>,
        accum: Accum,
    ) {
        self.moe_unpermute(s, index, weights, rows, y, accum)
    }
    fn scale_rows(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        weights: View<'_, f32>,
        rows: ViewMut<'_, S>,
    ) {
        self.moe_scale_rows(s, index, weights, rows)
    }
    fn row_dot(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        a: View<'_, S>,
        b: View<'_, S>,
        out: ViewMut<'_, f32>,
    ) {
        self.moe_row_dot(s, index, a, b, out)
    }
    fn gather_copies(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        values: View<'_, f32>,
        rows: ViewMut<'_, f32>,
    ) {
        self.moe_copies(s, index, values, rows, true)
    }
    fn scatter_copies(
        &self,
        s: RouteShape,
        index: View<'_, u32>,
        rows: View<'_, f32>,
        values: ViewMut<'_, f32>,
    ) {
        self.moe_copies(s, index, rows, values, false)
    }
    fn scale_each_row(&self, width: usize, weights: View<'_, f32>, rows: ViewMut<'_, S>) {
        self.moe_scale_each_row(width, weights, rows)
    }
    fn dot_each_row(&self, width: usize, a: View<'_, S>, b: View<'_, S>, out: ViewMut<'_, f32>) {
        self.moe_dot_each_row(width, a, b, out)
    }

    fn embedding_forward(
        &self,
        tokens: View<'_, u32>,
        wte: View<'_, S>,
        c: usize,
        out: ViewMut<'_, S>,
    ) {
        Kernels::<S, G>::embedding_forward_shard(self, tokens, wte, c, 0, out)
    }

    fn embedding_backward(
        &self,
        tokens: View<'_, u32>,
        dout: View<'_, S>,
        c: usize,
        dwte: ViewMut<'_, G>,
    ) {
        Kernels::<S, G>::embedding_backward_shard(self, tokens, dout, c, 0, dwte)
    }

    fn embedding_forward_shard(
        &self,
        tokens: View<'_, u32>,
        wte: View<'_, S>,
        c: usize,
        first: usize,
        mut out: ViewMut<'_, S>,
    ) {
        let op = "embedding_forward";
        let (n, rows) = (tokens.len() as u64, (wte.len() / c.max(1)) as u64);
        let (t, w, o) = (dev(&tokens, op), dev(&wte, op), dev_mut(&mut out, op));
        let (c, first) = (c as u64, first as u64);
        launch!(self, name::<S>(op), elementwise(n * c); t, w, o, n, c, first, rows);
    }

    fn embedding_backward_shard(
        &self,
        tokens: View<'_, u32>,
        dout: View<'_, S>,
        c: usize,
        first: usize,
        mut dwte: ViewMut<'_, G>,
    ) {
        let op = "embedding_backward";
        if tokens.is_empty() {
            return;
        }
        // The grouping is built on the host from the trainer's copy of the ids (read back
        // where there is none) and uploaded in one write of a few KiB, of one length for `n`
        // positions; inside a capture, before each launch of the graph (`captured`).
        let n = tokens.len();
        let base = {
            let mut ids = host_ids::ids();
            let grouping = ids.grouping(tokens);
            let base = self.scratch(Scratch::Tokens, 4 * grouping.len());
            if let Some(c) = lock(&self.capturing).as_mut() {
                let at = dev(&tokens, op);
                c.grouping(at, n, base)
                    .unwrap_or_else(|e| panic!("CUDA graph: {e}"));
            } else {
                self.upload_grouping(base, grouping);
            }
            base
        };
        let rows = (dwte.len() / c.max(1)) as u64;
        let (t, d, dw) = (dev(&tokens, op), dev(&dout, op), dev_mut(&mut dwte, op));
        let (ord, st, c, first) = (base, base + 4 * n as u64, c as u64, first as u64);
        // A block per position (`host_ids::group_into`): the same launch whatever the tokens.
        launch!(self, name2::<S, G>(op), per_row(n); t, ord, st, d, dw, c, first, rows);
    }

    fn add(&self, a: View<'_, S>, b: View<'_, S>, mut out: ViewMut<'_, S>) {
        let n = out.len() as u64;
        let (a, b, o) = (dev(&a, "add"), dev(&b, "add"), dev_mut(&mut out, "add"));
        launch!(self, name::<S>("add"), elementwise8(n); a, b, o, n);
    }

    fn add_inplace(&self, mut acc: ViewMut<'_, S>, x: View<'_, S>) {
        let n = acc.len() as u64;
        let (a, x) = (dev_mut(&mut acc, "add_inplace"), dev(&x, "add_inplace"));
        launch!(self, name::<S>("add_inplace"), elementwise8(n); a, x, n);
    }

    fn copy(&self, src: View<'_, S>, mut dst: ViewMut<'_, S>) {
        assert_eq!(src.len(), dst.len(), "copy lens");
        let (s, d) = (dev(&src, "copy"), dev_mut(&mut dst, "copy"));
        self.bind();
        OPS.copy();
        // SAFETY: both are device buffers of `len` elements.
        unsafe {
            result::memcpy_dtod_async(
                d,
                s,
                src.len() * size_of::<S>(),
                self.gpu.stream.cu_stream(),
            )
        }
        .unwrap_or_else(|e| panic!("CUDA op copy: {e:?}"));
    }

    fn scale(&self, mut x: ViewMut<'_, G>, s: f32) {
        let n = x.len() as u64;
        let x = dev_mut(&mut x, "scale");
        launch!(self, name::<G>("scale"), elementwise(n); x, n, s);
    }

    fn sum_squares(&self, x: View<'_, G>) -> f64 {
        let n = x.len() as u64;
        let partial = self.partials();
        let x = dev(&x, "sum_squares");
        launch!(self, name::<G>("sum_squares"), sum_grid(); x, n, partial);
        self.read_partials()
    }

    fn sum_squares_weighted(&self, parts: Weighted<'_, '_, G>) -> f64 {
        let partial = self.partials();
        let mut add = 0i32;
        for (x, w) in parts {
            let n = x.len() as u64;
            let x = dev(&x, "sum_squares_weighted");
            launch!(self, name::<G>("sum_squares_add"), sum_grid(); x, n, partial, w, add);
            add = 1;
        }
        match add {
            0 => 0.0,
            _ => self.read_partials(),
        }
    }

    fn widen(&self, src: View<'_, S>, mut dst: ViewMut<'_, f32>) {
        assert_eq!(src.len(), dst.len(), "widen lens");
        let n = dst.len() as u64;
        let (s, d) = (dev(&src, "widen"), dev_mut(&mut dst, "widen"));
        launch!(self, name::<S>("widen"), elementwise(n); s, d, n);
    }

    /// The rounding of `round_params`.
    fn narrow(&self, src: View<'_, f32>, mut dst: ViewMut<'_, S>) {
        assert_eq!(src.len(), dst.len(), "narrow lens");
        let n = dst.len() as u64;
        let (s, d) = (dev(&src, "narrow"), dev_mut(&mut dst, "narrow"));
        launch!(self, name::<S>("round_params"), elementwise(n); s, d, n);
    }

    fn round_params(&self, src: View<'_, f32>, mut dst: ViewMut<'_, S>) {
        let n = dst.len() as u64;
        let (s, d) = (dev(&src, "round_params"), dev_mut(&mut dst, "round_params"));
        launch!(self, name::<S>("round_params"), elementwise(n); s, d, n);
    }

    /// Counted on the host from the trainer's copy (`host_ids`), else on the device and read
    /// back at once: a mixture of experts weighs its load-balancing term by it during the
    /// forward (`router_loss`).
    fn count_targets(&self, targets: View<'_, u32>, vocab: usize) -> usize {
        // The trainer's copy of the targets, where it announced one: no read-back.
        if let Some(n) = host_ids::ids().count_below(&targets, vocab) {
            return n;
        }
        let n = targets.len() as u64;
        let count = self.scratch(Scratch::TargetCount, 8);
        OPS.write();
        // SAFETY: the scratch holds 8 bytes.
        unsafe { zero_queued(&self.gpu.stream, count, 8, "count_targets reset") };
        let (t, vocab) = (dev(&targets, "count_targets"), vocab as u32);
        launch!(self, "count_targets", elementwise(n); t, n, vocab, count);
        let mut c = [0u64];
        let _w = OPS.sync(SyncSite::TargetCount);
        // SAFETY: as above; the copy waits for the kernel.
        unsafe { read_after(&self.gpu.stream, &mut c, count, "count_targets read-back") };
        c[0] as usize
    }

    fn cross_entropy(
        &self,
        s: CeShape,
        mut logits: ViewMut<'_, f32>,
        targets: View<'_, u32>,
        mut losses: ViewMut<'_, f32>,
        dlogits_scale: Option<f32>,
    ) -> f64 {
        let op = "cross_entropy";
        let len = logits.len();
        let (z, t) = (dev_mut(&mut logits, op), dev(&targets, op));
        let l = dev_mut(&mut losses, op);
        let (vocab, grad, scale) = (
            s.vocab as u64,
            dlogits_scale.is_some() as i32,
            dlogits_scale.unwrap_or(0.0),
        );
        self.unstage_head();
        let staged = match S::DTYPE {
            // The 16-bit copy the head's products take, written in the same pass.
            DType::Bf16 | DType::F16 if dlogits_scale.is_some() => {
                let out = self.scratch(Scratch::HeadStaging, len * size_of::<S>());
                let kernel = name::<S>("cross_entropy_staged");
                launch!(self, kernel, per_row(s.rows); z, t, l, vocab, grad, scale, out);
                Some(out)
            }
            _ => {
                launch!(self, op, per_row(s.rows); z, t, l, vocab, grad, scale);
                None
            }
        };
        // Added on the device to the step's sum, in row order as the CPU adds them, for
        // `take_loss`: no host round trip per chunk.
        if s.rows > 0 {
            let (acc, rows) = (self.partials() + (LOSS_SLOTS * 8) as u64, s.rows as u64);
            launch!(self, "loss_accumulate", one_thread(); l, rows, acc);
            self.loss_added();
        }
        // Noted last: the loss's scratch, made at the first call, moves the write epoch.
        *lock(&self.staged) = staged.map(|staging| StagedHead::now(z, len, staging));
        0.0
    }

    fn ce_shard_stats(
        &self,
        s: CeShardShape,
        mut logits: ViewMut<'_, f32>,
        targets: View<'_, u32>,
        mut stats: ViewMut<'_, f32>,
        keep_exp: bool,
    ) {
        let op = "ce_shard_stats";
        assert_eq!(logits.len(), s.rows * s.vocab, "ce logits len");
        assert_eq!(targets.len(), s.rows, "ce targets len");
        assert_eq!(stats.len(), s.rows * 3, "ce stats len");
        self.unstage_head();
        if s.rows == 0 {
            return;
        }
        let (z, t, st) = (
            dev_mut(&mut logits, op),
            dev(&targets, op),
            dev_mut(&mut stats, op),
        );
        let (vocab, first, keep) = (s.vocab as u64, s.first as u64, keep_exp as i32);
        launch!(self, op, per_row(s.rows); z, t, st, vocab, first, keep);
    }

    fn ce_shard_finish(
        &self,
        s: CeShardShape,
        mut logits: ViewMut<'_, f32>,
        targets: View<'_, u32>,
        all: View<'_, f32>,
        rank: usize,
        mut losses: ViewMut<'_, f32>,
        dlogits_scale: Option<f32>,
    ) -> f64 {
        let op = "ce_shard_finish";
        let ranks = all.len() / (3 * s.rows).max(1);
        assert_eq!(all.len(), ranks * s.rows * 3, "ce gathered stats len");
        assert!(rank < ranks || s.rows == 0, "rank {rank} of {ranks}");
        assert_eq!(losses.len(), s.rows, "ce losses len");
        self.unstage_head();
        if s.rows == 0 {
            return 0.0;
        }
        let (z, t, a) = (dev_mut(&mut logits, op), dev(&targets, op), dev(&all, op));
        let l = dev_mut(&mut losses, op);
        let (rows, ranks, rank) = (s.rows as u64, ranks as u64, rank as u64);
        let (vocab, first, full) = (s.vocab as u64, s.first as u64, s.full_vocab as u64);
        let (grad, scale) = (dlogits_scale.is_some() as i32, dlogits_scale.unwrap_or(0.0));
        launch!(self, op, per_row(s.rows);
            z, t, a, rows, ranks, rank, l, vocab, first, full, grad, scale);
        // The step's loss sum on the device, as `cross_entropy` keeps it.
        let acc = self.partials() + (LOSS_SLOTS * 8) as u64;
        launch!(self, "loss_accumulate", one_thread(); l, rows, acc);
        self.loss_added();
        0.0
    }

    fn adamw_step(
        &self,
        h: AdamWParams,
        mut master: ViewMut<'_, f32>,
        grads: View<'_, G>,
        mut m: ViewMut<'_, f32>,
        mut v: ViewMut<'_, f32>,
        params: Option<(ViewMut<'_, S>, Rounding)>,
    ) {
        let op = "adamw_step";
        let n = master.len() as u64;
        assert!(
            grads.len() == n as usize && m.len() == n as usize && v.len() == n as usize,
            "adamw lens"
        );
        let c = Consts::of(h);
        let (p, g) = (dev_mut(&mut master, op), dev(&grads, op));
        let (m, v) = (dev_mut(&mut m, op), dev_mut(&mut v, op));
        let (out, rounding, seed) = match params {
            None => (0u64, 0i32, 0u64),
            Some((mut o, r)) => {
                assert_eq!(o.len(), n as usize, "adamw params out len");
                let o = dev_mut(&mut o, op);
                match r {
                    Rounding::Nearest => (o, 1, 0),
                    Rounding::Stochastic { seed } => (o, 2, seed),
                }
            }
        };
        launch!(self, name2::<S, G>("adamw"), elementwise8(n); c, p, g, m, v, out, n, rounding, seed, h.step);
    }
}

#[cfg(test)]
mod tests {
    /// Every kernel of the program can be named on the stack (`KernelName`'s 48 bytes).
    #[test]
    fn every_entry_point_fits_a_kernel_name() {
        for n in super::super::source::entry_points() {
            assert_eq!(kname!("{n}").as_ref(), n);
        }
        let long = "k".repeat(49);
        let refused = std::panic::catch_unwind(|| kname!("{long}"));
        assert!(refused.is_err(), "a name over 48 bytes is refused");
    }
}
