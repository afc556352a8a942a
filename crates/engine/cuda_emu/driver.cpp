// The CUDA emulator's driver (`libcuda.so.1`): the driver API calls cudarc makes for the
// backend, with NVIDIA's C ABI, on one emulated GPU whose memory is host memory.
//
// What it checks, as a driver would refuse or worse: copies and memsets that leave a live
// allocation, frees of unknown addresses, kernels that are not in the loaded program, and
// everything `runtime.hpp` checks of a launch. New allocations are filled with 0xff bytes
// (NaN as floats), so a kernel that reads memory nobody wrote shows it, as `cuMemAlloc`'s
// uninitialised memory may on a GPU.
//
// Work on the legacy default stream (and the synchronous copies and memsets, which are its
// work) runs at once, after the work queued on every blocking stream: CUDA's implicit
// synchronisation of the legacy stream. Work on a stream made by `cuStreamCreate` (non-blocking,
// as cudarc makes them: a copy stream, NCCL's) and on a thread's per-thread default stream
// (`CU_STREAM_PER_THREAD`, the backend's compute stream: a blocking stream of its own for each
// host thread) runs late: its asynchronous copies, memsets, event records and event waits are
// queued and run only when something waits for them (a synchronisation of the stream, of the
// context or of one of its events, a stream waiting on one of its events, a query, a free, a
// launch or a cuBLASLt call on it, work on the legacy stream), as late as CUDA allows.
// So a kernel that reads what a copy stream writes without waiting for its event reads what
// was there before, as it may on a GPU where the copy is still running, and the tests see it;
// an asynchronous copy from page-locked memory reads its host source when it runs, so a host
// buffer changed before the copy was waited for shows too (from pageable memory it is staged
// when called, and into pageable memory it has landed when the call returns, as CUDA says).
// A stream can be captured into a graph (`cuStreamBeginCapture_v2` .. `cuGraphLaunch`): its
// work is recorded, not run (a launch's arguments kept by value through the kernel library's
// `ferrotron_emu_keep_<kernel>`, a cuBLASLt product through `ferrotron_emu_at_once`), and what
// CUDA refuses from the capturing thread fails with CUDA's error and invalidates the capture.
// `FERROTRON_CUDA_EMU_STREAMS=sync` runs every stream's
// work at once instead. An event records the host's clock when it is reached, so GPU times
// read from events are the emulator's. The device's memory is `FERROTRON_CUDA_EMU_MEMORY`
// bytes (80 GiB, an H100's, if unset); `cuMemGetInfo` says what the allocations left of it.

#include "compile.hpp"
#include "runtime.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906,
};

namespace {

/// Compute capability 9.9: Hopper-like, and a name no real GPU has, so that the backend's
/// cache of compiled programs (keyed by `sm_XY`) never hands the emulator's program to a real
/// GPU or a real program to the emulator.
constexpr int CC_MAJOR = 9, CC_MINOR = 9;
constexpr const char* NAME = "ferrotron CUDA emulator";

struct Module {
    void* lib;
};
struct Function {
    int (*entry)(const emu::Launch*, void**);
    emu::Kept* (*keep)(void**);
    std::string name;
};
/// A graph's work, in the order it was captured (one stream's capture: a chain).
using Nodes = std::vector<std::function<CUresult()>>;
struct Graph {
    Nodes nodes;
};
struct GraphExec {
    std::shared_ptr<const Nodes> nodes;
};
/// A stream of `cuStreamCreate`: its queued work, and how much of what was queued has run.
struct Stream {
    std::mutex m;
    /// Whether a thread (`runner`) is running one of its items: one at a time keeps the order.
    bool running = false;
    std::thread::id runner;
    std::condition_variable cv;
    std::deque<std::function<CUresult()>> queue;
    unsigned long long queued = 0, ran = 0;
    CUresult error = 0;
    /// Whether the legacy stream's work waits for this stream's (a per-thread default stream,
    /// or one created without CU_STREAM_NON_BLOCKING).
    bool blocking = false;
    /// The graph this stream is capturing into (null: none), and whether something CUDA
    /// refuses during a capture invalidated it.
    Graph* capture = nullptr;
    bool invalidated = false;
    /// The event waits queued here and not yet run: (queue position, stream waited for, its
    /// ticket), so that the emulated NCCL can run what a collective's inputs wait for.
    std::vector<std::tuple<unsigned long long, std::weak_ptr<Stream>, unsigned long long>> waits;
};
/// An event: when it was reached, and the stream and queue position it waits for (none, or a
/// stream destroyed since, whose work has all run: reached).
struct Event {
    std::chrono::steady_clock::time_point at;
    std::weak_ptr<Stream> stream;
    unsigned long long ticket = 0;
    /// Records queued and not yet run (under `lock`): a destroyed event is freed by the last
    /// (CUDA frees a recorded event once reached), since one recorded on two streams is
    /// reached, by `reach`, on the later's only.
    int pending = 0;
    bool destroyed = false;
};

// The tables are never destroyed: a thread still in the driver while the process exits (a
// rank's, draining its stream) must not find them gone.
std::mutex lock;
std::map<uintptr_t, size_t>& allocations = *new std::map<uintptr_t, size_t>;  // device address → bytes
std::map<uintptr_t, size_t>& pinned = *new std::map<uintptr_t, size_t>;  // page-locked host address → bytes
size_t allocated = 0;
unsigned long long launches = 0;
int context_tag = 0;
thread_local void* current = nullptr;
/// The stream this thread is capturing (`CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`, as cudarc's
/// callers begin it): while it does, what CUDA calls unsafe from this thread (work on the
/// legacy stream, a synchronisation, an allocation or free) fails and invalidates the capture.
thread_local Stream* capturing = nullptr;

// Every live stream of cuStreamCreate (under `lock`), owned here: a thread draining every
// stream (a free, a context synchronisation) holds them while another destroys one.
std::map<Stream*, std::shared_ptr<Stream>>& streams = *new std::map<Stream*, std::shared_ptr<Stream>>;

/// The live stream `s`, or null.
std::shared_ptr<Stream> owned(Stream* s) {
    std::lock_guard<std::mutex> g(lock);
    auto it = streams.find(s);
    return it == streams.end() ? nullptr : it->second;
}

bool deferred() {
    static const bool late = [] {
        const char* e = std::getenv("FERROTRON_CUDA_EMU_STREAMS");
        return !(e && std::string(e) == "sync");
    }();
    return late;
}

/// The calling thread's per-thread default stream, made at its first use and registered
/// with the created ones (a context synchronisation or a free drains it); at the thread's
/// exit its queued work runs (CUDA completes it) and it goes.
struct PerThread {
    std::shared_ptr<Stream> stream;
    PerThread() : stream(std::make_shared<Stream>()) {
        stream->blocking = true;
        std::lock_guard<std::mutex> g(lock);
        streams[stream.get()] = stream;
    }
    ~PerThread();
};
Stream* per_thread() {
    thread_local PerThread mine;
    return mine.stream.get();
}

/// The stream `s` names when its work runs late; null for the default and legacy streams
/// (0, 1), whose work runs at once (after the blocking streams': [`legacy`]).
Stream* late_stream(void* s) {
    if ((uintptr_t)s <= 1 || !deferred()) return nullptr;
    if ((uintptr_t)s == 2) return per_thread();
    return static_cast<Stream*>(s);
}

/// The graph work on stream `s` goes into, if `s` is capturing.
Graph* capture_of(void* s) {
    if ((uintptr_t)s <= 1) return nullptr;
    Stream* st = (uintptr_t)s == 2 ? per_thread() : static_cast<Stream*>(s);
    return st->capture && !st->invalidated ? st->capture : nullptr;
}

/// `what`, refused during this thread's capture: says so, invalidates the capture, and gives
/// CUDA's error; 0 where this thread captures nothing.
CUresult refused_in_capture(const char* what, CUresult e = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED) {
    if (!capturing) return 0;
    std::fprintf(stderr, "cuda emulator: %s during a stream capture: refused, the capture is invalidated\n", what);
    capturing->invalidated = true;
    return e;
}

/// Runs `s`'s queued work, in order, up to and including its `until`-th item (all of it by
/// default); the first error is kept for the stream's next synchronisation.
CUresult drain(Stream* s, unsigned long long until = ~0ull) {
    const std::thread::id me = std::this_thread::get_id();
    std::unique_lock<std::mutex> g(s->m);
    for (;;) {
        // Done once the work asked for has run: up to the ticket, or everything queued (the
        // item another thread is running included; one this thread is running, in a wait
        // nested in it, cannot be waited for).
        bool idle = !s->running || s->runner == me;
        if (s->ran >= until || (s->queue.empty() && idle)) {
            CUresult e = s->error;
            s->error = 0;
            return e;
        }
        // One item at a time, by one thread at a time (the order), which gives the stream up
        // between items: a thread waiting here for a ticket that the running thread has
        // passed returns without waiting for the rest of that thread's drain, which may wait
        // for this thread's (two streams waiting on each other's earlier work).
        if (!idle) {
            s->cv.wait(g);
            continue;
        }
        std::function<CUresult()> work = std::move(s->queue.front());
        s->queue.pop_front();
        bool outer = s->running;  // a wait nested in this thread's own item of the stream
        s->running = true;
        s->runner = me;
        g.unlock();
        CUresult e = work();
        g.lock();
        s->ran++;
        if (e && !s->error) s->error = e;
        s->running = outer;
        s->cv.notify_all();
    }
}

/// Every stream's queued work (a context synchronisation, a free).
CUresult drain_all() {
    std::vector<std::shared_ptr<Stream>> all;
    {
        std::lock_guard<std::mutex> g(lock);
        for (auto& kv : streams) all.push_back(kv.second);
    }
    CUresult first = 0;
    for (auto& s : all) {
        CUresult e = drain(s.get());
        if (e && !first) first = e;
    }
    return first;
}

/// What work on the legacy stream waits for: every blocking stream's queued work (every
/// thread's per-thread default stream's).
CUresult legacy() {
    if (CUresult e = refused_in_capture("work on the legacy stream", CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)) return e;
    if (!deferred()) return 0;
    std::vector<std::shared_ptr<Stream>> blocking;
    {
        std::lock_guard<std::mutex> g(lock);
        for (auto& kv : streams)
            if (kv.second->blocking) blocking.push_back(kv.second);
    }
    CUresult first = 0;
    for (auto& s : blocking) {
        CUresult e = drain(s.get());
        if (e && !first) first = e;
    }
    return first;
}

/// What must run before work that runs at once is done on stream `s` (a kernel, whose
/// arguments cannot be kept for later, or a cuBLASLt product): `s`'s earlier work, or on the
/// legacy stream the blocking streams'.
CUresult before(void* s) {
    if (Stream* late = late_stream(s)) return drain(late);
    return (uintptr_t)s <= 1 ? legacy() : 0;
}

/// Queues `work` behind `s`'s earlier work; its position in the queue (counting from 1).
unsigned long long enqueue(Stream* s, std::function<CUresult()> work) {
    std::lock_guard<std::mutex> g(s->m);
    s->queue.push_back(std::move(work));
    return ++s->queued;
}

/// `work` on stream `s`: at once on a stream that runs it at once, else queued behind its
/// earlier work.
CUresult submit(void* s, std::function<CUresult()> work) {
    if (Graph* g = capture_of(s)) {
        g->nodes.push_back(std::move(work));
        return 0;
    }
    Stream* late = late_stream(s);
    if (!late) {
        if ((uintptr_t)s <= 1)
            if (CUresult e = legacy()) return e;
        return work();
    }
    enqueue(late, std::move(work));
    return 0;
}

/// Runs the work event `e` waits for.
CUresult reach(Event* e) {
    std::shared_ptr<Stream> s = e->stream.lock();
    return s ? drain(s.get(), e->ticket) : 0;
}

/// Whether host memory [p, p + n) is page-locked (`cuMemHostAlloc`). An asynchronous copy
/// from pageable memory is staged when it is called, and one into pageable memory has landed
/// when the call returns; only page-locked memory is read or written when the stream runs.
bool is_pinned(const void* p, size_t n) {
    std::lock_guard<std::mutex> g(lock);
    auto it = pinned.upper_bound((uintptr_t)p);
    if (it == pinned.begin()) return false;
    --it;
    return (uintptr_t)p >= it->first && (uintptr_t)p + n <= it->first + it->second;
}

size_t total_memory() {
    const char* e = std::getenv("FERROTRON_CUDA_EMU_MEMORY");
    return e && *e ? std::strtoull(e, nullptr, 10) : 80ull << 30;
}

/// Whether [p, p + n) lies inside one live allocation; says on stderr what is wrong if not.
bool inside(CUdeviceptr p, size_t n, const char* what) {
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.upper_bound(p);
    if (it != allocations.begin()) {
        --it;
        if (p >= it->first && p + n <= it->first + it->second) return true;
    }
    std::fprintf(stderr, "cuda emulator: %s of %zu bytes at device address 0x%llx is outside every live allocation\n",
                 what, n, p);
    return false;
}

PerThread::~PerThread() {
    drain(stream.get());
    std::lock_guard<std::mutex> g(lock);
    streams.erase(stream.get());
}

// The copies and memsets themselves, wherever they run.
CUresult copy(CUdeviceptr dst, const void* src, size_t n, const char* what) {
    if (n && !inside(dst, n, what)) return CUDA_ERROR_INVALID_VALUE;
    std::memcpy((void*)dst, src, n);
    return CUDA_SUCCESS;
}
CUresult copy_dtoh(void* dst, CUdeviceptr src, size_t n) {
    if (n && !inside(src, n, "a device-to-host copy")) return CUDA_ERROR_INVALID_VALUE;
    std::memcpy(dst, (const void*)src, n);
    return CUDA_SUCCESS;
}
CUresult copy_dtod(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    if (n && (!inside(dst, n, "a device-to-device copy's destination") ||
              !inside(src, n, "a device-to-device copy's source")))
        return CUDA_ERROR_INVALID_VALUE;
    std::memmove((void*)dst, (const void*)src, n);
    return CUDA_SUCCESS;
}
CUresult set8(CUdeviceptr dst, unsigned char v, size_t n) {
    if (n && !inside(dst, n, "a memset")) return CUDA_ERROR_INVALID_VALUE;
    std::memset((void*)dst, v, n);
    return CUDA_SUCCESS;
}
CUresult set32(CUdeviceptr dst, unsigned v, size_t n) {
    if (n && !inside(dst, n * 4, "a memset")) return CUDA_ERROR_INVALID_VALUE;
    for (size_t i = 0; i < n; i++) std::memcpy((char*)dst + 4 * i, &v, 4);
    return CUDA_SUCCESS;
}

}  // namespace

extern "C" {

CUresult cuGetErrorString(CUresult e, const char** s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    switch (e) {
        case CUDA_SUCCESS: *s = "no error"; break;
        case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
        case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; break;
        case CUDA_ERROR_INVALID_DEVICE: *s = "invalid device ordinal"; break;
        case CUDA_ERROR_INVALID_IMAGE: *s = "device kernel image is invalid"; break;
        case CUDA_ERROR_INVALID_HANDLE: *s = "invalid resource handle"; break;
        case CUDA_ERROR_NOT_FOUND: *s = "named symbol not found"; break;
        case CUDA_ERROR_LAUNCH_FAILED: *s = "unspecified launch failure"; break;
        case CUDA_ERROR_ILLEGAL_STATE: *s = "the operation cannot be performed in the present state"; break;
        case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: *s = "operation not permitted when stream is capturing"; break;
        case CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: *s = "operation failed due to a previous error during capture"; break;
        case CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: *s = "operation would make the legacy stream depend on a capturing blocking stream"; break;
        default: *s = "unknown error (cuda emulator)";
    }
    return CUDA_SUCCESS;
}
CUresult cuGetErrorName(CUresult e, const char** s) { return cuGetErrorString(e, s); }

CUresult cuInit(unsigned) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 13000;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetCount(int* n) {
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = 1;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGet(int* d, int ordinal) {
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetName(char* name, int len, int dev) {
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    std::snprintf(name, (size_t)len, "%s", NAME);
    return CUDA_SUCCESS;
}
CUresult cuDeviceTotalMem_v2(size_t* bytes, int dev) {
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = total_memory();
    return CUDA_SUCCESS;
}
CUresult cuDeviceGetAttribute(int* v, int attr, int dev) {
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    switch (attr) {
        case 1: *v = 1024; break;   // MAX_THREADS_PER_BLOCK
        case 10: *v = 32; break;    // WARP_SIZE
        case 16: *v = 132; break;   // MULTIPROCESSOR_COUNT (an H100 SXM's)
        case 75: *v = CC_MAJOR; break;
        case 76: *v = CC_MINOR; break;
        case 115: *v = 0; break;    // MEMORY_POOLS_SUPPORTED: no stream-ordered allocator
        default:
            std::fprintf(stderr, "cuda emulator: device attribute %d is not emulated\n", attr);
            return CUDA_ERROR_NOT_SUPPORTED;
    }
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRetain(void** ctx, int dev) {
    if (dev != 0) return CUDA_ERROR_INVALID_DEVICE;
    *ctx = &context_tag;
    return CUDA_SUCCESS;
}
CUresult cuDevicePrimaryCtxRelease_v2(int) { return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(void* ctx) {
    current = ctx;
    return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = current;
    return CUDA_SUCCESS;
}
CUresult cuCtxPushCurrent_v2(void* ctx) { return cuCtxSetCurrent(ctx); }
CUresult cuCtxPopCurrent_v2(void** ctx) {
    if (ctx) *ctx = current;
    return CUDA_SUCCESS;
}
CUresult cuCtxSynchronize() {
    if (CUresult e = refused_in_capture("a context synchronisation")) return e;
    return drain_all();
}

CUresult cuModuleLoadData(void** module, const void* image) {
    const char* text = static_cast<const char*>(image);
    const char* src = text ? std::strstr(text, emu_build::SOURCE_MARK) : nullptr;
    if (!src) {
        std::fprintf(stderr, "cuda emulator: the module is not the emulated NVRTC's (real PTX cannot run here)\n");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    std::string log, path = emu_build::build(src + std::strlen(emu_build::SOURCE_MARK), log);
    void* lib = path.empty() ? nullptr : dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        std::fprintf(stderr, "cuda emulator: the program did not build or load: %s%s\n", log.c_str(),
                     path.empty() ? "" : dlerror());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    *module = new Module{lib};
    return CUDA_SUCCESS;
}
CUresult cuModuleUnload(void* module) {
    delete static_cast<Module*>(module);  // the library stays loaded: functions may outlive it
    return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(void** f, void* module, const char* name) {
    auto* m = static_cast<Module*>(module);
    if (!m || !name) return CUDA_ERROR_INVALID_HANDLE;
    void* entry = dlsym(m->lib, ("ferrotron_emu_launch_" + std::string(name)).c_str());
    if (!entry) return CUDA_ERROR_NOT_FOUND;
    void* keep = dlsym(m->lib, ("ferrotron_emu_keep_" + std::string(name)).c_str());
    *f = new Function{reinterpret_cast<int (*)(const emu::Launch*, void**)>(entry),
                      reinterpret_cast<emu::Kept* (*)(void**)>(keep), name};
    return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int* v, int, void*) {
    *v = 0;
    return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(void*, int, int) { return CUDA_SUCCESS; }

CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* stream, void** params, void** extra) {
    auto* fn = static_cast<Function*>(f);
    if (!fn) return CUDA_ERROR_INVALID_HANDLE;
    if (extra || !params) return CUDA_ERROR_NOT_SUPPORTED;
    emu::Launch l{{gx, gy, gz}, {bx, by, bz}, shared};
    if (Graph* g = capture_of(stream)) {
        // Captured: its arguments kept by value, to run at each launch of the graph.
        if (!fn->keep) return CUDA_ERROR_NOT_SUPPORTED;
        std::shared_ptr<emu::Kept> kept(fn->keep(params));
        g->nodes.push_back([fn, l, kept]() -> CUresult {
            {
                std::lock_guard<std::mutex> g(lock);
                launches++;
            }
            return fn->entry(&l, kept->ptrs.data()) ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
        });
        return CUDA_SUCCESS;
    }
    // A kernel's arguments cannot be kept for later: on a stream whose work runs late, the
    // stream's earlier work runs first and the kernel at once.
    if (CUresult e = before(stream)) return e;
    {
        std::lock_guard<std::mutex> g(lock);
        launches++;
    }
    return fn->entry(&l, params) ? CUDA_ERROR_LAUNCH_FAILED : CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    if (!p || !bytes) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult e = refused_in_capture("cuMemAlloc")) return e;
    {
        std::lock_guard<std::mutex> g(lock);
        if (allocated + bytes > total_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
    }
    // 256-byte aligned, as cuMemAlloc's are (the backend's alignment checks rely on it).
    void* host = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!host) return CUDA_ERROR_OUT_OF_MEMORY;
    std::memset(host, 0xff, bytes);
    std::lock_guard<std::mutex> g(lock);
    allocations[(uintptr_t)host] = bytes;
    allocated += bytes;
    *p = (CUdeviceptr)host;
    return CUDA_SUCCESS;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    if (CUresult e = refused_in_capture("cuMemFree")) return e;
    // As on a GPU, a free waits for the work that may still use the memory.
    drain_all();
    std::lock_guard<std::mutex> g(lock);
    auto it = allocations.find(p);
    if (it == allocations.end()) {
        std::fprintf(stderr, "cuda emulator: cuMemFree of 0x%llx, which is not an allocation's start\n", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    allocated -= it->second;
    allocations.erase(it);
    std::free((void*)p);
    return CUDA_SUCCESS;
}
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(lock);
    *total = total_memory();
    *free_bytes = *total - allocated;
    return CUDA_SUCCESS;
}
CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    *p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    if (!*p) return CUDA_ERROR_OUT_OF_MEMORY;
    std::lock_guard<std::mutex> g(lock);
    pinned[(uintptr_t)*p] = bytes;
    return CUDA_SUCCESS;
}
CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
CUresult cuMemFreeHost(void* p) {
    // As a free of device memory, it waits for the work that may still copy from or to it.
    drain_all();
    {
        std::lock_guard<std::mutex> g(lock);
        pinned.erase((uintptr_t)p);
    }
    std::free(p);
    return CUDA_SUCCESS;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    if (CUresult e = legacy()) return e;
    return copy(dst, src, n, "a host-to-device copy");
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    if (CUresult e = legacy()) return e;
    return copy_dtoh(dst, src, n);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    if (CUresult e = legacy()) return e;
    return copy_dtod(dst, src, n);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    if (n && !inside(dst, n, "a host-to-device copy")) return CUDA_ERROR_INVALID_VALUE;
    if (!is_pinned(src, n)) {
        if (capture_of(s)) return refused_in_capture("a copy from pageable host memory");
        // Pageable memory is staged now: the caller may change it once the call returns.
        auto staged = std::make_shared<std::vector<char>>((const char*)src, (const char*)src + n);
        return submit(s, [=] { return copy(dst, staged->data(), n, "a host-to-device copy"); });
    }
    return submit(s, [=] { return copy(dst, src, n, "a host-to-device copy"); });
}
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    if (n && !inside(src, n, "a device-to-host copy")) return CUDA_ERROR_INVALID_VALUE;
    if (!is_pinned(dst, n)) {
        if (capture_of(s)) return refused_in_capture("a copy into pageable host memory");
        // Into pageable memory the copy has landed when the call returns.
        if (CUresult e = before(s)) return e;
        return copy_dtoh(dst, src, n);
    }
    return submit(s, [=] { return copy_dtoh(dst, src, n); });
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    return submit(s, [=] { return copy_dtod(dst, src, n); });
}
CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    if (CUresult e = legacy()) return e;
    return set8(dst, v, n);
}
CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* s) {
    return submit(s, [=] { return set8(dst, v, n); });
}
CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned v, size_t n) {
    if (CUresult e = legacy()) return e;
    return set32(dst, v, n);
}
CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, void* s) {
    return submit(s, [=] { return set32(dst, v, n); });
}

CUresult cuStreamCreate(void** s, unsigned flags) {
    auto st = std::make_shared<Stream>();
    st->blocking = !(flags & 1);  // CU_STREAM_NON_BLOCKING
    std::lock_guard<std::mutex> g(lock);
    streams[st.get()] = st;
    *s = st.get();
    return CUDA_SUCCESS;
}
CUresult cuStreamCreateWithPriority(void** s, unsigned flags, int) { return cuStreamCreate(s, flags); }
CUresult cuStreamDestroy_v2(void* s) {
    if ((uintptr_t)s <= 2) return CUDA_ERROR_INVALID_HANDLE;
    std::shared_ptr<Stream> st = owned(static_cast<Stream*>(s));
    if (!st) return CUDA_ERROR_INVALID_HANDLE;
    // Work queued before the destruction still runs (CUDA completes it), then the stream goes
    // (once no other thread is draining it).
    drain(st.get());
    std::lock_guard<std::mutex> g(lock);
    streams.erase(st.get());
    return CUDA_SUCCESS;
}
CUresult cuStreamSynchronize(void* s) {
    if (CUresult e = refused_in_capture("a stream synchronisation")) return e;
    return before(s);
}
CUresult cuStreamQuery(void* s) { return cuStreamSynchronize(s); }
CUresult cuStreamWaitEvent(void* s, void* e, unsigned) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (capture_of(s)) {
        std::fprintf(stderr, "cuda emulator: an event wait in a captured graph is not emulated\n");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    auto* ev = static_cast<Event*>(e);
    // What the event waits for as of now (a later record of it does not count).
    std::weak_ptr<Stream> on = ev->stream;
    unsigned long long ticket = ev->ticket;
    auto wait = [=] {
        std::shared_ptr<Stream> st = on.lock();
        return st ? drain(st.get(), ticket) : CUDA_SUCCESS;
    };
    Stream* late = late_stream(s);
    if (!late) return submit(s, wait);
    std::lock_guard<std::mutex> g(late->m);
    late->queue.push_back(wait);
    // The waits already run go first (a compute stream's would pile up over a run).
    auto& w = late->waits;
    auto run = std::find_if(w.begin(), w.end(), [&](auto& t) { return std::get<0>(t) > late->ran; });
    w.erase(w.begin(), run);
    w.emplace_back(++late->queued, on, ticket);
    return CUDA_SUCCESS;
}

CUresult cuEventCreate(void** e, unsigned) {
    *e = new Event{std::chrono::steady_clock::now(), {}, 0};
    return CUDA_SUCCESS;
}
CUresult cuEventRecord(void* e, void* s) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (capture_of(s)) {
        std::fprintf(stderr, "cuda emulator: an event record in a captured graph is not emulated\n");
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    auto* ev = static_cast<Event*>(e);
    Stream* late = late_stream(s);
    if (!late) {
        if ((uintptr_t)s <= 1)
            if (CUresult e = legacy()) return e;
        ev->stream.reset();
        ev->at = std::chrono::steady_clock::now();
        return CUDA_SUCCESS;
    }
    {
        std::lock_guard<std::mutex> g(lock);
        ev->pending++;
    }
    ev->ticket = enqueue(late, [ev] {
        ev->at = std::chrono::steady_clock::now();
        std::lock_guard<std::mutex> g(lock);
        if (--ev->pending == 0 && ev->destroyed) delete ev;
        return CUDA_SUCCESS;
    });
    ev->stream = owned(late);
    return CUDA_SUCCESS;
}
CUresult cuEventRecordWithFlags(void* e, void* s, unsigned) { return cuEventRecord(e, s); }
CUresult cuEventSynchronize(void* e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    if (CUresult r = refused_in_capture("an event synchronisation")) return r;
    return reach(static_cast<Event*>(e));
}
CUresult cuEventQuery(void* e) { return cuEventSynchronize(e); }
CUresult cuEventDestroy_v2(void* e) {
    if (!e) return CUDA_ERROR_INVALID_HANDLE;
    // A record still queued writes into the event when it runs: the last one frees it.
    auto* ev = static_cast<Event*>(e);
    std::lock_guard<std::mutex> g(lock);
    if (ev->pending == 0)
        delete ev;
    else
        ev->destroyed = true;
    return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime_v2(float* ms, void* start, void* end) {
    if (!ms || !start || !end) return CUDA_ERROR_INVALID_HANDLE;
    auto d = static_cast<Event*>(end)->at - static_cast<Event*>(start)->at;
    *ms = std::chrono::duration<float, std::milli>(d).count();
    return CUDA_SUCCESS;
}
CUresult cuEventElapsedTime(float* ms, void* start, void* end) { return cuEventElapsedTime_v2(ms, start, end); }

/// For the emulator's libnccl: `work(arg)` on stream `s` as this driver runs its own work
/// there (at once on the default stream, queued on a late one), so that a collective's result
/// lands when its stream runs, not when it was called.
CUresult ferrotron_emu_submit(void* s, CUresult (*work)(void*), void* arg) {
    return submit(s, [=] { return work(arg); });
}

// Stream capture (CUDA graphs): the work a thread issues to a stream between the capture's
// begin and end is recorded, not run, and runs, in order, at each launch of the graph on a
// stream. One stream's capture is one chain (events, which would join others, are refused).
CUresult cuStreamBeginCapture_v2(void* s, int /* mode: thread-local as cudarc's callers ask */) {
    if ((uintptr_t)s <= 1) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;  // the legacy stream
    Stream* st = (uintptr_t)s == 2 ? per_thread() : static_cast<Stream*>(s);
    if (st->capture || capturing) return CUDA_ERROR_ILLEGAL_STATE;
    st->capture = new Graph;
    st->invalidated = false;
    capturing = st;
    return CUDA_SUCCESS;
}
CUresult cuStreamBeginCapture(void* s, int mode) { return cuStreamBeginCapture_v2(s, mode); }
CUresult cuStreamEndCapture(void* s, void** graph) {
    if (!graph) return CUDA_ERROR_INVALID_VALUE;
    *graph = nullptr;
    if ((uintptr_t)s <= 1) return CUDA_ERROR_ILLEGAL_STATE;
    Stream* st = (uintptr_t)s == 2 ? per_thread() : static_cast<Stream*>(s);
    if (!st->capture) return CUDA_ERROR_ILLEGAL_STATE;
    Graph* g = st->capture;
    st->capture = nullptr;
    if (capturing == st) capturing = nullptr;
    if (st->invalidated) {
        delete g;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *graph = g;
    return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(void* s, int* status) {
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    Stream* st = (uintptr_t)s <= 1 ? nullptr : (uintptr_t)s == 2 ? per_thread() : static_cast<Stream*>(s);
    *status = !st || !st->capture ? 0 : st->invalidated ? 2 : 1;  // NONE, ACTIVE, INVALIDATED
    return CUDA_SUCCESS;
}
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    if (!exec || !graph) return CUDA_ERROR_INVALID_VALUE;
    *exec = new GraphExec{std::make_shared<const Nodes>(static_cast<Graph*>(graph)->nodes)};
    return CUDA_SUCCESS;
}
CUresult cuGraphLaunch(void* exec, void* s) {
    if (!exec) return CUDA_ERROR_INVALID_VALUE;
    if (capture_of(s)) return CUDA_ERROR_NOT_SUPPORTED;
    std::shared_ptr<const Nodes> nodes = static_cast<GraphExec*>(exec)->nodes;
    return submit(s, [nodes]() -> CUresult {
        for (auto& n : *nodes)
            if (CUresult e = n()) return e;
        return CUDA_SUCCESS;
    });
}
CUresult cuGraphUpload(void* exec, void*) { return exec ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<GraphExec*>(exec);  // a launch still queued keeps its nodes
    return CUDA_SUCCESS;
}
CUresult cuGraphDestroy(void* graph) {
    delete static_cast<Graph*>(graph);
    return CUDA_SUCCESS;
}

/// For the emulator's cuBLASLt: what must run before a product on stream `s` runs at once
/// (as before a launch).
CUresult ferrotron_emu_before(void* s) { return before(s); }

/// For the emulator's cuBLASLt: `work(arg)` at once after `s`'s earlier work (as a launch),
/// or, on a capturing stream, recorded to run at each launch of the graph; `drop(arg)` once
/// it is no longer needed.
CUresult ferrotron_emu_at_once(void* s, CUresult (*work)(void*), void* arg, void (*drop)(void*)) {
    std::shared_ptr<void> kept(arg, drop);
    if (Graph* g = capture_of(s)) {
        g->nodes.push_back([work, kept] { return work(kept.get()); });
        return CUDA_SUCCESS;
    }
    if (CUresult e = before(s)) return e;
    return work(kept.get());
}

/// For the emulator's libnccl, which reads a call's inputs when it is called: runs the work
/// that the event waits queued on stream `s` wait for (the compute stream's work that
/// produced the inputs), not `s`'s own queued work (earlier results still land late).
CUresult ferrotron_emu_reach_waits(void* s) {
    Stream* late = late_stream(s);
    if (!late) return (uintptr_t)s <= 1 ? legacy() : 0;
    std::vector<std::pair<std::weak_ptr<Stream>, unsigned long long>> targets;
    {
        std::lock_guard<std::mutex> g(late->m);
        auto& w = late->waits;
        w.erase(std::remove_if(w.begin(), w.end(), [&](auto& t) { return std::get<0>(t) <= late->ran; }),
                w.end());
        for (auto& t : w) targets.emplace_back(std::get<1>(t), std::get<2>(t));
    }
    CUresult first = 0;
    for (auto& [on, ticket] : targets) {
        std::shared_ptr<Stream> st = on.lock();
        CUresult e = st ? drain(st.get(), ticket) : 0;
        if (e && !first) first = e;
    }
    return first;
}

/// Kernels launched since the library was loaded (for the emulator's own tests).
unsigned long long ferrotron_emu_launches() {
    std::lock_guard<std::mutex> g(lock);
    return launches;
}

}  // extern "C"
