// Shared by every kernel of the CUDA backend (compiled at run time by NVRTC, one program).
//
// No CUDA header is included, so the program compiles with NVRTC alone wherever the driver
// is (no toolkit include directory to find). 16-bit storage is `unsigned short`, converted
// by the PTX `cvt` instructions (round to nearest even, as `half`'s `from_f32` and torch's
// casts do). All arithmetic is f32, as on the CPU backend (kernels/mod.rs).

typedef unsigned short bf16_t;
typedef unsigned short f16_t;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
#define F_INF __int_as_float(0x7f800000)
#define F_INF_NEG __int_as_float(0xff800000)

// The 16-bit conversions, PTX `cvt` on a GPU. The CUDA emulator (crates/engine/cuda_emu, which
// compiles this program with g++ to run it on the host in CI) brings its own, bit for bit the
// same rounding.
#ifdef FERROTRON_CUDA_EMU
__device__ __forceinline__ float f16_to_f32(f16_t h) { return emu::f16_to_f32(h); }
__device__ __forceinline__ bf16_t to_bf16(float x) { return emu::f32_to_bf16(x); }
__device__ __forceinline__ f16_t to_f16(float x) { return emu::f32_to_f16(x); }
#else
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ bf16_t to_bf16(float x) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
__device__ __forceinline__ f16_t to_f16(float x) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#endif
__device__ __forceinline__ float ld(const float* p, u64 i) { return p[i]; }
__device__ __forceinline__ float ld_bf16(const bf16_t* p, u64 i) {
    return __uint_as_float(((u32)p[i]) << 16);
}
__device__ __forceinline__ float ld_f16(const f16_t* p, u64 i) { return f16_to_f32(p[i]); }
__device__ __forceinline__ void st(float* p, u64 i, float x) { p[i] = x; }

// One storage type per kernel instantiation: `E` names it, `Store<E>` reads and writes it.
struct F32 { typedef float T; };
struct BF16 { typedef bf16_t T; };
struct F16 { typedef f16_t T; };
template <typename E> struct Store;
template <> struct Store<F32> {
    static __device__ __forceinline__ float get(const float* p, u64 i) { return p[i]; }
    static __device__ __forceinline__ void put(float* p, u64 i, float x) { p[i] = x; }
};
template <> struct Store<BF16> {
    static __device__ __forceinline__ float get(const bf16_t* p, u64 i) { return ld_bf16(p, i); }
    static __device__ __forceinline__ void put(bf16_t* p, u64 i, float x) { p[i] = to_bf16(x); }
};
template <> struct Store<F16> {
    static __device__ __forceinline__ float get(const f16_t* p, u64 i) { return ld_f16(p, i); }
    static __device__ __forceinline__ void put(f16_t* p, u64 i, float x) { p[i] = to_f16(x); }
};
#define GET(E, p, i) Store<E>::get((p), (i))
#define PUT(E, p, i, x) Store<E>::put((p), (i), (x))

// Eight consecutive elements in 16-byte accesses (issue #32's vector loads: one instruction
// moves eight 16-bit elements, or two moves eight f32), widened to f32 and rounded back exactly
// as GET and PUT do, so a vector kernel's bits are the element-wise kernel's.
struct alignas(16) V16 {
    u32 w[4];
};
__device__ __forceinline__ V16 ld16(const void* p) {
#ifdef FERROTRON_CUDA_EMU
    emu::aligned16(p);  // (a GPU faults on a misaligned vector access: the emulator refuses it)
    V16 v;
    memcpy(&v, p, 16);
    return v;
#else
    return *(const V16*)p;
#endif
}
__device__ __forceinline__ void st16(void* p, V16 v) {
#ifdef FERROTRON_CUDA_EMU
    emu::aligned16(p);
    memcpy(p, &v, 16);
#else
    *(V16*)p = v;
#endif
}
template <typename E>
struct Vec8;
template <>
struct Vec8<F32> {
    static __device__ __forceinline__ void ld(const float* p, float (&x)[8]) {
        V16 a = ld16(p), b = ld16(p + 4);
#pragma unroll
        for (int j = 0; j < 4; j++) x[j] = __uint_as_float(a.w[j]), x[4 + j] = __uint_as_float(b.w[j]);
    }
    static __device__ __forceinline__ void st(float* p, const float (&x)[8]) {
        V16 a, b;
#pragma unroll
        for (int j = 0; j < 4; j++) a.w[j] = __float_as_uint(x[j]), b.w[j] = __float_as_uint(x[4 + j]);
        st16(p, a);
        st16(p + 4, b);
    }
};
// The 16-bit types: word j holds elements 2j (low half) and 2j + 1.
template <typename E>
struct Vec8Half {
    static __device__ __forceinline__ void ld(const u16* p, float (&x)[8]) {
        V16 v = ld16(p);
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u16 lo = (u16)(v.w[j] & 0xffffu), hi = (u16)(v.w[j] >> 16);
            x[2 * j] = GET(E, &lo, 0);
            x[2 * j + 1] = GET(E, &hi, 0);
        }
    }
    static __device__ __forceinline__ void st(u16* p, const float (&x)[8]) {
        V16 v;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            u16 lo, hi;
            PUT(E, &lo, 0, x[2 * j]);
            PUT(E, &hi, 0, x[2 * j + 1]);
            v.w[j] = (u32)lo | ((u32)hi << 16);
        }
        st16(p, v);
    }
};
template <>
struct Vec8<BF16> : Vec8Half<BF16> {};
template <>
struct Vec8<F16> : Vec8Half<F16> {};

// Whether every pointer is 16-byte aligned (the trainer's buffers are; a view at an odd
// offset is not, and takes the element-wise path).
template <typename... P>
__device__ __forceinline__ bool aligned16(const P*... p) {
    return ((((u64)p) | ...) & 15) == 0;
}

// Grid-stride over n elements: eight at a time where `vectors` (vec(i) takes elements
// i..i+8, i a multiple of 8), then the rest, or all of them, one at a time (one(i)). The
// launch needs only n/8 threads (`elementwise8` on the Rust side).
template <typename Vf, typename Of>
__device__ __forceinline__ void for_each8_from(u64 n, bool vectors, u64 first, u64 stride, Vf vec, Of one) {
    u64 head = vectors ? n / 8 * 8 : 0;
    for (u64 k = first; k < head / 8; k += stride) vec(k * 8);
    for (u64 i = head + first; i < n; i += stride) one(i);
}
template <typename Vf, typename Of>
__device__ __forceinline__ void for_each8(u64 n, bool vectors, Vf vec, Of one) {
    for_each8_from(n, vectors, (u64)blockIdx.x * blockDim.x + threadIdx.x, (u64)gridDim.x * blockDim.x, vec, one);
}
// The same over one row, by the threads of one block.
template <typename Vf, typename Of>
__device__ __forceinline__ void for_each8_in_block(u64 n, bool vectors, Vf vec, Of one) {
    for_each8_from(n, vectors, threadIdx.x, blockDim.x, vec, one);
}

// out[i] = f(a[i], b[i]) over n elements, eight at a time where all three are aligned (`out`
// may be `a`).
template <typename E, typename F>
__device__ __forceinline__ void map2(const typename E::T* a, const typename E::T* b, typename E::T* out, u64 n,
                                     F f) {
    for_each8(
        n, aligned16(a, b, out),
        [&](u64 i) {
            float x[8], y[8];
            Vec8<E>::ld(a + i, x);
            Vec8<E>::ld(b + i, y);
#pragma unroll
            for (int j = 0; j < 8; j++) x[j] = f(x[j], y[j]);
            Vec8<E>::st(out + i, x);
        },
        [&](u64 i) { PUT(E, out, i, f(GET(E, a, i), GET(E, b, i))); });
}

// One row of n elements through the block's threads, eight at a time where `vectors`:
// f(value, index) for each, its result written back in place with WRITE (`map_row`) or not
// (`each_in_row`).
template <typename E, bool WRITE, typename F>
__device__ __forceinline__ void row_pass(typename E::T* x, u64 n, bool vectors, F f) {
    for_each8_in_block(
        n, vectors,
        [&](u64 j) {
            float v[8];
            Vec8<E>::ld(x + j, v);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                if constexpr (WRITE) v[e] = f(v[e], j + e);
                else f(v[e], j + e);
            }
            if constexpr (WRITE) Vec8<E>::st(x + j, v);
        },
        [&](u64 j) {
            if constexpr (WRITE) PUT(E, x, j, f(GET(E, x, j), j));
            else f(GET(E, x, j), j);
        });
}
template <typename E, typename F>
__device__ __forceinline__ void each_in_row(const typename E::T* x, u64 n, bool vectors, F f) {
    row_pass<E, false>(const_cast<typename E::T*>(x), n, vectors, f);
}
template <typename E, typename F>
__device__ __forceinline__ void map_row(typename E::T* x, u64 n, bool vectors, F f) {
    row_pass<E, true>(x, n, vectors, f);
}

// Grid-stride loop over n elements.
#define FOR_EACH(i, n) \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// Sum over a warp, every lane gets the result (a fixed butterfly: deterministic).
__device__ __forceinline__ float warp_sum(float x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
    for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}
__device__ __forceinline__ double warp_sum_f64(double x) {
    for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}

// Sum over a block of at most 1024 threads (a multiple of 32); every thread gets the result.
// `scratch` holds 32 floats of shared memory. Fixed order: deterministic.
__device__ float block_sum(float x, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    x = warp_sum(x);
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(x);
}
__device__ float block_max(float x, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    x = warp_max(x);
    __syncthreads();
    if (lane == 0) scratch[warp] = x;
    __syncthreads();
    x = lane < warps ? scratch[lane] : F_INF_NEG;
    return warp_max(x);
}

// Instantiates `NAME<E>` as extern "C" entry points NAME_f32, NAME_bf16, NAME_f16 (the Rust
// side picks the suffix from the element type: kernels/cuda/source.rs).
#define FOR_STORAGE(M) M(F32, f32) M(BF16, bf16) M(F16, f16)
// The (storage, gradient) pairs of the trainer's precisions (kernels/mod.rs: `Kernels<S, G>`):
// entry points NAME_f32_f32, NAME_bf16_bf16, NAME_bf16_f32, NAME_f16_f16.
#define FOR_GRADS(M) M(F32, F32, f32_f32) M(BF16, BF16, bf16_bf16) M(BF16, F32, bf16_f32) M(F16, F16, f16_f16)
