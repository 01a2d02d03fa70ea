#!/usr/bin/env python3
"""PyTorch's torch.distributed "nccl" backend on oxccl, on one GPU.

Run as   LD_PRELOAD=/path/to/oxccl/libnccl.so.2 python3 scripts/gpu-torch-check.py
(scripts/gpu-check.sh does). For world sizes 1 and 2 it starts one process per rank (this script
with --child; env MASTER_ADDR=127.0.0.1, MASTER_PORT a free port, RANK, WORLD_SIZE, LOCAL_RANK),
every rank on cuda:0, and checks against expected values:
  all_reduce (sum float32, sum bfloat16, max int64), broadcast, all_gather_into_tensor,
  reduce_scatter_tensor, all_to_all_single, send/recv between ranks 0 and 1 and a
  batch_isend_irecv ring (world 2), all_reduce in subgroups (dist.new_group: all ranks, then
  each rank alone; made by ncclCommSplit), and one all_reduce captured in a torch.cuda.CUDAGraph (warmed up on a
  side stream first, replayed 3 times with new inputs copied into the static input).
Each check prints "ok <name>" or "FAIL <name>: ..." (prefixed with [wW rR]). Rank 0 prints the
torch and NCCL versions (torch.cuda.nccl.version()), the libnccl files the process mapped
(/proc/self/maps), the file the global ncclAllReduce symbol comes from (dladdr) and oxccl's
executor, so the log shows oxccl was used; with a libnccl in LD_PRELOAD, a different libnccl
serving ncclAllReduce is a failure. Without LD_PRELOAD it checks whatever NCCL torch loaded
(NVIDIA's: a baseline for this script itself, at world size 1: NCCL refuses 2 ranks on 1 GPU).

Exits non-zero on any failure, or when a world size's ranks are still running after --timeout
seconds (default 120; they are killed). Usage: gpu-torch-check.py [--worlds 1,2] [--timeout S]
"""
import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time


# ----------------------------------------------------------------------------------------------
# Parent: one process per rank, per world size.
# ----------------------------------------------------------------------------------------------
def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world, timeout):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
        )
        # Own session: the whole rank (and anything it forks) can be killed together.
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--child"],
                env=env,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    rcs = [None] * world
    while time.monotonic() < deadline and any(rc is None for rc in rcs):
        for i, p in enumerate(procs):
            if rcs[i] is None:
                rcs[i] = p.poll()
        # A rank that failed may leave the others waiting for it: give them 15 s more at most.
        if any(rc not in (None, 0) for rc in rcs):
            deadline = min(deadline, time.monotonic() + 15)
        time.sleep(0.1)
    ok = True
    for i, p in enumerate(procs):
        if rcs[i] is None:
            print(f"FAIL world {world}: rank {i} (pid {p.pid}) still running after the timeout: killed",
                  flush=True)
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
            ok = False
        elif rcs[i] != 0:
            print(f"FAIL world {world}: rank {i} exited with {rcs[i]}", flush=True)
            ok = False
    return ok


def parent(args):
    worlds = [int(w) for w in args.worlds.split(",") if w]
    bad = []
    for w in worlds:
        print(f"== torch.distributed nccl, world size {w}, every rank on cuda:0", flush=True)
        t0 = time.monotonic()
        ok = run_world(w, args.timeout)
        print(f"== world size {w}: {'ok' if ok else 'FAILED'} ({time.monotonic() - t0:.1f} s)", flush=True)
        if not ok:
            bad.append(w)
    if bad:
        print(f"gpu-torch-check: FAILED (world sizes {bad})", flush=True)
        return 1
    print("gpu-torch-check: all ok", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# Child: one rank.
# ----------------------------------------------------------------------------------------------
class DlInfo(ctypes.Structure):
    _fields_ = [
        ("dli_fname", ctypes.c_char_p),
        ("dli_fbase", ctypes.c_void_p),
        ("dli_sname", ctypes.c_char_p),
        ("dli_saddr", ctypes.c_void_p),
    ]


def mapped_libnccl():
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and "libnccl" in parts[-1] and parts[-1] not in paths:
                paths.append(parts[-1])
    return paths


def symbol_file(name):
    """The file the process-global definition of `name` comes from (what libtorch binds to)."""
    glob = ctypes.CDLL(None)
    try:
        fn = getattr(glob, name)
    except AttributeError:
        return None
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    info = DlInfo()
    dladdr = None
    for lib in (glob, "libdl.so.2"):
        try:
            dladdr = (lib if not isinstance(lib, str) else ctypes.CDLL(lib)).dladdr
            break
        except (AttributeError, OSError):
            continue
    if dladdr is None:
        return "?"
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(DlInfo)]
    if dladdr(ctypes.c_void_p(addr), ctypes.byref(info)) == 0 or not info.dli_fname:
        return "?"
    return os.path.realpath(info.dli_fname.decode())


class Checker:
    def __init__(self, tag):
        self.tag = tag
        self.failed = 0

    def say(self, msg):
        print(f"[{self.tag}] {msg}", flush=True)

    def run(self, name, fn):
        try:
            err = fn()
        except Exception as e:  # a check's exception is its failure; go on with the others
            err = f"{type(e).__name__}: {e}"
        if err:
            self.failed += 1
            self.say(f"FAIL {name}: {err}")
        else:
            self.say(f"ok {name}")


def compare(got, want):
    """None when equal, else a description of the first difference."""
    import torch

    g = got.detach().cpu()
    w = want.detach().cpu()
    if g.shape != w.shape or g.dtype != w.dtype:
        return f"shape/dtype {tuple(g.shape)} {g.dtype}, expected {tuple(w.shape)} {w.dtype}"
    ne = (g != w).flatten()
    if not bool(ne.any()):
        return None
    idx = ne.nonzero()[0].item()
    return (f"{int(ne.sum())} of {ne.numel()} elements differ; first at {idx}: "
            f"got {g.flatten()[idx].item()}, expected {w.flatten()[idx].item()}")


def die_with_parent():
    """The rank dies with the script that started it (it runs in a session of its own, out of
    the reach of a timeout that kills the script's process group): no orphan keeps the GPU."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent is gone already
        os._exit(1)


def child():
    die_with_parent()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    chk = Checker(f"w{world} r{rank}")

    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dev = torch.device("cuda:0")
    timeout = datetime.timedelta(seconds=90)
    try:
        dist.init_process_group("nccl", device_id=dev, timeout=timeout)
        how = "device_id=cuda:0 (eager communicator)"
    except TypeError:  # a torch without device_id
        dist.init_process_group("nccl", timeout=timeout)
        how = "no device_id (this torch lacks it)"
    if rank == 0:
        chk.say(f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                f"torch.cuda.nccl.version() = {torch.cuda.nccl.version()}, "
                f"{torch.cuda.get_device_name(0)}; init_process_group with {how}")

        def which_nccl():
            maps = mapped_libnccl()
            chk.say(f"libnccl mapped: {maps if maps else 'none'}")
            served = symbol_file("ncclAllReduce")
            chk.say(f"ncclAllReduce served by: {served}")
            glob = ctypes.CDLL(None)
            if hasattr(glob, "oxcclGetExecutor"):
                ex = ctypes.c_int(-1)
                glob.oxcclGetExecutor(ctypes.byref(ex))
                chk.say(f"oxccl executor: {({0: 'host', 1: 'CUDA'}).get(ex.value, ex.value)}")
            else:
                chk.say("oxcclGetExecutor not found: not oxccl")
            pre = [p for p in os.environ.get("LD_PRELOAD", "").replace(",", " ").split() if "libnccl" in p]
            if not pre:
                chk.say("LD_PRELOAD names no libnccl: checking whatever NCCL torch loaded")
                return None
            want = os.path.realpath(pre[0])
            if served != want:
                return f"LD_PRELOAD={pre[0]} ({want}), but ncclAllReduce comes from {served}"
            if not hasattr(glob, "oxcclGetExecutor"):
                return "the preloaded libnccl has no oxcclGetExecutor: not oxccl"
            # No other libnccl beside it (torch could load NVIDIA's by its full path and bind
            # to it while the global symbol is ours), and oxccl on the GPU, not the host.
            others = [m for m in maps if os.path.realpath(m) != want]
            if others:
                return f"another libnccl is mapped beside the preloaded one: {others}"
            if ex.value != 1:
                return f"oxccl runs on its host executor (oxcclGetExecutor: {ex.value}), not CUDA"
            # (torch.cuda.nccl.version() is the version torch was built against: the running
            # library's is ncclGetVersion's, as ProcessGroupNCCL asks it.)
            v = ctypes.c_int(0)
            glob.ncclGetVersion(ctypes.byref(v))
            if v.value != 23203:
                return f"ncclGetVersion says {v.value}, not oxccl's 23203"
            return None

        chk.run("oxccl-is-the-nccl-in-use", which_nccl)

    N = (1 << 20) + 3  # odd on purpose
    ar = torch.arange(N, device=dev)

    def val(r, k=0):  # small integers: every sum is exact, in bfloat16 too (world <= 2)
        return (ar * 3 + r * 5 + k) % 11

    def all_reduce_sum_f32():
        x = val(rank).float()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return compare(x, sum(val(r) for r in range(world)).float())

    def all_reduce_sum_bf16():
        x = ((ar + rank) % 5).to(torch.bfloat16)
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return compare(x, sum((ar + r) % 5 for r in range(world)).to(torch.bfloat16))

    def i64(r):
        return (ar * (r + 1)) % 1000 - r * 3 + (1 << 40) * (r + 1)

    def all_reduce_max_i64():
        x = i64(rank).to(torch.int64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        want = i64(0)
        for r in range(1, world):
            want = torch.maximum(want, i64(r))
        return compare(x, want.to(torch.int64))

    def broadcast():
        src = world - 1
        x = val(rank, 7).float() if rank == src else torch.full((N,), -1.0, device=dev)
        dist.broadcast(x, src=src)
        return compare(x, val(src, 7).float())

    def all_gather_into_tensor():
        out = torch.full((world * N,), -1.0, device=dev)
        dist.all_gather_into_tensor(out, val(rank, 1).float())
        return compare(out, torch.cat([val(r, 1).float() for r in range(world)]))

    def reduce_scatter_tensor():
        inp = torch.cat([val(rank, 2 + c).float() for c in range(world)])
        out = torch.full((N,), -1.0, device=dev)
        dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM)
        return compare(out, sum(val(r, 2 + rank) for r in range(world)).float())

    def a2a(src, dst):
        return (ar * 7 + src * 100 + dst * 10) % 1013

    def all_to_all_single():
        inp = torch.cat([a2a(rank, d) for d in range(world)]).to(torch.int32)
        out = torch.full((world * N,), -1, dtype=torch.int32, device=dev)
        dist.all_to_all_single(out, inp)
        return compare(out, torch.cat([a2a(s, rank) for s in range(world)]).to(torch.int32))

    def send_recv():
        errs = []
        for src, dst in ((0, 1), (1, 0)):
            if rank == src:
                dist.send(val(src, 3).float(), dst=dst)
            elif rank == dst:
                x = torch.full((N,), -1.0, device=dev)
                dist.recv(x, src=src)
                e = compare(x, val(src, 3).float())
                if e:
                    errs.append(f"{src}->{dst}: {e}")
        torch.cuda.synchronize()
        return "; ".join(errs) or None

    def isend_irecv_ring():
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        x = torch.full((N,), -1.0, device=dev)
        ops = [dist.P2POp(dist.isend, val(rank, 4).float(), nxt),
               dist.P2POp(dist.irecv, x, prv)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        return compare(x, val(prv, 4).float())

    def cuda_graph_all_reduce():
        static_in = val(rank, 5).float()
        static_out = torch.empty_like(static_in)
        # Warm up on a side stream (as PyTorch's CUDA graph docs show).
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                y = static_in.clone()
                dist.all_reduce(y)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            static_out.copy_(static_in)
            dist.all_reduce(static_out)
        for k in range(3):
            static_in.copy_(val(rank, 20 + k).float())
            static_out.fill_(-1.0)
            g.replay()
            torch.cuda.synchronize()
            e = compare(static_out, sum(val(r, 20 + k) for r in range(world)).float())
            if e:
                return f"replay {k}: {e}"
        del g
        return None

    def new_groups():
        # Subgroups: with a bound device torch makes them by ncclCommSplit of the default
        # communicator (non-blocking, as its eager communicators are), the ranks left out
        # passing NCCL_SPLIT_NOCOLOR; all ranks, then rank 0 alone, then (world 2) rank 1 alone.
        errs = []
        subsets = [list(range(world)), [0]] + ([[1]] if world >= 2 else [])
        for k, ranks in enumerate(subsets):
            g = dist.new_group(ranks=ranks)
            if rank in ranks:
                # (An error is noted and the loop goes on, so that every rank makes the
                # same groups in the same order.)
                try:
                    x = val(rank, 30 + k).float()
                    dist.all_reduce(x, group=g)
                    torch.cuda.synchronize()
                    e = compare(x, sum(val(r, 30 + k) for r in ranks).float())
                except Exception as ex:
                    e = f"{type(ex).__name__}: {ex}"
                if e:
                    errs.append(f"group {ranks}: {e}")
                dist.destroy_process_group(g)
        return "; ".join(errs) or None

    checks = [
        ("all_reduce-sum-float32", all_reduce_sum_f32),
        ("all_reduce-sum-bfloat16", all_reduce_sum_bf16),
        ("all_reduce-max-int64", all_reduce_max_i64),
        ("broadcast", broadcast),
        ("all_gather_into_tensor", all_gather_into_tensor),
        ("reduce_scatter_tensor", reduce_scatter_tensor),
        ("all_to_all_single", all_to_all_single),
    ]
    if world >= 2:  # torch refuses a send to oneself
        checks += [("send-recv-0-1", send_recv), ("batch_isend_irecv-ring", isend_irecv_ring)]
    checks.append(("new_group-all_reduce", new_groups))
    checks.append(("cuda-graph-all_reduce", cuda_graph_all_reduce))
    for name, fn in checks:
        chk.run(name, fn)
        torch.cuda.synchronize()

    try:
        dist.barrier()
        torch.cuda.synchronize()
        dist.destroy_process_group()
    except Exception as e:
        chk.failed += 1
        chk.say(f"FAIL shutdown: {type(e).__name__}: {e}")
    chk.say(f"{'all ok' if not chk.failed else f'{chk.failed} FAILED'}")
    sys.stdout.flush()
    return 1 if chk.failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worlds", default="1,2", help="world sizes, comma separated (default 1,2)")
    ap.add_argument("--timeout", type=float, default=120, help="seconds per world size (default 120)")
    args = ap.parse_args()
    if args.child:
        sys.exit(child())
    sys.exit(parent(args))


if __name__ == "__main__":
    main()
