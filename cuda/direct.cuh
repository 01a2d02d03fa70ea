// The direct all-reduce's element loop (`oxccl_direct4` / `oxccl_direct16` in runner.cu), apart
// so that tests/cuda_arith.rs runs it on the host (with reduce.cuh's host definitions), thread
// by thread, against the host executor's reductions.
//
// An all-reduce of every rank of one communicator on this device, all in one launch (see
// `src/exec/cuda/direct.rs`): lane k is rank k's one program of one LOCAL_REDUCE step over its
// own input (src) and output (dst), with its own reduction. Each element is reduced across the
// ranks in rank order, y = finish(op(prep_{n-1}(x_{n-1}), ... op(prep_1(x_1), prep_0(x_0)))),
// and written to every rank's output: n inputs read and n outputs written once, the least an
// all-reduce of n ranks sharing one memory can move. One thread reads and writes each element,
// so in-place buffers need no barrier. Every block takes a share of the elements.
#ifndef __CUDACC__
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
#endif

#define OX_DIRECT_MAX 16
#ifdef __CUDACC__
#define OX_UNROLL _Pragma("unroll")
#else
#define OX_UNROLL
#endif

// 16 bytes of elements of dtype DT.
template <int DT>
union OxPack {
  uint4 v;
  typename OxDt<DT>::S e[16 / sizeof(typename OxDt<DT>::S)];
};

// Up to M ranks (registers for M packs per element pack; U element packs in flight per thread):
// the n inputs `src` reduced into each of the `nd` outputs `dst`.
template <int DT, int M, int U>
__device__ __forceinline__ void direct_typed(const uint8_t* const* src, uint8_t* const* dst,
                                             const OxRed* red, int n, int nd, uint64_t count,
                                             size_t tid, size_t nt) {
  typedef typename OxDt<DT>::S S;
  const int K = 16 / sizeof(S);
  uintptr_t al = 0;
  for (int k = 0; k < n; k++) al |= (uintptr_t)src[k];
  for (int k = 0; k < nd; k++) al |= (uintptr_t)dst[k];
  uint64_t head = 0;
  // 16 bytes at a time for 4- and 8-byte types (as `reduce_typed`; not compiled for narrower
  // ones, whose unrolled conversions cost NVRTC minutes). Loops run to constant bounds (with
  // guards), so that the packs stay in registers; all loads of U packs are issued before their
  // arithmetic.
  if constexpr (sizeof(S) >= 4) {
    if ((al & 15) == 0) {
      const uint64_t np = count / K;
      for (uint64_t i0 = tid; i0 < np; i0 += U * nt) {
        OxPack<DT> x[U][M];
OX_UNROLL
        for (int u = 0; u < U; u++) {
          const uint64_t i = i0 + u * nt;
OX_UNROLL
          for (int k = 0; k < M; k++)
            if (k < n && i < np) x[u][k].v = ((const uint4*)src[k])[i];
        }
OX_UNROLL
        for (int u = 0; u < U; u++) {
          const uint64_t i = i0 + u * nt;
          if (i >= np) break;
          OxPack<DT> acc;
OX_UNROLL
          for (int j = 0; j < K; j++) acc.e[j] = ox_prep<DT>(x[u][0].e[j], red[0]);
OX_UNROLL
          for (int k = 1; k < M; k++) {
            if (k < n) {
OX_UNROLL
              for (int j = 0; j < K; j++)
                acc.e[j] = ox_combine<DT>(x[u][k].e[j], acc.e[j], red[k]);
            }
          }
OX_UNROLL
          for (int j = 0; j < K; j++) acc.e[j] = ox_finish<DT>(acc.e[j], red[0]);
          for (int k = 0; k < nd; k++) ((uint4*)dst[k])[i] = acc.v;
        }
      }
      head = np * K;
    }
  }
  for (uint64_t i = head + tid; i < count; i += nt) {
    S acc = ox_prep<DT>(((const S*)src[0])[i], red[0]);
    for (int k = 1; k < n; k++) acc = ox_combine<DT>(((const S*)src[k])[i], acc, red[k]);
    acc = ox_finish<DT>(acc, red[0]);
    for (int k = 0; k < nd; k++) ((S*)dst[k])[i] = acc;
  }
}

