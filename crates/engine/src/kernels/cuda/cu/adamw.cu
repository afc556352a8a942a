// One torch.optim.AdamW step over a flat buffer (Loshchilov & Hutter 2019, Alg. 2; the
// constants are computed on the host exactly as kernels/cpu/adamw.rs computes them), with the
// master weights optionally rounded into 16-bit parameters: to nearest, or stochastically with
// the counter-based noise of numerics/rounding.rs (same bits as the CPU for the same seed,
// step and index, so a resumed run and either backend draw the same noise).

struct AdamConsts {
    float decay, w, b2, one_m_b2, eps, step_size, bc2_sqrt, grad_scale;
};

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ u32 noise(u64 seed, u64 step, u64 index) {
    const u64 GAMMA = 0x9E3779B97F4A7C15ull;
    u64 h = mix64(seed + GAMMA);
    h = mix64(h ^ (step + GAMMA * 2));
    h = mix64(h ^ (index + GAMMA * 3));
    return (u32)(h >> 32);
}

// numerics::rounding::bf16_stochastic.
__device__ bf16_t bf16_stochastic(float x, u32 r) {
    u32 bits = __float_as_uint(x), a = bits & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return to_bf16(x);
    if (a > 0x7F7F0000u) {
        u32 sign = (bits >> 16) & 0x8000u;
        return (bf16_t)((a >= 0x7F7F8000u ? 0x7F80u : 0x7F7Fu) | sign);
    }
    return (bf16_t)((bits + (r & 0xFFFFu)) >> 16);
}

// numerics::rounding::f16_stochastic (its u128 arithmetic in u64: past 63 dropped bits the
// quanta are 0 and any remainder rounds up with probability below 2^-32, as there).
__device__ f16_t f16_stochastic(float x, u32 r) {
    u32 bits = __float_as_uint(x), a = bits & 0x7FFFFFFFu;
    if (a >= 0x7F800000u) return to_f16(x);
    u32 sign = (bits >> 16) & 0x8000u;
    if (a > 0x477FE000u) return (f16_t)((a >= 0x477FF000u ? 0x7C00u : 0x7BFFu) | sign);
    int exp_field = (int)(a >> 23);
    int e = exp_field == 0 ? -126 : exp_field - 127;
    u64 sig = exp_field == 0 ? (a & 0x7FFFFFu) : ((a & 0x7FFFFFu) | 0x800000u);
    int em = e > -14 ? e : -14;
    u32 s = (u32)(em - 10 - (e - 23));
    u64 n, threshold;
    if (s < 64) {
        n = sig >> s;
        u64 rem = sig & ((1ull << s) - 1);
        threshold = ((rem << 32) + (1ull << s) - 1) >> s;
    } else {
        n = 0;
        threshold = sig != 0;
    }
    if ((u64)r + threshold >= (1ull << 32)) n += 1;
    u64 code = ((u64)(em + 14) << 10) + n;
    return (f16_t)((u32)code | sign);
}

template <typename E> struct Stochastic;
template <> struct Stochastic<F32> {
    static __device__ __forceinline__ void put(float* p, u64 i, float x, u32) { p[i] = x; }
};
template <> struct Stochastic<BF16> {
    static __device__ __forceinline__ void put(bf16_t* p, u64 i, float x, u32 r) { p[i] = bf16_stochastic(x, r); }
};
template <> struct Stochastic<F16> {
    static __device__ __forceinline__ void put(f16_t* p, u64 i, float x, u32 r) { p[i] = f16_stochastic(x, r); }
};

// One parameter's update: the new master weight, with its moments updated in place.
__device__ __forceinline__ float adamw_one(const AdamConsts& c, float g, float master, float& m, float& v) {
    float gi = g * c.grad_scale;
    float pi = master * c.decay;
    // torch's lerp: weight < 0.5 ? self + w·(end − self) : end − (end − self)·(1 − w)
    float mi = c.w < 0.5f ? m + c.w * (gi - m) : gi - (gi - m) * (1.0f - c.w);
    float vi = v * c.b2 + c.one_m_b2 * gi * gi;
    float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
    m = mi;
    v = vi;
    return pi - c.step_size * (mi / denom);
}

// rounding: 0 none (fp32 training), 1 nearest, 2 stochastic. Eight parameters a thread where
// the five buffers are 16-byte aligned (AdamW moves 20–28 bytes a parameter: the step is
// bound by memory), one at a time otherwise; the same bits either way.
template <typename S, typename G>
__device__ void adamw_impl(AdamConsts c, float* master, const typename G::T* grads, float* m, float* v,
                           typename S::T* params, u64 n, int rounding, u64 seed, u64 step) {
    auto round = [&](u64 i, float p) {
        if (rounding == 2) Stochastic<S>::put(params, i, p, noise(seed, step, i));
    };
    for_each8(
        n, aligned16(master, m, v) && aligned16(grads) && aligned16(params),
        [&](u64 i) {
            float g[8], p[8], mv[8], vv[8];
            Vec8<G>::ld(grads + i, g);
            Vec8<F32>::ld(master + i, p);
            Vec8<F32>::ld(m + i, mv);
            Vec8<F32>::ld(v + i, vv);
#pragma unroll
            for (int j = 0; j < 8; j++) p[j] = adamw_one(c, g[j], p[j], mv[j], vv[j]);
            Vec8<F32>::st(m + i, mv);
            Vec8<F32>::st(v + i, vv);
            Vec8<F32>::st(master + i, p);
            if (rounding == 1) Vec8<S>::st(params + i, p);
#pragma unroll
            for (int j = 0; j < 8; j++) round(i + j, p[j]);
        },
        [&](u64 i) {
            float p = adamw_one(c, GET(G, grads, i), master[i], m[i], v[i]);
            master[i] = p;
            if (rounding == 1) PUT(S, params, i, p);
            round(i, p);
        });
}

#define ADAMW(S, G, sfx)                                                                             \
    extern "C" __global__ void adamw_##sfx(AdamConsts c, float* master, const G::T* grads, float* m, \
                                           float* v, S::T* params, u64 n, int rounding, u64 seed,    \
                                           u64 step) {                                               \
        adamw_impl<S, G>(c, master, grads, m, v, params, n, rounding, seed, step);                   \
    }
FOR_GRADS(ADAMW)
