/* Stand-in for CUDA's cuda_bf16.h (oxccl's ABI tests). */
#ifndef OXCCL_TEST_CUDA_BF16_H
#define OXCCL_TEST_CUDA_BF16_H
typedef struct { unsigned short x; } __nv_bfloat16;
#endif
