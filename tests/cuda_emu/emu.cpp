// The kernels of cuda/runner.cu on the host, for tests/cuda_emulated.rs: runner.cu compiled by
// g++ under a few definitions of CUDA's built-ins, as a shared library the test's stand-in
// driver calls from its streams.
//
// A block is one host thread with one CUDA thread in it (blockDim 1): the kernels read their
// place from threadIdx/blockDim and loop over their elements in strides of blockDim, so one
// thread does a block's whole share, its barriers have no one to wait for, and its `__shared__`
// variables are the thread's own. The blocks of a launch run at once, each on its own thread
// (the lanes of a launch wait for one another through their connections, as on a GPU).
//
// What this shows: the runner's logic (descriptors as the executor lays them out, steps,
// slices, counters, the FIFO protocol between lanes and launches, reductions). What it cannot
// show: the GPU's memory model (fences, caches), occupancy, or speed.

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>

#include <string>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
static thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __shared__ static thread_local
#define __grid_constant__
#define __launch_bounds__(...)
#define __CUDACC_EMULATED__ 1

// Each read of a counter in a wait gives the core away now and then: the blocks are threads,
// more of them than cores.
static thread_local unsigned ox_spins;
#define OX_SPIN()                          \
  do {                                     \
    if ((++ox_spins & 15) == 0) sched_yield(); \
  } while (0)

static inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __syncthreads() {}
static inline unsigned atomicCAS(unsigned* p, unsigned expected, unsigned v) {
  __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return expected;
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) {
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned atomicExch(unsigned* p, unsigned v) {
  return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}

#define OX_LARGE 1
#include "runner.cu"

typedef void (*Kernel)(const void*);

template <class P, void (*K)(P)>
static void call(const void* params) {
  P p;
  memcpy(&p, params, sizeof p);
  K(p);
}

static Kernel kernel_named(const char* name) {
  const std::string n = name;
  if (n == "oxccl_run") return call<OxParams, oxccl_run>;
  if (n == "oxccl_local") return call<OxParams, oxccl_local>;
  if (n == "oxccl_run_large") return call<OxParamsLarge, oxccl_run_large>;
  if (n == "oxccl_local_large") return call<OxParamsLarge, oxccl_local_large>;
  if (n == "oxccl_direct4") return call<OxParams, oxccl_direct4>;
  if (n == "oxccl_direct16") return call<OxParams, oxccl_direct16>;
  if (n == "oxccl_copy") return call<OxParams, oxccl_copy>;
  return nullptr;
}

extern "C" {

// The parameter bytes kernel `name` takes; 0 for a name runner.cu has no kernel of.
size_t oxemu_param_bytes(const char* name) {
  if (!kernel_named(name)) return 0;
  return std::string(name).find("_large") != std::string::npos ? sizeof(OxParamsLarge)
                                                               : sizeof(OxParams);
}

// Runs kernel `name` over a grid of gx x gy blocks with `params` (its parameter's bytes), each
// block on a thread of its own; returns when every block has. 0, or -1 for an unknown name.
int oxemu_launch(const char* name, unsigned gx, unsigned gy, unsigned block, const void* params) {
  Kernel k = kernel_named(name);
  if (!k) return -1;
  std::vector<std::thread> blocks;
  for (unsigned y = 0; y < gy; y++) {
    for (unsigned x = 0; x < gx; x++) {
      blocks.emplace_back([=] {
        gridDim.x = gx;
        gridDim.y = gy;
        gridDim.z = 1;
        blockIdx.x = x;
        blockIdx.y = y;
        blockDim.x = 1;
        blockDim.y = 1;
        blockDim.z = 1;
        (void)block;
        k(params);
      });
    }
  }
  for (auto& t : blocks) t.join();
  return 0;
}
}
