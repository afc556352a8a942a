// RMSNorm (Zhang & Sennrich 2019), as kernels/cpu/rmsnorm.rs: one block per row.

// out = x·rstd·w, rstd = 1/sqrt(mean(x²) + eps), saved per row.
template <typename E>
__device__ void rmsnorm_forward_impl(const typename E::T* x, const typename E::T* w, typename E::T* out,
                                     float* rstd, u64 c, float eps) {
    __shared__ float scratch[32];
    u64 row = blockIdx.x;
    const typename E::T* xr = x + row * c;
    float ss = 0.0f;
    for (u64 j = threadIdx.x; j < c; j += blockDim.x) {
        float v = GET(E, xr, j);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    float r = rsqrtf(ss / (float)c + eps);
    if (threadIdx.x == 0) rstd[row] = r;
    for (u64 j = threadIdx.x; j < c; j += blockDim.x)
        PUT(E, out, row * c + j, GET(E, xr, j) * r * GET(E, w, j));
}

// dx (=|+=) rstd·(dy⊙w − x̂·mean(dy⊙w⊙x̂)), x̂ = x·rstd; one block per row.
template <typename E>
__device__ void rmsnorm_backward_input_impl(const typename E::T* dy, const typename E::T* x,
                                            const typename E::T* w, const float* rstd,
                                            typename E::T* dx, u64 c, int accum) {
    __shared__ float scratch[32];
    u64 row = blockIdx.x;
    float r = rstd[row];
    float dot = 0.0f;
    for (u64 j = threadIdx.x; j < c; j += blockDim.x)
        dot += GET(E, dy, row * c + j) * GET(E, w, j) * GET(E, x, row * c + j) * r;
    float mean = block_sum(dot, scratch) / (float)c;
    for (u64 j = threadIdx.x; j < c; j += blockDim.x) {
        u64 i = row * c + j;
        float xh = GET(E, x, i) * r;
        float g = r * (GET(E, dy, i) * GET(E, w, j) - xh * mean);
        PUT(E, dx, i, accum ? GET(E, dx, i) + g : g);
    }
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
