/* Every entry point fed bad input must return the right error code and leave a non-empty
 * ncclGetLastError message, and never crash. Also: ncclGetErrorString for every code and
 * ncclGetVersion. Runs single-process (1- and 2-rank communicators from ncclCommInitAll). */
#include "common.h"

static int passed, failed;

static void expect_impl(ncclResult_t got, ncclResult_t want, const char* call, int line) {
  if (got != want) {
    fprintf(stderr, "FAIL line %d: %s returned %s (%d), expected %s (%d); last error: %s\n", line,
            call, ncclGetErrorString(got), (int)got, ncclGetErrorString(want), (int)want,
            ncclGetLastError(NULL) ? ncclGetLastError(NULL) : "(null)");
    failed++;
    return;
  }
  if (want != ncclSuccess) {
    const char* msg = ncclGetLastError(NULL);
    if (msg == NULL || msg[0] == '\0') {
      fprintf(stderr, "FAIL line %d: %s returned %s but ncclGetLastError is empty\n", line, call,
              ncclGetErrorString(got));
      failed++;
      return;
    }
  }
  passed++;
}
#define EXPECT(call, want) expect_impl((call), (want), #call, __LINE__)

/* For features that may not exist yet: success, or ncclInvalidUsage with a message. */
static void expect_ok_or_not_yet(ncclResult_t got, const char* call, int line) {
  if (got == ncclSuccess) { passed++; return; }
  expect_impl(got, ncclInvalidUsage, call, line);
}
#define EXPECT_OK_OR_NOT_YET(call) expect_ok_or_not_yet((call), #call, __LINE__)

static const ncclDataType_t bad_types[] = {(ncclDataType_t)12, (ncclDataType_t)-1, (ncclDataType_t)1000};
static const ncclRedOp_t bad_ops[] = {(ncclRedOp_t)99, (ncclRedOp_t)-1, ncclNumOps};

/* Every collective / p2p call on `comm` (nranks ranks) with one bad argument at a time. */
static void bad_calls(ncclComm_t comm, int nranks, ncclResult_t want_comm, const char* what) {
  float buf[64], buf2[64];
  (void)what;
  memset(buf, 0, sizeof buf);
  memset(buf2, 0, sizeof buf2);
  ncclComm_t c = comm;
  const ncclResult_t IA = ncclInvalidArgument;
  if (want_comm != ncclSuccess) {
    /* A bad communicator: every call must refuse it. */
    EXPECT(ncclAllReduce(buf, buf2, 4, ncclFloat, ncclSum, c, NULL), want_comm);
    EXPECT(ncclBroadcast(buf, buf2, 4, ncclFloat, 0, c, NULL), want_comm);
    EXPECT(ncclBcast(buf, 4, ncclFloat, 0, c, NULL), want_comm);
    EXPECT(ncclReduce(buf, buf2, 4, ncclFloat, ncclSum, 0, c, NULL), want_comm);
    EXPECT(ncclAllGather(buf, buf2, 4, ncclFloat, c, NULL), want_comm);
    EXPECT(ncclReduceScatter(buf, buf2, 4, ncclFloat, ncclSum, c, NULL), want_comm);
    EXPECT(ncclAlltoAll(buf, buf2, 4, ncclFloat, c, NULL), want_comm);
    EXPECT(ncclGather(buf, buf2, 4, ncclFloat, 0, c, NULL), want_comm);
    EXPECT(ncclScatter(buf, buf2, 4, ncclFloat, 0, c, NULL), want_comm);
    EXPECT(ncclSend(buf, 4, ncclFloat, 0, c, NULL), want_comm);
    EXPECT(ncclRecv(buf, 4, ncclFloat, 0, c, NULL), want_comm);
    int x;
    EXPECT(ncclCommCount(c, &x), want_comm);
    EXPECT(ncclCommUserRank(c, &x), want_comm);
    EXPECT(ncclCommCuDevice(c, &x), want_comm);
    ncclResult_t ae;
    EXPECT(ncclCommGetAsyncError(c, &ae), want_comm);
    ncclRedOp_t op;
    float s = 1;
    EXPECT(ncclRedOpCreatePreMulSum(&op, &s, ncclFloat, ncclScalarHostImmediate, c), want_comm);
    /* (As NCCL's: finalizing or revoking NULL is a no-op.) */
    EXPECT(ncclCommFinalize(c), c == NULL ? ncclSuccess : want_comm);
    EXPECT(ncclCommRevoke(c, 0), c == NULL ? ncclSuccess : want_comm);
    ncclComm_t nc;
    EXPECT(ncclCommSplit(c, 0, 0, &nc, NULL), want_comm);
    void* h;
    EXPECT(ncclCommRegister(c, buf, sizeof buf, &h), want_comm);
    return;
  }
  /* Null buffers with a non-zero count. */
  EXPECT(ncclAllReduce(NULL, buf2, 4, ncclFloat, ncclSum, c, NULL), IA);
  EXPECT(ncclAllReduce(buf, NULL, 4, ncclFloat, ncclSum, c, NULL), IA);
  EXPECT(ncclBroadcast(buf, NULL, 4, ncclFloat, 0, c, NULL), IA);
  EXPECT(ncclBcast(NULL, 4, ncclFloat, 0, c, NULL), IA);
  EXPECT(ncclAllGather(NULL, buf2, 1, ncclFloat, c, NULL), IA);
  EXPECT(ncclAllGather(buf, NULL, 1, ncclFloat, c, NULL), IA);
  EXPECT(ncclReduceScatter(NULL, buf2, 1, ncclFloat, ncclSum, c, NULL), IA);
  EXPECT(ncclReduceScatter(buf, NULL, 1, ncclFloat, ncclSum, c, NULL), IA);
  EXPECT(ncclAlltoAll(NULL, buf2, 1, ncclFloat, c, NULL), IA);
  EXPECT(ncclAlltoAll(buf, NULL, 1, ncclFloat, c, NULL), IA);
  EXPECT(ncclSend(NULL, 4, ncclFloat, 0, c, NULL), IA);
  EXPECT(ncclRecv(NULL, 4, ncclFloat, 0, c, NULL), IA);
  /* Bad datatypes and ops. */
  for (size_t i = 0; i < sizeof bad_types / sizeof bad_types[0]; i++) {
    ncclDataType_t t = bad_types[i];
    EXPECT(ncclAllReduce(buf, buf2, 4, t, ncclSum, c, NULL), IA);
    EXPECT(ncclBroadcast(buf, buf2, 4, t, 0, c, NULL), IA);
    EXPECT(ncclBcast(buf, 4, t, 0, c, NULL), IA);
    EXPECT(ncclReduce(buf, buf2, 4, t, ncclSum, 0, c, NULL), IA);
    EXPECT(ncclAllGather(buf, buf2, 1, t, c, NULL), IA);
    EXPECT(ncclReduceScatter(buf, buf2, 1, t, ncclSum, c, NULL), IA);
    EXPECT(ncclAlltoAll(buf, buf2, 1, t, c, NULL), IA);
    EXPECT(ncclGather(buf, buf2, 1, t, 0, c, NULL), IA);
    EXPECT(ncclScatter(buf, buf2, 1, t, 0, c, NULL), IA);
    EXPECT(ncclSend(buf, 4, t, 0, c, NULL), IA);
    EXPECT(ncclRecv(buf, 4, t, 0, c, NULL), IA);
    ncclRedOp_t op;
    float s = 1;
    EXPECT(ncclRedOpCreatePreMulSum(&op, &s, t, ncclScalarHostImmediate, c), IA);
  }
  for (size_t i = 0; i < sizeof bad_ops / sizeof bad_ops[0]; i++) {
    ncclRedOp_t o = bad_ops[i];
    EXPECT(ncclAllReduce(buf, buf2, 4, ncclFloat, o, c, NULL), IA);
    EXPECT(ncclReduce(buf, buf2, 4, ncclFloat, o, 0, c, NULL), IA);
    EXPECT(ncclReduceScatter(buf, buf2, 1, ncclFloat, o, c, NULL), IA);
    EXPECT(ncclRedOpDestroy(o, c), IA);
  }
  EXPECT(ncclRedOpDestroy(ncclSum, c), IA); /* builtins cannot be destroyed */
  EXPECT(ncclRedOpDestroy(ncclAvg, c), IA);
  /* Bad roots and peers. */
  const int bad_ranks[] = {-1, nranks, nranks + 100};
  for (size_t i = 0; i < sizeof bad_ranks / sizeof bad_ranks[0]; i++) {
    int r = bad_ranks[i];
    EXPECT(ncclBroadcast(buf, buf2, 4, ncclFloat, r, c, NULL), IA);
    EXPECT(ncclBcast(buf, 4, ncclFloat, r, c, NULL), IA);
    EXPECT(ncclReduce(buf, buf2, 4, ncclFloat, ncclSum, r, c, NULL), IA);
    EXPECT(ncclGather(buf, buf2, 1, ncclFloat, r, c, NULL), IA);
    EXPECT(ncclScatter(buf, buf2, 1, ncclFloat, r, c, NULL), IA);
    EXPECT(ncclSend(buf, 4, ncclFloat, r, c, NULL), IA);
    EXPECT(ncclRecv(buf, 4, ncclFloat, r, c, NULL), IA);
  }
  /* A stream that is neither NULL nor an oxccl host stream. */
  struct { int junk[16]; } fake_stream;
  memset(&fake_stream, 0x11, sizeof fake_stream);
  EXPECT(ncclAllReduce(buf, buf2, 4, ncclFloat, ncclSum, c, (cudaStream_t)(void*)&fake_stream), IA);
  /* Query functions with null outputs. */
  EXPECT(ncclCommCount(c, NULL), IA);
  EXPECT(ncclCommUserRank(c, NULL), IA);
  EXPECT(ncclCommCuDevice(c, NULL), IA);
  EXPECT(ncclCommGetAsyncError(c, NULL), IA);
  /* PreMulSum creation. */
  ncclRedOp_t op;
  float s = 2;
  EXPECT(ncclRedOpCreatePreMulSum(NULL, &s, ncclFloat, ncclScalarHostImmediate, c), IA);
  EXPECT(ncclRedOpCreatePreMulSum(&op, NULL, ncclFloat, ncclScalarHostImmediate, c), IA);
  EXPECT(ncclRedOpCreatePreMulSum(&op, &s, ncclFloat, (ncclScalarResidence_t)7, c), IA);
  EXPECT(ncclRedOpCreatePreMulSum(&op, &s, ncclFloat, ncclScalarHostImmediate, c), ncclSuccess);
  EXPECT(ncclRedOpDestroy(op, c), ncclSuccess);
  EXPECT(ncclRedOpDestroy(op, c), IA); /* already destroyed */
  /* Split / register with null outputs. */
  EXPECT(ncclCommSplit(c, 0, 0, NULL, NULL), IA);
  EXPECT(ncclCommRegister(c, buf, sizeof buf, NULL), IA);
}

int main(void) {
  const ncclResult_t IA = ncclInvalidArgument;
  /* Version. */
  int v = 0;
  EXPECT(ncclGetVersion(&v), ncclSuccess);
  if (v != 23203 || v != NCCL_VERSION_CODE) {
    fprintf(stderr, "FAIL ncclGetVersion gave %d, expected 23203\n", v);
    failed++;
  }
  EXPECT(ncclGetVersion(NULL), IA);
  /* Error strings: non-empty, and distinct for the 9 real codes. */
  const char* strs[ncclNumResults];
  for (int i = 0; i < (int)ncclNumResults; i++) {
    strs[i] = ncclGetErrorString((ncclResult_t)i);
    if (!strs[i] || !strs[i][0]) {
      fprintf(stderr, "FAIL ncclGetErrorString(%d) is empty\n", i);
      failed++;
      continue;
    }
    for (int j = 0; j < i; j++)
      if (strs[j] && !strcmp(strs[i], strs[j])) {
        fprintf(stderr, "FAIL ncclGetErrorString(%d) == ncclGetErrorString(%d): %s\n", i, j, strs[i]);
        failed++;
      }
    passed++;
  }
  const int odd_codes[] = {ncclNumResults, -1, 12345};
  for (size_t i = 0; i < 3; i++) {
    const char* s = ncclGetErrorString((ncclResult_t)odd_codes[i]);
    if (!s || !s[0]) {
      fprintf(stderr, "FAIL ncclGetErrorString(%d) is empty\n", odd_codes[i]);
      failed++;
    } else {
      passed++;
    }
  }
  if (strcmp(ncclGetErrorString(ncclSuccess), "no error") != 0) {
    fprintf(stderr, "FAIL ncclGetErrorString(ncclSuccess) = \"%s\", NCCL says \"no error\"\n",
            ncclGetErrorString(ncclSuccess));
    failed++;
  }

  /* Unique ids and init. */
  EXPECT(ncclGetUniqueId(NULL), IA);
  ncclUniqueId id;
  EXPECT(ncclGetUniqueId(&id), ncclSuccess);
  ncclComm_t comm = NULL;
  EXPECT(ncclCommInitRank(NULL, 1, id, 0), IA);
  EXPECT(ncclCommInitRank(&comm, 0, id, 0), IA);
  EXPECT(ncclCommInitRank(&comm, -3, id, 0), IA);
  EXPECT(ncclCommInitRank(&comm, 2, id, 2), IA);
  EXPECT(ncclCommInitRank(&comm, 2, id, -1), IA);
  ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
  cfg.magic = 0x12345678;
  EXPECT(ncclCommInitRankConfig(&comm, 1, id, 0, &cfg), IA);
  ncclConfig_t cfg2 = NCCL_CONFIG_INITIALIZER;
  cfg2.blocking = 7;
  EXPECT(ncclCommInitRankConfig(&comm, 1, id, 0, &cfg2), IA);
  int devs[2] = {0, 1};
  ncclComm_t comms2[2];
  EXPECT(ncclCommInitAll(NULL, 2, devs), IA);
  EXPECT(ncclCommInitAll(comms2, 0, devs), ncclSuccess); /* (as NCCL: nothing made) */
  EXPECT(ncclCommInitAll(comms2, -1, devs), IA);
  int bad_devs[2] = {0, -1};
  EXPECT(ncclCommInitAll(comms2, 2, bad_devs), IA);
  EXPECT(ncclCommInitRankScalable(&comm, 1, 0, 0, &id, NULL), IA); /* no ids */
  EXPECT(ncclCommInitRankScalable(&comm, 1, 0, 1, NULL, NULL), IA);

  /* Memory. */
  EXPECT(ncclMemAlloc(NULL, 64), IA);
  {
    /* Zero bytes: NULL and success (as NCCL's); freeing NULL is a no-op. */
    static int mark;
    void* z = &mark;
    EXPECT(ncclMemAlloc(&z, 0), ncclSuccess);
    EXPECT(z == NULL ? ncclSuccess : ncclInternalError, ncclSuccess);
    EXPECT(ncclMemFree(z), ncclSuccess);
  }

  /* Groups: an end without a start is a usage error. */
  EXPECT(ncclGroupEnd(), ncclInvalidUsage);

  /* Host streams. */
  struct { int junk[16]; } fake;
  memset(&fake, 0x22, sizeof fake);
  EXPECT(oxcclHostStreamCreate(NULL), IA);
  EXPECT(oxcclHostStreamSynchronize((cudaStream_t)(void*)&fake), IA);
  EXPECT(oxcclHostStreamQuery((cudaStream_t)(void*)&fake), IA);
  EXPECT(oxcclHostStreamDestroy((cudaStream_t)(void*)&fake), IA);
  EXPECT(oxcclGetExecutor(NULL), IA);
  int ex = -1;
  EXPECT(oxcclGetExecutor(&ex), ncclSuccess);
  if (ex != 0) {
    fprintf(stderr, "FAIL oxcclGetExecutor gave %d with OXCCL_DEVICE=host (want 0)\n", ex);
    failed++;
  }

  /* Null / foreign / destroyed communicators. */
  bad_calls(NULL, 1, IA, "null comm");
  struct { char junk[4096]; } foreign;
  memset(&foreign, 0x33, sizeof foreign);
  bad_calls((ncclComm_t)(void*)&foreign, 1, IA, "foreign comm");
  EXPECT(ncclCommDestroy((ncclComm_t)(void*)&foreign), IA);
  EXPECT(ncclCommAbort((ncclComm_t)(void*)&foreign), IA);
  /* NCCL treats destroying or aborting NULL as a no-op. */
  EXPECT(ncclCommDestroy(NULL), ncclSuccess);
  EXPECT(ncclCommAbort(NULL), ncclSuccess);

  /* Real communicators with bad arguments. */
  for (int n = 1; n <= 2; n++) {
    ncclComm_t cs[2];
    int d[2] = {0, 1};
    NCCLCHECK(ncclCommInitAll(cs, n, d));
    bad_calls(cs[0], n, ncclSuccess, "good comm");
    /* An error inside a group must not break the group machinery. */
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8];
    EXPECT(ncclGroupStart(), ncclSuccess);
    EXPECT(ncclAllReduce(a, b, 8, (ncclDataType_t)12, ncclSum, cs[0], NULL), IA);
    ncclResult_t ge = ncclGroupEnd();
    if (ge != ncclSuccess && ge != IA) {
      fprintf(stderr, "FAIL ncclGroupEnd after a failed call in the group returned %s\n", ncclGetErrorString(ge));
      failed++;
    }
    /* ...and the communicators still work. */
    float out[2][8];
    NCCLCHECK(ncclGroupStart());
    for (int r = 0; r < n; r++) NCCLCHECK(ncclAllReduce(a, out[r], 8, ncclFloat, ncclSum, cs[r], NULL));
    NCCLCHECK(ncclGroupEnd());
    for (int r = 0; r < n; r++)
      for (int k = 0; k < 8; k++)
        if (out[r][k] != a[k] * (float)n) {
          fprintf(stderr, "FAIL allreduce after errors: rank %d [%d] = %g\n", r, k, out[r][k]);
          failed++;
          break;
        }
    for (int r = 0; r < n; r++) NCCLCHECK(ncclCommDestroy(cs[r]));
    /* Destroyed handles are refused. */
    bad_calls(cs[0], n, IA, "destroyed comm");
    EXPECT(ncclCommDestroy(cs[0]), IA);
  }

  /* Not-yet features answer ncclInvalidUsage (or work). */
  {
    ncclComm_t cs[1];
    int d[1] = {0};
    NCCLCHECK(ncclCommInitAll(cs, 1, d));
    static char winbuf[8192] __attribute__((aligned(4096)));
    ncclWindow_t win = NULL;
    ncclResult_t wr = ncclCommWindowRegister(cs[0], winbuf, sizeof winbuf, &win, NCCL_WIN_DEFAULT);
    expect_ok_or_not_yet(wr, "ncclCommWindowRegister", __LINE__);
    if (wr == ncclSuccess) NCCLCHECK(ncclCommWindowDeregister(cs[0], win));
    NCCLCHECK(ncclCommDestroy(cs[0]));
  }

  printf("bad_input: %d checks passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}
