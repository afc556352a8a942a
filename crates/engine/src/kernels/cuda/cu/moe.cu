// Mixture-of-experts routing (kernels/cpu/moe_routing.rs, the reference these follow): the
// router's softmax and top-k, the copies grouped by expert, the weighted sum back per token,
// and their gradients. Every sum runs in the CPU's order, one thread per sum, with products
// and sums rounded separately (__fmul_rn/__fadd_rn: no FMA contraction, which the CPU does
// not do either), so the results are the CPU's bits except where `expf` differs from the
// host's libm (the router's probabilities: within 2 ulp, CUDA C Programming Guide, "Mathematical
// Functions"). Sums that Rust's `Iterator::sum` makes start at -0.0, as it does.
//
// The routed rows' order (kernels/mod.rs `routed_rows`: expert by expert, copies in order
// within an expert) comes from tables built on the host from the router's choices
// (kernels/cuda/backend/moe.rs), as the embedding backward's grouping is:
//   by_row[r]            the copy c (= token·k + j) in routed row r;
//   by_token[2(n·k + j)] the routed row and copy of token n's j-th routed copy, in row order,
//                        ROUTE_NONE past its last (a dropped copy has no row).

#define ROUTE_DROPPED 0x80000000u
#define ROUTE_NONE 0xffffffffu

// One value rounded to storage type E and widened back (the CPU's `S::from_f32(..).to_f32()`).
template <typename E> struct Round;
template <> struct Round<F32> {
    static __device__ __forceinline__ float of(float x) { return x; }
};
template <> struct Round<BF16> {
    static __device__ __forceinline__ float of(float x) { return __uint_as_float(((u32)to_bf16(x)) << 16); }
};
template <> struct Round<F16> {
    static __device__ __forceinline__ float of(float x) { return f16_to_f32(to_f16(x)); }
};

// Per token (one thread): its k largest logits, largest first, ties to the lower expert (the
// CPU's scan: a later expert replaces the best only when strictly larger); their softmax
// probabilities into `weights`, divided by their sum with `norm`; the row's max and Σexp into
// `stats` [tokens, 2] for `router_load`.
extern "C" __global__ void router_topk(const float* logits, float* weights, u32* index, float* stats,
                                       u64 tokens, u64 e, u64 k, int norm) {
    FOR_EACH(n, tokens) {
        const float* row = logits + n * e;
        u32* idx = index + n * k;
        float* w = weights + n * k;
        for (u64 j = 0; j < k; j++) {
            u64 best = ~0ull;
            float best_l = F_INF_NEG;
            for (u64 x = 0; x < e; x++) {
                bool taken = false;
                for (u64 i = 0; i < j; i++) taken |= idx[i] == (u32)x;
                float l = row[x];
                if (!taken && (best == ~0ull || l > best_l)) {
                    best = x;
                    best_l = l;
                }
            }
            idx[j] = (u32)best;
        }
        float max = F_INF_NEG;
        for (u64 x = 0; x < e; x++) max = fmaxf(max, row[x]);
        float sum = -0.0f;
        for (u64 x = 0; x < e; x++) sum = __fadd_rn(sum, expf(row[x] - max));
        float chosen = 0.0f;
        for (u64 j = 0; j < k; j++) {
            w[j] = expf(row[idx[j]] - max) / sum;
            chosen = __fadd_rn(chosen, w[j]);
        }
        if (norm)
            for (u64 j = 0; j < k; j++) w[j] = w[j] / chosen;
        stats[2 * n] = max;
        stats[2 * n + 1] = sum;
    }
}

// Per expert x (one thread): adds Σ_n p[n, x] and the count of copies routed to x, token by
// token, to `load` [2E] (the running sums of earlier layers, in the CPU's order); with
// `has_cap`, marks ROUTE_DROPPED each copy past the `cap`-th one to x in copy order (the
// counts are the router's choices, taken before any drop). A thread rewrites only entries
// equal to its own expert, which other threads read as "not mine" either way.
extern "C" __global__ void router_load(const float* logits, u32* index, const float* stats, float* load,
                                       u64 tokens, u64 e, u64 k, int has_cap, u64 cap) {
    FOR_EACH(x, e) {
        float p = load[x], count = load[e + x];
        u64 taken = 0;
        for (u64 n = 0; n < tokens; n++) {
            p = __fadd_rn(p, expf(logits[n * e + x] - stats[2 * n]) / stats[2 * n + 1]);
            for (u64 j = 0; j < k; j++) {
                u64 c = n * k + j;
                u32 v = index[c];
                if (v != (u32)x) continue;
                count = __fadd_rn(count, 1.0f);
                if (has_cap && taken >= cap)
                    index[c] = v | ROUTE_DROPPED;
                else
                    taken++;
            }
        }
        load[x] = p;
        load[e + x] = count;
    }
}

// d p[x] for the token whose choices are `idx` (marks cleared) and weight gradients `dw`:
// aux_dp[x] plus, for a chosen x, dw_j (through the renormalisation: (dw_j − wdw) / chosen).
__device__ __forceinline__ float router_dp(u64 x, const u32* idx, const float* dw, u64 k, const float* aux_dp,
                                           int norm, float wdw, float chosen) {
    float routed = -0.0f;
    for (u64 j = 0; j < k; j++) {
        if ((idx[j] & ~ROUTE_DROPPED) != (u32)x) continue;
        routed = __fadd_rn(routed, norm ? (dw[j] - wdw) / chosen : dw[j]);
    }
    return __fadd_rn(aux_dp[x], routed);
}

// Per token (one thread): dlogits = p ⊙ (dp − ⟨p, dp⟩), p recomputed from the logits.
extern "C" __global__ void router_backward(const float* logits, const u32* index, const float* dweights,
                                           const float* aux_dp, float* dlogits, u64 tokens, u64 e, u64 k,
                                           int norm) {
    FOR_EACH(n, tokens) {
        const float* row = logits + n * e;
        float* dl = dlogits + n * e;
        const u32* idx = index + n * k;
        const float* dw = dweights + n * k;
        float max = F_INF_NEG;
        for (u64 x = 0; x < e; x++) max = fmaxf(max, row[x]);
        float sum = 0.0f;
        for (u64 x = 0; x < e; x++) {
            float p = expf(row[x] - max);
            dl[x] = p;
            sum = __fadd_rn(sum, p);
        }
        for (u64 x = 0; x < e; x++) dl[x] = dl[x] / sum;
        float chosen = -0.0f;
        for (u64 j = 0; j < k; j++) chosen = __fadd_rn(chosen, dl[idx[j] & ~ROUTE_DROPPED]);
        float wdw = -0.0f;
        for (u64 j = 0; j < k; j++)
            wdw = __fadd_rn(wdw, __fmul_rn(dl[idx[j] & ~ROUTE_DROPPED] / chosen, dw[j]));
        float dot = -0.0f;
        for (u64 x = 0; x < e; x++)
            dot = __fadd_rn(dot, __fmul_rn(dl[x], router_dp(x, idx, dw, k, aux_dp, norm, wdw, chosen)));
        for (u64 x = 0; x < e; x++)
            dl[x] = __fmul_rn(dl[x], router_dp(x, idx, dw, k, aux_dp, norm, wdw, chosen) - dot);
    }
}

// rows[r] = x[token of by_row[r]] (element copies: the CPU's bits).
template <typename E>
__device__ void moe_permute_impl(const u32* by_row, const typename E::T* x, typename E::T* rows, u64 nrows,
                                 u64 w, u64 k) {
    FOR_EACH(i, nrows * w) {
        u64 r = i / w, col = i - r * w;
        rows[i] = x[(by_row[r] / k) * w + col];
    }
}

// y[n] (=|+=) Σ_j weight·rows[row_j] over token n's routed copies in row order, each add
// rounded into E as the CPU's `S::from_f32(o + scale·v)` is; `weights` null: weights of 1.
template <typename E>
__device__ void moe_unpermute_impl(const u32* by_token, const float* weights, const typename E::T* rows,
                                   typename E::T* y, u64 tokens, u64 w, u64 k, int accumulate) {
    FOR_EACH(i, tokens * w) {
        u64 n = i / w, col = i - n * w;
        float acc = accumulate ? GET(E, y, i) : 0.0f;
        for (u64 j = 0; j < k; j++) {
            u32 r = by_token[2 * (n * k + j)], c = by_token[2 * (n * k + j) + 1];
            if (r == ROUTE_NONE) break;
            float scale = weights ? weights[c] : 1.0f;
            acc = Round<E>::of(__fadd_rn(acc, __fmul_rn(scale, GET(E, rows, (u64)r * w + col))));
        }
        PUT(E, y, i, acc);
    }
}

// The entry of routed row r: its copy, or r itself without a table (expert parallelism's rows
// arrive in order, each with its own entry: scale_each_row, dot_each_row).
__device__ __forceinline__ u64 entry_of(const u32* by_row, u64 r) { return by_row ? by_row[r] : r; }

// rows[r] *= weights[by_row[r]].
template <typename E>
__device__ void moe_scale_rows_impl(const u32* by_row, const float* weights, typename E::T* rows, u64 nrows,
                                    u64 w) {
    FOR_EACH(i, nrows * w) {
        u64 r = i / w;
        PUT(E, rows, i, __fmul_rn(GET(E, rows, i), weights[entry_of(by_row, r)]));
    }
}

// out[by_row[r]] = ⟨a[r], b[r]⟩ in f32, in element order (one thread per row).
template <typename E>
__device__ void moe_row_dot_impl(const u32* by_row, const typename E::T* a, const typename E::T* b, float* out,
                                 u64 nrows, u64 w) {
    FOR_EACH(r, nrows) {
        float s = -0.0f;
        for (u64 col = 0; col < w; col++)
            s = __fadd_rn(s, __fmul_rn(GET(E, a, r * w + col), GET(E, b, r * w + col)));
        out[entry_of(by_row, r)] = s;
    }
}

// rows[r] = values[by_row[r]]: each routed copy's value (its routing weight) in row order.
extern "C" __global__ void moe_gather_copies(const u32* by_row, const float* values, float* rows, u64 nrows) {
    FOR_EACH(r, nrows) rows[r] = values[by_row[r]];
}

// values[by_row[r]] = rows[r], the inverse (a dropped copy has no row: its entry stays).
extern "C" __global__ void moe_scatter_copies(const u32* by_row, const float* rows, float* values, u64 nrows) {
    FOR_EACH(r, nrows) values[by_row[r]] = rows[r];
}

#define MOE(E, sfx)                                                                                  \
    extern "C" __global__ void moe_permute_##sfx(const u32* by_row, const E::T* x, E::T* rows,        \
                                                 u64 nrows, u64 w, u64 k) {                          \
        moe_permute_impl<E>(by_row, x, rows, nrows, w, k);                                           \
    }                                                                                                \
    extern "C" __global__ void moe_unpermute_##sfx(const u32* by_token, const float* weights,         \
                                                   const E::T* rows, E::T* y, u64 tokens, u64 w,     \
                                                   u64 k, int accumulate) {                          \
        moe_unpermute_impl<E>(by_token, weights, rows, y, tokens, w, k, accumulate);                 \
    }                                                                                                \
    extern "C" __global__ void moe_scale_rows_##sfx(const u32* by_row, const float* weights,          \
                                                    E::T* rows, u64 nrows, u64 w) {                  \
        moe_scale_rows_impl<E>(by_row, weights, rows, nrows, w);                                     \
    }                                                                                                \
    extern "C" __global__ void moe_row_dot_##sfx(const u32* by_row, const E::T* a, const E::T* b,     \
                                                 float* out, u64 nrows, u64 w) {                     \
        moe_row_dot_impl<E>(by_row, a, b, out, nrows, w);                                            \
    }
FOR_STORAGE(MOE)
