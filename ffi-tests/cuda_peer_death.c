/* A peer process that dies while the other's kernels wait for it: 2 ranks on GPU 0, one forked
 * process each (ncclCommInitRank), device buffers, non-blocking streams. Both run one float sum
 * ncclAllReduce of 1 << 20 elements, checked element by element; then rank 1 kills itself
 * (SIGKILL: no goodbye) and rank 0, 200 ms later, issues the same all-reduce again, whose kernel
 * waits for rank 1 in vain. Rank 0 must then see, within BOUND seconds, ncclRemoteError from
 * ncclCommGetAsyncError with a message (ncclGetLastError) naming rank 1, and its stream must
 * drain (the kernel stops) before it aborts the communicator. NVIDIA's NCCL leaves that kernel
 * spinning for good.
 *
 * usage: cuda_peer_death [eager|graph] [timeout=S]
 *   eager  the all-reduce issued directly both times (default)
 *   graph  captured once into a CUDA graph (thread-local mode) and both runs are replays of it,
 *          which the library does not see launched (only the kernels can say they wait)
 *   timeout=S  seconds before the run is declared hung (default 60)
 * Prints "cuda_peer_death: PASS (...)" and exits 0, or FAIL lines and exits 1; 3 without a CUDA
 * driver or device (and in graph mode where oxccl's host executor runs: it has no graphs).
 */
#include "common.h"
#include "cuda_driver.h"

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#define COUNT ((size_t)1 << 20)
#define BOUND 10.0 /* seconds from the second launch to the error */

typedef struct {
  ncclUniqueId id;
  int id_ready;
  int first_done; /* ranks whose first all-reduce was checked */
  int unavailable;
} Shared;
static Shared* sh;
static int use_graph;
static double deadline;

static float input(int r, size_t i) { return (float)((r * 7 + (int)(i % 13)) % 16); }

static void wait_for(int* what, int value, int r, const char* why) {
  while (__atomic_load_n(what, __ATOMIC_ACQUIRE) < value) {
    if (now_sec() > deadline) {
      fprintf(stderr, "FAIL rank %d: %s never came\n", r, why);
      _exit(1);
    }
    usleep(1000);
  }
}

static int child_main(int r) {
  prctl(PR_SET_PDEATHSIG, SIGKILL); /* never outlive the parent */
  if (getppid() == 1) _exit(1);
  cuda_load("cuda_peer_death");
  cuda_make_current();
  if (cuda_executor_is_host("cuda_peer_death", r == 0) && use_graph) {
    fprintf(stderr, "cuda_peer_death: graph mode needs real CUDA graphs (not the host executor)\n");
    return CUDA_UNAVAILABLE;
  }
  if (r == 0) {
    NCCLCHECK(ncclGetUniqueId(&sh->id));
    __atomic_store_n(&sh->id_ready, 1, __ATOMIC_RELEASE);
  }
  wait_for(&sh->id_ready, 1, r, "the unique id");
  ncclComm_t comm;
  NCCLCHECK(ncclCommInitRank(&comm, 2, sh->id, r));
  CUstream st;
  CUCHECK(cu.StreamCreate(&st, CU_STREAM_NON_BLOCKING));
  CUdeviceptr sendbuf, recvbuf;
  CUCHECK(cu.MemAlloc(&sendbuf, COUNT * 4));
  CUCHECK(cu.MemAlloc(&recvbuf, COUNT * 4));
  float* host = (float*)malloc(COUNT * 4);
  SYSCHECK(host != NULL, "malloc");
  for (size_t i = 0; i < COUNT; i++) host[i] = input(r, i);
  CUCHECK(cu.MemcpyHtoDAsync(sendbuf, host, COUNT * 4, st));
  CUCHECK(cu.StreamSynchronize(st));
  void* sb = (void*)(uintptr_t)sendbuf;
  void* rb = (void*)(uintptr_t)recvbuf;

  CUgraph g = NULL;
  CUgraphExec ge = NULL;
  if (use_graph) {
    CUCHECK(cu.StreamBeginCapture(st, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    NCCLCHECK(ncclAllReduce(sb, rb, COUNT, ncclFloat32, ncclSum, comm, st));
    CUCHECK(cu.StreamEndCapture(st, &g));
    CUCHECK(cuda_graph_instantiate(&ge, g));
    CUCHECK(cu.GraphLaunch(ge, st));
  } else {
    NCCLCHECK(ncclAllReduce(sb, rb, COUNT, ncclFloat32, ncclSum, comm, st));
  }
  CUCHECK(cu.StreamSynchronize(st));
  CUCHECK(cu.MemcpyDtoHAsync(host, recvbuf, COUNT * 4, st));
  CUCHECK(cu.StreamSynchronize(st));
  size_t bad = 0;
  for (size_t i = 0; i < COUNT; i++) {
    float want = input(0, i) + input(1, i);
    if (host[i] != want && bad++ < 3)
      fprintf(stderr, "FAIL rank %d: element %zu: got %.9g, expected %.9g\n", r, i, (double)host[i],
              (double)want);
  }
  if (bad) return 1;
  __atomic_fetch_add(&sh->first_done, 1, __ATOMIC_ACQ_REL);
  wait_for(&sh->first_done, 2, r, "the peer's first all-reduce");
  if (r == 1) {
    fflush(NULL);
    kill(getpid(), SIGKILL);
  }
  usleep(200 * 1000);
  double t0 = now_sec();
  if (use_graph) CUCHECK(cu.GraphLaunch(ge, st));
  else NCCLCHECK(ncclAllReduce(sb, rb, COUNT, ncclFloat32, ncclSum, comm, st));
  ncclResult_t e = ncclSuccess;
  while (now_sec() - t0 < 3 * BOUND) {
    NCCLCHECK(ncclCommGetAsyncError(comm, &e));
    if (e != ncclSuccess && e != ncclInProgress) break;
    usleep(10 * 1000);
  }
  double seen = now_sec() - t0;
  const char* msg = ncclGetLastError(comm);
  int fails = 0;
  if (e != ncclRemoteError) {
    fprintf(stderr, "FAIL rank 0: ncclCommGetAsyncError gave %d (%s) after %.1f s, not ncclRemoteError\n",
            (int)e, ncclGetErrorString(e), seen);
    fails++;
  } else if (seen > BOUND) {
    fprintf(stderr, "FAIL rank 0: the error came after %.1f s (bound %.0f s)\n", seen, BOUND);
    fails++;
  }
  if (!msg || !strstr(msg, "rank 1")) {
    fprintf(stderr, "FAIL rank 0: the message does not name rank 1: %s\n", msg ? msg : "(null)");
    fails++;
  }
  /* The kernel must stop: a stream that never drains is killed by the alarm. */
  alarm(20);
  CUresult sync = cu.StreamSynchronize(st);
  alarm(0);
  double drained = now_sec() - t0;
  printf("rank 0: %s after %.1f s, stream drained after %.1f s (%s): %s\n", ncclGetErrorString(e),
         seen, drained, sync == CUDA_SUCCESS ? "ok" : cu_err_name(sync), msg ? msg : "");
  ncclCommAbort(comm);
  return fails ? 1 : 0;
}

int main(int argc, char** argv) {
  double timeout_s = 60;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "graph")) use_graph = 1;
    else if (!strcmp(argv[i], "eager")) use_graph = 0;
    else if (!strncmp(argv[i], "timeout=", 8)) timeout_s = atof(argv[i] + 8);
    else {
      fprintf(stderr, "usage: %s [eager|graph] [timeout=S]\n", argv[0]);
      return 2;
    }
  }
  sh = (Shared*)shared_zeroed(sizeof *sh);
  double t0 = now_sec();
  deadline = t0 + timeout_s;
  fflush(NULL);
  pid_t kids[2];
  for (int r = 0; r < 2; r++) {
    kids[r] = fork();
    SYSCHECK(kids[r] >= 0, "fork");
    if (kids[r] == 0) {
      int rc = child_main(r);
      fflush(NULL);
      _exit(rc);
    }
  }
  int status[2] = {0, 0}, done[2] = {0, 0}, left = 2;
  while (left > 0) {
    int st = 0;
    pid_t p = waitpid(-1, &st, WNOHANG);
    for (int r = 0; r < 2 && p > 0; r++)
      if (kids[r] == p) status[r] = st, done[r] = 1, left--;
    if (p > 0) continue;
    if (now_sec() > deadline) {
      for (int r = 0; r < 2; r++)
        if (!done[r]) {
          fprintf(stderr, "FAIL cuda_peer_death: rank %d still running after %.0f s: killed\n", r,
                  timeout_s);
          kill(kids[r], SIGKILL);
          waitpid(kids[r], &status[r], 0);
        }
      printf("cuda_peer_death: FAIL (hung)\n");
      return 1;
    }
    usleep(5000);
  }
  for (int r = 0; r < 2; r++)
    if (WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == CUDA_UNAVAILABLE) {
      fprintf(stderr, "cuda_peer_death: no CUDA driver or device (or no graphs)\n");
      return CUDA_UNAVAILABLE;
    }
  int ok0 = WIFEXITED(status[0]) && WEXITSTATUS(status[0]) == 0;
  int killed1 = WIFSIGNALED(status[1]) && WTERMSIG(status[1]) == SIGKILL;
  if (!killed1)
    fprintf(stderr, "FAIL cuda_peer_death: rank 1 did not die as planned (status %#x)\n", status[1]);
  if (!ok0) fprintf(stderr, "FAIL cuda_peer_death: rank 0 failed (status %#x)\n", status[0]);
  printf("cuda_peer_death: %s (%s, %.1fs)\n", ok0 && killed1 ? "PASS" : "FAIL",
         use_graph ? "graph replays" : "eager launches", now_sec() - t0);
  return ok0 && killed1 ? 0 : 1;
}
