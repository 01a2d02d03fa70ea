/* NCCL's first documented example ("single process, single thread, multiple devices") on host
 * buffers: ncclCommInitAll, then one ncclAllReduce per communicator inside a group.
 * usage: ex_single_process [NRANKS]   (default 4) */
#include "common.h"

int main(int argc, char** argv) {
  int n = argc > 1 ? atoi(argv[1]) : 4;
  if (n < 1 || n > 64) return 2;
  const size_t size = 32 * 1024;
  ncclComm_t* comms = (ncclComm_t*)calloc((size_t)n, sizeof(ncclComm_t));
  int* devs = (int*)calloc((size_t)n, sizeof(int));
  float** sendbuff = (float**)calloc((size_t)n, sizeof(float*));
  float** recvbuff = (float**)calloc((size_t)n, sizeof(float*));
  SYSCHECK(comms && devs && sendbuff && recvbuff, "calloc");
  for (int i = 0; i < n; i++) {
    devs[i] = i;
    sendbuff[i] = (float*)malloc(size * sizeof(float));
    recvbuff[i] = (float*)malloc(size * sizeof(float));
    SYSCHECK(sendbuff[i] && recvbuff[i], "malloc");
    for (size_t k = 0; k < size; k++) {
      sendbuff[i][k] = (float)example_value(i, k);
      recvbuff[i][k] = -1.0f;
    }
  }

  NCCLCHECK(ncclCommInitAll(comms, n, devs));

  NCCLCHECK(ncclGroupStart());
  for (int i = 0; i < n; ++i)
    NCCLCHECK(ncclAllReduce((const void*)sendbuff[i], (void*)recvbuff[i], size, ncclFloat, ncclSum,
                            comms[i], NULL));
  NCCLCHECK(ncclGroupEnd());

  long bad = 0;
  for (int i = 0; i < n; i++) {
    for (size_t k = 0; k < size; k++) {
      double want = 0;
      for (int p = 0; p < n; p++) want += example_value(p, k);
      if (recvbuff[i][k] != (float)want || sendbuff[i][k] != (float)example_value(i, k)) {
        if (bad++ < 5)
          fprintf(stderr, "FAIL rank %d element %zu: got %g expected %g (send now %g)\n", i, k,
                  recvbuff[i][k], want, sendbuff[i][k]);
      }
    }
  }

  for (int i = 0; i < n; ++i) NCCLCHECK(ncclCommDestroy(comms[i]));
  for (int i = 0; i < n; i++) {
    free(sendbuff[i]);
    free(recvbuff[i]);
  }
  free(comms); free(devs); free(sendbuff); free(recvbuff);
  if (bad) {
    fprintf(stderr, "ex_single_process: %ld wrong elements\n", bad);
    return 1;
  }
  printf("ex_single_process: %d ranks OK\n", n);
  return 0;
}
