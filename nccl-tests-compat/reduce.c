/* reduce_perf: ncclReduce to a root; busbw = algbw. Only the root's output is defined. */
#include "common.h"

static void layout(size_t count, int n, perfLayout* L) {
  (void)n;
  L->sendCount = L->recvCount = L->paramCount = count;
  L->sendInplace = L->recvInplace = 0;
}
static double algBytes(const perfLayout* L, size_t ws, int n) { (void)n; return (double)(L->paramCount * ws); }
static double busFactor(int n) { (void)n; return 1.0; }
static int checks(const perfCtx* c, int rank) { return rank == c->root; }
static double expected(const perfCtx* c, int rank, size_t i) { (void)rank; return perfReduced(c, i); }
static ncclResult_t run(const perfCtx* c, int rank, const void* s, void* r, ncclRedOp_t op, ncclComm_t comm,
                        cudaStream_t st) {
  (void)rank;
  return ncclReduce(s, r, c->L.paramCount, c->type, op, c->root, comm, st);
}

const perfColl perfTool = {"reduce_perf", 1, 1, 0, layout, algBytes, busFactor, checks, expected, run, NULL, NULL};
