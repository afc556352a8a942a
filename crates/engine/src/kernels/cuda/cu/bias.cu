// The bias of a linear layer: cuBLASLt's product leaves it out (kernels/cuda/gemm.rs), these
// add it forward and reduce it backward.

// y[r, c] += bias[c].
template <typename E>
__device__ void bias_add_impl(typename E::T* y, const typename E::T* bias, u64 rows, u64 cols) {
    FOR_EACH(i, rows * cols) PUT(E, y, i, GET(E, y, i) + GET(E, bias, i % cols));
}

// dbias[c] += Σ_rows dy[r, c]: one thread per column, rows in order.
template <typename E, typename G>
__device__ void bias_grad_impl(const typename E::T* dy, typename G::T* dbias, u64 rows, u64 cols) {
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= cols) return;
    float s = 0.0f;
    for (u64 r = 0; r < rows; r++) s += GET(E, dy, r * cols + c);
    PUT(G, dbias, c, GET(G, dbias, c) + s);
}

#define BIAS(E, sfx)                                                                                 \
    extern "C" __global__ void bias_add_##sfx(E::T* y, const E::T* bias, u64 rows, u64 cols) {       \
        bias_add_impl<E>(y, bias, rows, cols);                                                       \
    }
FOR_STORAGE(BIAS)
#define BIAS_GRAD(E, G, sfx)                                                                         \
    extern "C" __global__ void bias_grad_##sfx(const E::T* dy, G::T* dbias, u64 rows, u64 cols) {    \
        bias_grad_impl<E, G>(dy, dbias, rows, cols);                                                 \
    }
FOR_GRADS(BIAS_GRAD)
