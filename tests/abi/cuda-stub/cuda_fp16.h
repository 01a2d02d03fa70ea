/* Stand-in for CUDA's cuda_fp16.h (oxccl's ABI tests). */
#ifndef OXCCL_TEST_CUDA_FP16_H
#define OXCCL_TEST_CUDA_FP16_H
typedef struct { unsigned short x; } __half;
#endif
