#!/usr/bin/env bash
# Where a GPU host's CPU goes while 64 sessions each call Step, and while they call Echo of the
# same bytes: one attn-bench run (--sessions 64 --step_coding stub: its Steps, then its Echo),
# `perf record -a -g` for a window inside each half, and a report per thread name and per
# (thread name, symbol). Then the same load at each of STEP_LANES (default "2 4 8") lanes.
#   . BUNDLE/env.sh && bench/step_cpu_profile.sh BUNDLE OUT_DIR
# BUNDLE: a gpu-bundle of attnd, attnctl, attn-bench and perf (/usr/bin/perf). Writes
# OUT_DIR/{steps,echo}-{comm,sym}.txt, OUT_DIR/profile-run.csv, OUT_DIR/lanes.csv.
set -uo pipefail
bin=$(cd "$1" && pwd)/bin
out=$2
mkdir -p "$out"
port=50061
c=(--target 127.0.0.1:$port --mode decode --layers 1 --cache_tokens 4096 --heads 32 --kv_heads 8
   --head_dim 128 --dtype bf16 --warmup_s 0.5)
nproc >"$out/host.txt"
grep -m1 "model name" /proc/cpuinfo >>"$out/host.txt"

start_attnd() {
  "$bin/attnd" --listen=127.0.0.1:$port --metrics_listen= --backend=cuda \
    --kv_cache_bytes=17179869184 "$@" >>"$out/attnd.log" 2>&1 &
  attnd_pid=$!
  for _ in $(seq 300); do
    "$bin/attnctl" --target 127.0.0.1:$port health >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  return 1
}
stop_attnd() {  # waits until the port is free again, so that the next start can bind it
  kill -TERM "$attnd_pid"
  for _ in $(seq 100); do kill -0 "$attnd_pid" 2>/dev/null || return 0; sleep 0.1; done
}

# The run: prefill (~1 s), 0.5 s warm-up, 5 s of Steps, 0.5 s warm-up, 5 s of Echo.
start_attnd || exit 1
"$bin/attn-bench" "${c[@]}" --sessions 64 --step_coding stub --duration_s 5 \
  --csv "$out/profile-run.csv" --label profile >"$out/profile-run.txt" 2>&1 &
bench_pid=$!
sleep 3
"$bin/perf" record -a -g -o "$out/steps.data" -- sleep 1.5 >/dev/null 2>&1
sleep 3
"$bin/perf" record -a -g -o "$out/echo.data" -- sleep 1.5 >/dev/null 2>&1
for _ in $(seq 100); do kill -0 "$bench_pid" 2>/dev/null || break; sleep 0.2; done
stop_attnd
for m in steps echo; do
  "$bin/perf" report -i "$out/$m.data" --no-children --sort comm --stdio -g none 2>/dev/null |
    grep "%" | head -30 >"$out/$m-comm.txt"
  "$bin/perf" report -i "$out/$m.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null |
    grep "%" | head -150 >"$out/$m-sym.txt"
  rm -f "$out/$m.data"
done

for lanes in ${STEP_LANES:-2 4 8}; do
  start_attnd --step_lanes="$lanes" || exit 1
  "$bin/attn-bench" "${c[@]}" --sessions 64 --step_coding stub --duration_s 2 \
    --csv "$out/lanes.csv" --label "lanes$lanes" >>"$out/lanes.txt" 2>&1
  stop_attnd
done
cat "$out/steps-comm.txt" "$out/echo-comm.txt"
