/* Every collective x every datatype x every reduction x in/out-of-place x several counts x every
 * root, on NRANKS ranks of one process (ncclCommInitAll + groups), each element checked against a
 * reference computed here (in int64 / double, converted with our own minifloat code).
 *
 * usage: coll_matrix NRANKS [stream|cuda] [memalloc] [big=none|some|all] [coll=NAME]
 *   stream    per-rank oxccl host streams; several cases queued before oxcclHostStreamSynchronize
 *   cuda      on a GPU: every rank on device 0 (ncclCommInitAll with a devlist of zeros), buffers
 *             (guard bytes included) in device memory (cuMemAlloc) with a host shadow: a case's
 *             shadow is filled and copied to the device on the rank's stream, collectives run on
 *             per-rank CUDA streams (non-blocking), several cases are queued as with `stream`, and
 *             a flush synchronizes every stream, copies every buffer back into its shadow and
 *             checks the shadow (guards too). PreMulSum's "device" scalar is in device memory.
 *             The driver is loaded with dlopen (cuda_driver.h); without one the program exits 3.
 *   memalloc  buffers from ncclMemAlloc instead of malloc (with cuda: instead of cuMemAlloc)
 *   big=      how much of the matrix runs at count 70000 (default some: every collective and
 *             datatype, ops sum/avg/premulsum-device, roots 0 and n-1)
 *   coll=     run one collective only (AllReduce, Broadcast, Bcast, Reduce, AllGather,
 *             ReduceScatter, AlltoAll, Gather, Scatter, SendRecv, AlltoAllv)
 * Prints "coll_matrix: N checks passed, M failed"; exits 0 only when M == 0.
 */
#include "common.h"
#include "cuda_driver.h"

#include <stdarg.h>

enum { C_ALLREDUCE, C_BROADCAST, C_BCAST, C_REDUCE, C_ALLGATHER, C_REDUCESCATTER, C_ALLTOALL,
       C_GATHER, C_SCATTER, C_SENDRECV, C_ALLTOALLV, NUM_COLLS };
static const char* const coll_names[NUM_COLLS] = {
    "AllReduce", "Broadcast", "Bcast",   "Reduce",   "AllGather", "ReduceScatter",
    "AlltoAll",  "Gather",    "Scatter", "SendRecv", "AlltoAllv"};

/* Reductions: the 5 builtins plus PreMulSum with a host-immediate or a "device" scalar. */
enum { OP_SUM, OP_PROD, OP_MAX, OP_MIN, OP_AVG, OP_PMS_HOST, OP_PMS_DEV, NUM_OPS };
static const char* const op_names[NUM_OPS] = {"sum", "prod", "max", "min", "avg",
                                              "premulsum(host)", "premulsum(device)"};

#define MAX_RANKS 8
#define PAD 64 /* guard bytes before and after every buffer */
#define GUARD_BYTE 0xA5
#define POISON_BYTE 0x5A
#define MAX_PENDING 16
#define MAX_PENDING_BYTES (96u << 20)

static int nranks;
static int use_stream, use_memalloc, use_cuda, big_mode = 1; /* 0 none, 1 some, 2 all */
static ncclComm_t comms[MAX_RANKS];
static cudaStream_t streams[MAX_RANKS];
static long long n_pass, n_fail;
static int printed;

static void report(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
static void report(const char* fmt, ...) {
  n_fail++;
  if (printed++ >= 60) return;
  va_list ap;
  va_start(ap, fmt);
  fputs("FAIL ", stderr);
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
}

/* ----------------------------------------------------------------------------------------------
 * Inputs: small integers chosen so that every partial result is exact in the datatype, whatever
 * order the library reduces in.
 * -------------------------------------------------------------------------------------------- */
typedef struct {
  int coll, dt, op, inplace, root;
  size_t count;
  int seed;
  int64_t mag;     /* values in [-mag, mag] (signed) or [0, mag] (unsigned / avg) */
  int active;      /* sum-like ops: only `active` ranks per element contribute non-zero values */
} Gen;

static int is_reduction(int coll) {
  return coll == C_ALLREDUCE || coll == C_REDUCE || coll == C_REDUCESCATTER;
}

static void gen_setup(Gen* g) {
  int64_t L = dtype_exact_int_limit(g->dt);
  int64_t cap = dtype_is_float(g->dt) ? 1000 : 100000;
  if (g->dt == ncclInt8 || g->dt == ncclUint8) cap = 1000;
  g->active = nranks;
  if (!is_reduction(g->coll) || g->op == OP_MAX || g->op == OP_MIN || g->op == OP_PROD) {
    g->mag = L < cap ? L : cap;
    return;
  }
  int smax = (g->op == OP_PMS_HOST || g->op == OP_PMS_DEV) ? 2 : 1;
  int k = nranks;
  if ((int64_t)k * smax > L) k = (int)(L / smax);
  if (k < 1) k = 1;
  g->active = k;
  int64_t m = L / ((int64_t)k * smax);
  g->mag = m < cap ? m : cap;
}

static uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

/* Input element idx of rank r's send buffer. */
static int64_t gen_value(const Gen* g, int r, size_t idx) {
  uint32_t h = mix((uint32_t)idx * 2654435761U ^ mix((uint32_t)r * 97u + (uint32_t)g->seed));
  int sgn = dtype_is_signed(g->dt);
  if (is_reduction(g->coll) && g->op == OP_PROD) {
    /* +-1 everywhere, and 2 on at most one rank per element: |product| <= 2. */
    int64_t v = (((size_t)r + idx * 3 + (size_t)g->seed) % (size_t)(nranks + 1) == 0) ? 2 : 1;
    if (sgn && (h & 8)) v = -v;
    return v;
  }
  if (is_reduction(g->coll) && g->op != OP_MAX && g->op != OP_MIN) {
    if (g->active < nranks && (((size_t)r + idx) % (size_t)nranks) >= (size_t)g->active) return 0;
    if (!sgn || g->op == OP_AVG) return (int64_t)(h % (uint64_t)(g->mag + 1));
    return (int64_t)(h % (uint64_t)(2 * g->mag + 1)) - g->mag;
  }
  if (!sgn) return (int64_t)(h % (uint64_t)(g->mag + 1));
  return (int64_t)(h % (uint64_t)(2 * g->mag + 1)) - g->mag;
}

/* The PreMulSum scalar of rank r: 1 or 2. */
static int64_t pms_scalar(int r) { return 1 + (r % 2); }

/* Reduce element `idx` of every rank's send buffer. *exact is 0 when the result is a float average
 * (compared with a tolerance). */
static double reduce_ref(const Gen* g, size_t idx, int* exact) {
  int64_t acc = 0;
  *exact = 1;
  for (int p = 0; p < nranks; p++) {
    int64_t v = gen_value(g, p, idx);
    switch (g->op) {
      case OP_SUM: case OP_AVG: acc = p ? acc + v : v; break;
      case OP_PROD: acc = p ? acc * v : v; break;
      case OP_MAX: acc = (p == 0 || v > acc) ? v : acc; break;
      case OP_MIN: acc = (p == 0 || v < acc) ? v : acc; break;
      default: acc = p ? acc + pms_scalar(p) * v : pms_scalar(p) * v; break;
    }
  }
  if (g->op == OP_AVG) {
    if (dtype_is_float(g->dt)) {
      *exact = 0;
      return (double)acc / nranks;
    }
    return (double)(acc / nranks); /* C division truncates toward zero */
  }
  return (double)acc;
}

/* ----------------------------------------------------------------------------------------------
 * Buffers with guard bytes on both sides.
 * -------------------------------------------------------------------------------------------- */
typedef struct {
  char* base;      /* allocation start (cuda: the host shadow) */
  size_t bytes;    /* payload bytes */
  CUdeviceptr dev; /* cuda: the device allocation the shadow mirrors */
} Buf;

static void buf_alloc(Buf* b, size_t bytes) {
  size_t total = bytes + 2 * PAD;
  b->dev = 0;
  if (use_cuda) {
    if (use_memalloc) {
      void* p = NULL;
      NCCLCHECK(ncclMemAlloc(&p, total));
      b->dev = (CUdeviceptr)(uintptr_t)p;
    } else {
      CUCHECK(cu.MemAlloc(&b->dev, total));
    }
    b->base = (char*)malloc(total);
    SYSCHECK(b->base != NULL, "malloc");
  } else if (use_memalloc) {
    void* p = NULL;
    NCCLCHECK(ncclMemAlloc(&p, total));
    b->base = (char*)p;
  } else {
    b->base = (char*)malloc(total);
    SYSCHECK(b->base != NULL, "malloc");
  }
  b->bytes = bytes;
  memset(b->base, GUARD_BYTE, PAD);
  memset(b->base + PAD + bytes, GUARD_BYTE, PAD);
  memset(b->base + PAD, POISON_BYTE, bytes);
}

static char* buf_data(const Buf* b) { return b->base + PAD; }

/* cuda: the device address of a pointer into b's shadow. */
static void* buf_dev(const Buf* b, const char* host) {
  return (void*)(uintptr_t)(b->dev + (CUdeviceptr)(host - b->base));
}

/* cuda: shadow -> device (on the rank's stream, ordered before its collectives). */
static void buf_upload(const Buf* b, CUstream st) {
  if (b->base) CUCHECK(cu.MemcpyHtoDAsync(b->dev, b->base, b->bytes + 2 * PAD, st));
}

/* cuda: device -> shadow (after the streams were synchronized; a device -> pageable copy has
 * completed when it returns). */
static void buf_download(Buf* b, CUstream st) {
  if (b->base) CUCHECK(cu.MemcpyDtoHAsync(b->base, b->dev, b->bytes + 2 * PAD, st));
}

static void buf_free(Buf* b) {
  if (!b->base) return;
  if (use_cuda) {
    if (use_memalloc) NCCLCHECK(ncclMemFree((void*)(uintptr_t)b->dev));
    else CUCHECK(cu.MemFree(b->dev));
    free(b->base);
  } else if (use_memalloc) {
    NCCLCHECK(ncclMemFree(b->base));
  } else {
    free(b->base);
  }
  b->base = NULL;
}

/* ----------------------------------------------------------------------------------------------
 * One case: a collective with fixed parameters, with its own buffers so several can be in flight.
 * -------------------------------------------------------------------------------------------- */
typedef struct {
  Gen g;
  Buf sbuf[MAX_RANKS], rbuf[MAX_RANKS]; /* in-place: only rbuf is used ("the" buffer) */
  char* sendp[MAX_RANKS];
  char* recvp[MAX_RANKS];
  size_t send_elems, recv_elems;        /* per rank, in elements */
  ncclRedOp_t redop[MAX_RANKS];
  int have_redop;
  uint64_t scalar_store[MAX_RANKS];     /* PreMulSum scalars (bytes of the datatype) */
  CUdeviceptr scalar_dev[MAX_RANKS];    /* cuda: the "device" scalars, in device memory */
  /* AlltoAllv layout */
  size_t a2av_send_total[MAX_RANKS], a2av_recv_total[MAX_RANKS];
} Case;

static size_t a2av_count(const Gen* g, int s, int d) {
  return (g->count * (size_t)((s + 2 * d + g->seed) % 3 + 1)) / 3;
}
static size_t a2av_sdispl(const Gen* g, int s, int d) {
  size_t o = 0;
  for (int x = 0; x < d; x++) o += a2av_count(g, s, x);
  return o;
}
static size_t a2av_rdispl(const Gen* g, int d, int s) {
  size_t o = 0;
  for (int x = 0; x < s; x++) o += a2av_count(g, x, d);
  return o;
}

/* Element counts of the send and receive buffers. */
static void case_sizes(Case* c, int r, size_t* se, size_t* re) {
  size_t n = (size_t)nranks, cnt = c->g.count;
  switch (c->g.coll) {
    case C_ALLGATHER: case C_GATHER: *se = cnt; *re = n * cnt; break;
    case C_REDUCESCATTER: case C_SCATTER: *se = n * cnt; *re = cnt; break;
    case C_ALLTOALL: *se = n * cnt; *re = n * cnt; break;
    case C_ALLTOALLV: *se = c->a2av_send_total[r]; *re = c->a2av_recv_total[r]; break;
    default: *se = cnt; *re = cnt; break;
  }
}

static size_t case_bytes(const Case* c) {
  size_t b = 0;
  for (int r = 0; r < nranks; r++) b += c->sbuf[r].bytes + c->rbuf[r].bytes;
  return b;
}

static void case_setup(Case* c) {
  Gen* g = &c->g;
  size_t es = dtype_size(g->dt);
  gen_setup(g);
  if (g->coll == C_ALLTOALLV) {
    for (int r = 0; r < nranks; r++) {
      c->a2av_send_total[r] = c->a2av_recv_total[r] = 0;
      for (int p = 0; p < nranks; p++) {
        c->a2av_send_total[r] += a2av_count(g, r, p);
        c->a2av_recv_total[r] += a2av_count(g, p, r);
      }
    }
  }
  for (int r = 0; r < nranks; r++) {
    size_t se, re;
    case_sizes(c, r, &se, &re);
    c->send_elems = se; /* last rank's; per-rank values are recomputed where needed */
    c->recv_elems = re;
    memset(&c->sbuf[r], 0, sizeof(Buf));
    if (g->inplace) {
      size_t big = se > re ? se : re;
      buf_alloc(&c->rbuf[r], big * es);
      char* d = buf_data(&c->rbuf[r]);
      c->sendp[r] = c->recvp[r] = d;
      if (g->coll == C_ALLGATHER || g->coll == C_GATHER) c->sendp[r] = d + (size_t)r * g->count * es;
      if (g->coll == C_REDUCESCATTER || g->coll == C_SCATTER)
        c->recvp[r] = d + (size_t)r * g->count * es;
    } else {
      buf_alloc(&c->sbuf[r], se * es);
      buf_alloc(&c->rbuf[r], re * es);
      c->sendp[r] = buf_data(&c->sbuf[r]);
      c->recvp[r] = buf_data(&c->rbuf[r]);
    }
    for (size_t i = 0; i < se; i++) store_elem(g->dt, c->sendp[r], i, (double)gen_value(g, r, i));
    if (use_cuda) {
      buf_upload(&c->sbuf[r], streams[r]);
      buf_upload(&c->rbuf[r], streams[r]);
    }
  }
}

/* The buffers sendp/recvp point into, and the pointers the library gets (device addresses with
 * cuda). */
static const Buf* send_buf(const Case* c, int r) { return c->g.inplace ? &c->rbuf[r] : &c->sbuf[r]; }

static void* lib_send(const Case* c, int r) {
  return use_cuda ? buf_dev(send_buf(c, r), c->sendp[r]) : (void*)c->sendp[r];
}

static void* lib_recv(const Case* c, int r) {
  return use_cuda ? buf_dev(&c->rbuf[r], c->recvp[r]) : (void*)c->recvp[r];
}

static void case_create_ops(Case* c) {
  Gen* g = &c->g;
  c->have_redop = 0;
  if (!is_reduction(g->coll)) return;
  if (g->op < OP_PMS_HOST) {
    for (int r = 0; r < nranks; r++) c->redop[r] = (ncclRedOp_t)g->op; /* ncclSum.. ncclAvg */
    return;
  }
  for (int r = 0; r < nranks; r++) {
    c->scalar_store[r] = 0;
    if (g->op == OP_PMS_HOST) {
      store_elem(g->dt, &c->scalar_store[r], 0, (double)pms_scalar(r));
      NCCLCHECK(ncclRedOpCreatePreMulSum(&c->redop[r], &c->scalar_store[r], (ncclDataType_t)g->dt,
                                         ncclScalarHostImmediate, comms[r]));
      /* Host-immediate scalars are read during the call: a later change must not matter. */
      store_elem(g->dt, &c->scalar_store[r], 0, 7.0);
    } else if (use_cuda) {
      /* The same with the scalar in device memory, written on the rank's stream. */
      size_t es = dtype_size(g->dt);
      CUCHECK(cu.MemAlloc(&c->scalar_dev[r], 8));
      store_elem(g->dt, &c->scalar_store[r], 0, 5.0);
      CUCHECK(cu.MemcpyHtoDAsync(c->scalar_dev[r], &c->scalar_store[r], es, streams[r]));
      NCCLCHECK(ncclRedOpCreatePreMulSum(&c->redop[r], (void*)(uintptr_t)c->scalar_dev[r],
                                         (ncclDataType_t)g->dt, ncclScalarDevice, comms[r]));
      store_elem(g->dt, &c->scalar_store[r], 0, (double)pms_scalar(r));
      CUCHECK(cu.MemcpyHtoDAsync(c->scalar_dev[r], &c->scalar_store[r], es, streams[r]));
    } else {
      store_elem(g->dt, &c->scalar_store[r], 0, 5.0);
      NCCLCHECK(ncclRedOpCreatePreMulSum(&c->redop[r], &c->scalar_store[r], (ncclDataType_t)g->dt,
                                         ncclScalarDevice, comms[r]));
      /* "Device" scalars are read when the collective executes: set the real value now. */
      store_elem(g->dt, &c->scalar_store[r], 0, (double)pms_scalar(r));
    }
  }
  c->have_redop = 1;
}

static void case_destroy_ops(Case* c) {
  if (!c->have_redop) return;
  for (int r = 0; r < nranks; r++) {
    NCCLCHECK(ncclRedOpDestroy(c->redop[r], comms[r]));
    if (c->scalar_dev[r]) CUCHECK(cu.MemFree(c->scalar_dev[r]));
    c->scalar_dev[r] = 0;
  }
  c->have_redop = 0;
}

static void case_issue(Case* c) {
  Gen* g = &c->g;
  ncclDataType_t dt = (ncclDataType_t)g->dt;
  size_t es = dtype_size(g->dt);
  NCCLCHECK(ncclGroupStart());
  for (int r = 0; r < nranks; r++) {
    ncclComm_t cm = comms[r];
    cudaStream_t st = (use_stream || use_cuda) ? streams[r] : NULL;
    void* s = lib_send(c, r);
    void* d = lib_recv(c, r);
    switch (g->coll) {
      case C_ALLREDUCE: NCCLCHECK(ncclAllReduce(s, d, g->count, dt, c->redop[r], cm, st)); break;
      case C_BROADCAST: NCCLCHECK(ncclBroadcast(s, d, g->count, dt, g->root, cm, st)); break;
      case C_BCAST: NCCLCHECK(ncclBcast(d, g->count, dt, g->root, cm, st)); break;
      case C_REDUCE: NCCLCHECK(ncclReduce(s, d, g->count, dt, c->redop[r], g->root, cm, st)); break;
      case C_ALLGATHER: NCCLCHECK(ncclAllGather(s, d, g->count, dt, cm, st)); break;
      case C_REDUCESCATTER:
        NCCLCHECK(ncclReduceScatter(s, d, g->count, dt, c->redop[r], cm, st));
        break;
      case C_ALLTOALL: NCCLCHECK(ncclAlltoAll(s, d, g->count, dt, cm, st)); break;
      case C_GATHER: NCCLCHECK(ncclGather(s, d, g->count, dt, g->root, cm, st)); break;
      case C_SCATTER: NCCLCHECK(ncclScatter(s, d, g->count, dt, g->root, cm, st)); break;
      case C_SENDRECV: {
        int next = (r + 1) % nranks, prev = (r + nranks - 1) % nranks;
        NCCLCHECK(ncclSend(s, g->count, dt, next, cm, st));
        NCCLCHECK(ncclRecv(d, g->count, dt, prev, cm, st));
        break;
      }
      case C_ALLTOALLV:
        for (int p = 0; p < nranks; p++) {
          NCCLCHECK(ncclSend((char*)s + a2av_sdispl(g, r, p) * es, a2av_count(g, r, p), dt, p, cm, st));
          NCCLCHECK(ncclRecv((char*)d + a2av_rdispl(g, r, p) * es, a2av_count(g, p, r), dt, p, cm, st));
        }
        break;
    }
  }
  NCCLCHECK(ncclGroupEnd());
}

static void describe(const Case* c, char* out, size_t n) {
  const Gen* g = &c->g;
  snprintf(out, n, "%s %s%s%s n=%d count=%zu %s root=%d%s%s%s", coll_names[g->coll],
           dtype_names[g->dt], is_reduction(g->coll) ? " op=" : "",
           is_reduction(g->coll) ? op_names[g->op] : "", nranks, g->count,
           g->inplace ? "in-place" : "out-of-place", g->root, use_stream ? " stream" : "",
           use_cuda ? " cuda" : "", use_memalloc ? " memalloc" : "");
}

static void check_guards(const Case* c, const Buf* b, int r, const char* which) {
  if (!b->base) return;
  for (size_t i = 0; i < PAD; i++) {
    if ((unsigned char)b->base[i] != GUARD_BYTE ||
        (unsigned char)b->base[PAD + b->bytes + i] != GUARD_BYTE) {
      char d[256];
      describe(c, d, sizeof d);
      report("%s: rank %d: bytes around the %s buffer were overwritten", d, r, which);
      return;
    }
  }
  n_pass++;
}

/* Expected value of receive element j on rank r; returns 0 when the element is not defined. */
static int expected(const Case* c, int r, size_t j, double* val, int* exact) {
  const Gen* g = &c->g;
  size_t cnt = g->count;
  *exact = 1;
  switch (g->coll) {
    case C_ALLREDUCE: *val = reduce_ref(g, j, exact); return 1;
    case C_BROADCAST: case C_BCAST: *val = (double)gen_value(g, g->root, j); return 1;
    case C_REDUCE:
      if (r != g->root) return 0;
      *val = reduce_ref(g, j, exact);
      return 1;
    case C_ALLGATHER: *val = (double)gen_value(g, (int)(j / cnt), j % cnt); return 1;
    case C_REDUCESCATTER: *val = reduce_ref(g, (size_t)r * cnt + j, exact); return 1;
    case C_ALLTOALL: *val = (double)gen_value(g, (int)(j / cnt), (size_t)r * cnt + j % cnt); return 1;
    case C_GATHER:
      if (r != g->root) return 0;
      *val = (double)gen_value(g, (int)(j / cnt), j % cnt);
      return 1;
    case C_SCATTER: *val = (double)gen_value(g, g->root, (size_t)r * cnt + j); return 1;
    case C_SENDRECV: *val = (double)gen_value(g, (r + nranks - 1) % nranks, j); return 1;
    case C_ALLTOALLV: {
      int s = 0;
      size_t off = j;
      while (s < nranks && off >= a2av_count(g, s, r)) off -= a2av_count(g, s++, r);
      if (s == nranks) return 0;
      *val = (double)gen_value(g, s, a2av_sdispl(g, s, r) + off);
      return 1;
    }
  }
  return 0;
}

static void case_check(Case* c) {
  const Gen* g = &c->g;
  char d[256];
  describe(c, d, sizeof d);
  for (int r = 0; r < nranks; r++) {
    size_t se, re;
    case_sizes(c, r, &se, &re);
    int bad_here = 0;
    for (size_t j = 0; j < re; j++) {
      double want, got;
      int exact;
      if (!expected(c, r, j, &want, &exact)) continue;
      got = load_elem(g->dt, c->recvp[r], j);
      int ok;
      if (exact) {
        ok = got == want;
      } else {
        /* Float average: premultiplying by 1/n or dividing the sum may round differently;
         * allow max(2, nranks) ulps of the type at the exact result. */
        double tol = (nranks > 2 ? nranks : 2) * dtype_ulp(g->dt, want);
        ok = fabs(got - want) <= tol;
      }
      if (ok) {
        n_pass++;
      } else if (bad_here++ < 3) {
        report("%s: rank %d element %zu: got %.17g, expected %.17g", d, r, j, got, want);
      } else {
        n_fail++;
      }
    }
    /* Out-of-place: the send buffer is const. */
    if (!g->inplace && g->coll != C_BCAST) {
      for (size_t i = 0; i < se; i++) {
        double want = (double)gen_value(g, r, i), got = load_elem(g->dt, c->sendp[r], i);
        if (got != want) {
          report("%s: rank %d: send buffer element %zu changed (%.17g -> %.17g)", d, r, i, want, got);
          break;
        }
      }
    }
    check_guards(c, &c->sbuf[r], r, "send");
    check_guards(c, &c->rbuf[r], r, "receive");
  }
}

static void case_free(Case* c) {
  for (int r = 0; r < nranks; r++) {
    buf_free(&c->sbuf[r]);
    buf_free(&c->rbuf[r]);
  }
}

/* Cases in flight (stream mode queues several before synchronizing). */
static Case* pending[MAX_PENDING];
static int npending;
static size_t pending_bytes;

static void flush(void) {
  if (use_stream) {
    for (int r = 0; r < nranks; r++) NCCLCHECK(oxcclHostStreamSynchronize(streams[r]));
  }
  if (use_cuda) {
    for (int r = 0; r < nranks; r++) CUCHECK(cu.StreamSynchronize(streams[r]));
    for (int i = 0; i < npending; i++)
      for (int r = 0; r < nranks; r++) {
        buf_download(&pending[i]->sbuf[r], streams[r]);
        buf_download(&pending[i]->rbuf[r], streams[r]);
      }
  }
  for (int i = 0; i < npending; i++) {
    case_check(pending[i]);
    case_destroy_ops(pending[i]);
    case_free(pending[i]);
    free(pending[i]);
  }
  npending = 0;
  pending_bytes = 0;
}

static void run_case(int coll, int dt, int op, int inplace, size_t count, int root, int seed) {
  Case* c = (Case*)calloc(1, sizeof(Case));
  SYSCHECK(c != NULL, "calloc");
  c->g.coll = coll;
  c->g.dt = dt;
  c->g.op = op;
  c->g.inplace = inplace;
  c->g.count = count;
  c->g.root = root;
  c->g.seed = seed;
  case_setup(c);
  case_create_ops(c);
  case_issue(c);
  pending[npending++] = c;
  pending_bytes += case_bytes(c);
  if (!(use_stream || use_cuda) || npending == MAX_PENDING || pending_bytes > MAX_PENDING_BYTES) flush();
}

static int has_root(int coll) {
  return coll == C_BROADCAST || coll == C_BCAST || coll == C_REDUCE || coll == C_GATHER ||
         coll == C_SCATTER;
}

int main(int argc, char** argv) {
  int only = -1;
  if (argc < 2) {
    fprintf(stderr, "usage: %s NRANKS [stream|cuda] [memalloc] [big=none|some|all] [coll=NAME]\n",
            argv[0]);
    return 2;
  }
  nranks = atoi(argv[1]);
  if (nranks < 1 || nranks > MAX_RANKS) {
    fprintf(stderr, "NRANKS must be 1..%d\n", MAX_RANKS);
    return 2;
  }
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "stream")) use_stream = 1;
    else if (!strcmp(argv[i], "cuda")) use_cuda = 1;
    else if (!strcmp(argv[i], "memalloc")) use_memalloc = 1;
    else if (!strcmp(argv[i], "big=none")) big_mode = 0;
    else if (!strcmp(argv[i], "big=some")) big_mode = 1;
    else if (!strcmp(argv[i], "big=all")) big_mode = 2;
    else if (!strncmp(argv[i], "coll=", 5)) {
      for (int k = 0; k < NUM_COLLS; k++)
        if (!strcmp(argv[i] + 5, coll_names[k])) only = k;
      if (only < 0) {
        fprintf(stderr, "unknown collective %s\n", argv[i] + 5);
        return 2;
      }
    } else {
      fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (use_stream && use_cuda) {
    fprintf(stderr, "stream (oxccl host streams) and cuda (CUDA streams) exclude each other\n");
    return 2;
  }
  if (check_conversions() != 0) return 1;

  int devs[MAX_RANKS], one_gpu = 0;
  if (use_cuda) {
    cuda_load("coll_matrix");
    cuda_make_current(); /* before any NCCL call on this thread */
    /* Every rank on the one GPU; the host executor (a mock driver) wants distinct slots. */
    one_gpu = !cuda_executor_is_host("coll_matrix", 1);
  }
  for (int r = 0; r < nranks; r++) devs[r] = one_gpu ? 0 : r;
  NCCLCHECK(ncclCommInitAll(comms, nranks, devs));
  for (int r = 0; r < nranks; r++) {
    int cnt = -1, rank = -1;
    NCCLCHECK(ncclCommCount(comms[r], &cnt));
    NCCLCHECK(ncclCommUserRank(comms[r], &rank));
    if (cnt != nranks || rank != r) report("comm %d: count %d rank %d", r, cnt, rank);
    if (use_stream) NCCLCHECK(oxcclHostStreamCreate(&streams[r]));
    if (use_cuda) CUCHECK(cu.StreamCreate(&streams[r], CU_STREAM_NON_BLOCKING));
  }

  static const size_t counts[] = {0, 1, 7, 1000, 70000};
  double t0 = now_sec();
  int seed = 1;
  for (int coll = 0; coll < NUM_COLLS; coll++) {
    if (only >= 0 && coll != only) continue;
    double tc = now_sec();
    long long before = n_pass + n_fail;
    int nops = is_reduction(coll) ? NUM_OPS : 1;
    for (size_t ci = 0; ci < sizeof counts / sizeof counts[0]; ci++) {
      size_t count = counts[ci];
      int big = count >= 70000;
      if (big && big_mode == 0) continue;
      for (int inplace = 0; inplace < 2; inplace++) {
        if (coll == C_BCAST && !inplace) continue;              /* Bcast is in-place only */
        if ((coll == C_SENDRECV || coll == C_ALLTOALL || coll == C_ALLTOALLV) && inplace)
          continue; /* no in-place form documented */
        for (int op = 0; op < nops; op++) {
          if (big && big_mode == 1 && is_reduction(coll) && op != OP_SUM && op != OP_AVG &&
              op != OP_PMS_DEV)
            continue;
          for (int dt = 0; dt < NUM_DTYPES; dt++) {
            int nroots = has_root(coll) ? nranks : 1;
            for (int root = 0; root < nroots; root++) {
              if (big && big_mode == 1 && root != 0 && root != nranks - 1) continue;
              run_case(coll, dt, op, inplace, count, root, seed++);
            }
          }
        }
      }
    }
    flush();
    fprintf(stderr, "  %-13s %9lld checks in %.1fs\n", coll_names[coll], n_pass + n_fail - before,
            now_sec() - tc);
  }
  flush();

  for (int r = 0; r < nranks; r++) {
    if (use_stream) NCCLCHECK(oxcclHostStreamDestroy(streams[r]));
    if (use_cuda) CUCHECK(cu.StreamDestroy(streams[r]));
    NCCLCHECK(ncclCommDestroy(comms[r]));
  }
  printf("coll_matrix: %lld checks passed, %lld failed (nranks=%d%s%s%s, %.1fs)\n", n_pass, n_fail,
         nranks, use_stream ? ", host streams" : "", use_cuda ? ", CUDA device buffers" : "",
         use_memalloc ? ", ncclMemAlloc" : "", now_sec() - t0);
  return n_fail == 0 ? 0 : 1;
}
