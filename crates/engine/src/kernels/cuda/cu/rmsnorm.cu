// RMSNorm (Zhang & Sennrich 2019), as kernels/cpu/rmsnorm.rs: one block per row.

// Each row's loops take eight elements a load where the row, the weight and the output are
// 16-byte aligned (C a multiple of 8, as every model's is; a view at an odd offset goes element
// by element). A thread's share of a sum is then different elements than the element-wise
// loop's, so its rounding differs within f32's: the CPU comparison's band, not its bits.

// The rest of a row's norm once its Σ x² is known (each thread holding its share): rstd saved,
// out = x·rstd·w.
template <typename E>
__device__ void rmsnorm_row_finish(const typename E::T* xr, const typename E::T* w, typename E::T* o, float* rstd,
                                   u64 c, float eps, bool vec, float ss) {
    __shared__ float scratch[32];
    ss = block_sum(ss, scratch);
    float r = rsqrtf(ss / (float)c + eps);
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
    for_each8_in_block(
        c, vec,
        [&](u64 j) {
            float v[8], wv[8];
            Vec8<E>::ld(xr + j, v);
            Vec8<E>::ld(w + j, wv);
#pragma unroll
            for (int e = 0; e < 8; e++) v[e] = v[e] * r * wv[e];
            Vec8<E>::st(o + j, v);
        },
        [&](u64 j) { PUT(E, o, j, GET(E, xr, j) * r * GET(E, w, j)); });
}

// out = x·rstd·w, rstd = 1/sqrt(mean(x²) + eps), saved per row.
template <typename E>
__device__ void rmsnorm_forward_impl(const typename E::T* x, const typename E::T* w, typename E::T* out,
                                     float* rstd, u64 c, float eps) {
    u64 row = blockIdx.x;
    const typename E::T* xr = x + row * c;
    typename E::T* o = out + row * c;
    bool vec = aligned16(xr, w, o);
    float ss = 0.0f;
    each_in_row<E>(xr, c, vec, [&](float v, u64) { ss += v * v; });
    rmsnorm_row_finish<E>(xr, w, o, rstd, c, eps, vec, ss);
}

// resid += x, then the norm of the sum (issue #32: the residual add fused with the norm that
// reads it). The sum is rounded to E as add_inplace rounds it, and squared as stored; each
// thread adds and squares the elements rmsnorm_forward's thread would, in its order, so an
// aligned row gives the two kernels' bits. The finish reads back only what this thread wrote.
template <typename E>
__device__ void add_rmsnorm_forward_impl(typename E::T* resid, const typename E::T* x, const typename E::T* w,
                                         typename E::T* out, float* rstd, u64 c, float eps) {
    u64 row = blockIdx.x;
    typename E::T* rr = resid + row * c;
    const typename E::T* xr = x + row * c;
    typename E::T* o = out + row * c;
    bool vec = aligned16(rr, xr, w, o);
    float ss = 0.0f;
    for_each8_in_block(
        c, vec,
        [&](u64 j) {
            float a[8], b[8];
            Vec8<E>::ld(rr + j, a);
            Vec8<E>::ld(xr + j, b);
#pragma unroll
            for (int e = 0; e < 8; e++) a[e] += b[e];
            Vec8<E>::st(rr + j, a);
            Vec8<E>::ld(rr + j, a);  // as rounded
#pragma unroll
            for (int e = 0; e < 8; e++) ss += a[e] * a[e];
        },
        [&](u64 j) {
            PUT(E, rr, j, GET(E, rr, j) + GET(E, xr, j));
            float v = GET(E, rr, j);
            ss += v * v;
        });
    rmsnorm_row_finish<E>(rr, w, o, rstd, c, eps, vec, ss);
}

// dx (=|+=) rstd·(dy⊙w − x̂·mean(dy⊙w⊙x̂)), x̂ = x·rstd; one block per row.
template <typename E>
__device__ void rmsnorm_backward_input_impl(const typename E::T* dy, const typename E::T* x,
                                            const typename E::T* w, const float* rstd,
                                            typename E::T* dx, u64 c, int accum) {
    __shared__ float scratch[32];
    u64 row = blockIdx.x;
    float r = rstd[row];
    const typename E::T *dyr = dy + row * c, *xr = x + row * c;
    typename E::T* dxr = dx + row * c;
    bool vec = aligned16(dyr, xr, w, dxr);
    float dot = 0.0f;
    for_each8_in_block(
        c, vec,
        [&](u64 j) {
            float d[8], wv[8], v[8];
            Vec8<E>::ld(dyr + j, d);
            Vec8<E>::ld(w + j, wv);
            Vec8<E>::ld(xr + j, v);
#pragma unroll
            for (int e = 0; e < 8; e++) dot += d[e] * wv[e] * v[e] * r;
        },
        [&](u64 j) { dot += GET(E, dyr, j) * GET(E, w, j) * GET(E, xr, j) * r; });
    float mean = block_sum(dot, scratch) / (float)c;
    auto grad = [&](float d, float wj, float xj) { return r * (d * wj - xj * r * mean); };
    for_each8_in_block(
        c, vec,
        [&](u64 j) {
            float d[8], wv[8], v[8], acc[8];
            Vec8<E>::ld(dyr + j, d);
            Vec8<E>::ld(w + j, wv);
            Vec8<E>::ld(xr + j, v);
            if (accum) Vec8<E>::ld(dxr + j, acc);
#pragma unroll
            for (int e = 0; e < 8; e++) {
                float g = grad(d[e], wv[e], v[e]);
                d[e] = accum ? acc[e] + g : g;
            }
            Vec8<E>::st(dxr + j, d);
        },
        [&](u64 j) {
            float g = grad(GET(E, dyr, j), GET(E, w, j), GET(E, xr, j));
            PUT(E, dxr, j, accum ? GET(E, dxr, j) + g : g);
        });
}

// dw += Σ_rows dy⊙x̂ in two passes that fill the GPU (one thread per column over every row
// left most SMs idle: 3 blocks for C = 576, 10% of a SmolLM-135M step on an H200). Pass one:
// block (column block, slice) sums its slice of rows, in order, per column into
// partial[slice][c]; pass two (`column_partials_add`) adds the slices in order. The slices
// depend on n alone (the backend's NORM_SLICES), never on the GPU: deterministic.
template <typename E>
__device__ void rmsnorm_weight_partial_impl(const typename E::T* dy, const typename E::T* x, const float* rstd,
                                            float* partial, u64 n, u64 c, u64 slices) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x, slice = blockIdx.y;
    if (j >= c) return;
    u64 per = (n + slices - 1) / slices, r0 = slice * per, r1 = r0 + per < n ? r0 + per : n;
    float s = 0.0f;
    for (u64 row = r0; row < r1; row++) s += GET(E, dy, row * c + j) * GET(E, x, row * c + j) * rstd[row];
    partial[slice * c + j] = s;
}

// dw[j] += Σ_slices partial[slice][j], slices in order.
template <typename G>
__device__ void column_partials_add_impl(const float* partial, typename G::T* dw, u64 slices, u64 c) {
    FOR_EACH(j, c) {
        float s = 0.0f;
        for (u64 k = 0; k < slices; k++) s += partial[k * c + j];
        PUT(G, dw, j, GET(G, dw, j) + s);
    }
}

#define RMSNORM(E, sfx)                                                                              \
    extern "C" __global__ void rmsnorm_forward_##sfx(const E::T* x, const E::T* w, E::T* out,        \
                                                     float* rstd, u64 c, float eps) {                \
        rmsnorm_forward_impl<E>(x, w, out, rstd, c, eps);                                            \
    }                                                                                                \
    extern "C" __global__ void add_rmsnorm_forward_##sfx(E::T* resid, const E::T* x, const E::T* w,  \
                                                         E::T* out, float* rstd, u64 c, float eps) { \
        add_rmsnorm_forward_impl<E>(resid, x, w, out, rstd, c, eps);                                 \
    }                                                                                                \
    extern "C" __global__ void rmsnorm_backward_input_##sfx(const E::T* dy, const E::T* x,           \
                                                            const E::T* w, const float* rstd,        \
                                                            E::T* dx, u64 c, int accum) {            \
        rmsnorm_backward_input_impl<E>(dy, x, w, rstd, dx, c, accum);                                \
    }                                                                                                  \
    extern "C" __global__ void rmsnorm_weight_partial_##sfx(const E::T* dy, const E::T* x,            \
                                                            const float* rstd, float* partial, u64 n,  \
                                                            u64 c, u64 slices) {                       \
        rmsnorm_weight_partial_impl<E>(dy, x, rstd, partial, n, c, slices);                            \
    }                                                                                                  \
    extern "C" __global__ void column_partials_add_##sfx(const float* partial, E::T* dw, u64 slices,  \
                                                         u64 c) {                                      \
        column_partials_add_impl<E>(partial, dw, slices, c);                                           \
    }
FOR_STORAGE(RMSNORM)
