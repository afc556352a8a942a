// RoPE (Su et al. 2021, HF `rotate_half` pairs (i, i + D/2)) and SwiGLU (Shazeer 2020), as
// kernels/cpu/rope.rs and kernels/cpu/swiglu.rs.

// x [B, T, heads, D] rotated in place by the angle of its position t; sign = -1 rotates back
// (the rotation is orthogonal: its inverse is its transpose). cos/sin are [max_pos, D/2].
template <typename E>
__device__ void rope_impl(typename E::T* x, const float* cos_t, const float* sin_t, u64 t, u64 heads,
                          u64 d, u64 pairs, float sign) {
    u64 half = d / 2;
    FOR_EACH(k, pairs) {
        u64 i = k % half, row = k / half;  // row = ((b·T + pos)·heads + h)
        u64 pos = (row / heads) % t;
        u64 a = row * d + i, b = a + half;
        float c = cos_t[pos * half + i], s = sign * sin_t[pos * half + i];
        float x1 = GET(E, x, a), x2 = GET(E, x, b);
        PUT(E, x, a, x1 * c - x2 * s);
        PUT(E, x, b, x2 * c + x1 * s);
    }
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename E>
__device__ void swiglu_forward_impl(const typename E::T* g, const typename E::T* u, typename E::T* h, u64 n) {
    FOR_EACH(i, n) {
        float gi = GET(E, g, i);
        PUT(E, h, i, gi * sigmoid(gi) * GET(E, u, i));
    }
}

template <typename E>
__device__ void swiglu_backward_impl(const typename E::T* dh, const typename E::T* g, const typename E::T* u,
                                     typename E::T* dg, typename E::T* du, u64 n) {
    FOR_EACH(i, n) {
        float dhi = GET(E, dh, i), gi = GET(E, g, i), ui = GET(E, u, i);
        float sg = sigmoid(gi);
        PUT(E, du, i, dhi * gi * sg);
        PUT(E, dg, i, dhi * ui * sg * (1.0f + gi * (1.0f - sg)));
    }
}

#define ROPE_SWIGLU(E, sfx)                                                                          \
    extern "C" __global__ void rope_##sfx(E::T* x, const float* cos_t, const float* sin_t, u64 t,    \
                                          u64 heads, u64 d, u64 pairs, float sign) {                 \
        rope_impl<E>(x, cos_t, sin_t, t, heads, d, pairs, sign);                                     \
    }                                                                                                \
    extern "C" __global__ void swiglu_forward_##sfx(const E::T* g, const E::T* u, E::T* h, u64 n) {  \
        swiglu_forward_impl<E>(g, u, h, n);                                                          \
    }                                                                                                \
    extern "C" __global__ void swiglu_backward_##sfx(const E::T* dh, const E::T* g, const E::T* u,   \
                                                     E::T* dg, E::T* du, u64 n) {                    \
        swiglu_backward_impl<E>(dh, g, u, dg, du, n);                                                \
    }
FOR_STORAGE(ROPE_SWIGLU)
