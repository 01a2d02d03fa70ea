#!/usr/bin/env python3
"""Merge the outputs of scripts/bench.sh into one table, a CSV and a PNG plot.

Inputs (text, as the tools print it):
  --proc    all_reduce_perf, 2 processes (env launcher); may be several sweeps concatenated
  --reg     the same with -R 1: buffers from ncclMemAlloc, registered (optional)
  --thread  all_reduce_perf -g 2 (2 ranks as threads of one process)
  --mpi     mpi_allreduce under mpirun -np 2
  --memcpy  memcpy_probe
Every busbw is recomputed from the reported time per op with the same formula,
busbw = 2(n-1)/n * bytes / time (n = 2), so the columns and the ratios are comparable
(the tools print busbw with two decimals only, which is 0.00 for the small sizes).
The out-of-place column of all_reduce_perf is used. A row with wrong elements is flagged.
"""
import argparse
import csv
import math
import sys

NRANKS = 2
BUS = 2.0 * (NRANKS - 1) / NRANKS
MIB = 1 << 20


def parse_coll(path):
    """{size: ([time_us, ...], wrong)} from all_reduce_perf / mpi_allreduce output (first 9
    columns); a size measured several times (repeated sweeps) keeps every time, wrong is summed."""
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("#"):
                continue
            p = line.split()
            if len(p) < 9:
                continue
            try:
                size, t = int(p[0]), float(p[5])
            except ValueError:
                continue
            wrong = p[8]
            wrong = int(wrong) if wrong.lstrip("-").isdigit() else 0
            times, w = rows.get(size, ([], 0))
            rows[size] = (times + [t], w + wrong)
    return rows


def median(v):
    v = sorted(v)
    n = len(v)
    return None if n == 0 else (v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2]))


def parse_memcpy(path):
    rows = {}
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith("#"):
                continue
            p = line.split()
            if len(p) >= 3:
                try:
                    rows[int(p[0])] = float(p[2])
                except ValueError:
                    pass
    return rows


def busbw(size, t_us):
    return BUS * size / (t_us * 1e-6) / 1e9 if t_us and t_us > 0 else None


def human(n):
    for unit, k in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= k and n % k == 0:
            return f"{n // k} {unit}"
    return f"{n} B"


def fmt(v, spec="8.3f"):
    return format(v, spec) if v is not None else format("-", spec[: spec.index(".")] if "." in spec else spec)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--proc", required=True)
    ap.add_argument("--reg")
    ap.add_argument("--thread", required=True)
    ap.add_argument("--mpi", required=True)
    ap.add_argument("--memcpy", required=True)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--png", required=True)
    ap.add_argument("--max-bytes", type=int, required=True)
    ap.add_argument("--title", default="all_reduce f32 sum, 2 ranks")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--note", default="")
    ap.add_argument("--base", help="the same 2-process runs with a baseline library")
    ap.add_argument("--base-reg", help="the -R 1 runs with the baseline library")
    ap.add_argument("--base-name", default="baseline")
    a = ap.parse_args()

    proc, thread, mpi = parse_coll(a.proc), parse_coll(a.thread), parse_coll(a.mpi)
    reg = parse_coll(a.reg) if a.reg else {}
    mcp = parse_memcpy(a.memcpy)
    sizes = sorted(set(proc) | set(reg) | set(thread) | set(mpi) | set(mcp))
    if not sizes:
        print("report: no measurements parsed", file=sys.stderr)
        return 1

    table = []
    for s in sizes:
        lp, wp = proc.get(s, ([], 0))
        lt, wt = thread.get(s, ([], 0))
        lm, wm = mpi.get(s, ([], 0))
        lr, wr = reg.get(s, ([], 0))
        tp, tt, tm, tr = median(lp), median(lt), median(lm), median(lr)
        bp, bt, bm, br = busbw(s, tp), busbw(s, tt), busbw(s, tm), busbw(s, tr)
        mc = mcp.get(s)
        table.append(dict(
            size=s, proc_bw=bp, thread_bw=bt, mpi_bw=bm, memcpy=mc, reg_bw=br,
            ratio_mpi=(bp / bm) if bp and bm else None,
            ratio_memcpy=(bp / mc) if bp and mc else None,
            ratio_reg_mpi=(br / bm) if br and bm else None,
            proc_us=tp, thread_us=tt, mpi_us=tm, reg_us=tr,
            wrong=wp + wt + wm + wr, wrong_detail=(wp, wt, wm, wr),
            spread=[(min(x), max(x)) if x else (None, None) for x in (lp, lt, lm, lr)]))

    hdr = (f"{'size':>10}  {'oxccl-2proc':>11}  {'2proc -R':>8}  {'oxccl-2thr':>10}  {'MPI':>8}  {'memcpy':>8}"
           f"  {'oxccl/MPI':>9}  {'-R/MPI':>6}  {'oxccl/memcpy':>12}  {'2proc us':>9}  {'-R us':>9}  {'MPI us':>9}")
    print(f"# {a.title}; busbw in GB/s (2(n-1)/n * bytes / time), memcpy in GB/s (1 thread)")
    if a.repeats > 1:
        print(f"# median time of {a.repeats} runs per size (min..max of each in the CSV)")
    if a.note:
        print(f"# {a.note}")
    print(hdr)
    print("-" * len(hdr))
    for r in table:
        flag = "  WRONG RESULTS (proc,thread,mpi,reg)=%s" % (r["wrong_detail"],) if r["wrong"] else ""
        print(f"{human(r['size']):>10}  {fmt(r['proc_bw'], '11.3f')}  {fmt(r['reg_bw'])}"
              f"  {fmt(r['thread_bw'], '10.3f')}  {fmt(r['mpi_bw'])}  {fmt(r['memcpy'], '8.2f')}"
              f"  {fmt(r['ratio_mpi'], '9.2f')}  {fmt(r['ratio_reg_mpi'], '6.2f')}"
              f"  {fmt(r['ratio_memcpy'], '12.3f')}  {fmt(r['proc_us'], '9.2f')}  {fmt(r['reg_us'], '9.2f')}"
              f"  {fmt(r['mpi_us'], '9.2f')}{flag}")

    with open(a.csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["size_bytes", "oxccl_2proc_busbw_GBps", "oxccl_2thread_busbw_GBps", "mpi_busbw_GBps",
                    "memcpy_GBps", "ratio_oxccl2proc_over_mpi", "ratio_oxccl2proc_over_memcpy",
                    "oxccl_2proc_time_us", "oxccl_2thread_time_us", "mpi_time_us",
                    "wrong_2proc", "wrong_2thread", "wrong_mpi",
                    "oxccl_2proc_time_us_min", "oxccl_2proc_time_us_max",
                    "oxccl_2thread_time_us_min", "oxccl_2thread_time_us_max",
                    "mpi_time_us_min", "mpi_time_us_max",
                    "oxccl_2proc_reg_busbw_GBps", "ratio_oxccl2procreg_over_mpi", "oxccl_2proc_reg_time_us",
                    "wrong_2proc_reg", "oxccl_2proc_reg_time_us_min", "oxccl_2proc_reg_time_us_max"])

        def c(v):
            return "" if v is None else f"{v:.6g}"
        for r in table:
            w.writerow([r["size"], c(r["proc_bw"]), c(r["thread_bw"]), c(r["mpi_bw"]), c(r["memcpy"]),
                        c(r["ratio_mpi"]), c(r["ratio_memcpy"]), c(r["proc_us"]), c(r["thread_us"]),
                        c(r["mpi_us"]), *r["wrong_detail"][:3], *[c(v) for mm in r["spread"][:3] for v in mm],
                        c(r["reg_bw"]), c(r["ratio_reg_mpi"]), c(r["reg_us"]), r["wrong_detail"][3],
                        *[c(v) for v in r["spread"][3]]])
    print(f"\nCSV: {a.csv}")

    by = {r["size"]: r for r in table}
    l8 = by.get(8, {})
    print("\n8-byte latency (us): oxccl-2proc %s, oxccl-2proc -R %s, oxccl-2thread %s, MPI %s" % (
        fmt(l8.get("proc_us"), ".2f"), fmt(l8.get("reg_us"), ".2f"), fmt(l8.get("thread_us"), ".2f"),
        fmt(l8.get("mpi_us"), ".2f")))

    def verdict(ok, r):
        if r and r["wrong"]:
            return "FAIL (wrong results)"
        return "PASS" if ok else "FAIL"

    # The project's targets for this machine, for each kind of buffer oxccl ran on.
    kinds = [("proc", "malloc buffers")]
    if reg:
        kinds.append(("reg", "ncclMemAlloc buffers, registered (-R 1)"))
    for key, what in kinds:
        bw, ratio, us = f"{key}_bw", "ratio_mpi" if key == "proc" else "ratio_reg_mpi", f"{key}_us"
        print(f"\nTargets (oxccl 2 processes, {what}, vs OpenMPI, 2 processes):")
        for size, need in ((256 * MIB, 3.0), (1 * MIB, 1.0)):
            r = by.get(size)
            label = f"oxccl/MPI busbw >= {need:g} at {human(size)}"
            if size > a.max_bytes:
                print(f"  {label:<36} not measured (this sweep stops at {human(a.max_bytes)})")
            elif not r or r[ratio] is None:
                print(f"  {label:<36} no measurement  FAIL")
            else:
                v = verdict(r[ratio] >= need, r)
                print(f"  {label:<36} measured {r[ratio]:.2f}  "
                      f"({r[bw]:.3f} vs {r['mpi_bw']:.3f} GB/s)  {v}")
        label = "8-byte latency oxccl <= MPI"
        if l8.get(us) is None or l8.get("mpi_us") is None:
            print(f"  {label:<36} no measurement  FAIL")
        else:
            v = verdict(l8[us] <= l8["mpi_us"], l8)
            print(f"  {label:<36} measured {l8[us]:.2f} us vs {l8['mpi_us']:.2f} us  {v}")
    if a.base:
        base, base_reg = parse_coll(a.base), parse_coll(a.base_reg) if a.base_reg else {}
        print(f"\nThis build against the baseline ({a.base_name}), same run, busbw GB/s (8 B: time, us):")
        print(f"{'size':>10}  {'2proc':>8}  {'base':>8}  {'new/base':>8}  {'-R':>8}  {'base -R':>8}  {'new/base':>8}")
        for r in table:
            s = r["size"]
            lb, wb = base.get(s, ([], 0))
            lbr, wbr = base_reg.get(s, ([], 0))
            tb, tbr = median(lb), median(lbr)
            if s == 8:
                new, old, newr, oldr = r["proc_us"], tb, r["reg_us"], tbr
                q = (old / new) if new and old else None
                qr = (oldr / newr) if newr and oldr else None
            else:
                new, old, newr, oldr = r["proc_bw"], busbw(s, tb), r["reg_bw"], busbw(s, tbr)
                q = (new / old) if new and old else None
                qr = (newr / oldr) if newr and oldr else None
            flag = "  WRONG RESULTS (baseline)" if wb or wbr else ""
            print(f"{human(s):>10}  {fmt(new)}  {fmt(old)}  {fmt(q, '8.2f')}  {fmt(newr)}  {fmt(oldr)}"
                  f"  {fmt(qr, '8.2f')}{flag}")
        print("(new/base above 1: this build is faster; at 8 B the ratio is of times, base/new)")

    nwrong = sum(1 for r in table if r["wrong"])
    if nwrong:
        print(f"\nWARNING: {nwrong} size(s) had wrong results; their numbers are not valid")
    status = 1 if nwrong else 0

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("\nno matplotlib: plot skipped", file=sys.stderr)
        return status
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for key, name, style in (("proc_bw", "oxccl, 2 processes (shm)", "o-"),
                             ("reg_bw", "oxccl, 2 processes, ncclMemAlloc buffers (-R 1)", "D-"),
                             ("thread_bw", "oxccl, 2 threads (-g 2)", "s-"),
                             ("mpi_bw", "OpenMPI MPI_Allreduce, 2 processes", "^-"),
                             ("memcpy", "memcpy, 1 thread (GB/s)", "k--")):
        pts = [(r["size"], r[key]) for r in table if r[key]]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title(a.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    ticks = [s for s in sizes if int(math.log2(s)) % 4 == 3 or s == sizes[-1]]
    ax.set_xticks(ticks)
    ax.set_xticklabels([human(s).replace(" ", "") for s in ticks], rotation=45)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print(f"plot: {a.png}")
    return status


if __name__ == "__main__":
    sys.exit(main())
