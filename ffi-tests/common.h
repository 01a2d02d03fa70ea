/* Helpers shared by the ffi test programs. They use the library only through nccl.h and -lnccl.
 *
 * - NCCLCHECK(cmd): on failure prints the call, ncclGetErrorString and ncclGetLastError, exits 1.
 * - datatype tables and our OWN conversions for half, bfloat16, fp8 e4m3 and fp8 e5m2
 *   (independent of the library), element load/store through doubles.
 * - the oxccl extension declarations (host streams, executor query), in case nccl.h lacks them.
 * - now_sec(), shared_zeroed() (memory shared with forked children).
 */
#ifndef OXCCL_FFI_COMMON_H
#define OXCCL_FFI_COMMON_H

#include <nccl.h>

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The oxccl extensions (see HELPERS.md). The repository's include/nccl.h declares them too; an
 * identical redeclaration is harmless in C and C++, and a header may define
 * OXCCL_HOST_STREAM_DECLARED to skip ours. */
#ifndef OXCCL_HOST_STREAM_DECLARED
#define OXCCL_HOST_STREAM_DECLARED 1
ncclResult_t oxcclHostStreamCreate(cudaStream_t* stream);
ncclResult_t oxcclHostStreamSynchronize(cudaStream_t stream);
ncclResult_t oxcclHostStreamQuery(cudaStream_t stream);
ncclResult_t oxcclHostStreamDestroy(cudaStream_t stream);
#endif
#ifndef OXCCL_GET_EXECUTOR_DECLARED
#define OXCCL_GET_EXECUTOR_DECLARED 1
ncclResult_t oxcclGetExecutor(int* executor);
#endif

#ifdef __cplusplus
}
#endif

#define NCCLCHECK(cmd)                                                                         \
  do {                                                                                         \
    ncclResult_t res_ = (cmd);                                                                 \
    if (res_ != ncclSuccess) {                                                                 \
      const char* last_ = ncclGetLastError(NULL);                                              \
      fprintf(stderr, "FAIL %s:%d: %s -> %s (%d); last error: %s\n", __FILE__, __LINE__, #cmd, \
              ncclGetErrorString(res_), (int)res_, last_ ? last_ : "(null)");                  \
      fflush(stderr);                                                                          \
      exit(1);                                                                                 \
    }                                                                                          \
  } while (0)

#define SYSCHECK(cond, what)                                     \
  do {                                                           \
    if (!(cond)) {                                               \
      fprintf(stderr, "FAIL %s:%d: %s\n", __FILE__, __LINE__, what); \
      perror(what);                                              \
      exit(1);                                                   \
    }                                                            \
  } while (0)

/* ---------------------------------------------------------------------------------------------
 * Datatypes
 * ------------------------------------------------------------------------------------------- */

#define NUM_DTYPES 12

static const char* const dtype_names[NUM_DTYPES] = {"int8",   "uint8", "int32",  "uint32",
                                                    "int64",  "uint64", "half",  "float",
                                                    "double", "bfloat16", "f8e4m3", "f8e5m2"};

static inline size_t dtype_size(int dt) {
  switch (dt) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    default: return 8;
  }
}

static inline int dtype_is_float(int dt) {
  return dt == ncclFloat16 || dt == ncclFloat32 || dt == ncclFloat64 || dt == ncclBfloat16 ||
         dt == ncclFloat8e4m3 || dt == ncclFloat8e5m2;
}

static inline int dtype_is_signed(int dt) {
  return !(dt == ncclUint8 || dt == ncclUint32 || dt == ncclUint64);
}

/* Largest L such that every integer in [-L, L] (or [0, L] unsigned) is exact in the type. */
static inline int64_t dtype_exact_int_limit(int dt) {
  switch (dt) {
    case ncclInt8: return 127;
    case ncclUint8: return 255;
    case ncclInt32: return 2147483647LL;
    case ncclUint32: return 4294967295LL;
    case ncclFloat16: return 2048;
    case ncclFloat32: return 1LL << 24;
    case ncclFloat64: return 1LL << 53;
    case ncclBfloat16: return 256;
    case ncclFloat8e4m3: return 16;
    case ncclFloat8e5m2: return 8;
    default: return 1LL << 60; /* int64, uint64 */
  }
}

/* A small binary floating-point format: exponent bits, mantissa bits, bias, and whether the
 * all-ones exponent still holds finite numbers (e4m3 "fn": only S.1111.111 is NaN). */
typedef struct {
  int ebits, mbits, bias, fn;
} minifloat_t;

static const minifloat_t MF_HALF = {5, 10, 15, 0};
static const minifloat_t MF_BF16 = {8, 7, 127, 0};
static const minifloat_t MF_E4M3 = {4, 3, 7, 1};
static const minifloat_t MF_E5M2 = {5, 2, 15, 0};

static inline double mf_max_finite(minifloat_t f) {
  int emax = (1 << f.ebits) - 1 - f.bias; /* exponent of the all-ones field */
  if (f.fn) return ldexp((double)((1 << (f.mbits + 1)) - 2), emax - f.mbits); /* 1.110 x 2^8 */
  return ldexp((double)((1 << (f.mbits + 1)) - 1), emax - 1 - f.mbits);
}

/* Decode the bits of a minifloat to a double (exact). */
static inline double mf_decode(minifloat_t f, uint32_t bits) {
  uint32_t sign = (bits >> (f.ebits + f.mbits)) & 1;
  uint32_t e = (bits >> f.mbits) & ((1u << f.ebits) - 1);
  uint32_t m = bits & ((1u << f.mbits) - 1);
  double v;
  if (e == (1u << f.ebits) - 1 && (!f.fn || m == (1u << f.mbits) - 1)) {
    v = (!f.fn && m == 0) ? INFINITY : NAN;
  } else if (e == 0) {
    v = ldexp((double)m, 1 - f.bias - f.mbits);
  } else {
    v = ldexp((double)((1u << f.mbits) | m), (int)e - f.bias - f.mbits);
  }
  return sign ? -v : v;
}

/* Spacing of representable values at |x| (the unit in the last place). */
static inline double mf_ulp(minifloat_t f, double x) {
  int e2;
  double a = fabs(x);
  if (a == 0) return ldexp(1.0, 1 - f.bias - f.mbits);
  frexp(a, &e2);
  int E = e2 - 1;
  if (E < 1 - f.bias) E = 1 - f.bias;
  return ldexp(1.0, E - f.mbits);
}

/* Encode a double to the nearest minifloat, ties to even; saturates to the largest finite. */
static inline uint32_t mf_encode(minifloat_t f, double x) {
  uint32_t sign = signbit(x) ? 1u : 0u;
  uint32_t sbit = sign << (f.ebits + f.mbits);
  double a = fabs(x);
  if (isnan(x)) return sbit | (((1u << (f.ebits + f.mbits)) - 1)); /* a NaN pattern */
  if (a == 0) return sbit;
  double q = mf_ulp(f, a);
  double v = nearbyint(a / q) * q; /* a/q is exact (q is a power of two); default mode: RNE */
  double mx = mf_max_finite(f);
  if (v > mx) v = mx;
  if (v == 0) return sbit;
  int e2;
  frexp(v, &e2);
  int E = e2 - 1;
  if (E < 1 - f.bias) {
    uint32_t m = (uint32_t)ldexp(v, f.bias - 1 + f.mbits);
    return sbit | m;
  }
  uint32_t m = (uint32_t)(ldexp(v, f.mbits - E) - (double)(1u << f.mbits));
  return sbit | ((uint32_t)(E + f.bias) << f.mbits) | m;
}

static inline int dtype_minifloat(int dt, minifloat_t* f) {
  switch (dt) {
    case ncclFloat16: *f = MF_HALF; return 1;
    case ncclBfloat16: *f = MF_BF16; return 1;
    case ncclFloat8e4m3: *f = MF_E4M3; return 1;
    case ncclFloat8e5m2: *f = MF_E5M2; return 1;
    default: *f = MF_HALF; return 0;
  }
}

/* Read element idx of a buffer of type dt as a double. */
static inline double load_elem(int dt, const void* buf, size_t idx) {
  const char* p = (const char*)buf + idx * dtype_size(dt);
  switch (dt) {
    case ncclInt8: { int8_t v; memcpy(&v, p, 1); return v; }
    case ncclUint8: { uint8_t v; memcpy(&v, p, 1); return v; }
    case ncclInt32: { int32_t v; memcpy(&v, p, 4); return v; }
    case ncclUint32: { uint32_t v; memcpy(&v, p, 4); return v; }
    case ncclInt64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case ncclUint64: { uint64_t v; memcpy(&v, p, 8); return (double)v; }
    case ncclFloat32: { float v; memcpy(&v, p, 4); return v; }
    case ncclFloat64: { double v; memcpy(&v, p, 8); return v; }
    case ncclFloat16: case ncclBfloat16: {
      uint16_t v; minifloat_t f; memcpy(&v, p, 2); dtype_minifloat(dt, &f); return mf_decode(f, v);
    }
    default: {
      uint8_t v; minifloat_t f; memcpy(&v, p, 1); dtype_minifloat(dt, &f); return mf_decode(f, v);
    }
  }
}

/* Write v (already a value of the type, or rounded to nearest for floats) into element idx. */
static inline void store_elem(int dt, void* buf, size_t idx, double v) {
  char* p = (char*)buf + idx * dtype_size(dt);
  switch (dt) {
    case ncclInt8: { int8_t x = (int8_t)v; memcpy(p, &x, 1); break; }
    case ncclUint8: { uint8_t x = (uint8_t)v; memcpy(p, &x, 1); break; }
    case ncclInt32: { int32_t x = (int32_t)v; memcpy(p, &x, 4); break; }
    case ncclUint32: { uint32_t x = (uint32_t)v; memcpy(p, &x, 4); break; }
    case ncclInt64: { int64_t x = (int64_t)v; memcpy(p, &x, 8); break; }
    case ncclUint64: { uint64_t x = (uint64_t)v; memcpy(p, &x, 8); break; }
    case ncclFloat32: { float x = (float)v; memcpy(p, &x, 4); break; }
    case ncclFloat64: { memcpy(p, &v, 8); break; }
    case ncclFloat16: case ncclBfloat16: {
      minifloat_t f; dtype_minifloat(dt, &f); uint16_t x = (uint16_t)mf_encode(f, v);
      memcpy(p, &x, 2); break;
    }
    default: {
      minifloat_t f; dtype_minifloat(dt, &f); uint8_t x = (uint8_t)mf_encode(f, v);
      memcpy(p, &x, 1); break;
    }
  }
}

/* ulp of the type at x (floats only). */
static inline double dtype_ulp(int dt, double x) {
  minifloat_t f;
  if (dtype_minifloat(dt, &f)) return mf_ulp(f, x);
  if (dt == ncclFloat32) {
    float a = (float)fabs(x);
    return (double)nextafterf(a, INFINITY) - (double)a;
  }
  double a = fabs(x);
  return nextafter(a, INFINITY) - a;
}

/* Self-check of the conversions against hand-computed bit patterns (so a bug in our own reference
 * code cannot pass silently). Returns the number of failures. */
static inline int check_conversions(void) {
  struct { minifloat_t f; double v; uint32_t bits; } t[] = {
      {{5, 10, 15, 0}, 1.0, 0x3c00},  {{5, 10, 15, 0}, -2.0, 0xc000},
      {{5, 10, 15, 0}, 65504.0, 0x7bff}, {{5, 10, 15, 0}, 5.960464477539063e-08, 0x0001},
      {{5, 10, 15, 0}, 0.333251953125, 0x3555}, {{8, 7, 127, 0}, 1.0, 0x3f80},
      {{8, 7, 127, 0}, -3.0, 0xc040}, {{8, 7, 127, 0}, 0.333984375, 0x3eab},
      {{4, 3, 7, 1}, 1.0, 0x38},      {{4, 3, 7, 1}, 448.0, 0x7e},
      {{4, 3, 7, 1}, -0.001953125, 0x81}, {{4, 3, 7, 1}, 3.0, 0x44},
      {{5, 2, 15, 0}, 1.0, 0x3c},     {{5, 2, 15, 0}, 57344.0, 0x7b},
      {{5, 2, 15, 0}, -1.5, 0xbe},    {{5, 2, 15, 0}, 1.52587890625e-05, 0x01},
  };
  int bad = 0;
  for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++) {
    uint32_t got = mf_encode(t[i].f, t[i].v);
    double back = mf_decode(t[i].f, t[i].bits);
    if (got != t[i].bits || back != t[i].v) {
      fprintf(stderr, "FAIL conversion self-check %zu: %.17g -> 0x%x (want 0x%x), back %.17g\n", i,
              t[i].v, got, t[i].bits, back);
      bad++;
    }
  }
  /* Ties to even: 1 + 2^-11 in half is a tie between 1 and 1+2^-10 -> 1.0; 1+3*2^-11 -> up. */
  if (mf_encode(MF_HALF, 1.0 + ldexp(1, -11)) != 0x3c00) bad++;
  if (mf_encode(MF_HALF, 1.0 + 3 * ldexp(1, -11)) != 0x3c02) bad++;
  if (mf_encode(MF_E5M2, 0.9375) != 0x3c) bad++;  /* tie between 0.875 and 1.0 -> 1.0 (even) */
  if (mf_encode(MF_E4M3, 17.0) != 0x58) bad++;    /* tie between 16 and 18 -> 16 (even) */
  if (bad) fprintf(stderr, "FAIL conversion self-check: %d failures\n", bad);
  return bad;
}

static inline double now_sec(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* `bytes` of zeroed memory that the processes this one forks share with it. */
static inline void* shared_zeroed(size_t bytes) {
  void* p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  SYSCHECK(p != MAP_FAILED, "mmap");
  memset(p, 0, bytes);
  return p;
}

/* Value of element i on rank r for the simple examples: small integers, exact in every type. */
static inline double example_value(int rank, size_t i) { return (double)((rank * 3 + (int)(i % 5)) % 8); }

#endif
