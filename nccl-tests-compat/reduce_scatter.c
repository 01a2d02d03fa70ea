/* reduce_scatter_perf: ncclReduceScatter, count/n elements per rank; busbw = algbw * (n-1)/n.
 * In place: each rank's output is its own slot of the (whole-size) input buffer. */
#include "common.h"

static void layout(size_t count, int n, perfLayout* L) {
  size_t per = count / (size_t)n;
  L->paramCount = L->recvCount = per;
  L->sendCount = per * (size_t)n;
  L->sendInplace = 0;
  L->recvInplace = per;
}
static double algBytes(const perfLayout* L, size_t ws, int n) { return (double)(L->paramCount * ws) * n; }
static double busFactor(int n) { return (double)(n - 1) / n; }
static int checks(const perfCtx* c, int rank) { (void)c; (void)rank; return 1; }
static double expected(const perfCtx* c, int rank, size_t i) {
  return perfReduced(c, (size_t)rank * c->L.paramCount + i);
}
static ncclResult_t run(const perfCtx* c, int rank, const void* s, void* r, ncclRedOp_t op, ncclComm_t comm,
                        cudaStream_t st) {
  (void)rank;
  return ncclReduceScatter(s, r, c->L.paramCount, c->type, op, comm, st);
}

const perfColl perfTool = {"reduce_scatter_perf", 1, 0, 0, layout, algBytes, busFactor, checks, expected, run, NULL, NULL};
