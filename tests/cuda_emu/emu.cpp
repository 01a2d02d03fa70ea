// The kernels of cuda/runner.cu on the host, for tests/cuda_emulated.rs: runner.cu compiled by
// g++ under a few definitions of CUDA's built-ins, as a shared library the test's stand-in
// driver calls from its streams.
//
// A block is one host thread running its CUDA threads as fibers (ucontext), OXEMU_THREADS of
// them (default 4): `__shared__` variables are the host thread's own, so the block's fibers
// share them; `__syncthreads` hands over to the next fiber, and a pass of the scheduler takes
// every fiber to its next barrier (alternate passes go in reverse order, so that no thread's
// turn is always first); the kernels' element loops stride by `blockDim`, as on a GPU. Thread 0
// alone waits on counters, yielding the core while it spins. The blocks of a launch run at
// once, each on its own thread (the lanes of a launch wait for one another through their
// connections, as on a GPU), unless OXEMU_RESIDENT caps how many run at once.
//
// What this shows: the runner's logic (descriptors as the executor lays them out, steps,
// slices, counters, the FIFO protocol between lanes and launches, reductions). What it cannot
// show: the GPU's memory model (fences, caches), occupancy (beyond OXEMU_RESIDENT's cap), or
// speed.

#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

struct dim3 {
  unsigned x = 0, y = 0, z = 0;
};
static thread_local dim3 blockIdx, blockDim, gridDim;

// The block's fibers (on its host thread) and the one running.
struct Fiber {
  ucontext_t ctx;
  dim3 idx;
  bool done = false;
  std::vector<char> stack;
};
static thread_local Fiber* ox_fibers;
static thread_local unsigned ox_cur;
static thread_local ucontext_t ox_scheduler;
#define threadIdx (ox_fibers[ox_cur].idx)

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
// To the scheduler, which runs the next fiber; back here when every fiber has reached this
// barrier.
static inline void __syncthreads() { swapcontext(&ox_fibers[ox_cur].ctx, &ox_scheduler); }
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

// Slots the receivers took by reference (the sender's memory, not the slot): the tests count
// them (`oxemu_refs_taken`).
static std::atomic<unsigned long long> ox_refs_taken;
#define OX_TOOK_REF() ox_refs_taken.fetch_add(1)

// The clock a revoking sender bounds its wait by (`ox_revoke`).
#define OX_NOW_NS() \
  ((uint64_t)std::chrono::duration_cast<std::chrono::nanoseconds>( \
       std::chrono::steady_clock::now().time_since_epoch())          \
       .count())

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
  if (n == "oxccl_run_board") return call<OxParams, oxccl_run_board>;
  if (n == "oxccl_run_board_large") return call<OxParamsLarge, oxccl_run_board_large>;
  if (n == "oxccl_local_large") return call<OxParamsLarge, oxccl_local_large>;
  if (n == "oxccl_direct4") return call<OxParams, oxccl_direct4>;
  if (n == "oxccl_direct16") return call<OxParams, oxccl_direct16>;
  if (n == "oxccl_copy") return call<OxParams, oxccl_copy>;
  return nullptr;
}

// The kernel a fiber runs (set by run_block for its fibers).
static thread_local Kernel ox_kernel;
static thread_local const void* ox_params;

static void fiber_main() {
  ox_kernel(ox_params);
  ox_fibers[ox_cur].done = true;
  // Returning resumes the scheduler (uc_link).
}

// One block: `nt` fibers on this thread, run pass by pass until all have ended.
static void run_block(Kernel k, const void* params, dim3 at, dim3 grid, unsigned nt) {
  gridDim = grid;
  blockIdx = at;
  blockDim = dim3{nt, 1, 1};
  ox_kernel = k;
  ox_params = params;
  std::vector<Fiber> fibers(nt);
  ox_fibers = fibers.data();
  for (unsigned t = 0; t < nt; t++) {
    Fiber& f = fibers[t];
    f.idx = dim3{t, 0, 0};
    f.stack.resize(256 << 10);
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack.data();
    f.ctx.uc_stack.ss_size = f.stack.size();
    f.ctx.uc_link = &ox_scheduler;
    makecontext(&f.ctx, fiber_main, 0);
  }
  for (unsigned pass = 0;; pass++) {
    bool any = false;
    for (unsigned i = 0; i < nt; i++) {
      unsigned t = pass % 2 ? nt - 1 - i : i;
      if (fibers[t].done) continue;
      any = true;
      ox_cur = t;
      swapcontext(&ox_scheduler, &fibers[t].ctx);
    }
    if (!any) break;
  }
  ox_fibers = nullptr;
}

extern "C" {

// Slots taken by reference so far, by every launch of this process.
unsigned long long oxemu_refs_taken() { return ox_refs_taken.load(); }

// The parameter bytes kernel `name` takes; 0 for a name runner.cu has no kernel of.
size_t oxemu_param_bytes(const char* name) {
  if (!kernel_named(name)) return 0;
  return std::string(name).find("_large") != std::string::npos ? sizeof(OxParamsLarge)
                                                               : sizeof(OxParams);
}

// The blocks running now, of every launch (OXEMU_RESIDENT).
static std::mutex ox_res_mu;
static std::condition_variable ox_res_cv;
static unsigned ox_res_running;

// Runs kernel `name` over a grid of gx x gy blocks with `params` (its parameter's bytes), each
// block on a thread of its own with OXEMU_THREADS fibers (at most the `block` asked for);
// returns when every block has. 0, or -1 for an unknown name.
int oxemu_launch(const char* name, unsigned gx, unsigned gy, unsigned block, const void* params) {
  Kernel k = kernel_named(name);
  if (!k) return -1;
  const char* env = getenv("OXEMU_THREADS");
  unsigned nt = env ? (unsigned)atoi(env) : 4;
  if (nt < 1) nt = 1;
  if (nt > block) nt = block;
  // OXEMU_RESIDENT=n: at most n blocks (of every launch together) run at once; a launch starts
  // its blocks in the order of their index, each as soon as one has ended, as a GPU whose SMs
  // are full does.
  const char* res = getenv("OXEMU_RESIDENT");
  const unsigned limit = res ? (unsigned)atoi(res) : 0;
  std::vector<std::thread> blocks;
  for (unsigned y = 0; y < gy; y++) {
    for (unsigned x = 0; x < gx; x++) {
      if (limit) {
        std::unique_lock<std::mutex> l(ox_res_mu);
        ox_res_cv.wait(l, [&] { return ox_res_running < limit; });
        ox_res_running++;
      }
      blocks.emplace_back([=] {
        run_block(k, params, dim3{x, y, 0}, dim3{gx, gy, 1}, nt);
        if (limit) {
          std::lock_guard<std::mutex> l(ox_res_mu);
          ox_res_running--;
          ox_res_cv.notify_all();
        }
      });
    }
  }
  for (auto& t : blocks) t.join();
  return 0;
}
}
