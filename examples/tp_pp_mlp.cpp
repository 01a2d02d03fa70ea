// tp_pp_mlp: transformer MLP blocks, Y = GeLU(X.A).B, split across ranks the way large models
// are: tensor parallelism inside a layer (one all-reduce per block, Megatron-LM's split) and
// pipeline parallelism across layers (activations sent from stage to stage). Uses only nccl.h,
// the C++ standard library and POSIX sockets (to hand the unique id from rank 0 to the others).
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
// Rank 0 computes the same MLP unsplit and prints, last,
//   tp_pp_mlp: max |diff| = <x> (tolerance <t>): PASS   (or FAIL, exit code 1)

#include <nccl.h>

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
  bool rows_first = false, exact = false, across = false;
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

// C (m x n) = X (m x k, row stride ldx, from column x0) . W (k rows from r0, columns c0..c0+n,
// row stride ldw).
void gemm(const float* x, int ldx, int x0, const float* w, int ldw, int r0, int c0, float* c,
          int m, int k, int n) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      float s = 0;
      for (int t = 0; t < k; t++) s += x[i * ldx + x0 + t] * w[(r0 + t) * ldw + c0 + j];
      c[i * n + j] = s;
    }
}

std::vector<float> reference_layer(const Opts& o, const Layer& w, const std::vector<float>& x) {
  int m = o.batch, h = o.hidden, f = 4 * o.hidden;
  std::vector<float> z(static_cast<size_t>(m) * f), y(static_cast<size_t>(m) * h);
  gemm(x.data(), h, 0, w.a.data(), f, 0, 0, z.data(), m, h, f);
  for (auto& v : z) v = act(v, o.exact);
  gemm(z.data(), f, 0, w.b.data(), h, 0, 0, y.data(), m, f, h);
  clamp_exact(y, o.exact);
  return y;
}

// What one communicator carried and how long its calls took.
struct Stats {
  double bytes = 0, secs = 0;
  int calls = 0;
};

}  // namespace

int main(int argc, char** argv) {
  Opts o = parse(argc, argv);
  int rank = env_int("OMPI_COMM_WORLD_RANK", "RANK", 0);
  int nranks = env_int("OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", 1);
  if (o.tp * o.pp != nranks)
    die("--tp x --pp must be the world size (" + std::to_string(nranks) + ")");
  ncclUniqueId id;
  if (nranks > 1) share_id(&id, rank, nranks);
  else NCCL(ncclGetUniqueId(&id));
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
  auto all = weights(o);
  Stats st_tp, st_pp;
  auto timed = [](Stats& s, double bytes, auto&& call) {
    double t0 = now();
    call();
    s.secs += now() - t0;
    s.bytes += bytes;
    s.calls++;
  };
  cudaStream_t stream = nullptr;  // the NULL stream: on the host executor, the call itself

  std::vector<std::vector<float>> outputs;
  std::vector<float> x(static_cast<size_t>(m) * h), z, zp, y(static_cast<size_t>(m) * h);
  double t_start = now();
  for (int k = 0; k < o.microbatches; k++) {
    if (stage == 0) {
      x = input(o, k);
    } else {
      timed(st_pp, x.size() * 4.0, [&] {
        NCCL(ncclRecv(x.data(), x.size(), ncclFloat, stage - 1, ppc, stream));
      });
    }
    for (int l = stage * per; l < (stage + 1) * per; l++) {
      const Layer& w = all[l];
      if (!o.rows_first) {
        // Megatron: A by columns, B by rows: GeLU on each rank's slice, one all-reduce.
        z.assign(static_cast<size_t>(m) * fs, 0);
        gemm(x.data(), h, 0, w.a.data(), f, 0, tpi * fs, z.data(), m, h, fs);
        for (auto& v : z) v = act(v, o.exact);
        gemm(z.data(), fs, 0, w.b.data(), h, tpi * fs, 0, y.data(), m, fs, h);
        timed(st_tp, y.size() * 4.0, [&] {
          NCCL(ncclAllReduce(y.data(), y.data(), y.size(), ncclFloat, ncclSum, tpc, stream));
        });
      } else {
        // Rows first: A by rows (X by columns); X.A must be summed before the GeLU.
        z.assign(static_cast<size_t>(m) * f, 0);
        gemm(x.data(), h, tpi * hs, w.a.data(), f, tpi * hs, 0, z.data(), m, hs, f);
        timed(st_tp, z.size() * 4.0, [&] {
          NCCL(ncclAllReduce(z.data(), z.data(), z.size(), ncclFloat, ncclSum, tpc, stream));
        });
        for (auto& v : z) v = act(v, o.exact);
        // Each rank's columns of Y, gathered: [tp][m][hs] blocks, then transposed into Y.
        std::vector<float> part(static_cast<size_t>(m) * hs), got(static_cast<size_t>(m) * h);
        gemm(z.data(), f, 0, w.b.data(), h, 0, tpi * hs, part.data(), m, f, hs);
        timed(st_tp, got.size() * 4.0, [&] {
          NCCL(ncclAllGather(part.data(), got.data(), part.size(), ncclFloat, tpc, stream));
        });
        for (int t = 0; t < o.tp; t++)
          for (int i = 0; i < m; i++)
            for (int j = 0; j < hs; j++) y[i * h + t * hs + j] = got[(t * m + i) * hs + j];
      }
      clamp_exact(y, o.exact);
      x = y;
    }
    if (stage + 1 < o.pp) {
      timed(st_pp, x.size() * 4.0, [&] {
        NCCL(ncclSend(x.data(), x.size(), ncclFloat, stage + 1, ppc, stream));
      });
    } else {
      outputs.push_back(x);
    }
  }
  double t_all = now() - t_start;

  // The last stage's first tensor-parallel rank hands its outputs to rank 0, which checks them.
  int last = world_rank(o.pp - 1, 0);
  double maxdiff = 0, tol = o.exact ? 0.0 : 1e-3 * o.layers;
  if (rank == last && rank != 0)
    for (auto& out : outputs) NCCL(ncclSend(out.data(), out.size(), ncclFloat, 0, world, stream));
  if (rank == 0) {
    std::vector<float> got(static_cast<size_t>(m) * h);
    for (int k = 0; k < o.microbatches; k++) {
      if (last != 0) NCCL(ncclRecv(got.data(), got.size(), ncclFloat, last, world, stream));
      else got = outputs[k];
      std::vector<float> want = input(o, k);
      for (int l = 0; l < o.layers; l++) want = reference_layer(o, all[l], want);
      for (size_t i = 0; i < want.size(); i++)
        maxdiff = std::max(maxdiff, static_cast<double>(std::fabs(want[i] - got[i])));
    }
  }
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
