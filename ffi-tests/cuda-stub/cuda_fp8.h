/* Stand-in for CUDA's cuda_fp8.h (see cuda_runtime.h here): nccl.h only includes it. */
#ifndef OXCCL_FFI_CUDA_FP8_STUB_H
#define OXCCL_FFI_CUDA_FP8_STUB_H
#endif
