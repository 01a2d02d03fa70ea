/* Minimal stand-in for CUDA's cuda_runtime.h: just what nccl.h needs to compile on a machine
 * without the CUDA toolkit. Used only when the repository has no include/nccl.h yet and the
 * ffi tests compile against NCCL's upstream header. */
#ifndef OXCCL_FFI_CUDA_RUNTIME_STUB_H
#define OXCCL_FFI_CUDA_RUNTIME_STUB_H
#include <stddef.h>
#define CUDART_VERSION 12080
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
typedef enum { cudaSuccess = 0 } cudaError_t;
#endif
