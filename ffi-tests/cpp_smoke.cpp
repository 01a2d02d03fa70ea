// C++17 use of nccl.h: the declarations must have C linkage (this links against -lnccl, so a
// mangled name would fail at link time) and the header must be valid C++.
#include <nccl.h>

#include <cstdio>
#include <cstdlib>
#include <thread>
#include <type_traits>
#include <vector>

static_assert(std::is_same<decltype(&ncclAllReduce),
                           ncclResult_t (*)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t,
                                            ncclComm_t, cudaStream_t)>::value,
              "ncclAllReduce signature");
static_assert(sizeof(ncclUniqueId) == 128, "ncclUniqueId is 128 bytes");

#define CHECK(cmd)                                                                              \
  do {                                                                                          \
    ncclResult_t r_ = (cmd);                                                                    \
    if (r_ != ncclSuccess) {                                                                    \
      std::fprintf(stderr, "FAIL %s:%d %s -> %s: %s\n", __FILE__, __LINE__, #cmd,               \
                   ncclGetErrorString(r_), ncclGetLastError(nullptr));                          \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

int main() {
  int version = 0;
  CHECK(ncclGetVersion(&version));
  if (version != NCCL_VERSION_CODE) {
    std::fprintf(stderr, "FAIL version %d != %d\n", version, NCCL_VERSION_CODE);
    return 1;
  }
  constexpr int nranks = 2;
  constexpr size_t count = 1 << 16;
  ncclUniqueId id;
  CHECK(ncclGetUniqueId(&id));
  std::vector<std::vector<double>> out(nranks, std::vector<double>(count, -1.0));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < nranks; rank++) {
    threads.emplace_back([&, rank] {
      ncclComm_t comm = nullptr;
      CHECK(ncclCommInitRank(&comm, nranks, id, rank));
      std::vector<double> in(count);
      for (size_t i = 0; i < count; i++) in[i] = double(rank + 1) * double(i % 1024);
      CHECK(ncclAllReduce(in.data(), out[rank].data(), count, ncclDouble, ncclSum, comm, nullptr));
      CHECK(ncclCommDestroy(comm));
    });
  }
  for (auto& t : threads) t.join();
  for (int rank = 0; rank < nranks; rank++)
    for (size_t i = 0; i < count; i++)
      if (out[rank][i] != 3.0 * double(i % 1024)) {
        std::fprintf(stderr, "FAIL rank %d [%zu] = %g, expected %g\n", rank, i, out[rank][i],
                     3.0 * double(i % 1024));
        return 1;
      }
  std::printf("cpp_smoke: 2-rank allreduce OK\n");
  return 0;
}
