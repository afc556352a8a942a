// fp8 operands of the layer products (issue #32 item 4; Micikevicius et al. 2022), as the CPU's
// fp8 path makes them (numerics/fp8.rs, kernels/cpu/staged_gemm.rs): per-tensor current
// scaling, the scale the largest power of two 2^k with amax·2^k ≤ the format's max, each
// element x·scale rounded to nearest even into e4m3 (weights, activations) or e5m2 (gradients),
// finite values saturating. The codes are the CPU's bit for bit; cuBLASLt multiplies them on
// the tensor cores and undoes both scales through its A/B scale pointers (1/scale, exact).
//
// Hopper's fp8 products take A transposed and B not ("TN"): both operands with k contiguous.
// An operand whose k runs across the engine's rows (a weight in the input gradient, both
// operands of the weight gradient) is written transposed: `fp8_quantize_t`.

// Format: 0 e4m3 (3 mantissa bits, min exponent -6, max 448, code 0x7E), 1 e5m2 (2, -14,
// 57344, 0x7B). numerics::fp8::Fp8Format.
__device__ __forceinline__ float fp8_max(int f) { return f ? 57344.0f : 448.0f; }

// numerics::fp8::encode: round to nearest even with subnormals, finite values past max
// saturate, NaN → S.1111111, ±inf → ±inf (e5m2) or NaN (e4m3).
__device__ __forceinline__ unsigned char fp8_encode(int f, float x) {
    u32 bits = __float_as_uint(x), a = bits & 0x7fffffffu;
    unsigned char sign = (unsigned char)((bits >> 24) & 0x80u);
    if (a > 0x7f800000u) return sign | 0x7f;
    if (a == 0x7f800000u) return sign | (f ? 0x7c : 0x7f);
    if (__uint_as_float(a) >= fp8_max(f)) return sign | (f ? 0x7b : 0x7e);
    int exp_field = (int)(a >> 23);
    if (exp_field == 0) return sign;  // zero or an f32 subnormal: rounds to zero
    int m = f ? 2 : 3, emin = f ? -14 : -6, e = exp_field - 127;
    u32 sig = (a & 0x7fffffu) | 0x800000u;  // x = sig · 2^(e − 23)
    int em = e > emin ? e : emin;
    int s = em - m - (e - 23);  // bits of sig below the fp8 quantum (≥ 23 − m)
    if (s >= 25) return sign;   // below half the smallest subnormal
    u32 half = 1u << (s - 1), rem = sig & ((1u << s) - 1), n = sig >> s;
    if (rem > half || (rem == half && (n & 1))) n += 1;
    u32 code = ((u32)(em - emin) << m) + n, max_code = f ? 0x7bu : 0x7eu;
    return sign | (unsigned char)(code < max_code ? code : max_code);
}

// numerics::fp8::scale_for: 2^k, k = floor(log2(max / amax)) clamped to [−126, 126]; 1 for an
// amax that is 0 or not finite. amax = ma·2^ea and max = mm·2^em with ma, mm in [1, 2):
// k = em − ea − (mm < ma), on the bit patterns (an f32 subnormal amax normalised first).
__device__ __forceinline__ float fp8_scale(int f, float amax) {
    if (!(amax > 0.0f) || amax > 3.402823466e38f) return 1.0f;
    u32 b = __float_as_uint(amax);
    int ea;
    u32 ma;
    if ((b >> 23) == 0) {
        u32 sig = b, shift = 0;  // subnormal: shift the fraction up to the implicit bit
        while (!(sig & 0x800000u)) sig <<= 1, shift++;
        ea = -126 - (int)shift;
        ma = sig & 0x7fffffu;
    } else {
        ea = (int)(b >> 23) - 127;
        ma = b & 0x7fffffu;
    }
    u32 mb = __float_as_uint(fp8_max(f));
    int em = (int)(mb >> 23) - 127;
    int k = em - ea - ((mb & 0x7fffffu) < ma ? 1 : 0);
    k = k < -126 ? -126 : (k > 126 ? 126 : k);
    return __uint_as_float((u32)(k + 127) << 23);
}

// amax[0] = max |x| over n elements, NaNs skipped (staged_gemm.rs's fold with f32::max skips
// them too). Magnitudes' bit patterns order as the magnitudes: an atomic max on them is exact
// and independent of the order. amax[0] must start at 0 (`fp8_amax_reset`).
template <typename E>
__device__ void fp8_amax_impl(const typename E::T* x, u64 n, u32* amax) {
    u32 m = 0;
    FOR_EACH(i, n) {
        u32 a = __float_as_uint(GET(E, x, i)) & 0x7fffffffu;
        if (a <= 0x7f800000u && a > m) m = a;
    }
    for (int o = 16; o > 0; o >>= 1) {
        u32 other = __shfl_xor_sync(0xffffffffu, m, o);
        m = other > m ? other : m;
    }
    if ((threadIdx.x & 31) == 0 && m) atomicMax(amax, m);
}

// out[i] = encode(x[i]·scale), x and out both [rows, cols] row-major; scale_inv[0] = 1/scale
// (cuBLASLt's scale pointer), written by one thread.
template <typename E>
__device__ void fp8_quantize_impl(const typename E::T* x, u64 n, int f, const u32* amax, unsigned char* out,
                                  float* scale_inv) {
    float s = fp8_scale(f, __uint_as_float(amax[0]));
    if (blockIdx.x == 0 && threadIdx.x == 0) scale_inv[0] = 1.0f / s;
    FOR_EACH(i, n) out[i] = fp8_encode(f, GET(E, x, i) * s);
}

// The same, written transposed: out [cols, ld] row-major, its rows past `rows` zeros (a
// leading dimension cuBLASLt takes: a multiple of 16). A 32 × 32 tile a block of 256 threads,
// through shared memory so both the reads of x and the writes of out run along rows.
template <typename E>
__device__ void fp8_quantize_t_impl(const typename E::T* x, u64 rows, u64 cols, u64 ld, int f, const u32* amax,
                                    unsigned char* out, float* scale_inv) {
    __shared__ unsigned char tile[32][33];
    float s = fp8_scale(f, __uint_as_float(amax[0]));
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) scale_inv[0] = 1.0f / s;
    int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    u64 c0 = (u64)blockIdx.x * 32, r0 = (u64)blockIdx.y * 32;
    for (int r = ty; r < 32; r += 8) {
        u64 row = r0 + r, col = c0 + tx;
        if (col < cols && row < ld) tile[r][tx] = row < rows ? fp8_encode(f, GET(E, x, row * cols + col) * s) : 0;
    }
    __syncthreads();
    for (int c = ty; c < 32; c += 8) {
        u64 col = c0 + c, row = r0 + tx;
        if (col < cols && row < ld) out[col * ld + row] = tile[tx][c];
    }
}

// A product's two amax slots zeroed, in one launch.
extern "C" __global__ void fp8_amax_reset(u32* amax) { amax[0] = amax[1] = 0u; }

#define FP8(E, sfx)                                                                                  \
    extern "C" __global__ void fp8_amax_##sfx(const E::T* x, u64 n, u32* amax) {                      \
        fp8_amax_impl<E>(x, n, amax);                                                                \
    }                                                                                                \
    extern "C" __global__ void fp8_quantize_##sfx(const E::T* x, u64 n, int f, const u32* amax,      \
                                                  unsigned char* out, float* scale_inv) {            \
        fp8_quantize_impl<E>(x, n, f, amax, out, scale_inv);                                         \
    }                                                                                                \
    extern "C" __global__ void fp8_quantize_t_##sfx(const E::T* x, u64 rows, u64 cols, u64 ld, int f, \
                                                    const u32* amax, unsigned char* out,             \
                                                    float* scale_inv) {                              \
        fp8_quantize_t_impl<E>(x, rows, cols, ld, f, amax, out, scale_inv);                          \
    }
FOR_STORAGE(FP8)
