// tp_pp_mlp's device engine (--device cuda): the model's buffers in GPU memory and its
// arithmetic in four small kernels of ours (below, as source), compiled at start-up with NVRTC
// for the device's architecture. The CUDA driver (libcuda.so.1) and NVRTC are loaded with
// dlopen, so the example still builds with only nccl.h and a C++ compiler; a machine without
// them gets a message and exit code 3.
//
// Where NVRTC is: OXCCL_NVRTC (a file), else libnvrtc.so.13 / .so.12 / .so on the loader's path
// (pip's nvidia-cuda-nvrtc-cu12 puts it in site-packages/nvidia/cuda_nvrtc/lib).
//
// Everything runs in order on one non-blocking stream of the device's primary context, which is
// current on the calling thread before the communicators are made (NCCL binds a communicator to
// the current device). A CUstream is a cudaStream_t, a CUdeviceptr the address a device pointer
// holds.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace cuda_engine {

// The kernels. gemm sums in the same order as the host's loop and, compiled with
// --fmad=false, rounds the same way; tanhf may differ from the host's tanh in the last bits.
const char* const kSource = R"(
extern "C" __global__ void gemm(const float* x, int ldx, const float* w, int ldw, float* c,
                                int ldc, int m, int k, int n) {
  int i = blockIdx.y * blockDim.y + threadIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m || j >= n) return;
  float s = 0.0f;
  for (int t = 0; t < k; t++) s += x[(size_t)i * ldx + t] * w[(size_t)t * ldw + j];
  c[(size_t)i * ldc + j] = s;
}
extern "C" __global__ void activate(float* z, unsigned long long n, int exact) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i >= n) return;
  float v = z[i];
  z[i] = exact ? (v > 0.0f ? v : 0.0f)
               : 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
}
extern "C" __global__ void clamp8(float* y, unsigned long long n) {
  unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  if (i < n) y[i] = fmaxf(-8.0f, fminf(8.0f, y[i]));
}
// y (m x tp*hs) from tp blocks of m x hs: y[i][t*hs + j] = got[t][i][j].
extern "C" __global__ void interleave(const float* got, float* y, int tp, int m, int hs) {
  int j = blockIdx.x * blockDim.x + threadIdx.x, i = blockIdx.y, t = blockIdx.z;
  if (j < hs) y[((size_t)i * tp + t) * hs + j] = got[((size_t)t * m + i) * hs + j];
}
)";

constexpr int kUnavailable = 3;

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef int nvrtcResult;
typedef struct _nvrtcProgram* nvrtcProgram;

struct Api {
  CUresult (*Init)(unsigned);
  CUresult (*DeviceGet)(int*, int);
  CUresult (*DeviceGetAttribute)(int*, int, int);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, int);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*MemAlloc)(CUdeviceptr*, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, cudaStream_t);
  CUresult (*MemcpyDtoHAsync)(void*, CUdeviceptr, size_t, cudaStream_t);
  CUresult (*StreamCreate)(cudaStream_t*, unsigned);
  CUresult (*StreamSynchronize)(cudaStream_t);
  CUresult (*StreamDestroy)(cudaStream_t);
  CUresult (*ModuleLoadData)(CUmodule*, const void*);
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*);
  CUresult (*ModuleUnload)(CUmodule);
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           unsigned, cudaStream_t, void**, void**);
  CUresult (*GetErrorString)(CUresult, const char**);
  nvrtcResult (*CreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*,
                               const char* const*);
  nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetProgramLog)(nvrtcProgram, char*);
  nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*GetPTXSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetPTX)(nvrtcProgram, char*);
  nvrtcResult (*DestroyProgram)(nvrtcProgram*);
};

[[noreturn]] inline void unavailable(const std::string& why) {
  std::fprintf(stderr, "tp_pp_mlp: --device cuda: %s\n", why.c_str());
  std::exit(kUnavailable);
}

template <typename F>
void bind(void* lib, const char* lib_name, const char* name, F*& f) {
  void* s = dlsym(lib, name);
  if (!s) unavailable(std::string(lib_name) + " lacks " + name);
  f = reinterpret_cast<F*>(s);
}

class Engine {
 public:
  // Loads the driver and NVRTC, makes device 0's primary context current on this thread,
  // compiles the kernels and creates the stream.
  Engine() {
    void* cu = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    if (!cu) unavailable(std::string("no CUDA driver (") + dlerror() + ")");
    const char* c = "libcuda.so.1";
    bind(cu, c, "cuInit", api_.Init);
    bind(cu, c, "cuDeviceGet", api_.DeviceGet);
    bind(cu, c, "cuDeviceGetAttribute", api_.DeviceGetAttribute);
    bind(cu, c, "cuDevicePrimaryCtxRetain", api_.DevicePrimaryCtxRetain);
    bind(cu, c, "cuCtxSetCurrent", api_.CtxSetCurrent);
    bind(cu, c, "cuMemAlloc_v2", api_.MemAlloc);
    bind(cu, c, "cuMemFree_v2", api_.MemFree);
    bind(cu, c, "cuMemcpyHtoDAsync_v2", api_.MemcpyHtoDAsync);
    bind(cu, c, "cuMemcpyDtoHAsync_v2", api_.MemcpyDtoHAsync);
    bind(cu, c, "cuStreamCreate", api_.StreamCreate);
    bind(cu, c, "cuStreamSynchronize", api_.StreamSynchronize);
    bind(cu, c, "cuStreamDestroy_v2", api_.StreamDestroy);
    bind(cu, c, "cuModuleLoadData", api_.ModuleLoadData);
    bind(cu, c, "cuModuleGetFunction", api_.ModuleGetFunction);
    bind(cu, c, "cuModuleUnload", api_.ModuleUnload);
    bind(cu, c, "cuLaunchKernel", api_.LaunchKernel);
    bind(cu, c, "cuGetErrorString", api_.GetErrorString);
    if (api_.Init(0) != 0) unavailable("cuInit failed: no usable GPU");
    int dev = 0, major = 0, minor = 0;
    check(api_.DeviceGet(&dev, 0), "cuDeviceGet");
    check(api_.DeviceGetAttribute(&major, 75, dev), "compute capability");  // ..._MAJOR
    check(api_.DeviceGetAttribute(&minor, 76, dev), "compute capability");  // ..._MINOR
    check(api_.DevicePrimaryCtxRetain(&ctx_, dev), "cuDevicePrimaryCtxRetain");
    check(api_.CtxSetCurrent(ctx_), "cuCtxSetCurrent");
    std::string cubin = compile(major, minor);
    check(api_.ModuleLoadData(&module_, cubin.data()), "cuModuleLoadData");
    check(api_.ModuleGetFunction(&gemm_, module_, "gemm"), "kernel gemm");
    check(api_.ModuleGetFunction(&activate_, module_, "activate"), "kernel activate");
    check(api_.ModuleGetFunction(&clamp_, module_, "clamp8"), "kernel clamp8");
    check(api_.ModuleGetFunction(&interleave_, module_, "interleave"), "kernel interleave");
    check(api_.StreamCreate(&stream_, 1), "cuStreamCreate");  // CU_STREAM_NON_BLOCKING
  }
  ~Engine() {
    api_.StreamSynchronize(stream_);
    for (CUdeviceptr p : owned_) api_.MemFree(p);
    api_.StreamDestroy(stream_);
    api_.ModuleUnload(module_);
  }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  cudaStream_t stream() const { return stream_; }
  void sync() { check(api_.StreamSynchronize(stream_), "cuStreamSynchronize"); }
  // Device memory, freed with the engine.
  float* alloc(size_t n) {
    CUdeviceptr p = 0;
    check(api_.MemAlloc(&p, n * sizeof(float)), "cuMemAlloc");
    owned_.push_back(p);
    return reinterpret_cast<float*>(static_cast<uintptr_t>(p));
  }
  // Copies in stream order (the host side is pageable: an upload has read it when the call
  // returns; a download is waited for).
  void upload(float* dst, const float* src, size_t n) {
    check(api_.MemcpyHtoDAsync(ptr(dst), src, n * sizeof(float), stream_), "upload");
  }
  void download(float* dst, const float* src, size_t n) {
    check(api_.MemcpyDtoHAsync(dst, ptr(src), n * sizeof(float), stream_), "download");
    sync();
  }
  void gemm(const float* x, int ldx, const float* w, int ldw, float* c, int ldc, int m, int k,
            int n) {
    void* args[] = {&x, &ldx, &w, &ldw, &c, &ldc, &m, &k, &n};
    launch(gemm_, blocks(n, 16), blocks(m, 16), 1, 16, 16, args);
  }
  void activate(float* z, size_t n, bool exact) {
    unsigned long long count = n;
    int e = exact;
    void* args[] = {&z, &count, &e};
    launch(activate_, blocks(n, 256), 1, 1, 256, 1, args);
  }
  void clamp(float* y, size_t n) {
    unsigned long long count = n;
    void* args[] = {&y, &count};
    launch(clamp_, blocks(n, 256), 1, 1, 256, 1, args);
  }
  void interleave(const float* got, float* y, int tp, int m, int hs) {
    void* args[] = {&got, &y, &tp, &m, &hs};
    launch(interleave_, blocks(hs, 128), m, tp, 128, 1, args);
  }

 private:
  static CUdeviceptr ptr(const float* p) { return reinterpret_cast<uintptr_t>(p); }
  static unsigned blocks(size_t n, unsigned per) { return static_cast<unsigned>((n + per - 1) / per); }
  void launch(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
              void** args) {
    if (gx == 0 || gy == 0 || gz == 0) return;
    check(api_.LaunchKernel(f, gx, gy, gz, bx, by, 1, 0, stream_, args, nullptr), "cuLaunchKernel");
  }
  void check(CUresult r, const char* what) {
    if (r == 0) return;
    const char* s = nullptr;
    if (!api_.GetErrorString || api_.GetErrorString(r, &s) != 0 || !s) s = "?";
    std::fprintf(stderr, "tp_pp_mlp: %s: CUDA error %d: %s\n", what, r, s);
    std::exit(2);
  }
  // NVRTC: the kernels as a cubin for sm_<major><minor>, or, where this NVRTC is older than
  // the device, as PTX for an architecture it knows (the driver compiles that for the device).
  std::string compile(int major, int minor) {
    void* lib = nullptr;
    std::string tried;
    std::vector<std::string> names = {"libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"};
    if (const char* p = std::getenv("OXCCL_NVRTC")) names.insert(names.begin(), p);
    for (const auto& n : names) {
      if ((lib = dlopen(n.c_str(), RTLD_NOW | RTLD_LOCAL))) break;
      tried += (tried.empty() ? "" : ", ") + n;
    }
    if (!lib) unavailable("NVRTC not found (tried " + tried + "; set OXCCL_NVRTC to libnvrtc.so)");
    const char* n = "libnvrtc";
    bind(lib, n, "nvrtcCreateProgram", api_.CreateProgram);
    bind(lib, n, "nvrtcCompileProgram", api_.CompileProgram);
    bind(lib, n, "nvrtcGetProgramLogSize", api_.GetProgramLogSize);
    bind(lib, n, "nvrtcGetProgramLog", api_.GetProgramLog);
    bind(lib, n, "nvrtcGetCUBINSize", api_.GetCUBINSize);
    bind(lib, n, "nvrtcGetCUBIN", api_.GetCUBIN);
    bind(lib, n, "nvrtcGetPTXSize", api_.GetPTXSize);
    bind(lib, n, "nvrtcGetPTX", api_.GetPTX);
    bind(lib, n, "nvrtcDestroyProgram", api_.DestroyProgram);
    std::string log, out;
    const std::string sm = std::to_string(major) + std::to_string(minor);
    for (const std::string& arch : {"sm_" + sm, std::string("compute_90"), std::string("compute_80")}) {
      if (!try_compile("--gpu-architecture=" + arch, arch[0] == 's', &out, &log)) continue;
      if (arch[0] == 'c')
        std::fprintf(stderr, "tp_pp_mlp: this NVRTC cannot compile for sm_%s: kernels as PTX for %s\n",
                     sm.c_str(), arch.c_str());
      return out;
    }
    unavailable("compiling the kernels for sm_" + sm + " failed:\n" + log);
  }
  bool try_compile(const std::string& opt, bool cubin, std::string* out, std::string* log) {
    nvrtcProgram prog = nullptr;
    if (api_.CreateProgram(&prog, kSource, "tp_pp_mlp_kernels.cu", 0, nullptr, nullptr) != 0)
      unavailable("nvrtcCreateProgram failed");
    const char* opts[] = {opt.c_str(), "--fmad=false"};
    size_t size = 0;
    bool ok = api_.CompileProgram(prog, 2, opts) == 0;
    if (ok) {
      (cubin ? api_.GetCUBINSize : api_.GetPTXSize)(prog, &size);
      out->assign(size, '\0');  // PTX: its size counts the terminating NUL
      (cubin ? api_.GetCUBIN : api_.GetPTX)(prog, &(*out)[0]);
    } else {
      api_.GetProgramLogSize(prog, &size);
      std::string l(size, '\0');
      api_.GetProgramLog(prog, &l[0]);
      *log += opt + ": " + l.c_str() + "\n";
    }
    api_.DestroyProgram(&prog);
    return ok;
  }

  Api api_{};
  CUcontext ctx_ = nullptr;
  CUmodule module_ = nullptr;
  CUfunction gemm_ = nullptr, activate_ = nullptr, clamp_ = nullptr, interleave_ = nullptr;
  cudaStream_t stream_ = nullptr;
  std::vector<CUdeviceptr> owned_;
};

}  // namespace cuda_engine
