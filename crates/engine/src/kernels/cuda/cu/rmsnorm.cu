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

// dw += Σ_rows dy⊙x̂: one thread per column, rows in order (deterministic, coalesced).
template <typename E, typename G>
__device__ void rmsnorm_backward_weight_impl(const typename E::T* dy, const typename E::T* x,
                                             const float* rstd, typename G::T* dw, u64 n, u64 c) {
    u64 j = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= c) return;
    float s = 0.0f;
    for (u64 row = 0; row < n; row++) s += GET(E, dy, row * c + j) * GET(E, x, row * c + j) * rstd[row];
    PUT(G, dw, j, GET(G, dw, j) + s);
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
    }
FOR_STORAGE(RMSNORM)

// Parameter gradients are stored as G: f32, or the storage type itself (kernels/mod.rs).
#define RMSNORM_WEIGHT(E, G, sfx)                                                                    \
    extern "C" __global__ void rmsnorm_backward_weight_##sfx(const E::T* dy, const E::T* x,          \
                                                             const float* rstd, G::T* dw, u64 n,     \
                                                             u64 c) {                                \
        rmsnorm_backward_weight_impl<E, G>(dy, x, rstd, dw, n, c);                                   \
    }
FOR_GRADS(RMSNORM_WEIGHT)
