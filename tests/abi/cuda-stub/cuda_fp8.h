/* Stand-in for CUDA's cuda_fp8.h (oxccl's ABI tests). */
#ifndef OXCCL_TEST_CUDA_FP8_H
#define OXCCL_TEST_CUDA_FP8_H
typedef struct { unsigned char x; } __nv_fp8_e4m3;
#endif
