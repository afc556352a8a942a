// Token embedding (kernels/cpu/embedding.rs), whole table or a vocabulary shard holding rows
// first..first + rows (a token outside it gets a zero row forward and is another rank's
// backward).

template <typename E>
__device__ void embedding_forward_impl(const u32* tokens, const typename E::T* wte, typename E::T* out,
                                       u64 n, u64 c, u64 first, u64 rows) {
    FOR_EACH(k, n * c) {
        u64 row = k / c, j = k % c;
        u64 t = tokens[row];
        bool mine = t >= first && t - first < rows;
        PUT(E, out, k, mine ? GET(E, wte, (t - first) * c + j) : 0.0f);
    }
}

// dwte[t − first] += Σ dout[n] over the positions n of token t, summed in f32 first and
// rounded into G once (as the CPU does). The positions come grouped by token: `order` lists
// them, distinct token k owning order[starts[k] .. starts[k + 1]] and being tokens[order[starts[k]]]
// (built on the host from the token ids: kernels/cuda/backend/host_ids.rs). One block per
// position, the first blocks each a distinct token's, the rest (empty groups: starts[k] =
// starts[k + 1] = n) returning at once, so the launch does not depend on the tokens; threads
// over columns, positions in order: deterministic, no atomics.
template <typename E, typename G>
__device__ void embedding_backward_impl(const u32* tokens, const u32* order, const u32* starts,
                                        const typename E::T* dout, typename G::T* dwte, u64 c, u64 first,
                                        u64 rows) {
    u32 k = blockIdx.x;
    u32 s0 = starts[k], s1 = starts[k + 1];
    if (s0 == s1) return;
    u64 t = tokens[order[s0]];
    if (t < first || t - first >= rows) return;
    for (u64 j = threadIdx.x; j < c; j += blockDim.x) {
        float s = 0.0f;
        for (u32 p = s0; p < s1; p++) s += GET(E, dout, (u64)order[p] * c + j);
        u64 i = (t - first) * c + j;
        PUT(G, dwte, i, GET(G, dwte, i) + s);
    }
}

#define EMBEDDING(E, sfx)                                                                            \
    extern "C" __global__ void embedding_forward_##sfx(const u32* tokens, const E::T* wte,           \
                                                       E::T* out, u64 n, u64 c, u64 first,           \
                                                       u64 rows) {                                   \
        embedding_forward_impl<E>(tokens, wte, out, n, c, first, rows);                              \
    }
FOR_STORAGE(EMBEDDING)
#define EMBEDDING_BACKWARD(E, G, sfx)                                                                \
    extern "C" __global__ void embedding_backward_##sfx(const u32* tokens, const u32* order,         \
                                                        const u32* starts, const E::T* dout,         \
                                                        G::T* dwte, u64 c, u64 first, u64 rows) {    \
        embedding_backward_impl<E, G>(tokens, order, starts, dout, dwte, c, first, rows);            \
    }
FOR_GRADS(EMBEDDING_BACKWARD)
