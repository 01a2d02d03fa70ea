/* CUDA graph capture and replay of NCCL collectives: NRANKS ranks on GPU 0, one thread each
 * (ncclCommInitRank), device buffers, non-blocking CUDA streams. Each rank:
 *   1. runs one eager ncclAllReduce (float sum, 4096 elements), checked;
 *   2. captures an ncclAllReduce (float sum, 4096 elements) on its stream into a graph
 *      (cuStreamBeginCapture_v2 .. cuStreamEndCapture), instantiates it, and replays it 5 times:
 *      before each replay new inputs (and poison in the output) are copied to the device on the
 *      stream, outside the graph; after it the output is copied back and checked element by
 *      element, guard bytes too;
 *   3. the same with a group of two all-reduces captured together (ncclGroupStart/End inside the
 *      capture: float sum of 4096 elements and int32 max of 777), replayed 3 times;
 *   4. the same group with its two calls on two streams of one capture (the second stream forked
 *      from the first with an event, as PyTorch's side streams are): in the graph, a copy on the
 *      second stream makes the int32 input before the group and another copies its output after
 *      it, so the replays are right only if the library joined the second stream to its launch
 *      (ordered after the first copy, before the second); replayed 3 times. Then the two
 *      all-reduces as separate calls, the first on the forked stream: the replays must run them
 *      in that order (they share the connections); replayed 3 times. Between those two calls a
 *      third stream captures another graph of the float all-reduce, open at the same time
 *      (interleaved captures: the order of the first graph's calls must hold across it), replayed
 *      once after. Then a group whose second stream does not capture: ncclInvalidUsage (NCCL's
 *      rule), nothing captured;
 *   5. a graph of one all-reduce replayed on the first stream and an eager all-reduce of the
 *      same communicator on the second, one right after the other (either way round) with
 *      nothing of the program's ordering them: both right (they run in issue order, as NCCL's
 *      graph mixing support makes them), 3 rounds each way;
 *   6. a group of the two all-reduces and a send/recv ring (N2 int32 to the next rank, from the
 *      previous one) captured together: with two collective launches, the sends and receives
 *      run on the communicator's side stream, which the capture draws in (forked from the
 *      rank's stream before the collectives, joined back after them); replayed 3 times, every
 *      output checked;
 *   7. a graph of one all-reduce, replayed once (checked), then replayed again after
 *      ncclCommDestroy: that replay must end without a CUDA error and leave the output as it
 *      was (oxccl's graphs keep what their launches read; a communicator that ended makes them
 *      return at once, touching no freed connection). NCCL makes no such promise.
 *   8. an all-reduce whose input is a graph allocation of the capture (cuMemAllocAsync on the
 *      capturing stream, as PyTorch's cudaMallocAsync backend makes tensors; freed in the graph
 *      after it): its address exists only while the graph runs, and the driver's pointer query
 *      may not know it at capture time (the library must not refuse it then); replayed 3 times,
 *      checked. Left out where the driver has no cuMemAllocAsync (the emulated device).
 * Capture mode: THREAD_LOCAL by default. It forbids "unsafe" calls (implicitly synchronizing ones,
 * cuMemAlloc, ...) on the capturing thread, so a library doing one inside ncclAllReduce without
 * relaxing its own thread's mode fails the capture, while other ranks' threads (which may be
 * capturing at the same time) are not affected. GLOBAL (PyTorch's default) also forbids unsafe
 * calls on every other thread of the process while any thread captures, including the library's
 * own background threads; RELAXED forbids nothing. Device memory is allocated before, and copied
 * back after, a barrier around each capture, so the program itself is correct in every mode.
 *
 * usage: cuda_graph NRANKS [thread|global|relaxed] [nograph] [timeout=S]   (default thread, 50 s)
 *   nograph  no capture: each "replay" issues the collectives directly (tests this program's own
 *            logic with a mock driver and oxccl's host executor, tests/ffi.rs)
 * Prints "cuda_graph: N checks passed, M failed"; exits 0 only when M == 0; 3 without a CUDA
 * driver or device; 1 on a timeout.
 */
#include "common.h"
#include "cuda_driver.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <unistd.h>

#define MAX_RANKS 16
#define PAD 256
#define GUARD 0xA5
#define POISON 0x5A
#define N1 4096
#define N2 777
#define REPLAYS 5
#define GROUP_REPLAYS 3

static int nranks;
static int capture_mode = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
static int no_graph;
static double timeout_s = 50;
static ncclUniqueId uid;
static pthread_barrier_t barrier;
/* Captures that failed on some rank (then no rank replays that graph: its peers would wait for
 * the rank that has none until the timeout, hiding the failure). */
static int failed_captures;

typedef struct {
  CUdeviceptr dev; /* PAD + bytes + PAD */
  char* host;      /* shadow, same layout */
  size_t bytes;
} Buf;

typedef struct {
  int rank;
  ncclComm_t comm;
  CUstream st, st2;
  Buf s1, r1, s2, r2;
  Buf stage, out2; /* case 4: the int32 input before the copy into s2; r2 copied after */
  long long pass, fail;
  int printed;
} Rank;

/* A failed check of rank R (the first 20 printed). */
#define report(R, ...) report_failure((R)->rank, &(R)->fail, &(R)->printed, __VA_ARGS__)

static void buf_alloc(Buf* b, size_t bytes) {
  b->bytes = bytes;
  CUCHECK(cu.MemAlloc(&b->dev, bytes + 2 * PAD));
  b->host = (char*)malloc(bytes + 2 * PAD);
  SYSCHECK(b->host != NULL, "malloc");
}
static void buf_free(Buf* b) {
  CUCHECK(cu.MemFree(b->dev));
  free(b->host);
}
static void* buf_dptr(const Buf* b) { return (void*)(uintptr_t)(b->dev + PAD); }
static float* buf_f(const Buf* b) { return (float*)(b->host + PAD); }
static int32_t* buf_i(const Buf* b) { return (int32_t*)(b->host + PAD); }

/* Guards and poison into the shadow (the caller then writes inputs into it). */
static void buf_reset(Buf* b) {
  memset(b->host, GUARD, PAD);
  memset(b->host + PAD, POISON, b->bytes);
  memset(b->host + PAD + b->bytes, GUARD, PAD);
}
static void buf_upload(const Buf* b, CUstream st) {
  CUCHECK(cu.MemcpyHtoDAsync(b->dev, b->host, b->bytes + 2 * PAD, st));
}
static void buf_download(Buf* b, CUstream st) {
  CUCHECK(cu.MemcpyDtoHAsync(b->host, b->dev, b->bytes + 2 * PAD, st));
  CUCHECK(cu.StreamSynchronize(st));
}
static void buf_guards(Rank* R, const Buf* b, const char* what) {
  for (size_t i = 0; i < PAD; i++)
    if ((unsigned char)b->host[i] != GUARD || (unsigned char)b->host[PAD + b->bytes + i] != GUARD) {
      report(R, "%s: bytes around a buffer were overwritten", what);
      return;
    }
  R->pass++;
}

/* Inputs of replay `it` (small integers: float sums are exact). */
static float fin(int r, size_t i, int it) { return (float)((r * 5 + (int)i * 3 + it * 7) % 32); }
static int32_t iin(int r, size_t i, int it) { return (int32_t)((r * 97 + (int)i * 31 + it * 1009) % 4001) - 2000; }

static void set_inputs(Rank* R, int it, int second) {
  buf_reset(&R->s1);
  buf_reset(&R->r1);
  for (size_t i = 0; i < N1; i++) buf_f(&R->s1)[i] = fin(R->rank, i, it);
  buf_upload(&R->s1, R->st);
  buf_upload(&R->r1, R->st);
  if (second) {
    buf_reset(&R->s2);
    buf_reset(&R->r2);
    for (size_t i = 0; i < N2; i++) buf_i(&R->s2)[i] = iin(R->rank, i, it);
    buf_upload(&R->s2, R->st);
    buf_upload(&R->r2, R->st);
  }
}

static void check_outputs(Rank* R, int it, int second, const char* what) {
  char w[128];
  CUCHECK(cu.StreamSynchronize(R->st));
  buf_download(&R->s1, R->st);
  buf_download(&R->r1, R->st);
  snprintf(w, sizeof w, "%s: float sum", what);
  int bad = 0, send_bad = 0;
  for (size_t i = 0; i < N1; i++) {
    float want = 0;
    for (int p = 0; p < nranks; p++) want += fin(p, i, it);
    float got = buf_f(&R->r1)[i];
    if (got == want) R->pass++;
    else if (bad++ < 3) report(R, "%s element %zu: got %.9g, expected %.9g", w, i, (double)got, (double)want);
    else R->fail++;
    if (buf_f(&R->s1)[i] != fin(R->rank, i, it) && !send_bad++) report(R, "%s: send element %zu changed", w, i);
  }
  buf_guards(R, &R->s1, w);
  buf_guards(R, &R->r1, w);
  if (!second) return;
  buf_download(&R->s2, R->st);
  buf_download(&R->r2, R->st);
  snprintf(w, sizeof w, "%s: int32 max", what);
  bad = 0;
  send_bad = 0;
  for (size_t i = 0; i < N2; i++) {
    int32_t want = iin(0, i, it);
    for (int p = 1; p < nranks; p++)
      if (iin(p, i, it) > want) want = iin(p, i, it);
    int32_t got = buf_i(&R->r2)[i];
    if (got == want) R->pass++;
    else if (bad++ < 3) report(R, "%s element %zu: got %d, expected %d", w, i, got, want);
    else R->fail++;
    if (buf_i(&R->s2)[i] != iin(R->rank, i, it) && !send_bad++) report(R, "%s: send element %zu changed", w, i);
  }
  buf_guards(R, &R->s2, w);
  buf_guards(R, &R->r2, w);
}

static void enqueue(Rank* R, int second) {
  if (second) NCCLCHECK(ncclGroupStart());
  NCCLCHECK(ncclAllReduce(buf_dptr(&R->s1), buf_dptr(&R->r1), N1, ncclFloat32, ncclSum, R->comm, R->st));
  if (second) {
    NCCLCHECK(ncclAllReduce(buf_dptr(&R->s2), buf_dptr(&R->r2), N2, ncclInt32, ncclMax, R->comm, R->st));
    NCCLCHECK(ncclGroupEnd());
  }
}

/* Replays graph g (if any) `replays` times with new inputs, checking the float all-reduce and,
 * with `second`, the int32 one; `stage` (with `second`): the int32 input goes to the stage
 * buffer and s2 holds poison until the graph copies it in, and the graph copies r2 to out2
 * (case 4's first graph). */
static void replay(Rank* R, CUgraph g, int replays, int it0, int second, int stage, const char* what) {
  if (!g) return; /* reported by end_capture (here or on another rank) */
  size_t bytes2 = R->s2.bytes + 2 * PAD;
  CUgraphExec ge = NULL;
  CUCHECK(cuda_graph_instantiate(&ge, g));
  for (int k = 0; k < replays; k++) {
    int it = it0 + k;
    set_inputs(R, it, second); /* outside the graph, on the stream */
    if (stage) {
      memcpy(R->stage.host, R->s2.host, bytes2);
      CUCHECK(cu.MemcpyHtoDAsync(R->stage.dev, R->stage.host, bytes2, R->st));
      memset(R->s2.host + PAD, POISON, R->s2.bytes);
      buf_upload(&R->s2, R->st);
      buf_reset(&R->out2);
      buf_upload(&R->out2, R->st);
    }
    CUCHECK(cu.GraphLaunch(ge, R->st));
    char w[128];
    snprintf(w, sizeof w, "%s, replay %d", what, k);
    check_outputs(R, it, second, w); /* downloads r2 into its shadow */
    if (stage) {
      buf_download(&R->out2, R->st);
      if (memcmp(R->out2.host, R->r2.host, bytes2) != 0)
        report(R, "%s: the copy after the group read the int32 output before it was written", w);
      else
        R->pass++;
    }
  }
  CUCHECK(cu.GraphExecDestroy(ge));
}

/* Ends rank R's capture on its stream, then waits for every rank to have ended theirs: the
 * graph, or NULL (after reporting why) when this rank's or another's capture failed. */
static CUgraph end_capture_on(Rank* R, CUstream st, const char* what) {
  CUgraph g = NULL;
  CUresult r = cu.StreamEndCapture(st, &g);
  if (r != CUDA_SUCCESS || !g) {
    report(R, "%s: cuStreamEndCapture: CUDA error %d %s", what, (int)r, cu_err_name(r));
    __atomic_add_fetch(&failed_captures, 1, __ATOMIC_SEQ_CST);
    g = NULL;
  }
  pthread_barrier_wait(&barrier);
  int failed = __atomic_load_n(&failed_captures, __ATOMIC_SEQ_CST);
  pthread_barrier_wait(&barrier); /* all have read it before anyone can add to it again */
  if (failed && g) {
    CUCHECK(cu.GraphDestroy(g));
    g = NULL;
  }
  return g;
}

static CUgraph end_capture(Rank* R, const char* what) { return end_capture_on(R, R->st, what); }

/* Capture (between barriers: no rank allocates or copies synchronously while another captures),
 * instantiate, replay with new inputs each time. */
static void graph_case(Rank* R, int second, int replays, int it0) {
  const char* what = second ? "graph of a group of two all-reduces" : "graph of one all-reduce";
  if (R->rank == 0) {
    fprintf(stderr, "  [rank 0] %s: %s, %d replays\n", what, no_graph ? "nograph" : "capture", replays);
    fflush(stderr);
  }
  if (no_graph) {
    for (int k = 0; k < replays; k++) {
      set_inputs(R, it0 + k, second);
      enqueue(R, second);
      check_outputs(R, it0 + k, second, what);
    }
    return;
  }
  pthread_barrier_wait(&barrier);
  CUCHECK(cu.StreamBeginCapture(R->st, capture_mode));
  enqueue(R, second);
  CUgraph g = end_capture(R, what);
  if (!g) return; /* on every rank (end_capture) */
  size_t nodes = 0;
  if (cu.GraphGetNodes && cu.GraphGetNodes(g, NULL, &nodes) == CUDA_SUCCESS) {
    if (nodes == 0) report(R, "%s: the captured graph is empty (the collective ran outside it?)", what);
    else R->pass++;
    if (R->rank == 0) fprintf(stderr, "  [rank 0] %s: %zu nodes captured\n", what, nodes);
  }
  replay(R, g, replays, it0, second, 0, what);
  CUCHECK(cu.GraphDestroy(g));
}

/* Case 4 (see the top): calls of one communicator on two streams of one capture. */
static void two_stream_case(Rank* R, int replays, int it0) {
  const char* what = "graph of a group on two streams";
  const char* what2 = "graph of two calls on forked streams";
  if (no_graph || !cu.EventCreate || !cu.EventRecord || !cu.StreamWaitEvent || !cu.MemcpyDtoDAsync) {
    if (R->rank == 0) fprintf(stderr, "  [rank 0] %s: skipped (no capture or no events)\n", what);
    return;
  }
  if (R->rank == 0) {
    fprintf(stderr, "  [rank 0] %s, %s, and a refused group: capture, %d replays\n", what, what2, replays);
    fflush(stderr);
  }
  CUevent fork, join;
  CUCHECK(cu.EventCreate(&fork, 2 /* CU_EVENT_DISABLE_TIMING */));
  CUCHECK(cu.EventCreate(&join, 2));
  size_t bytes2 = R->s2.bytes + 2 * PAD;

  /* 4a. One group, its calls on the two streams, with a copy before and after on the second. */
  pthread_barrier_wait(&barrier);
  CUCHECK(cu.StreamBeginCapture(R->st, capture_mode));
  CUCHECK(cu.EventRecord(fork, R->st));
  CUCHECK(cu.StreamWaitEvent(R->st2, fork, 0));
  CUCHECK(cu.MemcpyDtoDAsync(R->s2.dev, R->stage.dev, bytes2, R->st2));
  NCCLCHECK(ncclGroupStart());
  NCCLCHECK(ncclAllReduce(buf_dptr(&R->s1), buf_dptr(&R->r1), N1, ncclFloat32, ncclSum, R->comm, R->st));
  NCCLCHECK(ncclAllReduce(buf_dptr(&R->s2), buf_dptr(&R->r2), N2, ncclInt32, ncclMax, R->comm, R->st2));
  NCCLCHECK(ncclGroupEnd());
  CUCHECK(cu.MemcpyDtoDAsync(R->out2.dev, R->r2.dev, bytes2, R->st2));
  CUCHECK(cu.EventRecord(join, R->st2));
  CUCHECK(cu.StreamWaitEvent(R->st, join, 0));
  CUgraph g = end_capture(R, what);
  replay(R, g, replays, it0, 1, 1, what);
  if (g) CUCHECK(cu.GraphDestroy(g));

  /* 4b. Two calls, not grouped: the first on the forked stream, the second on the first stream.
   * They share the communicator's connections, so the replay must run them in that order (on
   * every rank), not side by side. Between them, another graph's capture (on `apart`) takes a
   * call of the communicator, and stays open until after the second call. */
  CUstream apart;
  CUCHECK(cu.StreamCreate(&apart, CU_STREAM_NON_BLOCKING));
  pthread_barrier_wait(&barrier);
  CUCHECK(cu.StreamBeginCapture(R->st, capture_mode));
  CUCHECK(cu.EventRecord(fork, R->st));
  CUCHECK(cu.StreamWaitEvent(R->st2, fork, 0));
  NCCLCHECK(ncclAllReduce(buf_dptr(&R->s1), buf_dptr(&R->r1), N1, ncclFloat32, ncclSum, R->comm, R->st2));
  CUCHECK(cu.StreamBeginCapture(apart, capture_mode));
  NCCLCHECK(ncclAllReduce(buf_dptr(&R->s1), buf_dptr(&R->r1), N1, ncclFloat32, ncclSum, R->comm, apart));
  NCCLCHECK(ncclAllReduce(buf_dptr(&R->s2), buf_dptr(&R->r2), N2, ncclInt32, ncclMax, R->comm, R->st));
  CUCHECK(cu.EventRecord(join, R->st2));
  CUCHECK(cu.StreamWaitEvent(R->st, join, 0));
  g = end_capture(R, what2);
  CUgraph other = end_capture_on(R, apart, "the graph captured in between");
  replay(R, g, replays, it0 + replays, 1, 0, what2);
  replay(R, other, 1, it0 + 2 * replays, 0, 0, "the graph captured in between");
  if (g) CUCHECK(cu.GraphDestroy(g));
  if (other) CUCHECK(cu.GraphDestroy(other));

  /* 4c. The second stream not in the capture: ncclInvalidUsage, from the call (as NCCL) or from
   * ncclGroupEnd, and nothing captured. */
  pthread_barrier_wait(&barrier);
  CUCHECK(cu.StreamBeginCapture(R->st, capture_mode));
  NCCLCHECK(ncclGroupStart());
  NCCLCHECK(ncclAllReduce(buf_dptr(&R->s1), buf_dptr(&R->r1), N1, ncclFloat32, ncclSum, R->comm, R->st));
  ncclResult_t call = ncclAllReduce(buf_dptr(&R->s2), buf_dptr(&R->r2), N2, ncclInt32, ncclMax, R->comm, apart);
  ncclResult_t end = ncclGroupEnd();
  g = end_capture(R, "a refused group's capture");
  int refused = (call == ncclInvalidUsage || end == ncclInvalidUsage) &&
                (call == ncclSuccess || call == ncclInvalidUsage) && (end == ncclSuccess || end == ncclInvalidUsage);
  if (refused) R->pass++;
  else report(R, "a group on a capturing and a non-capturing stream: the call gave %s and ncclGroupEnd %s, "
              "expected ncclInvalidUsage", ncclGetErrorString(call), ncclGetErrorString(end));
  if (g) CUCHECK(cu.GraphDestroy(g));
  CUCHECK(cu.StreamDestroy(apart));
  if (cu.EventDestroy) {
    CUCHECK(cu.EventDestroy(fork));
    CUCHECK(cu.EventDestroy(join));
  }
  /* The communicator works on: an eager all-reduce. */
  set_inputs(R, it0 + 2 * replays + 1, 0);
  enqueue(R, 0);
  check_outputs(R, it0 + 2 * replays + 1, 0, "eager all-reduce after the refused group");
}

/* Holds a stream 20 ms (a host function in it: it calls no CUDA function). */
static void hold_fn(void* arg) {
  (void)arg;
  usleep(20000);
}

/* Case 5 (see the top): replays and eager calls one after the other on two streams. */
static void mixing_case(Rank* R, int replays, int it0) {
  const char* what = "a graph's replays and eager calls on another stream, unordered by the program";
  if (no_graph) return;
  if (R->rank == 0) {
    fprintf(stderr, "  [rank 0] %s: %d rounds each way\n", what, replays);
    fflush(stderr);
  }
  pthread_barrier_wait(&barrier);
  CUCHECK(cu.StreamBeginCapture(R->st, capture_mode));
  NCCLCHECK(ncclAllReduce(buf_dptr(&R->s1), buf_dptr(&R->r1), N1, ncclFloat32, ncclSum, R->comm, R->st));
  CUgraph g = end_capture(R, what);
  if (!g) return; /* on every rank (end_capture) */
  CUgraphExec ge = NULL;
  CUCHECK(cuda_graph_instantiate(&ge, g));
  for (int k = 0; k < 2 * replays; k++) {
    int it = it0 + k;
    set_inputs(R, it, 1);
    CUCHECK(cu.StreamSynchronize(R->st)); /* the inputs are in place for both streams */
    /* Rank 0 holds the stream of the first of the two a while: without their order it would
     * run the second while the other ranks run the first, on the same connections. */
    if (R->rank == 0 && cu.LaunchHostFunc)
      CUCHECK(cu.LaunchHostFunc(k % 2 == 0 ? R->st : R->st2, hold_fn, NULL));
    if (k % 2 == 0) CUCHECK(cu.GraphLaunch(ge, R->st));
    NCCLCHECK(ncclAllReduce(buf_dptr(&R->s2), buf_dptr(&R->r2), N2, ncclInt32, ncclMax, R->comm, R->st2));
    if (k % 2 == 1) CUCHECK(cu.GraphLaunch(ge, R->st));
    CUCHECK(cu.StreamSynchronize(R->st2));
    char w[160];
    snprintf(w, sizeof w, "%s, %s, round %d", what, k % 2 ? "eager first" : "replay first", k / 2);
    check_outputs(R, it, 1, w);
  }
  CUCHECK(cu.GraphExecDestroy(ge));
  CUCHECK(cu.GraphDestroy(g));
}

/* Case 6 (see the top): the two all-reduces and a send/recv ring in one group. The ring sends
 * from `stage` and receives into `out2` (free after case 4). */
static void enqueue_mixed(Rank* R) {
  int next = (R->rank + 1) % nranks, prev = (R->rank + nranks - 1) % nranks;
  NCCLCHECK(ncclGroupStart());
  enqueue(R, 1);
  NCCLCHECK(ncclSend(buf_dptr(&R->stage), N2, ncclInt32, next, R->comm, R->st));
  NCCLCHECK(ncclRecv(buf_dptr(&R->out2), N2, ncclInt32, prev, R->comm, R->st));
  NCCLCHECK(ncclGroupEnd());
}

static void mixed_case(Rank* R, int replays, int it0) {
  const char* what = "graph of two all-reduces and a send/recv ring in one group";
  if (R->rank == 0) {
    fprintf(stderr, "  [rank 0] %s: %s, %d replays\n", what, no_graph ? "nograph" : "capture", replays);
    fflush(stderr);
  }
  int prev = (R->rank + nranks - 1) % nranks;
  CUgraphExec ge = NULL;
  if (!no_graph) {
    pthread_barrier_wait(&barrier);
    CUCHECK(cu.StreamBeginCapture(R->st, capture_mode));
    enqueue_mixed(R);
    CUgraph g = end_capture(R, what);
    if (!g) return; /* on every rank (end_capture) */
    CUCHECK(cuda_graph_instantiate(&ge, g));
    CUCHECK(cu.GraphDestroy(g));
  }
  for (int k = 0; k < replays; k++) {
    int it = it0 + k;
    set_inputs(R, it, 1);
    buf_reset(&R->stage);
    for (size_t i = 0; i < N2; i++) buf_i(&R->stage)[i] = iin(R->rank, i, it + 500);
    buf_upload(&R->stage, R->st);
    buf_reset(&R->out2);
    buf_upload(&R->out2, R->st);
    if (ge) CUCHECK(cu.GraphLaunch(ge, R->st));
    else enqueue_mixed(R);
    char w[128];
    snprintf(w, sizeof w, "%s, replay %d", what, k);
    check_outputs(R, it, 1, w);
    buf_download(&R->out2, R->st);
    int bad = 0;
    for (size_t i = 0; i < N2; i++) {
      int32_t got = buf_i(&R->out2)[i], want = iin(prev, i, it + 500);
      if (got == want) R->pass++;
      else if (bad++ < 3) report(R, "%s: ring element %zu: got %d, expected %d", w, i, got, want);
      else R->fail++;
    }
    buf_guards(R, &R->out2, w);
  }
  if (ge) CUCHECK(cu.GraphExecDestroy(ge));
}

/* Case 7 (see the top): captures a graph of one all-reduce and replays it once, checked; the
 * caller destroys the communicator and calls destroyed_replay. NULL where nothing was captured. */
static CUgraphExec graph_for_later(Rank* R, int it) {
  const char* what = "graph replayed after ncclCommDestroy";
  if (R->rank == 0) {
    fprintf(stderr, "  [rank 0] %s\n", what);
    fflush(stderr);
  }
  pthread_barrier_wait(&barrier);
  CUCHECK(cu.StreamBeginCapture(R->st, capture_mode));
  enqueue(R, 0);
  CUgraph g = end_capture(R, what);
  if (!g) return NULL;
  CUgraphExec ge = NULL;
  CUCHECK(cuda_graph_instantiate(&ge, g));
  CUCHECK(cu.GraphDestroy(g)); /* the instance keeps what the graph held */
  set_inputs(R, it, 0);
  CUCHECK(cu.GraphLaunch(ge, R->st));
  check_outputs(R, it, 0, what);
  return ge;
}

static void destroyed_replay(Rank* R, CUgraphExec ge) {
  const char* what = "graph replayed after ncclCommDestroy";
  set_inputs(R, 61, 0); /* poison in the output */
  char* before = (char*)malloc(R->r1.bytes + 2 * PAD);
  SYSCHECK(before != NULL, "malloc");
  memcpy(before, R->r1.host, R->r1.bytes + 2 * PAD);
  CUresult r = cu.GraphLaunch(ge, R->st);
  if (r == CUDA_SUCCESS) r = cu.StreamSynchronize(R->st);
  if (r != CUDA_SUCCESS) {
    report(R, "%s: CUDA error %d %s", what, (int)r, cu_err_name(r));
  } else {
    R->pass++;
    buf_download(&R->r1, R->st);
    if (memcmp(before, R->r1.host, R->r1.bytes + 2 * PAD) != 0) report(R, "%s: it wrote the output", what);
    else R->pass++;
  }
  free(before);
  CUCHECK(cu.GraphExecDestroy(ge));
}

/* Case 8 (see the top). */
static void graph_alloc_case(Rank* R, int replays, int it0) {
  const char* what = "graph of an all-reduce of a graph allocation (cuMemAllocAsync)";
  if (no_graph || !cu.MemAllocAsync || !cu.MemFreeAsync || !cu.MemcpyDtoDAsync) {
    if (R->rank == 0) fprintf(stderr, "  [rank 0] %s: left out (nograph, or no cuMemAllocAsync)\n", what);
    return;
  }
  if (R->rank == 0) {
    fprintf(stderr, "  [rank 0] %s, %d replays\n", what, replays);
    fflush(stderr);
  }
  pthread_barrier_wait(&barrier);
  size_t bytes = N1 * 4;
  CUdeviceptr tmp = 0;
  CUCHECK(cu.StreamBeginCapture(R->st, capture_mode));
  CUCHECK(cu.MemAllocAsync(&tmp, bytes, R->st));
  CUCHECK(cu.MemcpyDtoDAsync(tmp, R->s1.dev + PAD, bytes, R->st));
  NCCLCHECK(ncclAllReduce((void*)(uintptr_t)tmp, buf_dptr(&R->r1), N1, ncclFloat32, ncclSum, R->comm, R->st));
  CUCHECK(cu.MemFreeAsync(tmp, R->st));
  CUgraph g = end_capture(R, what);
  if (!g) return;
  replay(R, g, replays, it0, 0, 0, what);
  CUCHECK(cu.GraphDestroy(g));
}

static void* rank_main(void* arg) {
  Rank* R = (Rank*)arg;
  cuda_make_current(); /* before any NCCL call on this thread */
  buf_alloc(&R->s1, N1 * 4);
  buf_alloc(&R->r1, N1 * 4);
  buf_alloc(&R->s2, N2 * 4);
  buf_alloc(&R->r2, N2 * 4);
  buf_alloc(&R->stage, N2 * 4);
  buf_alloc(&R->out2, N2 * 4);
  CUCHECK(cu.StreamCreate(&R->st, CU_STREAM_NON_BLOCKING));
  CUCHECK(cu.StreamCreate(&R->st2, CU_STREAM_NON_BLOCKING));
  NCCLCHECK(ncclCommInitRank(&R->comm, nranks, uid, R->rank));
  pthread_barrier_wait(&barrier);

  /* Eager first (what a program does before capturing), then the graphs. */
  if (R->rank == 0) {
    fprintf(stderr, "  [rank 0] eager all-reduce\n");
    fflush(stderr);
  }
  set_inputs(R, 100, 0);
  enqueue(R, 0);
  check_outputs(R, 100, 0, "eager all-reduce");
  graph_case(R, 0, REPLAYS, 0);
  graph_case(R, 1, GROUP_REPLAYS, 10);
  two_stream_case(R, GROUP_REPLAYS, 20);
  mixing_case(R, GROUP_REPLAYS, 40);
  mixed_case(R, GROUP_REPLAYS, 50);
  graph_alloc_case(R, GROUP_REPLAYS, 70);
  CUgraphExec later = no_graph ? NULL : graph_for_later(R, 60);

  pthread_barrier_wait(&barrier); /* nobody frees device memory while a peer still runs */
  NCCLCHECK(ncclCommDestroy(R->comm));
  if (later) destroyed_replay(R, later);
  CUCHECK(cu.StreamDestroy(R->st));
  CUCHECK(cu.StreamDestroy(R->st2));
  buf_free(&R->stage);
  buf_free(&R->out2);
  buf_free(&R->s1);
  buf_free(&R->r1);
  buf_free(&R->s2);
  buf_free(&R->r2);
  return NULL;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s NRANKS [thread|global|relaxed] [timeout=S]\n", argv[0]);
    return 2;
  }
  nranks = atoi(argv[1]);
  if (nranks < 1 || nranks > MAX_RANKS) {
    fprintf(stderr, "NRANKS must be 1..%d\n", MAX_RANKS);
    return 2;
  }
  const char* mode_name = "thread-local";
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "thread")) capture_mode = CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
    else if (!strcmp(argv[i], "global")) capture_mode = CU_STREAM_CAPTURE_MODE_GLOBAL, mode_name = "global";
    else if (!strcmp(argv[i], "relaxed")) capture_mode = CU_STREAM_CAPTURE_MODE_RELAXED, mode_name = "relaxed";
    else if (!strcmp(argv[i], "nograph")) no_graph = 1;
    else if (!strncmp(argv[i], "timeout=", 8)) timeout_s = atof(argv[i] + 8);
    else {
      fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  double t0 = now_sec();
  cuda_load("cuda_graph");
  cuda_make_current();
  if (cuda_executor_is_host("cuda_graph", 1) && !no_graph) {
    fprintf(stderr, "cuda_graph: needs real CUDA graphs (the host executor cannot be captured)\n");
    return CUDA_UNAVAILABLE;
  }
  NCCLCHECK(ncclGetUniqueId(&uid));
  pthread_barrier_init(&barrier, NULL, (unsigned)nranks);
  static Rank ranks[MAX_RANKS];
  pthread_t th[MAX_RANKS];
  for (int r = 0; r < nranks; r++) {
    ranks[r].rank = r;
    SYSCHECK(pthread_create(&th[r], NULL, rank_main, &ranks[r]) == 0, "pthread_create");
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += (time_t)timeout_s;
  long long pass = 0, fail = 0;
  for (int r = 0; r < nranks; r++) {
    int e = pthread_timedjoin_np(th[r], NULL, &ts);
    if (e == ETIMEDOUT) {
      fprintf(stderr, "FAIL cuda_graph: rank %d still running after %.0f s: hung\n", r, timeout_s);
      printf("cuda_graph: timeout (nranks=%d)\n", nranks);
      fflush(NULL);
      _exit(1);
    }
    SYSCHECK(e == 0, "pthread_timedjoin_np");
    pass += ranks[r].pass;
    fail += ranks[r].fail;
  }
  printf("cuda_graph: %lld checks passed, %lld failed (nranks=%d, %s%s, %.1fs)\n", pass, fail,
         nranks, no_graph ? "nograph: issued directly" : "capture mode ", no_graph ? "" : mode_name,
         now_sec() - t0);
  return fail == 0 ? 0 : 1;
}
