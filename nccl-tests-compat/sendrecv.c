/* sendrecv_perf: every rank sends to rank+1 and receives from rank-1 (a ring shift) in one group;
 * busbw = algbw. */
#include "common.h"

static void layout(size_t count, int n, perfLayout* L) {
  (void)n;
  L->sendCount = L->recvCount = L->paramCount = count;
  L->sendInplace = L->recvInplace = 0;
}
static double algBytes(const perfLayout* L, size_t ws, int n) { (void)n; return (double)(L->paramCount * ws); }
static double busFactor(int n) { (void)n; return 1.0; }
static int checks(const perfCtx* c, int rank) { (void)c; (void)rank; return 1; }
static double expected(const perfCtx* c, int rank, size_t i) {
  return perfInput(c, i, (rank + c->nranks - 1) % c->nranks);
}
static ncclResult_t run(const perfCtx* c, int rank, const void* s, void* r, ncclRedOp_t op, ncclComm_t comm,
                        cudaStream_t st) {
  (void)op;
  int n = c->nranks;
  ncclResult_t res = ncclGroupStart();
  if (res != ncclSuccess) return res;
  ncclResult_t a = ncclSend(s, c->L.paramCount, c->type, (rank + 1) % n, comm, st);
  ncclResult_t b = ncclRecv(r, c->L.paramCount, c->type, (rank + n - 1) % n, comm, st);
  res = ncclGroupEnd();
  if (a != ncclSuccess) return a;
  if (b != ncclSuccess) return b;
  return res;
}

const perfColl perfTool = {"sendrecv_perf", 0, 0, 0, layout, algBytes, busFactor, checks, expected, run, NULL, NULL};
