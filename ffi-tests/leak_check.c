/* After ncclCommDestroy no resources stay behind:
 *   - processes (fork, one rank each, the id passed through a pipe so the parent never loads any
 *     library state): each rank's thread count is back to its value before init, it has no
 *     /dev/shm/oxccl* mapping or open file; after all ranks exit no /dev/shm/oxccl* file that was
 *     not there before remains;
 *   - threads (one per rank in this process): same checks in this process;
 *   - with "hosts": processes only, each rank on a host of its own (OXCCL_HOSTID), so that every
 *     connection goes over the network transport; each rank's open descriptors (its sockets)
 *     are also back to their number before init.
 * usage: leak_check [NRANKS] [hosts]   (default 4) */
#include "common.h"

#include <dirent.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAXR 16
#define MAXFILES 256

static int nranks;
static int failed;
static int hosts;

/* Entries of a /proc directory (one per thread, or per open descriptor). */
static int count_entries(const char* dir) {
  DIR* d = opendir(dir);
  SYSCHECK(d != NULL, dir);
  int n = 0;
  struct dirent* e;
  while ((e = readdir(d)) != NULL)
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n;
}

static int count_tasks(void) { return count_entries("/proc/self/task"); }

/* Less the directory's own descriptor. */
static int count_fds(void) { return count_entries("/proc/self/fd") - 1; }

/* Names of /dev/shm entries starting with "oxccl". */
static int list_shm(char names[][256], int max) {
  DIR* d = opendir("/dev/shm");
  if (!d) return 0;
  int n = 0;
  struct dirent* e;
  while ((e = readdir(d)) != NULL)
    if (!strncmp(e->d_name, "oxccl", 5) && n < max) snprintf(names[n++], 256, "%s", e->d_name);
  closedir(d);
  return n;
}

static char shm_before[MAXFILES][256];
static int n_shm_before;

/* Files that appeared since the snapshot and are still there (rechecked for up to 3 s, so that a
 * file of some unrelated process that is about to go away does not count). */
static int new_shm_files(const char* when) {
  char now[MAXFILES][256];
  int leaked = 0;
  for (int attempt = 0; attempt < 30; attempt++) {
    int n = list_shm(now, MAXFILES);
    leaked = 0;
    for (int i = 0; i < n; i++) {
      int old = 0;
      for (int j = 0; j < n_shm_before; j++)
        if (!strcmp(now[i], shm_before[j])) old = 1;
      if (!old) {
        if (attempt == 29) fprintf(stderr, "FAIL %s: /dev/shm/%s remains\n", when, now[i]);
        leaked++;
      }
    }
    if (!leaked) return 0;
    usleep(100000);
  }
  return leaked;
}

/* Mappings or open descriptors of /dev/shm/oxccl* in this process. */
static int own_shm_refs(const char* when) {
  int refs = 0;
  FILE* f = fopen("/proc/self/maps", "r");
  SYSCHECK(f != NULL, "fopen /proc/self/maps");
  char line[1024];
  while (fgets(line, sizeof line, f))
    if (strstr(line, "/dev/shm/oxccl")) {
      if (refs++ < 3) fprintf(stderr, "FAIL %s: still mapped: %s", when, line);
    }
  fclose(f);
  DIR* d = opendir("/proc/self/fd");
  SYSCHECK(d != NULL, "opendir /proc/self/fd");
  struct dirent* e;
  while ((e = readdir(d)) != NULL) {
    char p[512], tgt[512];
    snprintf(p, sizeof p, "/proc/self/fd/%s", e->d_name);
    ssize_t k = readlink(p, tgt, sizeof tgt - 1);
    if (k <= 0) continue;
    tgt[k] = 0;
    if (strstr(tgt, "/dev/shm/oxccl")) {
      if (refs++ < 6) fprintf(stderr, "FAIL %s: fd %s still open on %s\n", when, e->d_name, tgt);
    }
  }
  closedir(d);
  return refs;
}

/* `count()` goes back to `want` (allowing 3 s for exiting threads to be reaped and sockets to
 * close); `what` names it in the failure. */
static int back_to(int (*count)(void), const char* what, int want, const char* when) {
  int n = 0;
  for (int i = 0; i < 30; i++) {
    n = count();
    if (n <= want) return 0;
    usleep(100000);
  }
  fprintf(stderr, "FAIL %s: %d %s, %d before init\n", when, n, what, want);
  return 1;
}

static int threads_back_to(int want, const char* when) {
  return back_to(count_tasks, "threads", want, when);
}

static int fds_back_to(int want, const char* when) {
  return back_to(count_fds, "open descriptors", want, when);
}

static void collectives(ncclComm_t comm, int rank) {
  int32_t s[1024], r[1024 * MAXR];
  for (int k = 0; k < 1024; k++) s[k] = rank + k;
  NCCLCHECK(ncclAllReduce(s, r, 1024, ncclInt32, ncclSum, comm, NULL));
  for (int k = 0; k < 1024; k++)
    if (r[k] != nranks * k + nranks * (nranks - 1) / 2) {
      fprintf(stderr, "FAIL rank %d allreduce[%d] = %d\n", rank, k, r[k]);
      exit(1);
    }
  NCCLCHECK(ncclAllGather(s, r, 1024, ncclInt32, comm, NULL));
  for (int p = 0; p < nranks; p++)
    if (r[p * 1024 + 5] != p + 5) {
      fprintf(stderr, "FAIL rank %d allgather[%d] = %d\n", rank, p * 1024 + 5, r[p * 1024 + 5]);
      exit(1);
    }
}

/* ---- processes ---- */
static int process_rank(int rank, int fd_in, int* fds_out) {
  if (hosts) {
    char h[32];
    snprintf(h, sizeof h, "leakhost%d", rank);
    setenv("OXCCL_HOSTID", h, 1);
  }
  int tasks0 = count_tasks(), fds0 = count_fds();
  ncclUniqueId id;
  if (rank == 0) {
    NCCLCHECK(ncclGetUniqueId(&id));
    for (int j = 1; j < nranks; j++)
      SYSCHECK(write(fds_out[j], &id, sizeof id) == (ssize_t)sizeof id, "write id");
  } else {
    size_t got = 0;
    while (got < sizeof id) {
      ssize_t k = read(fd_in, (char*)&id + got, sizeof id - got);
      SYSCHECK(k > 0, "read id");
      got += (size_t)k;
    }
  }
  ncclComm_t comm;
  NCCLCHECK(ncclCommInitRank(&comm, nranks, id, rank));
  collectives(comm, rank);
  NCCLCHECK(ncclCommDestroy(comm));
  char when[64];
  snprintf(when, sizeof when, "process rank %d after destroy", rank);
  int bad = threads_back_to(tasks0, when) + own_shm_refs(when);
  if (hosts) bad += fds_back_to(fds0, when);
  return bad ? 1 : 0;
}

static int run_processes(void) {
  int pipes[MAXR][2];
  pid_t kids[MAXR];
  for (int i = 1; i < nranks; i++) SYSCHECK(pipe(pipes[i]) == 0, "pipe");
  fflush(NULL);
  for (int i = 0; i < nranks; i++) {
    kids[i] = fork();
    SYSCHECK(kids[i] >= 0, "fork");
    if (kids[i] == 0) {
      alarm(100);
      int outs[MAXR];
      for (int j = 1; j < nranks; j++) outs[j] = pipes[j][1];
      int rc = process_rank(i, i ? pipes[i][0] : -1, outs);
      fflush(NULL);
      exit(rc);
    }
  }
  for (int i = 1; i < nranks; i++) {
    close(pipes[i][0]);
    close(pipes[i][1]);
  }
  int bad = 0;
  for (int i = 0; i < nranks; i++) {
    int st;
    SYSCHECK(waitpid(kids[i], &st, 0) == kids[i], "waitpid");
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "FAIL process rank %d ended with status 0x%x\n", i, st);
      bad++;
    }
  }
  bad += new_shm_files("after the process ranks exited");
  return bad;
}

/* ---- threads ---- */
static ncclUniqueId tid;
static void* thread_rank(void* arg) {
  int rank = (int)(intptr_t)arg;
  ncclComm_t comm;
  NCCLCHECK(ncclCommInitRank(&comm, nranks, tid, rank));
  collectives(comm, rank);
  NCCLCHECK(ncclCommDestroy(comm));
  return NULL;
}

static int run_threads(void) {
  int tasks0 = count_tasks();
  NCCLCHECK(ncclGetUniqueId(&tid));
  pthread_t th[MAXR];
  for (int r = 0; r < nranks; r++)
    SYSCHECK(pthread_create(&th[r], NULL, thread_rank, (void*)(intptr_t)r) == 0, "pthread_create");
  for (int r = 0; r < nranks; r++) pthread_join(th[r], NULL);
  int bad = threads_back_to(tasks0, "threads after destroy");
  bad += own_shm_refs("threads after destroy");
  bad += new_shm_files("threads after destroy");
  /* And once more with ncclCommInitAll in this same process. */
  ncclComm_t comms[MAXR];
  int devs[MAXR];
  for (int r = 0; r < nranks; r++) devs[r] = r;
  NCCLCHECK(ncclCommInitAll(comms, nranks, devs));
  for (int r = 0; r < nranks; r++) NCCLCHECK(ncclCommDestroy(comms[r]));
  bad += threads_back_to(tasks0, "ncclCommInitAll after destroy");
  bad += own_shm_refs("ncclCommInitAll after destroy");
  return bad;
}

int main(int argc, char** argv) {
  nranks = argc > 1 ? atoi(argv[1]) : 4;
  hosts = argc > 2 && !strcmp(argv[2], "hosts");
  if (nranks < 1 || nranks > MAXR) return 2;
  n_shm_before = list_shm(shm_before, MAXFILES);
  failed += run_processes();
  if (!hosts) failed += run_threads();
  if (failed) {
    fprintf(stderr, "leak_check: %d problems\n", failed);
    return 1;
  }
  printf("leak_check: %d ranks%s, no leftover threads, %s/dev/shm files\n", nranks,
         hosts ? " on hosts of their own" : "", hosts ? "sockets or " : "or ");
  return 0;
}
