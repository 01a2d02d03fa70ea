/* The few CUDA driver API functions the GPU test programs need, loaded at run time with
 * dlopen("libcuda.so.1"): no CUDA header, no CUDA library at link time, so the programs build on
 * a machine without the CUDA toolkit and fail with a clear message (exit code CUDA_UNAVAILABLE)
 * on one without a driver or device.
 *
 *   cuda_load(prog)       dlopen + dlsym every function, cuInit, device 0's primary context
 *                         (retained); exits CUDA_UNAVAILABLE with a message when any step fails
 *   cuda_make_current()   make that primary context current on the calling thread (before any
 *                         NCCL call on a thread: NCCL binds a communicator to the current device)
 *   CUCHECK(call)         on failure prints the call and the driver's error name and text, exits 1
 *
 *   cuda_executor_is_host(prog, verbose)  which oxccl executor runs the collectives (needs nccl.h first)
 *
 * The programs copy on their ranks' (non-blocking) streams only, never on the legacy default
 * stream: a legacy-stream copy waits for the work of every blocking stream of the context, which
 * with several ranks' threads in one context could include a kernel waiting for this very thread.
 * Host -> device copies from pageable memory are staged before the call returns, device -> host
 * ones to pageable memory have completed when it returns.
 *
 * A CUstream is the same handle as a cudaStream_t (both `struct CUstream_st*`), and a CUdeviceptr
 * is the address a device `void*` holds.
 */
#ifndef OXCCL_FFI_CUDA_DRIVER_H
#define OXCCL_FFI_CUDA_DRIVER_H

#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Exit code of a program that found no usable CUDA driver or device (tests/ffi.rs accepts it on
 * machines without a GPU). */
#define CUDA_UNAVAILABLE 3

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUgraph_st* CUgraph;
typedef struct CUgraphExec_st* CUgraphExec;
typedef struct CUgraphNode_st* CUgraphNode;
typedef struct CUevent_st* CUevent;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CU_STREAM_NON_BLOCKING 1u
/* CUstreamCaptureMode */
#define CU_STREAM_CAPTURE_MODE_GLOBAL 0
#define CU_STREAM_CAPTURE_MODE_THREAD_LOCAL 1
#define CU_STREAM_CAPTURE_MODE_RELAXED 2

typedef struct {
  CUresult (*Init)(unsigned int);
  CUresult (*DeviceGetCount)(int*);
  CUresult (*DeviceGet)(CUdevice*, int);
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*CtxSetCurrent)(CUcontext);
  CUresult (*MemAlloc)(CUdeviceptr*, size_t);
  CUresult (*MemFree)(CUdeviceptr);
  CUresult (*MemcpyHtoD)(CUdeviceptr, const void*, size_t);
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*MemcpyDtoH)(void*, CUdeviceptr, size_t);
  CUresult (*MemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
  CUresult (*StreamCreate)(CUstream*, unsigned int);
  CUresult (*StreamSynchronize)(CUstream);
  CUresult (*StreamDestroy)(CUstream);
  CUresult (*StreamBeginCapture)(CUstream, int);
  CUresult (*StreamEndCapture)(CUstream, CUgraph*);
  CUresult (*GraphInstantiateWithFlags)(CUgraphExec*, CUgraph, unsigned long long);
  CUresult (*GraphInstantiate_v2)(CUgraphExec*, CUgraph, CUgraphNode*, char*, size_t);
  CUresult (*GraphGetNodes)(CUgraph, CUgraphNode*, size_t*);
  CUresult (*GraphLaunch)(CUgraphExec, CUstream);
  CUresult (*GraphExecDestroy)(CUgraphExec);
  CUresult (*GraphDestroy)(CUgraph);
  /* Optional (NULL where the driver lacks them: the mock driver of tests/ffi.rs). */
  CUresult (*EventCreate)(CUevent*, unsigned int);
  CUresult (*EventRecord)(CUevent, CUstream);
  CUresult (*EventDestroy)(CUevent);
  CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned int);
  CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
  CUresult (*LaunchHostFunc)(CUstream, void (*)(void*), void*);
  CUresult (*MemAllocAsync)(CUdeviceptr*, size_t, CUstream);
  CUresult (*MemFreeAsync)(CUdeviceptr, CUstream);
  CUresult (*GetErrorName)(CUresult, const char**);
  CUresult (*GetErrorString)(CUresult, const char**);
} CudaApi;

static CudaApi cu;
static CUdevice cu_dev;
static CUcontext cu_ctx;

static inline const char* cu_err_name(CUresult r) {
  const char* s = NULL;
  if (!cu.GetErrorName || cu.GetErrorName(r, &s) != CUDA_SUCCESS || !s) return "?";
  return s;
}

static inline const char* cu_err_string(CUresult r) {
  const char* s = NULL;
  if (!cu.GetErrorString || cu.GetErrorString(r, &s) != CUDA_SUCCESS || !s) return "?";
  return s;
}

#define CUCHECK(cmd)                                                                          \
  do {                                                                                        \
    CUresult cr_ = (cmd);                                                                     \
    if (cr_ != CUDA_SUCCESS) {                                                                \
      fprintf(stderr, "FAIL %s:%d: %s -> CUDA error %d %s: %s\n", __FILE__, __LINE__, #cmd,   \
              (int)cr_, cu_err_name(cr_), cu_err_string(cr_));                                \
      fflush(stderr);                                                                         \
      exit(1);                                                                                \
    }                                                                                         \
  } while (0)

/* dlsym into a function pointer without a pedantic object-to-function cast warning. */
static inline int cu_sym(void* lib, const char* name, void* fnp, int required, const char* prog) {
  void* s = dlsym(lib, name);
  if (!s && required) {
    fprintf(stderr, "%s: the CUDA driver (libcuda.so.1) lacks %s\n", prog, name);
    fflush(stderr);
    exit(CUDA_UNAVAILABLE);
  }
  memcpy(fnp, &s, sizeof s);
  return s != NULL;
}

/* Load the driver, cuInit, and retain device 0's primary context (not made current: call
 * cuda_make_current on each thread that uses it). */
static inline void cuda_load(const char* prog) {
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    const char* e = dlerror();
    fprintf(stderr,
            "%s: cannot load the CUDA driver libcuda.so.1 (%s): this program needs an NVIDIA GPU "
            "and its driver\n",
            prog, e ? e : "unknown error");
    fflush(stderr);
    exit(CUDA_UNAVAILABLE);
  }
  cu_sym(lib, "cuGetErrorName", &cu.GetErrorName, 1, prog);
  cu_sym(lib, "cuGetErrorString", &cu.GetErrorString, 1, prog);
  cu_sym(lib, "cuInit", &cu.Init, 1, prog);
  cu_sym(lib, "cuDeviceGetCount", &cu.DeviceGetCount, 1, prog);
  cu_sym(lib, "cuDeviceGet", &cu.DeviceGet, 1, prog);
  cu_sym(lib, "cuDevicePrimaryCtxRetain", &cu.DevicePrimaryCtxRetain, 1, prog);
  cu_sym(lib, "cuCtxSetCurrent", &cu.CtxSetCurrent, 1, prog);
  cu_sym(lib, "cuMemAlloc_v2", &cu.MemAlloc, 1, prog);
  cu_sym(lib, "cuMemFree_v2", &cu.MemFree, 1, prog);
  cu_sym(lib, "cuMemcpyHtoD_v2", &cu.MemcpyHtoD, 1, prog);
  cu_sym(lib, "cuMemcpyHtoDAsync_v2", &cu.MemcpyHtoDAsync, 1, prog);
  cu_sym(lib, "cuMemcpyDtoH_v2", &cu.MemcpyDtoH, 1, prog);
  cu_sym(lib, "cuMemcpyDtoHAsync_v2", &cu.MemcpyDtoHAsync, 1, prog);
  cu_sym(lib, "cuStreamCreate", &cu.StreamCreate, 1, prog);
  cu_sym(lib, "cuStreamSynchronize", &cu.StreamSynchronize, 1, prog);
  cu_sym(lib, "cuStreamDestroy_v2", &cu.StreamDestroy, 1, prog);
  cu_sym(lib, "cuStreamBeginCapture_v2", &cu.StreamBeginCapture, 1, prog);
  cu_sym(lib, "cuStreamEndCapture", &cu.StreamEndCapture, 1, prog);
  int have_wf = cu_sym(lib, "cuGraphInstantiateWithFlags", &cu.GraphInstantiateWithFlags, 0, prog);
  int have_v2 = cu_sym(lib, "cuGraphInstantiate_v2", &cu.GraphInstantiate_v2, 0, prog);
  if (!have_wf && !have_v2) {
    fprintf(stderr, "%s: the CUDA driver lacks cuGraphInstantiateWithFlags and cuGraphInstantiate_v2\n",
            prog);
    exit(CUDA_UNAVAILABLE);
  }
  cu_sym(lib, "cuGraphGetNodes", &cu.GraphGetNodes, 0, prog);
  cu_sym(lib, "cuGraphLaunch", &cu.GraphLaunch, 1, prog);
  cu_sym(lib, "cuGraphExecDestroy", &cu.GraphExecDestroy, 1, prog);
  cu_sym(lib, "cuGraphDestroy", &cu.GraphDestroy, 1, prog);
  cu_sym(lib, "cuEventCreate", &cu.EventCreate, 0, prog);
  cu_sym(lib, "cuEventRecord", &cu.EventRecord, 0, prog);
  cu_sym(lib, "cuEventDestroy_v2", &cu.EventDestroy, 0, prog);
  cu_sym(lib, "cuStreamWaitEvent", &cu.StreamWaitEvent, 0, prog);
  cu_sym(lib, "cuMemcpyDtoDAsync_v2", &cu.MemcpyDtoDAsync, 0, prog);
  cu_sym(lib, "cuLaunchHostFunc", &cu.LaunchHostFunc, 0, prog);
  cu_sym(lib, "cuMemAllocAsync", &cu.MemAllocAsync, 0, prog);
  cu_sym(lib, "cuMemFreeAsync", &cu.MemFreeAsync, 0, prog);

  CUresult r = cu.Init(0);
  int ndev = 0;
  if (r == CUDA_SUCCESS) r = cu.DeviceGetCount(&ndev);
  if (r != CUDA_SUCCESS || ndev < 1) {
    fprintf(stderr, "%s: no usable CUDA device (cuInit/cuDeviceGetCount: %d %s: %s; %d devices)\n",
            prog, (int)r, cu_err_name(r), cu_err_string(r), ndev);
    fflush(stderr);
    exit(CUDA_UNAVAILABLE);
  }
  CUCHECK(cu.DeviceGet(&cu_dev, 0));
  CUCHECK(cu.DevicePrimaryCtxRetain(&cu_ctx, cu_dev));
}

/* Counts a failed check of rank `rank` and prints the first 20 (the GPU programs' `report`). */
static void report_failure(int rank, long long* fail, int* printed, const char* fmt, ...)
    __attribute__((unused, format(printf, 4, 5)));
static void report_failure(int rank, long long* fail, int* printed, const char* fmt, ...) {
  (*fail)++;
  if ((*printed)++ >= 20) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "FAIL rank %d: ", rank);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
  fflush(stderr);
}

static inline void cuda_make_current(void) { CUCHECK(cu.CtxSetCurrent(cu_ctx)); }

/* oxccl's executor query, weak so that cuda_ranks and cuda_graph also run against NVIDIA's NCCL
 * (at 1 rank: NCCL refuses two ranks on one GPU). Returns 1 when oxccl's host executor will run
 * the collectives, which is only right with OXCCL_DEVICE=host and a mock driver whose "device"
 * memory is host memory (tests/ffi.rs); exits 1 when oxccl chose its host executor on its own
 * (device buffers would crash it). Prints the library version and executor. */
#pragma weak oxcclGetExecutor
static inline int cuda_executor_is_host(const char* prog, int verbose) {
  int ver = 0, ex = -1;
  ncclGetVersion(&ver);
  if (!oxcclGetExecutor) {
    if (verbose) fprintf(stderr, "%s: NCCL version %d (not oxccl)\n", prog, ver);
    return 0;
  }
  if (oxcclGetExecutor(&ex) != ncclSuccess) {
    fprintf(stderr, "FAIL %s: oxcclGetExecutor failed: %s\n", prog, ncclGetLastError(NULL));
    exit(1);
  }
  if (verbose)
    fprintf(stderr, "%s: oxccl, NCCL version %d, %s executor\n", prog, ver, ex == 1 ? "CUDA" : "host");
  if (ex == 1) return 0;
  const char* dev = getenv("OXCCL_DEVICE");
  if (dev && !strcmp(dev, "host")) return 1;
  fprintf(stderr,
          "FAIL %s: oxccl chose its host executor although the CUDA driver loaded: it cannot work "
          "on device buffers (NCCL_DEBUG=INFO says why it chose)\n",
          prog);
  exit(1);
}

/* Instantiate a graph with whichever entry point the driver has. */
static inline CUresult cuda_graph_instantiate(CUgraphExec* exec, CUgraph g) {
  if (cu.GraphInstantiateWithFlags) return cu.GraphInstantiateWithFlags(exec, g, 0);
  return cu.GraphInstantiate_v2(exec, g, NULL, NULL, 0);
}

#endif
