/* One process per rank (fork). The unique id is made by the parent before fork ("parent"), or by
 * rank 0's process and passed to the others through pipes ("pipe"). The parent waits for every
 * child and fails if any fails, dies, or is still running when the alarm fires.
 * usage: ex_processes NRANKS [parent|pipe] [TIMEOUT_S]   (defaults: 4 parent 100) */
#include "common.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define COUNT 10007
#define MAXR 64

static pid_t kids[MAXR];
static int nkids;

static void on_alarm(int sig) {
  (void)sig;
  static const char msg[] = "FAIL ex_processes: timeout, killing the ranks\n";
  ssize_t w = write(2, msg, sizeof msg - 1);
  (void)w;
  for (int i = 0; i < nkids; i++)
    if (kids[i] > 0) kill(kids[i], SIGKILL);
  _exit(1);
}

static int run_rank(int rank, int nranks, ncclUniqueId id) {
  ncclComm_t comm;
  NCCLCHECK(ncclCommInitRank(&comm, nranks, id, rank));
  long bad = 0;
  int32_t* s = (int32_t*)malloc(COUNT * sizeof(int32_t));
  int32_t* r = (int32_t*)malloc((size_t)nranks * COUNT * sizeof(int32_t));
  SYSCHECK(s && r, "malloc");

  for (size_t k = 0; k < COUNT; k++) s[k] = (int32_t)(rank + 1) * (int32_t)(k % 1000);
  NCCLCHECK(ncclAllReduce(s, r, COUNT, ncclInt32, ncclSum, comm, NULL));
  for (size_t k = 0; k < COUNT; k++) {
    int32_t want = (int32_t)(nranks * (nranks + 1) / 2) * (int32_t)(k % 1000);
    if (r[k] != want && bad++ < 5)
      fprintf(stderr, "FAIL rank %d allreduce element %zu: got %d expected %d\n", rank, k, r[k], want);
  }

  for (size_t k = 0; k < COUNT; k++) s[k] = rank * 1000000 + (int32_t)k;
  NCCLCHECK(ncclAllGather(s, r, COUNT, ncclInt32, comm, NULL));
  for (size_t p = 0; p < (size_t)nranks; p++)
    for (size_t k = 0; k < COUNT; k++) {
      int32_t want = (int32_t)p * 1000000 + (int32_t)k;
      if (r[p * COUNT + k] != want && bad++ < 5)
        fprintf(stderr, "FAIL rank %d allgather element %zu: got %d expected %d\n", rank,
                p * COUNT + k, r[p * COUNT + k], want);
    }

  int root = nranks / 2;
  for (size_t k = 0; k < COUNT; k++) s[k] = rank == root ? (int32_t)k * 3 : -1;
  NCCLCHECK(ncclBcast(s, COUNT, ncclInt32, root, comm, NULL));
  for (size_t k = 0; k < COUNT; k++)
    if (s[k] != (int32_t)k * 3 && bad++ < 5)
      fprintf(stderr, "FAIL rank %d bcast element %zu: got %d expected %d\n", rank, k, s[k], (int)k * 3);

  NCCLCHECK(ncclCommDestroy(comm));
  free(s);
  free(r);
  return bad ? 1 : 0;
}

int main(int argc, char** argv) {
  int nranks = argc > 1 ? atoi(argv[1]) : 4;
  int use_pipe = argc > 2 && !strcmp(argv[2], "pipe");
  int timeout = argc > 3 ? atoi(argv[3]) : 100;
  if (nranks < 1 || nranks > MAXR) return 2;
  fflush(NULL);

  ncclUniqueId id;
  memset(&id, 0, sizeof id);
  int pipes[MAXR][2];
  if (!use_pipe) {
    NCCLCHECK(ncclGetUniqueId(&id));
  } else {
    for (int i = 1; i < nranks; i++) SYSCHECK(pipe(pipes[i]) == 0, "pipe");
  }

  for (int i = 0; i < nranks; i++) {
    pid_t pid = fork();
    SYSCHECK(pid >= 0, "fork");
    if (pid == 0) {
      if (use_pipe) {
        if (i == 0) {
          NCCLCHECK(ncclGetUniqueId(&id));
          for (int j = 1; j < nranks; j++) {
            SYSCHECK(write(pipes[j][1], &id, sizeof id) == (ssize_t)sizeof id, "write id");
            close(pipes[j][1]);
          }
        } else {
          size_t got = 0;
          while (got < sizeof id) {
            ssize_t k = read(pipes[i][0], (char*)&id + got, sizeof id - got);
            SYSCHECK(k > 0, "read id");
            got += (size_t)k;
          }
        }
      }
      int rc = run_rank(i, nranks, id);
      fflush(NULL);
      exit(rc);
    }
    kids[nkids++] = pid;
  }
  if (use_pipe)
    for (int i = 1; i < nranks; i++) {
      close(pipes[i][0]);
      close(pipes[i][1]);
    }

  signal(SIGALRM, on_alarm);
  alarm((unsigned)timeout);
  int bad = 0;
  for (int i = 0; i < nranks; i++) {
    int st = 0;
    SYSCHECK(waitpid(kids[i], &st, 0) == kids[i], "waitpid");
    kids[i] = -1;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "FAIL rank %d: %s %d\n", i, WIFEXITED(st) ? "exit status" : "killed by signal",
              WIFEXITED(st) ? WEXITSTATUS(st) : WTERMSIG(st));
      bad++;
    }
  }
  alarm(0);
  if (bad) return 1;
  printf("ex_processes: %d ranks (%s) OK\n", nranks, use_pipe ? "id through a pipe" : "id before fork");
  return 0;
}
