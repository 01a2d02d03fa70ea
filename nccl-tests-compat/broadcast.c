/* broadcast_perf: ncclBroadcast from a root; busbw = algbw. */
#include "common.h"

static void layout(size_t count, int n, perfLayout* L) {
  (void)n;
  L->sendCount = L->recvCount = L->paramCount = count;
  L->sendInplace = L->recvInplace = 0;
}
static double algBytes(const perfLayout* L, size_t ws, int n) { (void)n; return (double)(L->paramCount * ws); }
static double busFactor(int n) { (void)n; return 1.0; }
static int checks(const perfCtx* c, int rank) { (void)c; (void)rank; return 1; }
static double expected(const perfCtx* c, int rank, size_t i) { (void)rank; return perfInput(c, i, c->root); }
static ncclResult_t run(const perfCtx* c, int rank, const void* s, void* r, ncclRedOp_t op, ncclComm_t comm,
                        cudaStream_t st) {
  (void)rank; (void)op;
  return ncclBroadcast(s, r, c->L.paramCount, c->type, c->root, comm, st);
}

const perfColl perfTool = {"broadcast_perf", 0, 1, 0, layout, algBytes, busFactor, checks, expected, run, NULL, NULL};
