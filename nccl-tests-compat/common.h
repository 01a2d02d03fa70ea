/* oxccl perf tools: the driver shared by every *_perf program.
 *
 * Written for oxccl from the documented behaviour of NVIDIA's nccl-tests (command line, output
 * table, bus-bandwidth factors); no nccl-tests code is used. The tools call the library only
 * through NCCL's C ABI and link with -lnccl, so LD_LIBRARY_PATH picks the libnccl.so.2 to test. */
#ifndef OXCCL_PERF_COMMON_H
#define OXCCL_PERF_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include "nccl.h"

/* oxccl extensions (declared here too in case the nccl.h in use is NVIDIA's). Weak: absent from
 * NVIDIA's NCCL, against which the same binaries also run (they are only called on oxccl's host
 * executor). */
ncclResult_t oxcclHostStreamCreate(cudaStream_t* stream) __attribute__((weak));
ncclResult_t oxcclHostStreamSynchronize(cudaStream_t stream) __attribute__((weak));
ncclResult_t oxcclHostStreamQuery(cudaStream_t stream) __attribute__((weak));
ncclResult_t oxcclHostStreamDestroy(cudaStream_t stream) __attribute__((weak));
ncclResult_t oxcclGetExecutor(int* executor) __attribute__((weak));

/* Reduction selector used by the tools: NCCL's builtin ops plus "mulsum" (a PreMulSum op that
 * each rank creates with its own scalar), and "none" for collectives without an op. */
enum { PERF_SUM = 0, PERF_PROD = 1, PERF_MAX = 2, PERF_MIN = 3, PERF_AVG = 4, PERF_MULSUM = 5,
       PERF_NUM_OPS = 6, PERF_NO_OP = -1 };

/* Per-rank buffer geometry of one size step, in elements. */
typedef struct {
  size_t sendCount;   /* elements of each rank's input */
  size_t recvCount;   /* elements of each rank's output that are checked */
  size_t paramCount;  /* the count argument given to NCCL (also the table's count column) */
  size_t sendInplace; /* in-place: input lives at recvbuf + sendInplace*rank */
  size_t recvInplace; /* in-place: output lives at recvbuf + recvInplace*rank */
} perfLayout;

/* What a check compares against: the collective gives the expected value of element i of rank
 * `rank`'s output as an exact number (see perfInput / perfReduced). */
typedef struct {
  int nranks;
  ncclDataType_t type;
  int op;        /* PERF_* */
  int root;
  uint64_t seed;
  perfLayout L;
} perfCtx;

/* The (exact, small, integral) value of element i of rank r's input. */
double perfInput(const perfCtx* c, size_t i, int r);
/* The reduction over all ranks of perfInput(c, i, r) under c->op (avg: the exact quotient). */
double perfReduced(const perfCtx* c, size_t i);

typedef struct {
  const char* name;     /* program name, e.g. "all_reduce_perf" */
  int usesOp;           /* has a reduction operator column */
  int usesRoot;         /* has a root */
  int pow2Ranks;        /* needs a power-of-two number of ranks */
  void (*layout)(size_t count, int nranks, perfLayout* L);
  /* bytes used for algbw, and the busbw/algbw factor */
  double (*algBytes)(const perfLayout* L, size_t wordSize, int nranks);
  double (*busFactor)(int nranks);
  /* 1 if rank's output is defined and checked; fills expected value for element i */
  int (*checks)(const perfCtx* c, int rank);
  double (*expected)(const perfCtx* c, int rank, size_t i);
  /* issue the operation for one rank (inside a group when needed) */
  ncclResult_t (*run)(const perfCtx* c, int rank, const void* sendbuf, void* recvbuf,
                      ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  /* Optional: operations made of dependent phases. Each phase is issued for every local rank in
   * its own group (ranks driven by one thread must not merge dependent phases into one group,
   * where operations run concurrently). NULL: one phase, `run`. */
  int (*nPhases)(int nranks);
  ncclResult_t (*runPhase)(const perfCtx* c, int rank, const void* sendbuf, void* recvbuf,
                           ncclComm_t comm, cudaStream_t stream, int phase);
} perfColl;

/* Defined by each tool's own source file. */
extern const perfColl perfTool;

size_t perfWordSize(ncclDataType_t t);

#endif
