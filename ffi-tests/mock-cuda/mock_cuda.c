/* A stand-in libcuda.so.1 for running the GPU test programs (coll_matrix cuda, cuda_ranks) on a
 * machine without a GPU, to test THEIR logic (shadows, copies, device addresses, in-place offsets,
 * threads and processes, timeouts) with oxccl's host executor (OXCCL_DEVICE=host): "device"
 * memory is host memory, a CUstream is an oxccl host stream (oxcclHostStreamCreate, found at run
 * time in the already loaded libnccl), and an asynchronous copy waits for the stream's earlier
 * work and then copies (stream order kept). Graph capture is not emulated: those calls fail with
 * CUDA_ERROR_NOT_SUPPORTED. Modules are not run: cuLaunchKernel knows the kernels of
 * examples/cuda_engine.h by name and does their arithmetic on the host, in stream order (the
 * image loaded is not looked at; a real one comes from NVRTC). Built by the tests into a
 * directory put on LD_LIBRARY_PATH.
 */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef void* Handle;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_UNKNOWN 999

typedef int (*stream_fn)(void*);
typedef int (*stream_create_fn)(void**);

static void* oxccl(const char* name) {
  void* s = dlsym(RTLD_DEFAULT, name);
  return s;
}

static CUresult host_stream_sync(Handle st) {
  if (!st) return CUDA_SUCCESS;
  stream_fn f;
  void* s = oxccl("oxcclHostStreamSynchronize");
  if (!s) return CUDA_ERROR_UNKNOWN;
  memcpy(&f, &s, sizeof s);
  return f(st) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
}

CUresult cuGetErrorName(CUresult e, const char** s) {
  *s = e == CUDA_SUCCESS ? "CUDA_SUCCESS"
       : e == CUDA_ERROR_NOT_SUPPORTED ? "CUDA_ERROR_NOT_SUPPORTED"
       : e == CUDA_ERROR_OUT_OF_MEMORY ? "CUDA_ERROR_OUT_OF_MEMORY"
                                       : "CUDA_ERROR_MOCK";
  return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = e == CUDA_ERROR_NOT_SUPPORTED ? "not supported by the mock driver" : "mock driver error";
  return CUDA_SUCCESS;
}

CUresult cuInit(unsigned int flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
CUresult cuDeviceGetCount(int* n) { *n = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(int* d, int ordinal) { *d = ordinal; return ordinal == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

static int primary_ctx;
CUresult cuDevicePrimaryCtxRetain(Handle* ctx, int dev) {
  (void)dev;
  *ctx = &primary_ctx;
  return CUDA_SUCCESS;
}
CUresult cuCtxSetCurrent(Handle ctx) { return ctx == &primary_ctx ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
  void* m = NULL;
  if (posix_memalign(&m, 256, bytes ? bytes : 1) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
  *p = (CUdeviceptr)(uintptr_t)m;
  return CUDA_SUCCESS;
}
CUresult cuMemFree_v2(CUdeviceptr p) { free((void*)(uintptr_t)p); return CUDA_SUCCESS; }

CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* s, size_t n) {
  memcpy((void*)(uintptr_t)d, s, n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* s, size_t n, Handle st) {
  CUresult r = host_stream_sync(st);
  if (r == CUDA_SUCCESS) memcpy((void*)(uintptr_t)d, s, n);
  return r;
}
CUresult cuMemcpyDtoH_v2(void* d, CUdeviceptr s, size_t n) {
  memcpy(d, (const void*)(uintptr_t)s, n);
  return CUDA_SUCCESS;
}
CUresult cuMemcpyDtoHAsync_v2(void* d, CUdeviceptr s, size_t n, Handle st) {
  CUresult r = host_stream_sync(st);
  if (r == CUDA_SUCCESS) memcpy(d, (const void*)(uintptr_t)s, n);
  return r;
}

CUresult cuStreamCreate(Handle* st, unsigned int flags) {
  (void)flags;
  stream_create_fn f;
  void* s = oxccl("oxcclHostStreamCreate");
  if (!s) return CUDA_ERROR_UNKNOWN;
  memcpy(&f, &s, sizeof s);
  return f(st) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
}
CUresult cuStreamSynchronize(Handle st) { return host_stream_sync(st); }
CUresult cuStreamDestroy_v2(Handle st) {
  stream_fn f;
  void* s = oxccl("oxcclHostStreamDestroy");
  if (!s) return CUDA_ERROR_UNKNOWN;
  memcpy(&f, &s, sizeof s);
  return f(st) == 0 ? CUDA_SUCCESS : CUDA_ERROR_UNKNOWN;
}

CUresult cuStreamBeginCapture_v2(Handle st, int mode) { (void)st; (void)mode; return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuStreamEndCapture(Handle st, Handle* g) { (void)st; (void)g; return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuGraphInstantiateWithFlags(Handle* e, Handle g, unsigned long long f) {
  (void)e; (void)g; (void)f;
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult cuGraphGetNodes(Handle g, Handle* nodes, size_t* n) { (void)g; (void)nodes; (void)n; return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuGraphLaunch(Handle e, Handle st) { (void)e; (void)st; return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuGraphExecDestroy(Handle e) { (void)e; return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuGraphDestroy(Handle g) { (void)g; return CUDA_ERROR_NOT_SUPPORTED; }

/* A device of compute capability 9.0 (what the example compiles its kernels for), or
 * OXCCL_MOCK_CC (major * 10 + minor: say 129, an architecture NVRTC does not know yet). */
CUresult cuDeviceGetAttribute(int* v, int attr, int dev) {
  if (dev != 0) return CUDA_ERROR_INVALID_VALUE;
  const char* e = getenv("OXCCL_MOCK_CC");
  int cc = e ? atoi(e) : 90;
  if (attr == 75) *v = cc / 10;       /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
  else if (attr == 76) *v = cc % 10;  /* ..._MINOR */
  else return CUDA_ERROR_NOT_SUPPORTED;
  return CUDA_SUCCESS;
}

/* ---- examples/cuda_engine.h's kernels, on the host ---------------------------------------- */

#define ARG(i, type) (*(type*)params[i])

static void k_gemm(void** params) {
  const float* x = ARG(0, const float*);
  int ldx = ARG(1, int);
  const float* w = ARG(2, const float*);
  int ldw = ARG(3, int);
  float* c = ARG(4, float*);
  int ldc = ARG(5, int), m = ARG(6, int), k = ARG(7, int), n = ARG(8, int);
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float s = 0.0f;
      for (int t = 0; t < k; t++) s += x[(size_t)i * ldx + t] * w[(size_t)t * ldw + j];
      c[(size_t)i * ldc + j] = s;
    }
}
static void k_activate(void** params) {
  float* z = ARG(0, float*);
  unsigned long long n = ARG(1, unsigned long long);
  int exact = ARG(2, int);
  for (unsigned long long i = 0; i < n; i++) {
    float v = z[i];
    z[i] = exact ? (v > 0.0f ? v : 0.0f)
                 : 0.5f * v * (1.0f + tanhf(0.7978845608f * (v + 0.044715f * v * v * v)));
  }
}
static void k_clamp8(void** params) {
  float* y = ARG(0, float*);
  unsigned long long n = ARG(1, unsigned long long);
  for (unsigned long long i = 0; i < n; i++) y[i] = fmaxf(-8.0f, fminf(8.0f, y[i]));
}
static void k_interleave(void** params) {
  const float* got = ARG(0, const float*);
  float* y = ARG(1, float*);
  int tp = ARG(2, int), m = ARG(3, int), hs = ARG(4, int);
  for (int t = 0; t < tp; t++)
    for (int i = 0; i < m; i++)
      for (int j = 0; j < hs; j++) y[((size_t)i * tp + t) * hs + j] = got[((size_t)t * m + i) * hs + j];
}

typedef struct {
  const char* name;
  void (*run)(void**);
} Kernel;
static const Kernel kernels[] = {
    {"gemm", k_gemm}, {"activate", k_activate}, {"clamp8", k_clamp8}, {"interleave", k_interleave}};
static int module_token;

CUresult cuModuleLoadData(Handle* module, const void* image) {
  if (!image) return CUDA_ERROR_INVALID_VALUE;
  *module = &module_token;
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(Handle module) { return module == &module_token ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
CUresult cuModuleGetFunction(Handle* f, Handle module, const char* name) {
  if (module != &module_token) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof kernels / sizeof kernels[0]; i++)
    if (strcmp(kernels[i].name, name) == 0) {
      *f = (Handle)&kernels[i];
      return CUDA_SUCCESS;
    }
  return 500; /* CUDA_ERROR_NOT_FOUND */
}
CUresult cuLaunchKernel(Handle f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shmem, Handle st, void** params, void** extra) {
  (void)shmem;
  if (!f || !params || extra || !gx || !gy || !gz || !bx || !by || !bz) return CUDA_ERROR_INVALID_VALUE;
  CUresult r = host_stream_sync(st);
  if (r == CUDA_SUCCESS) ((const Kernel*)f)->run(params);
  return r;
}

/* NVRTC 12 opens libcuda.so.1 when it compiles and asks it for its export table: the mock has
 * none to give (NVRTC then compiles as it does on a machine without a driver). */
CUresult cuGetExportTable(const void** table, const void* id) {
  (void)id;
  if (table) *table = NULL;
  return CUDA_ERROR_NOT_SUPPORTED;
}
