/* One thread per rank: the unique id comes from main, every thread calls ncclCommInitRank and runs
 * a few collectives on NULL streams (each call returns when its work is done).
 * usage: ex_threads [NRANKS]   (default 4) */
#include "common.h"

#include <pthread.h>

#define COUNT 4099

static int nranks;
static ncclUniqueId id;
static long failures[64];

static long check(int rank, const char* what, size_t j, double got, double want) {
  if (got == want) return 0;
  if (failures[rank] < 5)
    fprintf(stderr, "FAIL rank %d %s element %zu: got %.17g expected %.17g\n", rank, what, j, got, want);
  return 1;
}

static void* rank_main(void* arg) {
  int rank = (int)(intptr_t)arg;
  ncclComm_t comm;
  NCCLCHECK(ncclCommInitRank(&comm, nranks, id, rank));
  int cnt = -1, r = -1;
  NCCLCHECK(ncclCommCount(comm, &cnt));
  NCCLCHECK(ncclCommUserRank(comm, &r));
  if (cnt != nranks || r != rank) {
    fprintf(stderr, "FAIL rank %d: ncclCommCount %d ncclCommUserRank %d\n", rank, cnt, r);
    failures[rank]++;
  }
  size_t n = (size_t)nranks;
  float* fs = (float*)malloc(COUNT * sizeof(float));
  float* fr = (float*)malloc(COUNT * sizeof(float));
  int32_t* is = (int32_t*)malloc(n * COUNT * sizeof(int32_t));
  int32_t* ir = (int32_t*)malloc(n * COUNT * sizeof(int32_t));
  int64_t* ls = (int64_t*)malloc(COUNT * sizeof(int64_t));
  int64_t* lr = (int64_t*)malloc(n * COUNT * sizeof(int64_t));
  SYSCHECK(fs && fr && is && ir && ls && lr, "malloc");

  /* 1. AllReduce sum, float. */
  for (size_t k = 0; k < COUNT; k++) fs[k] = (float)example_value(rank, k);
  NCCLCHECK(ncclAllReduce(fs, fr, COUNT, ncclFloat32, ncclSum, comm, NULL));
  for (size_t k = 0; k < COUNT; k++) {
    double want = 0;
    for (int p = 0; p < nranks; p++) want += example_value(p, k);
    failures[rank] += check(rank, "allreduce", k, fr[k], want);
  }

  /* 2. Broadcast int32 from the last rank, in place. */
  for (size_t k = 0; k < COUNT; k++) is[k] = rank * 100000 + (int32_t)k;
  NCCLCHECK(ncclBroadcast(is, is, COUNT, ncclInt32, nranks - 1, comm, NULL));
  for (size_t k = 0; k < COUNT; k++)
    failures[rank] += check(rank, "broadcast", k, is[k], (nranks - 1) * 100000.0 + (double)k);

  /* 3. AllGather int64. */
  for (size_t k = 0; k < COUNT; k++) ls[k] = (int64_t)rank << 40 | (int64_t)k;
  NCCLCHECK(ncclAllGather(ls, lr, COUNT, ncclInt64, comm, NULL));
  for (size_t p = 0; p < n; p++)
    for (size_t k = 0; k < COUNT; k++)
      failures[rank] += check(rank, "allgather", p * COUNT + k, (double)lr[p * COUNT + k],
                              (double)((int64_t)p << 40 | (int64_t)k));

  /* 4. ReduceScatter max, int32. */
  for (size_t k = 0; k < n * COUNT; k++) is[k] = (int32_t)((k * 7 + (size_t)rank * 13) % 1000) - 500;
  NCCLCHECK(ncclReduceScatter(is, ir, COUNT, ncclInt32, ncclMax, comm, NULL));
  for (size_t k = 0; k < COUNT; k++) {
    size_t j = (size_t)rank * COUNT + k;
    int32_t want = INT32_MIN;
    for (size_t p = 0; p < n; p++) {
      int32_t v = (int32_t)((j * 7 + p * 13) % 1000) - 500;
      if (v > want) want = v;
    }
    failures[rank] += check(rank, "reducescatter", k, ir[k], want);
  }

  /* 5. Send/Recv ring in a group. */
  for (size_t k = 0; k < COUNT; k++) fs[k] = (float)(rank * 10 + (int)(k % 10));
  NCCLCHECK(ncclGroupStart());
  NCCLCHECK(ncclSend(fs, COUNT, ncclFloat32, (rank + 1) % nranks, comm, NULL));
  NCCLCHECK(ncclRecv(fr, COUNT, ncclFloat32, (rank + nranks - 1) % nranks, comm, NULL));
  NCCLCHECK(ncclGroupEnd());
  for (size_t k = 0; k < COUNT; k++)
    failures[rank] += check(rank, "sendrecv", k, fr[k], ((rank + nranks - 1) % nranks) * 10.0 + (double)(k % 10));

  NCCLCHECK(ncclCommDestroy(comm));
  free(fs); free(fr); free(is); free(ir); free(ls); free(lr);
  return NULL;
}

int main(int argc, char** argv) {
  nranks = argc > 1 ? atoi(argv[1]) : 4;
  if (nranks < 1 || nranks > 64) return 2;
  NCCLCHECK(ncclGetUniqueId(&id));
  pthread_t th[64];
  for (int r = 0; r < nranks; r++)
    SYSCHECK(pthread_create(&th[r], NULL, rank_main, (void*)(intptr_t)r) == 0, "pthread_create");
  long bad = 0;
  for (int r = 0; r < nranks; r++) {
    pthread_join(th[r], NULL);
    bad += failures[r];
  }
  if (bad) {
    fprintf(stderr, "ex_threads: %ld wrong results\n", bad);
    return 1;
  }
  printf("ex_threads: %d ranks OK\n", nranks);
  return 0;
}
