// Causal grouped-query attention without a T×T matrix in memory (the online softmax of Dao et
// al. 2022 / Milakov & Gimelshein 2018), as kernels/cpu/attention.rs defines it: q [B,T,H,D],
// k/v [B,T,KV,D], o [B,T,H,D], lse [B,H,T] (natural log), query head h reads kv head
// h / (H/KV), scale 1/√D. This is the first, plain kernel: one warp per query row (or key row
// in the backward), head dims up to 128 held four per lane. The tiled tensor-core kernel
// (FA2) is CUDA II's.

#define MAX_PER_LANE 4  // head_dim ≤ 128

struct AttnDims {
    u64 b, t, heads, kv_heads, d;
    float scale;
};

__device__ __forceinline__ u64 q_at(AttnDims s, u64 b, u64 i, u64 h) { return ((b * s.t + i) * s.heads + h) * s.d; }
__device__ __forceinline__ u64 kv_at(AttnDims s, u64 b, u64 j, u64 g) { return ((b * s.t + j) * s.kv_heads + g) * s.d; }
__device__ __forceinline__ u64 lse_at(AttnDims s, u64 b, u64 h, u64 i) { return (b * s.heads + h) * s.t + i; }

// This lane's dims of row `p` (zeros past d).
template <typename E>
__device__ __forceinline__ void load_row(const typename E::T* p, u64 d, float* r) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; k++) {
        u64 c = lane + 32 * k;
        r[k] = c < d ? GET(E, p, c) : 0.0f;
    }
}
__device__ __forceinline__ float dot(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < MAX_PER_LANE; k++) s += a[k] * b[k];
    return warp_sum(s);
}

// The warp's row index in a grid of warps.
__device__ __forceinline__ u64 warp_id() { return ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; }

template <typename E>
__device__ void attention_forward_impl(AttnDims s, const typename E::T* q, const typename E::T* k,
                                       const typename E::T* v, typename E::T* o, float* lse) {
    u64 w = warp_id();
    if (w >= s.b * s.heads * s.t) return;
    u64 i = w % s.t, h = (w / s.t) % s.heads, b = w / (s.t * s.heads);
    u64 g = h / (s.heads / s.kv_heads);
    float qr[MAX_PER_LANE], kr[MAX_PER_LANE], vr[MAX_PER_LANE], acc[MAX_PER_LANE] = {0, 0, 0, 0};
    load_row<E>(q + q_at(s, b, i, h), s.d, qr);
    float m = F_INF_NEG, l = 0.0f;
    for (u64 j = 0; j <= i; j++) {
        load_row<E>(k + kv_at(s, b, j, g), s.d, kr);
        float x = dot(qr, kr) * s.scale;
        float m2 = fmaxf(m, x);
        float a = expf(m - m2), p = expf(x - m2);
        load_row<E>(v + kv_at(s, b, j, g), s.d, vr);
#pragma unroll
        for (int c = 0; c < MAX_PER_LANE; c++) acc[c] = acc[c] * a + p * vr[c];
        l = l * a + p;
        m = m2;
    }
    int lane = threadIdx.x & 31;
    typename E::T* orow = o + q_at(s, b, i, h);
#pragma unroll
    for (int c = 0; c < MAX_PER_LANE; c++)
        if (lane + 32 * c < s.d) PUT(E, orow, lane + 32 * c, acc[c] / l);
    if (lane == 0) lse[lse_at(s, b, h, i)] = m + logf(l);
}

// dq_i = scale · Σ_{j≤i} p_ij (dO_i·v_j − Δ_i) k_j, with Δ_i = dO_i·o_i saved in `delta` [B,H,T]
// for the key pass. One warp per query row.
template <typename E>
__device__ void attention_backward_q_impl(AttnDims s, const typename E::T* q, const typename E::T* k,
                                          const typename E::T* v, const typename E::T* o, const float* lse,
                                          const typename E::T* d_o, typename E::T* dq, float* delta) {
    u64 w = warp_id();
    if (w >= s.b * s.heads * s.t) return;
    u64 i = w % s.t, h = (w / s.t) % s.heads, b = w / (s.t * s.heads);
    u64 g = h / (s.heads / s.kv_heads);
    float qr[MAX_PER_LANE], dor[MAX_PER_LANE], kr[MAX_PER_LANE], vr[MAX_PER_LANE], acc[MAX_PER_LANE] = {0, 0, 0, 0};
    load_row<E>(q + q_at(s, b, i, h), s.d, qr);
    load_row<E>(d_o + q_at(s, b, i, h), s.d, dor);
    load_row<E>(o + q_at(s, b, i, h), s.d, vr);
    float di = dot(dor, vr), li = lse[lse_at(s, b, h, i)];
    for (u64 j = 0; j <= i; j++) {
        load_row<E>(k + kv_at(s, b, j, g), s.d, kr);
        load_row<E>(v + kv_at(s, b, j, g), s.d, vr);
        float p = expf(dot(qr, kr) * s.scale - li);
        float ds = p * (dot(dor, vr) - di) * s.scale;
#pragma unroll
        for (int c = 0; c < MAX_PER_LANE; c++) acc[c] += ds * kr[c];
    }
    int lane = threadIdx.x & 31;
    typename E::T* row = dq + q_at(s, b, i, h);
#pragma unroll
    for (int c = 0; c < MAX_PER_LANE; c++)
        if (lane + 32 * c < s.d) PUT(E, row, lane + 32 * c, acc[c]);
    if (lane == 0) delta[lse_at(s, b, h, i)] = di;
}

// dv_j = Σ_h Σ_{i≥j} p_ij dO_i and dk_j = scale · Σ_h Σ_{i≥j} p_ij (dO_i·v_j − Δ_i) q_i over the
// query heads h of kv head g. One warp per key row; runs after the query pass (Δ).
template <typename E>
__device__ void attention_backward_kv_impl(AttnDims s, const typename E::T* q, const typename E::T* k,
                                           const typename E::T* v, const float* lse, const typename E::T* d_o,
                                           const float* delta, typename E::T* dk, typename E::T* dv) {
    u64 w = warp_id();
    if (w >= s.b * s.kv_heads * s.t) return;
    u64 j = w % s.t, g = (w / s.t) % s.kv_heads, b = w / (s.t * s.kv_heads);
    u64 group = s.heads / s.kv_heads;
    float kr[MAX_PER_LANE], vr[MAX_PER_LANE], qr[MAX_PER_LANE], dor[MAX_PER_LANE];
    float dkr[MAX_PER_LANE] = {0, 0, 0, 0}, dvr[MAX_PER_LANE] = {0, 0, 0, 0};
    load_row<E>(k + kv_at(s, b, j, g), s.d, kr);
    load_row<E>(v + kv_at(s, b, j, g), s.d, vr);
    for (u64 h = g * group; h < (g + 1) * group; h++) {
        for (u64 i = j; i < s.t; i++) {
            load_row<E>(q + q_at(s, b, i, h), s.d, qr);
            load_row<E>(d_o + q_at(s, b, i, h), s.d, dor);
            u64 r = lse_at(s, b, h, i);
            float p = expf(dot(qr, kr) * s.scale - lse[r]);
            float ds = p * (dot(dor, vr) - delta[r]) * s.scale;
#pragma unroll
            for (int c = 0; c < MAX_PER_LANE; c++) {
                dvr[c] += p * dor[c];
                dkr[c] += ds * qr[c];
            }
        }
    }
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < MAX_PER_LANE; c++)
        if (lane + 32 * c < s.d) {
            PUT(E, dk + kv_at(s, b, j, g), lane + 32 * c, dkr[c]);
            PUT(E, dv + kv_at(s, b, j, g), lane + 32 * c, dvr[c]);
        }
}

#define ATTENTION(E, sfx)                                                                            \
    extern "C" __global__ void attention_forward_##sfx(AttnDims s, const E::T* q, const E::T* k,     \
                                                       const E::T* v, E::T* o, float* lse) {         \
        attention_forward_impl<E>(s, q, k, v, o, lse);                                               \
    }                                                                                                \
    extern "C" __global__ void attention_backward_q_##sfx(AttnDims s, const E::T* q, const E::T* k,  \
                                                          const E::T* v, const E::T* o,              \
                                                          const float* lse, const E::T* d_o,         \
                                                          E::T* dq, float* delta) {                  \
        attention_backward_q_impl<E>(s, q, k, v, o, lse, d_o, dq, delta);                            \
    }                                                                                                \
    extern "C" __global__ void attention_backward_kv_##sfx(AttnDims s, const E::T* q, const E::T* k, \
                                                           const E::T* v, const float* lse,          \
                                                           const E::T* d_o, const float* delta,      \
                                                           E::T* dk, E::T* dv) {                     \
        attention_backward_kv_impl<E>(s, q, k, v, lse, d_o, delta, dk, dv);                          \
    }
FOR_STORAGE(ATTENTION)
