// The drivers' records: all of stdin read at once (`read_input`), taken in order (`take`),
// answers gathered in `out_buf` and written at the end (`write_output`).
#pragma once
#include <stdio.h>
#include <stdlib.h>
#include <vector>

static std::vector<unsigned char> in_buf;
static size_t in_pos = 0;
static std::vector<unsigned char> out_buf;

static void read_input() {
  unsigned char chunk[65536];
  size_t got;
  while ((got = fread(chunk, 1, sizeof chunk, stdin)) > 0) in_buf.insert(in_buf.end(), chunk, chunk + got);
}

static bool more_input() { return in_pos < in_buf.size(); }

static const unsigned char* take(size_t n) {
  if (in_pos + n > in_buf.size()) {
    fprintf(stderr, "cuda_arith driver: truncated input\n");
    exit(2);
  }
  const unsigned char* p = in_buf.data() + in_pos;
  in_pos += n;
  return p;
}

// 0 when every answer was written.
static int write_output() {
  return fwrite(out_buf.data(), 1, out_buf.size(), stdout) == out_buf.size() ? 0 : 3;
}
