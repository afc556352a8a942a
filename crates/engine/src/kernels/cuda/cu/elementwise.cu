// Elementwise ops (kernels/cpu/elementwise.rs): adds, copies, gradient scaling, the rounding
// of parameters from the f32 master weights, and the squared sum of a gradient buffer.

// out = a + b, eight at a time (`out` may be `a`: add_inplace).
template <typename E>
__device__ void add_impl(const typename E::T* a, const typename E::T* b, typename E::T* out, u64 n) {
    map2<E>(a, b, out, n, [](float x, float y) { return x + y; });
}
template <typename E>
__device__ void add_inplace_impl(typename E::T* acc, const typename E::T* x, u64 n) {
    add_impl<E>(acc, x, acc, n);
}
template <typename E>
__device__ void scale_impl(typename E::T* x, u64 n, float s) {
    FOR_EACH(i, n) PUT(E, x, i, GET(E, x, i) * s);
}
template <typename E>
__device__ void round_params_impl(const float* src, typename E::T* dst, u64 n) {
    FOR_EACH(i, n) PUT(E, dst, i, src[i]);
}
template <typename E>
__device__ void widen_impl(const typename E::T* src, float* dst, u64 n) {
    FOR_EACH(i, n) dst[i] = GET(E, src, i);
}

// Σ x² of each block's part, times `w`, into `partial[blockIdx.x]` (f64), or with `add` added
// to it (a weighted norm over many tensors, `sum_squares_weighted`, read back once); the host
// adds the blocks in order, so the result does not depend on timing. inf/NaN propagate (the
// overflow check).
template <typename E>
__device__ void sum_squares_impl(const typename E::T* x, u64 n, double* partial, double w, int add) {
    __shared__ double scratch[32];
    // Four independent sums a thread, so four loads are in flight rather than one chain of
    // dependent f64 adds (one sum ran at 360 GB/s over a 1B model's gradients on an H200).
    // The grid is fixed (SUM_BLOCKS): which element goes to which sum depends on n alone.
    double a[4] = {0.0, 0.0, 0.0, 0.0};
    u64 stride = (u64)gridDim.x * blockDim.x, i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride)
#pragma unroll
        for (int k = 0; k < 4; k++) {
            double v = (double)GET(E, x, i + k * stride);
            a[k] += v * v;
        }
    for (; i < n; i += stride) {
        double v = (double)GET(E, x, i);
        a[0] += v * v;
    }
    double s = (a[0] + a[1]) + (a[2] + a[3]);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    s = warp_sum_f64(s);
    if (lane == 0) scratch[warp] = s;
    __syncthreads();
    if (warp == 0) {
        s = lane < warps ? scratch[lane] : 0.0;
        s = warp_sum_f64(s);
        if (lane == 0) partial[blockIdx.x] = (add ? partial[blockIdx.x] : 0.0) + w * s;
    }
}

#define ELEMENTWISE(E, sfx)                                                                         \
    extern "C" __global__ void add_##sfx(const E::T* a, const E::T* b, E::T* out, u64 n) {           \
        add_impl<E>(a, b, out, n);                                                                  \
    }                                                                                               \
    extern "C" __global__ void add_inplace_##sfx(E::T* acc, const E::T* x, u64 n) {                 \
        add_inplace_impl<E>(acc, x, n);                                                             \
    }                                                                                               \
    extern "C" __global__ void scale_##sfx(E::T* x, u64 n, float s) { scale_impl<E>(x, n, s); }     \
    extern "C" __global__ void round_params_##sfx(const float* src, E::T* dst, u64 n) {             \
        round_params_impl<E>(src, dst, n);                                                          \
    }                                                                                               \
    extern "C" __global__ void widen_##sfx(const E::T* src, float* dst, u64 n) { widen_impl<E>(src, dst, n); } \
    extern "C" __global__ void sum_squares_##sfx(const E::T* x, u64 n, double* partial) {           \
        sum_squares_impl<E>(x, n, partial, 1.0, 0);                                                 \
    }                                                                                               \
    extern "C" __global__ void sum_squares_add_##sfx(const E::T* x, u64 n, double* partial, double w, \
                                                     int add) {                                     \
        sum_squares_impl<E>(x, n, partial, w, add);                                                 \
    }
FOR_STORAGE(ELEMENTWISE)

// How many targets the loss counts (those below `vocab`): integer adds, exact in any order.
extern "C" __global__ void count_targets(const u32* targets, u64 n, u32 vocab, u64* count) {
    u64 c = 0;
    FOR_EACH(i, n) c += targets[i] < vocab;
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0 && c) atomicAdd(count, c);
}
