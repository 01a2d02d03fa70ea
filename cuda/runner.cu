// The CUDA executor's kernels: the program runner (one block per lane runs the lane's step
// programs over connections, slice by slice, exactly as the host executor's `exec/host/steps.rs`
// does on the CPU) and a wide kernel for work that touches no connection.
//
// A launch's work arrives by value as the kernel parameter (a flat descriptor, laid out by
// `src/exec/cuda/desc.rs`): nothing outside the launch refers to host memory the caller may
// reuse, and a CUDA graph that captured the launch replays it unchanged. Each kernel has a twin
// (`_large`) whose parameter takes OX_PARAM_BYTES_LARGE, for launches whose descriptor is larger
// than OX_PARAM_BYTES (CUDA 12.1 and later, sm_70 and later; compiled in where OX_LARGE is set). The connections'
// counters and slots live in the connection regions (pinned host memory mapped into the device,
// or device memory), whose state (monotonic counters) carries over from launch to launch and
// from replay to replay.
//
// Connection region layout (`src/transport/mod.rs`): tail (u64) at 0, head (u64) at 64, attach
// count (u32) at 128, which ends have closed (u32, the host's only) at 192, per slot (call word
// 0, call word 1, bytes) as u64 at 1024 + 24 * slot; slot data at `slots + slot * slot_bytes`.
// A slot whose bytes word has OX_REF_FLAG holds no data but, in its first 8 bytes, the address
// of the sender's memory that holds it (`OX_STEP_REF_*`); the receiving blocks' claims on that
// memory (u32) are at 256, and whether the sender revoked its slots (u32) at 320 (`ox_revoke`).

#include "reduce.cuh"
#include "direct.cuh"

#define OX_THREADS 512
#define OX_PARAM_BYTES 4000

enum OxPrim {
  P_SEND = 0,
  P_RECV = 1,
  P_COPY_SEND = 2,
  P_RECV_COPY_SEND = 3,
  P_RECV_REDUCE_SEND = 4,
  P_RECV_REDUCE_COPY = 5,
  P_RECV_REDUCE_COPY_SEND = 6,
  P_LOCAL_COPY = 7,
  P_LOCAL_REDUCE = 8,
};

struct OxConnD {  // 32 bytes
  uint64_t hdr;
  uint64_t slots;
  uint32_t nsteps;
  uint32_t slot_bytes;
  // What a step sending by reference on it adds to the address it posts: where the receiver,
  // a kernel of another process, sees the memory (0 in this process).
  int64_t ref_delta;
};
// Programs and steps in the plan's flat form (`FlatProgram`, `FlatStep`, `FlatRed`,
// `FlatAddr` of `src/plan/encode.rs`).
struct OxAddr {  // kind 0 none, 1 address `at`
  uint32_t kind, idx;
  uint64_t at;
};
struct OxStepD {  // 56 bytes
  uint32_t prim, prep;  // prep: OX_STEP_* flags
  uint32_t send, recv;  // connection index, or OX_NONE
  OxAddr src, dst;
  uint64_t len;
};
// kind: 0 none, 1 ready (flags bit 0: premul in `scalar`, bit 1: `postdiv`), 2 PreMulSum with
// the scalar's bits in `scalar`, 3 PreMulSum with the scalar at device address `scalar`.
struct OxRedD {  // 32 bytes
  uint32_t kind;
  int32_t dtype;
  uint32_t op, flags;
  uint64_t scalar, postdiv;
};
struct OxProgD {  // 80 bytes
  uint32_t first_step, nsteps;
  uint64_t esize, slice, niter;
  OxRedD red;
  uint64_t call0, call1;
};
#define OX_NONE 0xffffffffu
// A step's `prep` flags. PREP: a send applies the reduction's pre-multiplication. REF_SRC /
// REF_DST: the step sends its slices by reference, the address of its source (REF_SRC) or of
// its destination once written (REF_DST) in place of the bytes, for a receiver that reads this
// memory (a kernel of this process, or of another process on this GPU that opened it: the address
// as it sees it, the connection's `ref_delta` added) (`src/exec/cuda/desc.rs`: `mark_refs`, which
// says when); the program then
// waits at its end until the receiver has taken every slot (`ox_drain`).
#define OX_STEP_PREP 1u
#define OX_STEP_REF_SRC 2u
#define OX_STEP_REF_DST 4u
// Beside REF_SRC or REF_DST: the receiver is a kernel of another process (`ox_revoke`).
#define OX_STEP_REF_PEER 8u
#define OX_REF_FLAG (1ull << 63)
#define OX_REF_CLAIMS 256
#define OX_REF_REVOKED 320
struct OxHeadD {  // 16 bytes
  uint64_t reserved;
  uint16_t nconns, nprogs, nsteps, nlanes;
};
// The header's `reserved`: the blocks per lane (low 16 bits), and this flag for a launch captured
// into a CUDA graph, which may be replayed after its communicator ended: its blocks look at the
// control block before anything else and return at once where it says stop (the connections
// may be freed by then).
#define OX_HEAD_CAPTURED (1ull << 16)
// And this flag where every connection of the launch has both ends on this GPU and the host
// asked for it (`OXCCL_CUDA_FENCE=gpu`): the fences that publish and take a step's slots are
// device-scope, not system-scope (nothing off the GPU reads those counters or slots).
#define OX_HEAD_GPU_FENCES (1ull << 17)
struct OxLaneD {  // 24 bytes
  uint16_t first_prog, nprogs;
  uint16_t brank, bn;  // a board lane's rank and its communicator's ranks
  uint64_t ctl;        // the lane's communicator's control block (OxCtl)
  uint64_t board;      // 0, or a board lane's device board (`ox_board`)
};
// The communicator's control block (pinned host memory): the host sets `abort`; a kernel that
// stops on an error says why in `err` and `info`; a kernel that waits for a peer says so now
// and then in `wait_conn` (the connection's header) and `wait_mark` (a value that changes while
// it waits), which is how the host's watcher knows which peer a running kernel, launched
// eagerly or replayed from a graph, waits for.
struct OxCtl {
  uint32_t abort;
  uint32_t err;
  uint64_t info[6];
  uint64_t wait_conn;
  uint64_t wait_mark;
  uint64_t wait_step;  // the step of wait_conn a kernel waits for (~0: its peer's attach)
};
static_assert(sizeof(OxConnD) == 32, "OxConnD layout");
static_assert(sizeof(OxStepD) == 56, "OxStepD layout");
static_assert(sizeof(OxProgD) == 80, "OxProgD layout");
static_assert(sizeof(OxHeadD) == 16, "OxHeadD layout");
static_assert(sizeof(OxLaneD) == 24, "OxLaneD layout");
static_assert(sizeof(OxCtl) == 80, "OxCtl layout");
#define OX_PARAM_BYTES_LARGE 32760
struct OxParams {
  uint64_t words[OX_PARAM_BYTES / 8];
};
struct OxParamsLarge {
  uint64_t words[OX_PARAM_BYTES_LARGE / 8];
};

enum {
  OX_ERR_NONE = 0,
  OX_ERR_CALL = 1,
  OX_ERR_ABORT = 2,
  OX_ERR_BOARD_CALL = 3,
  OX_ERR_BOARD_LEFT = 4,
  OX_ERR_REF_REVOKED = 5
};

// OX_SPIN: what a read of a counter may also do. Nothing on a GPU; the host emulation of the
// kernels (tests/cuda_emu) lets other blocks, which are threads there, have the cores.
#ifndef OX_SPIN
#define OX_SPIN()
#endif
// OX_TOOK_REF: what a receiver taking a slot by reference also does (the host emulation counts).
#ifndef OX_TOOK_REF
#define OX_TOOK_REF()
#endif
__device__ __forceinline__ uint64_t ld_vol64(const uint64_t* p) {
  OX_SPIN();
  return *(const volatile uint64_t*)p;
}
__device__ __forceinline__ uint32_t ld_vol32(const uint32_t* p) {
  OX_SPIN();
  return *(const volatile uint32_t*)p;
}
__device__ __forceinline__ void st_vol64(uint64_t* p, uint64_t v) {
  *(volatile uint64_t*)p = v;
}

// A load of FIFO slot data that sees what the peer wrote since this block last read the same
// address (slots are reused: an L1 line left from an earlier pass would be stale). It bypasses
// L1 (ld.global.cg) but is an ordinary load the compiler may batch; the counter read before it
// was followed by a fence (`ox_step_fence`: system-scope, or device-scope where every
// connection is on this GPU).
template <typename T>
__device__ __forceinline__ T ld_fresh(const T* p) {
#ifndef __CUDA_ARCH__
  // The host emulation (tests/cuda_emu): no L1 to bypass; the fence after the counter's read
  // orders this load.
  T t;
  memcpy(&t, p, sizeof(T));
  return t;
#else
  if (sizeof(T) == 1) {
    unsigned short v;
    asm volatile("ld.global.cg.u8 %0, [%1];" : "=h"(v) : "l"(p));
    return (T)v;
  } else if (sizeof(T) == 2) {
    unsigned short v;
    asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
    T t;
    memcpy(&t, &v, 2);
    return t;
  } else if (sizeof(T) == 4) {
    unsigned int v;
    asm volatile("ld.global.cg.u32 %0, [%1];" : "=r"(v) : "l"(p));
    T t;
    memcpy(&t, &v, 4);
    return t;
  } else {
    unsigned long long v;
    asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(v) : "l"(p));
    T t;
    memcpy(&t, &v, 8);
    return t;
  }
#endif
}
__device__ __forceinline__ uint4 ld_fresh(const uint4* p) {
  uint4 v;
#ifndef __CUDA_ARCH__
  memcpy(&v, p, sizeof v);
#else
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
#endif
  return v;
}

// Connections one launch may use with several blocks per lane (more fall back to one).
#define OX_MAX_CONNS 64

struct OxShared {
  const uint8_t* in;
  uint8_t* out;
  unsigned* claim;  // the claims word of the connection the block reads a referred slice of
  uint64_t rstep, sstep;
  int stop;
  OxRed red;
  // Per connection of the launch: the next step this block sends or receives on it (read
  // from the counters at the block's first use, then counted here: with several blocks per
  // lane the counters move only when the last block of a step is done); the other end's
  // counter as last read (its tail for a receive, its head for a send: both only grow, so a
  // step they already cover needs no read, which saves a trip to host or peer memory); and
  // which of these are known (OX_KNOWN_*).
  uint64_t next[OX_MAX_CONNS];
  uint64_t seen[OX_MAX_CONNS];
  uint8_t known[OX_MAX_CONNS];
};
#define OX_KNOWN_NEXT 1
#define OX_KNOWN_SEEN 2
#define OX_KNOWN_ATTACHED 4

// Thread 0, every 1024th read of a counter it waits on (connection header `hdr`): tells the
// host which connection it waits for, with a mark (the block and how long this wait has
// lasted: it keeps changing while the block waits; a short wait may leave the value an
// earlier one did, which only delays the host's look by one turn), and whether it must stop
// (abort). The connection is visible to the host before the mark.
__device__ __forceinline__ bool ox_still_waits(OxCtl* ctl, uint64_t hdr, uint64_t step,
                                               unsigned spins) {
  st_vol64(&ctl->wait_conn, hdr);
  st_vol64(&ctl->wait_step, step);
  __threadfence_system();
  st_vol64(&ctl->wait_mark, ((uint64_t)(blockIdx.x + 1) << 32) | spins);
  return ld_vol32(&ctl->abort) == 0;
}

// ---- element loops (all threads of the block; `tid`/`nt` the thread's place) ----

__device__ __forceinline__ void copy_bytes(uint8_t* d0, uint8_t* d1, const uint8_t* s, size_t bytes,
                                           bool fresh, int tid, int nt) {
  // Vectorised when every pointer is 16-byte aligned.
  uintptr_t al = (uintptr_t)s | (uintptr_t)d0 | (uintptr_t)d1;
  size_t done = 0;
  if ((al & 15) == 0) {
    size_t nv = bytes / 16;
    const uint4* sv = (const uint4*)s;
    uint4* v0 = (uint4*)d0;
    uint4* v1 = (uint4*)d1;
    size_t i = tid;
    // Four loads in flight per thread.
    if (!fresh) {
      for (; i + 3 * (size_t)nt < nv; i += 4 * (size_t)nt) {
        uint4 a = sv[i], b = sv[i + nt], c = sv[i + 2 * nt], d = sv[i + 3 * nt];
        if (v0) { v0[i] = a; v0[i + nt] = b; v0[i + 2 * nt] = c; v0[i + 3 * nt] = d; }
        if (v1) { v1[i] = a; v1[i + nt] = b; v1[i + 2 * nt] = c; v1[i + 3 * nt] = d; }
      }
    } else {
      for (; i + 3 * (size_t)nt < nv; i += 4 * (size_t)nt) {
        uint4 a = ld_fresh(sv + i), b = ld_fresh(sv + i + nt), c = ld_fresh(sv + i + 2 * nt),
              d = ld_fresh(sv + i + 3 * nt);
        if (v0) { v0[i] = a; v0[i + nt] = b; v0[i + 2 * nt] = c; v0[i + 3 * nt] = d; }
        if (v1) { v1[i] = a; v1[i + nt] = b; v1[i + 2 * nt] = c; v1[i + 3 * nt] = d; }
      }
    }
    for (; i < nv; i += nt) {
      uint4 x = fresh ? ld_fresh(sv + i) : sv[i];
      if (v0) v0[i] = x;
      if (v1) v1[i] = x;
    }
    done = nv * 16;
  } else if ((al & 3) == 0) {
    size_t nw = bytes / 4;
    const uint32_t* sw = (const uint32_t*)s;
    uint32_t* w0 = (uint32_t*)d0;
    uint32_t* w1 = (uint32_t*)d1;
    for (size_t i = tid; i < nw; i += nt) {
      uint32_t x = fresh ? ld_fresh(sw + i) : sw[i];
      if (w0) w0[i] = x;
      if (w1) w1[i] = x;
    }
    done = nw * 4;
  }
  for (size_t i = done + tid; i < bytes; i += nt) {
    uint8_t x = fresh ? ld_fresh(s + i) : s[i];
    if (d0) d0[i] = x;
    if (d1) d1[i] = x;
  }
}

// One primitive's element function (PRIM fixed at compile time).
template <int DT, int PRIM>
__device__ __forceinline__ typename OxDt<DT>::S ox_elem(typename OxDt<DT>::S a,
                                                       typename OxDt<DT>::S b, const OxRed& r) {
  if (PRIM == P_SEND) return ox_prep<DT>(a, r);
  if (PRIM == P_LOCAL_REDUCE) return ox_finish<DT>(ox_prep<DT>(a, r), r);
  if (PRIM == P_RECV_REDUCE_SEND) return ox_combine<DT>(a, b, r);
  return ox_finish<DT>(ox_combine<DT>(a, b, r), r);
}

// 16-byte packs of a primitive: loads batched, elements in a short loop.
template <int DT, int PRIM>
__device__ __forceinline__ void reduce_packs(const uint4* sv, const uint4* iv, uint4* dv,
                                             uint4* ov, size_t np, const OxRed& r, int tid,
                                             int nt) {
  const int K = 16 / sizeof(typename OxDt<DT>::S);
  const bool recv = PRIM != P_SEND && PRIM != P_LOCAL_REDUCE;
  for (size_t i = tid; i < np; i += nt) {
    OxPack<DT> a, b, y;
    a.v = sv[i];
    b.v = recv ? ld_fresh(iv + i) : a.v;
#pragma unroll 4
    for (int j = 0; j < K; j++) y.e[j] = ox_elem<DT, PRIM>(a.e[j], b.e[j], r);
    if (PRIM == P_SEND || PRIM == P_RECV_REDUCE_SEND || PRIM == P_RECV_REDUCE_COPY_SEND)
      ov[i] = y.v;
    if (PRIM != P_SEND && PRIM != P_RECV_REDUCE_SEND) dv[i] = y.v;
  }
}

// The reducing primitives over `n` elements of dtype DT: 16 bytes at a time where every
// pointer allows it (4- and 8-byte types), then element by element.
template <int DT>
__device__ __forceinline__ void reduce_typed(int prim, bool prep, const uint8_t* src0,
                                             const uint8_t* in0, uint8_t* dst0, uint8_t* out0,
                                             size_t n, const OxRed& r, int tid, int nt) {
  typedef typename OxDt<DT>::S S;
  const int K = 16 / sizeof(S);
  uintptr_t al = (uintptr_t)src0 | (uintptr_t)in0 | (uintptr_t)dst0 | (uintptr_t)out0;
  size_t head = 0;
  // Packs for 4- and 8-byte types (for narrower ones the conversions dominate, and unrolling
  // them costs minutes of NVRTC compile time).
  if (sizeof(S) >= 4 && (al & 15) == 0) {
    size_t np = n / K;
    const uint4* sv = (const uint4*)src0;
    const uint4* iv = (const uint4*)in0;
    uint4* dv = (uint4*)dst0;
    uint4* ov = (uint4*)out0;
    switch (prim) {
      case P_SEND: reduce_packs<DT, P_SEND>(sv, iv, dv, ov, np, r, tid, nt); break;
      case P_LOCAL_REDUCE: reduce_packs<DT, P_LOCAL_REDUCE>(sv, iv, dv, ov, np, r, tid, nt); break;
      case P_RECV_REDUCE_SEND:
        reduce_packs<DT, P_RECV_REDUCE_SEND>(sv, iv, dv, ov, np, r, tid, nt);
        break;
      case P_RECV_REDUCE_COPY:
        reduce_packs<DT, P_RECV_REDUCE_COPY>(sv, iv, dv, ov, np, r, tid, nt);
        break;
      default: reduce_packs<DT, P_RECV_REDUCE_COPY_SEND>(sv, iv, dv, ov, np, r, tid, nt); break;
    }
    head = np * K;
  }
  const S* src = (const S*)src0 + head;
  const S* in = in0 ? (const S*)in0 + head : nullptr;
  S* dst = dst0 ? (S*)dst0 + head : nullptr;
  S* out = out0 ? (S*)out0 + head : nullptr;
  n -= head;
  switch (prim) {
    case P_SEND:  // prep only (a plain send is a copy)
      for (size_t i = tid; i < n; i += nt) out[i] = ox_prep<DT>(src[i], r);
      break;
    case P_RECV_REDUCE_SEND:
      for (size_t i = tid; i < n; i += nt) out[i] = ox_combine<DT>(src[i], ld_fresh(in + i), r);
      break;
    case P_RECV_REDUCE_COPY:
      for (size_t i = tid; i < n; i += nt)
        dst[i] = ox_finish<DT>(ox_combine<DT>(src[i], ld_fresh(in + i), r), r);
      break;
    case P_RECV_REDUCE_COPY_SEND:
      for (size_t i = tid; i < n; i += nt) {
        S v = ox_finish<DT>(ox_combine<DT>(src[i], ld_fresh(in + i), r), r);
        dst[i] = v;
        out[i] = v;
      }
      break;
    case P_LOCAL_REDUCE:
      for (size_t i = tid; i < n; i += nt) dst[i] = ox_finish<DT>(ox_prep<DT>(src[i], r), r);
      break;
  }
  (void)prep;
}

__device__ void reduce_any(int prim, bool prep, const uint8_t* src, const uint8_t* in,
                           uint8_t* dst, uint8_t* out, size_t n, const OxRed& r, int tid,
                           int nt) {
  switch (r.dtype) {
#define OX_CASE(d) \
  case d: reduce_typed<d>(prim, prep, src, in, dst, out, n, r, tid, nt); break;
    OX_CASE(0) OX_CASE(1) OX_CASE(2) OX_CASE(3) OX_CASE(4) OX_CASE(5)
    OX_CASE(6) OX_CASE(7) OX_CASE(8) OX_CASE(9) OX_CASE(10) OX_CASE(11)
#undef OX_CASE
  }
}

// One primitive over one slice (all threads).
__device__ __forceinline__ void run_prim(uint32_t prim, bool prep, const OxProgD& p,
                                         const OxRed& r, const uint8_t* src, uint8_t* dst,
                                         const uint8_t* in, uint8_t* out, size_t n, int tid,
                                         int nt) {
  size_t bytes = n * p.esize;
  switch (prim) {
    case P_SEND:
      if (prep && r.has_premul)
        reduce_any(P_SEND, true, src, nullptr, nullptr, out, n, r, tid, nt);
      else
        copy_bytes(out, nullptr, src, bytes, false, tid, nt);
      break;
    case P_RECV: copy_bytes(dst, nullptr, in, bytes, true, tid, nt); break;
    case P_COPY_SEND: copy_bytes(out, dst, src, bytes, false, tid, nt); break;
    case P_RECV_COPY_SEND: copy_bytes(out, dst, in, bytes, true, tid, nt); break;
    case P_LOCAL_COPY: copy_bytes(dst, nullptr, src, bytes, false, tid, nt); break;
    case P_LOCAL_REDUCE:
      // One rank's reduction: a copy unless scaled.
      if (!r.has_premul && r.postdiv <= 1)
        copy_bytes(dst, nullptr, src, bytes, false, tid, nt);
      else
        reduce_any(prim, prep, src, in, dst, out, n, r, tid, nt);
      break;
    default: reduce_any(prim, prep, src, in, dst, out, n, r, tid, nt); break;
  }
}

// What a step that sends by reference does itself: its primitive without the send (OX_NONE:
// nothing, for a plain send).
__device__ __forceinline__ uint32_t ox_unsent(uint32_t prim) {
  switch (prim) {
    case P_COPY_SEND: return P_LOCAL_COPY;
    case P_RECV_COPY_SEND: return P_RECV;
    case P_RECV_REDUCE_COPY_SEND: return P_RECV_REDUCE_COPY;
    default: return OX_NONE;
  }
}

struct OxView {
  const OxHeadD* h;
  const OxConnD* conns;
  const OxProgD* progs;
  const OxStepD* steps;
  const OxLaneD* lanes;
};

__device__ __forceinline__ OxView ox_view(const uint64_t* words) {
  OxView v;
  const uint8_t* b = (const uint8_t*)words;
  v.h = (const OxHeadD*)b;
  v.conns = (const OxConnD*)(b + sizeof(OxHeadD));
  v.progs = (const OxProgD*)((const uint8_t*)v.conns + sizeof(OxConnD) * v.h->nconns);
  v.steps = (const OxStepD*)((const uint8_t*)v.progs + sizeof(OxProgD) * v.h->nprogs);
  v.lanes = (const OxLaneD*)((const uint8_t*)v.steps + sizeof(OxStepD) * v.h->nsteps);
  return v;
}

// Stops the kernel with an error (thread 0): the host reads it from the control block. The
// first block to fail claims `err` (OX_ERR_CLAIMED, which the host reads as no error yet),
// writes the details, and only then the code, so the host never sees a code with stale details.
#define OX_ERR_CLAIMED 0xffffffffu
__device__ void ox_fail(OxCtl* ctl, uint32_t code, uint64_t a, uint64_t b, uint64_t c, uint64_t d,
                        uint64_t e) {
  if (atomicCAS((unsigned int*)&ctl->err, 0u, OX_ERR_CLAIMED) == 0u) {
    ctl->info[0] = a;
    ctl->info[1] = b;
    ctl->info[2] = c;
    ctl->info[3] = d;
    ctl->info[4] = e;
    ctl->info[5] = blockIdx.x;
    __threadfence_system();
    *(volatile uint32_t*)&ctl->err = code;
    __threadfence_system();
  }
}

// Where a connection header keeps the arrival counts of the blocks of a lane, per slot: the
// sending end's and the receiving end's (u32 each; used only with several blocks per lane,
// where headers are in device memory).
#define OX_SEND_ARRIVALS 2560
#define OX_RECV_ARRIVALS 2816

// Thread 0: the step number this block is at on connection `ci` (sender: the tail, receiver:
// the head, as they were when the block first used the connection, plus its own steps since).
__device__ __forceinline__ uint64_t ox_next(const OxConnD& c, uint32_t ci, bool send,
                                            OxShared* sh) {
  if (ci < OX_MAX_CONNS) {
    if (!(sh->known[ci] & OX_KNOWN_NEXT)) {
      sh->known[ci] |= OX_KNOWN_NEXT;
      sh->next[ci] = ld_vol64((const uint64_t*)c.hdr + (send ? 0 : 8));
    }
    return sh->next[ci];
  }
  return ld_vol64((const uint64_t*)c.hdr + (send ? 0 : 8));
}

// The fence that orders a step's slots and counters: device-scope where every connection of
// the launch is on this GPU (`OX_HEAD_GPU_FENCES`), else system-scope.
__device__ __forceinline__ void ox_step_fence(bool gpu) {
  if (gpu) {
    __threadfence();
  } else {
    __threadfence_system();
  }
}

// Thread 0: waits for the step's slots. False when the kernel must stop (abort or error).
__device__ bool ox_wait_slots(const OxView& v, const OxStepD& s, const OxProgD& p, OxCtl* ctl,
                              OxShared* sh, bool gpu) {
  unsigned spins = 0;
  sh->in = nullptr;
  sh->out = nullptr;
  sh->claim = nullptr;
  const uint8_t* referred = nullptr;
  if (s.recv != OX_NONE) {
    const OxConnD& c = v.conns[s.recv];
    uint64_t* hdr = (uint64_t*)c.hdr;
    uint64_t head = ox_next(c, s.recv, false, sh);
    const bool cached = s.recv < OX_MAX_CONNS;
    const bool arrived = cached && (sh->known[s.recv] & OX_KNOWN_SEEN) && sh->seen[s.recv] > head;
    if (!arrived) {
      uint64_t tail;
      while ((tail = ld_vol64(hdr)) <= head) {
        if ((++spins & 1023) == 0 && !ox_still_waits(ctl, c.hdr, head, spins)) return false;
      }
      if (cached) {
        sh->seen[s.recv] = tail;
        sh->known[s.recv] |= OX_KNOWN_SEEN;
      }
    }
    ox_step_fence(gpu);
    uint64_t idx = head % c.nsteps;
    const uint64_t* meta = (const uint64_t*)(c.hdr + 1024 + 24 * idx);
    uint64_t t0 = ld_vol64(meta), t1 = ld_vol64(meta + 1);
    if (t0 != p.call0 || t1 != p.call1) {
      ox_fail(ctl, OX_ERR_CALL, (uint64_t)s.recv, t0, t1, p.call0, p.call1);
      return false;
    }
    // (The slot, or the sender's memory it refers to.)
    const uint8_t* slot = (const uint8_t*)(c.slots + idx * c.slot_bytes);
    if (ld_vol64(meta + 2) & OX_REF_FLAG) {
      referred = (const uint8_t*)ld_vol64((const uint64_t*)slot);
    } else {
      sh->in = slot;
    }
    sh->rstep = head;
  }
  if (s.send != OX_NONE) {
    const OxConnD& c = v.conns[s.send];
    uint64_t* hdr = (uint64_t*)c.hdr;
    const bool cached = s.send < OX_MAX_CONNS;
    if (!(cached && (sh->known[s.send] & OX_KNOWN_ATTACHED))) {
      while (ld_vol32((const uint32_t*)(c.hdr + 128)) < 2) {
        if ((++spins & 1023) == 0 && !ox_still_waits(ctl, c.hdr, ~0ull, spins)) return false;
      }
      if (cached) sh->known[s.send] |= OX_KNOWN_ATTACHED;
    }
    uint64_t tail = ox_next(c, s.send, true, sh);
    const bool room =
        cached && (sh->known[s.send] & OX_KNOWN_SEEN) && tail - sh->seen[s.send] < c.nsteps;
    if (!room) {
      uint64_t head;
      while (tail - (head = ld_vol64(hdr + 8)) >= c.nsteps) {
        if ((++spins & 1023) == 0 && !ox_still_waits(ctl, c.hdr, tail, spins)) return false;
      }
      // The head just read says the peer has read the slot: the fence orders that read
      // before the block's writes into the slot (an acquire; the peer fenced before it
      // published the head). A head seen before was followed by `ox_post`'s fence.
      ox_step_fence(gpu);
      if (cached) {
        sh->seen[s.send] = head;
        sh->known[s.send] |= OX_KNOWN_SEEN;
      }
    }
    sh->out = (uint8_t*)(c.slots + (tail % c.nsteps) * c.slot_bytes);
    sh->sstep = tail;
  }
  if (referred) {
    // The sender's memory: claimed (released once the block has read its share, in
    // `ox_run`), unless the sender's kernel stopped and revoked its slots (`ox_revoke`): a
    // claim made before the revocation is seen by it, which waits for its release.
    const OxConnD& c = v.conns[s.recv];
    unsigned* claims = (unsigned*)(c.hdr + OX_REF_CLAIMS);
    atomicAdd(claims, 1u);
    __threadfence();
    if (ld_vol32((const uint32_t*)(c.hdr + OX_REF_REVOKED)) != 0) {
      atomicAdd(claims, ~0u);
      ox_fail(ctl, OX_ERR_REF_REVOKED, (uint64_t)s.recv, 0, 0, 0, 0);
      return false;
    }
    sh->claim = claims;
    sh->in = referred;
    OX_TOOK_REF();
  }
  return true;
}

// Thread 0, after the block's part of a step: counts the block in (with `nb` blocks per lane)
// and, if it is the last, publishes the step (head for the receive, metadata and tail for the
// send; `ref` not 0: the slot refers to the slice's bytes there). The block's writes were made
// visible before it counts itself in.
__device__ void ox_post(const OxView& v, const OxStepD& s, const OxProgD& p, OxShared* sh,
                        uint64_t bytes, uint32_t nb, bool gpu, uint64_t ref) {
  ox_step_fence(gpu);
  if (s.recv != OX_NONE) {
    const OxConnD& c = v.conns[s.recv];
    bool last = true;
    if (nb > 1) {
      unsigned* arr = (unsigned*)(c.hdr + OX_RECV_ARRIVALS) + sh->rstep % c.nsteps;
      last = atomicAdd(arr, 1u) == nb - 1;
      if (last) {
        atomicExch(arr, 0u);
        // The other blocks counted themselves in (device-scope atomics) after their fences:
        // the last block's own fence at the step's scope carries what they read to a sender
        // on another GPU or the host before the head that frees their slots.
        ox_step_fence(gpu);
      }
    }
    if (last) st_vol64((uint64_t*)c.hdr + 8, sh->rstep + 1);
    if (s.recv < OX_MAX_CONNS) sh->next[s.recv] = sh->rstep + 1;
  }
  if (s.send != OX_NONE) {
    const OxConnD& c = v.conns[s.send];
    bool last = true;
    if (nb > 1) {
      unsigned* arr = (unsigned*)(c.hdr + OX_SEND_ARRIVALS) + sh->sstep % c.nsteps;
      last = atomicAdd(arr, 1u) == nb - 1;
      if (last) {
        atomicExch(arr, 0u);
        __threadfence();
      }
    }
    if (last) {
      uint64_t* meta = (uint64_t*)(c.hdr + 1024 + 24 * (sh->sstep % c.nsteps));
      if (ref) {
        st_vol64((uint64_t*)(c.slots + (sh->sstep % c.nsteps) * c.slot_bytes), ref);
        bytes |= OX_REF_FLAG;
      }
      st_vol64(meta, p.call0);
      st_vol64(meta + 1, p.call1);
      st_vol64(meta + 2, bytes);
      ox_step_fence(gpu);
      st_vol64((uint64_t*)c.hdr, sh->sstep + 1);
    }
    if (s.send < OX_MAX_CONNS) sh->next[s.send] = sh->sstep + 1;
  }
}

// The step's OX_STEP_REF_* flag, where it sends by reference; 0 where it does not.
__device__ __forceinline__ uint32_t ox_byref(const OxStepD& s) {
  return s.send != OX_NONE ? s.prep & (OX_STEP_REF_SRC | OX_STEP_REF_DST) : 0;
}

// Thread 0, at the end of a program with steps that sent by reference (OX_STEP_REF_*): waits
// until the receivers have taken every slot the block sent on those steps' connections, so
// that nothing reads the memory the slots refer to once the kernel ends. False when the
// kernel must stop (abort or error): `ox_revoke` then.
__device__ bool ox_drain(const OxView& v, const OxProgD& p, OxCtl* ctl, OxShared* sh) {
  unsigned spins = 0;
  for (uint32_t k = 0; k < p.nsteps; k++) {
    const OxStepD& s = v.steps[p.first_step + k];
    if (!ox_byref(s)) continue;
    const OxConnD& c = v.conns[s.send];
    const uint64_t want = ox_next(c, s.send, true, sh);
    while (ld_vol64((const uint64_t*)c.hdr + 8) < want) {
      if ((++spins & 1023) == 0 && !ox_still_waits(ctl, c.hdr, want - 1, spins)) return false;
    }
  }
  return true;
}

// Nanoseconds of a clock every block reads alike (the GPU's global timer; the host emulation
// defines OX_NOW_NS as its monotonic clock).
#ifndef OX_NOW_NS
__device__ __forceinline__ uint64_t ox_now_ns() {
#ifdef __CUDA_ARCH__
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#else
  return 0;
#endif
}
#define OX_NOW_NS() ox_now_ns()
#endif
// How long a sender that revokes its slots waits for the receivers' claims (`ox_revoke`).
#define OX_CLAIMS_WAIT_NS 10000000000ull

// Thread 0, when a program that sent slots by reference stops before its receivers took them
// all (abort, error): revokes them, then waits until no receiving block holds a claim on the
// memory they refer to (a block holds one only while it reads a slice, which ends), so that
// nothing reads that memory once the kernel ends. A receiver that comes later finds them
// revoked and stops with OX_ERR_REF_REVOKED. (Both ends are on this GPU: device scope.) A
// receiver in another process (OX_STEP_REF_PEER) that died while it held a claim never lets go:
// past OX_CLAIMS_WAIT_NS (a live one reads a slice in microseconds, or within its process's
// next time slice) the sender stops waiting for it, its communicator failed already. A
// receiver in this process is waited for as long as it takes.
__device__ void ox_revoke(const OxView& v, const OxProgD& p) {
  const uint64_t t0 = OX_NOW_NS();
  for (int pass = 0; pass < 2; pass++) {
    for (uint32_t k = 0; k < p.nsteps; k++) {
      const OxStepD& s = v.steps[p.first_step + k];
      if (!ox_byref(s)) continue;
      const uint64_t hdr = v.conns[s.send].hdr;
      if (pass == 0) {
        atomicExch((unsigned*)(hdr + OX_REF_REVOKED), 1u);
        __threadfence();
      } else {
        const bool bounded = s.prep & OX_STEP_REF_PEER;
        while (ld_vol32((const uint32_t*)(hdr + OX_REF_CLAIMS)) != 0 &&
               (!bounded || OX_NOW_NS() - t0 < OX_CLAIMS_WAIT_NS)) {
        }
      }
    }
  }
}

// Reads a PreMulSum scalar of `esize` bytes from device memory.
__device__ uint64_t ox_scalar(uint64_t addr, int esize) {
  uint64_t v = 0;
  const uint8_t* p = (const uint8_t*)addr;
  for (int i = 0; i < esize; i++) v |= (uint64_t)p[i] << (8 * i);
  return v;
}

// The reduction of a program, a device-resident PreMulSum scalar read now (as NCCL's kernels
// read it when they run).
__device__ OxRed ox_red(const OxProgD& p) {
  OxRed r;
  r.dtype = (uint32_t)p.red.dtype;
  r.kind = p.red.kind == 1 ? p.red.op : 0;
  r.pad = 0;
  r.has_premul = p.red.kind >= 2 || (p.red.kind == 1 && (p.red.flags & 1));
  r.premul_bits = p.red.kind == 3 ? ox_scalar(p.red.scalar, (int)p.esize) : p.red.scalar;
  r.postdiv = (p.red.kind == 1 && (p.red.flags & 2)) ? p.red.postdiv : 0;
  return r;
}

// ---- the device board: direct collectives across launches ----
//
// Ranks of one communicator that are all in one process on one GPU (each launching on its own
// stream, from threads of their own, say) reach each other's buffers: each rank's launch has a
// board lane, one program of one step over its own input (src) and output (dst), whose call
// words say the collective (kind, count, root: `src/plan/call.rs`), and the lanes meet on the
// communicator's board (`src/exec/cuda/board.rs`), device memory they share. The operation is
// cut into parts (`ox_board_parts`, the same on every rank) of the element indices of one
// rank's count; for each part, every rank publishes its buffers in its line and arrives, waits
// for every rank's arrival, claims every peer's buffers, does its share of the part's elements
// (`ox_board_share`: each element read once per input and written once per output, by one
// rank), lets the claims go, and arrives again; it leaves the part when every rank has, so no
// rank's launch ends while a peer may still read its input or write its output, and no line is
// written for the next operation while a peer may still read it for this one. A block of the
// lane takes the parts `part`, `part + nb`, ... in order (ranks may run their lanes with
// different numbers of blocks). Each (part, rank) line holds: the rank's arrivals at the part
// (u64; two per operation, so a rank's own count says which operation comes next: graph
// replays need no host), its input, output and call words, the claims peers hold on its
// buffers, and its reduction (OxRed).
//
// A rank whose kernel must stop inside a part (abort, a call mismatch, a peer that left) marks
// its arrivals OX_BOARD_LEFT and waits until no peer holds a claim on its buffers: a peer
// claims, then looks at the arrivals again, and lets go of a rank that left (with fences
// between, one of the two sees the other); so once the kernel ends, nothing reads or writes
// that rank's buffers any more, whatever the user then does with them. A peer that finds a
// rank left before it did its share (fewer than two arrivals at the part), or finds it left
// when it claims, stops too, with OX_ERR_BOARD_LEFT: its outputs would lack that share.
#define OX_BOARD_LINE 128
#define OX_BOARD_PARTS 64
#define OX_BOARD_PART_BYTES (64 << 10)
#define OX_BOARD_LEFT (1ull << 63)
struct OxBoardLine {
  uint64_t arrive, src, dst, call0, call1;
  unsigned int claims, pad0;
  uint64_t pad[2];
  OxRed red;
};
static_assert(sizeof(OxBoardLine) <= OX_BOARD_LINE, "OxBoardLine layout");
// The collectives' codes in call words (`CollKind`'s order).
enum { OX_ALL_REDUCE = 0, OX_BROADCAST = 1, OX_REDUCE = 2, OX_ALL_GATHER = 3, OX_REDUCE_SCATTER = 4 };

__device__ __forceinline__ uint64_t ox_board_parts(uint64_t bytes) {
  uint64_t p = bytes / OX_BOARD_PART_BYTES;
  return p < 1 ? 1 : (p > OX_BOARD_PARTS ? OX_BOARD_PARTS : p);
}

// Threads `tid`, `tid + nt`, ... below n: wait until rank k's line of the part has `want`
// arrivals. A rank that left counts only where it had `done` arrivals (the second wait: it
// did its share of the operation; the first: it arrived at it), else the kernel stops too
// (OX_ERR_BOARD_LEFT: part `q`).
// False when the kernel must stop (abort, a rank that left).
__device__ __forceinline__ bool ox_board_wait(OxCtl* ctl, const uint8_t* lines, int n,
                                              uint64_t want, uint64_t done, uint64_t q, int tid,
                                              int nt) {
  for (int k = tid; k < n; k += nt) {
    const uint64_t* a = (const uint64_t*)(lines + (uint64_t)k * OX_BOARD_LINE);
    unsigned spins = 0;
    uint64_t v;
    while ((v = ld_vol64(a)) < want) {
      if ((++spins & 1023) == 0 && !ox_still_waits(ctl, (uint64_t)a, want, spins)) return false;
    }
    if ((v & OX_BOARD_LEFT) && (v & ~OX_BOARD_LEFT) < done) {
      ox_fail(ctl, OX_ERR_BOARD_LEFT, (uint64_t)k, q, 0, 0, 0);
      return false;
    }
  }
  return true;
}

// `bytes` from `src` to each of the `nd` outputs `dst` (16 bytes at a time where all allow).
__device__ __forceinline__ void ox_copy_to(const uint8_t* src, uint8_t* const* dst, int nd,
                                           uint64_t bytes, int tid, int nt) {
  uintptr_t al = (uintptr_t)src;
  for (int k = 0; k < nd; k++) al |= (uintptr_t)dst[k];
  uint64_t done = 0;
  if ((al & 15) == 0) {
    const uint64_t nv = bytes / 16;
    for (uint64_t i = tid; i < nv; i += nt) {
      const uint4 v = ((const uint4*)src)[i];
      for (int k = 0; k < nd; k++) ((uint4*)dst[k])[i] = v;
    }
    done = nv * 16;
  }
  for (uint64_t i = done + tid; i < bytes; i += nt) {
    const uint8_t v = src[i];
    for (int k = 0; k < nd; k++) dst[k][i] = v;
  }
}

// This rank's share [a, b) of a part's element indices (of one rank's `count`), every rank's
// buffers at `src`/`dst` (all threads; `in`/`out`: shared room for the pointers of a round).
// All-reduce: every input into every output. Reduce: into the root's. Broadcast: the root's
// input into every output. All-gather: rank g's input into segment g of every output, g by g.
// Reduce-scatter: segment g of every input into rank g's output, g by g.
__device__ __forceinline__ void ox_board_share(uint32_t kind, int root, int n, uint64_t count,
                                               uint64_t a, uint64_t b, uint64_t es,
                                               const uint8_t* const* src, uint8_t* const* dst,
                                               const OxRed* red, const uint8_t** in,
                                               uint8_t** out, int tid, int nt) {
  const bool segments = kind == OX_ALL_GATHER || kind == OX_REDUCE_SCATTER;
  const int ni = (kind == OX_BROADCAST || kind == OX_ALL_GATHER) ? 1 : n;
  const int no = (kind == OX_REDUCE || kind == OX_REDUCE_SCATTER) ? 1 : n;
  for (int g = 0; g < (segments ? n : 1); g++) {
    const uint64_t at = a * es, seg = (g * count + a) * es;
    for (int k = tid; k < n; k += nt) {
      switch (kind) {
        case OX_REDUCE:
          in[k] = src[k] + at;
          if (k == 0) out[0] = dst[root] + at;
          break;
        case OX_BROADCAST:
          if (k == 0) in[0] = src[root] + at;
          out[k] = dst[k] + at;
          break;
        case OX_ALL_GATHER:
          if (k == 0) in[0] = src[g] + at;
          out[k] = dst[k] + seg;
          break;
        case OX_REDUCE_SCATTER:
          in[k] = src[k] + seg;
          if (k == 0) out[0] = dst[g] + at;
          break;
        default:
          in[k] = src[k] + at;
          out[k] = dst[k] + at;
      }
    }
    __syncthreads();
    if (ni == 1) {
      ox_copy_to(in[0], out, no, (b - a) * es, tid, nt);
    } else {
      switch (red[0].dtype) {
#define OX_CASE(d) \
  case d: direct_typed<d, OX_DIRECT_MAX, 1>(in, out, red, ni, no, b - a, tid, nt); break;
        OX_CASE(0) OX_CASE(1) OX_CASE(2) OX_CASE(3) OX_CASE(4) OX_CASE(5)
        OX_CASE(6) OX_CASE(7) OX_CASE(8) OX_CASE(9) OX_CASE(10) OX_CASE(11)
#undef OX_CASE
      }
    }
    __syncthreads();
  }
}

// A board lane (see above), run by block `part` of its `nb` (in `oxccl_run_board` only: its
// element loops take registers the runner's other paths do not need).
__device__ __forceinline__ void ox_board(const OxView& v, const OxLaneD& lane, OxCtl* ctl,
                                     uint32_t nb, uint32_t part) {
  const OxProgD& p = v.progs[lane.first_prog];
  const OxStepD& s = v.steps[p.first_step];
  const int n = lane.bn, me = lane.brank, tid = threadIdx.x, nt = blockDim.x;
  __shared__ const uint8_t* src[OX_DIRECT_MAX];
  __shared__ uint8_t* dst[OX_DIRECT_MAX];
  __shared__ const uint8_t* in[OX_DIRECT_MAX];
  __shared__ uint8_t* out[OX_DIRECT_MAX];
  __shared__ OxRed red[OX_DIRECT_MAX];
  __shared__ uint64_t epoch;
  __shared__ int stop;
  __shared__ OxRed mine;
  const uint32_t kind = (uint32_t)(p.call1 & 0xff);
  const int root = (int)(p.call1 >> 32);
  // (The host never launches these.)
  if (n < 1 || n > OX_DIRECT_MAX || me >= n || kind > OX_REDUCE_SCATTER || root >= n) return;
  if (tid == 0) {
    mine = ox_red(p);
    stop = 0;
  }
  __syncthreads();
  // `count`: one rank's (of the vector; per rank for all-gather and reduce-scatter).
  const uint64_t count = s.len, es = p.esize;
  const bool segments = kind == OX_ALL_GATHER || kind == OX_REDUCE_SCATTER;
  const uint64_t parts = ox_board_parts(count * es * (segments ? n : 1));
  // Elements per part, and per rank's share of a part: multiples of 16 bytes.
  const uint64_t align = es < 16 ? 16 / es : 1;
  const uint64_t per = ((count + parts - 1) / parts + align - 1) / align * align;
  for (uint64_t q = part; q < parts; q += nb) {
    const uint8_t* lines = (const uint8_t*)(lane.board + q * n * OX_BOARD_LINE);
    OxBoardLine* own = (OxBoardLine*)(lines + (uint64_t)me * OX_BOARD_LINE);
    const uint64_t lo = q * per < count ? q * per : count;
    const uint64_t len = count - lo < per ? count - lo : per;
    const uint64_t share = ((len + n - 1) / n + align - 1) / align * align;
    const uint64_t a = lo + (me * share < len ? me * share : len);
    const uint64_t b = lo + ((me + 1) * share < len ? (me + 1) * share : len);
    if (tid == 0) {
      epoch = ld_vol64(&own->arrive);
      if (!(epoch & OX_BOARD_LEFT)) {
        st_vol64(&own->src, s.src.at);
        st_vol64(&own->dst, s.dst.at);
        st_vol64(&own->call0, p.call0);
        st_vol64(&own->call1, p.call1);
        own->red = mine;
        __threadfence();
        st_vol64(&own->arrive, epoch + 1);
      }
    }
    __syncthreads();
    const uint64_t e = epoch;
    // (A rank that left its board before: its communicator has failed.)
    if (e & OX_BOARD_LEFT) {
      if (tid == 0) ox_fail(ctl, OX_ERR_BOARD_LEFT, (uint64_t)me, q, 0, 0, 0);
      return;
    }
    // (A rank that arrived and left is checked for its call first, then found gone when
    // claimed: a mismatch that made it leave is reported as one.)
    if (!ox_board_wait(ctl, lines, n, e + 1, e + 1, q, tid, nt)) stop = 1;
    __syncthreads();
    // Every rank made this call (read only where every rank has arrived: a line may be left
    // from an earlier operation until then).
    if (!stop) {
      __threadfence();
      for (int k = tid; k < n; k += nt) {
        const OxBoardLine* l = (const OxBoardLine*)(lines + (uint64_t)k * OX_BOARD_LINE);
        const uint64_t c0 = ld_vol64(&l->call0), c1 = ld_vol64(&l->call1);
        if (c0 != p.call0 || c1 != p.call1) {
          ox_fail(ctl, OX_ERR_BOARD_CALL, (uint64_t)k, c0, c1, p.call0, p.call1);
          stop = 1;
        }
      }
    }
    __syncthreads();
    // Thread k claims rank k's buffers (not its own), then looks again whether it left.
    uint32_t held = 0;  // (bit k: this thread holds a claim on rank k's buffers)
    if (!stop) {
      for (int k = tid; k < n; k += nt) {
        if (k == me) continue;
        OxBoardLine* l = (OxBoardLine*)(lines + (uint64_t)k * OX_BOARD_LINE);
        atomicAdd(&l->claims, 1u);
        __threadfence();
        if (ld_vol64(&l->arrive) & OX_BOARD_LEFT) {
          atomicAdd(&l->claims, ~0u);
          ox_fail(ctl, OX_ERR_BOARD_LEFT, (uint64_t)k, q, 0, 0, 0);
          stop = 1;
        } else {
          held |= 1u << k;
        }
      }
    }
    __syncthreads();
    if (!stop) {
      for (int k = tid; k < n; k += nt) {
        const OxBoardLine* l = (const OxBoardLine*)(lines + (uint64_t)k * OX_BOARD_LINE);
        src[k] = (const uint8_t*)ld_vol64(&l->src);
        dst[k] = (uint8_t*)ld_vol64(&l->dst);
        uint64_t w[sizeof(OxRed) / 8];
        for (int i = 0; i < (int)(sizeof(OxRed) / 8); i++) w[i] = ld_vol64((const uint64_t*)&l->red + i);
        memcpy(&red[k], w, sizeof(OxRed));
      }
      __syncthreads();
      if (b > a) ox_board_share(kind, root, n, count, a, b, es, src, dst, red, in, out, tid, nt);
    }
    // The block's writes (into the outputs, which may be mapped host memory) are visible
    // before it lets its claims go and says it is done with the part.
    __syncthreads();
    if (held) {
      __threadfence_system();
      for (int k = tid; k < n; k += nt) {
        if (held & (1u << k)) {
          atomicAdd(&((OxBoardLine*)(lines + (uint64_t)k * OX_BOARD_LINE))->claims, ~0u);
        }
      }
    }
    if (!stop) {
      if (tid == 0) {
        __threadfence_system();
        st_vol64(&own->arrive, e + 2);
      }
      // (Every thread waits after thread 0's arrival: one may wait for its own rank's line.)
      __syncthreads();
      if (!ox_board_wait(ctl, lines, n, e + 2, e + 2, q, tid, nt)) stop = 1;
      // What the peers wrote into this rank's output is seen by what its stream runs next.
      __threadfence();
    }
    __syncthreads();
    if (stop) {
      // Leaving: no peer may touch this rank's buffers once the kernel ends.
      if (tid == 0) {
        st_vol64(&own->arrive, ld_vol64(&own->arrive) | OX_BOARD_LEFT);
        __threadfence();
        unsigned spins = 0;
        while (ld_vol32(&own->claims) != 0) {
          if ((++spins & 1023) == 0) ox_still_waits(ctl, (uint64_t)own, ~0ull, spins);
        }
        __threadfence();
      }
      __syncthreads();
      return;
    }
  }
}

// The program runner: `nb` blocks per lane (the header's `reserved` low 16 bits; 1 unless
// every connection is in device memory), block `blockIdx.x % nb` taking its share of each
// slice. BOARD: board lanes run too (`oxccl_run_board`, for launches that have any).
template <bool BOARD>
__device__ __forceinline__ void ox_run(const uint64_t* words) {
  OxView v = ox_view(words);
  uint32_t nb = (uint32_t)(v.h->reserved & 0xffff);
  if (nb == 0) nb = 1;
  const bool gpu = (v.h->reserved & OX_HEAD_GPU_FENCES) != 0;
  const uint32_t li = blockIdx.x / nb, part = blockIdx.x % nb;
  if (li >= v.h->nlanes) return;
  const OxLaneD lane = v.lanes[li];
  OxCtl* ctl = (OxCtl*)lane.ctl;
  __shared__ OxShared sh;
  const int tid = threadIdx.x, nt = blockDim.x;
  if (tid == 0) sh.stop = (v.h->reserved & OX_HEAD_CAPTURED) && ld_vol32(&ctl->abort) != 0;
  for (int i = tid; i < OX_MAX_CONNS; i += nt) sh.known[i] = 0;
  __syncthreads();
  if (sh.stop) return;
  if constexpr (BOARD) {
    if (lane.board) {
      ox_board(v, lane, ctl, nb, part);
      return;
    }
  }
  for (int pi = 0; pi < lane.nprogs; pi++) {
    const OxProgD& p = v.progs[lane.first_prog + pi];
    OxRed r;
    if (tid == 0) sh.red = ox_red(p);
    __syncthreads();
    r = sh.red;
    __syncthreads();
    // Elements per share, a multiple of 16 bytes.
    const uint64_t align = p.esize < 16 ? 16 / p.esize : 1;
    bool refs = false;
    for (uint64_t it = 0; it < p.niter; it++) {
      for (uint32_t k = 0; k < p.nsteps; k++) {
        const OxStepD& s = v.steps[p.first_step + k];
        uint64_t off = it * p.slice;
        if (off >= s.len) continue;
        uint64_t n = s.len - off < p.slice ? s.len - off : p.slice;
        if (tid == 0) {
          sh.stop = !ox_wait_slots(v, s, p, ctl, &sh, gpu);
          if (sh.stop && refs) ox_revoke(v, p);
        }
        __syncthreads();
        if (sh.stop) return;
        uint64_t per = ((n + nb - 1) / nb + align - 1) / align * align;
        uint64_t lo = per * part < n ? per * part : n;
        uint64_t hi = lo + per < n ? lo + per : n;
        uint64_t at = (off + lo) * p.esize;
        // A send by reference: the slot gets the slice's address, not its bytes.
        const uint32_t byref = ox_byref(s);
        const uint32_t prim = byref ? ox_unsent(s.prim) : s.prim;
        refs |= byref != 0;
        const uint8_t* in = sh.in ? sh.in + lo * p.esize : nullptr;
        uint8_t* out = sh.out && !byref ? sh.out + lo * p.esize : nullptr;
        const uint8_t* src = s.src.at ? (const uint8_t*)(s.src.at + at) : nullptr;
        uint8_t* dst = s.dst.at ? (uint8_t*)(s.dst.at + at) : nullptr;
        if (hi > lo && prim != OX_NONE)
          run_prim(prim, s.prep & OX_STEP_PREP, p, r, src, dst, in, out, hi - lo, tid, nt);
        // The block's writes reach thread 0 at the barrier; its fences in ox_post (cumulative)
        // order them before what it publishes. Its reads of a referred slice are done: the
        // claim on it goes.
        __syncthreads();
        if (tid == 0) {
          if (sh.claim) {
            __threadfence();
            atomicAdd(sh.claim, ~0u);
          }
          const uint64_t ref =
              byref ? (byref & OX_STEP_REF_SRC ? s.src.at : s.dst.at) + off * p.esize +
                          (uint64_t)v.conns[s.send].ref_delta
                    : 0;
          ox_post(v, s, p, &sh, n * p.esize, nb, gpu, ref);
        }
      }
    }
    if (refs) {
      if (tid == 0) {
        sh.stop = !ox_drain(v, p, ctl, &sh);
        if (sh.stop) ox_revoke(v, p);
      }
      __syncthreads();
      if (sh.stop) return;
    }
  }
}

// Work that touches no connection, one program of one step per lane (e.g. the copy of a
// one-rank collective): every block takes its share of each lane's elements (gridDim.y =
// lanes).
__device__ __forceinline__ void ox_local(const uint64_t* words) {
  OxView v = ox_view(words);
  if (blockIdx.y >= v.h->nlanes) return;
  const OxLaneD lane = v.lanes[blockIdx.y];
  const int tid = blockIdx.x * blockDim.x + threadIdx.x;
  const int nt = gridDim.x * blockDim.x;
  for (int pi = 0; pi < lane.nprogs; pi++) {
    const OxProgD& p = v.progs[lane.first_prog + pi];
    OxRed r = ox_red(p);
    for (uint32_t k = 0; k < p.nsteps; k++) {
      const OxStepD& s = v.steps[p.first_step + k];
      run_prim(s.prim, s.prep & OX_STEP_PREP, p, r, (const uint8_t*)s.src.at,
               (uint8_t*)s.dst.at, nullptr, nullptr, s.len, tid, nt);
    }
  }
}

// Plain copies, one per lane (a one-rank collective out of place; `OXCCL_CUDA_COPY_KERNEL=1`):
// lane `blockIdx.y`'s one step by `copy_bytes`, every block of the row a share, in few
// registers (two blocks per SM): nothing of the general runner's state or dispatch.
__device__ __forceinline__ void ox_copy(const uint64_t* words) {
  OxView v = ox_view(words);
  if (blockIdx.y >= v.h->nlanes) return;
  const OxLaneD lane = v.lanes[blockIdx.y];
  if (lane.nprogs == 0) return;
  const OxProgD& p = v.progs[lane.first_prog];
  if (p.nsteps == 0) return;
  const OxStepD& s = v.steps[p.first_step];
  if (s.src.at == s.dst.at) return;
  copy_bytes((uint8_t*)s.dst.at, nullptr, (const uint8_t*)s.src.at, s.len * p.esize, false,
             blockIdx.x * blockDim.x + threadIdx.x, gridDim.x * blockDim.x);
}

extern "C" __global__ void __launch_bounds__(OX_THREADS, 2)
    oxccl_copy(const __grid_constant__ OxParams P) {
  ox_copy(P.words);
}

// The direct all-reduce's kernels (the element loop: `direct.cuh`).
template <int M, int U>
__device__ __forceinline__ void ox_direct(const uint64_t* words) {
  OxView v = ox_view(words);
  const int n = v.h->nlanes;
  if (n < 1 || n > M) return;  // the host never launches these
  __shared__ OxRed red[OX_DIRECT_MAX];
  __shared__ const uint8_t* src[OX_DIRECT_MAX];
  __shared__ uint8_t* dst[OX_DIRECT_MAX];
  __shared__ uint64_t count;
  // (A stride over the lanes, for blocks of fewer threads than lanes: the host emulation's.)
  for (int k = threadIdx.x; k < n; k += blockDim.x) {
    const OxProgD& p = v.progs[v.lanes[k].first_prog];
    const OxStepD& s = v.steps[p.first_step];
    red[k] = ox_red(p);
    src[k] = (const uint8_t*)s.src.at;
    dst[k] = (uint8_t*)s.dst.at;
    if (k == 0) count = s.len;
  }
  __syncthreads();
  const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  const size_t nt = (size_t)gridDim.x * blockDim.x;
  switch (red[0].dtype) {
#define OX_CASE(d) \
  case d: direct_typed<d, M, U>(src, dst, red, n, n, count, tid, nt); break;
    OX_CASE(0) OX_CASE(1) OX_CASE(2) OX_CASE(3) OX_CASE(4) OX_CASE(5)
    OX_CASE(6) OX_CASE(7) OX_CASE(8) OX_CASE(9) OX_CASE(10) OX_CASE(11)
#undef OX_CASE
  }
}

// Up to 4 ranks (two element packs in flight per thread, few registers: two blocks per SM), and
// up to OX_DIRECT_MAX.
extern "C" __global__ void __launch_bounds__(OX_THREADS, 2)
    oxccl_direct4(const __grid_constant__ OxParams P) {
  ox_direct<4, 2>(P.words);
}
extern "C" __global__ void __launch_bounds__(OX_THREADS)
    oxccl_direct16(const __grid_constant__ OxParams P) {
  ox_direct<OX_DIRECT_MAX, 1>(P.words);
}

// The kernels, taking their descriptor by value (its address is the parameter's own: the
// parameter is not copied): `oxccl_run`, `oxccl_run_board` (launches with board lanes; up to
// 128 registers a thread, which the board's element loops take) and `oxccl_local`, and their
// `_large` twins.
#define OX_KERNELS(SUFFIX, PARAMS)                                                         \
  extern "C" __global__ void __launch_bounds__(OX_THREADS)                                 \
      oxccl_run##SUFFIX(const __grid_constant__ PARAMS P) {                                \
    ox_run<false>(P.words);                                                                \
  }                                                                                        \
  extern "C" __global__ void __launch_bounds__(OX_THREADS, 1)                              \
      oxccl_run_board##SUFFIX(const __grid_constant__ PARAMS P) {                          \
    ox_run<true>(P.words);                                                                 \
  }                                                                                        \
  extern "C" __global__ void __launch_bounds__(OX_THREADS)                                 \
      oxccl_local##SUFFIX(const __grid_constant__ PARAMS P) {                              \
    ox_local(P.words);                                                                     \
  }
OX_KERNELS(, OxParams)
#ifdef OX_LARGE
OX_KERNELS(_large, OxParamsLarge)
#endif
