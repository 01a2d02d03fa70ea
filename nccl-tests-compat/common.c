/* oxccl perf tools: common driver (argument parsing, rank setup, timing, checking, output).
 * Original code for oxccl; see common.h. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "common.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <libgen.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

/* Exit codes. */
#define EXIT_BAD_ARGS 1
#define EXIT_NCCL_ERROR 3
#define EXIT_TIMEOUT 4
#define EXIT_WRONG 7

#define MAX_LOCAL 256

/* ------------------------------------------------------------------------------------------ */
/* Options (defaults as nccl-tests documents them)                                            */

static int optThreads = 1, optGpus = 1;
static size_t optMinBytes = 32u << 20, optMaxBytes = 32u << 20, optStepBytes = 1u << 20;
static size_t optStepFactor = 1;
static int optIters = 20, optWarmup = 5, optAgg = 1, optCycles = 1;
static int optCheck = 1, optBlocking = 0, optStreamNull = 0, optTimeout = 0, optGraph = 0;
static int optCputime = 0, optAverage = 1, optRegister = 0, optParallelInit = 0;
static int optOp = PERF_SUM, optAllOps = 0;
static int optType = ncclFloat32, optAllTypes = 0;
static int optRoot = 0;

static const char* typeNames[ncclNumTypes] = {"int8", "uint8", "int32", "uint32", "int64", "uint64",
                                              "half", "float", "double", "bfloat16", "f8e4m3", "f8e5m2"};
static const char* opNames[PERF_NUM_OPS] = {"sum", "prod", "max", "min", "avg", "mulsum"};

size_t perfWordSize(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
  case ncclFloat16: case ncclBfloat16: return 2;
  case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
  default: return 8;
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Process-level context                                                                      */

static int nProcs = 1, procRank = 0, localProc = 0;
static int executor = 0; /* 0 host, 1 CUDA */
static char hostName[256];
static int oobListen = -1, oobFds[4096], oobRoot = -1;

static void die(int code, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfprintf(stderr, fmt, ap);
  va_end(ap);
  fflush(stdout);
  fflush(stderr);
  _exit(code);
}

#define NCCLCHECK(call) do {                                                            \
    ncclResult_t r_ = (call);                                                          \
    if (r_ != ncclSuccess && r_ != ncclInProgress) {                                   \
      const char* last_ = ncclGetLastError(NULL);                                      \
      die(EXIT_NCCL_ERROR, "%s: Test NCCL failure %s:%d '%s / %s' in %s\n", hostName,  \
          __FILE__, __LINE__, ncclGetErrorString(r_), last_ ? last_ : "", #call);      \
    }                                                                                  \
  } while (0)

/* ---- CUDA runtime, loaded on demand for the CUDA executor ---- */
static struct {
  void* h;
  int (*setDevice)(int);
  int (*malloc_)(void**, size_t);
  int (*free_)(void*);
  int (*memcpy_)(void*, const void*, size_t, int);
  int (*streamCreate)(cudaStream_t*, unsigned);
  int (*streamSync)(cudaStream_t);
  int (*streamQuery)(cudaStream_t);
  int (*streamDestroy)(cudaStream_t);
  const char* (*errStr)(int);
  int (*deviceCount)(int*);
  int (*memcpyAsync)(void*, const void*, size_t, int, cudaStream_t);
} cu;

static void cudaLoad(void) {
  const char* names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", NULL};
  for (int i = 0; names[i] && !cu.h; i++) cu.h = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
  if (!cu.h) die(EXIT_BAD_ARGS, "%s: the CUDA executor is active but libcudart could not be loaded (%s); "
                 "set OXCCL_DEVICE=host to use the host executor\n", hostName, dlerror());
#define LOADSYM(f, n) do { *(void**)&cu.f = dlsym(cu.h, n); if (!cu.f) die(EXIT_BAD_ARGS, "libcudart lacks %s\n", n); } while (0)
  LOADSYM(setDevice, "cudaSetDevice");
  LOADSYM(malloc_, "cudaMalloc");
  LOADSYM(free_, "cudaFree");
  LOADSYM(memcpy_, "cudaMemcpy");
  LOADSYM(streamCreate, "cudaStreamCreateWithFlags");
  LOADSYM(streamSync, "cudaStreamSynchronize");
  LOADSYM(streamQuery, "cudaStreamQuery");
  LOADSYM(streamDestroy, "cudaStreamDestroy");
  LOADSYM(errStr, "cudaGetErrorString");
  LOADSYM(deviceCount, "cudaGetDeviceCount");
  LOADSYM(memcpyAsync, "cudaMemcpyAsync");
#undef LOADSYM
}

#define CUDACHECK(call) do {                                                             \
    int e_ = (call);                                                                    \
    if (e_ != 0) die(2, "%s: Test CUDA failure %s:%d '%s'\n", hostName, __FILE__, __LINE__, \
                     cu.errStr ? cu.errStr(e_) : "?");                                  \
  } while (0)

/* Rank slots beyond the machine's GPUs wrap around: several ranks share a GPU (oxccl allows it;
 * NVIDIA's NCCL refuses it at init with a message of its own). */
static void devSet(int dev) {
  if (executor != 1) return;
  int n = 0;
  CUDACHECK(cu.deviceCount(&n));
  CUDACHECK(cu.setDevice(n > 0 ? dev % n : dev));
}

static void* devAlloc(size_t bytes) {
  void* p = NULL;
  if (bytes == 0) bytes = 1;
  if (optRegister) {
    NCCLCHECK(ncclMemAlloc(&p, bytes));
  } else if (executor == 1) {
    CUDACHECK(cu.malloc_(&p, bytes));
  } else if (posix_memalign(&p, 4096, bytes) != 0) {
    die(EXIT_BAD_ARGS, "%s: out of host memory (%zu bytes)\n", hostName, bytes);
  }
  return p;
}

static void devFree(void* p) {
  if (optRegister) NCCLCHECK(ncclMemFree(p));
  else if (executor == 1) CUDACHECK(cu.free_(p));
  else free(p);
}

/* A rank's inputs, on its own stream: ordered before its collective there. (cudaMemcpy from
 * pageable memory may return before its DMA lands, and is ordered only on the legacy stream,
 * which the tool's non-blocking streams do not wait for; a device-wide synchronize instead
 * would wait forever for another thread's rank on the same GPU, whose kernel waits for this
 * one.) The host buffer (malloc'd, pageable) may be reused at once: a copy from pageable
 * memory is staged before the call returns. */
static void devUploadOn(void* dst, const void* src, size_t n, cudaStream_t s) {
  if (n == 0) return;
  if (executor == 1) CUDACHECK(cu.memcpyAsync(dst, src, n, 4, s));
  else memcpy(dst, src, n);
}

static void devDownload(void* dst, const void* src, size_t n) {
  if (n == 0) return;
  if (executor == 1) CUDACHECK(cu.memcpy_(dst, src, n, 4));
  else memcpy(dst, src, n);
}

static cudaStream_t streamCreate(void) {
  cudaStream_t s = NULL;
  if (optStreamNull) return NULL;
  if (executor == 1) CUDACHECK(cu.streamCreate(&s, 1));
  else NCCLCHECK(oxcclHostStreamCreate(&s));
  return s;
}

static void streamDestroy(cudaStream_t s) {
  if (!s) return;
  if (executor == 1) CUDACHECK(cu.streamDestroy(s));
  else NCCLCHECK(oxcclHostStreamDestroy(s));
}

/* 1 when all work on s is done. */
static int streamDone(cudaStream_t s) {
  if (executor == 1) {
    int e = cu.streamQuery(s);
    if (e == 0) return 1;
    if (e == 600 /* cudaErrorNotReady */) return 0;
    CUDACHECK(e);
    return 0;
  }
  if (!s) return 1;
  ncclResult_t r = oxcclHostStreamQuery(s);
  if (r == ncclSuccess) return 1;
  if (r == ncclInProgress) return 0;
  NCCLCHECK(r);
  return 0;
}

static double nowSec(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------------------------------ */
/* Out-of-band exchange between processes: a TCP star around process 0.                      */

/* With OXCCL_TIMEOUT_S set, the exchange waits no longer than that for the other processes (a
 * process stopped, a link down while the results are gathered): the run ends with an error
 * instead of a wait for ever. Unset, it waits as long as they take. */
static void oobTimeouts(int fd) {
  const char* v = getenv("OXCCL_TIMEOUT_S");
  int s = v ? atoi(v) : 0;
  if (s <= 0) return;
  struct timeval tv = {.tv_sec = s, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

static void sendAll(int fd, const void* p, size_t n) {
  const char* c = p;
  while (n) {
    ssize_t k = send(fd, c, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      die(EXIT_BAD_ARGS, "%s: bootstrap socket send: no progress for OXCCL_TIMEOUT_S\n", hostName);
    if (k <= 0) die(EXIT_BAD_ARGS, "%s: bootstrap socket send failed: %s\n", hostName, strerror(errno));
    c += k; n -= (size_t)k;
  }
}

static void recvAll(int fd, void* p, size_t n) {
  char* c = p;
  while (n) {
    ssize_t k = recv(fd, c, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
      die(EXIT_BAD_ARGS, "%s: bootstrap socket receive: nothing for OXCCL_TIMEOUT_S\n", hostName);
    if (k <= 0) die(EXIT_BAD_ARGS, "%s: bootstrap socket receive failed (peer gone?)\n", hostName);
    c += k; n -= (size_t)k;
  }
}

/* Gather `n` bytes from every process into all[nProcs*n] on every process. */
static void oobAllgather(const void* mine, size_t n, void* all) {
  char* a = all;
  memcpy(a + (size_t)procRank * n, mine, n);
  if (nProcs == 1) return;
  if (procRank == 0) {
    for (int p = 1; p < nProcs; p++) recvAll(oobFds[p], a + (size_t)p * n, n);
    for (int p = 1; p < nProcs; p++) sendAll(oobFds[p], a, n * (size_t)nProcs);
  } else {
    sendAll(oobRoot, mine, n);
    recvAll(oobRoot, a, n * (size_t)nProcs);
  }
}

static const char* envOr(const char* a, const char* b) {
  const char* v = getenv(a);
  return v ? v : (b ? getenv(b) : NULL);
}

static int connectTo(const char* host, int port, double deadline) {
  char portStr[16];
  snprintf(portStr, sizeof portStr, "%d", port);
  for (;;) {
    struct addrinfo hints = {0}, *res = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host, portStr, &hints, &res) == 0) {
      for (struct addrinfo* ai = res; ai; ai = ai->ai_next) {
        int fd = socket(ai->ai_family, ai->ai_socktype, ai->ai_protocol);
        if (fd < 0) continue;
        if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) {
          int one = 1;
          setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
          oobTimeouts(fd);
          freeaddrinfo(res);
          return fd;
        }
        close(fd);
      }
      freeaddrinfo(res);
    }
    if (nowSec() > deadline)
      die(EXIT_BAD_ARGS, "%s: could not reach rank 0 at %s:%d\n", hostName, host, port);
    usleep(50000);
  }
}

/* Rank 0 of the out-of-band exchange: waits until `fd` is readable, or ends the run when
 * `deadline` passes, naming the processes that have not connected (`have` of them have). */
static void waitReadable(int fd, double deadline, const char* what, int have) {
  for (;;) {
    double left = deadline - nowSec();
    if (left <= 0) {
      char missing[512] = "";
      size_t at = 0;
      for (int r = 1; r < nProcs && at + 16 < sizeof missing; r++)
        if (!oobFds[r]) at += (size_t)snprintf(missing + at, sizeof missing - at, "%s%d", at ? " " : "", r);
      die(EXIT_BAD_ARGS,
          "%s: rank 0 waited %d s for %s: %d of %d processes connected (not yet: %s); "
          "check that every process was started with the same WORLD_SIZE, MASTER_ADDR and "
          "MASTER_PORT, and can reach this host\n",
          hostName, optTimeout > 0 ? optTimeout : 120, what, have - 1, nProcs - 1, missing);
    }
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int k = poll(&p, 1, (int)(left * 1000) + 1);
    if (k > 0) return;
    if (k < 0 && errno != EINTR) die(EXIT_BAD_ARGS, "%s: poll failed: %s\n", hostName, strerror(errno));
  }
}

static void oobInit(void) {
  const char* sz = getenv("OMPI_COMM_WORLD_SIZE");
  int mpi = sz != NULL;
  if (!sz) sz = getenv("WORLD_SIZE");
  if (!sz || atoi(sz) <= 1) return;
  nProcs = atoi(sz);
  if (nProcs > 4096) die(EXIT_BAD_ARGS, "too many processes (%d)\n", nProcs);
  procRank = atoi(envOr(mpi ? "OMPI_COMM_WORLD_RANK" : "RANK", NULL) ? envOr(mpi ? "OMPI_COMM_WORLD_RANK" : "RANK", NULL) : "0");
  const char* lr = envOr(mpi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "LOCAL_RANK", NULL);
  localProc = lr ? atoi(lr) : procRank;

  /* Where rank 0 listens: MASTER_ADDR:MASTER_PORT (torchrun style), or under mpirun without
   * those, an ephemeral port published in a small file in /tmp keyed by the job id. */
  const char* addr = getenv("MASTER_ADDR");
  const char* portS = getenv("MASTER_PORT");
  const char* forced = getenv("OXCCL_TESTS_PORT");
  int port = -1;
  char fileName[512] = "";
  if (addr && portS) {
    port = atoi(portS);
    /* torchrun's agent may already serve its store on MASTER_PORT */
    const char* agent = getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (agent && (strcmp(agent, "True") == 0 || strcmp(agent, "1") == 0)) port += 1;
  } else if (mpi) {
    const char* job = envOr("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE");
    if (!job) job = envOr("OMPI_MCA_orte_ess_jobid", "OMPI_COMM_WORLD_NODE_RANK");
    if (!job) die(EXIT_BAD_ARGS, "mpirun detected but no job id found: set MASTER_ADDR and MASTER_PORT\n");
    snprintf(fileName, sizeof fileName, "/tmp/oxccl-nccl-tests-%s-%d.addr", job, (int)getuid());
    for (char* c = fileName + 5; *c; c++) if (*c == '/' || *c == ' ') *c = '_';
    addr = NULL;
  } else {
    die(EXIT_BAD_ARGS, "WORLD_SIZE=%d but MASTER_ADDR/MASTER_PORT are not set\n", nProcs);
  }
  if (forced) port = atoi(forced);
  double deadline = nowSec() + (optTimeout > 0 ? optTimeout : 120);

  if (procRank == 0) {
    oobListen = socket(AF_INET, SOCK_STREAM, 0);
    int one = 1;
    setsockopt(oobListen, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {0};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons((uint16_t)(port > 0 ? port : 0));
    if (bind(oobListen, (struct sockaddr*)&sa, sizeof sa) != 0 || listen(oobListen, 256) != 0)
      die(EXIT_BAD_ARGS, "%s: rank 0 cannot listen on port %d: %s\n", hostName, port, strerror(errno));
    if (fileName[0]) {
      socklen_t len = sizeof sa;
      getsockname(oobListen, (struct sockaddr*)&sa, &len);
      char tmp[600];
      snprintf(tmp, sizeof tmp, "%s.tmp", fileName);
      FILE* f = fopen(tmp, "w");
      if (!f) die(EXIT_BAD_ARGS, "cannot write %s\n", tmp);
      fprintf(f, "%s %d\n", hostName, ntohs(sa.sin_port));
      fclose(f);
      rename(tmp, fileName);
    }
    for (int i = 1; i < nProcs; i++) {
      /* Not forever: processes that never come (a launcher that failed, a host that cannot
       * reach this one) end the run with the list of those missing. */
      waitReadable(oobListen, deadline, "connections", i);
      int fd = accept(oobListen, NULL, NULL);
      if (fd < 0) die(EXIT_BAD_ARGS, "%s: accept failed: %s\n", hostName, strerror(errno));
      int one2 = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one2, sizeof one2);
      oobTimeouts(fd);
      int32_t r;
      waitReadable(fd, deadline, "a connected process's rank", i + 1);
      recvAll(fd, &r, sizeof r);
      if (r <= 0 || r >= nProcs || oobFds[r]) die(EXIT_BAD_ARGS, "bad bootstrap rank %d\n", r);
      oobFds[r] = fd;
    }
    close(oobListen);
    if (fileName[0]) unlink(fileName);
  } else {
    char host[256];
    if (fileName[0]) {
      for (;;) {
        FILE* f = fopen(fileName, "r");
        if (f) {
          int ok = fscanf(f, "%255s %d", host, &port) == 2;
          fclose(f);
          if (ok) break;
        }
        if (nowSec() > deadline) die(EXIT_BAD_ARGS, "rank 0 never published %s\n", fileName);
        usleep(50000);
      }
      addr = host;
    }
    oobRoot = connectTo(addr, port, deadline);
    int32_t r = procRank;
    sendAll(oobRoot, &r, sizeof r);
  }
}

/* ------------------------------------------------------------------------------------------ */
/* Thread synchronisation: barrier + reduction of one double over all threads of all processes */

static pthread_mutex_t syncMu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t syncCv = PTHREAD_COND_INITIALIZER;
static int syncArrived = 0;
static unsigned long syncGen = 0;
static double syncVals[MAX_LOCAL], syncResult;

enum { RED_RANK0 = 0, RED_AVG = 1, RED_MIN = 2, RED_MAX = 3, RED_SUM = 4 };

static double combine(const double* v, int n, int mode) {
  double x = v[0];
  for (int i = 1; i < n; i++) {
    if (mode == RED_AVG || mode == RED_SUM) x += v[i];
    else if (mode == RED_MIN) x = v[i] < x ? v[i] : x;
    else if (mode == RED_MAX) x = v[i] > x ? v[i] : x;
  }
  return x;
}

static double syncReduce(int thread, double v, int mode) {
  pthread_mutex_lock(&syncMu);
  unsigned long gen = syncGen;
  syncVals[thread] = v;
  if (++syncArrived == optThreads) {
    double x = combine(syncVals, optThreads, mode);
    if (nProcs > 1) {
      double* all = malloc(sizeof(double) * nProcs);
      oobAllgather(&x, sizeof x, all);
      x = combine(all, nProcs, mode);
      free(all);
    }
    if (mode == RED_AVG) x /= (double)(nProcs * optThreads);
    syncResult = x;
    syncArrived = 0;
    syncGen++;
    pthread_cond_broadcast(&syncCv);
  } else {
    while (gen == syncGen) pthread_cond_wait(&syncCv, &syncMu);
  }
  double r = syncResult;
  pthread_mutex_unlock(&syncMu);
  return r;
}

static void syncBarrier(int thread) { (void)syncReduce(thread, 0, RED_SUM); }

/* ------------------------------------------------------------------------------------------ */
/* Data: exact small values, encoded in every datatype                                        */

static uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Largest integer magnitude (exclusive) that data-movement tests store in a type exactly. */
static uint64_t moveRange(ncclDataType_t t) {
  switch (t) {
  case ncclInt8: return 100;
  case ncclUint8: return 200;
  case ncclFloat16: return 2048;
  case ncclBfloat16: return 256;
  case ncclFloat8e4m3: return 16;
  case ncclFloat8e5m2: return 8;
  default: return 1u << 20;
  }
}

/* Reductions use inputs where at most two ranks contribute per element, so every result stays
 * a small integer (<= 8) that every type, fp8 included, represents exactly. */
static int mulsumScalar(int rank) { return 1 + (rank & 1); }

double perfInput(const perfCtx* c, size_t i, int r) {
  uint64_t h = mix64(c->seed * 0x100000001b3ull ^ (uint64_t)i);
  int n = c->nranks;
  if (c->op == PERF_NO_OP || c->op == PERF_MAX || c->op == PERF_MIN) {
    uint64_t g = mix64(h ^ ((uint64_t)(r + 1) << 40));
    return (double)(g % moveRange(c->type));
  }
  int j = (int)((i + c->seed) % (uint64_t)n);
  int k = (j + 1) % n;
  if (c->op == PERF_PROD) {
    if (r == j) return (double)(1 + (h & 1));
    if (r == k) return (double)(1 + ((h >> 1) & 1));
    return 1;
  }
  if (r == j) return (double)(1 + (h >> 8) % 3);
  if (r == k) return (double)((h >> 4) & 1);
  return 0;
}

double perfReduced(const perfCtx* c, size_t i) {
  double acc = perfInput(c, i, 0) * (c->op == PERF_MULSUM ? mulsumScalar(0) : 1);
  for (int r = 1; r < c->nranks; r++) {
    double v = perfInput(c, i, r);
    switch (c->op) {
    case PERF_PROD: acc *= v; break;
    case PERF_MAX: acc = v > acc ? v : acc; break;
    case PERF_MIN: acc = v < acc ? v : acc; break;
    case PERF_MULSUM: acc += v * mulsumScalar(r); break;
    default: acc += v; break;
    }
  }
  if (c->op == PERF_AVG) {
    int isFloat = c->type >= ncclFloat16;
    acc = isFloat ? acc / c->nranks : floor(acc / c->nranks);
  }
  return acc;
}

/* IEEE-style small float with E exponent bits and M mantissa bits, round to nearest even. */
static uint64_t miniEncode(double v, int E, int M) {
  int bias = (1 << (E - 1)) - 1;
  uint64_t sign = 0;
  if (signbit(v)) { sign = 1; v = -v; }
  if (v == 0) return sign << (E + M);
  int e;
  double m = frexp(v, &e); /* v = m * 2^e, m in [0.5, 1) */
  int ex = e - 1 + bias;
  uint64_t mant;
  if (ex <= 0) {
    mant = (uint64_t)nearbyint(ldexp(v, bias - 1 + M));
    return (sign << (E + M)) | mant;
  }
  mant = (uint64_t)nearbyint(ldexp(m * 2, M));
  if (mant == (1ull << (M + 1))) { mant >>= 1; ex++; }
  return (sign << (E + M)) | ((uint64_t)ex << M) | (mant & ((1ull << M) - 1));
}

static double miniDecode(uint64_t b, int E, int M, int ocpE4M3) {
  int bias = (1 << (E - 1)) - 1;
  int sign = (int)((b >> (E + M)) & 1);
  int ex = (int)((b >> M) & ((1u << E) - 1));
  uint64_t mant = b & ((1ull << M) - 1);
  double v;
  if (ocpE4M3 && ex == (1 << E) - 1 && mant == (1ull << M) - 1) return NAN;
  if (!ocpE4M3 && ex == (1 << E) - 1) v = mant ? NAN : INFINITY;
  else if (ex == 0) v = ldexp((double)mant, 1 - bias - M);
  else v = ldexp((double)(mant | (1ull << M)), ex - bias - M);
  return sign ? -v : v;
}

static void encodeValue(ncclDataType_t t, double v, void* dst) {
  switch (t) {
  case ncclInt8: { int8_t x = (int8_t)v; memcpy(dst, &x, 1); break; }
  case ncclUint8: { uint8_t x = (uint8_t)v; memcpy(dst, &x, 1); break; }
  case ncclInt32: { int32_t x = (int32_t)v; memcpy(dst, &x, 4); break; }
  case ncclUint32: { uint32_t x = (uint32_t)v; memcpy(dst, &x, 4); break; }
  case ncclInt64: { int64_t x = (int64_t)v; memcpy(dst, &x, 8); break; }
  case ncclUint64: { uint64_t x = (uint64_t)v; memcpy(dst, &x, 8); break; }
  case ncclFloat16: { uint16_t x = (uint16_t)miniEncode(v, 5, 10); memcpy(dst, &x, 2); break; }
  case ncclBfloat16: { uint16_t x = (uint16_t)miniEncode(v, 8, 7); memcpy(dst, &x, 2); break; }
  case ncclFloat32: { float x = (float)v; memcpy(dst, &x, 4); break; }
  case ncclFloat64: memcpy(dst, &v, 8); break;
  case ncclFloat8e4m3: { uint8_t x = (uint8_t)miniEncode(v, 4, 3); memcpy(dst, &x, 1); break; }
  case ncclFloat8e5m2: { uint8_t x = (uint8_t)miniEncode(v, 5, 2); memcpy(dst, &x, 1); break; }
  default: break;
  }
}

static double decodeValue(ncclDataType_t t, const void* src) {
  uint64_t b = 0;
  memcpy(&b, src, perfWordSize(t));
  switch (t) {
  case ncclFloat16: return miniDecode(b, 5, 10, 0);
  case ncclBfloat16: return miniDecode(b, 8, 7, 0);
  case ncclFloat8e4m3: return miniDecode(b, 4, 3, 1);
  case ncclFloat8e5m2: return miniDecode(b, 5, 2, 0);
  case ncclFloat32: { float f; memcpy(&f, src, 4); return f; }
  case ncclFloat64: { double d; memcpy(&d, src, 8); return d; }
  default: return 0;
  }
}

/* One unit in the last place at the magnitude of v (v a finite value of type t). */
static double ulpOf(ncclDataType_t t, double v) {
  unsigned char a[8] = {0}, b[8] = {0};
  encodeValue(t, fabs(v), a);
  uint64_t bits = 0;
  memcpy(&bits, a, perfWordSize(t));
  bits++;
  memcpy(b, &bits, perfWordSize(t));
  return decodeValue(t, b) - decodeValue(t, a);
}

/* ------------------------------------------------------------------------------------------ */
/* Per-thread state and the benchmark loop                                                    */

typedef struct {
  int thread;
  int nLocal;
  int ranks[MAX_LOCAL], devs[MAX_LOCAL];
  ncclComm_t comms[MAX_LOCAL];
  cudaStream_t streams[MAX_LOCAL];
  void* send[MAX_LOCAL];
  void* recv[MAX_LOCAL];
  void* regSend[MAX_LOCAL];
  void* regRecv[MAX_LOCAL];
  size_t bufBytes;
  unsigned char* host; /* staging for inputs and results */
  unsigned char* hostExp;
  double bwSum;
  int bwCount;
  long long wrongTotal;
} threadState;

static int nRanks;
static ncclUniqueId uniqueId;
static threadState* threads;

#define PRINT(...) do { if (procRank == 0 && st->thread == 0) printf(__VA_ARGS__); } while (0)

static void waitStreams(threadState* st) {
  double start = nowSec();
  for (;;) {
    int all = 1;
    for (int i = 0; i < st->nLocal; i++) {
      if (executor == 1) devSet(st->devs[i]);
      if (!streamDone(st->streams[i])) { all = 0; break; }
    }
    if (all) return;
    for (int i = 0; i < st->nLocal; i++) {
      ncclResult_t asyncErr = ncclSuccess;
      NCCLCHECK(ncclCommGetAsyncError(st->comms[i], &asyncErr));
      if (asyncErr != ncclSuccess && asyncErr != ncclInProgress) {
        for (int k = 0; k < st->nLocal; k++) ncclCommAbort(st->comms[k]);
        NCCLCHECK(asyncErr);
      }
    }
    if (optTimeout > 0 && nowSec() - start > optTimeout) {
      for (int k = 0; k < st->nLocal; k++) ncclCommAbort(st->comms[k]);
      die(EXIT_TIMEOUT, "%s: Test timeout (%ds) waiting for the streams\n", hostName, optTimeout);
    }
    if (executor == 0 && optTimeout <= 0 && st->streams[0]) {
      /* nothing to watch: let the library block */
      for (int i = 0; i < st->nLocal; i++) NCCLCHECK(oxcclHostStreamSynchronize(st->streams[i]));
      return;
    }
    /* Poll again at once, as nccl-tests does. On the host executor each query runs the
     * stream's pending work on this thread for a while, so a nap here would stall the work
     * (measured: 20 us naps halved 256 MiB all-reduce bandwidth under -T). */
    sched_yield();
  }
}

static void setCtx(perfCtx* c, size_t bytes, ncclDataType_t type, int op, int root, uint64_t seed) {
  c->nranks = nRanks;
  c->type = type;
  c->op = perfTool.usesOp ? op : PERF_NO_OP;
  c->root = root;
  c->seed = seed;
  perfTool.layout(bytes / perfWordSize(type), nRanks, &c->L);
}

static void startOp(threadState* st, const perfCtx* c, int inPlace) {
  size_t ws = perfWordSize(c->type);
  if (perfTool.nPhases) {
    int phases = perfTool.nPhases(c->nranks);
    for (int ph = 0; ph < phases; ph++) {
      if (st->nLocal > 1) NCCLCHECK(ncclGroupStart());
      for (int i = 0; i < st->nLocal; i++) {
        int rank = st->ranks[i];
        char* rb = st->recv[i];
        const void* sb = inPlace ? rb + c->L.sendInplace * ws * rank : st->send[i];
        void* out = inPlace ? rb + c->L.recvInplace * ws * rank : rb;
        NCCLCHECK(perfTool.runPhase(c, rank, sb, out, st->comms[i], st->streams[i], ph));
      }
      if (st->nLocal > 1) NCCLCHECK(ncclGroupEnd());
    }
    if (optBlocking) {
      waitStreams(st);
      syncBarrier(st->thread);
    }
    return;
  }
  if (st->nLocal > 1) NCCLCHECK(ncclGroupStart());
  for (int i = 0; i < st->nLocal; i++) {
    int rank = st->ranks[i];
    char* rb = st->recv[i];
    const void* sb = inPlace ? rb + c->L.sendInplace * ws * rank : st->send[i];
    void* out = inPlace ? rb + c->L.recvInplace * ws * rank : rb;
    ncclRedOp_t op = (ncclRedOp_t)(c->op < 0 ? ncclSum : c->op);
    if (c->op == PERF_MULSUM) {
      unsigned char scalar[8] = {0};
      encodeValue(c->type, mulsumScalar(rank), scalar);
      NCCLCHECK(ncclRedOpCreatePreMulSum(&op, scalar, c->type, ncclScalarHostImmediate, st->comms[i]));
    }
    NCCLCHECK(perfTool.run(c, rank, sb, out, op, st->comms[i], st->streams[i]));
    if (c->op == PERF_MULSUM) NCCLCHECK(ncclRedOpDestroy(op, st->comms[i]));
  }
  if (st->nLocal > 1) NCCLCHECK(ncclGroupEnd());
  if (optBlocking) {
    waitStreams(st);
    syncBarrier(st->thread);
  }
}

/* Write every local rank's input (and poison the output) for one run. */
static void prepareData(threadState* st, const perfCtx* c, int inPlace) {
  size_t ws = perfWordSize(c->type);
  for (int i = 0; i < st->nLocal; i++) {
    int rank = st->ranks[i];
    if (executor == 1) devSet(st->devs[i]);
    /* poison the receive buffer so that elements never written are caught */
    memset(st->host, 0xA7, st->bufBytes);
    devUploadOn(st->recv[i], st->host, st->bufBytes, st->streams[i]);
    for (size_t k = 0; k < c->L.sendCount; k++) encodeValue(c->type, perfInput(c, k, rank), st->host + k * ws);
    if (inPlace)
      devUploadOn((char*)st->recv[i] + c->L.sendInplace * ws * rank, st->host, c->L.sendCount * ws, st->streams[i]);
    else devUploadOn(st->send[i], st->host, c->L.sendCount * ws, st->streams[i]);
  }
}

static long long checkData(threadState* st, const perfCtx* c, int inPlace) {
  size_t ws = perfWordSize(c->type);
  int tolerant = c->op == PERF_AVG && c->type >= ncclFloat16;
  long long wrong = 0;
  for (int i = 0; i < st->nLocal; i++) {
    int rank = st->ranks[i];
    if (!perfTool.checks(c, rank)) continue;
    if (executor == 1) devSet(st->devs[i]);
    const char* out = (const char*)st->recv[i] + (inPlace ? c->L.recvInplace * ws * rank : 0);
    devDownload(st->host, out, c->L.recvCount * ws);
    for (size_t k = 0; k < c->L.recvCount; k++) {
      double want = perfTool.expected(c, rank, k);
      unsigned char e[8] = {0};
      encodeValue(c->type, want, e);
      const unsigned char* got = st->host + k * ws;
      if (memcmp(e, got, ws) == 0) continue;
      if (tolerant) {
        double g = decodeValue(c->type, got), w = decodeValue(c->type, e);
        if (!isnan(g) && fabs(g - w) <= 2 * ulpOf(c->type, w)) continue;
      }
      if (wrong < 4 && getenv("OXCCL_TESTS_VERBOSE"))
        fprintf(stderr, "rank %d elt %zu: want %g\n", rank, k, want);
      wrong++;
    }
  }
  return wrong;
}

static void formatTime(char* buf, double us) {
  if (us >= 10000.0) sprintf(buf, "%7.0f", us);
  else if (us >= 100.0) sprintf(buf, "%7.1f", us);
  else sprintf(buf, "%7.2f", us);
}

static void benchOne(threadState* st, const perfCtx* c0, int inPlace, uint64_t* rep) {
  perfCtx c = *c0;
  size_t ws = perfWordSize(c.type);
  /* first call outside the timing, with checkable data */
  c.seed = 99;
  prepareData(st, &c, inPlace);
  startOp(st, &c, inPlace);
  waitStreams(st);
  syncBarrier(st->thread);

  if (optGraph > 0 && st->thread == 0 && procRank == 0) { /* noted once at start */ }
  double t0 = nowSec();
  for (int it = 0; it < optIters; it++) {
    if (optAgg > 1) NCCLCHECK(ncclGroupStart());
    for (int a = 0; a < optAgg; a++) startOp(st, &c, inPlace);
    if (optAgg > 1) NCCLCHECK(ncclGroupEnd());
  }
  double cpu = (nowSec() - t0) / ((double)optIters * optAgg);
  waitStreams(st);
  double sec = (nowSec() - t0) / ((double)optIters * optAgg);
  if (optIters <= 0) sec = cpu = 0;
  sec = syncReduce(st->thread, sec, optAverage);
  cpu = syncReduce(st->thread, cpu, optAverage);

  double algBw = 0, busBw = 0;
  if (sec > 0) {
    algBw = perfTool.algBytes(&c.L, ws, nRanks) / 1.0e9 / sec;
    busBw = algBw * perfTool.busFactor(nRanks);
  }

  long long wrong = 0;
  (*rep)++;
  for (int k = 0; k < optCheck; k++) {
    c.seed = *rep * 131 + (uint64_t)k;
    prepareData(st, &c, inPlace);
    startOp(st, &c, inPlace);
    waitStreams(st);
    wrong = (long long)syncReduce(st->thread, (double)checkData(st, &c, inPlace), RED_SUM);
    if (wrong) break;
  }
  if (wrong) st->wrongTotal++; /* rows (size x placement) with wrong elements */

  char tbuf[32];
  formatTime(tbuf, (optCputime ? cpu : sec) * 1e6);
  if (optCheck) PRINT("  %7s  %6.2f  %6.2f  %5lld", tbuf, algBw, busBw, wrong);
  else PRINT("  %7s  %6.2f  %6.2f  %5s", tbuf, algBw, busBw, "N/A");
  st->bwSum += busBw;
  st->bwCount++;
}

static void runSizes(threadState* st, ncclDataType_t type, int op, int root) {
  perfCtx c;
  uint64_t rep = 0;
  /* warm-up at the largest and the smallest size */
  for (int pass = 0; pass < 2; pass++) {
    setCtx(&c, pass == 0 ? optMaxBytes : optMinBytes, type, op, root, 1);
    for (int w = 0; w < optWarmup; w++) startOp(st, &c, 0);
    waitStreams(st);
  }
  syncBarrier(st->thread);
  int cycle = 0;
  do {
    for (size_t size = optMinBytes; size <= optMaxBytes;
         size = optStepFactor > 1 ? size * optStepFactor : size + optStepBytes) {
      setCtx(&c, size, type, op, root, 1);
      size_t ws = perfWordSize(type);
      size_t shown = (c.L.sendCount > c.L.recvCount ? c.L.sendCount : c.L.recvCount) * ws;
      PRINT("%12zu  %12zu  %8s  %6s  %6d", shown, c.L.paramCount, typeNames[type],
            perfTool.usesOp ? opNames[op] : "none", perfTool.usesRoot ? root : -1);
      benchOne(st, &c, 0, &rep);
      benchOne(st, &c, 1, &rep);
      PRINT("\n");
      if (procRank == 0 && st->thread == 0) fflush(stdout);
      if (size == 0 && optStepFactor > 1) break;
      if (optStepFactor <= 1 && optStepBytes == 0) break;
    }
  } while (optCycles == 0 || ++cycle < optCycles);
}

static void* threadMain(void* arg) {
  threadState* st = arg;
  /* communicators: one group per thread, like a multi-device process */
  NCCLCHECK(ncclGroupStart());
  for (int i = 0; i < st->nLocal; i++) {
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    devSet(st->devs[i]);
    NCCLCHECK(ncclCommInitRankConfig(&st->comms[i], nRanks, uniqueId, st->ranks[i], &cfg));
  }
  NCCLCHECK(ncclGroupEnd());

  /* buffers large enough for every datatype at the largest size */
  size_t need = 0;
  for (int t = 0; t < ncclNumTypes; t++) {
    perfLayout L;
    size_t ws = perfWordSize((ncclDataType_t)t);
    perfTool.layout(optMaxBytes / ws, nRanks, &L);
    size_t s = L.sendCount * ws, r = L.recvCount * ws;
    size_t inpl = (L.sendInplace * (nRanks - 1) + L.sendCount) * ws;
    size_t inpr = (L.recvInplace * (nRanks - 1) + L.recvCount) * ws;
    size_t m = s > r ? s : r;
    if (inpl > m) m = inpl;
    if (inpr > m) m = inpr;
    if (m > need) need = m;
  }
  st->bufBytes = need + 64;
  st->host = malloc(st->bufBytes);
  st->hostExp = NULL;
  for (int i = 0; i < st->nLocal; i++) {
    devSet(st->devs[i]);
    st->send[i] = devAlloc(st->bufBytes);
    st->recv[i] = devAlloc(st->bufBytes);
    st->streams[i] = streamCreate();
    if (optRegister) {
      NCCLCHECK(ncclCommRegister(st->comms[i], st->send[i], st->bufBytes, &st->regSend[i]));
      NCCLCHECK(ncclCommRegister(st->comms[i], st->recv[i], st->bufBytes, &st->regRecv[i]));
    }
  }

  int types[ncclNumTypes], nTypes = 0;
  if (optAllTypes) for (int t = 0; t < ncclNumTypes; t++) types[nTypes++] = t;
  else types[nTypes++] = optType;
  int ops[PERF_NUM_OPS], nOps = 0;
  if (!perfTool.usesOp) ops[nOps++] = PERF_SUM;
  else if (optAllOps) for (int o = 0; o < PERF_NUM_OPS; o++) ops[nOps++] = o;
  else ops[nOps++] = optOp;
  int rootLo = optRoot, rootHi = optRoot;
  if (!perfTool.usesRoot) rootLo = rootHi = 0;
  else if (optRoot < 0) { rootLo = 0; rootHi = nRanks - 1; }

  for (int ti = 0; ti < nTypes; ti++)
    for (int oi = 0; oi < nOps; oi++)
      for (int r = rootLo; r <= rootHi; r++) runSizes(st, (ncclDataType_t)types[ti], ops[oi], r);

  for (int i = 0; i < st->nLocal; i++) {
    if (optRegister) {
      NCCLCHECK(ncclCommDeregister(st->comms[i], st->regSend[i]));
      NCCLCHECK(ncclCommDeregister(st->comms[i], st->regRecv[i]));
    }
    NCCLCHECK(ncclCommDestroy(st->comms[i]));
    streamDestroy(st->streams[i]);
    devFree(st->send[i]);
    devFree(st->recv[i]);
  }
  free(st->host);
  return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Command line                                                                               */

static double parseSize(const char* s) {
  char* end;
  double v = strtod(s, &end);
  if (end == s || v < 0) return -1;
  while (*end == ' ') end++;
  switch (*end) {
  case 'G': case 'g': v *= 1024.0 * 1024 * 1024; end++; break;
  case 'M': case 'm': v *= 1024.0 * 1024; end++; break;
  case 'K': case 'k': v *= 1024.0; end++; break;
  case '\0': break;
  default: return -1;
  }
  return v;
}

static int parseOp(const char* s) {
  if (strcmp(s, "all") == 0) return -2;
  for (int i = 0; i < PERF_NUM_OPS; i++) if (strcmp(s, opNames[i]) == 0) return i;
  return -3;
}

static int parseType(const char* s) {
  static const struct { const char* n; int t; } aliases[] = {
    {"char", ncclInt8}, {"int", ncclInt32}, {"fp16", ncclFloat16}, {"float16", ncclFloat16},
    {"fp32", ncclFloat32}, {"float32", ncclFloat32}, {"fp64", ncclFloat64}, {"float64", ncclFloat64},
    {"bf16", ncclBfloat16}, {"e4m3", ncclFloat8e4m3}, {"e5m2", ncclFloat8e5m2},
    {"fp8e4m3", ncclFloat8e4m3}, {"fp8e5m2", ncclFloat8e5m2}};
  if (strcmp(s, "all") == 0) return -2;
  for (int i = 0; i < ncclNumTypes; i++) if (strcmp(s, typeNames[i]) == 0) return i;
  for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++) if (strcmp(s, aliases[i].n) == 0) return aliases[i].t;
  return -3;
}

static void usage(const char* prog) {
  printf("USAGE: %s\n"
         "\t[-t,--nthreads <num threads>]\n"
         "\t[-g,--ngpus <gpus per thread>]\n"
         "\t[-b,--minbytes <min size in bytes>]\n"
         "\t[-e,--maxbytes <max size in bytes>]\n"
         "\t[-i,--stepbytes <increment size>]\n"
         "\t[-f,--stepfactor <increment factor>]\n"
         "\t[-n,--iters <iteration count>]\n"
         "\t[-m,--agg_iters <aggregated iteration count>]\n"
         "\t[-w,--warmup_iters <warmup iteration count>]\n"
         "\t[-N,--run_cycles <cycle count> run & print each cycle (default: 1; 0=infinite)]\n"
         "\t[-p,--parallel_init <0/1>]\n"
         "\t[-c,--check <check iteration count>]\n"
         "\t[-o,--op <sum/prod/min/max/avg/mulsum/all>]\n"
         "\t[-d,--datatype <nccltype/all>]\n"
         "\t[-r,--root <root> (-1 = all roots)]\n"
         "\t[-z,--blocking <0/1>]\n"
         "\t[-y,--stream_null <0/1>]\n"
         "\t[-T,--timeout <time in seconds>]\n"
         "\t[-G,--cudagraph <num graph launches>]\n"
         "\t[-C,--report_cputime <0/1>]\n"
         "\t[-a,--average <0/1/2/3> report average iteration time <0=RANK0/1=AVG/2=MIN/3=MAX>]\n"
         "\t[-R,--local_register <0/1/2> register send/recv buffers with the communicator]\n"
         "\t[-u,--cumem <0/1> (accepted, ignored)]\n"
         "\t[-h,--help]\n", prog);
}

static int parseArgs(int argc, char** argv) {
  static struct option longopts[] = {
    {"nthreads", required_argument, 0, 't'}, {"ngpus", required_argument, 0, 'g'},
    {"minbytes", required_argument, 0, 'b'}, {"maxbytes", required_argument, 0, 'e'},
    {"stepbytes", required_argument, 0, 'i'}, {"stepfactor", required_argument, 0, 'f'},
    {"iters", required_argument, 0, 'n'}, {"agg_iters", required_argument, 0, 'm'},
    {"warmup_iters", required_argument, 0, 'w'}, {"run_cycles", required_argument, 0, 'N'},
    {"parallel_init", required_argument, 0, 'p'}, {"check", required_argument, 0, 'c'},
    {"op", required_argument, 0, 'o'}, {"datatype", required_argument, 0, 'd'},
    {"root", required_argument, 0, 'r'}, {"blocking", required_argument, 0, 'z'},
    {"stream_null", required_argument, 0, 'y'}, {"timeout", required_argument, 0, 'T'},
    {"cudagraph", required_argument, 0, 'G'}, {"report_cputime", required_argument, 0, 'C'},
    {"average", required_argument, 0, 'a'}, {"local_register", required_argument, 0, 'R'},
    {"cumem", required_argument, 0, 'u'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
  int c, idx;
  double v;
  while ((c = getopt_long(argc, argv, "t:g:b:e:i:f:n:m:w:N:p:c:o:d:r:z:y:T:G:C:a:R:u:h", longopts, &idx)) != -1) {
    switch (c) {
    case 't': optThreads = (int)strtol(optarg, NULL, 0); break;
    case 'g': optGpus = (int)strtol(optarg, NULL, 0); break;
    case 'b':
      if ((v = parseSize(optarg)) < 0) { fprintf(stderr, "invalid size specified for 'minbytes'\n"); return -1; }
      optMinBytes = (size_t)v; break;
    case 'e':
      if ((v = parseSize(optarg)) < 0) { fprintf(stderr, "invalid size specified for 'maxbytes'\n"); return -1; }
      optMaxBytes = (size_t)v; break;
    case 'i':
      if ((v = parseSize(optarg)) < 0) { fprintf(stderr, "invalid size specified for 'stepbytes'\n"); return -1; }
      optStepBytes = (size_t)v; break;
    case 'f': optStepFactor = (size_t)strtol(optarg, NULL, 0); break;
    case 'n': optIters = (int)strtol(optarg, NULL, 0); break;
    case 'm': optAgg = (int)strtol(optarg, NULL, 0); break;
    case 'w': optWarmup = (int)strtol(optarg, NULL, 0); break;
    case 'N': optCycles = (int)strtol(optarg, NULL, 0); break;
    case 'p': optParallelInit = (int)strtol(optarg, NULL, 0); break;
    case 'c': optCheck = (int)strtol(optarg, NULL, 0); break;
    case 'o': {
      int o = parseOp(optarg);
      if (o == -3) { fprintf(stderr, "invalid op '%s'\n", optarg); return -1; }
      if (o == -2) optAllOps = 1; else { optAllOps = 0; optOp = o; }
      break;
    }
    case 'd': {
      int t = parseType(optarg);
      if (t == -3) { fprintf(stderr, "invalid datatype '%s'\n", optarg); return -1; }
      if (t == -2) optAllTypes = 1; else { optAllTypes = 0; optType = t; }
      break;
    }
    case 'r': optRoot = (int)strtol(optarg, NULL, 0); break;
    case 'z': optBlocking = (int)strtol(optarg, NULL, 0); break;
    case 'y': optStreamNull = (int)strtol(optarg, NULL, 0); break;
    case 'T': optTimeout = (int)strtol(optarg, NULL, 0); break;
    case 'G': optGraph = (int)strtol(optarg, NULL, 0); break;
    case 'C': optCputime = (int)strtol(optarg, NULL, 0); break;
    case 'a': optAverage = (int)strtol(optarg, NULL, 0); break;
    case 'R': optRegister = (int)strtol(optarg, NULL, 0); break;
    case 'u': break;
    case 'h': usage(basename(argv[0])); return 1;
    default: usage(basename(argv[0])); return -1;
    }
  }
  if (optind < argc) { fprintf(stderr, "unexpected argument '%s'\n", argv[optind]); return -1; }
  if (optMinBytes > optMaxBytes) {
    fprintf(stderr, "invalid sizes for 'minbytes' and 'maxbytes': %zu > %zu\n", optMinBytes, optMaxBytes);
    return -1;
  }
  if (optThreads < 1 || optGpus < 1 || optThreads * optGpus > MAX_LOCAL) {
    fprintf(stderr, "invalid -t/-g: need 1 <= nthreads*ngpus <= %d\n", MAX_LOCAL);
    return -1;
  }
  if (optAverage < 0 || optAverage > 3) { fprintf(stderr, "invalid -a %d\n", optAverage); return -1; }
  if (optStepFactor == 0) optStepFactor = 1;
  if (optStepFactor <= 1 && optStepBytes == 0 && optMinBytes != optMaxBytes) {
    fprintf(stderr, "invalid step: -i 0 without -f\n");
    return -1;
  }
  return 0;
}

int main(int argc, char** argv) {
  setlinebuf(stdout);
  gethostname(hostName, sizeof hostName - 1);
  int pr = parseArgs(argc, argv);
  if (pr != 0) return pr > 0 ? 0 : EXIT_BAD_ARGS;

  /* NVIDIA's NCCL has no oxcclGetExecutor (weak: NULL there) and always runs on the GPU. */
  if (oxcclGetExecutor) NCCLCHECK(oxcclGetExecutor(&executor));
  else executor = 1;
  if (executor == 1) cudaLoad();
  oobInit();
  nRanks = nProcs * optThreads * optGpus;

  const char* name = perfTool.name;
  if (procRank == 0) {
    printf("# Collective test starting: %s\n", name);
    printf("# nThread %d nGpus %d minBytes %zu maxBytes %zu step: %zu(%s) warmup iters: %d iters: %d "
           "agg iters: %d validation: %d graph: %d\n",
           optThreads, optGpus, optMinBytes, optMaxBytes, optStepFactor > 1 ? optStepFactor : optStepBytes,
           optStepFactor > 1 ? "factor" : "bytes", optWarmup, optIters, optAgg, optCheck, optGraph);
    if (optGraph > 0) printf("# Option -G (CUDA graph) is not supported by the %s executor. Ignoring\n",
                             executor == 1 ? "CUDA" : "host");
    if (executor == 0 && optRegister) printf("# -R %d: buffers from ncclMemAlloc, registered with ncclCommRegister\n", optRegister);
    printf("#\n# Using devices\n");
  }
  if (perfTool.pow2Ranks && (nRanks & (nRanks - 1)) != 0) {
    if (procRank == 0) printf("# %s needs a power-of-two number of ranks (got %d)\n", name, nRanks);
    return EXIT_BAD_ARGS;
  }

  /* device lines of every process, printed by process 0 in rank order */
  enum { LINE = 400 };
  int perProc = optThreads * optGpus;
  char* mine = calloc((size_t)perProc, LINE);
  for (int t = 0; t < optThreads; t++)
    for (int g = 0; g < optGpus; g++) {
      int l = t * optGpus + g;
      int rank = procRank * perProc + l;
      int dev = localProc * perProc + l;
      snprintf(mine + (size_t)l * LINE, LINE, "#  Rank %2d Group %2d Pid %6d on %10s device %2d [0x%02x] %s\n",
               rank, 0, (int)getpid(), hostName, dev, dev & 0xff,
               executor == 1 ? "CUDA device (oxccl CUDA executor)" : "oxccl host slot (host executor)");
    }
  char* all = malloc((size_t)perProc * LINE * nProcs);
  oobAllgather(mine, (size_t)perProc * LINE, all);
  if (procRank == 0)
    for (int i = 0; i < perProc * nProcs; i++) fputs(all + (size_t)i * LINE, stdout);
  free(mine);
  free(all);

  /* the unique id travels from process 0 through the launcher's rendezvous */
  {
    ncclUniqueId mineId;
    memset(&mineId, 0, sizeof mineId);
    if (procRank == 0) NCCLCHECK(ncclGetUniqueId(&mineId));
    ncclUniqueId* ids = malloc(sizeof(ncclUniqueId) * nProcs);
    oobAllgather(&mineId, sizeof mineId, ids);
    uniqueId = ids[0];
    free(ids);
  }

  if (procRank == 0) {
    printf("#\n");
    printf("#%61s%s%22s%s\n", "", "out-of-place", "", "in-place");
    printf("#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong\n");
    printf("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)       \n");
  }

  threads = calloc((size_t)optThreads, sizeof(threadState));
  pthread_t* tids = calloc((size_t)optThreads, sizeof(pthread_t));
  for (int t = 0; t < optThreads; t++) {
    threadState* st = &threads[t];
    st->thread = t;
    st->nLocal = optGpus;
    for (int g = 0; g < optGpus; g++) {
      st->ranks[g] = (procRank * optThreads + t) * optGpus + g;
      st->devs[g] = (localProc * optThreads + t) * optGpus + g;
    }
  }
  for (int t = 1; t < optThreads; t++) pthread_create(&tids[t], NULL, threadMain, &threads[t]);
  threadMain(&threads[0]);
  for (int t = 1; t < optThreads; t++) pthread_join(tids[t], NULL);

  double bw = 0;
  int bwCount = 0;
  long long wrong = 0;
  for (int t = 0; t < optThreads; t++) {
    bw += threads[t].bwSum;
    bwCount += threads[t].bwCount;
    wrong += threads[t].wrongTotal;
  }
  /* wrong counts were already summed over every rank; busbw is the same on every thread */
  wrong = threads[0].wrongTotal;
  bw = threads[0].bwCount ? threads[0].bwSum / threads[0].bwCount : 0;
  (void)bwCount;
  const char* minEnv = getenv("NCCL_TESTS_MIN_BW");
  double minBw = minEnv ? atof(minEnv) : -1;
  int bwFail = minEnv && bw < minBw * 0.9;
  if (procRank == 0) {
    printf("# Out of bounds values : %lld %s\n", wrong, wrong ? "FAILED" : "OK");
    printf("# Avg bus bandwidth    : %g %s\n", bw, minEnv ? (bwFail ? "FAILED" : "OK") : "");
    printf("#\n");
    printf("# Collective test concluded: %s\n", name);
    printf("#\n");
  }
  if (nProcs > 1) {
    char z = 0, *zs = malloc((size_t)nProcs);
    oobAllgather(&z, 1, zs);
    free(zs);
  }
  fflush(stdout);
  return (wrong || bwFail) ? EXIT_WRONG : 0;
}
