// One step of ring attention (context parallelism: Liu et al. 2023; kernels/cpu/attention.rs's
// `forward_ring` and `backward_ring` define it), on the device: this rank's queries against a
// key/value block that travels the ring in f32, with the load-balanced ("zigzag") split of
// `SeqPart`: a sequence cut into 2·ranks chunks, rank r holding chunks r and 2·ranks − 1 − r.
// A key is visible to a query when its position in the sequence is not after the query's.
// The plain kernels' scheme (attention.cu: one warp per query row, or per key row in the
// backward); the block's output merges into the running output and log-sum-exp by the online
// softmax (Dao 2023): the running state m = lse, l = 1, acc = o is the same softmax.

// Which tokens the queries and the block are (`RingShape`'s two `SeqPart`s).
struct RingParts {
    u64 q_rank, kv_rank, ranks;
};

// The position in its sequence of local token `i` of `rank`, holding `t` tokens
// (`SeqPart::position`).
__device__ __forceinline__ u64 seq_pos(u64 rank, u64 ranks, u64 i, u64 t) {
    if (ranks == 1) return i;
    u64 c = t / 2;
    return i < c ? rank * c + i : (2 * ranks - 1 - rank) * c + (i - c);
}

template <typename E>
__device__ void ring_forward_impl(AttnDims s, RingParts p, const typename E::T* q, const float* k, const float* v,
                                  float* o, float* lse, int merge) {
    u64 w = warp_id();
    if (w >= s.b * s.heads * s.t) return;
    u64 i = w % s.t, h = (w / s.t) % s.heads, b = w / (s.t * s.heads);
    u64 g = h / (s.heads / s.kv_heads), pi = seq_pos(p.q_rank, p.ranks, i, s.t);
    float qr[MAX_PER_LANE], kr[MAX_PER_LANE], vr[MAX_PER_LANE], acc[MAX_PER_LANE] = {0, 0, 0, 0};
    load_row<E>(q + q_at(s, b, i, h), s.d, qr);
    float* orow = o + q_at(s, b, i, h);
    u64 at = lse_at(s, b, h, i);
    float m = F_INF_NEG, l = 0.0f;
    if (merge) {
        load_row<F32>(orow, s.d, acc);
        m = lse[at];
        l = 1.0f;
    }
    for (u64 j = 0; j < s.t; j++) {
        if (seq_pos(p.kv_rank, p.ranks, j, s.t) > pi) continue;  // the whole warp: one row
        load_row<F32>(k + kv_at(s, b, j, g), s.d, kr);
        float x = dot(qr, kr) * s.scale;
        float m2 = fmaxf(m, x);
        float a = expf(m - m2), e = expf(x - m2);
        load_row<F32>(v + kv_at(s, b, j, g), s.d, vr);
#pragma unroll
        for (int c = 0; c < MAX_PER_LANE; c++) acc[c] = acc[c] * a + e * vr[c];
        l = l * a + e;
        m = m2;
    }
    // A query that sees no key of the block keeps its values (m, l, acc as loaded).
    if (l == 0.0f) return;
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < MAX_PER_LANE; c++)
        if (lane + 32 * c < s.d) orow[lane + 32 * c] = acc[c] / l;
    if (lane == 0) lse[at] = m + logf(l);
}

// The block's part of dq_i = scale · Σ_j p_ij (dO_i·v_j − Δ_i) k_j over its visible keys, added
// to dq (f32); Δ_i = dO_i·o_i into `delta` [B,H,T] for the key pass. One warp per query row.
template <typename E>
__device__ void ring_backward_q_impl(AttnDims s, RingParts p, const typename E::T* q, const float* k,
                                     const float* v, const typename E::T* o, const float* lse,
                                     const typename E::T* d_o, float* dq, float* delta) {
    u64 w = warp_id();
    if (w >= s.b * s.heads * s.t) return;
    u64 i = w % s.t, h = (w / s.t) % s.heads, b = w / (s.t * s.heads);
    u64 g = h / (s.heads / s.kv_heads), pi = seq_pos(p.q_rank, p.ranks, i, s.t);
    float qr[MAX_PER_LANE], dor[MAX_PER_LANE], kr[MAX_PER_LANE], vr[MAX_PER_LANE], acc[MAX_PER_LANE] = {0, 0, 0, 0};
    load_row<E>(q + q_at(s, b, i, h), s.d, qr);
    load_row<E>(d_o + q_at(s, b, i, h), s.d, dor);
    load_row<E>(o + q_at(s, b, i, h), s.d, vr);
    float di = dot(dor, vr), li = lse[lse_at(s, b, h, i)];
    for (u64 j = 0; j < s.t; j++) {
        if (seq_pos(p.kv_rank, p.ranks, j, s.t) > pi) continue;
        load_row<F32>(k + kv_at(s, b, j, g), s.d, kr);
        load_row<F32>(v + kv_at(s, b, j, g), s.d, vr);
        float e = expf(dot(qr, kr) * s.scale - li);
        float ds = e * (dot(dor, vr) - di) * s.scale;
#pragma unroll
        for (int c = 0; c < MAX_PER_LANE; c++) acc[c] += ds * kr[c];
    }
    int lane = threadIdx.x & 31;
    float* row = dq + q_at(s, b, i, h);
#pragma unroll
    for (int c = 0; c < MAX_PER_LANE; c++)
        if (lane + 32 * c < s.d) row[lane + 32 * c] += acc[c];
    if (lane == 0) delta[lse_at(s, b, h, i)] = di;
}

// The block's dv_j = Σ_h Σ_i p_ij dO_i and dk_j = scale · Σ_h Σ_i p_ij (dO_i·v_j − Δ_i) q_i over
// the query heads of kv head g and the queries that see key j, added to dk, dv (f32, which
// travel the ring with the block). One warp per key row; after the query pass (Δ).
template <typename E>
__device__ void ring_backward_kv_impl(AttnDims s, RingParts p, const typename E::T* q, const float* k,
                                      const float* v, const float* lse, const typename E::T* d_o,
                                      const float* delta, float* dk, float* dv) {
    u64 w = warp_id();
    if (w >= s.b * s.kv_heads * s.t) return;
    u64 j = w % s.t, g = (w / s.t) % s.kv_heads, b = w / (s.t * s.kv_heads);
    u64 group = s.heads / s.kv_heads, pj = seq_pos(p.kv_rank, p.ranks, j, s.t);
    float kr[MAX_PER_LANE], vr[MAX_PER_LANE], qr[MAX_PER_LANE], dor[MAX_PER_LANE];
    float dkr[MAX_PER_LANE] = {0, 0, 0, 0}, dvr[MAX_PER_LANE] = {0, 0, 0, 0};
    load_row<F32>(k + kv_at(s, b, j, g), s.d, kr);
    load_row<F32>(v + kv_at(s, b, j, g), s.d, vr);
    for (u64 h = g * group; h < (g + 1) * group; h++) {
        for (u64 i = 0; i < s.t; i++) {
            if (seq_pos(p.q_rank, p.ranks, i, s.t) < pj) continue;
            load_row<E>(q + q_at(s, b, i, h), s.d, qr);
            load_row<E>(d_o + q_at(s, b, i, h), s.d, dor);
            u64 r = lse_at(s, b, h, i);
            float e = expf(dot(qr, kr) * s.scale - lse[r]);
            float ds = e * (dot(dor, vr) - delta[r]) * s.scale;
#pragma unroll
            for (int c = 0; c < MAX_PER_LANE; c++) {
                dvr[c] += e * dor[c];
                dkr[c] += ds * qr[c];
            }
        }
    }
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int c = 0; c < MAX_PER_LANE; c++)
        if (lane + 32 * c < s.d) {
            dk[kv_at(s, b, j, g) + lane + 32 * c] += dkr[c];
            dv[kv_at(s, b, j, g) + lane + 32 * c] += dvr[c];
        }
}

#define RING_ATTENTION(E, sfx)                                                                         \
    extern "C" __global__ void ring_forward_##sfx(AttnDims s, RingParts p, const E::T* q, const float* k, \
                                                  const float* v, float* o, float* lse, int merge) {      \
        ring_forward_impl<E>(s, p, q, k, v, o, lse, merge);                                            \
    }                                                                                                  \
    extern "C" __global__ void ring_backward_q_##sfx(AttnDims s, RingParts p, const E::T* q,             \
                                                     const float* k, const float* v, const E::T* o,      \
                                                     const float* lse, const E::T* d_o, float* dq,       \
                                                     float* delta) {                                     \
        ring_backward_q_impl<E>(s, p, q, k, v, o, lse, d_o, dq, delta);                                \
    }                                                                                                  \
    extern "C" __global__ void ring_backward_kv_##sfx(AttnDims s, RingParts p, const E::T* q,            \
                                                      const float* k, const float* v, const float* lse,  \
                                                      const E::T* d_o, const float* delta, float* dk,    \
                                                      float* dv) {                                       \
        ring_backward_kv_impl<E>(s, p, q, k, v, lse, d_o, delta, dk, dv);                              \
    }
FOR_STORAGE(RING_ATTENTION)
