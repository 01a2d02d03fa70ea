// tp_pp_mlp: transformer MLP blocks, Y = GeLU(X.A).B, split across ranks the way large models
// are: tensor parallelism inside a layer (one all-reduce per block, Megatron-LM's split) and
// pipeline parallelism across layers (activations sent from stage to stage). Uses only nccl.h,
// the C++ standard library and POSIX sockets (to hand the unique id from rank 0 to the others);
// with --device cuda also the CUDA driver and NVRTC, loaded at run time (cuda_engine.h).
//
// Launch one rank per process, like the perf tools: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
// or under mpirun (OMPI_COMM_WORLD_RANK/SIZE; without MASTER_ADDR/MASTER_PORT, one host: rank 0
// publishes its port in a file named by the job). Options:
//   --tp N --pp M               tensor- and pipeline-parallel sizes (N x M = world size)
//   --hidden H --layers L       model shape (the MLP's inner size is 4H; L is a multiple of M)
//   --microbatches K --batch B  K micro-batches of B rows go through the pipeline
//   --split megatron|rows-first A by columns and B by rows (one all-reduce of B x H per block),
//                               or A by rows (X by columns): X.A is summed before the GeLU (an
//                               all-reduce of B x 4H) and B x H gathered after (an all-gather)
//   --exact                     integer-valued data, ReLU and clamping: results are exact
//   --tp-across-hosts           place each tensor-parallel group across hosts on purpose
//   --device host|cuda          the buffers in host memory (oxccl's host executor: run with
//                               OXCCL_DEVICE=host where a GPU is present), or on GPU 0 with
//                               the arithmetic in kernels of ours (cuda_engine.h)
// Rank 0 computes the same MLP unsplit and prints, last,
//   tp_pp_mlp: max |diff| = <x> (tolerance <t>): PASS   (or FAIL, exit code 1)

#include <nccl.h>

#include "cuda_engine.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

[[noreturn]] void die(const std::string& msg) {
  std::fprintf(stderr, "tp_pp_mlp: %s\n", msg.c_str());
  std::exit(2);
}

#define NCCL(call)                                                                     \
  do {                                                                                 \
    ncclResult_t r_ = (call);                                                          \
    if (r_ != ncclSuccess)                                                             \
      die(std::string(#call) + ": " + ncclGetErrorString(r_) + " (" +                   \
          ncclGetLastError(nullptr) + ")");                                            \
  } while (0)

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct Opts {
  int tp = 1, pp = 1, hidden = 64, layers = 2, microbatches = 4, batch = 8;
  bool rows_first = false, exact = false, across = false, cuda = false;
};

Opts parse(int argc, char** argv) {
  Opts o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    auto val = [&]() -> int {
      if (i + 1 >= argc) die("missing value after " + a);
      return std::atoi(argv[++i]);
    };
    if (a == "--tp") o.tp = val();
    else if (a == "--pp") o.pp = val();
    else if (a == "--hidden") o.hidden = val();
    else if (a == "--layers") o.layers = val();
    else if (a == "--microbatches") o.microbatches = val();
    else if (a == "--batch") o.batch = val();
    else if (a == "--exact") o.exact = true;
    else if (a == "--tp-across-hosts") o.across = true;
    else if (a == "--device") {
      if (i + 1 >= argc) die("missing value after --device");
      std::string d = argv[++i];
      if (d == "cuda") o.cuda = true;
      else if (d != "host") die("--device is host or cuda, not " + d);
    }
    else if (a == "--split") {
      if (i + 1 >= argc) die("missing value after --split");
      std::string s = argv[++i];
      if (s == "rows-first") o.rows_first = true;
      else if (s != "megatron") die("--split is megatron or rows-first, not " + s);
    } else die("unknown option " + a);
  }
  if (o.tp < 1 || o.pp < 1 || o.hidden < 1 || o.layers < 1 || o.microbatches < 1 || o.batch < 1)
    die("sizes must be positive");
  if (o.layers % o.pp) die("--layers must be a multiple of --pp");
  if ((4 * o.hidden) % o.tp || o.hidden % o.tp) die("--hidden must be a multiple of --tp");
  return o;
}

// ---- handing the unique id out: rank 0 listens on MASTER_PORT, the others connect ----------

int env_int(const char* a, const char* b, int dflt) {
  const char* v = std::getenv(a);
  if (!v && b) v = std::getenv(b);
  return v ? std::atoi(v) : dflt;
}

// Under mpirun without MASTER_ADDR/MASTER_PORT (ranks of one host): rank 0 publishes its
// host and port in a file named by the job.
std::string job_file() {
  const char* job = std::getenv("OMPI_MCA_ess_base_jobid");
  if (!job) job = std::getenv("PMIX_NAMESPACE");
  if (!job) die("set MASTER_ADDR and MASTER_PORT");
  std::string f = std::string("/tmp/oxccl-tp-pp-") + job + "-" + std::to_string(getuid());
  for (size_t i = 5; i < f.size(); i++)
    if (f[i] == '/' || f[i] == ' ') f[i] = '_';
  return f;
}

void share_id(ncclUniqueId* id, int rank, int nranks) {
  const char* host = std::getenv("MASTER_ADDR");
  const char* port = std::getenv("MASTER_PORT");
  std::string file, host_s, port_s;
  if (!host || !port) file = job_file();
  if (rank == 0) {
    NCCL(ncclGetUniqueId(id));
    int l = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in sa{};
    sa.sin_family = AF_INET;
    sa.sin_addr.s_addr = htonl(INADDR_ANY);
    sa.sin_port = htons(static_cast<uint16_t>(port ? std::atoi(port) : 0));
    if (bind(l, reinterpret_cast<sockaddr*>(&sa), sizeof sa) || listen(l, 1024))
      die(std::string("rank 0 cannot listen on port ") + (port ? port : "0"));
    if (!file.empty()) {
      socklen_t len = sizeof sa;
      getsockname(l, reinterpret_cast<sockaddr*>(&sa), &len);
      FILE* f = std::fopen((file + ".tmp").c_str(), "w");
      if (!f) die("cannot write " + file);
      std::fprintf(f, "127.0.0.1 %d\n", ntohs(sa.sin_port));
      std::fclose(f);
      std::rename((file + ".tmp").c_str(), file.c_str());
    }
    for (int i = 1; i < nranks; i++) {
      int fd = accept(l, nullptr, nullptr);
      if (fd < 0 || write(fd, id, sizeof *id) != static_cast<ssize_t>(sizeof *id))
        die("handing the unique id out failed");
      close(fd);
    }
    close(l);
    if (!file.empty()) std::remove(file.c_str());
    return;
  }
  if (!file.empty()) {
    for (int tries = 0;; tries++) {
      char h[256];
      int p = 0;
      FILE* f = std::fopen(file.c_str(), "r");
      bool ok = f && std::fscanf(f, "%255s %d", h, &p) == 2;
      if (f) std::fclose(f);
      if (ok) {
        host_s = h;
        port_s = std::to_string(p);
        host = host_s.c_str();
        port = port_s.c_str();
        break;
      }
      if (tries > 1200) die("rank 0 never published " + file);
      usleep(50000);
    }
  }
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(host, port, &hints, &res) || !res) die(std::string("cannot resolve ") + host);
  for (int tries = 0;; tries++) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
      size_t got = 0;
      while (got < sizeof *id) {
        ssize_t n = read(fd, reinterpret_cast<char*>(id) + got, sizeof *id - got);
        if (n <= 0) die("reading the unique id failed");
        got += static_cast<size_t>(n);
      }
      close(fd);
      break;
    }
    close(fd);
    if (tries > 1200) die(std::string("rank 0 is not listening at ") + host + ":" + port);
    usleep(50000);
  }
  freeaddrinfo(res);
}

// ---- the model -------------------------------------------------------------------------------

// A seeded generator (the same numbers on every rank and in the reference).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9e3779b97f4a7c15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  // Integers in [-k, k], or uniform in [-1, 1) scaled.
  float value(bool exact, float scale) {
    if (exact) return static_cast<float>(static_cast<int>(next() % 5) - 2);
    return scale * (static_cast<float>(next() >> 40) / static_cast<float>(1 << 24) * 2.0f - 1.0f);
  }
};

// Layer l's full weights: A (H x 4H), B (4H x H), row-major.
struct Layer {
  std::vector<float> a, b;
};

std::vector<Layer> weights(const Opts& o) {
  std::vector<Layer> w(o.layers);
  int h = o.hidden, f = 4 * o.hidden;
  for (int l = 0; l < o.layers; l++) {
    Rng g(1000 + l);
    w[l].a.resize(static_cast<size_t>(h) * f);
    w[l].b.resize(static_cast<size_t>(f) * h);
    for (auto& x : w[l].a) x = g.value(o.exact, 1.0f / std::sqrt(static_cast<float>(h)));
    for (auto& x : w[l].b) x = g.value(o.exact, 1.0f / std::sqrt(static_cast<float>(f)));
  }
  return w;
}

std::vector<float> input(const Opts& o, int k) {
  Rng g(7 + k);
  std::vector<float> x(static_cast<size_t>(o.batch) * o.hidden);
  for (auto& v : x) v = g.value(o.exact, 1.0f);
  return x;
}

float act(float z, bool exact) {
  if (exact) return z > 0 ? z : 0;  // ReLU: exact on integers
  return 0.5f * z * (1.0f + std::tanh(0.7978845608f * (z + 0.044715f * z * z * z)));
}

// Keeps an exact run's values small enough that every sum stays exact in float.
void clamp_exact(std::vector<float>& y, bool exact) {
  if (exact)
    for (auto& v : y) v = std::max(-8.0f, std::min(8.0f, v));
}

// C (m x n, row stride ldc) = X (m x k, row stride ldx) . W (k x n, row stride ldw).
void gemm(const float* x, int ldx, const float* w, int ldw, float* c, int ldc, int m, int k,
          int n) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float s = 0;
      for (int t = 0; t < k; t++) s += x[i * ldx + t] * w[t * ldw + j];
      c[i * ldc + j] = s;
    }
}

std::vector<float> reference_layer(const Opts& o, const Layer& w, const std::vector<float>& x) {
  int m = o.batch, h = o.hidden, f = 4 * o.hidden;
  std::vector<float> z(static_cast<size_t>(m) * f), y(static_cast<size_t>(m) * h);
  gemm(x.data(), h, w.a.data(), f, z.data(), f, m, h, f);
  for (auto& v : z) v = act(v, o.exact);
  gemm(z.data(), f, w.b.data(), h, y.data(), h, m, f, h);
  clamp_exact(y, o.exact);
  return y;
}

// The host engine (--device host): buffers in host memory, the arithmetic in the loops above;
// collectives on the NULL stream, where oxccl's host executor runs the call itself.
// cuda_engine.h has the same members for GPU memory.
class HostEngine {
 public:
  cudaStream_t stream() const { return nullptr; }
  void sync() {}
  float* alloc(size_t n) {
    bufs_.emplace_back(n);
    return bufs_.back().data();
  }
  void upload(float* dst, const float* src, size_t n) { std::memcpy(dst, src, n * sizeof(float)); }
  void download(float* dst, const float* src, size_t n) { upload(dst, src, n); }
  void gemm(const float* x, int ldx, const float* w, int ldw, float* c, int ldc, int m, int k,
            int n) {
    ::gemm(x, ldx, w, ldw, c, ldc, m, k, n);
  }
  void activate(float* z, size_t n, bool exact) {
    for (size_t i = 0; i < n; i++) z[i] = act(z[i], exact);
  }
  void clamp(float* y, size_t n) {
    for (size_t i = 0; i < n; i++) y[i] = std::max(-8.0f, std::min(8.0f, y[i]));
  }
  // y (m x tp*hs) from tp blocks of m x hs.
  void interleave(const float* got, float* y, int tp, int m, int hs) {
    for (int t = 0; t < tp; t++)
      for (int i = 0; i < m; i++)
        for (int j = 0; j < hs; j++) y[(i * tp + t) * hs + j] = got[(t * m + i) * hs + j];
  }

 private:
  std::vector<std::vector<float>> bufs_;  // a moved vector keeps its storage
};

// What one communicator carried and how long its calls took.
struct Stats {
  double bytes = 0, secs = 0;
  int calls = 0;
};

ncclUniqueId unique_id(int rank, int nranks) {
  ncclUniqueId id;
  if (nranks > 1) share_id(&id, rank, nranks);
  else NCCL(ncclGetUniqueId(&id));
  return id;
}

// One rank's run on engine `eng` (host or device buffers).
template <class Engine>
int run(const Opts& o, Engine& eng, int rank, int nranks, const ncclUniqueId& id) {
  ncclComm_t world, tpc, ppc;
  NCCL(ncclCommInitRank(&world, nranks, id, rank));
  // Placement: by default a tensor-parallel group is consecutive ranks (one host's, when a
  // host runs tp ranks or a multiple); --tp-across-hosts interleaves them across the world.
  int stage = o.across ? rank % o.pp : rank / o.tp;
  int tpi = o.across ? rank / o.pp : rank % o.tp;
  auto world_rank = [&](int s, int t) { return o.across ? t * o.pp + s : s * o.tp + t; };
  NCCL(ncclCommSplit(world, stage, tpi, &tpc, nullptr));
  NCCL(ncclCommSplit(world, tpi, stage, &ppc, nullptr));

  const int m = o.batch, h = o.hidden, f = 4 * o.hidden;
  const int per = o.layers / o.pp, fs = f / o.tp, hs = h / o.tp;
  const size_t mh = static_cast<size_t>(m) * h, mf = static_cast<size_t>(m) * f;
  // This stage's weights, whole (each rank reads its slices in place).
  auto all = weights(o);
  std::vector<float*> wa(o.layers), wb(o.layers);
  for (int l = stage * per; l < (stage + 1) * per; l++) {
    wa[l] = eng.alloc(all[l].a.size());
    wb[l] = eng.alloc(all[l].b.size());
    eng.upload(wa[l], all[l].a.data(), all[l].a.size());
    eng.upload(wb[l], all[l].b.data(), all[l].b.size());
  }
  float *x = eng.alloc(mh), *y = eng.alloc(mh), *z = eng.alloc(mf);
  float *part = eng.alloc(static_cast<size_t>(m) * hs), *got = eng.alloc(mh);
  Stats st_tp, st_pp;
  // A collective's time: from when the stream has done the work before it to when the
  // stream has done it.
  auto timed = [&](Stats& s, double bytes, auto&& call) {
    eng.sync();
    double t0 = now();
    call();
    eng.sync();
    s.secs += now() - t0;
    s.bytes += bytes;
    s.calls++;
  };
  cudaStream_t stream = eng.stream();

  std::vector<std::vector<float>> outputs;
  double t_start = now();
  for (int k = 0; k < o.microbatches; k++) {
    if (stage == 0) {
      std::vector<float> in = input(o, k);
      eng.upload(x, in.data(), mh);
    } else {
      timed(st_pp, mh * 4.0,
            [&] { NCCL(ncclRecv(x, mh, ncclFloat, stage - 1, ppc, stream)); });
    }
    for (int l = stage * per; l < (stage + 1) * per; l++) {
      if (!o.rows_first) {
        // Megatron: A by columns, B by rows: GeLU on each rank's slice, one all-reduce.
        eng.gemm(x, h, wa[l] + tpi * fs, f, z, fs, m, h, fs);
        eng.activate(z, static_cast<size_t>(m) * fs, o.exact);
        eng.gemm(z, fs, wb[l] + static_cast<size_t>(tpi) * fs * h, h, y, h, m, fs, h);
        timed(st_tp, mh * 4.0,
              [&] { NCCL(ncclAllReduce(y, y, mh, ncclFloat, ncclSum, tpc, stream)); });
      } else {
        // Rows first: A by rows (X by columns); X.A must be summed before the GeLU.
        eng.gemm(x + tpi * hs, h, wa[l] + static_cast<size_t>(tpi) * hs * f, f, z, f, m, hs, f);
        timed(st_tp, mf * 4.0,
              [&] { NCCL(ncclAllReduce(z, z, mf, ncclFloat, ncclSum, tpc, stream)); });
        eng.activate(z, mf, o.exact);
        // Each rank's columns of Y, gathered: [tp][m][hs] blocks, then interleaved into Y.
        eng.gemm(z, f, wb[l] + tpi * hs, h, part, hs, m, f, hs);
        timed(st_tp, mh * 4.0, [&] {
          NCCL(ncclAllGather(part, got, static_cast<size_t>(m) * hs, ncclFloat, tpc, stream));
        });
        eng.interleave(got, y, o.tp, m, hs);
      }
      if (o.exact) eng.clamp(y, mh);
      std::swap(x, y);
    }
    if (stage + 1 < o.pp) {
      timed(st_pp, mh * 4.0, [&] { NCCL(ncclSend(x, mh, ncclFloat, stage + 1, ppc, stream)); });
    } else {
      outputs.emplace_back(mh);
      eng.download(outputs.back().data(), x, mh);
    }
  }
  eng.sync();
  double t_all = now() - t_start;

  // The last stage's first tensor-parallel rank hands its outputs to rank 0, which checks them.
  int last = world_rank(o.pp - 1, 0);
  double maxdiff = 0, tol = o.exact ? 0.0 : 1e-3 * o.layers;
  if (rank == last && rank != 0)
    for (auto& out : outputs) {
      eng.upload(x, out.data(), mh);
      NCCL(ncclSend(x, mh, ncclFloat, 0, world, stream));
    }
  if (rank == 0) {
    std::vector<float> back(mh);
    for (int k = 0; k < o.microbatches; k++) {
      if (last != 0) {
        NCCL(ncclRecv(x, mh, ncclFloat, last, world, stream));
        eng.download(back.data(), x, mh);
      } else {
        back = outputs[k];
      }
      std::vector<float> want = input(o, k);
      for (int l = 0; l < o.layers; l++) want = reference_layer(o, all[l], want);
      for (size_t i = 0; i < want.size(); i++)
        maxdiff = std::max(maxdiff, static_cast<double>(std::fabs(want[i] - back[i])));
    }
  }
  eng.sync();
  std::printf(
      "rank %d (stage %d, tp %d): tp comm %d calls %.0f bytes %.3f ms, pp comm %d calls %.0f "
      "bytes %.3f ms, %.3f ms per micro-batch\n",
      rank, stage, tpi, st_tp.calls, st_tp.bytes, st_tp.secs * 1e3, st_pp.calls, st_pp.bytes,
      st_pp.secs * 1e3, t_all * 1e3 / o.microbatches);
  std::fflush(stdout);
  NCCL(ncclCommDestroy(ppc));
  NCCL(ncclCommDestroy(tpc));
  NCCL(ncclCommDestroy(world));
  if (rank == 0) {
    bool pass = maxdiff <= tol;
    std::printf("tp_pp_mlp: max |diff| = %g (tolerance %g): %s\n", maxdiff, tol,
                pass ? "PASS" : "FAIL");
    return pass ? 0 : 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Opts o = parse(argc, argv);
  int rank = env_int("OMPI_COMM_WORLD_RANK", "RANK", 0);
  int nranks = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", 1);
  if (o.tp * o.pp != nranks)
    die("--tp x --pp must be the world size (" + std::to_string(nranks) + ")");
  if (o.cuda) {
    // Before the communicators: the device's context is current on this thread.
    cuda_engine::Engine eng;
    ncclUniqueId id = unique_id(rank, nranks);
    return run(o, eng, rank, nranks, id);
  }
  HostEngine eng;
  ncclUniqueId id = unique_id(rank, nranks);
  return run(o, eng, rank, nranks, id);
}
