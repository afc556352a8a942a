// The CUDA emulator's device side: what a kernel of the CUDA backend (`src/kernels/cuda/cu/`)
// needs from CUDA to compile with g++ and run on the host, one block at a time, each of its
// threads a fiber (ucontext) on the calling OS thread.
//
// Why fibers and not loops: the kernels synchronise (`__syncthreads`, warp shuffles), so a
// thread must be able to stop half-way and let the others of its block (or warp) catch up.
// The scheduler runs every ready fiber until it finishes or waits, then releases the barriers
// whose participants have all arrived. It is also a checker, which is why the emulator is
// worth its lines: it refuses what CUDA leaves undefined instead of doing something plausible
//   - a barrier that can never be released (some threads at `__syncthreads`, others at a
//     warp shuffle): "deadlock", with who waits where; and a `__syncthreads` reached by part
//     of a warp whose other lanes returned (a warp that returned whole no longer counts, as on
//     the hardware);
//   - a shuffle whose mask names a lane that has returned;
//   - a launch with an empty grid (CUDA: CUDA_ERROR_INVALID_VALUE), more than 1024 threads
//     per block, or dynamic shared memory (no kernel of the backend uses it).
// Device memory is host memory (the driver emulator's `cuMemAlloc` is `aligned_alloc`), so a
// device pointer is dereferenced as it is.
//
// Not emulated: concurrency between blocks (they run in order), the memory model (a missing
// `__syncthreads` between a write and another thread's read is caught only when the order in
// which fibers run exposes it), PTX, and the GPU's own rounding of `expf`/`logf` (the host's
// libm is used; the tests' tolerances cover ulps).
//
// Compiled into every kernel library the emulator builds (`compile.hpp`): header only, and
// every piece of state is per OS thread, so ranks that launch from several threads at once
// each run their own blocks.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <ucontext.h>
#include <utility>
#include <vector>

#define FERROTRON_CUDA_EMU 1
#define __device__
#define __forceinline__ inline
// One block runs at a time on a thread: a thread-local static is the block's shared memory.
#define __shared__ static thread_local

struct dim3 {
    unsigned x, y, z;
};

namespace emu {

// Switching between fibers. On x86-64, the six callee-saved registers pushed on the fiber's
// own stack (no kernel changes the FP control words, so they are not switched): ucontext's
// `swapcontext` also saves the signal mask with a system call on every switch, which made a
// training step spend most of its time in the kernel. Elsewhere, ucontext.
#if defined(__x86_64__)
struct Context {
    void* sp;
};
extern "C" void ferrotron_emu_switch(void** save, void* load) __attribute__((visibility("hidden")));
asm(R"(
    .text
    .p2align 4
ferrotron_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
inline void switch_to(Context& save, Context& load) { ferrotron_emu_switch(&save.sp, load.sp); }
/// A context that starts `entry` (which never returns) on `stack`.
inline void start(Context& c, std::vector<char>& stack, void (*entry)(), Context&) {
    uintptr_t top = ((uintptr_t)(stack.data() + stack.size())) & ~(uintptr_t)15;
    // After the `ret` into `entry`, rsp = top - 8: a call's alignment at a function's entry.
    void** slot = (void**)(top - 16);
    slot[0] = (void*)entry;
    slot -= 6;
    for (int i = 0; i < 6; i++) slot[i] = nullptr;  // r15 … rbp
    c.sp = slot;
}
#else
struct Context {
    ucontext_t uc;
};
inline void switch_to(Context& save, Context& load) { swapcontext(&save.uc, &load.uc); }
inline void start(Context& c, std::vector<char>& stack, void (*entry)(), Context& back) {
    getcontext(&c.uc);
    c.uc.uc_stack.ss_sp = stack.data();
    c.uc.uc_stack.ss_size = stack.size();
    c.uc.uc_link = &back.uc;
    makecontext(&c.uc, entry, 0);
}
#endif

/// What a fiber is doing when the scheduler looks at it.
enum class State { Ready, AtSyncthreads, AtShuffle, Done };

struct Fiber {
    Context ctx;
    dim3 tid;
    State state;
    // A shuffle in progress: this lane's value, the lane it reads, the lanes taking part,
    // and (once released) what it got.
    uint64_t value, result;
    unsigned src, mask;
};

/// The block being run on this OS thread.
struct Block {
    dim3 idx, dim, grid;
    const char* kernel;
    Fiber* cur;
    std::vector<Fiber>& fibers;
    Context scheduler;
    void (*body)(void**);
    void** params;
};

inline thread_local Block* block = nullptr;
/// The fibers of the blocks run on this OS thread, kept from launch to launch.
inline thread_local std::vector<Fiber> fibers;
/// Fiber stacks, kept from launch to launch on this OS thread.
inline thread_local std::vector<std::vector<char>> stacks;
constexpr size_t STACK_BYTES = 64 << 10;

inline void wait(State s) {
    Fiber* f = block->cur;
    f->state = s;
    switch_to(f->ctx, block->scheduler);
}

template <class T>
inline T shuffle(unsigned mask, T v, unsigned src) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 8 bytes");
    Fiber* f = block->cur;
    f->value = 0;
    std::memcpy(&f->value, &v, sizeof(T));
    f->src = src;
    f->mask = mask;
    wait(State::AtShuffle);
    T out;
    std::memcpy(&out, &f->result, sizeof(T));
    return out;
}

inline unsigned lane() {
    return block->cur->tid.x & 31;  // every launch of the backend is one-dimensional
}

}  // namespace emu

#define threadIdx (emu::block->cur->tid)
#define blockIdx (emu::block->idx)
#define blockDim (emu::block->dim)
#define gridDim (emu::block->grid)

inline void __syncthreads() { emu::wait(emu::State::AtSyncthreads); }
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int m) {
    return emu::shuffle(mask, v, emu::lane() ^ (unsigned)m);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d) {
    unsigned l = emu::lane();
    return emu::shuffle(mask, v, l + d < 32 ? l + d : l);
}
template <class T>
inline T __shfl_sync(unsigned mask, T v, int src) {
    return emu::shuffle(mask, v, (unsigned)src & 31);
}

namespace emu {
/// What CUDA leaves undefined and a thread did (a misaligned `ldmatrix` row): the launch
/// fails with it once the block has run.
inline thread_local const char* fault = nullptr;

/// A 16-byte access (a vector load or store, an `ldmatrix` row) must be 16-byte aligned.
inline void aligned16(const void* p) {
    if (reinterpret_cast<uintptr_t>(p) & 15) fault = "a 16-byte access at an address not 16-byte aligned";
}

/// Each lane's operands of a warp-wide `mma_16816` or `ldmatrix_x4`, by thread index.
inline thread_local const void* warp_operands[1024];
/// Every lane of the caller's warp arrives before any goes on: a shuffle with the full mask.
inline void warp_barrier() { (void)shuffle(0xffffffffu, 0u, lane()); }
inline float bf16_to_f32(unsigned short h) {
    unsigned u = (unsigned)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32` for the caller's warp:
/// c += A·B, with the fragments of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with
/// floating point type"; g = lane / 4, t = lane % 4, the lower column in a register's low
/// half): A a0 (g, 2t), a1 (g+8, 2t), a2 (g, 2t+8), a3 (g+8, 2t+8); B b0 (k 2t, n g),
/// b1 (k 2t+8, n g); C c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1). Every lane must take
/// part (`.aligned`): one that has returned is the shuffle's deadlock. Products and sums in
/// f32, k in order (the hardware's order and internal precision are its own; the tests'
/// tolerances cover both).
inline void mma_16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1,
                      float (*widen)(unsigned short)) {
    struct Operands {
        unsigned a[4], b[2];
    } mine{{a[0], a[1], a[2], a[3]}, {b0, b1}};
    unsigned me = block->cur->tid.x, base = me & ~31u;
    warp_operands[me] = &mine;
    warp_barrier();
    float A[16][16], B[16][8];
    for (unsigned l = 0; l < 32; l++) {
        const Operands* x = static_cast<const Operands*>(warp_operands[base + l]);
        unsigned g = l >> 2, t = l & 3;
        for (unsigned r = 0; r < 4; r++) {
            unsigned row = g + 8 * (r & 1), col = 2 * t + 8 * (r >> 1);
            A[row][col] = widen((unsigned short)(x->a[r] & 0xffff));
            A[row][col + 1] = widen((unsigned short)(x->a[r] >> 16));
        }
        for (unsigned r = 0; r < 2; r++) {
            unsigned k = 2 * t + 8 * r;
            B[k][g] = widen((unsigned short)(x->b[r] & 0xffff));
            B[k + 1][g] = widen((unsigned short)(x->b[r] >> 16));
        }
    }
    // Every lane has read the others' operands before any goes on to overwrite its own.
    warp_barrier();
    unsigned g = (me & 31) >> 2, t = me & 3;
    for (unsigned e = 0; e < 4; e++) {
        unsigned row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
        float acc = c[e];
        for (unsigned k = 0; k < 16; k++) acc += A[row][k] * B[k][col];
        c[e] = acc;
    }
}

/// `ldmatrix.sync.aligned.m8n8.x4(.trans).shared.b16` for the caller's warp (PTX ISA,
/// "Warp-level matrix load instruction: ldmatrix"): row r of matrix j is 8 16-bit elements at
/// the address lane 8j + r gives, 16-byte aligned; register j of lane L gets matrix j's row
/// L/4, elements 2(L%4) (low half) and 2(L%4)+1, or with `trans` its column L/4, rows 2(L%4)
/// (low) and 2(L%4)+1.
inline void ldmatrix_x4(unsigned (&r)[4], const void* row, bool trans) {
    unsigned me = block->cur->tid.x, base = me & ~31u, l = me & 31;
    aligned16(row);
    warp_operands[me] = row;
    warp_barrier();
    auto at = [&](unsigned lane, unsigned e) {
        unsigned short h;
        std::memcpy(&h, static_cast<const char*>(warp_operands[base + lane]) + 2 * e, 2);
        return (unsigned)h;
    };
    for (unsigned j = 0; j < 4; j++) {
        unsigned lo, hi;
        if (trans) {
            lo = at(8 * j + 2 * (l % 4), l / 4);
            hi = at(8 * j + 2 * (l % 4) + 1, l / 4);
        } else {
            lo = at(8 * j + l / 4, 2 * (l % 4));
            hi = at(8 * j + l / 4, 2 * (l % 4) + 1);
        }
        r[j] = lo | (hi << 16);
    }
    // Every lane has read the others' addresses before any goes on to replace its own.
    warp_barrier();
}
}  // namespace emu

// One OS thread runs the whole grid, so the atomics need no atomicity.
template <class T>
inline T atomicAdd(T* p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}
template <class T>
inline T atomicMax(T* p, T v) {
    T old = *p;
    *p = old > v ? old : v;
    return old;
}

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline int __float_as_int(float f) { return (int)__float_as_uint(f); }
// Separately rounded, never contracted (the library is built with -ffp-contract=off).
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// The 16-bit conversions the kernels write as PTX `cvt` (common.cuh): round to nearest even.
namespace emu {
inline unsigned short f32_to_bf16(float x) {
    unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1);
    return (unsigned short)(u >> 16);
}
inline float f16_to_f32(unsigned short h) {
    unsigned sign = (unsigned)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {  // subnormal (or zero): man · 2^-24, exact in f32
        float f = (float)man * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    return __uint_as_float(sign | ((exp + 112) << 23) | (man << 13));
}
inline unsigned short f32_to_f16(float x) {
    unsigned u = __float_as_uint(x), sign = (u >> 16) & 0x8000;
    unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return (unsigned short)(sign | 0x7e00);  // NaN
    if (a >= 0x477ff000u) return (unsigned short)(sign | 0x7c00);  // rounds to ±inf
    if (a < 0x38800000u) {  // below the smallest normal: a multiple of 2^-24, rounded RNE
        float q = std::nearbyint(__uint_as_float(a) * 16777216.0f);  // default mode: to even
        return (unsigned short)(sign | (unsigned)q);
    }
    unsigned r = a + 0xfffu + ((a >> 13) & 1);  // RNE on the 13 dropped bits
    return (unsigned short)(sign | ((r - 0x38000000u) >> 13));
}

/// The geometry of one launch, as `cuLaunchKernel` received it.
struct Launch {
    unsigned grid[3], block[3], shared_bytes;
};

/// A fiber's whole life: the kernel's body, then back to the scheduler for good.
inline void fiber_main() {
    Block* b = block;
    b->body(b->params);
    b->cur->state = State::Done;
    switch_to(b->cur->ctx, b->scheduler);
}

/// Says why a block cannot go on, naming the kernel, the block and where its threads wait.
inline int deadlock(const Block& b, const char* why) {
    int at_sync = 0, at_shfl = 0, done = 0;
    for (const Fiber& f : b.fibers) {
        at_sync += f.state == State::AtSyncthreads;
        at_shfl += f.state == State::AtShuffle;
        done += f.state == State::Done;
    }
    std::fprintf(stderr,
                 "cuda emulator: %s in kernel %s, block (%u,%u,%u): %d threads at "
                 "__syncthreads, %d at a warp shuffle, %d returned, of %zu\n",
                 why, b.kernel, b.idx.x, b.idx.y, b.idx.z, at_sync, at_shfl, done, b.fibers.size());
    return 1;
}

/// Releases warp `w`'s shuffle if every lane its mask names has arrived: 1 released, 0 not
/// yet, -1 never (a named lane has returned, or the lanes disagree on the mask).
inline int release_shuffle(Block& b, size_t w) {
    size_t first = w * 32, last = first + 32 < b.fibers.size() ? first + 32 : b.fibers.size();
    unsigned mask = 0;
    bool any = false;
    for (size_t i = first; i < last; i++) {
        if (b.fibers[i].state != State::AtShuffle) continue;
        if (any && b.fibers[i].mask != mask) return -1;
        mask = b.fibers[i].mask;
        any = true;
    }
    if (!any) return 0;
    for (size_t i = first; i < last; i++) {
        if (!(mask >> (i - first) & 1)) continue;
        if (b.fibers[i].state == State::Done) return -1;
        if (b.fibers[i].state != State::AtShuffle) return 0;
    }
    for (size_t i = first; i < last; i++) {
        Fiber& f = b.fibers[i];
        if (!(mask >> (i - first) & 1)) continue;
        size_t s = first + f.src;
        f.result = (f.src < 32 && s < last && (mask >> f.src & 1)) ? b.fibers[s].value : f.value;
        f.state = State::Ready;
    }
    return 1;
}

/// Runs one block to the end: 0, or 1 after saying why it cannot finish.
inline int run_block(Block& b) {
    size_t n = b.fibers.size();
    while (stacks.size() < n) stacks.emplace_back(STACK_BYTES);
    for (size_t i = 0; i < n; i++) {
        Fiber& f = b.fibers[i];
        f.tid = dim3{(unsigned)(i % b.dim.x), (unsigned)(i / b.dim.x % b.dim.y),
                     (unsigned)(i / (b.dim.x * b.dim.y))};
        f.state = State::Ready;
        start(f.ctx, stacks[i], fiber_main, b.scheduler);
    }
    for (;;) {
        // Each warp runs until none of its lanes can go on, its shuffles released as soon as
        // its lanes have all arrived: a shuffle costs a pass over 32 lanes, not the block.
        for (size_t w = 0; w * 32 < n; w++) {
            size_t first = w * 32, last = first + 32 < n ? first + 32 : n;
            for (int r = 1; r > 0;) {
                for (size_t i = first; i < last; i++) {
                    Fiber& f = b.fibers[i];
                    if (f.state != State::Ready) continue;
                    b.cur = &f;
                    switch_to(b.scheduler, f.ctx);
                }
                r = release_shuffle(b, w);
                if (r < 0) return deadlock(b, "a warp shuffle names a lane that returned or disagrees on its mask");
            }
        }
        size_t done = 0, at_sync = 0;
        for (const Fiber& f : b.fibers) {
            done += f.state == State::Done;
            at_sync += f.state == State::AtSyncthreads;
        }
        if (done == n) return 0;
        // A warp that has returned whole no longer counts at the barrier (as the hardware's
        // arrival count does); one that returned in part while the rest waits is undefined.
        for (size_t w = 0; at_sync && w * 32 < n; w++) {
            bool waits = false, left = false;
            for (size_t i = w * 32; i < n && i < w * 32 + 32; i++) {
                waits |= b.fibers[i].state == State::AtSyncthreads;
                left |= b.fibers[i].state == State::Done;
            }
            if (waits && left) return deadlock(b, "__syncthreads after part of a warp returned");
        }
        if (at_sync + done == n) {
            for (Fiber& f : b.fibers)
                if (f.state == State::AtSyncthreads) f.state = State::Ready;
            continue;
        }
        return deadlock(b, "deadlock");
    }
}

/// Runs a grid of `body` (one kernel, its parameters unpacked from `params`): 0, or 1 after
/// saying on stderr why the launch failed.
inline int launch(const Launch* l, const char* kernel, void (*body)(void**), void** params) {
    unsigned threads = l->block[0] * l->block[1] * l->block[2];
    if (l->grid[0] == 0 || l->grid[1] == 0 || l->grid[2] == 0 || threads == 0) {
        std::fprintf(stderr,
                     "cuda emulator: kernel %s launched with an empty grid (%u,%u,%u) x (%u,%u,%u): "
                     "CUDA refuses it (CUDA_ERROR_INVALID_VALUE)\n",
                     kernel, l->grid[0], l->grid[1], l->grid[2], l->block[0], l->block[1], l->block[2]);
        return 1;
    }
    if (threads > 1024 || l->grid[1] > 65535 || l->grid[2] > 65535) {
        std::fprintf(stderr, "cuda emulator: kernel %s: %u threads per block or grid (%u,%u,%u) over CUDA's limits\n",
                     kernel, threads, l->grid[0], l->grid[1], l->grid[2]);
        return 1;
    }
    if (l->shared_bytes) {
        std::fprintf(stderr, "cuda emulator: kernel %s asks for %u bytes of dynamic shared memory, which the emulator does not provide\n",
                     kernel, l->shared_bytes);
        return 1;
    }
    fibers.resize(threads);
    Block b{{}, {l->block[0], l->block[1], l->block[2]}, {l->grid[0], l->grid[1], l->grid[2]},
            kernel, nullptr, fibers, {}, body, params};
    Block* outer = block;
    block = &b;
    int rc = 0;
    for (unsigned z = 0; z < b.grid.z && !rc; z++)
        for (unsigned y = 0; y < b.grid.y && !rc; y++)
            for (unsigned x = 0; x < b.grid.x && !rc; x++) {
                b.idx = dim3{x, y, z};
                rc = run_block(b);
                if (!rc && fault) {
                    std::fprintf(stderr, "cuda emulator: kernel %s, block (%u,%u,%u): %s\n", kernel, x, y, z, fault);
                    fault = nullptr;
                    rc = 1;
                }
            }
    block = outer;
    return rc;
}

/// Calls `f` with its arguments read from `cuLaunchKernel`'s array of pointers to them.
template <class... A, size_t... I>
inline void call(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
}
template <class... A>
inline void call(void (*f)(A...), void** p) {
    call(f, p, std::index_sequence_for<A...>{});
}

/// A launch's arguments kept by value, for a launch captured into a graph and run later
/// (`cuLaunchKernel`'s array points at the caller's variables, gone by then): `ptrs` is the
/// array the kernel's entry reads them through.
struct Kept {
    virtual ~Kept() = default;
    std::vector<void*> ptrs;
};
template <class... A>
struct KeptArgs : Kept {
    std::tuple<std::remove_cv_t<std::remove_reference_t<A>>...> values;
};
template <class... A, size_t... I>
inline Kept* keep(void (*)(A...), void** p, std::index_sequence<I...>) {
    auto* k = new KeptArgs<A...>;
    k->values = std::make_tuple(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
    k->ptrs = {static_cast<void*>(&std::get<I>(k->values))...};
    return k;
}
template <class... A>
inline Kept* keep(void (*f)(A...), void** p) {
    return keep(f, p, std::index_sequence_for<A...>{});
}

}  // namespace emu

// The kernel library's entry points for each kernel, appended by `compile.hpp`: its launch,
// and its arguments kept by value (`emu::Kept`, owned by the caller).
#define FERROTRON_EMU_ENTRY(name)                                                              \
    extern "C" int ferrotron_emu_launch_##name(const emu::Launch* l, void** p) {                \
        return emu::launch(l, #name, [](void** q) { emu::call(name, q); }, p);                   \
    }                                                                                          \
    extern "C" emu::Kept* ferrotron_emu_keep_##name(void** p) { return emu::keep(name, p); }
