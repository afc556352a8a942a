// Causal grouped-query attention on tensor cores: FlashAttention-2 (Dao 2023), for 16-bit
// storage (bf16, f16) and head dims 64 and 128; the plain kernels of attention.cu take every
// other case and are these kernels' reference in the tests. Same tensors and layouts as
// attention.cu (q [B,T,H,D], k/v [B,T,KV,D], lse and Δ [B,H,T]), same two-pass backward
// without atomics: a query pass (Δ and dQ), then a key pass (dK and dV over the group's query
// heads).
//
// A block is 4 warps; each warp owns 16 rows of the block's 64-row tile (query rows, or key
// rows in the key pass) and keeps them in registers as mma operands; the other side's 64-row
// tiles come through shared memory. Products are `mma.sync.aligned.m16n8k16` with f32
// accumulators. Its fragments, from the PTX ISA ("Matrix Fragments for mma.m16n8k16 with
// floating point type"), with g = lane / 4 and t = lane % 4, each .b32 register holding two
// 16-bit elements, the lower column (or k) in its low half:
//   A (16×16, row-major): a0 = (g, 2t), a1 = (g+8, 2t), a2 = (g, 2t+8), a3 = (g+8, 2t+8)
//   B (16×8, k × n):      b0 = (k 2t, n g), b1 = (k 2t+8, n g)
//   C (16×8, f32):        c0, c1 = (g, 2t), (g, 2t+1); c2, c3 = (g+8, 2t), (g+8, 2t+1)
// Two adjacent C tiles (16 columns) are, rounded to 16 bits, one A tile: the softmax's P (and
// the backward's dS) feed the next product from registers.
//
// The probabilities and dS are rounded to the storage type before their products, as FA2
// does; the running max, the sums and every accumulator are f32.

#define FA_TILE 64
#define FA_WARPS 4

// A tile of FA_TILE rows × D 16-bit elements in shared memory, as pairs: word c of row r
// holds elements 2c and 2c+1. Rows are 16 bytes longer than D elements, which keeps every
// 8-element row segment 16-byte aligned (ldmatrix's rule) and puts the 8 rows one ldmatrix
// phase reads in 8 distinct groups of 4 banks.
template <int D>
struct alignas(16) Tile {
    u32 w[FA_TILE][D / 2 + 4];
};

__device__ __forceinline__ u32 pack2(u32 lo, u32 hi) { return lo | (hi << 16); }

// ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16: four 8×8 matrices of 16-bit elements,
// row r of matrix j at the address lane 8j + r gives (16-byte aligned). Register j of lane L
// holds matrix j's row L/4, elements 2(L%4) and 2(L%4)+1 (low, high half); with .trans its
// column L/4, rows 2(L%4) and 2(L%4)+1: a B fragment of a matrix stored k-major.
__device__ __forceinline__ u32 shared_address(const void* p) {
    u64 a;
    asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
    return (u32)a;
}
__device__ __forceinline__ void ldsm_x4(u32 (&r)[4], const u32* row) {
#ifdef FERROTRON_CUDA_EMU
    emu::ldmatrix_x4(r, row, false);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
#endif
}
__device__ __forceinline__ void ldsm_x4_trans(u32 (&r)[4], const u32* row) {
#ifdef FERROTRON_CUDA_EMU
    emu::ldmatrix_x4(r, row, true);
#else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(row)));
#endif
}

// cp.async (sm_80 on): 16 bytes from global to shared memory without a register in between.
// The copies a thread issued land by its cp.async.wait_group, so the next tile's load runs
// under this tile's products (FA2's prefetch; the load was half a tile's time on the H200's
// trace). `valid` false writes zeros and reads nothing (src-size 0); `src` stays a real address.
__device__ __forceinline__ void copy16_async(u32* dst, const u16* src, bool valid) {
#ifdef FERROTRON_CUDA_EMU
    emu::aligned16(dst);
    emu::aligned16(src);
    if (valid)
        memcpy(dst, src, 16);
    else
        memset(dst, 0, 16);
#else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
                 "r"(valid ? 16 : 0));
#endif
}
// Closes the copies issued so far into one group; `async_wait<N>` waits until at most N groups
// are still in flight. (The emulator copies at once: both are no-ops there.)
__device__ __forceinline__ void async_commit() {
#ifndef FERROTRON_CUDA_EMU
    asm volatile("cp.async.commit_group;\n" ::);
#endif
}
template <int N>
__device__ __forceinline__ void async_wait() {
#ifndef FERROTRON_CUDA_EMU
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
#endif
}

// The 16-bit type's rounding and widening, and the product on it.
template <typename E>
struct Mma16;
template <>
struct Mma16<BF16> {
    static __device__ __forceinline__ u32 bits(float x) { return to_bf16(x); }
    static __device__ __forceinline__ float widen(u32 h) { return __uint_as_float(h << 16); }
    static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#ifdef FERROTRON_CUDA_EMU
        emu::mma_16816(c, a, b0, b1, emu::bf16_to_f32);
#else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
    }
};
template <>
struct Mma16<F16> {
    static __device__ __forceinline__ u32 bits(float x) { return to_f16(x); }
    static __device__ __forceinline__ float widen(u32 h) { return f16_to_f32((f16_t)h); }
    static __device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#ifdef FERROTRON_CUDA_EMU
        emu::mma_16816(c, a, b0, b1, emu::f16_to_f32);
#else
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
            "{%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
    }
};

// Rows row0.. of a [.., T, .., D] tensor (`p` at row 0 of its batch and head, `stride`
// elements from row to row) into a tile; rows at or past `t` are zeros. 16 bytes at a time,
// asynchronously (landed by the caller's async_wait), where `p` and the stride allow (the
// trainer's buffers: 64-byte aligned, H·D a multiple of 8), else element pairs, at once (a
// view at an odd offset).
template <int D>
__device__ void load_tile(Tile<D>& s, const u16* p, u64 row0, u64 t, u64 stride) {
    if (((u64)p & 15) == 0 && stride % 8 == 0) {
        for (int i = threadIdx.x; i < FA_TILE * D / 8; i += FA_WARPS * 32) {
            int r = i / (D / 8), c = i % (D / 8);
            u64 row = row0 + r;
            copy16_async(&s.w[r][4 * c], row < t ? p + row * stride + 8 * c : p, row < t);
        }
        return;
    }
    for (int i = threadIdx.x; i < FA_TILE * D / 2; i += FA_WARPS * 32) {
        int r = i / (D / 2), c = i % (D / 2);
        u64 row = row0 + r;
        const u16* x = p + row * stride + 2 * c;
        s.w[r][c] = row < t ? pack2(x[0], x[1]) : 0u;
    }
}

// This thread's A fragments of rows `row` and row + 8 (every 16-column chunk of D), straight
// from global memory; rows at or past `t` are zeros.
template <int D>
__device__ void load_a(u32 (&a)[D / 16][4], const u16* p, u64 row, u64 t, u64 stride) {
    int ti = threadIdx.x & 3;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc++)
#pragma unroll
        for (int r = 0; r < 4; r++) {
            u64 rr = row + 8 * (r & 1);
            const u16* x = p + rr * stride + kc * 16 + 2 * ti + 8 * (r >> 1);
            a[kc][r] = rr < t ? pack2(x[0], x[1]) : 0u;
        }
}

// acc[n] (n = 0..7: the tile's 64 rows, 8 at a time) += A · tileᵀ: the tile's rows are the
// product's columns (B = tileᵀ, k along D). One ldmatrix gives an n block's b0, b1 for two
// 16-wide k chunks: matrix j is rows n·8.., elements kc·16 + 8j...
template <typename E, int D>
__device__ __forceinline__ void mma_rows(float (&acc)[8][4], const u32 (&a)[D / 16][4], const Tile<D>& s) {
    int lane = threadIdx.x & 31;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc += 2)
#pragma unroll
        for (int n = 0; n < 8; n++) {
            u32 b[4];
            ldsm_x4(b, &s.w[n * 8 + (lane & 7)][(kc * 16 + 8 * (lane >> 3)) / 2]);
            Mma16<E>::mma(acc[n], a[kc], b[0], b[1]);
            Mma16<E>::mma(acc[n], a[kc + 1], b[2], b[3]);
        }
}

// acc[n] (n = 0..D/8: the head dims, 8 at a time) += P · tile, P the 16 × 64 C fragments in
// `p` rounded to 16 bits (the FA2 register trick), the tile's rows being the product's k.
// One transposing ldmatrix gives b0, b1 of two n blocks: matrix j is rows kk·16 + 8(j%2)..,
// elements (n + j/2)·8...
template <typename E, int D>
__device__ __forceinline__ void mma_cols(float (&acc)[D / 8][4], const float (&p)[8][4], const Tile<D>& s) {
    int lane = threadIdx.x & 31, j = lane >> 3;
#pragma unroll
    for (int kk = 0; kk < 4; kk++) {
        u32 a[4] = {
            pack2(Mma16<E>::bits(p[2 * kk][0]), Mma16<E>::bits(p[2 * kk][1])),
            pack2(Mma16<E>::bits(p[2 * kk][2]), Mma16<E>::bits(p[2 * kk][3])),
            pack2(Mma16<E>::bits(p[2 * kk + 1][0]), Mma16<E>::bits(p[2 * kk + 1][1])),
            pack2(Mma16<E>::bits(p[2 * kk + 1][2]), Mma16<E>::bits(p[2 * kk + 1][3])),
        };
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            u32 b[4];
            ldsm_x4_trans(b, &s.w[kk * 16 + 8 * (j & 1) + (lane & 7)][(n + (j >> 1)) * 4]);
            Mma16<E>::mma(acc[n], a, b[0], b[1]);
            Mma16<E>::mma(acc[n + 1], a, b[2], b[3]);
        }
    }
}

// Sum (or max) over the 4 threads of a quad, which together hold a C fragment's row.
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// Writes this thread's part of rows `row` and row + 8 of `acc` · `mul[r]` (rows past t skipped).
template <typename E, int D>
__device__ __forceinline__ void store_rows(u16* p, const float (&acc)[D / 8][4], u64 row, u64 t, u64 stride,
                                           const float (&mul)[2]) {
    int ti = threadIdx.x & 3;
#pragma unroll
    for (int e = 0; e < 4; e++) {
        u64 rr = row + 8 * (e >> 1);
        if (rr >= t) continue;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            p[rr * stride + n * 8 + 2 * ti + (e & 1)] = (u16)Mma16<E>::bits(acc[n][e] * mul[e >> 1]);
    }
}

// The other side's two tiles a step needs (K and V, or Q and dO), twice over where shared
// memory allows (D 64: 37 KB of the 48 a block may declare; D 128 would take 70), so that one
// step's tiles land while the last step's are multiplied.
template <int D>
struct TilePair {
    static constexpr int STAGES = D == 64 ? 2 : 1;
    Tile<D> a[STAGES], b[STAGES];
};

// Steps 0..n: load(i, stage) issues step i's copies (async_commit closes them), body(i, stage)
// uses them once landed; with two stages step i + 1's copies are issued before step i's body.
// The caller has issued step 0's, load(0, 0), and then loaded what its rows keep in registers
// (which a load inside the loop would keep live: the compiler cannot tell it runs once).
template <int D, typename Load, typename Body>
__device__ __forceinline__ void pipelined(u64 n, Load load, Body body) {
    constexpr int S = TilePair<D>::STAGES;
    for (u64 i = 0; i < n; i++) {
        int cur = S == 2 ? (int)(i & 1) : 0;
        if (S == 2 && i + 1 < n) {
            load(i + 1, cur ^ 1);  // into the stage the last step's body released
            async_wait<1>();
        } else {
            async_wait<0>();
        }
        __syncthreads();  // every thread's copies of this step have landed
        body(i, cur);
        __syncthreads();  // every thread is done with this stage
        if (S == 1 && i + 1 < n) load(i + 1, 0);
    }
}

template <int D>
__device__ __forceinline__ void load_pair(TilePair<D>& t, int stage, const u16* pa, const u16* pb, u64 row0,
                                          u64 rows, u64 stride) {
    load_tile<D>(t.a[stage], pa, row0, rows, stride);
    load_tile<D>(t.b[stage], pb, row0, rows, stride);
    async_commit();
}

// The diagonal tile's causal mask on a 16 × 64 block of scores (this warp's 16 rows against
// the tile's 64 columns, both counted from the tile's start): −∞ where the key comes after the
// query. `KEYS`: the rows are keys and the columns queries (the key pass's transposed scores).
// Only the diagonal tile needs it: every key of an earlier tile precedes every query of a
// later one, and rows or columns past t are zeros whose products are not stored (a query
// past t has dO = 0, so its column adds nothing to dK or dV).
template <bool KEYS>
__device__ __forceinline__ void mask_diagonal(float (&sc)[8][4]) {
    int r0 = (threadIdx.x >> 5) * 16 + ((threadIdx.x & 31) >> 2), ti = threadIdx.x & 3;
#pragma unroll
    for (int n = 0; n < 8; n++)
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int c = n * 8 + 2 * ti + (e & 1), r = r0 + 8 * (e >> 1);
            if (KEYS ? c < r : c > r) sc[n][e] = F_INF_NEG;
        }
}

// The exponentials are exp2 of scores scaled by log2(e) (FA2's one FFMA and one EX2 an element);
// the saved log-sum-exp stays in natural log, as attention.cu's.
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

// The query tile of block y, the heaviest (last, the most causal keys) first: a wave's
// longest blocks start first and the short ones fill its tail (FA2's order).
__device__ __forceinline__ u64 query_tile() { return gridDim.y - 1 - blockIdx.y; }

// Forward: block (b·H + h, query tile). Rows past t compute on zeros and are not written.
template <typename E, int D>
__device__ void flash_forward_impl(AttnDims s, const u16* q, const u16* k, const u16* v, u16* o, float* lse) {
    __shared__ TilePair<D> kv;
    u64 h = blockIdx.x % s.heads, b = blockIdx.x / s.heads, qb = query_tile();
    u64 g = h / (s.heads / s.kv_heads), qstride = s.heads * D, kvstride = s.kv_heads * D;
    int lane = threadIdx.x & 31, gi = lane >> 2, ti = lane & 3;
    u64 row = qb * FA_TILE + (threadIdx.x >> 5) * 16 + gi;  // and row + 8
    const u16 *kp = k + kv_at(s, b, 0, g), *vp = v + kv_at(s, b, 0, g);
    auto load = [&](u64 kb, int st) { load_pair<D>(kv, st, kp, vp, kb * FA_TILE, s.t, kvstride); };
    load(0, 0);
    u32 qa[D / 16][4];
    load_a<D>(qa, q + q_at(s, b, 0, h), row, s.t, qstride);
    float acc[D / 8][4] = {}, m[2] = {F_INF_NEG, F_INF_NEG}, l[2] = {0.0f, 0.0f}, sl = s.scale * FA_LOG2E;
    // Causal: the key tiles up to this query tile's own.
    pipelined<D>(
        qb + 1, load,
        [&](u64 kb, int st) {
            float sc[8][4] = {};
            mma_rows<E, D>(sc, qa, kv.a[st]);
            if (kb == qb) mask_diagonal<false>(sc);
            // Online softmax over this tile's keys, in log2 units (every row keeps its first
            // key unmasked: key kb·64 ≤ every row of a tile at or after kb).
            float mx[2] = {m[0], m[1]};
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    sc[n][e] *= sl;
                    mx[e >> 1] = fmaxf(mx[e >> 1], sc[n][e]);
                }
            float alpha[2];
#pragma unroll
            for (int r = 0; r < 2; r++) {
                mx[r] = quad_max(mx[r]);
                alpha[r] = exp2f(m[r] - mx[r]);
                m[r] = mx[r];
                l[r] *= alpha[r];
            }
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    sc[n][e] = exp2f(sc[n][e] - m[e >> 1]);
                    l[e >> 1] += sc[n][e];  // this thread's columns; the quad's sum at the end
                }
#pragma unroll
            for (int n = 0; n < D / 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[n][e] *= alpha[e >> 1];
            mma_cols<E, D>(acc, sc, kv.b[st]);
        });
    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] = quad_sum(l[r]);
        inv[r] = 1.0f / l[r];
    }
    store_rows<E, D>(o + q_at(s, b, 0, h), acc, row, s.t, qstride, inv);
#pragma unroll
    for (int r = 0; r < 2; r++)
        if (ti == 0 && row + 8 * r < s.t) lse[lse_at(s, b, h, row + 8 * r)] = m[r] * FA_LN2 + logf(l[r]);
}

// Backward, query pass: Δ_i = dO_i·O_i (saved for the key pass) and
// dQ = scale · Σ_j P_ij (dO_i·V_j − Δ_i) K_j over the key tiles up to the query tile's own.
template <typename E, int D>
__device__ void flash_backward_q_impl(AttnDims s, const u16* q, const u16* k, const u16* v, const u16* o,
                                      const float* lse, const u16* d_o, u16* dq, float* delta) {
    __shared__ TilePair<D> kv;
    u64 h = blockIdx.x % s.heads, b = blockIdx.x / s.heads, qb = query_tile();
    u64 g = h / (s.heads / s.kv_heads), qstride = s.heads * D, kvstride = s.kv_heads * D;
    int lane = threadIdx.x & 31, gi = lane >> 2, ti = lane & 3;
    u64 row = qb * FA_TILE + (threadIdx.x >> 5) * 16 + gi;
    const u16 *kp = k + kv_at(s, b, 0, g), *vp = v + kv_at(s, b, 0, g);
    u64 qoff = q_at(s, b, 0, h);
    // The first tiles' copies go out before the rows' own loads.
    auto load = [&](u64 kb, int st) { load_pair<D>(kv, st, kp, vp, kb * FA_TILE, s.t, kvstride); };
    load(0, 0);
    u32 qa[D / 16][4], da[D / 16][4], oa[D / 16][4];
    load_a<D>(qa, q + qoff, row, s.t, qstride);
    load_a<D>(da, d_o + qoff, row, s.t, qstride);
    load_a<D>(oa, o + qoff, row, s.t, qstride);
    float dl[2] = {0.0f, 0.0f}, lr[2], acc[D / 8][4] = {}, sl = s.scale * FA_LOG2E;
#pragma unroll
    for (int kc = 0; kc < D / 16; kc++)
#pragma unroll
        for (int r = 0; r < 4; r++)
            dl[r & 1] += Mma16<E>::widen(da[kc][r] & 0xffffu) * Mma16<E>::widen(oa[kc][r] & 0xffffu) +
                         Mma16<E>::widen(da[kc][r] >> 16) * Mma16<E>::widen(oa[kc][r] >> 16);
#pragma unroll
    for (int r = 0; r < 2; r++) {
        u64 i = row + 8 * r;
        dl[r] = quad_sum(dl[r]);
        lr[r] = i < s.t ? lse[lse_at(s, b, h, i)] * FA_LOG2E : 0.0f;
        if (ti == 0 && i < s.t) delta[lse_at(s, b, h, i)] = dl[r];
    }
    pipelined<D>(
        qb + 1, load,
        [&](u64 kb, int st) {
            float sc[8][4] = {}, dp[8][4] = {};
            mma_rows<E, D>(sc, qa, kv.a[st]);
            mma_rows<E, D>(dp, da, kv.b[st]);
            if (kb == qb) mask_diagonal<false>(sc);
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float p = exp2f(sc[n][e] * sl - lr[e >> 1]);
                    sc[n][e] = p * (dp[n][e] - dl[e >> 1]) * s.scale;  // dS
                }
            mma_cols<E, D>(acc, sc, kv.a[st]);
        });
    float one[2] = {1.0f, 1.0f};
    store_rows<E, D>(dq + qoff, acc, row, s.t, qstride, one);
}

// Backward, key pass: block (b·KV + g, key tile); for every query head of kv head g and every
// query tile from the key tile's own on (one pipelined run of steps over both), Pᵀ and dSᵀ
// from the keys' side: dV += Pᵀ·dO and dK += dSᵀ·Q (dS carries the scale, as in the query
// pass). Key tile 0 has the most steps and is launched first.
template <typename E, int D>
__device__ void flash_backward_kv_impl(AttnDims s, const u16* q, const u16* k, const u16* v, const float* lse,
                                       const u16* d_o, const float* delta, u16* dk, u16* dv) {
    __shared__ TilePair<D> qd;
    __shared__ float ls[TilePair<D>::STAGES][FA_TILE], dls[TilePair<D>::STAGES][FA_TILE];
    u64 g = blockIdx.x % s.kv_heads, b = blockIdx.x / s.kv_heads, kb = blockIdx.y;
    u64 group = s.heads / s.kv_heads, qstride = s.heads * D, kvstride = s.kv_heads * D;
    int lane = threadIdx.x & 31, gi = lane >> 2, ti = lane & 3;
    u64 row = kb * FA_TILE + (threadIdx.x >> 5) * 16 + gi;  // key rows row, row + 8
    u64 kvoff = kv_at(s, b, 0, g), tiles = (s.t + FA_TILE - 1) / FA_TILE;
    // (32 bits: a 64-bit division is a call, and its frame a spill, in the loop.)
    u32 per_head = (u32)(tiles - kb);
    auto load = [&](u64 i, int st) {
        u64 h = g * group + (u32)i / per_head, qb = kb + (u32)i % per_head;
        u64 qoff = q_at(s, b, 0, h);
        load_pair<D>(qd, st, q + qoff, d_o + qoff, qb * FA_TILE, s.t, qstride);
        for (int c = threadIdx.x; c < FA_TILE; c += FA_WARPS * 32) {
            u64 qi = qb * FA_TILE + c;
            ls[st][c] = qi < s.t ? lse[lse_at(s, b, h, qi)] * FA_LOG2E : 0.0f;
            dls[st][c] = qi < s.t ? delta[lse_at(s, b, h, qi)] : 0.0f;
        }
    };
    load(0, 0);
    u32 ka[D / 16][4], va[D / 16][4];
    load_a<D>(ka, k + kvoff, row, s.t, kvstride);
    load_a<D>(va, v + kvoff, row, s.t, kvstride);
    float dka[D / 8][4] = {}, dva[D / 8][4] = {}, sl = s.scale * FA_LOG2E;
    pipelined<D>(
        group * per_head, load,
        [&](u64 i, int st) {
            float pt[8][4] = {}, dpt[8][4] = {};
            mma_rows<E, D>(pt, ka, qd.a[st]);
            mma_rows<E, D>(dpt, va, qd.b[st]);
            if ((u32)i % per_head == 0) mask_diagonal<true>(pt);  // qb == kb
#pragma unroll
            for (int n = 0; n < 8; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int c = n * 8 + 2 * ti + (e & 1);
                    float p = exp2f(pt[n][e] * sl - ls[st][c]);
                    pt[n][e] = p;
                    dpt[n][e] = p * (dpt[n][e] - dls[st][c]) * s.scale;  // dSᵀ
                }
            mma_cols<E, D>(dva, pt, qd.b[st]);
            mma_cols<E, D>(dka, dpt, qd.a[st]);
        });
    float one[2] = {1.0f, 1.0f};
    store_rows<E, D>(dk + kvoff, dka, row, s.t, kvstride, one);
    store_rows<E, D>(dv + kvoff, dva, row, s.t, kvstride, one);
}

#define FLASH(E, sfx, D)                                                                                  \
    extern "C" __global__ void flash_forward_##D##_##sfx(AttnDims s, const u16* q, const u16* k,          \
                                                         const u16* v, u16* o, float* lse) {              \
        flash_forward_impl<E, D>(s, q, k, v, o, lse);                                                     \
    }                                                                                                     \
    extern "C" __global__ void flash_backward_q_##D##_##sfx(AttnDims s, const u16* q, const u16* k,       \
                                                            const u16* v, const u16* o, const float* lse, \
                                                            const u16* d_o, u16* dq, float* delta) {      \
        flash_backward_q_impl<E, D>(s, q, k, v, o, lse, d_o, dq, delta);                                  \
    }                                                                                                     \
    extern "C" __global__ void flash_backward_kv_##D##_##sfx(AttnDims s, const u16* q, const u16* k,      \
                                                             const u16* v, const float* lse,              \
                                                             const u16* d_o, const float* delta, u16* dk, \
                                                             u16* dv) {                                   \
        flash_backward_kv_impl<E, D>(s, q, k, v, lse, d_o, delta, dk, dv);                                \
    }
#define FLASH_DIMS(E, sfx) FLASH(E, sfx, 64) FLASH(E, sfx, 128)
FLASH_DIMS(BF16, bf16)
FLASH_DIMS(F16, f16)
