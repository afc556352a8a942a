// Vocabulary-parallel cross-entropy (kernels/cpu/vocab_parallel_ce.rs; Megatron-LM's
// `_VocabParallelCrossEntropy`, Shoeybi et al. 2019 §3) on the device: each tensor-parallel
// rank holds the logits of its slice of the vocabulary, and the logits are never gathered.
// One block per row, as `cross_entropy` (cross_entropy.cu, whose online softmax it shares).

// First half: per row of this rank's logits, its max m, Σ exp(z − m) and the target's logit
// when this rank holds it (else 0) into `stats[row]` (three f32); with `keep`, the logits
// become exp(z − m), which the second half turns into the gradient.
extern "C" __global__ void ce_shard_stats(float* logits, const u32* targets, float* stats, u64 vocab,
                                          u64 first, int keep) {
    __shared__ float scratch[32];
    u64 row = blockIdx.x, t = targets[row];
    float* z = logits + row * vocab;
    bool vec = aligned16(z);
    float m = F_INF_NEG, sum = 0.0f;
    each_in_row<F32>(z, vocab, vec, [&](float x, u64) { softmax_add(m, sum, x); });
    float mx = block_max(m, scratch);
    sum = block_sum(m > F_INF_NEG ? sum * expf(m - mx) : 0.0f, scratch);
    float zt = t >= first && t - first < vocab ? z[t - first] : 0.0f;
    __syncthreads();  // every thread has read z[t] before it is overwritten
    if (threadIdx.x == 0) {
        stats[row * 3] = mx;
        stats[row * 3 + 1] = sum;
        stats[row * 3 + 2] = zt;
    }
    if (keep) map_row<F32>(z, vocab, vec, [&](float x, u64) { return expf(x - mx); });
}

// Second half, from every rank's statistics gathered in rank order (`all`: [ranks, rows, 3];
// this rank is `rank`): with M = max m_r and S = Σ s_r·exp(m_r − M) in rank order (the same
// bits on every rank), the loss ln S + M − z_t (0 for a target ≥ full_vocab, which is
// ignored) and, with a gradient, the kept exponentials times scale·exp(m_rank − M)/S, less
// scale at the target's column: (softmax − onehot)·scale. Products and sums rounded each on
// their own (no FMA contraction), as the CPU computes them.
extern "C" __global__ void ce_shard_finish(float* logits, const u32* targets, const float* all, u64 rows,
                                           u64 ranks, u64 rank, float* losses, u64 vocab, u64 first,
                                           u64 full_vocab, int with_grad, float scale) {
    u64 row = blockIdx.x, t = targets[row];
    float* z = logits + row * vocab;
    bool vec = aligned16(z);
    if (t >= full_vocab) {
        if (threadIdx.x == 0) losses[row] = 0.0f;
        if (with_grad) map_row<F32>(z, vocab, vec, [&](float, u64) { return 0.0f; });
        return;
    }
    const float* st = all + row * 3;
    u64 step = rows * 3;
    float mx = F_INF_NEG, sum = 0.0f, zt = 0.0f;
    for (u64 r = 0; r < ranks; r++) mx = fmaxf(mx, st[r * step]);
    for (u64 r = 0; r < ranks; r++) {
        sum = __fadd_rn(sum, __fmul_rn(st[r * step + 1], expf(st[r * step] - mx)));
        zt = __fadd_rn(zt, st[r * step + 2]);
    }
    if (threadIdx.x == 0) losses[row] = logf(sum) + mx - zt;
    if (with_grad) {
        float k = __fmul_rn(scale, expf(st[rank * step] - mx)) / sum;
        u64 tl = t >= first && t - first < vocab ? t - first : vocab;
        map_row<F32>(z, vocab, vec, [&](float x, u64 j) {
            float g = __fmul_rn(x, k);
            return j == tl ? g - scale : g;
        });
    }
}
