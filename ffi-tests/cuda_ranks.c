/* NRANKS ranks on GPU 0, one thread or one forked process per rank, each with its own
 * ncclCommInitRank, running collectives on device buffers: AllReduce (float sum, int32 max),
 * Broadcast (root 1 % n), AllGather (int32), ReduceScatter (float sum), AlltoAll (float) and a ring
 * of ncclSend/ncclRecv in a group, at counts 1, 1000 and 1 << 20 elements; with `grouped`, then
 * GROUPED float sum AllReduces of 1000 elements each in one group (as PyTorch coalesces them: on
 * the CUDA executor one launch whose descriptor needs the kernels' large parameter). Every buffer has guard
 * bytes on both sides; inputs are small integers (float sums are exact), written into a host
 * shadow and copied to the device on the rank's stream; after the stream is synchronized the
 * buffers are copied back and every element, the guards and (out of place) the send buffer are
 * checked against values computed here.
 *
 * usage: cuda_ranks NRANKS threads|processes [inplace] [grouped] [mixed] [timeout=S]
 *   threads    one thread per rank; the unique id from ncclGetUniqueId on the main thread
 *   processes  one forked process per rank; nothing touches CUDA before fork: each child loads
 *              the driver and makes device 0's primary context current itself, and rank 0's
 *              process makes the unique id and passes it to the others in a shared mapping
 *   inplace    AllReduce, Broadcast, AllGather and ReduceScatter in place (AlltoAll and the
 *              send/recv ring have no in-place form and stay out of place)
 *   grouped    also the GROUPED all-reduces in one group
 *   mixed      also collectives and a send/recv ring grouped differently by even and odd ranks
 *              (`mixed_group`; needs 2 ranks or more, and a FIFO smaller than 2 MiB to mean much:
 *              OXCCL_CHUNK_BYTES=65536)
 *   timeout=S  seconds before the ranks are declared hung and killed (default 50)
 * The driver is loaded with dlopen (cuda_driver.h); the CUDA streams are non-blocking. Threads
 * allocate and free device memory only between barriers (cuMemFree may wait for the whole device,
 * including other ranks' kernels waiting on this one).
 * Prints "cuda_ranks: N checks passed, M failed"; exits 0 only when M == 0 and every rank exited
 * 0; 3 when there is no CUDA driver or device; 1 on a timeout (after killing the ranks).
 */
#include "common.h"
#include "cuda_driver.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_RANKS 16
#define PAD 256
#define GUARD 0xA5
#define POISON 0x5A
#define MAX_COUNT ((size_t)1 << 20)

static const size_t counts[] = {1, 1000, MAX_COUNT};

static int nranks, inplace, use_procs, grouped, mixed;
static double timeout_s = 50;
static double deadline; /* now_sec() value */

/* Shared between the ranks (an anonymous shared mapping: it survives fork). */
typedef struct {
  ncclUniqueId id;
  int id_ready;
  long long pass[MAX_RANKS], fail[MAX_RANKS];
} Shared;
static Shared* sh;

typedef struct {
  int rank;
  ncclComm_t comm;
  CUstream st;
  CUdeviceptr dsend, drecv; /* each PAD + MAX_COUNT * nranks * 4 + PAD bytes */
  char *hsend, *hrecv;      /* host shadows of the same size */
  size_t cap;
  long long pass, fail;
  int printed;
} Rank;

static pthread_barrier_t barrier;
static void sync_ranks(void) {
  if (!use_procs) pthread_barrier_wait(&barrier);
}

/* A failed check of rank R (the first 20 printed). */
#define report(R, ...) report_failure((R)->rank, &(R)->fail, &(R)->printed, __VA_ARGS__)

/* ---- values (small integers: exact in float, sums too) ------------------------------------- */
static float fval(int r, size_t i) { return (float)((r * 7 + (int)(i % 4099) * 3) % 16); }
static int32_t ival(int r, size_t i) { return (int32_t)((r * 131 + (int)(i % 4001) * 37) % 2001) - 1000; }
static int32_t gval(int r, size_t i) { return (int32_t)(r * 4194304 + (int)i); }
static float bval(size_t i) { return (float)(i % 4093) + 0.5f; }
static float aval(int src, int dst, size_t i) {
  return (float)((src * MAX_RANKS + dst) * 1024 + (int)(i % 1024));
}

/* ---- buffers --------------------------------------------------------------------------------- */
static float* hsf(Rank* R) { return (float*)(R->hsend + PAD); }
static float* hrf(Rank* R) { return (float*)(R->hrecv + PAD); }
static int32_t* hsi(Rank* R) { return (int32_t*)(R->hsend + PAD); }
static int32_t* hri(Rank* R) { return (int32_t*)(R->hrecv + PAD); }
static void* dsend(Rank* R, size_t off_bytes) { return (void*)(uintptr_t)(R->dsend + PAD + off_bytes); }
static void* drecv(Rank* R, size_t off_bytes) { return (void*)(uintptr_t)(R->drecv + PAD + off_bytes); }

/* Guards around, poison inside, the first sbytes / rbytes of the send / receive buffers' shadows
 * (sbytes 0: the send buffer is not used). */
static void begin(Rank* R, size_t sbytes, size_t rbytes) {
  if (sbytes) {
    memset(R->hsend, GUARD, PAD);
    memset(R->hsend + PAD, POISON, sbytes);
    memset(R->hsend + PAD + sbytes, GUARD, PAD);
  }
  memset(R->hrecv, GUARD, PAD);
  memset(R->hrecv + PAD, POISON, rbytes);
  memset(R->hrecv + PAD + rbytes, GUARD, PAD);
}

/* Shadows -> device, on the rank's stream (ordered before the collective). */
static void upload(Rank* R, size_t sbytes, size_t rbytes) {
  if (sbytes) CUCHECK(cu.MemcpyHtoDAsync(R->dsend, R->hsend, sbytes + 2 * PAD, R->st));
  CUCHECK(cu.MemcpyHtoDAsync(R->drecv, R->hrecv, rbytes + 2 * PAD, R->st));
}

static int guards_ok(const char* p, size_t bytes) {
  for (size_t i = 0; i < PAD; i++)
    if ((unsigned char)p[i] != GUARD || (unsigned char)p[PAD + bytes + i] != GUARD) return 0;
  return 1;
}

/* Wait for the stream, copy the buffers back, check the guards. */
static void finish(Rank* R, size_t sbytes, size_t rbytes, const char* what) {
  CUCHECK(cu.StreamSynchronize(R->st));
  if (sbytes) CUCHECK(cu.MemcpyDtoHAsync(R->hsend, R->dsend, sbytes + 2 * PAD, R->st));
  CUCHECK(cu.MemcpyDtoHAsync(R->hrecv, R->drecv, rbytes + 2 * PAD, R->st));
  CUCHECK(cu.StreamSynchronize(R->st));
  if (sbytes) {
    if (guards_ok(R->hsend, sbytes)) R->pass++;
    else report(R, "%s: bytes around the send buffer were overwritten", what);
  }
  if (guards_ok(R->hrecv, rbytes)) R->pass++;
  else report(R, "%s: bytes around the %s buffer were overwritten", what, sbytes ? "receive" : "in-place");
}

static void check_f(Rank* R, const char* what, const char* buf, size_t j, float got, float want, int* bad) {
  if (got == want) {
    R->pass++;
  } else if ((*bad)++ < 3) {
    report(R, "%s: %s element %zu: got %.9g, expected %.9g", what, buf, j, (double)got, (double)want);
  } else {
    R->fail++;
  }
}

static void check_i(Rank* R, const char* what, const char* buf, size_t j, int32_t got, int32_t want, int* bad) {
  if (got == want) {
    R->pass++;
  } else if ((*bad)++ < 3) {
    report(R, "%s: %s element %zu: got %d, expected %d", what, buf, j, got, want);
  } else {
    R->fail++;
  }
}

static void announce(Rank* R, const char* what) {
  if (R->rank != 0) return;
  fprintf(stderr, "  [rank 0] %s\n", what);
  fflush(stderr);
}

/* ---- the collectives ------------------------------------------------------------------------- */
static void allreduce_sum(Rank* R, size_t n) {
  char what[96];
  snprintf(what, sizeof what, "AllReduce float sum count=%zu%s", n, inplace ? " in-place" : "");
  announce(R, what);
  size_t b = n * 4;
  begin(R, inplace ? 0 : b, b);
  float* in = inplace ? hrf(R) : hsf(R);
  for (size_t i = 0; i < n; i++) in[i] = fval(R->rank, i);
  upload(R, inplace ? 0 : b, b);
  NCCLCHECK(ncclAllReduce(inplace ? drecv(R, 0) : dsend(R, 0), drecv(R, 0), n, ncclFloat32, ncclSum,
                          R->comm, R->st));
  finish(R, inplace ? 0 : b, b, what);
  int bad = 0, bads = 0;
  for (size_t i = 0; i < n; i++) {
    float want = 0;
    for (int p = 0; p < nranks; p++) want += fval(p, i);
    check_f(R, what, "receive", i, hrf(R)[i], want, &bad);
    if (!inplace && hsf(R)[i] != fval(R->rank, i) && bads++ == 0)
      report(R, "%s: send buffer element %zu changed", what, i);
  }
}

static void allreduce_max(Rank* R, size_t n) {
  char what[96];
  snprintf(what, sizeof what, "AllReduce int32 max count=%zu%s", n, inplace ? " in-place" : "");
  announce(R, what);
  size_t b = n * 4;
  begin(R, inplace ? 0 : b, b);
  int32_t* in = inplace ? hri(R) : hsi(R);
  for (size_t i = 0; i < n; i++) in[i] = ival(R->rank, i);
  upload(R, inplace ? 0 : b, b);
  NCCLCHECK(ncclAllReduce(inplace ? drecv(R, 0) : dsend(R, 0), drecv(R, 0), n, ncclInt32, ncclMax,
                          R->comm, R->st));
  finish(R, inplace ? 0 : b, b, what);
  int bad = 0, bads = 0;
  for (size_t i = 0; i < n; i++) {
    int32_t want = ival(0, i);
    for (int p = 1; p < nranks; p++)
      if (ival(p, i) > want) want = ival(p, i);
    check_i(R, what, "receive", i, hri(R)[i], want, &bad);
    if (!inplace && hsi(R)[i] != ival(R->rank, i) && bads++ == 0)
      report(R, "%s: send buffer element %zu changed", what, i);
  }
}

static void broadcast(Rank* R, size_t n) {
  int root = 1 % nranks;
  char what[96];
  snprintf(what, sizeof what, "Broadcast float root=%d count=%zu%s", root, n, inplace ? " in-place" : "");
  announce(R, what);
  size_t b = n * 4;
  begin(R, inplace ? 0 : b, b);
  float* in = inplace ? hrf(R) : hsf(R);
  /* Non-root ranks' inputs are not read: out of place they hold other values, in place poison. */
  if (R->rank == root) for (size_t i = 0; i < n; i++) in[i] = bval(i);
  else if (!inplace) for (size_t i = 0; i < n; i++) in[i] = -fval(R->rank, i) - 1;
  upload(R, inplace ? 0 : b, b);
  NCCLCHECK(ncclBroadcast(inplace ? drecv(R, 0) : dsend(R, 0), drecv(R, 0), n, ncclFloat32, root,
                          R->comm, R->st));
  finish(R, inplace ? 0 : b, b, what);
  int bad = 0;
  for (size_t i = 0; i < n; i++) check_f(R, what, "receive", i, hrf(R)[i], bval(i), &bad);
}

static void allgather(Rank* R, size_t n) {
  char what[96];
  snprintf(what, sizeof what, "AllGather int32 count=%zu%s", n, inplace ? " in-place" : "");
  announce(R, what);
  size_t b = n * 4, rb = (size_t)nranks * b;
  begin(R, inplace ? 0 : b, rb);
  int32_t* in = inplace ? hri(R) + (size_t)R->rank * n : hsi(R);
  for (size_t i = 0; i < n; i++) in[i] = gval(R->rank, i);
  upload(R, inplace ? 0 : b, rb);
  NCCLCHECK(ncclAllGather(inplace ? drecv(R, (size_t)R->rank * b) : dsend(R, 0), drecv(R, 0), n,
                          ncclInt32, R->comm, R->st));
  finish(R, inplace ? 0 : b, rb, what);
  int bad = 0;
  for (int p = 0; p < nranks; p++)
    for (size_t i = 0; i < n; i++)
      check_i(R, what, "receive", (size_t)p * n + i, hri(R)[(size_t)p * n + i], gval(p, i), &bad);
  if (!inplace)
    for (size_t i = 0; i < n; i++)
      if (hsi(R)[i] != gval(R->rank, i)) {
        report(R, "%s: send buffer element %zu changed", what, i);
        break;
      }
}

static void reducescatter(Rank* R, size_t n) {
  char what[96];
  snprintf(what, sizeof what, "ReduceScatter float sum count=%zu%s", n, inplace ? " in-place" : "");
  announce(R, what);
  size_t b = n * 4, sb = (size_t)nranks * b;
  size_t total = (size_t)nranks * n;
  /* In place: the receive buffer is slice `rank` of the (n * count) input. */
  begin(R, inplace ? 0 : sb, inplace ? sb : b);
  float* in = inplace ? hrf(R) : hsf(R);
  for (size_t j = 0; j < total; j++) in[j] = fval(R->rank, j);
  upload(R, inplace ? 0 : sb, inplace ? sb : b);
  NCCLCHECK(ncclReduceScatter(inplace ? drecv(R, 0) : dsend(R, 0),
                              inplace ? drecv(R, (size_t)R->rank * b) : drecv(R, 0), n, ncclFloat32,
                              ncclSum, R->comm, R->st));
  finish(R, inplace ? 0 : sb, inplace ? sb : b, what);
  const float* out = inplace ? hrf(R) + (size_t)R->rank * n : hrf(R);
  int bad = 0;
  for (size_t i = 0; i < n; i++) {
    size_t j = (size_t)R->rank * n + i;
    float want = 0;
    for (int p = 0; p < nranks; p++) want += fval(p, j);
    check_f(R, what, "receive", i, out[i], want, &bad);
  }
  if (!inplace)
    for (size_t j = 0; j < total; j++)
      if (hsf(R)[j] != fval(R->rank, j)) {
        report(R, "%s: send buffer element %zu changed", what, j);
        break;
      }
}

static void alltoall(Rank* R, size_t n) {
  char what[96];
  snprintf(what, sizeof what, "AlltoAll float count=%zu", n);
  announce(R, what);
  size_t b = (size_t)nranks * n * 4;
  begin(R, b, b);
  for (int d = 0; d < nranks; d++)
    for (size_t i = 0; i < n; i++) hsf(R)[(size_t)d * n + i] = aval(R->rank, d, i);
  upload(R, b, b);
  NCCLCHECK(ncclAlltoAll(dsend(R, 0), drecv(R, 0), n, ncclFloat32, R->comm, R->st));
  finish(R, b, b, what);
  int bad = 0;
  for (int s = 0; s < nranks; s++)
    for (size_t i = 0; i < n; i++)
      check_f(R, what, "receive", (size_t)s * n + i, hrf(R)[(size_t)s * n + i], aval(s, R->rank, i), &bad);
  for (int d = 0; d < nranks; d++)
    for (size_t i = 0; i < n; i++)
      if (hsf(R)[(size_t)d * n + i] != aval(R->rank, d, i)) {
        report(R, "%s: send buffer element %zu changed", what, (size_t)d * n + i);
        d = nranks;
        break;
      }
}

static void sendrecv_ring(Rank* R, size_t n) {
  char what[96];
  snprintf(what, sizeof what, "Send/Recv ring int32 count=%zu", n);
  announce(R, what);
  int next = (R->rank + 1) % nranks, prev = (R->rank + nranks - 1) % nranks;
  size_t b = n * 4;
  begin(R, b, b);
  for (size_t i = 0; i < n; i++) hsi(R)[i] = gval(R->rank, i);
  upload(R, b, b);
  NCCLCHECK(ncclGroupStart());
  NCCLCHECK(ncclSend(dsend(R, 0), n, ncclInt32, next, R->comm, R->st));
  NCCLCHECK(ncclRecv(drecv(R, 0), n, ncclInt32, prev, R->comm, R->st));
  NCCLCHECK(ncclGroupEnd());
  finish(R, b, b, what);
  int bad = 0;
  for (size_t i = 0; i < n; i++) check_i(R, what, "receive", i, hri(R)[i], gval(prev, i), &bad);
  for (size_t i = 0; i < n; i++)
    if (hsi(R)[i] != gval(R->rank, i)) {
      report(R, "%s: send buffer element %zu changed", what, i);
      break;
    }
}

#define GROUPED 48

/* GROUPED all-reduces of n elements each, on consecutive parts of the buffers, in one group. */
static void grouped_allreduce(Rank* R, size_t n) {
  char what[96];
  snprintf(what, sizeof what, "AllReduce float sum x%d in one group count=%zu%s", GROUPED, n,
           inplace ? " in-place" : "");
  announce(R, what);
  size_t total = n * GROUPED, b = total * 4;
  begin(R, inplace ? 0 : b, b);
  float* in = inplace ? hrf(R) : hsf(R);
  for (size_t i = 0; i < total; i++) in[i] = fval(R->rank, i);
  upload(R, inplace ? 0 : b, b);
  NCCLCHECK(ncclGroupStart());
  for (int j = 0; j < GROUPED; j++) {
    size_t off = (size_t)j * n * 4;
    NCCLCHECK(ncclAllReduce(inplace ? drecv(R, off) : dsend(R, off), drecv(R, off), n, ncclFloat32,
                            ncclSum, R->comm, R->st));
  }
  NCCLCHECK(ncclGroupEnd());
  finish(R, inplace ? 0 : b, b, what);
  int bad = 0;
  for (size_t i = 0; i < total; i++) {
    float want = 0;
    for (int p = 0; p < nranks; p++) want += fval(p, i);
    check_f(R, what, "receive", i, hrf(R)[i], want, &bad);
  }
}

/* A group of collectives and sends and receives that the ranks group differently: even ranks
 * group an AllReduce (float sum, n), the Send/Recv ring (int32, m), an AllGather (int32, n) and a
 * ReduceScatter (float sum, n); odd ranks make the same collectives one by one, then the ring in a
 * group of its own. With m larger than a connection's FIFO (run it with a small
 * OXCCL_CHUNK_BYTES), an even rank's sends and receives, were they in its AllReduce's launch,
 * would wait for an odd rank's, which come after its AllGather and ReduceScatter, which would
 * wait for the even rank's, queued behind them: a hang (they run beside the collectives, as NCCL
 * runs a group in one kernel). Out of place, on consecutive parts of the buffers. */
static void mixed_group(Rank* R, size_t n, size_t m) {
  char what[128];
  snprintf(what, sizeof what, "AllReduce, Send/Recv ring (count=%zu), AllGather, ReduceScatter, %s count=%zu", m,
           R->rank % 2 ? "one by one" : "in one group", n);
  announce(R, what);
  int next = (R->rank + 1) % nranks, prev = (R->rank + nranks - 1) % nranks;
  size_t o_ag = n * 4, o_rs = o_ag + (size_t)nranks * n * 4, o_p = o_rs + (size_t)nranks * n * 4;
  size_t total = o_p + m * 4;
  SYSCHECK(total + 2 * PAD <= R->cap, "mixed_group: buffers too small");
  begin(R, total, total);
  float* ar = hsf(R);
  int32_t* ag = (int32_t*)(R->hsend + PAD + o_ag);
  float* rs = (float*)(R->hsend + PAD + o_rs);
  int32_t* ring = (int32_t*)(R->hsend + PAD + o_p);
  for (size_t i = 0; i < n; i++) ar[i] = fval(R->rank, i);
  for (size_t i = 0; i < n; i++) ag[i] = gval(R->rank, i);
  for (size_t j = 0; j < (size_t)nranks * n; j++) rs[j] = fval(R->rank, j);
  for (size_t i = 0; i < m; i++) ring[i] = gval(R->rank, i);
  upload(R, total, total);
  int together = R->rank % 2 == 0;
  if (together) NCCLCHECK(ncclGroupStart());
  NCCLCHECK(ncclAllReduce(dsend(R, 0), drecv(R, 0), n, ncclFloat32, ncclSum, R->comm, R->st));
  if (together) {
    NCCLCHECK(ncclSend(dsend(R, o_p), m, ncclInt32, next, R->comm, R->st));
    NCCLCHECK(ncclRecv(drecv(R, o_p), m, ncclInt32, prev, R->comm, R->st));
  }
  NCCLCHECK(ncclAllGather(dsend(R, o_ag), drecv(R, o_ag), n, ncclInt32, R->comm, R->st));
  NCCLCHECK(ncclReduceScatter(dsend(R, o_rs), drecv(R, o_rs), n, ncclFloat32, ncclSum, R->comm, R->st));
  if (!together) {
    NCCLCHECK(ncclGroupStart());
    NCCLCHECK(ncclSend(dsend(R, o_p), m, ncclInt32, next, R->comm, R->st));
    NCCLCHECK(ncclRecv(drecv(R, o_p), m, ncclInt32, prev, R->comm, R->st));
  }
  NCCLCHECK(ncclGroupEnd());
  finish(R, total, total, what);
  int bad = 0;
  for (size_t i = 0; i < n; i++) {
    float want = 0;
    for (int p = 0; p < nranks; p++) want += fval(p, i);
    check_f(R, what, "AllReduce receive", i, hrf(R)[i], want, &bad);
  }
  bad = 0;
  const int32_t* gout = (const int32_t*)(R->hrecv + PAD + o_ag);
  for (int p = 0; p < nranks; p++)
    for (size_t i = 0; i < n; i++)
      check_i(R, what, "AllGather receive", (size_t)p * n + i, gout[(size_t)p * n + i], gval(p, i), &bad);
  bad = 0;
  const float* rout = (const float*)(R->hrecv + PAD + o_rs);
  for (size_t i = 0; i < n; i++) {
    size_t j = (size_t)R->rank * n + i;
    float want = 0;
    for (int p = 0; p < nranks; p++) want += fval(p, j);
    check_f(R, what, "ReduceScatter receive", i, rout[i], want, &bad);
  }
  bad = 0;
  const int32_t* pout = (const int32_t*)(R->hrecv + PAD + o_p);
  for (size_t i = 0; i < m; i++) check_i(R, what, "ring receive", i, pout[i], gval(prev, i), &bad);
}

/* One rank, start to end. The caller made device 0's primary context current. */
static void run_rank(Rank* R, ncclUniqueId id) {
  R->cap = 2 * PAD + (size_t)nranks * MAX_COUNT * 4;
  CUCHECK(cu.MemAlloc(&R->dsend, R->cap));
  CUCHECK(cu.MemAlloc(&R->drecv, R->cap));
  R->hsend = (char*)malloc(R->cap);
  R->hrecv = (char*)malloc(R->cap);
  SYSCHECK(R->hsend && R->hrecv, "malloc");
  CUCHECK(cu.StreamCreate(&R->st, CU_STREAM_NON_BLOCKING));
  NCCLCHECK(ncclCommInitRank(&R->comm, nranks, id, R->rank));
  int cnt = -1, rk = -1;
  NCCLCHECK(ncclCommCount(R->comm, &cnt));
  NCCLCHECK(ncclCommUserRank(R->comm, &rk));
  if (cnt != nranks || rk != R->rank) report(R, "communicator has count %d rank %d", cnt, rk);
  sync_ranks(); /* every rank allocated: no cuMemAlloc while collectives run */

  for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
    size_t n = counts[ci];
    allreduce_sum(R, n);
    allreduce_max(R, n);
    broadcast(R, n);
    allgather(R, n);
    reducescatter(R, n);
    alltoall(R, n);
    sendrecv_ring(R, n);
  }
  if (grouped) grouped_allreduce(R, 1000);
  if (mixed) mixed_group(R, (size_t)1 << 16, (size_t)1 << 19);

  sync_ranks(); /* every rank's collectives are done before anyone frees device memory */
  NCCLCHECK(ncclCommDestroy(R->comm));
  CUCHECK(cu.StreamDestroy(R->st));
  CUCHECK(cu.MemFree(R->dsend));
  CUCHECK(cu.MemFree(R->drecv));
  free(R->hsend);
  free(R->hrecv);
}

/* ---- threads --------------------------------------------------------------------------------- */
static ncclUniqueId thread_id;

static void* thread_main(void* arg) {
  Rank* R = (Rank*)arg;
  cuda_make_current(); /* before any NCCL call on this thread */
  run_rank(R, thread_id);
  return NULL;
}

static int run_threads(void) {
  cuda_load("cuda_ranks");
  cuda_make_current();
  cuda_executor_is_host("cuda_ranks", 1);
  NCCLCHECK(ncclGetUniqueId(&thread_id));
  pthread_barrier_init(&barrier, NULL, (unsigned)nranks);
  static Rank ranks[MAX_RANKS];
  pthread_t th[MAX_RANKS];
  for (int r = 0; r < nranks; r++) {
    ranks[r].rank = r;
    SYSCHECK(pthread_create(&th[r], NULL, thread_main, &ranks[r]) == 0, "pthread_create");
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += (time_t)timeout_s;
  for (int r = 0; r < nranks; r++) {
    int e = pthread_timedjoin_np(th[r], NULL, &ts);
    if (e == ETIMEDOUT) {
      fprintf(stderr, "FAIL cuda_ranks: rank %d (a thread) still running after %.0f s: hung\n", r,
              timeout_s);
      printf("cuda_ranks: timeout (nranks=%d, threads)\n", nranks);
      fflush(NULL);
      _exit(1);
    }
    SYSCHECK(e == 0, "pthread_timedjoin_np");
    sh->pass[r] = ranks[r].pass;
    sh->fail[r] = ranks[r].fail;
  }
  return 0;
}

/* ---- processes ------------------------------------------------------------------------------- */
static int child_main(int r) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the parent */
  if (getppid() == 1) _exit(1);
  cuda_load("cuda_ranks"); /* this process's own CUDA, after fork */
  cuda_make_current();
  cuda_executor_is_host("cuda_ranks", r == 0);
  ncclUniqueId id;
  if (r == 0) {
    NCCLCHECK(ncclGetUniqueId(&sh->id));
    __atomic_store_n(&sh->id_ready, 1, __ATOMIC_RELEASE);
  } else {
    while (!__atomic_load_n(&sh->id_ready, __ATOMIC_ACQUIRE)) {
      if (now_sec() > deadline) {
        fprintf(stderr, "FAIL cuda_ranks: rank %d: no unique id from rank 0\n", r);
        return 1;
      }
      usleep(1000);
    }
  }
  memcpy(&id, &sh->id, sizeof id);
  Rank R;
  memset(&R, 0, sizeof R);
  R.rank = r;
  run_rank(&R, id);
  sh->pass[r] = R.pass;
  sh->fail[r] = R.fail;
  return R.fail ? 1 : 0;
}

static int run_processes(void) {
  pid_t kids[MAX_RANKS];
  int status[MAX_RANKS], done[MAX_RANKS];
  fflush(NULL);
  for (int r = 0; r < nranks; r++) {
    pid_t pid = fork();
    SYSCHECK(pid >= 0, "fork");
    if (pid == 0) {
      int rc = child_main(r);
      fflush(NULL);
      _exit(rc);
    }
    kids[r] = pid;
    done[r] = 0;
  }
  int left = nranks, bad = 0, unavailable = 0;
  while (left > 0) {
    int st = 0;
    pid_t p = waitpid(-1, &st, WNOHANG);
    if (p > 0) {
      for (int r = 0; r < nranks; r++) {
        if (kids[r] != p) continue;
        done[r] = 1;
        status[r] = st;
        left--;
        if (WIFEXITED(st) && WEXITSTATUS(st) == CUDA_UNAVAILABLE) unavailable++;
        if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
          fprintf(stderr, "FAIL rank %d (pid %d): %s %d\n", r, (int)p,
                  WIFEXITED(st) ? "exit status" : "killed by signal",
                  WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
          bad++;
          /* The others may wait for it forever: give them 10 s more at most. */
          if (deadline > now_sec() + 10) deadline = now_sec() + 10;
        }
      }
      continue;
    }
    if (now_sec() > deadline) {
      for (int r = 0; r < nranks; r++)
        if (!done[r]) {
          fprintf(stderr, "FAIL cuda_ranks: rank %d (pid %d) still running at the deadline: killed\n",
                  r, (int)kids[r]);
          kill(kids[r], SIGKILL);
        }
      for (int r = 0; r < nranks; r++)
        if (!done[r]) waitpid(kids[r], &status[r], 0);
      printf("cuda_ranks: timeout (nranks=%d, processes)\n", nranks);
      return 1;
    }
    usleep(5000);
  }
  if (unavailable) {
    fprintf(stderr, "cuda_ranks: no CUDA driver or device\n");
    return CUDA_UNAVAILABLE;
  }
  return bad ? 1 : 0;
}

int main(int argc, char** argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: %s NRANKS threads|processes [inplace] [grouped] [timeout=S]\n", argv[0]);
    return 2;
  }
  nranks = atoi(argv[1]);
  if (nranks < 1 || nranks > MAX_RANKS) {
    fprintf(stderr, "NRANKS must be 1..%d\n", MAX_RANKS);
    return 2;
  }
  if (!strcmp(argv[2], "processes")) use_procs = 1;
  else if (strcmp(argv[2], "threads") != 0) {
    fprintf(stderr, "second argument: threads or processes, not %s\n", argv[2]);
    return 2;
  }
  for (int i = 3; i < argc; i++) {
    if (!strcmp(argv[i], "inplace")) inplace = 1;
    else if (!strcmp(argv[i], "grouped")) grouped = 1;
    else if (!strcmp(argv[i], "mixed")) mixed = 1;
    else if (!strncmp(argv[i], "timeout=", 8)) timeout_s = atof(argv[i] + 8);
    else {
      fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  sh = (Shared*)shared_zeroed(sizeof *sh);
  double t0 = now_sec();
  deadline = t0 + timeout_s;

  int rc = use_procs ? run_processes() : run_threads();
  if (rc == CUDA_UNAVAILABLE) return rc;
  long long pass = 0, fail = 0;
  for (int r = 0; r < nranks; r++) {
    pass += sh->pass[r];
    fail += sh->fail[r];
  }
  printf("cuda_ranks: %lld checks passed, %lld failed (nranks=%d, %s%s, %.1fs)%s\n", pass, fail,
         nranks, use_procs ? "processes" : "threads", inplace ? ", in place" : "", now_sec() - t0,
         rc ? "; some ranks failed or hung" : "");
  return (rc == 0 && fail == 0) ? 0 : 1;
}
