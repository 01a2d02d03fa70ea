/* mpi_allreduce: the MPI baseline for all_reduce_perf. MPI_Allreduce(float, MPI_SUM) over
 * MPI_COMM_WORLD at sizes minBytes..maxBytes (factor f), timed the way all_reduce_perf times
 * (one untimed checked call, barrier, `iters` back-to-back calls, time per op averaged over the
 * ranks), printed in all_reduce_perf's column layout (out-of-place only):
 *   size count type redop root time(us) algbw busbw #wrong
 * busbw = algbw * 2(n-1)/n, algbw = bytes / time. Results are checked element by element
 * against an exactly representable reference; any wrong element makes the exit status 1.
 *   mpirun -np 2 mpi_allreduce -b 8 -e 256M -f 2 -n 20 -w 5
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

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

/* rank r contributes (r+1) * (i % 97); the sum over n ranks is (i % 97) * n(n+1)/2, exact in float */
static void fill(float* buf, size_t count, int rank) {
  for (size_t i = 0; i < count; i++) buf[i] = (float)((rank + 1) * (int)(i % 97));
}

static long long check(const float* buf, size_t count, int nranks) {
  long long wrong = 0;
  float tri = (float)(nranks * (nranks + 1) / 2);
  for (size_t i = 0; i < count; i++)
    if (buf[i] != (float)(i % 97) * tri) wrong++;
  return wrong;
}

int main(int argc, char** argv) {
  size_t minBytes = 8, maxBytes = 32u << 20, factor = 2;
  int iters = 20, warmup = 5;
  int c;
  while ((c = getopt(argc, argv, "b:e:f:n:w:h")) != -1) {
    switch (c) {
    case 'b': minBytes = (size_t)parseSize(optarg); break;
    case 'e': maxBytes = (size_t)parseSize(optarg); break;
    case 'f': factor = (size_t)strtoul(optarg, NULL, 0); break;
    case 'n': iters = atoi(optarg); break;
    case 'w': warmup = atoi(optarg); break;
    default:
      fprintf(stderr, "usage: %s [-b minbytes] [-e maxbytes] [-f factor] [-n iters] [-w warmup]\n", argv[0]);
      return c == 'h' ? 0 : 2;
    }
  }
  if (factor < 2 || minBytes < 4 || maxBytes < minBytes || iters < 1) {
    fprintf(stderr, "mpi_allreduce: bad arguments\n");
    return 2;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  MPI_Init(&argc, &argv);
  int rank, nranks;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &nranks);

  size_t maxCount = maxBytes / sizeof(float);
  float* send = malloc(maxCount * sizeof(float));
  float* recv = malloc(maxCount * sizeof(float));
  if (!send || !recv) {
    fprintf(stderr, "mpi_allreduce: out of memory\n");
    MPI_Abort(MPI_COMM_WORLD, 1);
  }
  fill(send, maxCount, rank);
  memset(recv, 0, maxCount * sizeof(float));

  if (rank == 0) {
    int len;
    char ver[MPI_MAX_LIBRARY_VERSION_STRING];
    MPI_Get_library_version(ver, &len);
    char* nl = strchr(ver, '\n');
    if (nl) *nl = '\0';
    printf("# mpi_allreduce: %d ranks, %s\n", nranks, ver);
    printf("# minBytes %zu maxBytes %zu factor %zu warmup iters: %d iters: %d\n", minBytes, maxBytes, factor,
           warmup, iters);
    printf("#       size         count      type   redop    root     time   algbw   busbw #wrong\n");
    printf("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)       \n");
  }
  /* warm-up at the largest and the smallest size, as all_reduce_perf does */
  for (int w = 0; w < warmup; w++) {
    MPI_Allreduce(send, recv, (int)maxCount, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(send, recv, (int)(minBytes / sizeof(float)), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  }

  long long wrongTotal = 0;
  for (size_t bytes = minBytes; bytes <= maxBytes; bytes *= factor) {
    size_t count = bytes / sizeof(float);
    memset(recv, 0, count * sizeof(float));
    MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    long long wrong = check(recv, count, nranks);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int it = 0; it < iters; it++) MPI_Allreduce(send, recv, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double sec = (MPI_Wtime() - t0) / iters, sum = 0;
    MPI_Allreduce(&sec, &sum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    sec = sum / nranks;
    wrong += check(recv, count, nranks); /* the timed calls' result too */
    long long wrongAll = 0;
    MPI_Allreduce(&wrong, &wrongAll, 1, MPI_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
    wrongTotal += wrongAll;
    double algBw = (double)(count * sizeof(float)) / 1.0e9 / sec;
    double busBw = algBw * 2.0 * (nranks - 1) / nranks;
    if (rank == 0) {
      double us = sec * 1e6;
      printf("%12zu  %12zu  %8s  %6s  %6d  ", count * sizeof(float), count, "float", "sum", -1);
      if (us >= 10000.0) printf("%7.0f", us);
      else if (us >= 100.0) printf("%7.1f", us);
      else printf("%7.2f", us);
      printf("  %6.2f  %6.2f  %5lld\n", algBw, busBw, wrongAll);
    }
    if (bytes > maxBytes / factor) break;
  }
  if (rank == 0) printf("# Out of bounds values : %lld %s\n", wrongTotal, wrongTotal ? "FAILED" : "OK");
  free(send);
  free(recv);
  MPI_Finalize();
  return wrongTotal ? 1 : 0;
}
