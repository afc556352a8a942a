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
