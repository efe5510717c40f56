#!/usr/bin/env bash
# Where a GPU host's CPU goes while 64 sessions each call Step, and while they call Echo of the
# same bytes: one attn-bench run (--sessions 64 --step_coding stub: its Steps, then its Echo),
# `perf record -a -g` for a window inside each half, and a report per thread name and per
# (thread name, symbol), once per set of attnd flags in PROFILE_VARIANTS (default "-": none;
# " " for no profile). Then the same load at each of STEP_LANES (default "2 4 8") lanes, for each
# set of flags in STEP_VARIANTS (default "-"), the whole sweep STEP_ROUNDS (default 1) times, so
# that variants alternate, each with its step phases and mean tokens per launch
# (bench/step_phases.py; the sessions' prefill taken out by a set-up-only run before it: stage and
# enqueue, where the prefill's copies weigh most, keep what two prefills differ by). A set of
# flags is comma-separated, e.g. "--step_poll_when_busy=true,--max_step_delay_us=50".
#   . BUNDLE/env.sh && bench/step_cpu_profile.sh BUNDLE OUT_DIR
# BUNDLE: a gpu-bundle of attnd, attnctl, attn-bench and perf (/usr/bin/perf). Writes
# OUT_DIR/{steps,echo}-VARIANT-{comm,sym}.txt, OUT_DIR/profile-VARIANT.csv, OUT_DIR/lanes.csv,
# OUT_DIR/phases.md.
set -uo pipefail
bin=$(cd "$1" && pwd)/bin
out=$2
mkdir -p "$out"
port=50061
mport=9461
c=(--target 127.0.0.1:$port --mode decode --layers 1 --cache_tokens 4096 --heads 32 --kv_heads 8
   --head_dim 128 --dtype bf16 --warmup_s 0.5)
nproc >"$out/host.txt"
grep -m1 "model name" /proc/cpuinfo >>"$out/host.txt"

start_attnd() {
  "$bin/attnd" --listen=127.0.0.1:$port --metrics_listen=127.0.0.1:$mport --backend=cuda \
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

# A variant's name in file names and labels: its flags with every other character dropped.
tag_of() { [ "$1" = - ] && echo default || echo "$1" | tr -c 'a-z0-9\n' _; }
flags_of() { [ "$1" = - ] || echo "$1" | tr , ' '; }

# One run per profile variant: prefill (~1 s), 0.5 s warm-up, 5 s of Steps, 0.5 s warm-up, 5 s
# of Echo.
for variant in ${PROFILE_VARIANTS:--}; do
  tag=$(tag_of "$variant")
  # shellcheck disable=SC2046
  start_attnd $(flags_of "$variant") || exit 1
  "$bin/attn-bench" "${c[@]}" --sessions 64 --step_coding stub --duration_s 5 \
    --csv "$out/profile-$tag.csv" --label "profile-$tag" >"$out/profile-$tag.txt" 2>&1 &
  bench_pid=$!
  sleep 3
  "$bin/perf" record -a -g -o "$out/steps.data" -- sleep 1.5 >/dev/null 2>&1
  sleep 3
  "$bin/perf" record -a -g -o "$out/echo.data" -- sleep 1.5 >/dev/null 2>&1
  for _ in $(seq 100); do kill -0 "$bench_pid" 2>/dev/null || break; sleep 0.2; done
  stop_attnd
  for m in steps echo; do
    "$bin/perf" report -i "$out/$m.data" --no-children --sort comm --stdio -g none 2>/dev/null |
      grep "%" | head -30 >"$out/$m-$tag-comm.txt"
    "$bin/perf" report -i "$out/$m.data" --no-children --sort comm,sym --stdio -g none 2>/dev/null |
      grep "%" | head -150 >"$out/$m-$tag-sym.txt"
    rm -f "$out/$m.data"
  done
done

scrape() { python3 "$(dirname "$0")/step_phases.py" scrape "http://127.0.0.1:$mport/metrics" "$1"; }
header=--header
for round in $(seq "${STEP_ROUNDS:-1}"); do
  for variant in ${STEP_VARIANTS:--}; do
    for lanes in ${STEP_LANES:-2 4 8}; do
      tag=lanes$lanes-$(tag_of "$variant")-r$round
      # shellcheck disable=SC2046
      start_attnd --step_lanes="$lanes" $(flags_of "$variant") || exit 1
      scrape "$out/$tag-m0.txt"
      "$bin/attn-bench" "${c[@]}" --sessions 64 --step_coding stub --duration_s 0.05 --warmup_s 0 \
        >/dev/null 2>&1
      scrape "$out/$tag-m1.txt"
      "$bin/attn-bench" "${c[@]}" --sessions 64 --step_coding stub --duration_s 2 \
        --csv "$out/lanes.csv" --label "$tag" >>"$out/lanes.txt" 2>&1
      scrape "$out/$tag-m2.txt"
      python3 "$(dirname "$0")/step_phases.py" diff "$out/$tag-m1.txt" "$out/$tag-m2.txt" "$tag" \
        $header --less "$out/$tag-m0.txt" "$out/$tag-m1.txt" >>"$out/phases.md"
      header=
      stop_attnd
    done
  done
done
head -12 "$out"/steps-*-comm.txt "$out"/echo-*-comm.txt 2>/dev/null  # none without a profile
cat "$out/phases.md"
