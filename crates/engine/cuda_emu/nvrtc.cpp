// The CUDA emulator's NVRTC (`libnvrtc.so.13`): the calls cudarc's `compile_ptx_with_opts`
// makes, with the C ABI of NVIDIA's library. "Compiling" builds the program for the host with
// g++ (`compile.hpp`), so a program g++ rejects fails here with g++'s messages as the log, and
// the "PTX" it returns is a small text the emulated driver understands: a `.version` line
// (the backend checks it against the driver, `ptx_version.rs`), the target it was asked for,
// then the program itself.

#include "compile.hpp"

#include <cstring>
#include <string>

typedef int nvrtcResult;
enum {
    NVRTC_SUCCESS = 0,
    NVRTC_ERROR_INVALID_INPUT = 3,
    NVRTC_ERROR_INVALID_PROGRAM = 4,
    NVRTC_ERROR_COMPILATION = 6,
};

namespace {
struct Program {
    std::string src, ptx, log;
};

// A program's text (its PTX or its log) as NVRTC hands it out: first its size with the
// terminator, then the bytes into the caller's buffer of that size.
nvrtcResult size_of(void* prog, std::string Program::*text, size_t* size) {
    auto* p = static_cast<Program*>(prog);
    if (!p || !size) return NVRTC_ERROR_INVALID_INPUT;
    *size = (p->*text).size() + 1;
    return NVRTC_SUCCESS;
}
nvrtcResult copy_of(void* prog, std::string Program::*text, char* out) {
    auto* p = static_cast<Program*>(prog);
    if (!p || !out) return NVRTC_ERROR_INVALID_INPUT;
    std::memcpy(out, (p->*text).c_str(), (p->*text).size() + 1);
    return NVRTC_SUCCESS;
}
}  // namespace

extern "C" {

const char* nvrtcGetErrorString(nvrtcResult r) {
    switch (r) {
        case NVRTC_SUCCESS: return "NVRTC_SUCCESS";
        case NVRTC_ERROR_INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT";
        case NVRTC_ERROR_INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM";
        case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION";
        default: return "NVRTC_ERROR (cuda emulator)";
    }
}

nvrtcResult nvrtcVersion(int* major, int* minor) {
    if (!major || !minor) return NVRTC_ERROR_INVALID_INPUT;
    *major = 13;
    *minor = 0;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcCreateProgram(void** prog, const char* src, const char*, int headers, const char* const*,
                               const char* const*) {
    if (!prog || !src) return NVRTC_ERROR_INVALID_INPUT;
    if (headers) return NVRTC_ERROR_INVALID_INPUT;  // the backend's program includes nothing
    *prog = new Program{src, "", ""};
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcDestroyProgram(void** prog) {
    if (!prog || !*prog) return NVRTC_ERROR_INVALID_PROGRAM;
    delete static_cast<Program*>(*prog);
    *prog = nullptr;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcCompileProgram(void* prog, int n, const char* const* options) {
    auto* p = static_cast<Program*>(prog);
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    std::string target = "sm_90";
    for (int i = 0; i < n; i++) {
        const char* o = options[i];
        for (const char* flag : {"--gpu-architecture=", "-arch="})
            if (!std::strncmp(o, flag, std::strlen(flag))) target = o + std::strlen(flag);
    }
    if (emu_build::build(p->src, p->log).empty()) return NVRTC_ERROR_COMPILATION;
    p->ptx = "// The ferrotron CUDA emulator's program (crates/engine/cuda_emu): not PTX.\n"
             ".version 9.0\n.target " + target + "\n.address_size 64\n" +
             emu_build::SOURCE_MARK + p->src;
    return NVRTC_SUCCESS;
}

nvrtcResult nvrtcGetPTXSize(void* prog, size_t* size) { return size_of(prog, &Program::ptx, size); }
nvrtcResult nvrtcGetPTX(void* prog, char* out) { return copy_of(prog, &Program::ptx, out); }
nvrtcResult nvrtcGetProgramLogSize(void* prog, size_t* size) { return size_of(prog, &Program::log, size); }
nvrtcResult nvrtcGetProgramLog(void* prog, char* out) { return copy_of(prog, &Program::log, out); }

}  // extern "C"
