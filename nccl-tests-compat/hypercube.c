/* hypercube_perf: an allgather built from send/recv along the dimensions of a hypercube: at step
 * k every rank swaps the 2^k blocks it holds with rank ^ 2^k. Needs a power-of-two rank count;
 * busbw = algbw * (n-1)/n. Same buffer layout as all_gather_perf. */
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
/* Phase 0 puts our own block in its slot (out of place: a send/recv to ourselves); phase k >= 1
 * swaps the 2^(k-1) blocks we hold with rank ^ 2^(k-1). Each phase depends on the previous one. */
static int nPhases(int n) {
  int p = 1;
  for (int mask = 1; mask < n; mask <<= 1) p++;
  return p;
}

static ncclResult_t runPhase(const perfCtx* c, int rank, const void* s, void* r, ncclComm_t comm,
                             cudaStream_t st, int phase) {
  size_t per = c->L.paramCount, ws = perfWordSize(c->type);
  char* out = r;
  ncclResult_t res, a, b;
  if (phase == 0) {
    if ((const char*)s == out + (size_t)rank * per * ws) return ncclSuccess; /* in place */
    if ((res = ncclGroupStart()) != ncclSuccess) return res;
    a = ncclSend(s, per, c->type, rank, comm, st);
    b = ncclRecv(out + (size_t)rank * per * ws, per, c->type, rank, comm, st);
  } else {
    int mask = 1 << (phase - 1);
    int peer = rank ^ mask;
    size_t mine = (size_t)(rank & ~(mask - 1)), theirs = (size_t)(peer & ~(mask - 1));
    if ((res = ncclGroupStart()) != ncclSuccess) return res;
    a = ncclSend(out + mine * per * ws, per * (size_t)mask, c->type, peer, comm, st);
    b = ncclRecv(out + theirs * per * ws, per * (size_t)mask, c->type, peer, comm, st);
  }
  if ((res = ncclGroupEnd()) != ncclSuccess) return res;
  if (a != ncclSuccess) return a;
  return b;
}

static ncclResult_t run(const perfCtx* c, int rank, const void* s, void* r, ncclRedOp_t op, ncclComm_t comm,
                        cudaStream_t st) {
  (void)op;
  ncclResult_t res;
  for (int ph = 0; ph < nPhases(c->nranks); ph++)
    if ((res = runPhase(c, rank, s, r, comm, st, ph)) != ncclSuccess) return res;
  return ncclSuccess;
}

const perfColl perfTool = {"hypercube_perf", 0, 0, 1, layout, algBytes, busFactor, checks,
                           expected, run, nPhases, runPhase};
