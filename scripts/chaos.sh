#!/usr/bin/env bash
# scripts/chaos.sh [ITER] : failures at random moments; every survivor must end in an error
#
# Each iteration runs a random perf tool (out of place, data checked) over 2-4 ranks, then at a
# random moment fails one rank, as MODE says:
#   kill  (default) SIGKILL a random rank;
#   stop  SIGSTOP a random rank (a hung peer; OXCCL_TIMEOUT_S=6 for the others), killed after;
#   link  (HOSTS=2 only) take one host's link down.
# HOSTS=1 (default): processes on this host (shared memory). HOSTS=2: 2 namespace hosts x 2
# ranks joined by a bridge (needs root), the data between them over TCP.
# A survivor must exit on its own within 40 s (HOSTS=2: 60 s), not by a signal, and /dev/shm
# must hold nothing of the run afterwards (TOOLS="reduce broadcast" picks the tools). Prints a line per iteration (the survivors' exit
# codes and times, or rank 0's "done" where the tool finished before the failure), then
# "bad=N"; exits 1 if N > 0. Logs stay in $DIR (default /tmp/oxccl-chaos).
#   scripts/chaos.sh 40;  MODE=stop scripts/chaos.sh 15;  HOSTS=2 MODE=link scripts/chaos.sh 8
set -u
ITER=${1:-20} MODE=${MODE:-kill} HOSTS=${HOSTS:-1}
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN=$ROOT/target/release
DIR=${DIR:-/tmp/oxccl-chaos}
TOOLS=(${TOOLS:-all_reduce all_gather broadcast reduce reduce_scatter alltoall gather scatter sendrecv})
[ -x "$BIN/all_reduce_perf" ] || { echo "build first: cargo build --release; make -C nccl-tests-compat"; exit 2; }
[ "$MODE" != link ] || [ "$HOSTS" = 2 ] || { echo "MODE=link needs HOSTS=2"; exit 2; }
T="oxch$$"
cleanup() {
  for p in $(jobs -p); do kill -9 "$p" 2>/dev/null; done
  for i in 0 1; do
    for p in $(ip netns pids "$T$i" 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
    ip netns del "$T$i" 2>/dev/null
  done
  sleep 0.5  # (a namespace goes, and its veth end with it, once its last process has)
  for i in 0 1; do ip link del "${T}p$i" 2>/dev/null; done
  ip link del "${T}br" 2>/dev/null
}
trap cleanup EXIT
trap 'exit 130' INT TERM
if [ "$HOSTS" = 2 ]; then
  ip link add "${T}br" type bridge && ip link set "${T}br" up || exit 2
  for i in 0 1; do
    ip netns add "$T$i" && ip -n "$T$i" link set lo up
    ip link add "${T}v$i" type veth peer name "${T}p$i"
    ip link set "${T}v$i" netns "$T$i" && ip -n "$T$i" link set "${T}v$i" name eth0
    ip -n "$T$i" addr add "10.78.0.$((i + 1))/24" dev eth0 && ip -n "$T$i" link set eth0 up
    ip link set "${T}p$i" master "${T}br" up
  done
fi
export LD_LIBRARY_PATH=$BIN OXCCL_DEVICE=host
bad=0
for it in $(seq 1 "$ITER"); do
  t=${TOOLS[$((RANDOM % ${#TOOLS[@]}))]}
  port=$((20000 + RANDOM % 20000))
  if [ "$HOSTS" = 2 ]; then n=4; limit=600; else n=$((2 + RANDOM % 3)); limit=400; fi
  victim=$((RANDOM % n))
  delay=$(awk -v r=$RANDOM -v h="$HOSTS" 'BEGIN{printf "%.2f", (h == 2 ? 1.0 : 0.05) + (r % 1500) / 1000}')
  d=$DIR/$it; rm -rf "$d"; mkdir -p "$d"
  ls /dev/shm >"$d/shm-before"
  args=(-b 1K -e 16M -f 4 -n 40 -w 2 -c 1)
  tmo=6; [ "$MODE" = stop ] || tmo=20
  if [ "$HOSTS" = 2 ]; then
    for h in 0 1; do
      ip netns exec "$T$h" unshare --mount --uts --propagation private sh -c \
        "mount -t tmpfs tmpfs /dev/shm && hostname $T-host$h && exec \"\$@\"" sh \
        env WORLD_SIZE=4 MASTER_ADDR=10.78.0.1 MASTER_PORT=$port NCCL_SOCKET_IFNAME=eth0 \
        OXCCL_TIMEOUT_S=$tmo sh -c "
        for r in $((2 * h)) $((2 * h + 1)); do
          (RANK=\$r $BIN/${t}_perf ${args[*]} >$d/out\$r 2>$d/err\$r & echo \$! >$d/pid\$r
           wait \$!; date +%s.%N >$d/end\$r) &
        done
        wait; ls /dev/shm >$d/shm$h" &
    done
    sleep 0.5
  else
    for r in $(seq 0 $((n - 1))); do
      RANK=$r WORLD_SIZE=$n MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OXCCL_TIMEOUT_S=$tmo \
        "$BIN/${t}_perf" "${args[@]}" >"$d/out$r" 2>"$d/err$r" &
      echo $! >"$d/pid$r"
    done
  fi
  sleep "$delay"
  vp=$(cat "$d/pid$victim")
  case $MODE in
    kill) kill -9 "$vp" 2>/dev/null; [ "$HOSTS" = 1 ] && { wait "$vp"; } 2>/dev/null ;;
    stop) kill -STOP "$vp" 2>/dev/null ;;
    link) ip -n "$T$((victim / 2))" link set eth0 down ;;
  esac
  t0=$(date +%s.%N) verdict=ok msg=""
  for r in $(seq 0 $((n - 1))); do
    [ "$MODE" != link ] && [ "$r" = "$victim" ] && continue
    p=$(cat "$d/pid$r")
    for _ in $(seq 1 $limit); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$p" 2>/dev/null; then
      verdict=HANG; msg+=" r$r hangs;"
      gdb -p "$p" -batch -ex "thread apply all bt" >"$d/bt$r" 2>&1; kill -9 "$p"
    fi
    el=$(awk -v s="$t0" -v e="$(date +%s.%N)" 'BEGIN{printf "%.1f", e - s}')
    # (Ranks on namespace hosts are not this shell's children: their errors say how they ended.)
    if grep -q "Segmentation\|Aborted\|panicked" "$d/err$r"; then verdict=SIGNAL; msg+=" r$r crashed;"; fi
    if [ "$HOSTS" = 1 ]; then
      wait "$p"; rc=$?
      [ $rc -gt 128 ] && [ $verdict = ok ] && { verdict=SIGNAL; msg+=" r$r rc=$rc;"; }
      msg+=" r$r rc$rc(${el}s);"
    else
      sleep 0.2  # (its end time is written just after it ends)
      el=$(awk -v s="$t0" -v e="$(cat "$d/end$r" 2>/dev/null || date +%s.%N)" 'BEGIN{printf "%.1f", e - s}')
      if [ -s "$d/err$r" ]; then msg+=" r$r error(${el}s);"; else msg+=" r$r no error(${el}s);"; fi
    fi
  done
  [ "$MODE" = stop ] && kill -9 "$vp" 2>/dev/null
  { wait; } 2>/dev/null
  [ "$MODE" = link ] && ip -n "$T$((victim / 2))" link set eth0 up
  grep -q "Collective test concluded" "$d/out0" && msg+=" (rank 0 done before the failure)"
  if [ "$HOSTS" = 2 ]; then left=$(cat "$d"/shm* 2>/dev/null | wc -l)
  else
    # What this run left (others' files, made meanwhile, may show here too: run it alone).
    comm -13 "$d/shm-before" <(ls /dev/shm) >"$d/shm-left"
    left=$(wc -l <"$d/shm-left")
  fi
  [ "$left" != 0 ] && verdict="$verdict SHM($left)"
  echo "$it $t n=$n $MODE r$victim after ${delay}s: $verdict;$msg"
  [ "$verdict" = ok ] || bad=$((bad + 1))
done
echo "bad=$bad"
[ $bad = 0 ]
