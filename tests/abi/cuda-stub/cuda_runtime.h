/* Stand-in for CUDA's cuda_runtime.h: just the types nccl.h uses (oxccl's ABI tests). */
#ifndef OXCCL_TEST_CUDA_RUNTIME_H
#define OXCCL_TEST_CUDA_RUNTIME_H
#define CUDART_VERSION 13000
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#define OXCCL_TEST_CUDA_STUB 1
#endif
