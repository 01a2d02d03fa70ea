/* memcpy_probe: single-thread memcpy bandwidth at sizes minBytes..maxBytes (factor f), the
 * machine's copy ceiling next to the collective numbers. For each size the copy count is
 * calibrated to run for at least ~minMs milliseconds, then the best of `trials` timed runs is
 * reported as GB/s = bytes copied / second (1 GB = 1e9 B). Small sizes stay in cache; the large
 * ones measure memory. Output, one line per size:  size  time_us  GB/s
 *   memcpy_probe -b 8 -e 256M -f 2 [-m 20] [-t 3]
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double nowSec(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double parseSize(const char* s) {
  char* end;
  double v = strtod(s, &end);
  switch (*end) {
  case 'K': case 'k': v *= 1024; break;
  case 'M': case 'm': v *= 1024 * 1024; break;
  case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
  case '\0': break;
  default: return -1;
  }
  return v;
}

/* called through a volatile pointer so that the compiler cannot drop or merge the copies */
static void* (*volatile copyFn)(void*, const void*, size_t) = memcpy;

static double timeCopies(char* dst, const char* src, size_t bytes, long reps) {
  double t0 = nowSec();
  for (long r = 0; r < reps; r++) copyFn(dst, src, bytes);
  return nowSec() - t0;
}

int main(int argc, char** argv) {
  size_t minBytes = 8, maxBytes = 256u << 20, factor = 2;
  double minMs = 20;
  int trials = 3, c;
  while ((c = getopt(argc, argv, "b:e:f:m:t:h")) != -1) {
    switch (c) {
    case 'b': minBytes = (size_t)parseSize(optarg); break;
    case 'e': maxBytes = (size_t)parseSize(optarg); break;
    case 'f': factor = (size_t)strtoul(optarg, NULL, 0); break;
    case 'm': minMs = atof(optarg); break;
    case 't': trials = atoi(optarg); break;
    default:
      fprintf(stderr, "usage: %s [-b minbytes] [-e maxbytes] [-f factor] [-m min_ms] [-t trials]\n", argv[0]);
      return c == 'h' ? 0 : 2;
    }
  }
  if (factor < 2 || minBytes < 1 || maxBytes < minBytes || trials < 1 || minMs <= 0) {
    fprintf(stderr, "memcpy_probe: bad arguments\n");
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  char* src = aligned_alloc(4096, (maxBytes + 4095) / 4096 * 4096);
  char* dst = aligned_alloc(4096, (maxBytes + 4095) / 4096 * 4096);
  if (!src || !dst) {
    fprintf(stderr, "memcpy_probe: out of memory\n");
    return 1;
  }
  for (size_t i = 0; i < maxBytes; i++) src[i] = (char)(i * 7 + 1);
  memset(dst, 0, maxBytes);

  printf("# memcpy_probe: 1 thread, best of %d runs of >= %.0f ms each\n", trials, minMs);
  printf("#       size     time(us)      GB/s\n");
  int bad = 0;
  for (size_t bytes = minBytes; bytes <= maxBytes; bytes *= factor) {
    long reps = 1;
    double t = timeCopies(dst, src, bytes, reps);
    while (t * 1e3 < minMs && reps < (1L << 40)) {
      reps = t > 0 ? (long)((double)reps * (minMs / 1e3) / t * 1.2) + 1 : reps * 10;
      t = timeCopies(dst, src, bytes, reps);
    }
    double best = t;
    for (int k = 1; k < trials; k++) {
      double tk = timeCopies(dst, src, bytes, reps);
      if (tk < best) best = tk;
    }
    /* the copies really happened: the destination matches the source */
    if (memcmp(dst, src, bytes) != 0) bad = 1;
    double per = best / (double)reps;
    printf("%12zu  %11.3f  %8.2f\n", bytes, per * 1e6, (double)bytes / per / 1e9);
    if (bytes > maxBytes / factor) break;
  }
  free(src);
  free(dst);
  if (bad) fprintf(stderr, "memcpy_probe: destination differs from source\n");
  return bad;
}
