/* Stand-in for <cuda_fp16.h>: nothing of it is needed from C. */
#ifndef OXCCL_TESTS_CUDA_FP16_STUB_H
#define OXCCL_TESTS_CUDA_FP16_STUB_H
#endif
