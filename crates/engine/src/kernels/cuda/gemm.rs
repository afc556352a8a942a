//! The linear layers' products on cuBLASLt.
//!
//! The engine's matrices are row-major (`nn.Linear`: `W [out, in]`, activations `[N, C]`);
//! cuBLASLt's are column-major. A row-major `M [r, c]` is the column-major `Mᵀ [c, r]` with the
//! same leading dimension, so each product is written as the transposed one (`(A·B)ᵀ = Bᵀ·Aᵀ`)
//! with no copy. [`Product`] is that description, built by [`forward`], [`backward_input`] and
//! [`backward_weight`]; [`reference`] computes it on the host by cuBLAS's definition, which is
//! how the mapping is tested against the CPU backend without a GPU.
//!
//! A bias (`nn.Linear`'s, the attention's q/k/v in Qwen2) is added in the product's epilogue
//! (`CUBLASLT_EPILOGUE_BIAS`): one launch instead of two, and D rounded once, after the bias,
//! as the CPU rounds it. cuBLASLt adds a bias of D's type over D's rows (the engine's output
//! features), after α·A·B + β·C (the cuBLASLt documentation, "cublasLtEpilogue_t").
//!
//! Arithmetic: f32 accumulation always (`CUBLAS_COMPUTE_32F`; TF32 is not enabled, so fp32
//! products are IEEE fp32 as on the CPU); bf16/f16 operands multiply as stored. `+=` outputs
//! use β = 1, so a gradient of a 16-bit type is rounded once per call, as on the CPU.

use crate::kernels::MatmulShape;
use crate::numerics::fp8::Fp8Format;
use cudarc::cublaslt::{result as lt, sys};
use ferrotron_plan::DType;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

/// One column-major operand: `rows × cols` stored with leading dimension `ld`, used as is or
/// transposed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Operand {
    pub rows: usize,
    pub cols: usize,
    pub ld: usize,
    pub trans: bool,
}

/// `D [m, n] = op(A) [m, k] · op(B) [k, n] (+ D)`, column-major.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Product {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: Operand,
    pub b: Operand,
}

fn plain(rows: usize, cols: usize) -> Operand {
    Operand {
        rows,
        cols,
        ld: rows,
        trans: false,
    }
}

fn transposed(rows: usize, cols: usize) -> Operand {
    Operand {
        trans: true,
        ..plain(rows, cols)
    }
}

/// `Y [n, out] = X [n, in] · W [out, in]ᵀ`, as `Yᵀ [out, n] = op(W: [in, out])ᵀ · Xᵀ [in, n]`:
/// A = W (transposed), B = X.
pub fn forward(s: MatmulShape) -> Product {
    Product {
        m: s.out_features,
        n: s.n,
        k: s.in_features,
        a: transposed(s.in_features, s.out_features),
        b: plain(s.in_features, s.n),
    }
}

/// `dX [n, in] = dY [n, out] · W [out, in]`, as `dXᵀ [in, n] = W' [in, out] · dYᵀ [out, n]`:
/// A = W, B = dY.
pub fn backward_input(s: MatmulShape) -> Product {
    Product {
        m: s.in_features,
        n: s.n,
        k: s.out_features,
        a: plain(s.in_features, s.out_features),
        b: plain(s.out_features, s.n),
    }
}

/// `dW [out, in] = dY [n, out]ᵀ · X [n, in]`, as `dWᵀ [in, out] = Xᵀ [in, n] · op(dYᵀ: [out, n])ᵀ`:
/// A = X, B = dY (transposed).
pub fn backward_weight(s: MatmulShape) -> Product {
    Product {
        m: s.in_features,
        n: s.out_features,
        k: s.n,
        a: plain(s.in_features, s.n),
        b: transposed(s.out_features, s.n),
    }
}

/// Hopper's fp8 products take A transposed and B not ("TN", the cuBLASLt documentation,
/// `cublasLtMatmul`: k contiguous in both operands). The forward is already so; the input
/// gradient reads `Wᵀ [in, out]` (row-major, a transposed copy of the weight) as A; the weight
/// gradient reads `Xᵀ [in, k]` as A and `dYᵀ [out, k]` as B, each row padded to `k` ≥ n tokens
/// (a multiple of 16, as the operands' leading dimension must be, the pad zeros).
pub fn fp8_backward_input(s: MatmulShape) -> Product {
    Product {
        a: transposed(s.out_features, s.in_features),
        ..backward_input(s)
    }
}

/// See [`fp8_backward_input`]; `k` is the padded token count.
pub fn fp8_backward_weight(s: MatmulShape, k: usize) -> Product {
    Product {
        m: s.in_features,
        n: s.out_features,
        k,
        a: transposed(k, s.in_features),
        b: plain(k, s.out_features),
    }
}

/// `d = op(a)·op(b) + beta·d` by cuBLAS's definition (column-major, `M[r, c]` at `r + c·ld`),
/// on the host: the specification the GPU's products are tested against.
pub fn reference(p: &Product, a: &[f32], b: &[f32], d: &mut [f32], beta: f32) {
    let at = |o: &Operand, m: &[f32], r: usize, c: usize| match o.trans {
        false => m[r + c * o.ld],
        true => m[c + r * o.ld],
    };
    for j in 0..p.n {
        for i in 0..p.m {
            let s: f32 = (0..p.k)
                .map(|l| at(&p.a, a, i, l) * at(&p.b, b, l, j))
                .sum();
            let o = &mut d[i + j * p.m];
            *o = s + beta * *o;
        }
    }
}

/// What A and B hold: elements of a storage type, or fp8 codes with the device addresses of
/// their dequantising scales (an f32 each, cuBLASLt's A and B scale pointers: D = scale_A ·
/// scale_B · Σ a·b).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Inputs {
    Stored(DType),
    Fp8 {
        a: Fp8Format,
        b: Fp8Format,
        scales: [u64; 2],
    },
}

impl Inputs {
    fn types(self) -> [sys::cudaDataType; 2] {
        match self {
            Inputs::Stored(t) => [cuda_type(t); 2],
            Inputs::Fp8 { a, b, .. } => [fp8_type(a), fp8_type(b)],
        }
    }
}

fn fp8_type(f: Fp8Format) -> sys::cudaDataType {
    match f {
        Fp8Format::E4M3 => sys::cudaDataType::CUDA_R_8F_E4M3,
        Fp8Format::E5M2 => sys::cudaDataType::CUDA_R_8F_E5M2,
    }
}

fn cuda_type(t: DType) -> sys::cudaDataType {
    match t {
        DType::F32 => sys::cudaDataType::CUDA_R_32F,
        DType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
        DType::F16 => sys::cudaDataType::CUDA_R_16F,
        other => panic!("no cuBLASLt product for {other:?} operands on this backend"),
    }
}

/// One product to run: its description, the device addresses of A, B and D, what A and B hold
/// (`ab`) and the type of D (`out`), whether D accumulates (β = 1) or is overwritten, and the
/// device address of a bias to add in the epilogue (`m` elements of D's type).
#[derive(Clone, Copy, Debug)]
pub struct Call {
    pub p: Product,
    pub ab: Inputs,
    pub out: DType,
    pub a: u64,
    pub b: u64,
    pub d: u64,
    pub accumulate: bool,
    pub bias: Option<u64>,
}

/// Key of a product's chosen algorithm: its shape and types, whether it accumulates, the
/// alignment of A, B and D ([`alignment`]), and its bias's address (a descriptor attribute, so
/// each bias has its descriptor: a model has a few, at fixed offsets in its parameters).
type AlgoKey = (Product, Inputs, DType, bool, [u32; 3], Option<u64>);

/// The alignment the backend asks of a bias before it gives it to the epilogue (cuBLASLt
/// states none for the bias vector; its vectorised epilogues read 16 bytes at a time), else
/// the bias is added by its own kernel after the product.
pub const BIAS_ALIGNMENT: u64 = 16;

/// The largest power of two, up to 256 bytes, that divides a device address: what cuBLASLt's
/// heuristic may assume of an operand (`CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_*_BYTES`). Its
/// default assumes 256-byte alignment, but the trainer's weights sit at element offsets of one
/// flat buffer and the arena's buffers at 64-byte offsets, so an algorithm chosen for a fresh
/// allocation could read past what an operand's address allows. PyTorch's cuBLASLt path and
/// TransformerEngine set these attributes from the real pointers for the same reason.
pub fn alignment(addr: u64) -> u32 {
    1 << addr.trailing_zeros().min(8)
}

/// A cuBLASLt handle with its workspace, and the descriptors and algorithm of each product
/// seen.
pub struct Lt {
    handle: sys::cublasLtHandle_t,
    workspace: *mut c_void,
    workspace_bytes: usize,
    prepared: Mutex<HashMap<AlgoKey, Cached>>,
}

/// A product's cache entry: its descriptors (none where cuBLASLt offered no algorithm), and
/// whether it may run: a product with a bias that cuBLASLt declined runs without it (its
/// descriptors kept until the handle goes, as another thread may hold a copy).
#[derive(Clone, Copy)]
struct Cached {
    m: Option<Prepared>,
    usable: bool,
}

// SAFETY: the handle is used from one stream at a time (the backend's), and cuBLASLt handles
// may be shared between threads that way; the cache of descriptors is behind a mutex, and a
// descriptor, once made, is only read.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

/// cuBLASLt's recommended workspace for Hopper (the cuBLAS documentation, "cublasLtMatmul":
/// 32 MiB on sm_90); the backend charges it to the plan's overhead.
pub const WORKSPACE_BYTES: usize = 32 << 20;

impl Lt {
    /// A handle with `workspace` (device memory of `workspace_bytes`, owned by the caller).
    pub fn new(workspace: u64, workspace_bytes: usize) -> Result<Lt, String> {
        // SAFETY: a probe of the library, as cudarc does before its first call.
        let names = ["libcublasLt.so", "libcublasLt.so.13", "libcublasLt.so.12"];
        if !super::libs::load("FERROTRON_CUBLASLT", &names, || unsafe {
            sys::is_culib_present()
        }) {
            return Err(
                "cuBLASLt (libcublasLt.so) is not installed: install the CUDA toolkit's cuBLAS"
                    .into(),
            );
        }
        let handle = lt::create_handle().map_err(|e| format!("cuBLASLt handle: {e:?}"))?;
        Ok(Lt {
            handle,
            workspace: workspace as *mut c_void,
            workspace_bytes,
            prepared: Mutex::new(HashMap::new()),
        })
    }

    /// `d = op(a)·op(b) (+ d) (+ bias)` on `stream`. Returns whether the bias was added: not
    /// when it is not [`BIAS_ALIGNMENT`]-aligned, or cuBLASLt has no algorithm with it or
    /// declines it when enqueued (the caller adds it then), nor for an empty product.
    ///
    /// # Safety
    /// The call's `a`, `b`, `d` (and `bias`) are device addresses of at least the operands'
    /// sizes, and `stream` is a live stream of the context this handle was made in.
    pub unsafe fn run(&self, c: Call, stream: sys::cudaStream_t) -> Result<bool, String> {
        let Call {
            p,
            ab,
            out,
            a,
            b,
            d,
            accumulate,
            bias,
        } = c;
        // Empty products (an expert no token was routed to) are not cuBLASLt's to run: an
        // empty D has nothing to write, and a sum over k = 0 terms leaves D (β = 1) or zeroes
        // it (β = 0, on `stream`, in order with the products).
        if p.m == 0 || p.n == 0 || (p.k == 0 && accumulate) {
            return Ok(false);
        }
        if p.k == 0 {
            let bytes = p.m * p.n * out.bytes() as usize;
            super::OPS.write();
            // SAFETY: D holds m·n elements of `out` on `stream` (this function's contract).
            let on = stream as cudarc::driver::sys::CUstream;
            return unsafe { cudarc::driver::result::memset_d8_async(d, 0, bytes, on) }
                .map(|_| false)
                .map_err(|e| format!("zeroing an empty product's output: {e:?}"));
        }
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let key = |bias| {
            let aligned = [alignment(a), alignment(b), alignment(d)];
            (p, ab, out, accumulate, aligned, bias)
        };
        let bias = bias.filter(|at| at % BIAS_ALIGNMENT == 0);
        let (m, biased) = match bias.map(|_| self.prepared(key(bias))).transpose()? {
            Some(Some(m)) => (m, true),
            _ => (
                self.prepared(key(None))?
                    .expect("a product without a bias is never refused"),
                false,
            ),
        };
        // SAFETY: the descriptors are the cache's, alive until the handle is dropped; pointers
        // and stream are the caller's (this function's contract).
        let r = unsafe {
            lt::matmul(
                self.handle,
                m.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                a as *const c_void,
                m.a,
                b as *const c_void,
                m.b,
                d as *const c_void,
                m.d,
                d as *mut c_void,
                m.d,
                &m.algo,
                self.workspace,
                self.workspace_bytes,
                stream,
            )
        };
        match r {
            Ok(()) => {
                super::OPS.blas();
                Ok(biased)
            }
            // A bias cuBLASLt declines only when the product is enqueued (NOT_SUPPORTED, nothing
            // queued): remembered, and this product and the next run without it.
            Err(lt::CublasError(sys::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED)) if biased => {
                self.decline(key(bias));
                // SAFETY: the same call without its bias (this function's contract).
                unsafe { self.run(Call { bias: None, ..c }, stream) }
            }
            Err(e) => Err(format!("cuBLASLt matmul: {e:?}")),
        }
    }

    /// A product with a bias that cuBLASLt declined: not run again.
    fn decline(&self, key: AlgoKey) {
        let mut cache = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cache.get_mut(&key) {
            c.usable = false;
        }
    }

    /// The descriptors and algorithm of a product, made on its first call and kept: a step
    /// runs the same few shapes hundreds of times, and each descriptor is a host allocation
    /// and a few library calls (PyTorch caches them per shape too). `None` for a product with
    /// a bias that cuBLASLt has no algorithm for (kept too: asked once); an error for one
    /// without.
    fn prepared(&self, key: AlgoKey) -> Result<Option<Prepared>, String> {
        let mut cache = self.prepared.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = cache.get(&key) {
            return Ok(c.m.filter(|_| c.usable));
        }
        // SAFETY: descriptors made here, destroyed on failure or when the handle is dropped.
        let m = match unsafe { self.describe(key) } {
            Ok(m) => Some(m),
            Err(_) if key.5.is_some() => None,
            Err(e) => return Err(e),
        };
        cache.insert(key, Cached { m, usable: true });
        Ok(m)
    }

    /// A product's descriptors, and the fastest algorithm cuBLASLt's heuristic offers for it
    /// within the workspace and the operands' alignment.
    unsafe fn describe(&self, key: AlgoKey) -> Result<Prepared, String> {
        let (p, ab, out, _, [align_a, align_b, align_d], bias) = key;
        let err = |what: &'static str| move |e: lt::CublasError| format!("cuBLASLt {what}: {e:?}");
        let layout = |t: sys::cudaDataType, rows: usize, cols: usize, ld: usize| {
            lt::create_matrix_layout(t, rows as u64, cols as u64, ld as i64)
        };
        let [ta, tb] = ab.types();
        let desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(err("descriptor"))?;
        let mut m = Prepared {
            desc,
            a: std::ptr::null_mut(),
            b: std::ptr::null_mut(),
            d: std::ptr::null_mut(),
            algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let r = (|| {
            m.a = layout(ta, p.a.rows, p.a.cols, p.a.ld).map_err(err("layout A"))?;
            m.b = layout(tb, p.b.rows, p.b.cols, p.b.ld).map_err(err("layout B"))?;
            m.d = layout(cuda_type(out), p.m, p.n, p.m).map_err(err("layout D"))?;
            // The TRANSA/TRANSB attributes are cublasOperation_t, an int32: CUBLAS_OP_N = 0,
            // CUBLAS_OP_T = 1 (cublas_api.h).
            use sys::cublasLtMatmulDescAttributes_t as D;
            for (attr, t) in [
                (D::CUBLASLT_MATMUL_DESC_TRANSA, p.a.trans as i32),
                (D::CUBLASLT_MATMUL_DESC_TRANSB, p.b.trans as i32),
            ] {
                lt::set_matmul_desc_attribute(
                    desc,
                    attr,
                    (&t as *const i32).cast(),
                    size_of_val(&t),
                )
                .map_err(err("transposition"))?;
            }
            if let Inputs::Fp8 { scales, .. } = ab {
                // The scale pointers are `void*` attributes: the device addresses themselves.
                for (attr, at) in [
                    (D::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, scales[0]),
                    (D::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, scales[1]),
                ] {
                    lt::set_matmul_desc_attribute(
                        desc,
                        attr,
                        (&at as *const u64).cast(),
                        size_of_val(&at),
                    )
                    .map_err(err("fp8 scale"))?;
                }
            }
            if let Some(at) = bias {
                // cublasLtEpilogue_t is a 32-bit enum; the bias pointer a `void*` attribute
                // (its type, unset, is D's).
                let e = sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS as u32;
                lt::set_matmul_desc_attribute(
                    desc,
                    D::CUBLASLT_MATMUL_DESC_EPILOGUE,
                    (&e as *const u32).cast(),
                    size_of_val(&e),
                )
                .and_then(|_| {
                    lt::set_matmul_desc_attribute(
                        desc,
                        D::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                        (&at as *const u64).cast(),
                        size_of_val(&at),
                    )
                })
                .map_err(err("bias epilogue"))?;
            }
            let pref = lt::create_matmul_pref().map_err(err("preference"))?;
            let ws = self.workspace_bytes;
            use sys::cublasLtMatmulPreferenceAttributes_t as P;
            let mut r = lt::set_matmul_pref_attribute(
                pref,
                P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws as *const usize).cast(),
                size_of_val(&ws),
            );
            // C is D (the product accumulates in place), so C's alignment is D's.
            for (attr, bytes) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_d),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_d),
            ] {
                // The attributes are uint32_t (cublasLt.h).
                r = r.and_then(|_| {
                    lt::set_matmul_pref_attribute(
                        pref,
                        attr,
                        (&bytes as *const u32).cast(),
                        size_of_val(&bytes),
                    )
                });
            }
            let r = r.and_then(|_| {
                lt::get_matmul_algo_heuristic(self.handle, desc, m.a, m.b, m.d, m.d, pref)
            });
            let _ = lt::destroy_matmul_pref(pref);
            m.algo = r
                .map_err(|e| format!("cuBLASLt has no algorithm for {key:?}: {e:?}"))?
                .algo;
            Ok(())
        })();
        match r {
            Ok(()) => Ok(m),
            Err(e) => {
                m.destroy();
                Err(e)
            }
        }
    }
}

/// A product's descriptors and chosen algorithm (handles to cuBLASLt's host objects).
#[derive(Clone, Copy)]
struct Prepared {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
}

impl Prepared {
    /// # Safety
    /// Not used after.
    unsafe fn destroy(&self) {
        for l in [self.a, self.b, self.d] {
            if !l.is_null() {
                let _ = lt::destroy_matrix_layout(l);
            }
        }
        let _ = lt::destroy_matmul_desc(self.desc);
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: created in `new` and `describe`, destroyed once, none used after.
        unsafe {
            for m in self
                .prepared
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .values()
                .filter_map(|c| c.m.as_ref())
            {
                m.destroy();
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::{Accum, AsView, AsViewMut, CpuKernels, Kernels};

    fn random(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32
                    / (1u32 << 24) as f32
                    - 0.5
            })
            .collect()
    }

    fn close(a: &[f32], b: &[f32], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}[{i}]: {x} vs {y}"
            );
        }
    }

    /// The three products, read by cuBLAS's column-major definition on the engine's row-major
    /// buffers, are the CPU backend's products (including `+=`).
    #[test]
    fn an_operands_alignment_is_the_largest_power_of_two_dividing_its_address() {
        assert_eq!(alignment(0x7f00_0000_0000), 256);
        assert_eq!(alignment(0x7f00_0000_0040), 64);
        assert_eq!(alignment(0x7f00_0000_0042), 2);
        assert_eq!(alignment(0x7f00_0000_0106), 2);
        assert_eq!(alignment(0x7f00_0000_0204), 4);
    }

    #[test]
    fn the_column_major_products_are_the_engines_row_major_ones() {
        let cpu = CpuKernels::PLAIN;
        let k: &dyn Kernels<f32> = &cpu;
        for (n, i, o) in [(5, 7, 3), (16, 8, 24), (1, 33, 2)] {
            let s = MatmulShape {
                n,
                in_features: i,
                out_features: o,
                ragged: false,
            };
            let (x, w, dy) = (random(n * i, 1), random(o * i, 2), random(n * o, 3));
            for accum in [false, true] {
                let acc = if accum { Accum::Add } else { Accum::Overwrite };
                let mut want = random(n * o, 4);
                let mut got = want.clone();
                k.matmul_forward(s, x.view(), w.view(), None, want.view_mut(), acc);
                reference(&forward(s), &w, &x, &mut got, accum as u8 as f32);
                close(&got, &want, "forward");

                let mut want = random(n * i, 5);
                let mut got = want.clone();
                k.matmul_backward_input(s, dy.view(), w.view(), want.view_mut(), acc);
                reference(&backward_input(s), &w, &dy, &mut got, accum as u8 as f32);
                close(&got, &want, "backward input");
            }
            // Weight gradients always accumulate.
            let mut want = random(o * i, 6);
            let mut got = want.clone();
            k.matmul_backward_weight(s, dy.view(), x.view(), want.view_mut(), None);
            reference(&backward_weight(s), &x, &dy, &mut got, 1.0);
            close(&got, &want, "backward weight");

            // The fp8 (TN) forms on transposed copies, the weight gradient's padded.
            let mut want = random(n * i, 7);
            let mut got = want.clone();
            k.matmul_backward_input(s, dy.view(), w.view(), want.view_mut(), Accum::Add);
            let wt = transpose(&w, o, i, o);
            reference(&fp8_backward_input(s), &wt, &dy, &mut got, 1.0);
            close(&got, &want, "fp8 backward input");
            let pad = n.next_multiple_of(16);
            let mut want = random(o * i, 8);
            let mut got = want.clone();
            k.matmul_backward_weight(s, dy.view(), x.view(), want.view_mut(), None);
            let (xt, dyt) = (transpose(&x, n, i, pad), transpose(&dy, n, o, pad));
            reference(&fp8_backward_weight(s, pad), &xt, &dyt, &mut got, 1.0);
            close(&got, &want, "fp8 backward weight");
        }
    }

    /// Row-major `m [rows, cols]` transposed, each of its `cols` rows `ld` long (zeros past
    /// `rows`), as `fp8_quantize_t` writes it.
    fn transpose(m: &[f32], rows: usize, cols: usize, ld: usize) -> Vec<f32> {
        let mut t = vec![0.0; cols * ld];
        for r in 0..rows {
            for c in 0..cols {
                t[c * ld + r] = m[r * cols + c];
            }
        }
        t
    }
}
