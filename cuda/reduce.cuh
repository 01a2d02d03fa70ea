// Element-wise arithmetic of NCCL reductions for the CUDA kernels, bit for bit the host
// executor's (`src/reduce/`: `mod.rs`, `kernel.rs`, `convert.rs`):
//  - integers wrap (sum, product, the premul multiplication); max / min are the integer ones;
//  - f32 / f64 compute natively; float16, bfloat16 and both fp8 formats widen each operand to
//    f32, compute, and round back to nearest even after every operation (the premul product is
//    rounded to the type before it is combined); e4m3 saturates to +-448, the others overflow
//    to infinity;
//  - `ox_combine(src, in)` is `op(prep(src), in)`: the Rust `Combine` kernel's `op(pre(x), y)`
//    with x the local (source) element and y the accumulator (the received input);
//  - float max / min are the host's `maxnum` / `minnum` as LLVM lowers them on x86_64:
//    max(a, b) = a is NaN ? b : (b > a ? b : a) (min with <): a NaN loses to a number, ties
//    (+0 / -0) give `a`, two NaNs give `b` (the host leaves these last two unspecified);
//  - add / mul / div produce the NaN x86 SSE produces: the first NaN operand (a, else b)
//    quieted, or the default NaN (negative, quiet: 0xffc00000 / 0xfff8000000000000) when
//    neither operand is a NaN (inf - inf, 0 * inf); NaN payloads then narrow as `convert.rs`
//    narrows them (top payload bits kept, quiet bit set when they were all zero);
//  - postdiv (integer ncclAvg): truncating division toward zero, exact for every divisor;
//    0 or 1 means none; float types divide in the compute type by the divisor rounded to it.
//
// Host and device give the same bits: the conversions are integer code, comparisons are integer
// compares of the float bits (unaffected by flush-to-zero), and on the device add / mul / div
// are explicit `.rn` PTX instructions without `.ftz` (never contracted into FMAs, subnormals
// kept, whatever -ftz / -fmad / --use_fast_math says). On the host the float operations are
// plain C++: compile with `-ffp-contract=off` wherever FMA instructions are enabled (-mfma,
// -march=native), or `a * b + c` may fuse.
//
// tests/cuda_arith.rs checks the header (under g++) against the host's Reducer bit for bit.
// Compiles with plain g++/clang (`#include <stdint.h>` only), nvcc and NVRTC (which gets a
// stdint.h of typedefs only: no INT64_MIN-style macros are used here).
#pragma once

#include <stdint.h>

#ifndef __CUDACC__
#ifndef __host__
#define __host__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __forceinline__
#define __forceinline__ inline __attribute__((always_inline))
#endif
#endif

#define OX_FN __host__ __device__ __forceinline__

// dtype codes = ncclDataType_t: 0 int8, 1 uint8, 2 int32, 3 uint32, 4 int64, 5 uint64, 6 half,
// 7 float, 8 double, 9 bfloat16, 10 fp8 e4m3, 11 fp8 e5m2. kind: 0 sum, 1 prod, 2 max, 3 min.
struct OxRed {  // 32 bytes, same layout in Rust (#[repr(C)])
  uint32_t dtype;
  uint32_t kind;
  uint32_t has_premul;   // PreMulSum (kind is then 0 = sum)
  uint32_t pad;
  uint64_t premul_bits;  // the scalar's bits in the dtype (low bits used)
  uint64_t postdiv;      // divisor for ncclAvg (0 or 1: none)
};

// ---- bit casts ----

OX_FN uint32_t ox_fbits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
#endif
}
OX_FN float ox_bitsf(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
#endif
}
OX_FN uint64_t ox_dbits(double f) {
#ifdef __CUDA_ARCH__
  return (uint64_t)__double_as_longlong(f);
#else
  uint64_t u;
  __builtin_memcpy(&u, &f, 8);
  return u;
#endif
}
OX_FN double ox_bitsd(uint64_t u) {
#ifdef __CUDA_ARCH__
  return __longlong_as_double((long long)u);
#else
  double f;
  __builtin_memcpy(&f, &u, 8);
  return f;
#endif
}

// Leading zeros of a non-zero 32-bit value.
OX_FN int ox_clz32(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __clz((int)x);
#else
  return __builtin_clz(x);
#endif
}

// ---- float arithmetic: IEEE round to nearest even, x86 SSE NaN results ----

OX_FN bool ox_nan_f(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }
OX_FN bool ox_nan_d(uint64_t u) {
  return (u & 0x7fffffffffffffffull) > 0x7ff0000000000000ull;
}

// The NaN x86 gives for `a op b` once the result `r` is a NaN.
OX_FN float ox_fix_f(float r, float a, float b) {
  uint32_t ur = ox_fbits(r);
  if (!ox_nan_f(ur)) return r;
  uint32_t ua = ox_fbits(a), ub = ox_fbits(b);
  uint32_t n = ox_nan_f(ua) ? ua : ox_nan_f(ub) ? ub : 0xffc00000u;
  return ox_bitsf(n | 0x00400000u);
}
OX_FN double ox_fix_d(double r, double a, double b) {
  uint64_t ur = ox_dbits(r);
  if (!ox_nan_d(ur)) return r;
  uint64_t ua = ox_dbits(a), ub = ox_dbits(b);
  uint64_t n = ox_nan_d(ua) ? ua : ox_nan_d(ub) ? ub : 0xfff8000000000000ull;
  return ox_bitsd(n | 0x0008000000000000ull);
}

OX_FN float ox_add(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
#else
  float r = a + b;
#endif
  return ox_fix_f(r, a, b);
}
OX_FN float ox_mul(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
#else
  float r = a * b;
#endif
  return ox_fix_f(r, a, b);
}
OX_FN float ox_div(float a, float b) {
#ifdef __CUDA_ARCH__
  float r;
  asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
#else
  float r = a / b;
#endif
  return ox_fix_f(r, a, b);
}
OX_FN double ox_add(double a, double b) {
#ifdef __CUDA_ARCH__
  double r;
  asm("add.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
#else
  double r = a + b;
#endif
  return ox_fix_d(r, a, b);
}
OX_FN double ox_mul(double a, double b) {
#ifdef __CUDA_ARCH__
  double r;
  asm("mul.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
#else
  double r = a * b;
#endif
  return ox_fix_d(r, a, b);
}
OX_FN double ox_div(double a, double b) {
#ifdef __CUDA_ARCH__
  double r;
  asm("div.rn.f64 %0, %1, %2;" : "=d"(r) : "d"(a), "d"(b));
#else
  double r = a / b;
#endif
  return ox_fix_d(r, a, b);
}

// Order keys of non-NaN floats: `key(x) < key(y)` iff x < y (+0 and -0 are equal).
OX_FN int32_t ox_key(uint32_t u) {
  int32_t m = (int32_t)(u & 0x7fffffffu);
  return (u >> 31) ? -m : m;
}
OX_FN int64_t ox_key(uint64_t u) {
  int64_t m = (int64_t)(u & 0x7fffffffffffffffull);
  return (u >> 63) ? -m : m;
}

OX_FN float ox_max(float a, float b) {
  uint32_t ua = ox_fbits(a), ub = ox_fbits(b);
  if (ox_nan_f(ua)) return b;
  return (!ox_nan_f(ub) && ox_key(ub) > ox_key(ua)) ? b : a;
}
OX_FN float ox_min(float a, float b) {
  uint32_t ua = ox_fbits(a), ub = ox_fbits(b);
  if (ox_nan_f(ua)) return b;
  return (!ox_nan_f(ub) && ox_key(ub) < ox_key(ua)) ? b : a;
}
OX_FN double ox_max(double a, double b) {
  uint64_t ua = ox_dbits(a), ub = ox_dbits(b);
  if (ox_nan_d(ua)) return b;
  return (!ox_nan_d(ub) && ox_key(ub) > ox_key(ua)) ? b : a;
}
OX_FN double ox_min(double a, double b) {
  uint64_t ua = ox_dbits(a), ub = ox_dbits(b);
  if (ox_nan_d(ua)) return b;
  return (!ox_nan_d(ub) && ox_key(ub) < ox_key(ua)) ? b : a;
}

// ---- integer arithmetic: wrapping, in the unsigned type of the same width ----

#define OX_INT_OPS(T, U)                                                         \
  OX_FN T ox_add(T a, T b) { return (T)(U)((U)a + (U)b); }                      \
  OX_FN T ox_mul(T a, T b) { return (T)(U)((uint64_t)(U)a * (uint64_t)(U)b); } \
  OX_FN T ox_max(T a, T b) { return b > a ? b : a; }                            \
  OX_FN T ox_min(T a, T b) { return b < a ? b : a; }
OX_INT_OPS(int8_t, uint8_t)
OX_INT_OPS(uint8_t, uint8_t)
OX_INT_OPS(int32_t, uint32_t)
OX_INT_OPS(uint32_t, uint32_t)
OX_INT_OPS(int64_t, uint64_t)
OX_INT_OPS(uint64_t, uint64_t)
#undef OX_INT_OPS

// Truncating division toward zero by d > 1, exact for every divisor.
OX_FN int64_t ox_idiv(int64_t x, uint64_t d) {
  if (d <= 0x7fffffffffffffffull) return x / (int64_t)d;
  // |x| <= 2^63 <= d: only -2^63 / 2^63 is not 0.
  return ((uint64_t)x == 0x8000000000000000ull && d == 0x8000000000000000ull) ? -1 : 0;
}
OX_FN uint64_t ox_udiv(uint64_t x, uint64_t d) { return x / d; }

// ---- narrow float formats (convert.rs), integer code on f32 bits ----

// E exponent bits, M mantissa bits, bias B; INF: IEEE-like infinities and NaNs, else only the
// all-ones magnitude is NaN and overflow saturates to the largest finite value.
template <int E, int M, int B, bool INF>
OX_FN uint32_t ox_narrow_to_f32(uint32_t x) {
  const uint32_t BITS = 1 + E + M;
  const uint32_t MAG_MASK = (1u << (E + M)) - 1;
  const uint32_t EXP_MASK = ((1u << E) - 1) << M;
  const uint32_t MANT_MASK = (1u << M) - 1;
  const uint32_t SH = 23 - M;
  const uint32_t REBIAS = (uint32_t)(127 - B) << 23;
  uint32_t sign = ((x >> (BITS - 1)) & 1u) << 31;
  uint32_t mag = x & MAG_MASK;
  uint32_t exp = mag & EXP_MASK;
  uint32_t mant = mag & MANT_MASK;
  uint32_t r;
  if (INF ? exp == EXP_MASK : mag == MAG_MASK) {
    r = INF ? (0x7f800000u | (mant << SH)) : 0x7fc00000u;
  } else if (exp == 0) {
    if (mant == 0) {
      r = 0;
    } else {
      // mant * 2^(1-B-M), normal in f32: leading bit p becomes the implicit one.
      int p = 31 - ox_clz32(mant);
      r = ((uint32_t)(p + 1 - B - M + 127) << 23) | ((mant << (23 - p)) & 0x7fffffu);
    }
  } else {
    r = (mag << SH) + REBIAS;
  }
  return r | sign;
}

template <int E, int M, int B, bool INF>
OX_FN uint32_t ox_narrow_from_f32(uint32_t bits) {
  const uint32_t BITS = 1 + E + M;
  const uint32_t MAG_MASK = (1u << (E + M)) - 1;
  const uint32_t EXP_MASK = ((1u << E) - 1) << M;
  const uint32_t MANT_MASK = (1u << M) - 1;
  const uint32_t SH = 23 - M;
  const uint32_t REBIAS = (uint32_t)(127 - B) << 23;
  const uint32_t TOP = INF ? EXP_MASK : MAG_MASK - 1;
  const uint32_t MIN_NORMAL = (uint32_t)(127 + 1 - B) << 23;
  uint32_t sign = (bits >> 31) << (BITS - 1);
  uint32_t a = bits & 0x7fffffffu;
  uint32_t r;
  if (a > 0x7f800000u) {
    if (INF) {
      uint32_t m = (a >> SH) & MANT_MASK;
      r = EXP_MASK | (m ? m : (1u << (M - 1)));
    } else {
      r = MAG_MASK;
    }
  } else if (a < MIN_NORMAL) {
    // Subnormal (or zero) in the format: a multiple of 2^(1-B-M), rounded to nearest even.
    uint32_t e = a >> 23;
    uint32_t m = a & 0x7fffffu;
    if (e) m |= 0x800000u;
    else e = 1;
    uint32_t s = (uint32_t)(151 - B - M) - e;  // >= 24 - M >= 1
    if (s > 25) {
      r = 0;  // below half the smallest step
    } else {
      uint32_t q = m >> s;
      uint32_t rem = m & ((1u << s) - 1);
      uint32_t half = 1u << (s - 1);
      r = q + ((rem > half || (rem == half && (q & 1))) ? 1u : 0u);
    }
  } else {
    uint32_t reb = a - REBIAS;
    uint32_t odd = (reb >> SH) & 1;
    uint32_t rounded = (reb + (1u << (SH - 1)) - 1 + odd) >> SH;
    r = rounded > TOP ? TOP : rounded;
  }
  return r | sign;
}

OX_FN float ox_f16_to_f32(uint16_t h) { return ox_bitsf(ox_narrow_to_f32<5, 10, 15, true>(h)); }
OX_FN uint16_t ox_f32_to_f16(float f) {
  return (uint16_t)ox_narrow_from_f32<5, 10, 15, true>(ox_fbits(f));
}
OX_FN float ox_e4m3_to_f32(uint8_t x) { return ox_bitsf(ox_narrow_to_f32<4, 3, 7, false>(x)); }
OX_FN uint8_t ox_f32_to_e4m3(float f) {
  return (uint8_t)ox_narrow_from_f32<4, 3, 7, false>(ox_fbits(f));
}
OX_FN float ox_e5m2_to_f32(uint8_t x) { return ox_bitsf(ox_narrow_to_f32<5, 2, 15, true>(x)); }
OX_FN uint8_t ox_f32_to_e5m2(float f) {
  return (uint8_t)ox_narrow_from_f32<5, 2, 15, true>(ox_fbits(f));
}
OX_FN float ox_bf16_to_f32(uint16_t h) { return ox_bitsf((uint32_t)h << 16); }
OX_FN uint16_t ox_f32_to_bf16(float f) {
  uint32_t b = ox_fbits(f);
  if ((b & 0x7fffffffu) > 0x7f800000u) {
    uint32_t h = b >> 16;
    return (uint16_t)((h & 0x7f) == 0 ? (h | 0x40) : h);
  }
  return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1)) >> 16);
}

// ---- datatypes: storage S, compute type C, conversions, the scalar, postdiv ----

template <int DT>
struct OxDt;

#define OX_INT_DT(CODE, T, DIV)                                                \
  template <>                                                                  \
  struct OxDt<CODE> {                                                          \
    typedef T S;                                                               \
    typedef T C;                                                               \
    static OX_FN C load(S s) { return s; }                                     \
    static OX_FN S store(C c) { return c; }                                    \
    static OX_FN C scalar(uint64_t bits) { return (T)bits; }                   \
    static OX_FN S div(S x, uint64_t d) { return (T)DIV; }                     \
  };
OX_INT_DT(0, int8_t, ox_idiv(x, d))
OX_INT_DT(1, uint8_t, ox_udiv(x, d))
OX_INT_DT(2, int32_t, ox_idiv(x, d))
OX_INT_DT(3, uint32_t, ox_udiv(x, d))
OX_INT_DT(4, int64_t, ox_idiv(x, d))
OX_INT_DT(5, uint64_t, ox_udiv(x, d))
#undef OX_INT_DT

template <>
struct OxDt<7> {
  typedef float S;
  typedef float C;
  static OX_FN C load(S s) { return s; }
  static OX_FN S store(C c) { return c; }
  static OX_FN C scalar(uint64_t bits) { return ox_bitsf((uint32_t)bits); }
  static OX_FN S div(S x, uint64_t d) { return ox_div(x, (float)d); }
};
template <>
struct OxDt<8> {
  typedef double S;
  typedef double C;
  static OX_FN C load(S s) { return s; }
  static OX_FN S store(C c) { return c; }
  static OX_FN C scalar(uint64_t bits) { return ox_bitsd(bits); }
  static OX_FN S div(S x, uint64_t d) { return ox_div(x, (double)d); }
};

#define OX_NARROW_DT(CODE, T, TO, FROM)                                        \
  template <>                                                                  \
  struct OxDt<CODE> {                                                          \
    typedef T S;                                                               \
    typedef float C;                                                           \
    static OX_FN C load(S s) { return TO(s); }                                 \
    static OX_FN S store(C c) { return FROM(c); }                              \
    static OX_FN C scalar(uint64_t bits) { return TO((T)bits); }               \
    static OX_FN S div(S x, uint64_t d) { return FROM(ox_div(TO(x), (float)d)); } \
  };
OX_NARROW_DT(6, uint16_t, ox_f16_to_f32, ox_f32_to_f16)
OX_NARROW_DT(9, uint16_t, ox_bf16_to_f32, ox_f32_to_bf16)
OX_NARROW_DT(10, uint8_t, ox_e4m3_to_f32, ox_f32_to_e4m3)
OX_NARROW_DT(11, uint8_t, ox_e5m2_to_f32, ox_f32_to_e5m2)
#undef OX_NARROW_DT

// ---- the interface of the kernels ----

// `x * premul`, rounded to the type (x itself without a premul).
template <int DT>
OX_FN typename OxDt<DT>::S ox_prep(typename OxDt<DT>::S x, const OxRed& r) {
  typedef OxDt<DT> T;
  if (!r.has_premul) return x;
  return T::store(ox_mul(T::load(x), T::scalar(r.premul_bits)));
}

// `op(prep(src), in)`: src the local element, in the accumulated (received) one.
template <int DT>
OX_FN typename OxDt<DT>::S ox_combine(typename OxDt<DT>::S src, typename OxDt<DT>::S in,
                                      const OxRed& r) {
  typedef OxDt<DT> T;
  typename T::C a = T::load(ox_prep<DT>(src, r));
  typename T::C b = T::load(in);
  typename T::C c;
  switch (r.kind) {
    case 0: c = ox_add(a, b); break;
    case 1: c = ox_mul(a, b); break;
    case 2: c = ox_max(a, b); break;
    default: c = ox_min(a, b); break;
  }
  return T::store(c);
}

// `x / postdiv` (x itself for a divisor of 0 or 1).
template <int DT>
OX_FN typename OxDt<DT>::S ox_finish(typename OxDt<DT>::S x, const OxRed& r) {
  if (r.postdiv <= 1) return x;
  return OxDt<DT>::div(x, r.postdiv);
}

#undef OX_FN
