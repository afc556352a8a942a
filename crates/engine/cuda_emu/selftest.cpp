// The CUDA emulator's own test (`build.sh` runs it): the device runtime runs what CUDA defines
// as CUDA does, and refuses, loudly, what CUDA leaves undefined. Without this, a runtime that
// ran nothing, or ran threads without ever making them wait for each other, could pass the
// backend's tests by accident.

#include "runtime.hpp"

#include <cstdio>
#include <string>

#define __global__

static int failures = 0;
static void check(bool ok, const std::string& what) {
    if (!ok) {
        std::fprintf(stderr, "selftest FAILED: %s\n", what.c_str());
        failures++;
    }
}

// Every thread of every block writes its global index: a grid of 3 × 64 must write 192 entries.
extern "C" __global__ void iota(unsigned* out) { out[blockIdx.x * blockDim.x + threadIdx.x] = blockIdx.x * blockDim.x + threadIdx.x; }

// A block's sum through shared memory and two barriers, then a warp butterfly: only correct if
// every thread waits at `__syncthreads` and each shuffle reads the partner's value of the same
// round.
extern "C" __global__ void block_sum(const float* x, float* out) {
    __shared__ float partial[32];
    float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) out[blockIdx.x] = v;
    }
}

// A write then a read of another thread's slot: right only with the barrier between them.
extern "C" __global__ void rotate(unsigned* out) {
    __shared__ unsigned slot[256];
    slot[threadIdx.x] = threadIdx.x * 7;
    __syncthreads();
    out[threadIdx.x] = slot[(threadIdx.x + 1) % blockDim.x];
}

// The second warp returns before the barrier; the first still meets it.
extern "C" __global__ void rotate_tail(unsigned* out) {
    __shared__ unsigned slot[32];
    if (threadIdx.x >= 32) return;
    slot[threadIdx.x] = threadIdx.x;
    __syncthreads();
    out[threadIdx.x] = slot[31 - threadIdx.x];
}

// Undefined in CUDA: half of a warp waits at a barrier its other half never reaches.
extern "C" __global__ void divergent_barrier(unsigned* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1;
}

// Undefined in CUDA: a full-mask shuffle after half the warp has returned.
extern "C" __global__ void shuffle_after_return(float* out) {
    if (threadIdx.x >= 16) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

// Launches through the entry points, as the driver does.
FERROTRON_EMU_ENTRY(iota)
FERROTRON_EMU_ENTRY(block_sum)
FERROTRON_EMU_ENTRY(rotate)
FERROTRON_EMU_ENTRY(rotate_tail)
FERROTRON_EMU_ENTRY(divergent_barrier)
FERROTRON_EMU_ENTRY(shuffle_after_return)

static int launch(int (*entry)(const emu::Launch*, void**), unsigned grid, unsigned block, void* arg0,
                  void* arg1 = nullptr) {
    emu::Launch l{{grid, 1, 1}, {block, 1, 1}, 0};
    void* params[] = {&arg0, &arg1};
    return entry(&l, params);
}

int main() {
    unsigned idx[192] = {};
    check(launch(ferrotron_emu_launch_iota, 3, 64, idx) == 0, "iota launches");
    bool all = true;
    for (unsigned i = 0; i < 192; i++) all &= idx[i] == i;
    check(all, "every thread of every block ran once with its own index");

    float x[2 * 256], sums[2] = {};
    double want[2] = {};
    for (int i = 0; i < 512; i++) {
        x[i] = (float)((i * 37) % 11) - 5.0f;
        want[i / 256] += x[i];
    }
    check(launch(ferrotron_emu_launch_block_sum, 2, 256, x, sums) == 0, "block_sum launches");
    check(sums[0] == (float)want[0] && sums[1] == (float)want[1],
          "block sums through shared memory and shuffles: " + std::to_string(sums[0]) + " " +
              std::to_string(sums[1]) + " vs " + std::to_string(want[0]) + " " + std::to_string(want[1]));

    unsigned rot[256] = {};
    check(launch(ferrotron_emu_launch_rotate, 1, 256, rot) == 0, "rotate launches");
    all = true;
    for (unsigned i = 0; i < 256; i++) all &= rot[i] == ((i + 1) % 256) * 7;
    check(all, "a barrier orders every write before every read");

    // A warp that returns whole leaves the barrier to the others (rows past the end).
    unsigned ones[64] = {};
    check(launch(ferrotron_emu_launch_rotate_tail, 1, 64, ones) == 0, "a warp that returned whole does not hold the barrier");
    all = true;
    for (unsigned i = 0; i < 32; i++) all &= ones[i] == 31 - i && ones[32 + i] == 0;
    check(all, "the first warp read the slots its lanes wrote before the barrier");
    std::fprintf(stderr, "(selftest: the next three refusals are expected)\n");
    check(launch(ferrotron_emu_launch_divergent_barrier, 1, 64, ones) != 0, "a divergent __syncthreads is refused");
    float out[32] = {};
    check(launch(ferrotron_emu_launch_shuffle_after_return, 1, 32, out) != 0,
          "a shuffle naming a returned lane is refused");
    check(launch(ferrotron_emu_launch_iota, 0, 64, idx) != 0, "an empty grid is refused");

    if (failures) return 1;
    std::printf("cuda emulator selftest: ok\n");
    return 0;
}
