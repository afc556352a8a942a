// The bias of a linear layer: cuBLASLt's product leaves it out (kernels/cuda/gemm.rs), these
// add it forward and reduce it backward.

// y[r, c] += bias[c].
template <typename E>
__device__ void bias_add_impl(typename E::T* y, const typename E::T* bias, u64 rows, u64 cols) {
    FOR_EACH(i, rows * cols) PUT(E, y, i, GET(E, y, i) + GET(E, bias, i % cols));
}

// dbias[c] += Σ_rows dy[r, c] in two passes that fill the GPU, as RMSNorm's weight gradient
// (rmsnorm.cu): one thread per column over every row ran ⌈cols/256⌉ blocks, 4 for a q bias of
// 896 columns. Pass one: block (column block, slice) sums its slice of rows, in order, into
// partial[slice][c]; pass two (`column_partials_add`) adds the slices in order into dbias.
template <typename E>
__device__ void bias_grad_partial_impl(const typename E::T* dy, float* partial, u64 rows, u64 cols, u64 slices) {
    u64 c = (u64)blockIdx.x * blockDim.x + threadIdx.x, slice = blockIdx.y;
    if (c >= cols) return;
    u64 per = (rows + slices - 1) / slices, r0 = slice * per, r1 = r0 + per < rows ? r0 + per : rows;
    float s = 0.0f;
    for (u64 r = r0; r < r1; r++) s += GET(E, dy, r * cols + c);
    partial[slice * cols + c] = s;
}

#define BIAS(E, sfx)                                                                                 \
    extern "C" __global__ void bias_add_##sfx(E::T* y, const E::T* bias, u64 rows, u64 cols) {       \
        bias_add_impl<E>(y, bias, rows, cols);                                                       \
    }                                                                                                \
    extern "C" __global__ void bias_grad_partial_##sfx(const E::T* dy, float* partial, u64 rows,     \
                                                       u64 cols, u64 slices) {                       \
        bias_grad_partial_impl<E>(dy, partial, rows, cols, slices);                                  \
    }
FOR_STORAGE(BIAS)
