/* Stand-in for <cuda_bf16.h>: nothing of it is needed from C. */
#ifndef OXCCL_TESTS_CUDA_BF16_STUB_H
#define OXCCL_TESTS_CUDA_BF16_STUB_H
#endif
