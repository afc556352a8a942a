// Softmax + cross-entropy fused over a chunk of f32 logit rows (kernels/cpu/cross_entropy.rs):
// loss_r = logsumexp(z_r) − z_r[t_r]; with a gradient, z_r becomes s·(softmax(z_r) − onehot(t_r)).
// A target ≥ vocab is ignored: loss 0, gradient row 0. One block per row; the host adds the
// losses in row order (f64), as the CPU does, so the sum is reproducible.
extern "C" __global__ void cross_entropy(float* logits, const u32* targets, float* losses, u64 vocab,
                                         int with_grad, float scale) {
    __shared__ float scratch[32];
    u64 row = blockIdx.x;
    float* z = logits + row * vocab;
    u32 t = targets[row];
    if (t >= vocab) {
        if (threadIdx.x == 0) losses[row] = 0.0f;
        if (with_grad)
            for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) z[j] = 0.0f;
        return;
    }
    float mx = F_INF_NEG;
    for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) mx = fmaxf(mx, z[j]);
    mx = block_max(mx, scratch);
    float sum = 0.0f;
    for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) sum += expf(z[j] - mx);
    sum = block_sum(sum, scratch);
    float zt = z[t];
    __syncthreads();  // every thread has read z[t] before it is overwritten
    if (threadIdx.x == 0) losses[row] = logf(sum) + mx - zt;
    if (with_grad) {
        float k = scale / sum;
        for (u64 j = threadIdx.x; j < vocab; j += blockDim.x) z[j] = expf(z[j] - mx) * k - (j == t ? scale : 0.0f);
    }
}

// The step's loss sum kept on the device (issue #32: no read-back per chunk), in `acc`, read
// once with the gradient norm (`Kernels::take_loss`). A chunk's row losses are summed in row
// order in f64 and then added, as the CPU sums them: one thread, deterministic.
extern "C" __global__ void loss_accumulate(const float* losses, u64 rows, double* acc) {
    double s = 0.0;
    for (u64 r = 0; r < rows; r++) s += (double)losses[r];
    acc[0] += s;
}
extern "C" __global__ void loss_reset(double* acc) { acc[0] = 0.0; }
