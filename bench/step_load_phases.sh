#!/usr/bin/env bash
# Many sessions' Steps under attnd flag variants: steps/s against an Echo of the same bytes
# (attn-bench --sessions N --step_coding stub: its Steps, then its Echo), and the step phases and
# mean tokens per launch of the measured part (bench/step_phases.py; the sessions' prefill taken
# out by a set-up-only run before it: stage and enqueue, where the prefill's copies weigh most,
# keep what the two prefills differ by, and can even come out negative).
#   . BUNDLE/env.sh && bench/step_load_phases.sh BUNDLE OUT_DIR
# BUNDLE: a gpu-bundle of attnd and attn-bench. VARIANTS: space-separated sets of comma-separated
# attnd flags, "-" for none (default: "- --max_step_delay_us=50 --max_step_delay_us=150");
# ROUNDS (default 2) repeats the list so that variants alternate; SESSIONS (default 64),
# LEVEL_S (default 2), BACKEND (default cuda). Writes OUT_DIR/steps.csv, OUT_DIR/phases.md, the scrapes and attnd logs.
set -uo pipefail
self_dir=$(cd "$(dirname "$0")" && pwd)
bin=$(cd "$1" && pwd)/bin
out=$2
mkdir -p "$out"
py=${PYTHON:-python3}
port=50071
mport=9471
c=(--target "127.0.0.1:$port" --mode decode --layers 1 --cache_tokens 4096 --heads 32 --kv_heads 8
   --head_dim 128 --dtype bf16 --sessions "${SESSIONS:-64}" --step_coding stub)
scrape() { "$py" "$self_dir/step_phases.py" scrape "http://127.0.0.1:$mport/metrics" "$1"; }
header=--header
for round in $(seq "${ROUNDS:-2}"); do
  for variant in ${VARIANTS:-- --max_step_delay_us=50 --max_step_delay_us=150}; do
    flags=()
    tag=default
    if [ "$variant" != - ]; then
      IFS=, read -r -a flags <<<"$variant"
      tag=${variant//[^a-z0-9]/_}
    fi
    tag=$tag-r$round
    "$bin/attnd" --listen=127.0.0.1:$port --metrics_listen=127.0.0.1:$mport --backend="${BACKEND:-cuda}" \
      --kv_cache_bytes=17179869184 "${flags[@]}" >"$out/attnd-$tag.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do grep -q 'serving attn.v1' "$out/attnd-$tag.log" && break; sleep 0.2; done
    scrape "$out/$tag-m0.txt"
    "$bin/attn-bench" "${c[@]}" --duration_s 0.05 --warmup_s 0 >/dev/null 2>&1
    scrape "$out/$tag-m1.txt"
    "$bin/attn-bench" "${c[@]}" --duration_s "${LEVEL_S:-2}" --warmup_s 0.5 --csv "$out/steps.csv" \
      --label "$tag" >>"$out/steps.txt" 2>&1
    scrape "$out/$tag-m2.txt"
    "$py" "$self_dir/step_phases.py" diff "$out/$tag-m1.txt" "$out/$tag-m2.txt" "$tag" $header \
      --less "$out/$tag-m0.txt" "$out/$tag-m1.txt" >>"$out/phases.md"
    header=
    kill -TERM "$pid"
    wait "$pid"
  done
done
cat "$out/phases.md"
