// Runs the direct all-reduce's element loop (cuda/direct.cuh) on the host for tests/cuda_arith.rs:
// each "thread" of a grid of `nt` in turn (each element belongs to one thread, so the order
// does not matter). Reads records from stdin until EOF, answers each on stdout (little-endian):
//   record: u32 dtype, u32 kind, u32 n, u32 nt, u64 count, u32 misalign (elements the last
//   rank's buffers are shifted by), u32 in_place, u64 postdiv, then per rank u64 has_premul and
//   u64 premul bits, then the n inputs (count elements each, in the dtype).
//   answer: the n outputs, then u32 1 when every byte around each output (64 on each side) is
//   untouched and, out of place, every input is unchanged; else 0.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>

#include "reduce.cuh"
#include "direct.cuh"
#include "io.h"

template <class T>
static T get() {
  T v;
  memcpy(&v, take(sizeof(T)), sizeof(T));
  return v;
}

static const size_t PAD = 64;
static const unsigned char GUARD = 0xa5;

// One rank's buffer: PAD guard bytes, the elements, PAD guard bytes, 16-byte aligned at the
// elements plus `shift` bytes.
struct Buf {
  std::vector<unsigned char> mem;
  unsigned char* at;
  size_t bytes;
  Buf(size_t b, size_t shift) : mem(b + 2 * PAD + 32, GUARD), bytes(b) {
    uintptr_t base = ((uintptr_t)mem.data() + PAD + 15) & ~(uintptr_t)15;
    at = (unsigned char*)base + shift;
  }
  bool guards_intact() const {
    for (const unsigned char* p = mem.data(); p < at; p++)
      if (*p != GUARD) return false;
    for (const unsigned char* p = at + bytes; p < mem.data() + mem.size(); p++)
      if (*p != GUARD) return false;
    return true;
  }
};

template <int DT>
static void run(const OxRed* red, int n, uint64_t count, size_t nt, size_t mis, bool in_place) {
  typedef typename OxDt<DT>::S S;
  const size_t bytes = count * sizeof(S);
  std::vector<Buf> src, dst;
  const uint8_t* sp[OX_DIRECT_MAX];
  uint8_t* dp[OX_DIRECT_MAX];
  std::vector<std::vector<unsigned char>> inputs;
  for (int k = 0; k < n; k++) {
    size_t shift = k == n - 1 ? mis * sizeof(S) : 0;
    src.emplace_back(bytes, shift);
    dst.emplace_back(bytes, shift);
  }
  for (int k = 0; k < n; k++) {
    const unsigned char* x = take(bytes);
    inputs.emplace_back(x, x + bytes);
    memcpy(src[k].at, x, bytes);
    sp[k] = src[k].at;
    dp[k] = in_place ? src[k].at : dst[k].at;
  }
  for (size_t t = 0; t < nt; t++) {
    if (n <= 4)
      direct_typed<DT, 4, 2>(sp, dp, red, n, n, count, t, nt);
    else
      direct_typed<DT, OX_DIRECT_MAX, 1>(sp, dp, red, n, n, count, t, nt);
  }
  uint32_t ok = 1;
  for (int k = 0; k < n; k++) {
    out_buf.insert(out_buf.end(), dp[k], dp[k] + bytes);
    const Buf& out = in_place ? src[k] : dst[k];
    if (!out.guards_intact()) ok = 0;
    if (!in_place && (!src[k].guards_intact() || memcmp(src[k].at, inputs[k].data(), bytes)))
      ok = 0;
  }
  unsigned char b[4];
  memcpy(b, &ok, 4);
  out_buf.insert(out_buf.end(), b, b + 4);
}

int main() {
  read_input();
  while (more_input()) {
    const uint32_t dtype = get<uint32_t>(), kind = get<uint32_t>(), n = get<uint32_t>(),
                   nt = get<uint32_t>();
    const uint64_t count = get<uint64_t>();
    const uint32_t mis = get<uint32_t>(), in_place = get<uint32_t>();
    const uint64_t postdiv = get<uint64_t>();
    if (n < 1 || n > OX_DIRECT_MAX || nt < 1) {
      fprintf(stderr, "direct: bad record (n %u, nt %u)\n", n, nt);
      return 2;
    }
    OxRed red[OX_DIRECT_MAX];
    for (uint32_t k = 0; k < n; k++) {
      red[k].dtype = dtype;
      red[k].kind = kind;
      red[k].has_premul = (uint32_t)get<uint64_t>();
      red[k].pad = 0;
      red[k].premul_bits = get<uint64_t>();
      red[k].postdiv = postdiv;
    }
    switch (dtype) {
#define CASE(d) \
  case d: run<d>(red, (int)n, count, nt, mis, in_place != 0); break;
      CASE(0) CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10)
      CASE(11)
#undef CASE
      default:
        fprintf(stderr, "direct: dtype %u\n", dtype);
        return 2;
    }
  }
  return write_output();
}
