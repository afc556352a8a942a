// RoPE (Su et al. 2021, HF `rotate_half` pairs (i, i + D/2)) and SwiGLU (Shazeer 2020), as
// kernels/cpu/rope.rs and kernels/cpu/swiglu.rs.

// x [B, T, heads, D] rotated in place by the angle of its position t; sign = -1 rotates back
// (the rotation is orthogonal: its inverse is its transpose). cos/sin are [max_pos, D/2].
// Pair k is element i = k mod D/2 of row k div D/2 with element i + D/2; eight pairs at a time
// where D/2 is a multiple of 8 (they share a row and a position).
template <typename E>
__device__ void rope_impl(typename E::T* x, const float* cos_t, const float* sin_t, u64 t, u64 heads,
                          u64 d, u64 pairs, float sign) {
    u64 half = d / 2;
    // Pair k's first element in x, and its angle's in the tables.
    auto at = [&](u64 k, u64& a, u64& angle) {
        u64 i = k % half, row = k / half;  // row = ((b·T + pos)·heads + h)
        u64 pos = (row / heads) % t;
        a = row * d + i;
        angle = pos * half + i;
    };
    for_each8(
        pairs, half % 8 == 0 && aligned16(x, cos_t, sin_t),
        [&](u64 k) {
            u64 a, angle;
            at(k, a, angle);
            float x1[8], x2[8], c[8], s[8];
            Vec8<E>::ld(x + a, x1);
            Vec8<E>::ld(x + a + half, x2);
            Vec8<F32>::ld(cos_t + angle, c);
            Vec8<F32>::ld(sin_t + angle, s);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                float sj = sign * s[j], y1 = x1[j] * c[j] - x2[j] * sj;
                x2[j] = x2[j] * c[j] + x1[j] * sj;
                x1[j] = y1;
            }
            Vec8<E>::st(x + a, x1);
            Vec8<E>::st(x + a + half, x2);
        },
        [&](u64 k) {
            u64 a, angle;
            at(k, a, angle);
            u64 b = a + half;
            float c = cos_t[angle], s = sign * sin_t[angle];
            float x1 = GET(E, x, a), x2 = GET(E, x, b);
            PUT(E, x, a, x1 * c - x2 * s);
            PUT(E, x, b, x2 * c + x1 * s);
        });
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float swiglu(float g, float u) { return g * sigmoid(g) * u; }

// h = silu(g)·u, eight at a time.
template <typename E>
__device__ void swiglu_forward_impl(const typename E::T* g, const typename E::T* u, typename E::T* h, u64 n) {
    map2<E>(g, u, h, n, [](float a, float b) { return swiglu(a, b); });
}

// du = dh·silu(g); dg = dh·u·σ(g)(1 + g(1 − σ(g))). Both outputs of one element, in `d`.
__device__ __forceinline__ void swiglu_grad(float dh, float g, float u, float (&d)[2]) {
    float sg = sigmoid(g);
    d[0] = dh * g * sg;
    d[1] = dh * u * sg * (1.0f + g * (1.0f - sg));
}

template <typename E>
__device__ void swiglu_backward_impl(const typename E::T* dh, const typename E::T* g, const typename E::T* u,
                                     typename E::T* dg, typename E::T* du, u64 n) {
    for_each8(
        n, aligned16(dh, g, u, dg, du),
        [&](u64 i) {
            float dv[8], gv[8], uv[8], d[2];
            Vec8<E>::ld(dh + i, dv);
            Vec8<E>::ld(g + i, gv);
            Vec8<E>::ld(u + i, uv);
#pragma unroll
            for (int j = 0; j < 8; j++) {
                swiglu_grad(dv[j], gv[j], uv[j], d);
                uv[j] = d[0];  // du
                gv[j] = d[1];  // dg
            }
            Vec8<E>::st(du + i, uv);
            Vec8<E>::st(dg + i, gv);
        },
        [&](u64 i) {
            float d[2];
            swiglu_grad(GET(E, dh, i), GET(E, g, i), GET(E, u, i), d);
            PUT(E, du, i, d[0]);
            PUT(E, dg, i, d[1]);
        });
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
