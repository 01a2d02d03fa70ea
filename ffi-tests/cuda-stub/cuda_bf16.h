/* Stand-in for CUDA's cuda_bf16.h (see cuda_runtime.h here): nccl.h only includes it. */
#ifndef OXCCL_FFI_CUDA_BF16_STUB_H
#define OXCCL_FFI_CUDA_BF16_STUB_H
#endif
