/* Stand-in for CUDA's cuda.h: the driver types NCCL's device-API headers (nccl_device/*.h) name
 * in host code, so that oxccl's ABI tests can compile those headers without CUDA. */
#ifndef OXCCL_TEST_CUDA_H
#define OXCCL_TEST_CUDA_H
#define CUDA_VERSION 13000
typedef enum CUmemLocationType_enum { CU_MEM_LOCATION_TYPE_INVALID = 0 } CUmemLocationType;
#endif
