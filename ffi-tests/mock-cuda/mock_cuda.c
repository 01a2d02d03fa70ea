/* A stand-in libcuda.so.1 for running the GPU test programs (coll_matrix cuda, cuda_ranks) on a
 * machine without a GPU, to test THEIR logic (shadows, copies, device addresses, in-place offsets,
 * threads and processes, timeouts) with oxccl's host executor (OXCCL_DEVICE=host): "device"
 * memory is host memory, a CUstream is an oxccl host stream (oxcclHostStreamCreate, found at run
 * time in the already loaded libnccl), and an asynchronous copy waits for the stream's earlier
 * work and then copies (stream order kept). Graph capture is not emulated: those calls fail with
 * CUDA_ERROR_NOT_SUPPORTED. Built by tests/ffi.rs into a directory put on LD_LIBRARY_PATH.
 */
#include <dlfcn.h>
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
