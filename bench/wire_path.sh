#!/usr/bin/env bash
# Attend's and Echo's wire paths against whole-message protobuf coding, in one run on one host:
# two attnds on loopback, one with the wire path (the default) and one with
# --attend_wire_path=false; for each request size and concurrency, and each client coding
# (attn-bench --client_coding: the client library's raw calls, or the generated stub):
#   echo-protobuf     Echo, protobuf coding at both ends (stub -> --attend_wire_path=false)
#   echo-wire         Echo, raw at both ends (client wire coding -> wire path): the transport's own
#   attend-protobuf   Attend, protobuf at both ends
#   attend-server     Attend, stub client -> wire-path server (the server's side alone)
#   attend-wire       Attend, wire coding at both ends
# and the raw TCP ceiling (attn-tcp-ceiling, run by attn-bench right after the attend-wire level)
# at the same sizes and concurrency. Prints a table of GB/s (request + response bytes) and ratios.
#   bench/wire_path.sh BIN OUT_DIR [seconds per level]
# BIN holds attnd, attnctl, attn-bench and attn-tcp-ceiling. Environment:
#   TOKENS   query (and key) tokens per request to sweep (default "256 2048 8192")
#   CONC     concurrency levels, one client connection each (default "1,16")
#   BACKEND  attnd --backend (default cuda)
#   ATTND_FLAGS  more attnd flags for both (e.g. --kv_cache_bytes=1073741824)
#   SHAPE    "long": q, k and v of one sequence of TOKENS tokens (default); "q": TOKENS queries
#            over one key (q and o carry the bytes, next to no compute: the transport alone on a
#            CPU backend)
set -uo pipefail
bin=$1; out=$2; secs=${3:-2}
tokens=${TOKENS:-256 2048 8192}
conc=${CONC:-1,16}
mkdir -p "$out"
: >"$out/attnd.log"
csv=$out/wire_path.csv
rm -f "$csv"
common=(--duration_s "$secs" --warmup_s 0.5 --heads 16 --head_dim 128 --dtype bf16
        --concurrency "$conc" --csv "$csv")

# shellcheck source=attnd_lib.sh
. "$(dirname "$0")/attnd_lib.sh"
server=(--backend=${BACKEND:-cuda} --pinned_pool_bytes=$((8 << 30)) --max_inflight_bytes=$((8 << 30)))
wire_port=50761; proto_port=50762
port=$wire_port; start_attnd "${server[@]}" || exit 1; wire_pid=$pid
port=$proto_port; start_attnd "${server[@]}" --attend_wire_path=false || exit 1; proto_pid=$pid
trap 'kill -TERM $wire_pid $proto_pid 2>/dev/null; wait' EXIT

bench() {  # label, port, attn-bench flags...
  local label=$1 port=$2; shift 2
  echo "== $label: attn-bench $*" | tee -a "$out/all.txt"
  "$bin/attn-bench" --target 127.0.0.1:$port "${common[@]}" --label "$label" "$@" 2>&1 |
    tee -a "$out/all.txt"
}

nproc | sed 's/^/cores: /' | tee -a "$out/all.txt"
for t in $tokens; do
  if [[ ${SHAPE:-long} == q ]]; then shape=(--seq "$t" --kv_seq 1); else shape=(--seq "$t"); fi
  bench "echo-protobuf t=$t" $proto_port --mode echo --client_coding protobuf "${shape[@]}" --tcp_ceiling_s 0
  bench "echo-wire t=$t" $wire_port --mode echo --client_coding wire "${shape[@]}" --tcp_ceiling_s 0
  bench "attend-protobuf t=$t" $proto_port --mode unary --client_coding protobuf "${shape[@]}" --tcp_ceiling_s 0
  bench "attend-server t=$t" $wire_port --mode unary --client_coding protobuf "${shape[@]}" --tcp_ceiling_s 0
  bench "attend-wire t=$t" $wire_port --mode unary --client_coding wire "${shape[@]}" --tcp_ceiling_s 1.5
done

# The table: one row per (tokens, concurrency), from the CSV's label, concurrency, gb_per_s and
# tcp_gb_per_s columns.
awk -F, '
  NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
  {
    label = $col["label"]; gsub(/"/, "", label)
    split(label, l, " t="); key = l[2] "," $col["concurrency"]
    gb[l[1], key] = $col["gb_per_s"]; rps[l[1], key] = $col["requests_per_s"]
    if ($col["tcp_gb_per_s"] != "") tcp[key] = $col["tcp_gb_per_s"]
    if (!(key in seen)) { seen[key] = 1; keys[++n] = key }
  }
  function r(a, b) { return (b > 0) ? sprintf("%.2f", a / b) : "-" }
  END {
    print "| tokens | clients | TCP GB/s | Echo protobuf | Echo wire | Attend protobuf | Attend server-wire | Attend wire | wire req/s | Attend wire / server-wire | Attend wire / protobuf | Attend wire / Echo wire | Echo wire / Echo protobuf | Attend wire / TCP | Echo wire / TCP |"
    print "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    for (i = 1; i <= n; ++i) {
      k = keys[i]; split(k, p, ",")
      ep = gb["echo-protobuf", k]; ew = gb["echo-wire", k]; ap = gb["attend-protobuf", k]
      as = gb["attend-server", k]; aw = gb["attend-wire", k]; c = tcp[k]
      printf "| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.1f | %s | %s | %s | %s | %s | %s |\n",
             p[1], p[2], c, ep, ew, ap, as, aw, rps["attend-wire", k], r(aw, as), r(aw, ap),
             r(aw, ew), r(ew, ep), r(aw, c), r(ew, c)
    }
  }' "$csv" | tee "$out/table.md" | tee -a "$out/all.txt"
