/* A net plugin over TCP sockets, for oxccl's tests: it implements NCCL's net plugin ABI
 * version NET_V (6 .. 12, chosen at build time: -DNET_V=8) so that every collective can run
 * through oxccl's plugin path. Each message is an 8-byte length and the bytes; requests of a
 * comm complete in order. Listens on OXCCL_TEST_NET_IP, else on the first interface that is up
 * and not loopback, else on 127.0.0.1. Not a product:
 * blocking connect, no device offload, host memory only. */
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <arpa/inet.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#ifndef NET_V
#define NET_V 8
#endif

typedef int res_t;
enum { OK = 0, SYS = 2, INTERNAL = 3, REMOTE = 6 };
typedef void (*logger_t)(int level, unsigned long flags, const char* file, int line, const char* fmt, ...);
static logger_t logf_;

#define NREQ 32
struct comm;
struct req {
  struct comm* c;
  int recv, state; /* state: 0 free, 1 active, 2 complete (not yet reported) */
  char* buf;
  size_t size;  /* bytes to send, or room to receive */
  uint64_t len; /* the message's length (header) */
  size_t hoff, off;
};
struct ctx;
struct comm {
  int fd;
  struct ctx* ctx; /* v11+: the context it was made in */
  struct req reqs[NREQ];
  int head, tail; /* oldest active, next to allocate */
};
struct handle { uint32_t ip; uint16_t port; uint32_t magic; };
struct listener { int fd; struct ctx* ctx; };

/* v11+ contexts (NCCL makes one per communicator of each rank, its hash as the id), each
 * counting the listeners and comms made in it and not closed yet (the table of live ones is
 * with the v11 functions). */
struct ctx { uint64_t id; int open; };
static void opened(struct ctx* c) { if (c) __atomic_add_fetch(&c->open, 1, __ATOMIC_RELAXED); }
static void closed(struct ctx* c) { if (c) __atomic_sub_fetch(&c->open, 1, __ATOMIC_RELAXED); }

static res_t init_(void) {
  if (logf_) logf_(3, 0, __FILE__, __LINE__, "testnet plugin initialised (ABI v%d, %s)", NET_V, "TCP");
  return OK;
}
static res_t devices(int* n) { *n = 1; return OK; }
struct props_prefix { char* name; char* pciPath; uint64_t guid; int ptrSupport; };
static res_t getProperties(int dev, void* props) {
  (void)dev;
  struct props_prefix* p = props;
  p->name = "testnet";
  p->pciPath = NULL;
  p->guid = 0x7e57;
  p->ptrSupport = 1; /* NCCL_PTR_HOST */
  return OK;
}
/* The first IPv4 address of an interface that is up and not loopback; else 127.0.0.1. */
static in_addr_t first_address(void) {
  in_addr_t found = inet_addr("127.0.0.1");
  struct ifaddrs* all;
  if (getifaddrs(&all)) return found;
  for (struct ifaddrs* i = all; i; i = i->ifa_next) {
    if (i->ifa_addr && i->ifa_addr->sa_family == AF_INET && (i->ifa_flags & IFF_UP) &&
        !(i->ifa_flags & IFF_LOOPBACK)) {
      found = ((struct sockaddr_in*)i->ifa_addr)->sin_addr.s_addr;
      break;
    }
  }
  freeifaddrs(all);
  return found;
}

static res_t listen_(int dev, void* h, void** lc) {
  (void)dev;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return SYS;
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  const char* ip = getenv("OXCCL_TEST_NET_IP");
  a.sin_addr.s_addr = ip ? inet_addr(ip) : first_address();
  socklen_t len = sizeof a;
  if (bind(fd, (void*)&a, sizeof a) || listen(fd, 64) || getsockname(fd, (void*)&a, &len)) {
    close(fd);
    return SYS;
  }
  fcntl(fd, F_SETFL, O_NONBLOCK);
  struct handle hd = {a.sin_addr.s_addr, a.sin_port, 0x7e57};
  memcpy(h, &hd, sizeof hd);
  struct listener* l = calloc(1, sizeof *l);
  l->fd = fd;
  *lc = l;
  return OK;
}
static struct comm* new_comm(int fd) {
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  fcntl(fd, F_SETFL, O_NONBLOCK);
  struct comm* c = calloc(1, sizeof *c);
  c->fd = fd;
  return c;
}
static res_t connect_(int dev, void* h, void** sc) {
  (void)dev;
  struct handle hd;
  memcpy(&hd, h, sizeof hd);
  if (hd.magic != 0x7e57) return INTERNAL;
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = hd.ip;
  a.sin_port = hd.port;
  if (connect(fd, (void*)&a, sizeof a)) { close(fd); return SYS; }
  *sc = new_comm(fd);
  return OK;
}
static res_t accept_(void* lc, void** rc) {
  int fd = accept(((struct listener*)lc)->fd, NULL, NULL);
  if (fd < 0) {
    *rc = NULL;
    return errno == EAGAIN || errno == EWOULDBLOCK ? OK : SYS;
  }
  struct comm* c = new_comm(fd);
  c->ctx = ((struct listener*)lc)->ctx;
  opened(c->ctx);
  *rc = c;
  return OK;
}
static res_t regMr_(void* c, void* d, size_t s, int t, void** mh) {
  (void)c; (void)d; (void)s;
  if (t != 1) return INTERNAL;
  *mh = (void*)0x1;
  return OK;
}
static res_t deregMr(void* c, void* mh) { (void)c; (void)mh; return OK; }
static res_t post(void* cv, int recv, void* data, size_t size, void** request) {
  struct comm* c = cv;
  struct req* r = &c->reqs[c->tail];
  if (r->state != 0) { *request = NULL; return OK; } /* busy: again later */
  /* OXCCL_TEST_NET_BUSY=1: refuse every third post, as a plugin out of resources may. */
  static int calls;
  if (getenv("OXCCL_TEST_NET_BUSY") && __atomic_fetch_add(&calls, 1, __ATOMIC_RELAXED) % 3 == 1) {
    *request = NULL;
    return OK;
  }
  memset(r, 0, sizeof *r);
  r->c = c; r->recv = recv; r->state = 1; r->buf = data; r->size = size;
  r->len = size;
  c->tail = (c->tail + 1) % NREQ;
  *request = r;
  return OK;
}
/* Moves the oldest active request on; 1 when it completed, 0 when it waits, <0 on error. */
static int advance(struct comm* c) {
  struct req* r = &c->reqs[c->head];
  if (r->state != 1) return 0;
  while (r->hoff < 8) {
    ssize_t n = r->recv ? recv(c->fd, (char*)&r->len + r->hoff, 8 - r->hoff, 0)
                        : send(c->fd, (char*)&r->len + r->hoff, 8 - r->hoff, MSG_NOSIGNAL);
    if (n > 0) { r->hoff += n; continue; }
    if (n == 0 && r->recv && r->hoff == 0) return -3; /* the peer has gone between messages */
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    return -1;
  }
  if (r->recv && r->len > r->size) return -2;
  while (r->off < r->len) {
    ssize_t n = r->recv ? recv(c->fd, r->buf + r->off, r->len - r->off, 0)
                        : send(c->fd, r->buf + r->off, r->len - r->off, MSG_NOSIGNAL);
    if (n > 0) { r->off += n; continue; }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    return -1;
  }
  r->state = 2;
  c->head = (c->head + 1) % NREQ;
  return 1;
}
static res_t test(void* request, int* done, int* size) {
  struct req* r = request;
  struct comm* c = r->c;
  while (r->state == 1) {
    int a = advance(c);
    if (a == -3) return REMOTE; /* closed: the caller decides whether that is a failure */
    if (a < 0) {
      if (logf_) logf_(2, 0, __FILE__, __LINE__, "testnet: a connection failed");
      return a == -2 ? INTERNAL : REMOTE;
    }
    if (a == 0) break;
  }
  *done = r->state == 2;
  if (*done) {
    if (size) *size = (int)r->len;
    r->state = 0;
  }
  return OK;
}
static res_t closeComm(void* c) {
  if (c) { closed(((struct comm*)c)->ctx); close(((struct comm*)c)->fd); free(c); }
  return OK;
}
static res_t closeListen(void* l) {
  if (l) { closed(((struct listener*)l)->ctx); close(((struct listener*)l)->fd); free(l); }
  return OK;
}

/* The ABI's signatures, per version. */
#if NET_V >= 10
/* NCCL passes a profiler callback (ncclProfilerCallback_t); a plugin may call it unchecked. */
typedef int (*profiler_t)(void** handle, int type, void* parent, int64_t plugin, void* ext);
static res_t profiler_ok(void* pf) {
  void* h = (void*)0x1;
  if (!pf || ((profiler_t)pf)(&h, 0, NULL, 0, NULL) != OK || h != NULL) {
    if (logf_) logf_(2, 0, __FILE__, __LINE__, "testnet: no usable profiler callback");
    return INTERNAL;
  }
  return OK;
}
#endif
#if NET_V >= 11
/* Listen and connect check that they get a live context; init and finalize say whose it is,
 * and finalize whether anything made in it is still open. */
#define MAX_CTX 64
static struct ctx* live[MAX_CTX];
static int is_live(void* c) {
  for (int i = 0; c && i < MAX_CTX; i++) if (__atomic_load_n(&live[i], __ATOMIC_ACQUIRE) == c) return 1;
  return 0;
}
static res_t init_v(void** ctx, uint64_t id, void* cfg, logger_t lf, void* pf) {
  (void)cfg; logf_ = lf;
  if (profiler_ok(pf) != OK) return INTERNAL;
  struct ctx* c = calloc(1, sizeof *c);
  if (!c) return SYS;
  c->id = id;
  int i = 0;
  while (i < MAX_CTX && !__atomic_compare_exchange_n(&live[i], &(struct ctx*){NULL}, c, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) i++;
  if (i == MAX_CTX) { free(c); return INTERNAL; }
  *ctx = c;
  if (logf_) logf_(3, 0, __FILE__, __LINE__, "testnet context for comm %#llx", (unsigned long long)id);
  return init_();
}
static res_t listen_v(void* ctx, int dev, void* h, void** lc) {
  if (!is_live(ctx)) return INTERNAL;
  res_t r = listen_(dev, h, lc);
  if (r == OK) { ((struct listener*)*lc)->ctx = ctx; opened(ctx); }
  return r;
}
static res_t connect_v(void* ctx, int dev, void* h, void** sc, void** dc) {
  if (!is_live(ctx)) return INTERNAL;
  *dc = NULL;
  res_t r = connect_(dev, h, sc);
  if (r == OK && *sc) { ((struct comm*)*sc)->ctx = ctx; opened(ctx); }
  return r;
}
static res_t finalize(void* ctx) {
  if (!is_live(ctx)) return INTERNAL;
  struct ctx* c = ctx;
  int open = __atomic_load_n(&c->open, __ATOMIC_RELAXED);
  if (open && logf_) logf_(2, 0, __FILE__, __LINE__, "testnet: context for comm %#llx finalized with %d comm(s) open", (unsigned long long)c->id, open);
  if (logf_) logf_(3, 0, __FILE__, __LINE__, "testnet context for comm %#llx finalized", (unsigned long long)c->id);
  for (int i = 0; i < MAX_CTX; i++) if (live[i] == c) __atomic_store_n(&live[i], NULL, __ATOMIC_RELEASE);
  free(c);
  return OK;
}
#elif NET_V == 10
static res_t init_v(logger_t lf, void* pf) { logf_ = lf; if (profiler_ok(pf) != OK) return INTERNAL; return init_(); }
static res_t listen_v(int dev, void* h, void** lc) { return listen_(dev, h, lc); }
static res_t connect_v(int dev, void* cfg, void* h, void** sc, void** dc) { (void)cfg; *dc = NULL; return connect_(dev, h, sc); }
#else
static res_t init_v(logger_t lf) { logf_ = lf; return init_(); }
static res_t listen_v(int dev, void* h, void** lc) { return listen_(dev, h, lc); }
#if NET_V == 6
static res_t connect_v(int dev, void* h, void** sc) { return connect_(dev, h, sc); }
#else
static res_t connect_v(int dev, void* h, void** sc, void** dc) { *dc = NULL; return connect_(dev, h, sc); }
#endif
#endif
#if NET_V == 6
static res_t accept_v(void* lc, void** rc) { return accept_(lc, rc); }
#else
static res_t accept_v(void* lc, void** rc, void** dc) { *dc = NULL; return accept_(lc, rc); }
#endif
#if NET_V <= 7
static res_t regMr_v(void* c, void* d, int s, int t, void** mh) { return regMr_(c, d, (size_t)s, t, mh); }
#else
static res_t regMr_v(void* c, void* d, size_t s, int t, void** mh) { return regMr_(c, d, s, t, mh); }
#endif
#if NET_V <= 8
static res_t isend_v(void* c, void* d, int s, int tag, void* mh, void** req) { (void)tag; (void)mh; return post(c, 0, d, (size_t)s, req); }
static res_t irecv_v(void* c, int n, void** d, int* s, int* tags, void** mh, void** req) {
  (void)tags; (void)mh; if (n != 1) return INTERNAL; return post(c, 1, d[0], (size_t)s[0], req);
}
#elif NET_V == 9
static res_t isend_v(void* c, void* d, size_t s, int tag, void* mh, void** req) { (void)tag; (void)mh; return post(c, 0, d, s, req); }
static res_t irecv_v(void* c, int n, void** d, size_t* s, int* tags, void** mh, void** req) {
  (void)tags; (void)mh; if (n != 1) return INTERNAL; return post(c, 1, d[0], s[0], req);
}
#else
static res_t isend_v(void* c, void* d, size_t s, int tag, void* mh, void* ph, void** req) { (void)tag; (void)mh; (void)ph; return post(c, 0, d, s, req); }
static res_t irecv_v(void* c, int n, void** d, size_t* s, int* tags, void** mh, void** ph, void** req) {
  (void)tags; (void)mh; (void)ph; if (n != 1) return INTERNAL; return post(c, 1, d[0], s[0], req);
}
#endif

/* name, then the functions in the order of ncclNet_v<NET_V>_t. */
struct table { const char* name; void* fns[22]; };
#define NAME2(a, b) a##b
#define NAME(a, b) NAME2(a, b)
struct table NAME(ncclNetPlugin_v, NET_V) = {
  "testnet",
  {
    (void*)init_v, (void*)devices, (void*)getProperties, (void*)listen_v, (void*)connect_v,
    (void*)accept_v, (void*)regMr_v, NULL /* regMrDmaBuf */, (void*)deregMr, (void*)isend_v,
    (void*)irecv_v, NULL /* iflush */, (void*)test, (void*)closeComm, (void*)closeComm,
    (void*)closeListen,
#if NET_V >= 7
    NULL /* getDeviceMr */, NULL /* irecvConsumed */,
#endif
#if NET_V >= 9
    NULL /* makeVDevice */,
#endif
#if NET_V >= 11
    (void*)finalize, NULL /* setNetAttr */,
#endif
  },
};
