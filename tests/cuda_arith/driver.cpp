// Runs cuda/reduce.cuh on the host for tests/cuda_arith.rs. Reads records from stdin until EOF,
// answers each on stdout (all little-endian):
//   mode 0 (arithmetic): header = OxRed with `pad` = 0, then u64 n; a[n], b[n] in the dtype.
//     Answer: finish(combine(a[i], b[i])) for all i, then prep(a[i]), then finish(a[i]).
//   mode 1 (narrowing): header = OxRed with `pad` = 1 (only dtype used), u64 n; n f32 bit
//     patterns. Answer: n values in the dtype (6, 9, 10 or 11).
//   mode 2 (widening): as mode 1 with `pad` = 2; n values in the dtype. Answer: n f32 patterns.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "reduce.cuh"
#include "io.h"

template <class T>
static T get(const unsigned char* p, size_t i) {
  T v;
  memcpy(&v, p + i * sizeof(T), sizeof(T));
  return v;
}

template <class T>
static void put(T v) {
  unsigned char b[sizeof(T)];
  memcpy(b, &v, sizeof(T));
  out_buf.insert(out_buf.end(), b, b + sizeof(T));
}

template <int DT>
static void arith(const OxRed& r, size_t n) {
  typedef typename OxDt<DT>::S S;
  const unsigned char* a = take(n * sizeof(S));
  const unsigned char* b = take(n * sizeof(S));
  for (size_t i = 0; i < n; i++)
    put<S>(ox_finish<DT>(ox_combine<DT>(get<S>(a, i), get<S>(b, i), r), r));
  for (size_t i = 0; i < n; i++) put<S>(ox_prep<DT>(get<S>(a, i), r));
  for (size_t i = 0; i < n; i++) put<S>(ox_finish<DT>(get<S>(a, i), r));
}

template <int DT>
static void convert(int mode, size_t n) {
  typedef typename OxDt<DT>::S S;
  if (mode == 1) {
    const unsigned char* x = take(n * 4);
    for (size_t i = 0; i < n; i++) put<S>(OxDt<DT>::store(ox_bitsf(get<uint32_t>(x, i))));
  } else {
    const unsigned char* x = take(n * sizeof(S));
    for (size_t i = 0; i < n; i++) put<uint32_t>(ox_fbits(OxDt<DT>::load(get<S>(x, i))));
  }
}

int main() {
  read_input();
  while (more_input()) {
    OxRed r;
    memcpy(&r, take(sizeof r), sizeof r);
    uint64_t n = get<uint64_t>(take(8), 0);
    if (r.pad == 0) {
      switch (r.dtype) {
#define OX_CASE(d) \
  case d: arith<d>(r, n); break;
        OX_CASE(0) OX_CASE(1) OX_CASE(2) OX_CASE(3) OX_CASE(4) OX_CASE(5)
        OX_CASE(6) OX_CASE(7) OX_CASE(8) OX_CASE(9) OX_CASE(10) OX_CASE(11)
#undef OX_CASE
        default: fprintf(stderr, "driver: dtype %u\n", r.dtype); return 2;
      }
    } else {
      switch (r.dtype) {
        case 6: convert<6>((int)r.pad, n); break;
        case 9: convert<9>((int)r.pad, n); break;
        case 10: convert<10>((int)r.pad, n); break;
        case 11: convert<11>((int)r.pad, n); break;
        default: fprintf(stderr, "driver: conversion of dtype %u\n", r.dtype); return 2;
      }
    }
  }
  return write_output();
}
