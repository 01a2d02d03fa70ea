/* all_gather_perf: ncclAllGather of count/n elements per rank; busbw = algbw * (n-1)/n.
 * In place: each rank's input is its own slot of the receive buffer. */
#include "common.h"

static void layout(size_t count, int n, perfLayout* L) {
  size_t per = count / (size_t)n;
  L->paramCount = L->sendCount = per;
  L->recvCount = per * (size_t)n;
  L->sendInplace = per;
  L->recvInplace = 0;
}
static double algBytes(const perfLayout* L, size_t ws, int n) { return (double)(L->paramCount * ws) * n; }
static double busFactor(int n) { return (double)(n - 1) / n; }
static int checks(const perfCtx* c, int rank) { (void)c; (void)rank; return 1; }
static double expected(const perfCtx* c, int rank, size_t i) {
  (void)rank;
  size_t per = c->L.paramCount;
  return perfInput(c, i % per, (int)(i / per));
}
static ncclResult_t run(const perfCtx* c, int rank, const void* s, void* r, ncclRedOp_t op, ncclComm_t comm,
                        cudaStream_t st) {
  (void)rank; (void)op;
  return ncclAllGather(s, r, c->L.paramCount, c->type, comm, st);
}

const perfColl perfTool = {"all_gather_perf", 0, 0, 0, layout, algBytes, busFactor, checks, expected, run, NULL, NULL};
