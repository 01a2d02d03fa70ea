/* Minimal stand-in for <cuda_runtime.h>: just the types nccl.h names, so the perf tools build on
 * machines without a CUDA toolkit. Only used when no real CUDA headers are on the include path. */
#ifndef OXCCL_TESTS_CUDA_RUNTIME_STUB_H
#define OXCCL_TESTS_CUDA_RUNTIME_STUB_H
#define CUDART_VERSION 13000
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef int cudaError_t;
#endif
