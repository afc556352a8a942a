// The CUDA emulator's compiler: the backend's CUDA C++ program, as the emulated NVRTC received
// it, built by g++ into a host library of kernels (`runtime.hpp` included first), one entry
// point `ferrotron_emu_launch_<kernel>` per `extern "C" __global__` function. Used by both
// emulated libraries: NVRTC compiles (and reports g++'s errors as its log), the driver loads;
// the library is cached by a hash of the program and the runtime, so the driver finds what
// NVRTC built, and a program cached as "PTX" by the backend (`source.rs`) still loads after
// the cache of libraries is gone.
#pragma once

#include <dlfcn.h>
#include <string>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>

namespace emu_build {

/// The line after which the emulated PTX carries the program's source.
constexpr const char* SOURCE_MARK = "//@@ferrotron-cuda-emu-source@@\n";

/// The directory this library was loaded from (where `build.sh` put `runtime.hpp`).
inline std::string self_dir() {
    Dl_info info;
    if (!dladdr((void*)&self_dir, &info) || !info.dli_fname) return ".";
    std::string p = info.dli_fname;
    size_t slash = p.rfind('/');
    return slash == std::string::npos ? "." : p.substr(0, slash);
}

inline bool read_file(const std::string& path, std::string& out) {
    std::ifstream f(path, std::ios::binary);
    if (!f) return false;
    std::stringstream s;
    s << f.rdbuf();
    out = s.str();
    return true;
}

inline bool write_file(const std::string& path, const std::string& text) {
    std::ofstream f(path, std::ios::binary);
    f << text;
    return bool(f);
}

/// FNV-1a: stable across builds, as the backend's own cache key is.
inline unsigned long long fnv(const std::string& s) {
    unsigned long long h = 0xcbf29ce484222325ull;
    for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
    return h;
}

/// The names of the program's entry points, from its preprocessed text (where the macros
/// that write `NAME_##sfx` have been expanded and `__global__` is left as written).
inline std::string entries(const std::string& pre) {
    std::string out;
    const std::string key = "__global__ void ";
    for (size_t at = pre.find(key); at != std::string::npos; at = pre.find(key, at + 1)) {
        size_t b = at + key.size(), e = b;
        while (e < pre.size() && (isalnum((unsigned char)pre[e]) || pre[e] == '_')) e++;
        if (e > b) out += "FERROTRON_EMU_ENTRY(" + pre.substr(b, e - b) + ")\n";
    }
    return out;
}

inline int run(const std::string& cmd) { return std::system(cmd.c_str()); }

/// Builds `src` into a kernel library (or finds it built): its path, or "" with the
/// compiler's messages in `log`.
inline std::string build(const std::string& src, std::string& log) {
    std::string dir = self_dir(), runtime = dir + "/runtime.hpp", rt;
    if (!read_file(runtime, rt)) {
        log = "cuda emulator: " + runtime + " is missing (crates/engine/cuda_emu/build.sh puts it there)";
        return "";
    }
    const char* cache_env = std::getenv("FERROTRON_CUDA_EMU_CACHE");
    std::string cache = cache_env && *cache_env ? cache_env : dir + "/kernels";
    mkdir(cache.c_str(), 0755);
    char key[32];
    std::snprintf(key, sizeof key, "%016llx", fnv(rt + src));
    std::string lib = cache + "/" + key + ".so";
    if (access(lib.c_str(), R_OK) == 0) return lib;
    // Unique per thread: the tests of one process compile at once.
    std::string tmp = cache + "/" + key + "-" + std::to_string(getpid()) + "-" + std::to_string(gettid());
    const char* cxx_env = std::getenv("CXX");
    std::string cxx = cxx_env && *cxx_env ? cxx_env : "g++";
    bool ok = write_file(tmp + ".cu", src) &&
              run(cxx + " -std=c++17 -E -P -x c++ -include '" + runtime + "' '" + tmp + ".cu' -o '" +
                  tmp + ".ii' 2> '" + tmp + ".log'") == 0;
    std::string pre;
    // The entry points are found in the expanded text, then appended to the program as written.
    if (ok) ok = read_file(tmp + ".ii", pre) && write_file(tmp + ".cpp", src + "\n" + entries(pre));
    // -ffp-contract=off: every product and sum rounded on its own, as `__fmul_rn` promises.
    if (ok)
        ok = run(cxx + " -std=c++17 -O2 -fPIC -shared -ffp-contract=off -D__global__= -w -include '" +
                 runtime + "' '" + tmp + ".cpp' -o '" + tmp + ".so' 2> '" + tmp + ".log'") == 0;
    read_file(tmp + ".log", log);
    if (ok) ok = std::rename((tmp + ".so").c_str(), lib.c_str()) == 0;
    for (const char* ext : {".cu", ".ii", ".cpp", ".log", ".so"}) std::remove((tmp + ext).c_str());
    if (!ok && log.empty()) log = "cuda emulator: " + cxx + " failed to build the kernels";
    return ok ? lib : "";
}

}  // namespace emu_build
