// The CUDA emulator's libnccl: the NCCL calls ferrotron's NCCL communicator makes
// (`crates/dist/src/backends/nccl.rs`, through cudarc's `nccl::result`), between ranks that are
// threads of one process (the threads launcher), so several NCCL ranks are tested without GPUs.
// Built as `libnccl.so.2` with a `libnccl.so` link (cudarc loads it by name: put the directory
// on LD_LIBRARY_PATH).
//
// What it does: `ncclCommInitRank` joins the ranks holding the same unique id (blocking until
// all have, as NCCL's init does). A collective waits for every rank of its communicator, then
// the last to arrive computes every rank's result on the device buffers (the driver emulator's
// device pointers are host pointers) and releases them: sums in rank order from 0
// (`0 + x₀ + x₁ + …`, as ferrotron's threads backend adds), so the results are that backend's
// bit for bit. Sends and receives between `ncclGroupStart` and `ncclGroupEnd` are matched per
// (source, destination) pair in order; `ncclGroupEnd` returns once its receives have copied.
// A send never waits for its receiver (NCCL's host does not: the wait is the stream's), so a
// pipeline whose stages send before they receive runs here as on GPUs; its bytes are copied
// into the pair's mailbox when it is called. A call reads its sends when it is made, after
// running what its stream's queued event waits wait for (the compute stream's work that wrote
// them: `ferrotron_emu_reach_waits` of the emulated driver), but its
// results land in the receiving buffers when its stream runs: the emulated driver queues them
// there (`ferrotron_emu_submit`) and runs them as late as CUDA allows, so a compute stream that
// reads a result without waiting for the communication stream reads what was there before.
//
// Differences from NCCL, said here so no test relies on them: several ranks may share the one
// emulated GPU (NCCL refuses that); only f32 and bf16 collectives are emulated (a bf16 sum adds
// in f32 and rounds each partial sum to bf16, in rank order, as a ring's hops round: at two
// ranks one rounding), other types and operations fail with ncclInvalidArgument and a line on
// stderr. A collective inside a group runs when it is called, as every rank calls the group's
// collectives in the same order (NCCL runs the group as one; sends and receives are not mixed
// with collectives in one group here).

#include <condition_variable>
#include <cstdarg>
#include <dlfcn.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unistd.h>
#include <utility>
#include <vector>

namespace {

enum : int { SUCCESS = 0, SYSTEM_ERROR = 2, INVALID_ARGUMENT = 4, INVALID_USAGE = 5 };
enum : int { FLOAT32 = 7, BFLOAT16 = 9 };

// bf16 ⇄ f32: widening is exact; rounding to nearest even (NaN kept quiet), as CUDA's.
float from_bf16(uint16_t b) {
    uint32_t u = uint32_t(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
uint16_t to_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return uint16_t(u >> 16);
}
enum : int { SUM = 0 };

int fail(int status, const char* fn, const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    std::fprintf(stderr, "ferrotron NCCL emulator: %s: ", fn);
    std::vfprintf(stderr, fmt, args);
    std::fputc('\n', stderr);
    va_end(args);
    return status;
}

size_t bytes_of(int type) {
    static const size_t sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return type >= 0 && type < 10 ? sizes[type] : 0;
}

enum class Kind { AllReduce, Broadcast, Reduce, ReduceScatter, AllGather };
const char* name_of(Kind k) {
    switch (k) {
        case Kind::AllReduce: return "ncclAllReduce";
        case Kind::Broadcast: return "ncclBroadcast";
        case Kind::Reduce: return "ncclReduce";
        case Kind::ReduceScatter: return "ncclReduceScatter";
        default: return "ncclAllGather";
    }
}

// One rank's part of a collective, and (once computed) what lands in its `recv`.
struct Part {
    Kind kind;
    const void* send;
    void* recv;
    size_t count;  // NCCL's count: per rank for ReduceScatter (recv) and AllGather (send)
    int root;
    int type = FLOAT32;
    std::vector<char> result;
};

// Bytes that land in a device buffer when their stream runs.
struct Landing {
    void* dst;
    std::vector<char> bytes;
};

int land(void* arg) {
    std::unique_ptr<Landing> l(static_cast<Landing*>(arg));
    if (!l->bytes.empty()) std::memcpy(l->dst, l->bytes.data(), l->bytes.size());
    return 0;
}

// `bytes` into `dst` on `stream`, through the emulated driver (found by its soname, as cudarc
// loaded it); at once where there is none.
int deliver(void* stream, void* dst, const void* src, size_t n) {
    using Submit = int (*)(void*, int (*)(void*), void*);
    static Submit submit = [] {
        void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        return h ? reinterpret_cast<Submit>(dlsym(h, "ferrotron_emu_submit")) : nullptr;
    }();
    auto* l = new Landing{dst, std::vector<char>(static_cast<const char*>(src), static_cast<const char*>(src) + n)};
    if (!submit) return land(l);
    return submit(stream, land, l) ? fail(SYSTEM_ERROR, "ncclGroupEnd", "the driver refused the stream") : SUCCESS;
}

// Runs the work that `stream`'s queued event waits wait for, so that a call's inputs are
// written before it reads them (NCCL's kernel reads them when its stream gets there).
int reach(void* stream, const char* fn) {
    using Reach = int (*)(void*);
    static Reach reach_waits = [] {
        void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        return h ? reinterpret_cast<Reach>(dlsym(h, "ferrotron_emu_reach_waits")) : nullptr;
    }();
    if (reach_waits && reach_waits(stream)) return fail(SYSTEM_ERROR, fn, "the work its stream waits for failed");
    return SUCCESS;
}

struct Message {
    std::vector<char> bytes;
};

// The ranks of one unique id.
struct Clique {
    int nranks;
    int joined = 0;
    std::mutex mu;
    std::condition_variable cv;
    bool aborted = false;
    // The collective in progress: the parts arrived so far, and how many calls have completed.
    std::vector<Part> parts;
    int arrived = 0;
    uint64_t completed = 0;
    int status = SUCCESS;
    // Messages in flight, by (source, destination), in send order.
    std::map<std::pair<int, int>, std::vector<Message>> mail;
};

std::mutex cliques_mu;
std::map<std::string, std::shared_ptr<Clique>> cliques;

struct Comm {
    std::shared_ptr<Clique> clique;
    int rank;
};

struct Pending {
    bool send;
    void* buf;
    size_t bytes;
    int peer;
    Comm* comm;
    void* stream;
};
thread_local int group_depth = 0;
thread_local std::vector<Pending> pending;

// Sums `n` elements of every rank's `send` (from `offset` elements), in rank order from 0, in
// the collective's type: f32 adds in f32; bf16 adds in f32 and rounds each partial sum to bf16,
// as a ring's hops round.
std::vector<char> sum_of(const Clique& c, size_t offset, size_t n, int type) {
    if (type == BFLOAT16) {
        std::vector<uint16_t> sum(n, 0);
        for (const Part& p : c.parts) {
            const uint16_t* x = static_cast<const uint16_t*>(p.send) + offset;
            for (size_t i = 0; i < n; i++) sum[i] = to_bf16(from_bf16(sum[i]) + from_bf16(x[i]));
        }
        const char* b = reinterpret_cast<const char*>(sum.data());
        return std::vector<char>(b, b + n * 2);
    }
    std::vector<float> sum(n, 0.0f);
    for (const Part& p : c.parts) {
        const float* x = static_cast<const float*>(p.send) + offset;
        for (size_t i = 0; i < n; i++) sum[i] += x[i];
    }
    const char* b = reinterpret_cast<const char*>(sum.data());
    return std::vector<char>(b, b + n * 4);
}

// Every rank's results of the collective whose parts have all arrived.
int compute(Clique& c) {
    const Part& p0 = c.parts[0];
    int n = c.nranks;
    for (const Part& p : c.parts)
        if (p.kind != p0.kind || p.count != p0.count || p.root != p0.root)
            return fail(INVALID_USAGE, name_of(p0.kind), "the ranks called different collectives or counts");
    for (const Part& p : c.parts)
        if (p.type != p0.type) return fail(INVALID_USAGE, name_of(p0.kind), "the ranks called different types");
    size_t count = p0.count, width = bytes_of(p0.type);
    switch (p0.kind) {
        case Kind::AllReduce: {
            std::vector<char> sum = sum_of(c, 0, count, p0.type);
            for (Part& p : c.parts) p.result = sum;
            return SUCCESS;
        }
        case Kind::Broadcast: {
            const char* root = static_cast<const char*>(c.parts[p0.root].send);
            for (Part& p : c.parts) p.result.assign(root, root + count * width);
            return SUCCESS;
        }
        case Kind::Reduce:
            // The root's buffer only; the others' are left as they are.
            c.parts[p0.root].result = sum_of(c, 0, count, p0.type);
            return SUCCESS;
        case Kind::ReduceScatter:
            for (int r = 0; r < n; r++) c.parts[r].result = sum_of(c, r * count, count, p0.type);
            return SUCCESS;
        case Kind::AllGather: {
            std::vector<char> all(count * n * width);
            for (int r = 0; r < n; r++) std::memcpy(all.data() + r * count * width, c.parts[r].send, count * width);
            for (Part& p : c.parts) p.result = all;
            return SUCCESS;
        }
    }
    return INVALID_USAGE;
}

int collective(Comm* comm, Part part, int type, int op, void* stream) {
    const char* fn = name_of(part.kind);
    if (!comm) return fail(INVALID_ARGUMENT, fn, "null communicator");
    if ((type != FLOAT32 && type != BFLOAT16) || op != SUM)
        return fail(INVALID_ARGUMENT, fn, "data type %d, operation %d: only f32 and bf16 sums are emulated", type, op);
    part.type = type;
    if (int e = reach(stream, fn)) return e;
    Clique& c = *comm->clique;
    std::unique_lock<std::mutex> lock(c.mu);
    if (c.aborted) return fail(SYSTEM_ERROR, fn, "the communicator was aborted");
    uint64_t mine = c.completed;
    c.parts[comm->rank] = part;
    if (++c.arrived == c.nranks) {
        c.status = compute(c);
        c.arrived = 0;
        c.completed++;
        c.cv.notify_all();
    } else {
        c.cv.wait(lock, [&] { return c.completed != mine || c.aborted; });
        if (c.completed == mine) return fail(SYSTEM_ERROR, fn, "the communicator was aborted");
    }
    // The next collective's parts arrive only once every rank has taken its result.
    std::vector<char> out = std::move(c.parts[comm->rank].result);
    int status = c.status;
    lock.unlock();
    if (status != SUCCESS) return status;
    return deliver(stream, part.recv, out.data(), out.size());
}

// The sends and receives of one group, in the order they were called.
int run_group(std::vector<Pending>& ops) {
    const char* fn = "ncclGroupEnd";
    for (Pending& o : ops) {
        if (!o.send) continue;
        if (int e = reach(o.stream, fn)) return e;
        Clique& c = *o.comm->clique;
        const char* b = static_cast<const char*>(o.buf);
        std::lock_guard<std::mutex> lock(c.mu);
        c.mail[{o.comm->rank, o.peer}].push_back(Message{std::vector<char>(b, b + o.bytes)});
        c.cv.notify_all();
    }
    int status = SUCCESS;
    std::vector<std::pair<Pending*, std::vector<char>>> arrived;
    for (Pending& o : ops) {
        if (o.send) continue;
        Clique& c = *o.comm->clique;
        std::unique_lock<std::mutex> lock(c.mu);
        auto& box = c.mail[{o.peer, o.comm->rank}];
        c.cv.wait(lock, [&] { return !box.empty() || c.aborted; });
        if (box.empty()) return fail(SYSTEM_ERROR, fn, "the communicator was aborted");
        Message m = std::move(box.front());
        box.erase(box.begin());
        if (m.bytes.size() != o.bytes)
            status = fail(INVALID_USAGE, fn, "rank %d sent %zu bytes to rank %d, which receives %zu",
                          o.peer, m.bytes.size(), o.comm->rank, o.bytes);
        else
            arrived.emplace_back(&o, std::move(m.bytes));
    }
    // What was received lands when the receiver's stream runs.
    for (auto& [o, bytes] : arrived) {
        int s = deliver(o->stream, o->buf, bytes.data(), bytes.size());
        if (s != SUCCESS) status = s;
    }
    return status;
}

int point_to_point(bool send, void* buf, size_t count, int type, int peer, Comm* comm, void* stream) {
    const char* fn = send ? "ncclSend" : "ncclRecv";
    if (!comm) return fail(INVALID_ARGUMENT, fn, "null communicator");
    if (bytes_of(type) == 0) return fail(INVALID_ARGUMENT, fn, "data type %d", type);
    if (peer < 0 || peer >= comm->clique->nranks)
        return fail(INVALID_ARGUMENT, fn, "peer %d of %d ranks", peer, comm->clique->nranks);
    pending.push_back(Pending{send, buf, count * bytes_of(type), peer, comm, stream});
    if (group_depth > 0) return SUCCESS;
    std::vector<Pending> ops;
    ops.swap(pending);
    return run_group(ops);
}

}  // namespace

extern "C" {

struct ncclUniqueId {
    char internal[128];
};

int ncclGetVersion(int* version) {
    if (!version) return fail(INVALID_ARGUMENT, "ncclGetVersion", "null pointer");
    *version = 22703;  // the API of NCCL 2.27
    return SUCCESS;
}

const char* ncclGetErrorString(int result) {
    switch (result) {
        case SUCCESS: return "no error (ferrotron NCCL emulator)";
        case SYSTEM_ERROR: return "system error (ferrotron NCCL emulator)";
        case INVALID_ARGUMENT: return "invalid argument (ferrotron NCCL emulator)";
        case INVALID_USAGE: return "invalid usage (ferrotron NCCL emulator)";
        default: return "unknown result (ferrotron NCCL emulator)";
    }
}

const char* ncclGetLastError(void*) { return "see the ferrotron NCCL emulator's line on stderr"; }

int ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return fail(INVALID_ARGUMENT, "ncclGetUniqueId", "null pointer");
    static std::mutex mu;
    static uint64_t next = 0;
    std::lock_guard<std::mutex> lock(mu);
    std::memset(id->internal, 0, sizeof id->internal);
    std::snprintf(id->internal, sizeof id->internal, "ferrotron-nccl-emu %d %llu", int(getpid()),
                  (unsigned long long)++next);
    return SUCCESS;
}

int ncclCommInitRank(void** comm, int nranks, ncclUniqueId id, int rank) {
    const char* fn = "ncclCommInitRank";
    if (!comm || nranks < 1 || rank < 0 || rank >= nranks)
        return fail(INVALID_ARGUMENT, fn, "rank %d of %d ranks", rank, nranks);
    std::string key(id.internal, strnlen(id.internal, sizeof id.internal));
    std::shared_ptr<Clique> c;
    {
        std::lock_guard<std::mutex> lock(cliques_mu);
        auto& slot = cliques[key];
        if (!slot) {
            slot = std::make_shared<Clique>();
            slot->nranks = nranks;
            slot->parts.resize(nranks);
        }
        c = slot;
    }
    std::unique_lock<std::mutex> lock(c->mu);
    if (c->nranks != nranks)
        return fail(INVALID_USAGE, fn, "rank %d joins with %d ranks, the others with %d", rank, nranks, c->nranks);
    // NCCL's init is collective: every rank returns once all have joined.
    if (++c->joined == nranks) {
        c->cv.notify_all();
        std::lock_guard<std::mutex> l(cliques_mu);
        cliques.erase(key);  // the id may not be reused
    } else {
        c->cv.wait(lock, [&] { return c->joined == c->nranks; });
    }
    *comm = new Comm{c, rank};
    return SUCCESS;
}

int ncclCommDestroy(void* comm) {
    delete static_cast<Comm*>(comm);
    return SUCCESS;
}

int ncclCommAbort(void* comm) {
    Comm* c = static_cast<Comm*>(comm);
    if (c) {
        std::lock_guard<std::mutex> lock(c->clique->mu);
        c->clique->aborted = true;
        c->clique->cv.notify_all();
    }
    delete c;
    return SUCCESS;
}

int ncclGroupStart(void) {
    group_depth++;
    return SUCCESS;
}

int ncclGroupEnd(void) {
    if (group_depth == 0) return fail(INVALID_USAGE, "ncclGroupEnd", "no group was started");
    if (--group_depth > 0) return SUCCESS;
    std::vector<Pending> ops;
    ops.swap(pending);
    return run_group(ops);
}

int ncclSend(const void* buf, size_t count, int type, int peer, void* comm, void* stream) {
    return point_to_point(true, const_cast<void*>(buf), count, type, peer, static_cast<Comm*>(comm), stream);
}

int ncclRecv(void* buf, size_t count, int type, int peer, void* comm, void* stream) {
    return point_to_point(false, buf, count, type, peer, static_cast<Comm*>(comm), stream);
}

int ncclAllReduce(const void* send, void* recv, size_t count, int type, int op, void* comm, void* stream) {
    Part p{Kind::AllReduce, send, recv, count, 0, FLOAT32, {}};
    return collective(static_cast<Comm*>(comm), p, type, op, stream);
}

int ncclBroadcast(const void* send, void* recv, size_t count, int type, int root, void* comm, void* stream) {
    Comm* c = static_cast<Comm*>(comm);
    if (c && (root < 0 || root >= c->clique->nranks))
        return fail(INVALID_ARGUMENT, "ncclBroadcast", "root %d of %d ranks", root, c->clique->nranks);
    Part p{Kind::Broadcast, send, recv, count, root, FLOAT32, {}};
    return collective(c, p, type, SUM, stream);
}

int ncclReduce(const void* send, void* recv, size_t count, int type, int op, int root, void* comm, void* stream) {
    Comm* c = static_cast<Comm*>(comm);
    if (c && (root < 0 || root >= c->clique->nranks))
        return fail(INVALID_ARGUMENT, "ncclReduce", "root %d of %d ranks", root, c->clique->nranks);
    Part p{Kind::Reduce, send, recv, count, root, FLOAT32, {}};
    return collective(c, p, type, op, stream);
}

int ncclReduceScatter(const void* send, void* recv, size_t count, int type, int op, void* comm, void* stream) {
    Part p{Kind::ReduceScatter, send, recv, count, 0, FLOAT32, {}};
    return collective(static_cast<Comm*>(comm), p, type, op, stream);
}

int ncclAllGather(const void* send, void* recv, size_t count, int type, void* comm, void* stream) {
    Part p{Kind::AllGather, send, recv, count, 0, FLOAT32, {}};
    return collective(static_cast<Comm*>(comm), p, type, SUM, stream);
}

}  // extern "C"
